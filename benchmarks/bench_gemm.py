"""WsGemm (SPEC 4) on the GPU beside cuBLAS and the HBM floor.

    python benchmarks/bench_gemm.py [--replays 60] [--warmup-ms 0] [--out benchmarks/results/gemm-h200.json]

For (N, K) in (1024, 7168), (4096, 7168), (7168, 2048) and M in 1, 4, 8, 16, 32, 64:
- us: one WsGemm, timed as a CUDA graph of 8 GEMMs over 8 weight copies (so L2 cannot serve
  the weights) replayed --replays times, median / 8. Consecutive GEMMs in the graph are
  programmatic dependents, so each one's weight prefetch overlaps its predecessor's tail.
- us_nopdl: the same with programmatic dependent launch off (KIMI_EXPERTS_PDL=0 at configure).
- cublas_us: torch.nn.functional.linear (cuBLAS) on the same 8 copies, same graph method.
- floor_us: weight bytes / HBM read bandwidth (probe_read over 4 GiB, measured in this run).
- TBps: weight bytes / us.  max_err: max |y - ref| / (|ref| + 2^-8 * rms(ref)) vs fp32.
- --warmup-ms T: each of those graphs replays for T ms more before it is timed (a card under
  sustained load, whose power cap may have lowered the SM clock; a study, not the record).
- board_W, sm_MHz, power_capped (cublas_...: the same for cuBLAS): the board's median power and
  SM clock over the timed replays, and the share of ~2 ms samples with the power cap among the
  clock event reasons (board.py, NVML; refreshed about every 100 ms, so these short rows read
  the state the run left the board in); absent without NVML.
Then a chain: 8 (predecessor -> WsGemm N=4096, K=7168) pairs a graph with the GEMMs'
programmatic dependent launch on and off, for a WsGemm predecessor (which lets its dependents
start at once) and a plain torch kernel (which does not): hidden_us, the difference, is how much
of the GEMM's time (its weight load) the dependent launch hides behind the predecessor. Also
checks that results are bit-identical across batch sizes. Writes JSON (top level: date, git
commit, command, gpu, hbm_read_TBps; rows: N, K, M, us, cublas_us, TBps, floor_us, ...) and
prints a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from board import Board  # noqa: E402
from common import (graph_replay_time_us, measure_hbm_read_bandwidth, print_table,  # noqa: E402
                    refuse_study_over_record, write_json)

SHAPES = [(1024, 7168), (4096, 7168), (7168, 2048)]
MS = [1, 4, 8, 16, 32, 64]
COPIES = 8
CHAIN_SHAPE = (4096, 7168)
CHAIN_PRED_SHAPE = (128, 28672)  # few CTAs, ~8 us: a predecessor that leaves most SMs free


@contextlib.contextmanager
def env_var(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def make_gemms(kx, weights, m, outs, pdl: bool):
    """WsGemm objects over `weights`, prepared for m rows into `outs` (PDL off via the env)."""
    with env_var("KIMI_EXPERTS_PDL", None if pdl else "0"):
        gemms = [kx.WsGemm(w) for w in weights]
        for g, o in zip(gemms, outs):
            g.prepare(m, o)
    return gemms


def run_all(gemms, x):
    import torch
    stream = torch.cuda.current_stream()
    for g in gemms:
        g.run(x, stream=stream)


def max_err(y, ref):
    """max |y - ref| / (|ref| + 2^-8 rms(ref)): ~2^-9 for a correctly rounded bf16 result."""
    ref = ref.float()
    scale = ref.abs() + ref.pow(2).mean().sqrt() / 256
    return ((y.float() - ref).abs() / scale).max().item()


def bench_shape(kx, torch, n, k, replays, hbm_TBps, warmup_ms=0.0, board=None):
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(1000 * n + k)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
               for _ in range(COPIES)]
    wbytes = 2 * n * k
    rows = []
    for m in MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        gemms = make_gemms(kx, weights, m, outs, pdl=True)
        gemms_nopdl = make_gemms(kx, weights, m, outs, pdl=False)

        run_all(gemms, x)
        torch.cuda.synchronize()
        ref = x.float() @ weights[0].float().t()
        err = max_err(outs[0], ref)
        cub_err = max_err(F.linear(x, weights[0]), ref)

        us = graph_replay_time_us(lambda: run_all(gemms, x), replays, warmup_ms=warmup_ms, board=board) / COPIES
        state = dict(board.reading) if board else {}
        us_nopdl = graph_replay_time_us(lambda: run_all(gemms_nopdl, x), replays, warmup_ms=warmup_ms) / COPIES
        cublas_us = graph_replay_time_us(lambda: [F.linear(x, w) for w in weights], replays,
                                         warmup_ms=warmup_ms, board=board) / COPIES
        if board:
            state.update({f"cublas_{key}": value for key, value in board.reading.items()})
        floor_us = wbytes / (hbm_TBps * 1e12) * 1e6
        rows.append({
            "N": n, "K": k, "M": m, "us": us, "us_nopdl": us_nopdl, "cublas_us": cublas_us,
            "TBps": wbytes / (us * 1e-6) / 1e12, "cublas_TBps": wbytes / (cublas_us * 1e-6) / 1e12,
            "floor_us": floor_us, "vs_floor": us / floor_us, "vs_cublas": us / cublas_us,
            "max_err": err, "cublas_max_err": cub_err, "ok": bool(err < 2 ** -7), **state,
        })
        print(f"  N={n} K={k} M={m}: {us:.2f} us (no PDL {us_nopdl:.2f}), cuBLAS {cublas_us:.2f} us,"
              f" floor {floor_us:.2f} us, err {err:.2e}", flush=True)
        del gemms, gemms_nopdl
    return rows


def batch_invariance(kx, torch, n, k):
    """Token rows must come out bit-identical whatever the batch they run in."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(64, k, device="cuda", generator=gen).to(torch.bfloat16)
    full = torch.empty(64, n, device="cuda", dtype=torch.bfloat16)
    g = kx.WsGemm(w)
    g.prepare(64, full)
    g.run(x)
    same = True
    for m, row0 in [(1, 0), (1, 37), (9, 5), (16, 48), (33, 31)]:
        part = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        gp = kx.WsGemm(w)
        gp.prepare(m, part)
        gp.run(x[row0:row0 + m].contiguous())
        torch.cuda.synchronize()
        same = same and torch.equal(part.view(torch.int16), full[row0:row0 + m].view(torch.int16))
    again = torch.empty_like(full)
    g2 = kx.WsGemm(w)
    g2.prepare(64, again)
    g2.run(x)
    torch.cuda.synchronize()
    same = same and torch.equal(again.view(torch.int16), full.view(torch.int16))
    return bool(same)


def chain(kx, torch, replays):
    """8 (predecessor -> WsGemm N=4096, K=7168) pairs a graph, per pair, with the GEMMs'
    programmatic dependent launch on (pair_us) and off (pair_nopdl_us); the predecessors launch
    alike in both. hidden_us = pair_nopdl_us - pair_us: the part of the GEMM's time that its early
    start (the weights it requests before its wait) hides behind the predecessor. pred_us and
    gemm_us: each kind alone, 8 a graph, the GEMMs without PDL (a GEMM that overlaps nothing);
    added_us = pair_us - pred_us: what the GEMM adds to its predecessor's time."""
    n, k = CHAIN_SHAPE
    pn, pk = CHAIN_PRED_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(11)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
               for _ in range(COPIES)]
    pweights = [(torch.randn(pn, pk, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
                for _ in range(COPIES)]
    a = torch.randn(8 << 20, device="cuda")  # 32 MB: a torch kernel of known duration
    b = torch.empty_like(a)
    stream = torch.cuda.current_stream
    rows = []
    for m in (1, 64):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        px = torch.randn(m, pk, device="cuda", generator=gen).to(torch.bfloat16)
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        pouts = [torch.empty(m, pn, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        gemms = {pdl: make_gemms(kx, weights, m, outs, pdl) for pdl in (True, False)}
        preds = make_gemms(kx, pweights, m, pouts, pdl=True)

        def torch_pred(i):
            torch.add(a, 1.0, out=b)

        def wsgemm_pred(i):
            preds[i].run(px, stream=stream())

        t_gemm = graph_replay_time_us(lambda: run_all(gemms[False], x), replays) / COPIES
        for name, pred in (("WsGemm N=128 K=28672", wsgemm_pred), ("torch add 32 MB", torch_pred)):
            t_pred = graph_replay_time_us(lambda: [pred(i) for i in range(COPIES)], replays) / COPIES

            def pairs(pdl):
                for i in range(COPIES):
                    pred(i)
                    gemms[pdl][i].run(x, stream=stream())

            t_pair = {pdl: graph_replay_time_us(lambda: pairs(pdl), replays) / COPIES
                      for pdl in (True, False)}
            rows.append({"predecessor": name, "M": m, "pred_us": t_pred, "gemm_us": t_gemm,
                         "pair_us": t_pair[True], "pair_nopdl_us": t_pair[False],
                         "hidden_us": t_pair[False] - t_pair[True], "added_us": t_pair[True] - t_pred})
        del gemms, preds
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    record = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gemm-h200.json")
    parser.add_argument("--replays", type=int, default=60)
    parser.add_argument("--warmup-ms", type=float, default=0.0,
                        help="replay each graph this long before timing it (sustained load; a study)")
    parser.add_argument("--out", default=record)
    parser.add_argument("--no-chain", action="store_true")
    args = parser.parse_args()
    if args.replays < 50:
        parser.error("--replays: use at least 50 (the median of many replays is the figure)")
    if args.warmup_ms < 0:
        parser.error("--warmup-ms: at least 0")
    refuse_study_over_record(parser, "--warmup-ms", args.warmup_ms > 0, args.out, record)
    refuse_study_over_record(parser, "--no-chain", args.no_chain, args.out, record)

    import torch
    import kimi_experts as kx

    if not kx.cuda_available():
        sys.exit(f"bench_gemm: needs the CUDA backend: {kx.backend_info().get('reason')}")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    hbm = measure_hbm_read_bandwidth()
    print(f"HBM read (probe_read, 4 GiB): {hbm:.3f} TB/s", flush=True)
    board = Board.open()
    if board is None:
        print("NVML not available: rows without the board's power state", flush=True)
    rows = []
    for n, k in SHAPES:
        rows += bench_shape(kx, torch, n, k, args.replays, hbm, args.warmup_ms, board)
        torch.cuda.empty_cache()
    invariant = batch_invariance(kx, torch, *CHAIN_SHAPE)
    chain_rows = [] if args.no_chain else chain(kx, torch, args.replays)

    write_json(args.out, rows, hbm_read_TBps=hbm, copies=COPIES, replays=args.replays, warmup_ms=args.warmup_ms,
               torch=torch.__version__, batch_invariant=invariant, chain=chain_rows)
    if chain_rows:
        print("\nchain (per pair; hidden = pair with the GEMM's PDL off - pair with it on):")
        print_table(chain_rows, ["predecessor", "M", "pred_us", "gemm_us", "pair_us", "pair_nopdl_us",
                                 "hidden_us", "added_us"])
    print(f"\nbatch-invariant (bit-identical rows across M): {invariant}")
    print(f"results: {args.out}\n")
    print_table(rows, ["N", "K", "M", "us", "us_nopdl", "cublas_us", "floor_us", "TBps",
                       "vs_cublas", "vs_floor", "max_err", "sm_MHz", "power_capped", "cublas_power_capped"])
    if not all(r["ok"] for r in rows) or not invariant:
        sys.exit("bench_gemm: a correctness check failed (see max_err / batch-invariant)")


if __name__ == "__main__":
    main()
