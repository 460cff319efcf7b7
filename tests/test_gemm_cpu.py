"""SPEC 4 on the CPU backend: kx.WsGemm against gemm_reference (float64).

Plain and split epilogues, odd M, the -0.0 rule, strided outputs into one "mailbox"
buffer (bytes outside the views untouched), strided x, prepare-once-run-many."""

from __future__ import annotations

import pytest
import torch

from gemm_check import (abs_products, assert_gemm_close, make_gemm_inputs, neg_zero_count,
                        neg_zero_inputs, want_for)
from shapes import count_bits, poison_, seed_of

SMALL_NK = [(64, 64), (256, 128), (100, 192), (257, 64), (1000, 320)]
MODEL_NK = [(1024, 7168), (4096, 7168), (7168, 2048), (256, 64)]


def run_plain(kx, W, x, out=None):
    m = x.shape[0]
    if out is None:
        out = poison_(torch.empty((m, W.shape[0]), dtype=torch.bfloat16))
    gemm = kx.WsGemm(W)
    gemm.prepare(m, out)
    res = gemm.run(x)
    assert res is out, "run() must return the out given to prepare()"
    return out


def run_split(kx, W, x, split, valid, logits=None, latent=None):
    m, n = x.shape[0], W.shape[0]
    if logits is None:
        logits = poison_(torch.empty((m, valid), dtype=torch.float32))
    if latent is None:
        latent = poison_(torch.empty((m, n - split), dtype=torch.bfloat16))
    gemm = kx.WsGemm(W, split=split, valid=valid)
    gemm.prepare(m, logits=logits, latent=latent)
    res = gemm.run(x)
    assert isinstance(res, tuple) and len(res) == 2, f"split run() returns (logits, latent), got {type(res)}"
    assert res[0] is logits and res[1] is latent
    return logits, latent


def check_split(kx, W, x, split, valid, what, logits=None, latent=None):
    """A split run: every element of both views written, each within its tolerance."""
    logits, latent = run_split(kx, W, x, split, valid, logits, latent)
    want, mag = want_for(x, W), abs_products(x, W)
    assert count_bits(logits, 0xFFFFFFFF) == 0 and count_bits(latent, 0xFFFF) == 0, f"{what}: not all written"
    assert_gemm_close(logits, want[:, :valid], mag[:, :valid], what + " logits", bf16=False)
    assert_gemm_close(latent, want[:, split:], mag[:, split:], what + " latent", bf16=True)


def check_plain(kx, tag, M, N, K):
    """A plain run on fresh inputs: every element written, within tolerance, no -0.0."""
    seed = seed_of(tag, M, N, K)
    x, W = make_gemm_inputs(M, N, K, seed)
    what = f"plain M={M} N={N} K={K} seed={seed}"
    out = run_plain(kx, W, x)
    assert count_bits(out, 0xFFFF) == 0, f"{what}: elements not written"
    assert_gemm_close(out, want_for(x, W), abs_products(x, W), what, bf16=True)
    assert neg_zero_count(out) == 0, f"{what}: -0.0 written"


@pytest.mark.parametrize("M", [1, 2, 3, 7, 16, 33, 64, 65, 100, 129, 256])
@pytest.mark.parametrize("N,K", SMALL_NK, ids=lambda v: str(v))
def test_plain_small(kx, M, N, K):
    check_plain(kx, "gemm", M, N, K)


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("N,K", MODEL_NK, ids=lambda v: str(v))
def test_plain_model_shapes(kx, M, N, K):
    check_plain(kx, "gemm-model", M, N, K)


SPLITS = [  # (N, K, split, valid)
    (256, 128, 128, 128),
    (256, 128, 160, 100),
    (256, 64, 256, 256),   # latent empty
    (256, 64, 0, 0),       # logits empty, latent = all columns
    (384, 192, 320, 7),
    (1000, 64, 512, 384),
]


@pytest.mark.parametrize("M", [1, 4, 13, 64])
@pytest.mark.parametrize("N,K,split,valid", SPLITS, ids=lambda v: str(v))
def test_split_epilogue(kx, M, N, K, split, valid):
    seed = seed_of("split", M, N, K, split, valid)
    x, W = make_gemm_inputs(M, N, K, seed)
    what = f"split M={M} N={N} K={K} split={split} valid={valid} seed={seed}"
    check_split(kx, W, x, split, valid, what)


def test_split_model_shape(kx):
    """The MoE front: router logits (fp32, 384 valid of 512) and a latent bf16 shard."""
    M, N, K, split, valid = 3, 1536, 7168, 512, 384
    seed = seed_of("split-model")
    x, W = make_gemm_inputs(M, N, K, seed)
    what = f"split M={M} N={N} K={K} split={split} valid={valid} seed={seed}"
    check_split(kx, W, x, split, valid, what)


@pytest.mark.parametrize("M,N,K", [(4, 64, 64), (7, 256, 192), (64, 128, 128)])
def test_negative_zero_rule(kx, M, N, K):
    x, W = neg_zero_inputs(M, N, K)
    what = f"-0.0 rule M={M} N={N} K={K}"
    want = want_for(x, W)
    # The rule is exercised: row 0's products are all -0.0 (x = -0.0, W > 0 in the first
    # half), and row 2's one non-zero product -2^-140 is an fp32 subnormal that rounds
    # to -0.0 in bf16 whatever the summation order.
    prods = x[0].float()[None, :] * W[: N // 2].float()
    assert bool(((prods == 0) & torch.signbit(prods)).all()), f"{what}: row 0 products not all -0.0"
    assert bool((want[2] == -(2.0**-140)).all()), f"{what}: row 2 should be -2^-140"
    out = run_plain(kx, W, x)
    assert neg_zero_count(out) == 0, f"{what}: plain output holds {neg_zero_count(out)} -0.0"
    assert bool((out[0] == 0).all()) and bool((out[1] == 0).all()), what
    assert bool((out[2] == 0).all()), f"{what}: -2^-140 rounds to (+)0 in bf16"
    logits, latent = run_split(kx, W, x, N // 2, N // 4)
    assert neg_zero_count(logits) == 0, f"{what}: logits hold {neg_zero_count(logits)} -0.0"
    assert neg_zero_count(latent) == 0, f"{what}: latent holds {neg_zero_count(latent)} -0.0"
    assert bool((logits[0] == 0).all()), what


def test_mailbox_strided_outputs(kx):
    """logits and latent as views into one fp32 'mailbox' row per token: row stride >
    width, column base offset; nothing outside the views changes."""
    M, N, K, split, valid = 5, 512, 128, 256, 200
    seed = seed_of("mailbox")
    x, W = make_gemm_inputs(M, N, K, seed)
    words = 8 + valid + 24 + (N - split) // 2 + 16  # fp32 words per mailbox row
    box = torch.empty((M + 1, words), dtype=torch.float32)
    poison_(box, 0x7F7F7F7F)
    logits = box[:M, 8:8 + valid]
    lat_base = 8 + valid + 24
    latent = box[:M, lat_base:lat_base + (N - split) // 2].view(torch.bfloat16)
    assert logits.stride() == (words, 1) and latent.stride() == (2 * words, 1)
    poison_(logits, 0xFFFFFFFF)
    poison_(latent, 0xFFFF)
    what = f"mailbox M={M} N={N} K={K} split={split} valid={valid} seed={seed}"
    check_split(kx, W, x, split, valid, what, logits=logits, latent=latent)
    mask = torch.ones_like(box, dtype=torch.bool)
    mask[:M, 8:8 + valid] = False
    mask[:M, lat_base:lat_base + (N - split) // 2] = False
    assert count_bits(box[mask], 0x7F7F7F7F) == int(mask.sum()), f"{what}: bytes outside the views changed"


def test_plain_strided_out_and_x(kx):
    M, N, K = 6, 192, 128
    seed = seed_of("strided")
    x, W = make_gemm_inputs(M, N, K, seed)
    xbuf = torch.zeros((M + 3, K + 64), dtype=torch.bfloat16)
    xbuf[2:2 + M, 64:] = x
    xv = xbuf[2:2 + M, 64:]
    big = poison_(torch.empty((M + 2, N + 40), dtype=torch.bfloat16), 0x1234)
    ov = big[1:1 + M, 8:8 + N]
    poison_(ov)
    what = f"strided M={M} N={N} K={K} seed={seed}"
    run_plain(kx, W, xv, out=ov)
    assert_gemm_close(ov, want_for(x, W), abs_products(x, W), what, bf16=True)
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[1:1 + M, 8:8 + N] = False
    assert count_bits(big[mask], 0x1234) == int(mask.sum()), f"{what}: bytes outside the view changed"


def test_prepare_once_run_many(kx):
    N, K = 320, 256
    _, W = make_gemm_inputs(1, N, K, seed_of("many-w"))
    gemm = kx.WsGemm(W)
    for M in (1, 9, 64, 2):
        out = poison_(torch.empty((M, N), dtype=torch.bfloat16))
        gemm.prepare(M, out)
        for step in range(3):
            seed = seed_of("many", M, step)
            x, _ = make_gemm_inputs(M, N, K, seed)
            poison_(out)
            gemm.run(x)
            assert_gemm_close(out, want_for(x, W), abs_products(x, W),
                              f"M={M} N={N} K={K} step={step} seed={seed}", bf16=True)


def test_deterministic(kx):
    M, N, K = 17, 1000, 448
    x, W = make_gemm_inputs(M, N, K, seed_of("det"))
    a = run_plain(kx, W, x).clone()
    b = run_plain(kx, W, x)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"M={M} N={N} K={K}: runs differ"


def test_inputs_not_modified(kx):
    x, W = make_gemm_inputs(3, 128, 64, 5)
    xs, Ws = x.clone(), W.clone()
    run_plain(kx, W, x)
    assert torch.equal(x.view(torch.int16), xs.view(torch.int16)), "x was modified"
    assert torch.equal(W.view(torch.int16), Ws.view(torch.int16)), "W was modified"
