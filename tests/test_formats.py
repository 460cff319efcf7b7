"""SPEC 2 bit for bit: kx.quantize_mxfp8 (rceil, floor), kx.quantize_mxfp4 and
kx.dequantize against the reference, on random data (fresh seeds) and edge cases;
input dtypes float32 / bfloat16 / float16; NumPy and torch inputs and outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shapes import every_scale_exponent, gen, seed_of

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_ID = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
MODES = ["rceil", "floor"]
FP32_MAX = torch.finfo(torch.float32).max


# --------------------------------------------------------------------------- helpers
def mixed_blocks(shape, seed, dtype=torch.float32, lo=-20, hi=20):
    """Normal values whose 32-blocks each get their own magnitude 2^[lo, hi): many
    different scale exponents and every e4m3 / e2m1 binade."""
    g = gen(seed)
    *lead, k = shape
    x = torch.randn((*lead, k // 32, 32), generator=g)
    x *= torch.exp2(torch.randint(lo, hi, (*lead, k // 32, 1), generator=g).float())
    return x.reshape(shape).to(dtype)


def as_torch(a):
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


def nonfinite_block_mask(x: torch.Tensor) -> torch.Tensor:
    """[..., K/32] bool: blocks holding NaN or Inf."""
    xf = x.float()
    return (~torch.isfinite(xf)).reshape(*xf.shape[:-1], xf.shape[-1] // 32, 32).any(-1)


def assert_same_layout_and_scales(got, want, what):
    """got, want: (codes, scales) pairs. Both uint8 of one shape, the scales bit-exact."""
    q, s = (as_torch(t) for t in got)
    rq, rs = want
    assert q.dtype == torch.uint8 and s.dtype == torch.uint8, what
    assert tuple(q.shape) == tuple(rq.shape), f"{what}: q shape {list(q.shape)} != {list(rq.shape)}"
    assert tuple(s.shape) == tuple(rs.shape), f"{what}: scale shape {list(s.shape)} != {list(rs.shape)}"
    bad_s = torch.nonzero(s != rs)
    assert bad_s.numel() == 0, (
        f"{what}: {len(bad_s)} scale bytes differ; first at {bad_s[0].tolist()}: "
        f"got {s[tuple(bad_s[0])].item():#04x}, want {rs[tuple(bad_s[0])].item():#04x}")
    return q, s, rq, rs


def assert_mxfp8_equal(kx, ref, x, mode, what):
    q, s, rq, rs = assert_same_layout_and_scales(
        kx.quantize_mxfp8(x, scale=mode), ref.quantize_mxfp8(as_torch(x), mode), what)
    # Non-finite blocks: scale 0xFF (checked above) and every element an e4m3 NaN (the
    # NaN's sign bit is not specified); all other elements bit-exact.
    nf = nonfinite_block_mask(as_torch(x)).repeat_interleave(32, -1)
    assert bool(((q[nf] & 0x7F) == 0x7F).all()), f"{what}: non-NaN element in a non-finite block"
    diff = (q != rq) & ~nf
    bad = torch.nonzero(diff)
    if bad.numel():
        i = tuple(bad[0])
        xv = as_torch(x)[i].item()
        raise AssertionError(
            f"{what}: {len(bad)} elements differ; first at {list(i)}: x={xv!r} "
            f"scale={s[i[:-1] + (i[-1] // 32,)].item():#04x} got {q[i].item():#04x}, "
            f"want {rq[i].item():#04x}")


def assert_mxfp4_equal(kx, ref, w, what):
    q, s, rq, rs = assert_same_layout_and_scales(kx.quantize_mxfp4(w), ref.quantize_mxfp4(as_torch(w)), what)
    bad = torch.nonzero(q != rq)
    if bad.numel():
        i = tuple(bad[0])
        k = i[-1] * 2
        xv = as_torch(w)[i[:-1] + (slice(k, k + 2),)].tolist()
        raise AssertionError(
            f"{what}: {len(bad)} bytes differ; first at {list(i)} (values {xv}): "
            f"got {q[i].item():#04x}, want {rq[i].item():#04x}")


def assert_same_floats(got, want, what):
    """Bitwise equality of float32 tensors, any NaN matching any NaN."""
    got = as_torch(got)
    assert got.dtype == torch.float32, f"{what}: dtype {got.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    gn, wn = torch.isnan(got), torch.isnan(want)
    bad = torch.nonzero((gn != wn) | (~gn & (got.view(torch.int32) != want.view(torch.int32))))
    if bad.numel():
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} values differ; first at {list(i)}: "
                             f"got {got[i].item()!r}, want {want[i].item()!r}")


# --------------------------------------------------------------------------- random data
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (64, 3584), (2, 3, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_quantize_mxfp8_random(kx, ref, dtype, mode, shape):
    lo, hi = (-20, 20) if dtype != torch.float16 else (-12, 8)  # keep fp16 finite
    seed = seed_of("q8", DT_ID[dtype], mode, shape)
    x = mixed_blocks(shape, seed, dtype, lo, hi)
    assert_mxfp8_equal(kx, ref, x, mode, f"shape={shape} dtype={dtype} mode={mode} seed={seed}")


def test_quantize_mxfp8_default_is_rceil(kx, ref):
    seed = seed_of("default")
    x = mixed_blocks((4, 128), seed)
    q0, s0 = kx.quantize_mxfp8(x)
    q1, s1 = kx.quantize_mxfp8(x, scale="rceil")
    assert torch.equal(as_torch(q0), as_torch(q1)) and torch.equal(as_torch(s0), as_torch(s1)), (
        f"default scale differs from rceil (seed={seed})")
    _, sf = kx.quantize_mxfp8(x, scale="floor")
    assert not torch.equal(as_torch(sf), as_torch(s0)), f"x tells rceil from floor nowhere (seed={seed})"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("shape", [(1, 32), (5, 160), (768, 3584), (2, 4, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_quantize_mxfp4_random(kx, ref, dtype, shape):
    seed = seed_of("q4", DT_ID[dtype], shape)
    lo, hi = (-20, 20) if dtype != torch.float16 else (-10, 8)
    w = mixed_blocks(shape, seed, dtype, lo, hi)
    assert_mxfp4_equal(kx, ref, w, f"shape={shape} dtype={dtype} seed={seed}")


def test_quantize_mxfp4_weight_like(kx, ref):
    seed = seed_of("q4w")
    w = (torch.randn((384, 3584), generator=gen(seed)) * 0.02).to(torch.bfloat16)
    assert_mxfp4_equal(kx, ref, w, f"N(0,0.02) bf16 weights seed={seed}")


@pytest.mark.parametrize("seed", [11, 12])
def test_dequantize_mxfp8_all_codes(kx, ref, seed):
    """Every e4m3 code (both NaN codes included) under random scales incl. 0, 0xFE, 0xFF."""
    g = gen(seed)
    q = torch.randint(0, 256, (64, 256), generator=g, dtype=torch.uint8)
    q[0] = torch.arange(256).to(torch.uint8)
    s = torch.randint(0, 256, (64, 8), generator=g, dtype=torch.uint8)
    s[0] = torch.tensor([0, 1, 127, 0xFE, 0xFF, 100, 150, 200], dtype=torch.uint8)
    assert_same_floats(kx.dequantize(q, s, "mxfp8"), ref.dequantize_mxfp8(q, s),
                       f"mxfp8 seed={seed}")


@pytest.mark.parametrize("seed", [21, 22])
def test_dequantize_mxfp4_all_codes(kx, ref, seed):
    g = gen(seed)
    q = torch.randint(0, 256, (64, 128), generator=g, dtype=torch.uint8)
    q[0] = torch.arange(128).to(torch.uint8) * 2 + 1
    s = torch.randint(0, 256, (64, 8), generator=g, dtype=torch.uint8)
    s[0] = torch.tensor([0, 1, 127, 0xFE, 0xFF, 100, 150, 200], dtype=torch.uint8)
    assert_same_floats(kx.dequantize(q, s, "mxfp4"), ref.dequantize_mxfp4(q, s),
                       f"mxfp4 seed={seed}")


@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_through_library(kx, ref, mode):
    x = mixed_blocks((16, 512), seed_of("rt", mode))
    q, s = kx.quantize_mxfp8(x, scale=mode)
    d = as_torch(kx.dequantize(q, s, "mxfp8"))
    assert_same_floats(d, ref.dequantize_mxfp8(*ref.quantize_mxfp8(x, mode)), f"mode={mode}")


# --------------------------------------------------------------------------- edge cases
def _e4m3_midpoints(ref):
    pos = ref.e4m3_to_float(torch.arange(0x7F, dtype=torch.uint8)).double()
    return ((pos[:-1] + pos[1:]) / 2).float()  # 126 exact midpoints


def edge_rows_mxfp8(ref) -> dict[str, torch.Tensor]:
    """Named [n, 32*m] float32 cases."""
    rows = {}
    rows["zeros"] = torch.zeros(1, 64)
    rows["neg_zeros"] = torch.full((1, 64), -0.0)
    rows["mixed_signed_zeros"] = torch.tensor([0.0, -0.0] * 32).reshape(1, 64)
    sub = torch.tensor([2.0**-149, 2.0**-140, 2.0**-127, 2.0**-126 * 0.75])
    rows["fp32_subnormals"] = torch.cat([sub, -sub] * 4).reshape(1, 32)
    rows["subnormal_with_normal"] = torch.cat([torch.tensor([1e-3]), torch.full((31,), 2.0**-140)]).reshape(1, 32)
    rows["all_equal_one"] = torch.ones(1, 32)
    rows["all_equal_neg"] = torch.full((1, 32), -3.14159)
    rows["all_equal_tiny"] = torch.full((1, 32), 1e-30)
    rows["at_448"] = torch.cat([torch.tensor([448.0, -448.0]), torch.linspace(-400, 400, 30)]).reshape(1, 32)
    rows["just_past_448"] = torch.cat([torch.nextafter(torch.tensor([448.0]), torch.tensor([1e9])),
                                       torch.linspace(-400, 400, 31)]).reshape(1, 32)
    rows["past_448_saturate_floor"] = torch.cat([torch.tensor([511.0, -500.0, 464.0, 480.0]),
                                                 torch.linspace(-300, 300, 28)]).reshape(1, 32)
    rows["pow2_times_448"] = (torch.tensor([448.0 * 2.0**k for k in range(-40, 40, 5)] + [1.0] * 16)).reshape(1, 32)
    # amax = 448 puts the scale at 2^0 in both modes; the other 31 of each block are
    # exact midpoints between neighbouring e4m3 values (ties), both signs.
    mids = _e4m3_midpoints(ref)[:124].reshape(4, 31)
    rows["ties_e4m3"] = torch.cat([torch.cat([torch.full((4, 1), 448.0), mids], 1),
                                   torch.cat([torch.full((4, 1), -448.0), -mids], 1)])
    rows["huge_amax"] = torch.tensor([3.0e38, -FP32_MAX, 1.0, -1e30] * 8).reshape(1, 32)
    rows["tiny_amax"] = torch.tensor([2.0**-149] * 16 + [-(2.0**-148)] * 16).reshape(1, 32)
    rows["near_fp32_max"] = torch.full((1, 32), FP32_MAX)
    return rows


@pytest.mark.parametrize("mode", MODES)
def test_quantize_mxfp8_edge_cases(kx, ref, mode):
    for name, x in edge_rows_mxfp8(ref).items():
        assert_mxfp8_equal(kx, ref, x, mode, f"edge case {name!r} mode={mode}")


@pytest.mark.parametrize("mode", MODES)
def test_quantize_mxfp8_ties_are_even(kx, ref, mode):
    """Exact midpoints between neighbouring e4m3 values round to the even code (checked
    against hand-computed codes, not only against the reference)."""
    mids = _e4m3_midpoints(ref)[:124]  # 124 midpoints + one 448 per block of 32
    blocks = mids.reshape(4, 31)
    x = torch.cat([torch.full((4, 1), 448.0), blocks], dim=1)
    q, s = kx.quantize_mxfp8(x, scale=mode)
    q, s = as_torch(q), as_torch(s)
    assert bool((s == 127).all()), f"mode={mode}: scales {s.tolist()}"
    lo = torch.arange(124).reshape(4, 31)
    want = torch.where(lo % 2 == 0, lo, lo + 1).to(torch.uint8)
    assert torch.equal(q[:, 1:], want), f"mode={mode}: got {q[:, 1:].tolist()}"
    qn, _ = kx.quantize_mxfp8(-x, scale=mode)
    assert torch.equal(as_torch(qn)[:, 1:], want | 0x80), f"mode={mode} negative ties"


def test_quantize_mxfp8_scale_boundaries(kx, ref):
    """amax exactly 448 * 2^k keeps e = k under rceil; the next fp32 above moves to k+1."""
    for k in (-127, -100, -8, 0, 1, 50, 119):
        a = 448.0 * 2.0**k
        at = torch.tensor([a] + [1.0 * 2.0**k] * 31, dtype=torch.float32)
        past = at.clone()
        past[0] = torch.nextafter(at[0], torch.tensor(math.inf))
        x = torch.stack([at, past])
        assert_mxfp8_equal(kx, ref, x, "rceil", f"rceil boundary k={k}")
        _, s = kx.quantize_mxfp8(x, scale="rceil")
        s = as_torch(s)
        want_at = k + 127
        assert s[0, 0].item() == want_at, f"k={k}: scale {s[0, 0].item()} want {want_at}"
        assert s[1, 0].item() == k + 1 + 127, f"k={k}: scale {s[1, 0].item()} want {k + 128}"
        assert_mxfp8_equal(kx, ref, x, "floor", f"floor boundary k={k}")


def test_quantize_every_scale_exponent(kx, ref):
    """Both scale rules and MXFP4, bit for bit, at every exponent fp32 has: the random
    blocks span only 2^[-20, 20) and the boundary test a few exponents."""
    for dtype in DTYPES:
        x = every_scale_exponent(dtype, seed_of("every-exponent", DT_ID[dtype]))
        x = x[torch.isfinite(x.float()).all(1)]  # f16 and bf16 overflow at the top
        for mode in MODES:
            assert_mxfp8_equal(kx, ref, x, mode, f"every exponent {DT_ID[dtype]} mode={mode}")
        assert_mxfp4_equal(kx, ref, x, f"every exponent {DT_ID[dtype]} mxfp4")


def test_quantize_mxfp8_nonfinite(kx, ref):
    base = mixed_blocks((6, 128), seed_of("nf8"))
    x = base.clone()
    x[0, 3] = math.nan
    x[1, 40] = math.inf
    x[2, 127] = -math.inf
    x[3, :] = math.nan
    x[4, 0:64:7] = math.inf  # two blocks
    for mode in MODES:
        what = f"non-finite mode={mode}"
        assert_mxfp8_equal(kx, ref, x, mode, what)
        _, s = kx.quantize_mxfp8(x, scale=mode)
        s = as_torch(s)
        want = nonfinite_block_mask(x)
        assert torch.equal(s == 0xFF, want), f"{what}: 0xFF scales at {torch.nonzero(s == 0xFF).tolist()}"
        # finite blocks unaffected: equal to quantizing the clean row
        _, sb = kx.quantize_mxfp8(base, scale=mode)
        assert torch.equal(s[~want], as_torch(sb)[~want]), what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DT_ID.get)
def test_quantize_mxfp8_narrow_dtype_edges(kx, ref, dtype):
    fi = torch.finfo(dtype)
    vals = [fi.tiny, fi.tiny / 4, fi.smallest_normal * 0.5, -fi.tiny, fi.max, -fi.max, 0.0, -0.0]
    # subnormals of the narrow type (bf16 min subnormal 2^-133, fp16 2^-24)
    sub = 2.0**-133 if dtype == torch.bfloat16 else 2.0**-24
    vals += [sub, -sub, 3 * sub, 5 * sub]
    x = torch.tensor((vals * 8)[:64], dtype=dtype).reshape(2, 32)
    x2 = torch.tensor([sub] * 32 + [-3 * sub] * 32, dtype=dtype).reshape(2, 32)
    x3 = torch.tensor([math.inf, 1.0] * 16 + [math.nan, 2.0] * 16, dtype=dtype).reshape(2, 32)
    for name, t in (("mixed", x), ("subnormal-only", x2), ("nonfinite", x3)):
        for mode in MODES:
            assert_mxfp8_equal(kx, ref, t, mode, f"{dtype} {name} mode={mode}")
        assert_mxfp4_equal(kx, ref, t, f"{dtype} {name} mxfp4")


def test_quantize_mxfp4_edge_cases(kx, ref):
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[:-1] + grid[1:]) / 2
    cases = {
        "zeros": torch.zeros(1, 32),
        "neg_zeros": torch.full((1, 32), -0.0),
        "ties": torch.cat([torch.tensor([6.0]), mids, -mids, grid, -grid, torch.tensor([5.0])]).reshape(1, 32),
        "at_6": torch.cat([torch.tensor([6.0, -6.0]), torch.linspace(-5, 5, 30)]).reshape(1, 32),
        "just_past_6": torch.cat([torch.nextafter(torch.tensor([6.0]), torch.tensor([7.0])),
                                  torch.linspace(-5, 5, 31)]).reshape(1, 32),
        "all_equal": torch.full((1, 32), 0.37),
        "huge": torch.tensor([FP32_MAX, -1e38] * 16).reshape(1, 32),
        "tiny": torch.tensor([2.0**-149, -(2.0**-149)] * 16).reshape(1, 32),
        "subnormal_mixed": torch.tensor([2.0**-130, 2.0**-149, -(2.0**-128), 0.0] * 8).reshape(1, 32),
        "nan": torch.tensor([1.0] * 31 + [math.nan]).reshape(1, 32),
        "inf_two_blocks": torch.tensor([1.0] * 32 + [-math.inf] + [2.0] * 31).reshape(1, 64),
    }
    for name, w in cases.items():
        assert_mxfp4_equal(kx, ref, w, f"mxfp4 edge case {name!r}")
    q, s = kx.quantize_mxfp4(cases["ties"])
    q = as_torch(q)
    # hand-computed: scale 2^0; 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
    codes = torch.stack([q[0] & 0xF, q[0] >> 4], 1).flatten()
    assert codes[1:8].tolist() == [0, 2, 2, 4, 4, 6, 6], f"ties: {codes.tolist()}"
    q, s = kx.quantize_mxfp4(cases["nan"])
    assert as_torch(s).item() == 0xFF and bool((as_torch(q) == 0).all()), "NaN block: scale 0xFF, elements 0"


# --------------------------------------------------------------------------- input / output types
def test_numpy_in_numpy_out(kx, ref):
    x = mixed_blocks((5, 64), seed_of("np"))
    xn = x.numpy()
    for mode in MODES:
        q, s = kx.quantize_mxfp8(xn, scale=mode)
        assert isinstance(q, np.ndarray) and isinstance(s, np.ndarray), f"got {type(q)}, {type(s)}"
        assert q.dtype == np.uint8 and s.dtype == np.uint8 and q.shape == (5, 64) and s.shape == (5, 2)
        assert_mxfp8_equal(kx, ref, xn, mode, f"numpy float32 mode={mode}")
    q4, s4 = kx.quantize_mxfp4(xn)
    assert isinstance(q4, np.ndarray) and q4.shape == (5, 32) and s4.shape == (5, 2)
    assert_mxfp4_equal(kx, ref, xn, "numpy mxfp4")
    d = kx.dequantize(q4, s4, "mxfp4")
    assert isinstance(d, np.ndarray) and d.dtype == np.float32 and d.shape == (5, 64)
    d8 = kx.dequantize(*kx.quantize_mxfp8(xn), "mxfp8")
    assert isinstance(d8, np.ndarray) and d8.dtype == np.float32


def test_empty_inputs_any_strides(kx):
    """No rows: empty outputs of the right shapes, whatever strides the empty input has
    (NumPy >= 2.4 gives empty arrays strides of 0)."""
    zero_strided = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(0, 64), strides=(0, 0))
    for x in (zero_strided, np.zeros((0, 64), np.float32), np.zeros((2, 0, 64), np.float32),
              torch.zeros((0, 64))):
        lead = tuple(x.shape[:-1])
        for mode in MODES:
            q, s = kx.quantize_mxfp8(x, scale=mode)
            assert tuple(q.shape) == lead + (64,) and tuple(s.shape) == lead + (2,), f"{x.shape} {mode}"
        q4, s4 = kx.quantize_mxfp4(x)
        assert tuple(q4.shape) == lead + (32,) and tuple(s4.shape) == lead + (2,), f"{x.shape} mxfp4"
        assert tuple(kx.dequantize(q4, s4, "mxfp4").shape) == lead + (64,), f"{x.shape} dequantize"


def test_numpy_float16_input(kx, ref):
    x = mixed_blocks((3, 96), seed_of("np16"), torch.float16, -10, 8)
    assert_mxfp8_equal(kx, ref, x.numpy(), "rceil", "numpy float16")
    assert_mxfp4_equal(kx, ref, x.numpy(), "numpy float16 mxfp4")


def test_torch_in_torch_out(kx):
    x = mixed_blocks((3, 64), seed_of("torch"), torch.bfloat16)
    q, s = kx.quantize_mxfp8(x)
    assert isinstance(q, torch.Tensor) and isinstance(s, torch.Tensor)
    assert q.dtype == torch.uint8 and q.device.type == "cpu" and tuple(s.shape) == (3, 2)
    q4, s4 = kx.quantize_mxfp4(x)
    assert isinstance(q4, torch.Tensor) and tuple(q4.shape) == (3, 32)
    d = kx.dequantize(q, s, "mxfp8")
    assert isinstance(d, torch.Tensor) and d.dtype == torch.float32 and tuple(d.shape) == (3, 64)


def test_input_not_modified(kx):
    x = mixed_blocks((4, 64), seed_of("nomod"))
    x[0, 0] = math.nan
    before = x.clone()
    kx.quantize_mxfp8(x)
    kx.quantize_mxfp4(x)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32)), "quantize modified its input"


def test_row_strided_view_read_where_it_lies_reversed_refused(kx, ref):
    """Rows a stride apart are quantized where they lie; a reversed view (a negative row
    stride) is refused by name rather than read forward from its last row."""
    wide = mixed_blocks((6, 128), seed_of("row-strided")).numpy()
    assert_mxfp8_equal(kx, ref, wide[:, :64], "rceil", "row-strided numpy view")
    assert_mxfp4_equal(kx, ref, wide[:, :64], "row-strided numpy view mxfp4")
    for view in (wide[::-1], wide.reshape(2, 3, 128)[:, ::-1]):
        for quantize, arg in ((kx.quantize_mxfp8, "x"), (kx.quantize_mxfp4, "w")):
            with pytest.raises(ValueError, match=arg + r": expected .*strides \[.*-128"):
                quantize(view)
