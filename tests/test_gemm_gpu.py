"""SPEC 4 on the GPU (issue 4): WsGemm against the float64 reference (on the GPU) for
every M in 1..64 and odd M beyond, the model's (N, K) shapes and small ones, both
epilogues, the -0.0 rule, strided "mailbox" outputs, CUDA-graph capture, determinism."""

from __future__ import annotations

import pytest
import torch

from gemm_check import (abs_products, assert_gemm_close, make_gemm_inputs, neg_zero_count,
                        neg_zero_inputs, want_for)
from gpu_util import sync_or_die
from shapes import count_bits, poison_, seed_of

pytestmark = pytest.mark.gpu
DEV = "cuda"

# (N, K, split, valid): the MoE front's shapes, with a split epilogue of router logits
# (valid experts, padded to split) and a latent shard.
SHAPES = [(1024, 7168, 512, 384), (4096, 7168, 512, 384), (7168, 2048, 128, 100),
          (256, 64, 128, 64), (1536, 7168, 512, 384), (384, 128, 256, 250),
          (20000, 256, 512, 384)]  # tile_n 256: two 64-row blocks per consumer warpgroup
MS = list(range(1, 65)) + [65, 77, 100, 127, 128, 200, 256]


@pytest.fixture(scope="module")
def weights():
    cache = {}

    def get(N, K):
        if (N, K) not in cache:
            cache[(N, K)] = make_gemm_inputs(1, N, K, seed_of("gpu-gemm-W", N, K), DEV)[1]
        return cache[(N, K)]

    return get


@pytest.mark.parametrize("N,K,split,valid", SHAPES, ids=lambda v: str(v))
def test_plain_every_m(kx, weights, N, K, split, valid):
    W = weights(N, K)
    gemm = kx.WsGemm(W)
    for M in MS:
        seed = seed_of("gpu-gemm", M, N, K)
        x = make_gemm_inputs(M, N, K, seed, DEV)[0]
        out = poison_(torch.empty((M, N), dtype=torch.bfloat16, device=DEV))
        gemm.prepare(M, out)
        res = gemm.run(x)
        what = f"plain M={M} N={N} K={K} seed={seed}"
        sync_or_die(what)
        assert res is out, f"{what}: run() returns the prepared out"
        assert count_bits(out, 0xFFFF) == 0, f"{what}: elements not written"
        assert_gemm_close(out, want_for(x, W), abs_products(x, W), what, bf16=True)
        assert neg_zero_count(out) == 0, f"{what}: -0.0 written"


@pytest.mark.parametrize("N,K,split,valid", SHAPES, ids=lambda v: str(v))
def test_split_every_m(kx, weights, N, K, split, valid):
    W = weights(N, K)
    gemm = kx.WsGemm(W, split=split, valid=valid)
    for M in MS:
        seed = seed_of("gpu-gemm-split", M, N, K)
        x = make_gemm_inputs(M, N, K, seed, DEV)[0]
        L = poison_(torch.empty((M, valid), dtype=torch.float32, device=DEV))
        T = poison_(torch.empty((M, N - split), dtype=torch.bfloat16, device=DEV))
        gemm.prepare(M, logits=L, latent=T)
        res = gemm.run(x)
        what = f"split M={M} N={N} K={K} split={split} valid={valid} seed={seed}"
        sync_or_die(what)
        assert res[0] is L and res[1] is T, f"{what}: run() returns (logits, latent)"
        assert count_bits(L, 0xFFFFFFFF) == 0 and count_bits(T, 0xFFFF) == 0, f"{what}: not all written"
        want, mag = want_for(x, W), abs_products(x, W)
        assert_gemm_close(L, want[:, :valid], mag[:, :valid], what + " logits", bf16=False)
        assert_gemm_close(T, want[:, split:], mag[:, split:], what + " latent", bf16=True)


@pytest.mark.parametrize("M,N,K", [(4, 256, 64), (7, 1024, 7168), (64, 4096, 7168), (33, 7168, 2048)])
def test_negative_zero_rule(kx, M, N, K):
    x, W = neg_zero_inputs(M, N, K, DEV)
    what = f"-0.0 rule M={M} N={N} K={K}"
    out = poison_(torch.empty((M, N), dtype=torch.bfloat16, device=DEV))
    g = kx.WsGemm(W)
    g.prepare(M, out)
    g.run(x)
    sync_or_die(what)
    assert neg_zero_count(out) == 0, f"{what}: plain output holds {neg_zero_count(out)} -0.0"
    assert bool((out[:3] == 0).all()), f"{what}: rows 0-2 must be (+)0"
    split, valid = N // 2, N // 4
    L = poison_(torch.empty((M, valid), dtype=torch.float32, device=DEV))
    T = poison_(torch.empty((M, N - split), dtype=torch.bfloat16, device=DEV))
    gs = kx.WsGemm(W, split=split, valid=valid)
    gs.prepare(M, logits=L, latent=T)
    gs.run(x)
    sync_or_die(what)
    assert neg_zero_count(L) == 0 and neg_zero_count(T) == 0, f"{what}: split outputs hold -0.0"


@pytest.mark.parametrize("M", [1, 5, 64])
def test_mailbox_outputs(kx, weights, M):
    N, K, split, valid = 1024, 7168, 512, 384
    W = weights(N, K)
    seed = seed_of("gpu-mailbox", M)
    x = make_gemm_inputs(M, N, K, seed, DEV)[0]
    words = 16 + valid + 40 + (N - split) // 2 + 8
    box = poison_(torch.empty((M + 1, words), dtype=torch.float32, device=DEV), 0x7F7F7F7F)
    L = box[:M, 16:16 + valid]
    base = 16 + valid + 40
    T = box[:M, base:base + (N - split) // 2].view(torch.bfloat16)
    poison_(L, 0xFFFFFFFF)
    poison_(T, 0xFFFF)
    g = kx.WsGemm(W, split=split, valid=valid)
    g.prepare(M, logits=L, latent=T)
    g.run(x)
    what = f"mailbox M={M} N={N} K={K} seed={seed}"
    sync_or_die(what)
    want, mag = want_for(x, W), abs_products(x, W)
    assert_gemm_close(L, want[:, :valid], mag[:, :valid], what + " logits", bf16=False)
    assert_gemm_close(T, want[:, split:], mag[:, split:], what + " latent", bf16=True)
    mask = torch.ones_like(box, dtype=torch.bool)
    mask[:M, 16:16 + valid] = False
    mask[:M, base:base + (N - split) // 2] = False
    assert count_bits(box[mask], 0x7F7F7F7F) == int(mask.sum()), f"{what}: bytes outside the views changed"


def test_strided_x_and_out(kx, weights):
    N, K, M = 4096, 7168, 9
    W = weights(N, K)
    x = make_gemm_inputs(M, N, K, seed_of("gpu-strided"), DEV)[0]
    xbuf = torch.zeros((M + 2, K + 128), dtype=torch.bfloat16, device=DEV)
    xbuf[1:1 + M, 128:] = x
    big = poison_(torch.empty((M, N + 64), dtype=torch.bfloat16, device=DEV), 0x1234)
    ov = big[:, 32:32 + N]
    g = kx.WsGemm(W)
    g.prepare(M, ov)
    g.run(xbuf[1:1 + M, 128:])
    sync_or_die("strided")
    assert_gemm_close(ov, want_for(x, W), abs_products(x, W), f"strided M={M} N={N} K={K}", bf16=True)
    assert count_bits(big[:, :32], 0x1234) == M * 32 and count_bits(big[:, 32 + N:], 0x1234) == M * 32, (
        f"strided M={M} N={N} K={K}: bytes outside the view changed")


@pytest.mark.parametrize("M", [1, 16, 64])
def test_graph_capture(kx, weights, M):
    N, K, split, valid = 1024, 7168, 512, 384
    W = weights(N, K)
    g = kx.WsGemm(W, split=split, valid=valid)
    x_s = torch.zeros((M, K), dtype=torch.bfloat16, device=DEV)
    L = torch.empty((M, valid), dtype=torch.float32, device=DEV)
    T = torch.empty((M, N - split), dtype=torch.bfloat16, device=DEV)
    g.prepare(M, logits=L, latent=T)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.run(x_s)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.run(x_s)
    for step in range(3):
        seed = seed_of("gpu-gemm-graph", M, step)
        x = make_gemm_inputs(M, N, K, seed, DEV)[0]
        x_s.copy_(x)
        poison_(L)
        poison_(T)
        graph.replay()
        what = f"graph M={M} step={step} seed={seed}"
        sync_or_die(what)
        want, mag = want_for(x, W), abs_products(x, W)
        assert_gemm_close(L, want[:, :valid], mag[:, :valid], what + " logits", bf16=False)
        assert_gemm_close(T, want[:, split:], mag[:, split:], what + " latent", bf16=True)


def test_deterministic(kx, weights):
    N, K, M = 4096, 7168, 37
    W = weights(N, K)
    x = make_gemm_inputs(M, N, K, seed_of("gpu-gemm-det"), DEV)[0]
    out = poison_(torch.empty((M, N), dtype=torch.bfloat16, device=DEV))
    g = kx.WsGemm(W)
    g.prepare(M, out)
    g.run(x)
    first = out.clone()
    assert count_bits(first, 0xFFFF) == 0, f"M={M}: elements not written"
    for i in range(50):
        poison_(out)
        g.run(x)
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), f"M={M}: run {i + 1} differs"
    sync_or_die("gemm determinism")


@pytest.mark.parametrize("N,K", [(4096, 7168), (7168, 2048), (1024, 7168), (256, 64), (20000, 256)],
                         ids=str)
def test_batch_invariant(kx, weights, N, K):
    """A token's row is bit-identical whatever batch it runs in (each wgmma token width, each
    tile height, pushed pairs and reduce-scattered clusters: (1024, 7168) runs clusters of 8): the
    kernel header and kimi_kernels.h promise it."""
    W = weights(N, K)
    x = make_gemm_inputs(64, N, K, seed_of("gpu-gemm-invariant", N, K), DEV)[0]
    full = torch.empty((64, N), dtype=torch.bfloat16, device=DEV)
    g = kx.WsGemm(W)
    g.prepare(64, full)
    g.run(x)
    for m, row0 in [(1, 0), (1, 37), (9, 5), (16, 48), (17, 3), (33, 31)]:
        part = poison_(torch.empty((m, N), dtype=torch.bfloat16, device=DEV))
        gp = kx.WsGemm(W)
        gp.prepare(m, part)
        gp.run(x[row0:row0 + m].contiguous())
        sync_or_die(f"invariance N={N} K={K} m={m}")
        same = part.view(torch.int16) == full[row0:row0 + m].view(torch.int16)
        assert bool(same.all()), (f"N={N} K={K}: rows {row0}..{row0 + m - 1} run alone (m={m}) differ "
                                  f"from the same rows in a batch of 64 at {int((~same).sum())} elements")


def test_device_mismatch(kx, weights):
    W = weights(256, 64)
    g = kx.WsGemm(W)
    out = torch.empty((2, 256), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="out"):
        g.prepare(2, out.cpu())
    g.prepare(2, out)
    with pytest.raises(ValueError, match="x"):
        g.run(torch.zeros((2, 64), dtype=torch.bfloat16))


def test_layouts_the_kernel_cannot_read_are_refused_by_name(kx, weights):
    """The kernel reads W and x through tensor maps: a start off 16-byte alignment or x rows a
    stride apart that is not a multiple of 8 elements is a ValueError naming the argument
    before any launch (not a CUDA error), and one row may have any stride. Nothing is written."""
    N, K, M = 256, 64, 4
    W = weights(N, K)
    flat = torch.zeros(N * K + 1, dtype=torch.bfloat16, device=DEV)
    flat[1:] = W.flatten()
    with pytest.raises(ValueError, match=r"W: .*16-byte aligned"):
        kx.WsGemm(flat[1:].view(N, K))
    g = kx.WsGemm(W)
    out = poison_(torch.empty((M, N), dtype=torch.bfloat16, device=DEV), 0x1234)
    g.prepare(M, out)
    x = make_gemm_inputs(M, N, K, seed_of("gpu-gemm-layouts"), DEV)[0]
    off = torch.zeros(M * K + 1, dtype=torch.bfloat16, device=DEV)
    off[1:] = x.flatten()
    uneven = torch.zeros((M, K + 4), dtype=torch.bfloat16, device=DEV)
    uneven[:, :K] = x
    for what, bad in [("misaligned", off[1:].view(M, K)), ("row stride K + 4", uneven[:, :K])]:
        with pytest.raises(ValueError, match=r"x: .*multiple of 8 elements"):
            g.run(bad)
        sync_or_die(what)
        assert count_bits(out, 0x1234) == M * N, f"{what}: a refused run wrote its output"
    one = kx.WsGemm(W)
    one.prepare(1, out[:1])
    one.run(uneven[:1, :K])  # one row: its stride is never used
    sync_or_die("one row")
    assert_gemm_close(out[:1], want_for(x[:1], W), abs_products(x[:1], W), "one row of a K + 4 buffer",
                      bf16=True)
