"""Host time of one eager call: what run() costs the CPU thread that launches it.

    python benchmarks/bench_host.py [--calls 200] [--rounds 15] [--out benchmarks/results/host-h200.json]

A decode step captured in a CUDA graph never pays this; an eager caller pays it every call,
and when it exceeds the kernel's time the GPU waits for the host. Each row times --calls
calls back to back with no synchronization inside (far fewer than the launch queue holds,
so the host never waits for the GPU), --rounds times, and reports the median per call
(kimi_experts.demo.eager_host_us, which the demo's one round uses too):
- PersistentExperts.run at k3-tp8, B = 1 and 64, the stream left to the library (PyTorch's
  current stream) and given as an int handle;
- WsGemm.run at N = 4096, K = 7168, M = 1;
- how run() finds PyTorch's current stream (torch_current_stream) beside the public
  torch.cuda.current_stream(), and the PyTorch calls an import of a torch tensor makes:
  __dlpack_device__(), and __dlpack__() with the current stream's handle and with -1
  (DLPack's "no synchronization").
Writes JSON (top level: date, git commit, command, gpu; rows: what, us) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, random_mxfp4_layer, routed_ids, write_json  # noqa: E402

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host-h200.json")
K3_TP8 = dict(hidden=3584, inter=384, experts=384, top_k=16)
GEMM_NK = (4096, 7168)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls a round (default 200)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (default 15)")
    parser.add_argument("--out", default=RECORD, help=f"JSON output (default {RECORD})")
    args = parser.parse_args()
    if not 1 <= args.calls <= 500 or args.rounds < 1:
        parser.error("--calls: 1..500 (the launch queue must not fill); --rounds: >= 1")

    import torch
    import kimi_experts as kx
    from kimi_experts._util import torch_current_stream
    from kimi_experts.demo import eager_host_us

    if not torch.cuda.is_available():
        print("bench_host: no CUDA device; nothing to time")
        return 1

    def timed(fn) -> float:
        fn()  # the first call (lazy set-up) stays out of the timing
        return eager_host_us(torch, fn, args.calls, args.rounds)

    gen, gen_cpu = torch.Generator(device="cuda").manual_seed(0), torch.Generator().manual_seed(0)
    s = K3_TP8
    w13, s13, w2, s2 = random_mxfp4_layer(torch, s["experts"], s["hidden"], s["inter"], seed=0)
    moe = kx.PersistentExperts(w13, s13, w2, s2, top_k=s["top_k"], hidden_scale="floor")
    buffers = kx.scratch(moe)
    rows = []
    for batch in (1, 64):
        x = torch.randn(batch, s["hidden"], device="cuda", generator=gen).to(torch.bfloat16)
        ids = routed_ids(torch, gen_cpu, batch, s["top_k"], s["experts"]).cuda()
        out = torch.empty(batch * s["top_k"], s["hidden"], dtype=torch.bfloat16, device="cuda")
        moe.prepare(batch, buffers, out)
        handle = torch.cuda.current_stream().cuda_stream
        rows.append({"what": f"PersistentExperts.run k3-tp8 B={batch}",
                     "us": timed(lambda: moe.run(x, ids))})
        rows.append({"what": f"PersistentExperts.run k3-tp8 B={batch}, stream=int",
                     "us": timed(lambda: moe.run(x, ids, stream=handle))})

    n, k = GEMM_NK
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
    gemm = kx.WsGemm(w)
    xg = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    yg = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    gemm.prepare(1, yg)
    rows.append({"what": f"WsGemm.run N={n} K={k} M=1", "us": timed(lambda: gemm.run(xg))})

    handle = torch.cuda.current_stream().cuda_stream or 1  # DLPack spells the legacy default 1
    rows.append({"what": "torch.cuda.current_stream()", "us": timed(torch.cuda.current_stream)})
    rows.append({"what": "kimi_experts._util.torch_current_stream(x)",
                 "us": timed(lambda: torch_current_stream(x))})
    rows.append({"what": "x.__dlpack_device__()", "us": timed(x.__dlpack_device__)})
    rows.append({"what": "x.__dlpack__(stream=current)",
                 "us": timed(lambda: x.__dlpack__(stream=handle, max_version=(1, 0)))})
    rows.append({"what": "x.__dlpack__(stream=-1)",
                 "us": timed(lambda: x.__dlpack__(stream=-1, max_version=(1, 0)))})

    write_json(args.out, rows, calls=args.calls, rounds=args.rounds, torch=torch.__version__,
               kimi_experts=os.path.dirname(kx.__file__))
    print(f"kimi_experts from {os.path.dirname(kx.__file__)}; host time per call, median of "
          f"{args.rounds} rounds of {args.calls} calls; written to {args.out}")
    print_table(rows, ["what", "us"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
