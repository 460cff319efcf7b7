"""kimi_experts beside the peers of SPEC 8 on the routed experts (k3-tp8 by default).

    python benchmarks/peers.py [--batches 1,2,4,8,16,32,64] [--calls 10] [--out benchmarks/results/peers-h200.json]

- kimi_experts: bench_experts.py's method in the same run (a CUDA graph of 8 layers' calls over 8
  weight sets, 60 replays, median / 8).
- torch: the plain-PyTorch implementation of SPEC 3, the library's own reference
  (kimi_experts.reference.moe_reference) on the GPU in float32, weights kept as MXFP4 and
  dequantized for the routed experts at every call, as a plain implementation that stores
  FP4 must; "torch, fp32 weights" the same with each expert's weights dequantized once and kept
  (8x the bytes in memory). Its routing is Python over the distinct experts (no CUDA graph can
  hold it), so it is timed eagerly with CUDA events: the median of --calls calls after two, on
  one layer.
- flashinfer, vllm, triton_kernels: each is timed only where this script has an adapter for it
  and the package imports; otherwise its row says why it was skipped. None is committed here
  (SPEC 8); none has an adapter yet, because no machine this project runs on has any of them
  (the GPU machine has no network, and vLLM's wheel is too large to carry there).
floor_us is the distinct routed experts' weight bytes over the HBM read bandwidth measured in
this run; TBps = those bytes / us (the effective weight bandwidth); ratio = us / floor_us;
vs_kimi = us / kimi_experts' us at the same B. Writes JSON, prints a table.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_experts import BATCHES, SHAPES, bench_shape  # noqa: E402
from common import (measure_hbm_read_bandwidth, parse_batches, print_table, random_mxfp4_layer,  # noqa: E402
                    routed_ids, write_json)

# SPEC 8's peers that need a package: (name, module to import, what it would run)
PACKAGED = [
    ("flashinfer", "flashinfer", "CUTLASS fused MoE, MXFP4 weights, bf16 activations"),
    ("vllm", "vllm", "fused_marlin_moe (MXFP4 w4a16) and the Triton fused_moe"),
    ("triton_kernels", "triton_kernels", "matmul_ogs with MXFP4 weights upcast on Hopper"),
]


def time_torch(torch, ref, layer, shape, batches, calls, hbm, keep_weights):
    """The plain-PyTorch peer, eager: median of `calls` calls after two, per B; keep_weights: each
    expert's dequantized weights kept between calls (the reference's cache)."""
    name = "torch, fp32 weights" if keep_weights else "torch"
    w13, s13, w2, s2 = layer
    cache = {} if keep_weights else None
    per_expert = sum(t[0].numel() for t in layer)  # bytes of one expert, FP4 + scales
    rows = []
    for B in batches:
        x = torch.randn(B, shape["H"], device="cuda").to(torch.bfloat16)
        ids = routed_ids(torch, torch.Generator().manual_seed(B), B, shape["top_k"], shape["E"]).cuda()

        def call():
            return ref.moe_reference(w13, s13, w2, s2, x, ids, hidden_scale=shape["hidden_scale"],
                                     dtype=torch.float32, cache=cache)

        for _ in range(2):
            call()
        times = []
        for _ in range(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        distinct = int(torch.unique(ids).numel())
        us = statistics.median(times)
        floor_us = distinct * per_expert / (hbm * 1e12) * 1e6
        rows.append(dict(peer=name, B=B, distinct_experts=distinct, us=us, TBps=distinct * per_expert / us / 1e6,
                         floor_us=floor_us, ratio=us / floor_us))
        print(f"  {name} B={B}: {us:.1f} us, floor {floor_us:.2f} us, ratio {us / floor_us:.1f}", flush=True)
    return rows


def packaged_peers():
    """SPEC 8's packaged peers, each with why it was not timed."""
    skipped = []
    for name, module, what in PACKAGED:
        try:
            importlib.import_module(module)
            reason = "imports, but this script has no adapter for it yet"
        except Exception as e:  # any import failure is a reason to skip, and is reported
            reason = f"not importable ({type(e).__name__}: {e})"
        skipped.append(dict(peer=name, runs=what, skipped=reason))
        print(f"  {name}: skipped, {reason}", flush=True)
    return skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="k3-tp8", choices=sorted(SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--calls", type=int, default=10, help="timed eager calls of each eager peer (median)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "peers-h200.json"))
    args = ap.parse_args()
    batches = parse_batches(ap, args.batches)
    if args.calls < 3:
        ap.error("--calls: at least 3 (the median of several calls is the figure)")

    import torch
    import kimi_experts as kx
    from kimi_experts import reference as ref

    if not kx.cuda_available():
        sys.exit(f"no usable GPU: {kx.backend_info()['reason']}")
    shape = SHAPES[args.shape]
    hbm = measure_hbm_read_bandwidth()
    print(f"HBM read bandwidth: {hbm:.3f} TB/s (probe_read over 4 GiB)", flush=True)

    print("kimi_experts:", flush=True)
    ours = bench_shape(torch, kx, args.shape, shape, batches, layers=8, replays=60, hbm=hbm)
    rows = [dict(peer="kimi_experts", B=r["B"], distinct_experts=r["distinct_experts"], us=r["us"],
                 TBps=r["TBps"], floor_us=r["floor_us"], ratio=r["ratio"]) for r in ours]
    print("torch (the reference, float32, on the GPU):", flush=True)
    layer = random_mxfp4_layer(torch, shape["E"], shape["H"], shape["I"], seed=1000)
    for keep_weights in (False, True):
        rows += time_torch(torch, ref, layer, shape, batches, args.calls, hbm, keep_weights)
    print("packaged peers:", flush=True)
    skipped = packaged_peers()

    kimi_us = {r["B"]: r["us"] for r in rows if r["peer"] == "kimi_experts"}
    for r in rows:
        r["vs_kimi"] = r["us"] / kimi_us[r["B"]]
    write_json(args.out, rows, shape=args.shape, hbm_read_TBps=hbm, calls=args.calls, skipped=skipped)
    print(f"results: {args.out}\n")
    print_table(rows, ["peer", "B", "distinct_experts", "us", "floor_us", "ratio", "vs_kimi"])


if __name__ == "__main__":
    main()
