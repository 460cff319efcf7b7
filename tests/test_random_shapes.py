"""Random legal shapes on both backends (SPEC 3 and 4: "any other legal shape"). Each case
draws its shape, settings, batch, strides and inputs from its own seed (printed in every
assert message), runs twice on poisoned outputs (bit-identical, every element written, no
byte outside the views touched) and checks against the float64 reference. The GPU cases
reach the kernels' edges (E up to 4096, top_k up to 32, batches past one launch, H, I, N
and K far from the model tiles); the CPU cases are smaller so that CI stays quick."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gemm_check import abs_products, assert_gemm_close, make_gemm_inputs, neg_zero_count, want_for
from moe_check import Layer, bitwise_equal, check_close, row_strided
from shapes import (count_bits, make_ids, make_route_weights, make_weights, make_x, make_x_varied,
                    poison_, seed_of, strided_rows)

OUTSIDE = 0x2345  # bf16 bits of the bytes around an output view; a finite value never written
OUTSIDE_F32 = OUTSIDE << 16 | OUTSIDE  # the same bytes around a float32 view

# Per backend: how many cases, and the largest draws (B and E log-uniform). H and I are drawn
# under what E leaves: a layer holds at most `weights` FP4 weights (E x H x I) and the
# reference, which keeps each expert a batch uses dequantized in float64, at most
# `ref_weights` (3 x H x I an expert).
BACKENDS = {
    "cpu": dict(cases=30, h_units=24, i_units=16, max_b=24, weights=2**24, ref_weights=2**22,
                gemm_cases=30, max_m=70, max_n=600, k_units=24),
    "cuda": dict(cases=60, h_units=112, i_units=96, max_b=200, weights=2**30, ref_weights=2**28,
                 gemm_cases=40, max_m=200, max_n=9000, k_units=160),
}


def _cap(r: random.Random) -> float:
    return r.choice([math.inf, round(r.uniform(0.25, 30.0), 3)])


def moe_case(seed: int, lim: dict) -> dict:
    r = random.Random(seed)
    top_k, B = r.randint(1, 32), max(1, round(2 ** r.uniform(0, math.log2(lim["max_b"]))))
    E = max(1, round(2 ** r.uniform(0, 12)))

    def room(e):  # the largest H x I that E = e leaves
        return min(lim["weights"] // e, lim["ref_weights"] // (3 * min(e, B * top_k)))

    while room(E) < 64 * 32:
        E //= 2
    h = r.randint(1, min(lim["h_units"], room(E) // (64 * 32)))
    i = r.randint(1, min(lim["i_units"], room(E) // (64 * 32 * h)))
    H, I = 64 * h, 32 * i
    return dict(name=f"random-{seed}", H=H, I=I, E=E, top_k=top_k, B=B,
                hidden_scale=r.choice(["rceil", "floor"]), beta=_cap(r), linear_beta=_cap(r),
                combine=r.random() < 0.5, varied=r.random() < 0.5,
                x_pad=r.choice([0, 0, 64, 200]), out_pad=r.choice([0, 0, 32, 96]))


def run_moe_case(kx, case: dict, device: str):
    what = (f"{case['name']}: H={case['H']} I={case['I']} E={case['E']} top_k={case['top_k']} "
            f"B={case['B']} {case['hidden_scale']} beta={case['beta']} linear_beta={case['linear_beta']} "
            f"combine={case['combine']} x_pad={case['x_pad']} out_pad={case['out_pad']}")
    seed, B, H = seed_of("random-moe", case["name"]), case["B"], case["H"]
    weights = tuple(t.to(device) for t in make_weights(case, seed))
    layer = Layer(kx, case, weights, beta=case["beta"], linear_beta=case["linear_beta"])
    x = (make_x_varied if case["varied"] else make_x)(B, H, seed)
    xv = row_strided(x.to(device), case["x_pad"], 1.0)
    ids = make_ids(B, case["top_k"], case["E"], seed).to(device)
    rw = make_route_weights(B, case["top_k"], seed).to(device) if case["combine"] else None
    rows = B if case["combine"] else B * case["top_k"]
    buf, out = strided_rows(rows, H, case["out_pad"], torch.bfloat16, device, OUTSIDE)
    layer.moe.prepare(B, kx.scratch(layer.moe), out, combine=case["combine"])
    results = []
    for attempt in range(2):
        poison_(out)
        layer.run(x.to(device) if attempt else xv, ids, rw, out=out, prepare=False)
        results.append(out.clone())
    if device == "cuda":
        torch.cuda.synchronize()
    assert count_bits(buf, OUTSIDE) == rows * case["out_pad"], f"{what}: bytes outside out changed"
    assert bitwise_equal(results[0], results[1]), f"{what}: two runs (strided and plain x) differ"
    check_close(results[0], layer.reference(x.to(device), ids, rw), what)


def gemm_case(seed: int, lim: dict) -> dict:
    r = random.Random(seed)
    N, K = r.randint(1, lim["max_n"]), 64 * r.randint(1, lim["k_units"])
    split = valid = None
    if r.random() < 0.5:
        split = r.choice([0, N, r.randint(0, N)])
        valid = r.choice([0, split, r.randint(0, split)])
    # x's start and row stride stay on 16 bytes, as the CUDA kernel requires (README)
    return dict(M=r.randint(1, lim["max_m"]), N=N, K=K, split=split, valid=valid,
                x_pad=r.choice([0, 0, 16, 144]), out_pad=r.choice([0, 0, 4, 50]))


def run_gemm_case(kx, case: dict, device: str):
    M, N, K, split, valid = (case[k] for k in ("M", "N", "K", "split", "valid"))
    what = f"random gemm {case}"
    seed = seed_of("random-gemm", M, N, K, split, valid)
    x, W = make_gemm_inputs(M, N, K, seed, device)
    xv = row_strided(x, case["x_pad"], 1.0)
    want, mag = want_for(x, W), abs_products(x, W)
    gemm = kx.WsGemm(W, split=split, valid=valid)
    if split is None:
        bufs_views = [strided_rows(M, N, case["out_pad"], torch.bfloat16, device, OUTSIDE)]
        gemm.prepare(M, bufs_views[0][1])
        expected = [(want, mag, True)]
    else:
        bufs_views = [strided_rows(M, valid, case["out_pad"], torch.float32, device, OUTSIDE_F32),
                      strided_rows(M, N - split, case["out_pad"], torch.bfloat16, device, OUTSIDE)]
        gemm.prepare(M, logits=bufs_views[0][1], latent=bufs_views[1][1])
        expected = [(want[:, :valid], mag[:, :valid], False), (want[:, split:], mag[:, split:], True)]
    results = []
    for attempt in range(2):
        for _, view in bufs_views:
            poison_(view, 0xFFFF if view.dtype == torch.bfloat16 else 0xFFFFFFFF)
        gemm.run(x if attempt else xv)
        results.append([view.clone() for _, view in bufs_views])
    if device == "cuda":
        torch.cuda.synchronize()
    for (buf, view), got, (w, m, bf16) in zip(bufs_views, results[0], expected):
        outside = OUTSIDE if buf.dtype == torch.bfloat16 else OUTSIDE_F32
        assert count_bits(buf, outside) == M * case["out_pad"], f"{what}: bytes outside the output changed"
        assert_gemm_close(got, w, m, what, bf16=bf16)
        assert neg_zero_count(got) == 0, f"{what}: -0.0 written"
    for a, b in zip(*results):
        assert torch.equal(a, b), f"{what}: two runs (strided and plain x) differ"


def _params(backend: str, kind: str):
    lim = BACKENDS[backend]
    make, count = (moe_case, lim["cases"]) if kind == "moe" else (gemm_case, lim["gemm_cases"])
    marks = [pytest.mark.gpu] if backend == "cuda" else []
    return [pytest.param(make(seed_of(kind, backend, i), lim), id=f"{backend}-{i}", marks=marks)
            for i in range(count)]


@pytest.mark.parametrize("case", _params("cpu", "moe") + _params("cuda", "moe"))
def test_random_moe_shape(kx, request, case):
    run_moe_case(kx, case, "cuda" if "gpu" in request.keywords else "cpu")


@pytest.mark.parametrize("case", _params("cpu", "gemm") + _params("cuda", "gemm"))
def test_random_gemm_shape(kx, request, case):
    run_gemm_case(kx, case, "cuda" if "gpu" in request.keywords else "cpu")
