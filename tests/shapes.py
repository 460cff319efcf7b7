"""Shared shapes and input makers for the tests (and usable by benchmarks).

Every maker takes a seed so a failing case reproduces from the parameters printed in
its assert message. Magnitudes are realistic for a decoder layer: bf16 hidden states
~ N(0, 1), FP4 weights whose dequantized values are ~1e-2 (random e2m1 codes under
scales near 2^-8, or quantize_mxfp4 of N(0, 0.02)), so FC1 outputs are O(1) and the
SiTU caps are exercised without saturating everything.
"""

from __future__ import annotations

import importlib.util
import pathlib
import zlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_reference():
    """kimi_experts.reference; loaded from its file when the package cannot be
    imported (the C extension not built yet): the reference needs only torch."""
    try:
        from kimi_experts import reference
        return reference
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "kimi_experts_reference", ROOT / "kimi_experts" / "reference.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


ref = _load_reference()

# --------------------------------------------------------------------------- shapes
# Kimi-K3 layer shards. E=384 experts, K_top=16, H=3584.
K3_TP8 = dict(name="k3-tp8", H=3584, I=384, E=384, top_k=16, hidden_scale="floor")
TP16 = dict(name="tp16", H=3584, I=192, E=384, top_k=16, hidden_scale="rceil")

# Small legal shapes (H % 64 == 0, I % 32 == 0, 1 <= K_top <= 32, E >= 1), chosen odd:
# E=1 (every slot the same expert), E < K_top (repeats forced), I not a multiple of 64.
SMALL_SHAPES = [
    dict(name="h64-i32-e1-k1", H=64, I=32, E=1, top_k=1, hidden_scale="rceil"),
    dict(name="h64-i32-e1-k4", H=64, I=32, E=1, top_k=4, hidden_scale="floor"),
    dict(name="h128-i96-e3-k2", H=128, I=96, E=3, top_k=2, hidden_scale="rceil"),
    dict(name="h192-i32-e7-k16", H=192, I=32, E=7, top_k=16, hidden_scale="floor"),
    dict(name="h64-i96-e7-k5", H=64, I=96, E=7, top_k=5, hidden_scale="rceil"),
    dict(name="h128-i32-e3-k7", H=128, I=32, E=3, top_k=7, hidden_scale="floor"),
    dict(name="h192-i96-e7-k3", H=192, I=96, E=7, top_k=3, hidden_scale="rceil"),
    dict(name="h64-i64-e5-k32", H=64, I=64, E=5, top_k=32, hidden_scale="rceil"),
    # K not a multiple of the GPU's chunk in either GEMM (68 = 23 + 23 + 22 and 9 = 5 + 4
    # k-blocks): the kernel's shorter last chunk
    dict(name="h2176-i288-e3-k2", H=2176, I=288, E=3, top_k=2, hidden_scale="floor"),
    # a one-token launch keeps x in shared memory and FC1's last chunk is shorter (132 =
    # 8 x 15 + 12 k-blocks; 4 x 27 + 24 in the 28-block chunks where its uncounted loads
    # ran 64 bytes past shared memory's end)
    dict(name="h4224-i32-e3-k2", H=4224, I=32, E=3, top_k=2, hidden_scale="rceil"),
    # K x I / 32 = 4128 hidden blocks, more than the GPU's tagged hand-off words hold (4096):
    # its one-token launches take the general path, without local x
    dict(name="h64-i4128-e3-k32", H=64, I=4128, E=3, top_k=32, hidden_scale="floor"),
    # the largest legal E with the most pairs per launch (B = 64 x 16): the GPU kernel's
    # shared-memory routing tables at their largest, next to its ring and reduce buffers
    dict(name="h64-i32-e4096-k16", H=64, I=32, E=4096, top_k=16, hidden_scale="floor"),
]

# Other models' MoE layers as one GPU holds them: the shard's H, I and top_k (which the k3 tiles
# were not chosen for: H = 2880 is 45 x 64, I up to 2880, top_k 1 to 8), E cut to 32 where the
# model has more, so that the float64 reference's dequantized experts stay small
# (benchmarks/bench_experts.py times them with the models' own E).
OTHER_MODEL_SHAPES = [
    dict(name="dsv3-tp8-e32", H=7168, I=256, E=32, top_k=8, hidden_scale="rceil"),
    dict(name="qwen3-235b-tp8-e32", H=4096, I=192, E=32, top_k=8, hidden_scale="rceil"),
    dict(name="gpt-oss-120b-e32", H=2880, I=2880, E=32, top_k=4, hidden_scale="rceil"),
    dict(name="llama4-maverick-tp8-e32", H=5120, I=1024, E=32, top_k=1, hidden_scale="rceil"),
    dict(name="mixtral-8x22b-tp8", H=6144, I=2048, E=8, top_k=2, hidden_scale="rceil"),
]


def shape_id(shape: dict) -> str:
    return shape["name"]


def seed_of(*parts) -> int:
    """A stable 31-bit seed from any parameters (str/int/float tuples)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def gen(seed: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# --------------------------------------------------------------------------- weights
def random_fp4_weights(E, H, I, seed):
    """Random e2m1 bytes under E8M0 scales 2^-9..2^-7: dequantized values ~ 1e-2. Fast at
    full size (k3-tp8 is ~830 MB)."""
    g = gen(seed)
    lo, hi = 127 - 9, 127 - 7 + 1
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(lo, hi, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g)
    s2 = torch.randint(lo, hi, (E, H, I // 32), dtype=torch.uint8, generator=g)
    return w13, s13, w2, s2


def quantized_fp4_weights(E, H, I, seed, std=0.02):
    """quantize_mxfp4 (the reference) of N(0, std) weights: realistic scale spread.
    Meant for small shapes (it materializes the float weights)."""
    g = gen(seed)
    w13f = torch.randn((E, 2 * I, H), generator=g) * std
    w2f = torch.randn((E, H, I), generator=g) * std
    w13, s13 = ref.quantize_mxfp4(w13f)
    w2, s2 = ref.quantize_mxfp4(w2f)
    return w13, s13, w2, s2


def make_weights(shape: dict, seed: int, kind: str = "auto"):
    """Weights for a shape dict; kind "random" / "quantized" / "auto" (quantized for
    small shapes, random bytes for the model-size ones)."""
    E, H, I = shape["E"], shape["H"], shape["I"]
    if kind == "auto":
        kind = "quantized" if E * H * I <= 8 * 2**20 else "random"
    if kind == "quantized":
        return quantized_fp4_weights(E, H, I, seed)
    return random_fp4_weights(E, H, I, seed)


# --------------------------------------------------------------------------- activations
def make_x(B, H, seed, std=1.0, device="cpu"):
    """bf16 hidden states [B, H] ~ N(0, std^2)."""
    g = gen(seed)
    return (torch.randn((B, H), generator=g) * std).to(torch.bfloat16).to(device)


def make_x_varied(B, H, seed, device="cpu", magnitudes=True, outliers=True):
    """bf16 [B, H] with per-token magnitudes spanning 1e-3..1e2 and a few x20 outlier
    channels (exercises the per-block MXFP8 scales). Either ingredient can be left out;
    the random draws are the same either way."""
    g = gen(seed)
    x = torch.randn((B, H), generator=g)
    mags = torch.pow(10.0, torch.randint(-3, 3, (B, 1), generator=g).float())
    if magnitudes:
        x = x * mags
    n_out = max(1, H // 256)
    cols = torch.randint(0, H, (n_out,), generator=g)
    if outliers:
        x[:, cols] *= 20.0
    return x.to(torch.bfloat16).to(device)


def make_ids(B, top_k, E, seed, repeat_frac=0.25, device="cpu"):
    """int32 [B, top_k] expert ids in [0, E). About repeat_frac of the tokens repeat an
    expert within their own slots (legal; each slot gets its row)."""
    g = gen(seed)
    ids = torch.randint(0, E, (B, top_k), generator=g, dtype=torch.int32)
    if top_k > 1:
        rep = torch.rand((B,), generator=g) < repeat_frac
        src = torch.randint(0, top_k, (B,), generator=g)
        dst = torch.randint(0, top_k, (B,), generator=g)
        for t in torch.nonzero(rep).flatten().tolist():
            ids[t, dst[t]] = ids[t, src[t]]
    return ids.to(device)


def make_route_weights(B, top_k, seed, device="cpu"):
    """float32 [B, top_k] routing weights: positive, normalized per token."""
    g = gen(seed)
    w = torch.rand((B, top_k), generator=g) + 0.05
    return (w / w.sum(dim=1, keepdim=True)).float().to(device)


def every_scale_exponent(dtype=torch.float32, seed=0):
    """One 32-block per (k, m) for every binade k of fp32 (subnormals included) and amax
    mantissas m = 1, 1.75, just above 1.75 and just below 2 (where rceil's and floor's
    exponents part), the other 31 elements random fractions of amax: [4 x 277, 32]. In a
    narrower dtype the top binades overflow (drop the rows that are not finite)."""
    ms = torch.tensor([1.0, 1.75, 1.75, 2.0], dtype=torch.float64)
    ms[2] = torch.nextafter(ms[2], torch.tensor(2.0, dtype=torch.float64))
    ms[3] = 2.0 - 2.0**-23
    ks = torch.arange(-149, 128, dtype=torch.float64)
    amax = torch.ldexp(ms[None, :], ks[:, None]).reshape(-1, 1)
    frac = torch.rand((amax.shape[0], 31), generator=gen(seed), dtype=torch.float64) * 2 - 1
    return torch.cat([amax, amax * frac], 1).to(dtype)


# --------------------------------------------------------------------------- comparison
def rel_fro(out: torch.Tensor, ref_t: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64 (ref should be finite and non-zero)."""
    o = out.double().to(ref_t.device)
    r = ref_t.double()
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    return num / den if den > 0 else num


# Why not bit-exactness: the library sums FC1 and FC2 in fp32 in an order of its choosing;
# the reference sums in float64. A hidden value h within an fp32 rounding of an e4m3
# rounding boundary can then be quantized one e4m3 step the other way (1/16-1/8 of it),
# and an amax near a scale step can move a whole block's MXFP8 scale; where h carries much
# of its row, that moves the row's outputs by several percent of the row (session 89 saw
# 6.5 % on the CPU backend: one fp32 ulp of h, on a midpoint). So an output passes
# (moe_check.check_close) when
# - its relative Frobenius error is below MOE_RTOL (bf16 rounding alone gives 1.66e-3);
# - at least MOE_EXACT of its elements are the reference rounded to bf16, bit for bit (the
#   CPU backend: >= 99.8 %; a wrong rounding mode leaves about half);
# - every element is the bf16 rounding of a value within the reference's slack
#   (reference.moe_reference(slack=True): every way fp32 sums may move it, those flips
#   included; ~2^-20 of the row for most elements), so a dropped, misplaced or truncated
#   element fails.
MOE_RTOL = 2e-2
MOE_EXACT = 0.95

POISON_BF16 = 0xFFFF  # a bf16 NaN the library never writes for finite data
# A finite bf16 pattern (~5.7e-28) for outputs where NaN rows are expected, so "not
# written" stays distinguishable from "written NaN".
FINITE_SENTINEL = 0x1234


def _signed(bits: int, width: int) -> int:
    """An unsigned bit pattern (e.g. 0x8000) as the signed int of that width."""
    bits &= (1 << width) - 1
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def strided_rows(rows: int, cols: int, pad: int, dtype, device, fill_bits: int | None = None):
    """A [rows, cols] view into a buffer `pad` columns wider (row stride cols + pad), starting
    `pad` // 2 columns in, the buffer filled with `fill_bits` if given; the buffer and the view."""
    buf = torch.empty((rows, cols + pad), dtype=dtype, device=device)
    if fill_bits is not None:
        poison_(buf, fill_bits)
    return buf, buf[:, pad // 2:pad // 2 + cols]


def poison_(t: torch.Tensor, bits: int = POISON_BF16) -> torch.Tensor:
    """Fill a bf16/fp32 tensor (or view) with a sentinel bit pattern."""
    if t.dtype == torch.bfloat16:
        t.view(torch.int16).fill_(_signed(bits, 16))
    elif t.dtype == torch.float32:
        t.view(torch.int32).fill_(_signed(bits, 32))
    else:
        raise TypeError(t.dtype)
    return t


def count_bits(t: torch.Tensor, bits: int) -> int:
    """How many elements of a bf16/fp32 tensor have exactly this bit pattern."""
    if t.dtype == torch.bfloat16:
        return int((t.view(torch.int16) == _signed(bits, 16)).sum())
    if t.dtype == torch.float32:
        return int((t.view(torch.int32) == _signed(bits, 32)).sum())
    raise TypeError(t.dtype)
