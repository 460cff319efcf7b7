"""The main job: one Kimi-K3 TP8-shaped MoE layer, run, checked and timed.

    python -m kimi_experts.demo [--batch 1] [--device auto|cpu|cuda] [--iters N]

Shape "k3-tp8": H=3584, I=384, E=384, top_k=16, hidden_scale="floor", SiTU caps 4/25.
Synthetic MXFP4 weights (random e2m1 codes under scales near 2^-7, so weights are
~0.02 like a trained layer's) and bf16 activations ~ N(0, 1); each token routes to
top_k distinct experts. The layer runs on the GPU when kimi_experts.cuda_available()
and PyTorch sees the device, else on the C CPU backend. The result is checked against
kimi_experts.reference (PyTorch, float64) when PyTorch is importable, else against a
NumPy recomputation of a few rows; then the median time per call and the effective
weight bandwidth (bytes of the distinct experts' weights + scales / time) are printed.
On the GPU a call is timed as serving runs it, replayed from a CUDA graph (of 10 calls),
and the host time of one eager run() call is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import kimi_experts as kx

SHAPE = dict(H=3584, I=384, E=384, top_k=16, hidden_scale="floor", beta=4.0, linear_beta=25.0)
# Relative Frobenius error allowed against the float64 reference: MXFP8 re-quantization
# of h can flip rare elements by one e4m3 step (tests/shapes.py MOE_RTOL says why). With
# PyTorch, every element must also lie in the reference's lawful range (reference.bf16_range).
RTOL = 2e-2
# Scale bytes 2^-8 .. 2^-6 around 2^-7: random e2m1 codes (rms ~2.9) become weights ~0.02.
SCALE_BYTES = (119, 120, 121)
BLOCK = 32


def make_weights(rng: np.random.Generator, E: int, H: int, I: int):
    """Random MXFP4 weights in the standard layout (SPEC 3): any byte is a valid pair
    of e2m1 codes, and the scales keep the dequantized weights near 0.02."""

    def fp4(*shape):
        return rng.integers(0, 256, size=shape, dtype=np.uint8)

    def scales(*shape):
        return rng.choice(np.array(SCALE_BYTES, np.uint8), size=shape)

    w13, s13 = fp4(E, 2 * I, H // 2), scales(E, 2 * I, H // BLOCK)
    w2, s2 = fp4(E, H, I // 2), scales(E, H, I // BLOCK)
    return w13, s13, w2, s2


def expert_bytes(H: int, I: int) -> int:
    """FP4 bytes + scale bytes of one expert (w13, s13, w2, s2)."""
    return 2 * I * H // 2 + 2 * I * H // BLOCK + H * I // 2 + H * I // BLOCK


def pick_device(requested: str):
    """("cuda", torch) or ("cpu", torch or None), with a printed reason."""
    try:
        import torch
    except ImportError:
        torch = None
    info = kx.backend_info()
    if requested == "cpu":
        return "cpu", torch, "requested"
    if not info["cuda_available"]:
        why = info["reason"]
        if requested == "cuda":
            sys.exit(f"--device cuda: CUDA is not available ({why})")
        return "cpu", torch, f"CUDA not available: {why}"
    if torch is None or not torch.cuda.is_available():
        why = "PyTorch is not installed" if torch is None else "PyTorch sees no CUDA device"
        if requested == "cuda":
            sys.exit(f"--device cuda: the demo moves tensors with PyTorch, and {why}")
        return "cpu", torch, f"{why} (the demo uses it for CUDA tensors)"
    return "cuda", torch, f"{info['device']}"


def numpy_check(w13, s13, w2, s2, x_bits, ids, out_bits, rows, s):
    """SPEC 3 for a few (token, slot) rows in NumPy float64, with the library's own
    format helpers (themselves checked bit for bit in tests/test_formats.py)."""
    I, K = s["I"], s["top_k"]

    def cap(v, c):
        return v if np.isinf(c) else c * np.tanh(v / c)

    x = kx.bf16_to_float32(x_bits)
    got = kx.bf16_to_float32(out_bits).astype(np.float64)
    num = den = 0.0
    for r in rows:
        t, j = divmod(r, K)
        e = int(ids[t, j])
        xq = kx.dequantize(*kx.quantize_mxfp8(x[t:t + 1]), "mxfp8")[0].astype(np.float64)
        a = kx.dequantize(w13[e], s13[e], "mxfp4").astype(np.float64) @ xq
        g = cap(a[:I], s["beta"])
        h = (g / (1 + np.exp(-g)) * cap(a[I:], s["linear_beta"])).astype(np.float32)
        hq = kx.dequantize(*kx.quantize_mxfp8(h[None], s["hidden_scale"]), "mxfp8")[0]
        want = kx.dequantize(w2[e], s2[e], "mxfp4").astype(np.float64) @ hq.astype(np.float64)
        num += float(np.sum((got[r] - want) ** 2))
        den += float(np.sum(want ** 2))
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


GRAPH_CALLS = 10


def capture_calls(torch, fn, calls: int):
    """A CUDA graph of ``calls`` back-to-back fn() (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def eager_host_us(torch, fn, calls: int = 100, rounds: int = 1) -> float:
    """Host time of one eager fn() in microseconds, the median over ``rounds`` of ``calls``
    back to back: fewer than the launch queue holds, so the CPU thread never waits for the
    GPU (benchmarks/bench_host.py uses it too)."""
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_experts.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="tokens per call (default 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--iters", type=int, default=0,
                   help="timed graph replays on the GPU (default 50), calls on the CPU (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the reference check")
    args = p.parse_args(argv)
    s = SHAPE
    H, I, E, K, B = s["H"], s["I"], s["E"], s["top_k"], args.batch
    if B < 1:
        p.error("--batch must be >= 1")
    if args.iters < 0:
        p.error("--iters must be >= 0 (0: the default)")

    device, torch, why = pick_device(args.device)
    info = kx.backend_info()
    print(f"kimi_experts {kx.__version__}: {info['build']}")
    print(f"device: {device} ({why})")
    print(f"layer k3-tp8: H={H} I={I} E={E} top_k={K} hidden_scale={s['hidden_scale']} "
          f"beta={s['beta']} linear_beta={s['linear_beta']}; batch={B}")

    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    w13, s13, w2, s2 = make_weights(rng, E, H, I)
    x_bits = kx.float32_to_bf16(rng.standard_normal((B, H), dtype=np.float32))
    ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(B)]).astype(np.int32)
    total = sum(a.nbytes for a in (w13, s13, w2, s2))
    print(f"weights: {total / 2**20:.0f} MiB of MXFP4 + scales, made in "
          f"{time.perf_counter() - t0:.1f} s")

    # ---- plan once -----------------------------------------------------------------
    if device == "cuda":
        dev = torch.device("cuda")
        weights = [torch.from_numpy(a).to(dev) for a in (w13, s13, w2, s2)]
        x = torch.from_numpy(x_bits.view(np.int16)).view(torch.bfloat16).to(dev)
        ids_t = torch.from_numpy(ids).to(dev)
        out = torch.empty((B * K, H), dtype=torch.bfloat16, device=dev)
    else:
        weights = [w13, s13, w2, s2]
        x, ids_t = kx.as_bfloat16(x_bits), ids
        out_bits = np.empty((B * K, H), np.uint16)
        out = kx.as_bfloat16(out_bits)
    moe = kx.PersistentExperts(*weights, top_k=K, beta=s["beta"], linear_beta=s["linear_beta"],
                               hidden_scale=s["hidden_scale"])
    buffers = kx.scratch(moe)
    moe.prepare(B, buffers, out)
    if moe.packed_bytes:
        print(f"packed kernel-layout copy: {moe.packed_bytes / 2**20:.0f} MiB; "
              f"scratch: {buffers.nbytes / 2**10:.0f} KiB")

    # ---- run and check ---------------------------------------------------------------
    moe.run(x, ids_t, validate=True)
    if device == "cuda":
        out_bits = out.view(torch.int16).cpu().numpy().view(np.uint16)
    n_nan = int(np.isnan(kx.bf16_to_float32(out_bits)).sum())
    ok = n_nan == 0
    if args.no_check:
        print("check: skipped (--no-check)")
    elif torch is not None:
        from kimi_experts import reference as ref

        want, slack = ref.moe_reference(*(torch.from_numpy(a) for a in (w13, s13, w2, s2)),
                                        torch.from_numpy(x_bits.view(np.int16)).view(torch.bfloat16),
                                        torch.from_numpy(ids), beta=s["beta"],
                                        linear_beta=s["linear_beta"], hidden_scale=s["hidden_scale"],
                                        dtype=torch.float64, slack=True)
        got = torch.from_numpy(kx.bf16_to_float32(out_bits)).double()
        err = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()
        lo, hi = ref.bf16_range(want, slack)
        outside = int((~((got >= lo) & (got <= hi))).sum())
        ok = ok and err < RTOL and outside == 0
        print(f"check vs kimi_experts.reference (PyTorch float64, all {B * K} rows): "
              f"relative error {err:.2e} (limit {RTOL:g}), elements outside the lawful range "
              f"{outside}, NaN {n_nan}: {'OK' if ok else 'FAILED'}")
    else:
        rows = sorted({0, B * K - 1, (B * K) // 2})
        err = numpy_check(w13, s13, w2, s2, x_bits, ids, out_bits, rows, s)
        ok = ok and err < RTOL
        print("note: PyTorch is not installed, so kimi_experts.reference cannot run; "
              f"checked rows {rows} against a NumPy recomputation instead")
        print(f"check (NumPy float64, {len(rows)} rows): relative error {err:.2e} "
              f"(limit {RTOL:g}), NaN {n_nan}: {'OK' if ok else 'FAILED'}")

    # ---- time ------------------------------------------------------------------------
    iters = args.iters or (50 if device == "cuda" else 5)
    times = []
    if device == "cuda":
        graph = capture_calls(torch, lambda: moe.run(x, ids_t), GRAPH_CALLS)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / GRAPH_CALLS)
        host_us = eager_host_us(torch, lambda: moe.run(x, ids_t))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            moe.run(x, ids_t)
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    distinct = len(np.unique(ids))
    nbytes = distinct * expert_bytes(H, I)
    how = (f"CUDA graph of {GRAPH_CALLS} calls, median of {iters} replays" if device == "cuda"
           else f"median of {iters}")
    print(f"time per call: {t * 1e6:,.1f} us ({how}); {distinct} distinct experts "
          f"= {nbytes / 1e6:.1f} MB of weights + scales -> {nbytes / t / 1e9:,.1f} GB/s "
          "effective weight bandwidth")
    if device == "cuda":
        print(f"host time of one eager run() call: {host_us:,.1f} us (what a caller outside a "
              "CUDA graph pays on its CPU thread)")
        print("note: repeated calls may be served from L2 (50 MB on H200); "
              "benchmarks/bench_experts.py rotates weights across layers for the HBM number")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
