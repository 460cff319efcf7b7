"""The plain-PyTorch reference of SPEC 2-4: the oracle the tests compare against.

Written from the specification alone, independently of the C backend and the CUDA
kernels, and kept deliberately simple: every format conversion is a table lookup or an
exact float64 computation, so the format functions are bit-exact by construction.

Importing ``kimi_experts`` never imports this module (it needs PyTorch); tests,
benchmarks and the demo import it explicitly::

    from kimi_experts import reference as ref
    q, s = ref.quantize_mxfp8(x)                       # x float [..., K]
    rows = ref.moe_reference(w13, s13, w2, s2, x, ids)  # float64 [B*K_top, H]
    out_like_library = ref.to_bf16(rows)

Choices the specification leaves open, and what this reference does:

- MXFP8 elements of a non-finite block are the e4m3 NaN 0x7F (S.1111.111 with S = 0);
  consumers only rely on "scale 0xFF, elements NaN". MXFP4 elements of a non-finite
  block are 0 (the scale 0xFF alone carries the NaN).
- Zero keeps its sign: an element that rounds to zero from a negative value (and -0.0
  itself) is encoded as negative zero (e4m3 0x80, e2m1 nibble 0x8), as the hardware
  ``cvt.rn.satfinite`` conversions do.
- The hidden activation h (SPEC 3 step 3) is rounded to float32 before it is quantized,
  whatever ``dtype`` the reference computes in: the library computes h in fp32, so the
  MXFP8 scale and element choices are made on the same fp32 values.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "MX_BLOCK",
    "e4m3_to_float",
    "float_to_e4m3",
    "e2m1_to_float",
    "float_to_e2m1",
    "e8m0_to_float",
    "mxfp8_scale_exponent",
    "mxfp4_scale_exponent",
    "quantize_mxfp8",
    "quantize_mxfp4",
    "dequantize_mxfp8",
    "dequantize_mxfp4",
    "dequantize",
    "situ",
    "moe_reference",
    "combine_rows",
    "gemm_reference",
    "to_bf16",
    "bf16_range",
    "bf16_bits",
    "SUM_SLACK",
    "SITU_SLACK",
]

MX_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF
SCALE_EXP_MIN, SCALE_EXP_MAX = -127, 127
SCALE_BIAS = 127


# --------------------------------------------------------------------------- tables
def _e4m3_positive_values() -> list[float]:
    """Values of the e4m3fn codes 0x00..0x7F (0x7F is NaN), from the bit layout."""
    vals = []
    for code in range(128):
        exp, man = code >> 3, code & 7
        if code == 0x7F:
            vals.append(math.nan)
        elif exp == 0:  # subnormal: man/8 * 2^(1-7)
            vals.append(man / 8.0 * 2.0**-6)
        else:
            vals.append((1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return vals


_E4M3_POS = _e4m3_positive_values()
_E2M1_POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# Full 256 / 16 entry decode tables (sign in the top bit).
_E4M3_TABLE = torch.tensor(_E4M3_POS + [-v for v in _E4M3_POS], dtype=torch.float64)
_E2M1_TABLE = torch.tensor(_E2M1_POS + [-v for v in _E2M1_POS], dtype=torch.float64)


def _table(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0 ** k as float64 for integer k in [-1022, 1023], built from its bits.
    torch.ldexp / torch.pow go through the device's pow(), which on CUDA can be one ulp
    off for some exponents: the scaled values then leave e4m3 midpoints and ties round
    the other way (seen on an H200: 59 of 32256 codes off by one)."""
    return ((k.long() + 1023) << 52).view(torch.float64)


# --------------------------------------------------------------------------- scalars
def e4m3_to_float(q) -> torch.Tensor:
    """uint8 e4m3fn bits -> float32 values (0x7F / 0xFF -> NaN)."""
    q = torch.as_tensor(q)
    return _table(_E4M3_TABLE, q.device)[q.long()].float()


def e2m1_to_float(nibbles) -> torch.Tensor:
    """4-bit e2m1 codes (as integers 0..15) -> float32 values."""
    n = torch.as_tensor(nibbles)
    return _table(_E2M1_TABLE, n.device)[n.long() & 0xF].float()


def e8m0_to_float(s) -> torch.Tensor:
    """E8M0 scale bytes -> float64 2^(s-127); 0xFF -> NaN."""
    s = torch.as_tensor(s)
    e = s.long() - SCALE_BIAS
    out = _pow2(e)
    return torch.where(s.long() == E8M0_NAN, torch.full_like(out, math.nan), out)


def _round_to_grid(mag: torch.Tensor, grid: list[float]) -> torch.Tensor:
    """Round non-negative float64 magnitudes (already clamped to the grid's max) to
    the code of the nearest grid value, ties to the even code. Exact: the midpoints of
    neighbouring e4m3/e2m1 values are exact in float64."""
    g = torch.tensor(grid, dtype=torch.float64, device=mag.device)
    mids = (g[:-1] + g[1:]) / 2
    # idx = number of midpoints strictly below mag: the nearest code unless mag sits
    # exactly on a midpoint, where idx is the lower of the two neighbours.
    idx = torch.searchsorted(mids, mag.contiguous(), right=False)
    on_mid = (idx < len(mids)) & (mids[idx.clamp(max=len(mids) - 1)] == mag)
    # tie: choose the even code of (idx, idx + 1)
    idx = torch.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    return idx


def float_to_e4m3(v) -> torch.Tensor:
    """float -> e4m3fn bits (uint8): round to nearest even, saturate to +-448
    (cvt.rn.satfinite), NaN -> 0x7F, sign of zero kept. +-Inf saturates to +-448."""
    v = torch.as_tensor(v)
    v64 = v.double()
    sign = torch.signbit(v64)
    mag = v64.abs().clamp(max=E4M3_MAX)
    nan = torch.isnan(v64)
    mag = torch.where(nan, torch.zeros_like(mag), mag)
    code = _round_to_grid(mag, _E4M3_POS[:0x7F])  # finite codes 0x00..0x7E
    code = code | (sign.long() << 7)
    code = torch.where(nan, torch.full_like(code, E4M3_NAN), code)
    return code.to(torch.uint8)


def float_to_e2m1(v) -> torch.Tensor:
    """float -> e2m1 4-bit codes (uint8 0..15): RNE onto {0,.5,1,1.5,2,3,4,6},
    saturating at 6; sign of zero kept. NaN is not defined for e2m1 (-> 0)."""
    v = torch.as_tensor(v)
    v64 = v.double()
    sign = torch.signbit(v64)
    nan = torch.isnan(v64)
    mag = torch.where(nan, torch.zeros_like(v64), v64.abs().clamp(max=E2M1_MAX))
    code = _round_to_grid(mag, _E2M1_POS) | (sign.long() << 3)
    code = torch.where(nan, torch.zeros_like(code), code)
    return code.to(torch.uint8)


# --------------------------------------------------------------------------- scales
def _ceil_exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest integer e with amax <= top * 2^e (amax > 0, finite, float64). Exact."""
    # top * 2^e >= amax  <=>  e >= log2(amax / top): a float log2 guess, corrected by one either way
    guess = torch.ceil(torch.log2(amax / top)).long()
    lo = top * _pow2(guess - 1)
    guess = torch.where(lo >= amax, guess - 1, guess)
    hi = top * _pow2(guess)
    guess = torch.where(hi < amax, guess + 1, guess)
    return guess


def _block_amax(v64: torch.Tensor) -> torch.Tensor:
    return v64.abs().amax(dim=-1)


def mxfp8_scale_exponent(amax, scale: str = "rceil") -> torch.Tensor:
    """Unclamped-then-clamped scale exponent e of SPEC 2 for finite amax (int64)."""
    amax = torch.as_tensor(amax).double()
    pos = amax > 0
    safe = torch.where(pos, amax, torch.ones_like(amax))
    if scale == "rceil":
        e = _ceil_exponent(safe, E4M3_MAX)
    elif scale == "floor":
        _, p = torch.frexp(safe)  # safe = m * 2^p, m in [0.5, 1): floor(log2) = p - 1
        e = p.long() - 1 - 8
    else:
        raise ValueError(f"scale: expected 'rceil' or 'floor', got {scale!r}")
    e = torch.where(pos, e, torch.full_like(e, SCALE_EXP_MIN))
    return e.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)


def mxfp4_scale_exponent(amax) -> torch.Tensor:
    """Smallest e with amax <= 6 * 2^e, clamped to [-127, 127]; amax 0 -> -127."""
    amax = torch.as_tensor(amax).double()
    pos = amax > 0
    safe = torch.where(pos, amax, torch.ones_like(amax))
    e = _ceil_exponent(safe, E2M1_MAX)
    e = torch.where(pos, e, torch.full_like(e, SCALE_EXP_MIN))
    return e.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)


def _blocks(x) -> tuple[torch.Tensor, tuple[int, ...]]:
    x = torch.as_tensor(x)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"x: expected a floating tensor, got {x.dtype}")
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"x: last dimension {k} is not a multiple of {MX_BLOCK}")
    # Widen to fp32 exactly first (bf16/fp16 -> fp32 is exact), then to float64 (exact).
    v = x.float().double()
    return v.reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK), tuple(x.shape)


# --------------------------------------------------------------------------- quantizers
def quantize_mxfp8(x, scale: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC 2 MXFP8: x float [..., K] -> (q uint8 [..., K] e4m3 bits,
    scales uint8 [..., K/32] E8M0). A block with NaN/Inf gets scale 0xFF and NaN
    elements (0x7F)."""
    v, shape = _blocks(x)
    finite = torch.isfinite(v).all(dim=-1)
    amax = _block_amax(torch.where(finite.unsqueeze(-1), v, torch.zeros_like(v)))
    e = mxfp8_scale_exponent(amax, scale)
    scaled = v * _pow2(-e).unsqueeze(-1)  # exact power-of-two scaling
    q = float_to_e4m3(scaled)
    q = torch.where(finite.unsqueeze(-1), q, torch.full_like(q, E4M3_NAN))
    s = torch.where(finite, e + SCALE_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    return q.reshape(shape), s


def quantize_mxfp4(w) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight MXFP4: w float [..., K] -> (q uint8 [..., K/2] two e2m1 per byte, low
    nibble = even index, scales uint8 [..., K/32]). Scale: the smallest e with
    amax <= 6 * 2^e (clamped to [-127, 127], amax 0 -> -127); elements RNE onto the
    e2m1 grid, saturating at 6. A non-finite block: scale 0xFF, elements 0."""
    v, shape = _blocks(w)
    finite = torch.isfinite(v).all(dim=-1)
    amax = _block_amax(torch.where(finite.unsqueeze(-1), v, torch.zeros_like(v)))
    e = mxfp4_scale_exponent(amax)
    scaled = v * _pow2(-e).unsqueeze(-1)
    codes = float_to_e2m1(scaled)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    codes = codes.reshape(*shape[:-1], shape[-1])
    q = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    s = torch.where(finite, e + SCALE_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    return q, s


def _apply_scales(vals64: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    k = vals64.shape[-1]
    s = torch.as_tensor(scales)
    if s.shape != (*vals64.shape[:-1], k // MX_BLOCK):
        raise ValueError(
            f"scales: expected shape {list(vals64.shape[:-1]) + [k // MX_BLOCK]}, "
            f"got {list(s.shape)}")
    f = e8m0_to_float(s.to(vals64.device))
    blocks = vals64.reshape(*vals64.shape[:-1], k // MX_BLOCK, MX_BLOCK) * f.unsqueeze(-1)
    # element * 2^e is exact in float64; the cast to float32 is then exact too except
    # for overflow (-> inf) or scale 0 with tiny elements (fp32 subnormals: exact).
    return blocks.reshape(vals64.shape).float()


def dequantize_mxfp8(q, scales) -> torch.Tensor:
    """(q uint8 [..., K], scales uint8 [..., K/32]) -> float32 [..., K]; scale 0xFF or
    an e4m3 NaN element -> NaN."""
    q = torch.as_tensor(q)
    vals = _table(_E4M3_TABLE, q.device)[q.long()]
    return _apply_scales(vals, scales)


def dequantize_mxfp4(q, scales) -> torch.Tensor:
    """(q uint8 [..., K/2], scales uint8 [..., K/32]) -> float32 [..., K]."""
    q = torch.as_tensor(q).long()
    t = _table(_E2M1_TABLE, q.device)
    vals = torch.stack((t[q & 0xF], t[q >> 4]), dim=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    return _apply_scales(vals, scales)


def dequantize(q, scales, fmt: str) -> torch.Tensor:
    if fmt == "mxfp8":
        return dequantize_mxfp8(q, scales)
    if fmt == "mxfp4":
        return dequantize_mxfp4(q, scales)
    raise ValueError(f"fmt: expected 'mxfp8' or 'mxfp4', got {fmt!r}")


# --------------------------------------------------------------------------- bf16
def to_bf16(t: torch.Tensor, *, no_negative_zero: bool = False) -> torch.Tensor:
    """Round like the library: to float32 first (the library accumulates in fp32),
    then round-to-nearest-even to bfloat16. With no_negative_zero, -0.0 becomes +0.0
    (the skinny GEMM's rule, SPEC 4)."""
    out = t.float().to(torch.bfloat16)
    if no_negative_zero:
        out = torch.where(out == 0, torch.zeros_like(out), out)
    return out


def bf16_range(value: torch.Tensor, slack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] (float64): the bf16 values an implementation within ``slack`` of ``value``
    (moe_reference(slack=True)) may write. Rounding to bf16 is monotone, so the ends suffice."""
    return to_bf16(value - slack).double(), to_bf16(value + slack).double()


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensor -> its bit patterns as int32 (0..65535)."""
    return t.contiguous().view(torch.int16).int() & 0xFFFF


# --------------------------------------------------------------------------- MoE
def _cap(v: torch.Tensor, c: float) -> torch.Tensor:
    if math.isinf(c):
        return v
    return c * torch.tanh(v / c)


def _silu(z: torch.Tensor) -> torch.Tensor:
    return z / (1 + torch.exp(-z))


def situ(a: torch.Tensor, inter: int, beta: float = 4.0, linear_beta: float = 25.0):
    """SPEC 3 step 3 on a [..., 2I] tensor: silu(cap(gate, beta)) * cap(up, linear_beta)."""
    gate, up = a[..., :inter], a[..., inter:]
    return _silu(_cap(gate, beta)) * _cap(up, linear_beta)


# ----------------------------------------------------------------- lawful distance (slack)
# An implementation that follows SPEC 3 but sums in float32, in an order of its choosing,
# lands near this reference, not on it: a hidden value within an fp32 rounding of an e4m3
# rounding boundary may be quantized one step the other way (1/16-1/8 of it), and a block's
# amax near a scale step may move the block's scale. moe_reference(..., slack=True) bounds
# the distance per output element, taking every such choice into account, under two
# assumptions with wide margins:
# - every FC1 and FC2 sum lies within SUM_SLACK x (the sum of its terms' magnitudes) of the
#   exact sum: 32x the largest error of the GPU's order (fp32 sums of 32-term blocks,
#   accumulated block by block) emulated with every add rounded toward zero, 2^-25.2;
# - SiTU evaluated in fp32 lies within SITU_SLACK of its value, relative (tanhf and expf
#   err by <= 2 ulps; the gate's cap amplifies by at most 1 + beta).
# The bound is wide for the ~1 % of hidden values near a boundary and ~2^-20 of a row's
# size elsewhere.
SUM_SLACK = 2.0**-20
SITU_SLACK = 2.0**-18
_SILU_ARGMIN = -1.2784645427610738  # silu'(z) = 0: 1 + e^-z + z e^-z = 0
_SILU_MIN = _SILU_ARGMIN / (1 + math.exp(-_SILU_ARGMIN))


def _hidden_interval(a, a_err, inter: int, beta: float, linear_beta: float):
    """[lo, hi] holding SiTU(a') for every a' within a_err of a, evaluated in fp32."""
    gate, up, d_gate, d_up = a[..., :inter], a[..., inter:], a_err[..., :inter], a_err[..., inter:]
    g_lo, g_hi = _cap(gate - d_gate, beta), _cap(gate + d_gate, beta)
    u_lo, u_hi = _cap(up - d_up, linear_beta), _cap(up + d_up, linear_beta)
    s_lo, s_hi = torch.minimum(_silu(g_lo), _silu(g_hi)), torch.maximum(_silu(g_lo), _silu(g_hi))
    dip = (g_lo <= _SILU_ARGMIN) & (g_hi >= _SILU_ARGMIN)  # silu's minimum lies inside
    s_lo = torch.where(dip, _SILU_MIN, s_lo)
    corners = torch.stack([s_lo * u_lo, s_lo * u_hi, s_hi * u_lo, s_hi * u_hi])
    lo, hi = corners.amin(0), corners.amax(0)
    return lo - SITU_SLACK * lo.abs(), hi + SITU_SLACK * hi.abs()


def _mxfp8_at(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """v quantized to e4m3 under the given block scale exponents, as float64 values."""
    p = _pow2(e)
    return e4m3_to_float(float_to_e4m3(v / p)).double() * p


def _mxfp8_slack(hq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: str) -> torch.Tensor:
    """Per element of hq (this reference's MXFP8 values along the last axis): how far the
    quantized value of anything in [lo, hi] can land from it, its block's scale included.
    Rounding onto the grid is monotone, so each candidate scale needs only lo and hi."""
    shape = hq.shape
    blocks = (*shape[:-1], shape[-1] // MX_BLOCK, MX_BLOCK)
    finite = (torch.isfinite(lo) & torch.isfinite(hi)).reshape(blocks).all(-1, keepdim=True)
    lo_b = torch.where(finite, lo.reshape(blocks), 0.0)
    hi_b = torch.where(finite, hi.reshape(blocks), 0.0)
    least = torch.where((lo_b <= 0) & (hi_b >= 0), 0.0, torch.minimum(lo_b.abs(), hi_b.abs()))
    e_lo = mxfp8_scale_exponent(least.amax(-1), scale).unsqueeze(-1)
    e_hi = mxfp8_scale_exponent(torch.maximum(lo_b.abs(), hi_b.abs()).amax(-1), scale).unsqueeze(-1)
    q = hq.reshape(blocks)
    q_min, q_max = q, q
    for step in range(int((e_hi - e_lo).max()) + 1):
        e = torch.minimum(e_lo + step, e_hi)
        q_min = torch.minimum(q_min, _mxfp8_at(lo_b, e))
        q_max = torch.maximum(q_max, _mxfp8_at(hi_b, e))
    moved = torch.maximum(q - q_min, q_max - q)
    return torch.where(finite, moved, math.nan).reshape(shape)


def _expert_weight(cache: dict | None, e: int, which: int, q, s, device) -> torch.Tensor:
    """Expert e's dequantized w13 (which = 0) or w2 (which = 1), kept in cache[e] when given."""
    held = cache.setdefault(e, [None, None]) if cache is not None else [None, None]
    if held[which] is None:
        held[which] = dequantize_mxfp4(q[e].to(device), s[e].to(device))
    return held[which]


def moe_reference(w13, s13, w2, s2, x, ids, weights=None, *, beta: float = 4.0,
                  linear_beta: float = 25.0, hidden_scale: str = "rceil",
                  dtype: torch.dtype = torch.float64, cache: dict | None = None,
                  device=None, slack: bool = False):
    """SPEC 3 in plain PyTorch.

    w13 uint8 [E, 2I, H/2], s13 uint8 [E, 2I, H/32], w2 uint8 [E, H, I/2],
    s2 uint8 [E, H, I/32], x bf16 [B, H], ids int [B, K_top], weights float [B, K_top]
    or None. Returns, in ``dtype`` and BEFORE the final bf16 rounding:
    rows [B*K_top, H] (row t*K_top + j is token t, slot j), or, when weights is given,
    the combined [B, H] z[t] = sum_j weights[t, j] * bf16(row_tj) (slot order).
    Ids outside [0, E) give NaN rows (and a NaN combined row for that token).

    ``cache`` (optional dict) keeps each expert's dequantized float32 weights between
    calls, keyed by expert index: pass the same dict for the same weights only.
    ``device`` (default: x's device) is where the arithmetic runs.

    With ``slack=True`` returns (out, slack): slack has out's shape and bounds, per
    element, how far an implementation that sums in float32 in any order may lawfully
    land from out before its own bf16 rounding (SUM_SLACK, SITU_SLACK above); NaN where
    out is NaN.
    """
    w13, s13, w2, s2 = (torch.as_tensor(t) for t in (w13, s13, w2, s2))
    x = torch.as_tensor(x)
    ids = torch.as_tensor(ids)
    device = torch.device(device) if device is not None else x.device
    n_exp, two_i, half_h = w13.shape
    inter, hidden = two_i // 2, half_h * 2
    batch, top_k = ids.shape
    if tuple(x.shape) != (batch, hidden):
        raise ValueError(f"x: expected shape {[batch, hidden]}, got {list(x.shape)}")

    # 1. xq = MXFP8(x), rceil, blocks along H (x widened to fp32 exactly).
    xq = dequantize_mxfp8(*quantize_mxfp8(x.to(device), "rceil")).to(dtype)

    flat_ids = ids.reshape(-1).to(device).long()
    experts = [(e, torch.nonzero(flat_ids == e).squeeze(1))
               for e in torch.unique(flat_ids).tolist() if 0 <= e < n_exp]  # a bad id's row stays NaN

    # 2. FC1 (exact products; accumulation in dtype), expert by expert.
    a = torch.full((batch * top_k, two_i), math.nan, dtype=dtype, device=device)
    a_err = torch.zeros_like(a) if slack else None
    for e, slots in experts:
        w13e = _expert_weight(cache, e, 0, w13, s13, device).to(dtype)
        xs = xq[slots // top_k]
        a[slots] = xs @ w13e.T
        if slack:
            a_err[slots] = SUM_SLACK * (xs.abs() @ w13e.abs().T)
    # 3. SiTU in dtype, then rounded to fp32 like the library's h.
    h = situ(a, inter, beta, linear_beta).float()
    # 4. hq = MXFP8(h) along I with the layer's hidden_scale.
    hq = dequantize_mxfp8(*quantize_mxfp8(h, hidden_scale)).to(dtype)
    if slack:
        moved = _mxfp8_slack(hq, *_hidden_interval(a, a_err, inter, beta, linear_beta), hidden_scale)
        hq_err = moved + SUM_SLACK * (hq.abs() + moved)
    # 5. FC2.
    rows = torch.full((batch * top_k, hidden), math.nan, dtype=dtype, device=device)
    row_slack = torch.full_like(rows, math.nan) if slack else None
    for e, slots in experts:
        w2e = _expert_weight(cache, e, 1, w2, s2, device).to(dtype)
        rows[slots] = hq[slots] @ w2e.T
        if slack:
            row_slack[slots] = hq_err[slots] @ w2e.abs().T
    if weights is None:
        return (rows, row_slack) if slack else rows
    return combine_rows(rows, weights, dtype=dtype, row_slack=row_slack)


def combine_rows(rows: torch.Tensor, weights, *, dtype: torch.dtype = torch.float64,
                 row_slack: torch.Tensor | None = None):
    """SPEC 3 step 6, combined form: rows [B*K_top, H] (reference values before the
    bf16 rounding, or the library's bf16 rows) and weights [B, K_top] ->
    z [B, H] = sum_j weights[t, j] * bf16(row_tj), accumulated in slot order in
    ``dtype`` (before the final bf16 rounding). Given the rows' slack (moe_reference),
    returns (z, z's slack): each row's lawful distance carried through its bf16
    rounding, plus an fp32 sum's."""
    w = torch.as_tensor(weights).to(device=rows.device, dtype=dtype)
    batch, top_k = w.shape
    shape = (batch, top_k, rows.shape[-1])
    rb = to_bf16(rows).to(dtype).reshape(shape)
    z = torch.zeros((batch, rows.shape[-1]), dtype=dtype, device=rows.device)
    for j in range(top_k):  # slot order
        z = z + w[:, j:j + 1] * rb[:, j]
    if row_slack is None:
        return z
    r, s = rows.to(dtype).reshape(shape), row_slack.to(dtype).reshape(shape)
    # bf16 rounding is monotone: a row within s of r rounds within these of bf16(r)
    moved = torch.maximum(to_bf16(r + s).to(dtype) - rb, rb - to_bf16(r - s).to(dtype))
    terms = w.abs().unsqueeze(-1) * (moved + SUM_SLACK * (rb.abs() + moved))
    return z, terms.sum(1)


# --------------------------------------------------------------------------- GEMM
def gemm_reference(x, W, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """SPEC 4: y = x @ W^T for bf16 x [M, K] and W [N, K], computed in ``dtype``
    (before the library's rounding: to_bf16(y, no_negative_zero=True) for bf16
    outputs, y.float() with -0.0 -> +0.0 for the fp32 logits)."""
    x = torch.as_tensor(x)
    W = torch.as_tensor(W)
    return x.to(dtype) @ W.to(dtype).T
