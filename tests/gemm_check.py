"""Shared checks for the skinny GEMM tests (CPU and GPU)."""

from __future__ import annotations

import torch

from shapes import gen, ref

# Element bound: the bf16 rounding (half an ulp: 2^-9 relative) plus fp32 accumulation
# error, bounded by a generous multiple of 2^-24 * sum_k |x_k w_k|.
BF16_REL = 2.0**-8
ACC_REL = 2.0**-16


def make_gemm_inputs(M, N, K, seed, device="cpu"):
    g = gen(seed)
    x = torch.randn((M, K), generator=g).to(torch.bfloat16)
    W = (torch.randn((N, K), generator=g) * K**-0.5).to(torch.bfloat16)
    return x.to(device), W.to(device)


def abs_products(x, W):
    return x.double().abs() @ W.double().abs().T


def assert_gemm_close(got, want, mag, what, *, bf16: bool):
    """got: library output (bf16 or fp32) [m, n]; want: float64 reference; mag:
    |x| @ |W|^T for the same columns."""
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {list(got.shape)} vs {list(want.shape)}"
    g = got.double()
    assert not bool(torch.isnan(g).any()), f"{what}: NaN in output"
    tol = ACC_REL * mag + (BF16_REL * want.abs() if bf16 else 0) + 1e-30
    err = (g - want).abs()
    bad = torch.nonzero(err > tol)
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {len(bad)} elements out of tolerance; first at {list(i)}: "
            f"got {g[i].item()!r}, want {want[i].item()!r} (tol {tol[i].item():.3g})")


def neg_zero_count(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:
        return int((t.view(torch.int16) == -32768).sum())
    if t.dtype == torch.float32:
        return int((t.view(torch.int32) == -(2**31)).sum())
    raise TypeError(t.dtype)


def neg_zero_inputs(M, N, K, device="cpu"):
    """x, W whose exact products give -0.0 results in several ways:
    row 0: x = -0.0 where W[0] > 0 and +0.0 where W[0] < 0: every product of the first
    N/2 columns is -0.0;
    row 1: x = +0.0, W < 0 in some columns: products -0.0 there;
    row 2: one tiny product -2^-140 (an fp32 subnormal that rounds to -0.0 in bf16);
    row 3: exact cancellation 1 - 1; further rows random."""
    g = gen(M * 1000 + N * 7 + K)
    W = (torch.rand((N, K), generator=g) + 0.5).to(torch.bfloat16)
    W[N // 2:] = -W[N // 2:]
    x = torch.randn((M, K), generator=g).to(torch.bfloat16)
    x[0] = -0.0
    if M > 1:
        x[1] = 0.0
    if M > 2:
        x[2] = 0.0
        x[2, 0] = 2.0**-70
        W[:, 0] = -(2.0**-70)
    if M > 3:
        x[3] = 0.0
        x[3, 1] = 1.0
        x[3, 2] = 1.0
        W[:, 1] = 1.0
        W[:, 2] = -1.0
    # keep every product of row 0 at -0.0 in the first N/2 columns: +0.0 where W < 0
    x[0, (W[0] < 0).nonzero().flatten()] = 0.0
    return x.to(device), W.to(device)


def want_for(x, W):
    return ref.gemm_reference(x, W)
