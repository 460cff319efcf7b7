"""The oracle checked on its own: the reference's formats against PyTorch's float8
dtype and against hand-computed values, quantizer invariants, and moe_reference
against a literal per-(token, slot) loop. Needs torch only (not the C extension)."""

from __future__ import annotations

import math

import pytest
import torch

from shapes import gen, make_ids, make_route_weights, make_x, quantized_fp4_weights, seed_of

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e4m3_table_matches_torch(ref):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = ref.e4m3_to_float(codes)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert got[0x7E].item() == 448.0 and got[0x01].item() == 2.0**-9
    assert math.isnan(got[0x7F].item()) and math.isnan(got[0xFF].item())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_float_to_e4m3_matches_torch(ref, seed):
    g = gen(seed)
    n = 200_000
    v = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 11, (n,), generator=g).float())
    got = ref.float_to_e4m3(v)
    # torch's cast is RNE but not saturating: clamp first to get satfinite.
    want = v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = torch.nonzero(got != want).flatten()
    assert bad.numel() == 0, f"seed={seed}: {bad.numel()} mismatches, first v={v[bad[0]].item()!r}"


def test_float_to_e4m3_ties_and_saturation(ref):
    pos = ref.e4m3_to_float(torch.arange(0x7F, dtype=torch.uint8)).double()
    mids = (pos[:-1] + pos[1:]) / 2  # exact midpoints (exact in fp32 too)
    got = ref.float_to_e4m3(mids.float())
    lo = torch.arange(0x7E)
    want = torch.where(lo % 2 == 0, lo, lo + 1).to(torch.uint8)  # ties to the even code
    assert torch.equal(got, want), f"got {got.tolist()}"
    assert torch.equal(ref.float_to_e4m3(-mids.float()), want | 0x80)
    special = torch.tensor([448.0, 449.0, 464.0, 1e30, math.inf, -math.inf, -0.0, 0.0, math.nan])
    assert ref.float_to_e4m3(special).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x80, 0, 0x7F]


def test_e2m1_ties_and_saturation(ref):
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    mids = (grid[:-1] + grid[1:]) / 2  # 0.25 .75 1.25 1.75 2.5 3.5 5
    assert ref.float_to_e2m1(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert ref.float_to_e2m1(-mids).tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert ref.float_to_e2m1(grid).tolist() == list(range(8))
    assert ref.float_to_e2m1(torch.tensor([7.0, 100.0, -0.0, -0.1, 0.26])).tolist() == [7, 7, 8, 8, 1]
    assert ref.e2m1_to_float(torch.arange(16)).tolist() == E2M1_GRID + [-v for v in E2M1_GRID]


def _mixed(rows, k, seed, dtype=torch.float32):
    g = gen(seed)
    x = torch.randn((rows, k), generator=g)
    blocks = x.reshape(rows, k // 32, 32)
    blocks *= torch.exp2(torch.randint(-30, 30, (rows, k // 32, 1), generator=g).float())
    return blocks.reshape(rows, k).to(dtype)


def test_pow2_exact(ref):
    """The reference scales by powers of two built from bits: equal to math.ldexp for
    every exponent it can meet (the E8M0 range and the quantizers' guesses)."""
    k = torch.arange(-1022, 1024)
    got = ref._pow2(k)
    assert got.dtype == torch.float64
    want = torch.tensor([math.ldexp(1.0, int(i)) for i in k], dtype=torch.float64)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mxfp8_scale_invariants(ref, mode):
    x = _mixed(64, 256, seed_of("inv8", mode))
    q, s = ref.quantize_mxfp8(x, mode)
    amax = x.double().abs().reshape(64, 8, 32).amax(-1)
    e = s.long() - 127
    if mode == "rceil":
        assert bool((amax <= 448 * torch.exp2(e.double())).all())
        assert bool((amax > 448 * torch.exp2(e.double() - 1)).all())
    else:
        assert bool((torch.exp2(e.double() + 8) <= amax).all())
        assert bool((amax < torch.exp2(e.double() + 9)).all())
    d = ref.dequantize_mxfp8(q, s).double()
    # element error <= half an e4m3 step (2^-4 relative) or a subnormal half-step,
    # except saturated floor-mode elements.
    scale = torch.exp2(e.double()).repeat_interleave(32, 1)
    err = (d - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-4, scale * 2.0**-10)
    ok = (err <= bound) | (x.double().abs() > 448 * scale)
    assert bool(ok.all()), f"mode={mode}"


def test_mxfp4_scale_invariants(ref):
    w = _mixed(64, 256, seed_of("inv4"))
    q, s = ref.quantize_mxfp4(w)
    assert q.shape == (64, 128) and s.shape == (64, 8)
    amax = w.double().abs().reshape(64, 8, 32).amax(-1)
    e = s.long() - 127
    assert bool((amax <= 6 * torch.exp2(e.double())).all())
    assert bool((amax > 6 * torch.exp2(e.double() - 1)).all())
    # nibble order: low nibble = even index
    lo = ref.e2m1_to_float(q & 0xF).double() * torch.exp2(e.double()).repeat_interleave(16, 1)
    d = ref.dequantize_mxfp4(q, s).double()
    assert torch.equal(lo, d[:, 0::2])


def test_roundtrip_exact_grid(ref):
    """quantize(dequantize(q, s)) == (q, s) when each block holds its grid maximum."""
    g = gen(7)
    q = torch.randint(0, 256, (16, 128), generator=g, dtype=torch.uint8)
    q = torch.where((q & 0x7F) == 0x7F, q ^ 1, q)  # no NaN codes
    q[:, 0::32] = 0x7E  # 448 in every block: the rceil and floor scales are the block's
    s = torch.randint(100, 150, (16, 4), generator=g, dtype=torch.uint8)
    v = ref.dequantize_mxfp8(q, s)
    for mode in ("rceil", "floor"):
        q2, s2 = ref.quantize_mxfp8(v, mode)
        assert torch.equal(s2, s), mode
        # -0 / +0 both decode to 0 and re-encode with their sign: exact.
        assert torch.equal(q2, q), mode
    w = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    w[:, 0::16] = (w[:, 0::16] & 0xF0) | 0x7  # 6.0 in every block
    v4 = ref.dequantize_mxfp4(w, s)
    w2, s2 = ref.quantize_mxfp4(v4)
    assert torch.equal(s2, s) and torch.equal(w2, w)


def test_nonfinite_blocks(ref):
    x = torch.ones(3, 64)
    x[0, 5] = math.nan
    x[1, 40] = math.inf
    x[2, 0] = -math.inf
    q, s = ref.quantize_mxfp8(x)
    assert s.tolist() == [[255, 119], [119, 255], [255, 119]]
    assert bool((q[0, :32] == 0x7F).all()) and bool((q[1, 32:] == 0x7F).all())
    d = ref.dequantize_mxfp8(q, s)
    assert bool(torch.isnan(d[0, :32]).all()) and bool((d[0, 32:] == 1).all())
    q4, s4 = ref.quantize_mxfp4(x)
    assert s4[0, 0].item() == 255 and bool((q4[0, :16] == 0).all())
    assert bool(torch.isnan(ref.dequantize_mxfp4(q4, s4)[0, :32]).all())


def test_zero_and_tiny_blocks(ref):
    x = torch.zeros(4, 32)
    x[1] = -0.0
    x[2, 3] = 2.0**-149  # the smallest fp32 subnormal
    x[3, :] = 3.0e38
    q, s = ref.quantize_mxfp8(x)
    assert s[:3].flatten().tolist() == [0, 0, 0]
    assert bool((q[0] == 0).all()) and bool((q[1] == 0x80).all())
    assert q[2, 3].item() == 0  # 2^-149 * 2^127 = 2^-22: rounds to 0
    # rceil: smallest e with 3e38 <= 448 * 2^e -> e = 120
    assert s[3].item() == 127 + 120
    _, sf = ref.quantize_mxfp8(x, "floor")
    assert sf[3].item() == 127 + 127 - 8 and sf[2].item() == 0  # floor(log2 3e38) = 127


@pytest.mark.parametrize("beta,lbeta", [(4.0, 25.0), (math.inf, math.inf)])
def test_moe_reference_vs_literal_loop(ref, beta, lbeta):
    """The vectorized reference equals SPEC 3 written as a loop over (token, slot)."""
    E, H, I, K, B = 3, 64, 32, 4, 5
    seed = seed_of("loop", beta)
    w13, s13, w2, s2 = quantized_fp4_weights(E, H, I, seed)
    x = make_x(B, H, seed)
    ids = make_ids(B, K, E, seed)
    rw = make_route_weights(B, K, seed)
    ids[1, 2] = E  # a bad id: NaN row
    W13 = ref.dequantize_mxfp4(w13, s13).double()
    W2 = ref.dequantize_mxfp4(w2, s2).double()
    want = torch.full((B * K, H), math.nan, dtype=torch.float64)
    for t in range(B):
        xq = ref.dequantize_mxfp8(*ref.quantize_mxfp8(x[t:t + 1])).double()[0]
        for j in range(K):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            a = W13[e] @ xq
            g = a[:I] if math.isinf(beta) else beta * torch.tanh(a[:I] / beta)
            u = a[I:] if math.isinf(lbeta) else lbeta * torch.tanh(a[I:] / lbeta)
            h = (g * torch.sigmoid(g) * u).float()
            hq = ref.dequantize_mxfp8(*ref.quantize_mxfp8(h[None], "floor")).double()[0]
            want[t * K + j] = W2[e] @ hq
    got = ref.moe_reference(w13, s13, w2, s2, x, ids, beta=beta, linear_beta=lbeta,
                            hidden_scale="floor")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.allclose(torch.nan_to_num(got), torch.nan_to_num(want), rtol=1e-9, atol=1e-12)
    z = ref.moe_reference(w13, s13, w2, s2, x, ids, rw, beta=beta, linear_beta=lbeta,
                          hidden_scale="floor")
    rb = ref.to_bf16(want).double().reshape(B, K, H)
    zw = (rw.double()[:, :, None] * rb).sum(1)
    assert bool(torch.isnan(z[1]).all()) and not bool(torch.isnan(z[[0, 2, 3, 4]]).any())
    assert torch.allclose(z[[0, 2, 3, 4]], zw[[0, 2, 3, 4]], rtol=1e-9, atol=1e-12)


def test_moe_reference_cache_and_repeats(ref):
    E, H, I, K, B = 2, 128, 64, 6, 3
    w = quantized_fp4_weights(E, H, I, 11)
    x = make_x(B, H, 11)
    ids = torch.zeros((B, K), dtype=torch.int32)  # every slot expert 0: repeats
    cache = {}
    a = ref.moe_reference(*w, x, ids, cache=cache)
    b = ref.moe_reference(*w, x, ids, cache=cache)
    assert list(cache) == [0] and torch.equal(a, b)
    for t in range(B):  # each repeated slot gets the same row
        for j in range(1, K):
            assert torch.equal(a[t * K + j], a[t * K])


def test_gemm_reference_and_to_bf16(ref):
    x = make_x(3, 64, 5)
    W = make_x(10, 64, 6)
    y = ref.gemm_reference(x, W)
    assert y.dtype == torch.float64 and y.shape == (3, 10)
    for m in range(3):  # against sums written out, each product exact in float64
        for n in range(10):
            want = math.fsum(float(a) * float(b) for a, b in zip(x[m].double(), W[n].double()))
            assert abs(y[m, n].item() - want) <= 1e-12 * (1 + abs(want)), (m, n, y[m, n].item(), want)
    z = ref.to_bf16(torch.tensor([-0.0, 1.0, -1e-45]), no_negative_zero=True)
    assert ref.bf16_bits(z).tolist() == [0, 0x3F80, 0]
    assert ref.bf16_bits(ref.to_bf16(torch.tensor([-0.0]))).tolist() == [0x8000]


def _lawful_rows(ref, w13, s13, w2, s2, x, ids, scale, reach, seed):
    """The rows of an implementation that errs by up to `reach` x the slack's assumptions:
    each FC1 and FC2 sum moved by a random fraction of SUM_SLACK x its terms' magnitudes,
    SiTU by one of SITU_SLACK, with the hidden values then quantized as SPEC 3 says.
    Returns the rows and how many hidden values came out other than the reference's."""
    g = gen(seed)
    inter = w13.shape[1] // 2
    W13, W2 = ref.dequantize_mxfp4(w13, s13).double(), ref.dequantize_mxfp4(w2, s2).double()
    xq = ref.dequantize_mxfp8(*ref.quantize_mxfp8(x)).double()

    def jitter(n, bound):  # a fraction in [-1, 1] of reach x bound, its ends included
        u = torch.rand(n, generator=g, dtype=torch.float64)
        u[torch.rand(n, generator=g) < 0.25] = 1.0
        return reach * bound * u * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)

    rows, flips = [], 0
    for t, e in ((t, int(e)) for t in range(ids.shape[0]) for e in ids[t]):
        a = W13[e] @ xq[t]
        a_lawful = a + jitter(a.numel(), ref.SUM_SLACK * (W13[e].abs() @ xq[t].abs()))
        h = ref.situ(a_lawful, inter)
        h = (h * (1 + jitter(h.numel(), ref.SITU_SLACK))).float()
        hq = ref.dequantize_mxfp8(*ref.quantize_mxfp8(h[None], scale)).double()[0]
        flips += int((hq != ref.dequantize_mxfp8(*ref.quantize_mxfp8(ref.situ(a, inter).float()[None],
                                                                        scale)).double()[0]).sum())
        y = W2[e] @ hq
        rows.append(y + jitter(y.numel(), ref.SUM_SLACK * (W2[e].abs() @ hq.abs())))
    return torch.stack(rows), flips


@pytest.mark.parametrize("scale", ["rceil", "floor"])
def test_moe_reference_slack_covers_lawful_rows(ref, scale):
    """moe_reference's slack holds every row an implementation within its assumptions can
    produce, hidden values quantized the other way included (the test counts them), and
    carries through the combine; twice the assumed error breaks it (it is not vacuous)."""
    E, H, I, K, B = 4, 256, 64, 4, 24
    seed = seed_of("slack", scale)
    w = quantized_fp4_weights(E, H, I, seed)
    x, ids, rw = make_x(B, H, seed), make_ids(B, K, E, seed), make_route_weights(B, K, seed)
    value, slack = ref.moe_reference(*w, x, ids, hidden_scale=scale, slack=True)
    z, z_slack = ref.moe_reference(*w, x, ids, rw, hidden_scale=scale, slack=True)
    assert bool((slack > 0).all()) and bool((slack < value.abs().amax(-1, keepdim=True)).all())
    total_flips = 0
    for trial in range(6):
        rows, flips = _lawful_rows(ref, *w, x, ids, scale, 1.0, seed + trial)
        total_flips += flips
        over = (rows - value).abs() - slack
        assert bool((over <= 1e-12 * value.abs()).all()), (
            f"trial {trial}: a lawful row beyond the slack by {over.max():.3g}")
        zl = (rw.double()[:, :, None] * ref.to_bf16(rows).double().reshape(B, K, H)).sum(1)
        assert bool(((zl - z).abs() <= z_slack * (1 + 1e-12)).all()), f"trial {trial}: combined beyond slack"
    assert total_flips > 0, "no hidden value was quantized the other way: the test exercised nothing"
    beyond = False
    for trial in range(6):
        rows, _ = _lawful_rows(ref, *w, x, ids, scale, 2.0, seed + 100 + trial)
        beyond |= bool(((rows - value).abs() > slack).any())
    assert beyond, "twice the assumed error never left the slack: it bounds nothing"


@pytest.mark.parametrize("scale", ["rceil", "floor"])
def test_mxfp8_slack_at_scale_steps(ref, scale):
    """Blocks whose amax sits just under, on and just over a scale step (and elements on
    rounding midpoints): every block drawn from [lo, hi], quantized whole, lies within the
    slack of the reference's quantization of the block's middle."""
    g = gen(seed_of("slack-steps", scale))
    top = 448.0 if scale == "rceil" else 1.0  # where the scale exponent steps (x 2^k)
    base = torch.rand((64, 32), generator=g, dtype=torch.float64) * 2 - 1
    step = top * 2.0 ** torch.randint(-6, 6, (64, 1), generator=g).double()
    base[:, 0] = step[:, 0] * (1 + torch.tensor([-2.0**-22, 0.0, 2.0**-22, 2.0**-30]).repeat(16))
    base[:, 1] = step[:, 0] * 304 / 448  # an e4m3 midpoint at the upper scale
    mid = base.float().double()
    half = mid.abs() * 2.0**-21
    lo, hi = mid - half, mid + half
    hq_codes, hs = ref.quantize_mxfp8(mid, scale)
    hq = ref.dequantize_mxfp8(hq_codes, hs).double()
    slack = ref._mxfp8_slack(hq, lo, hi, scale)
    stepped = torch.zeros(64, dtype=torch.bool)
    for u in (0.0, 1.0, *torch.rand(14, generator=g).tolist()):
        for sign in (1.0, -1.0):
            q, s = ref.quantize_mxfp8(mid + sign * u * half, scale)
            stepped |= (s != hs)[:, 0]
            moved = (ref.dequantize_mxfp8(q, s).double() - hq).abs()
            assert bool((moved <= slack).all()), f"u={u} sign={sign}"
    assert int(stepped.sum()) >= 16, f"only {int(stepped.sum())} blocks' scales stepped: too few to test"
