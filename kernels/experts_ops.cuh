/* experts_ops.cuh: the experts kernel's small device steps: the MMA, MXFP8 quantization
 * and stores, the tagged hand-off words, volatile shared-memory loads, and a tile's place
 * in the launch.
 * One translation unit with experts.cu, which includes its parts in order. */
#pragma once

#include "experts_layout.cuh"

namespace kx {
namespace {

/* ---- small device helpers --------------------------------------------------------- */
/* d += A (16x16 f16, 4 registers) x B (16x8 f16, 2 registers), fp32 accumulate. */
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9},"
      " {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four bf16 to dst: one 8-byte store when aligned (it is for the usual strides). */
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16 *dst, const float (&v)[4]) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
  if (((uintptr_t)dst & 7) == 0) {
    uint2 w;
    w.x = *reinterpret_cast<uint32_t *>(&lo);
    w.y = *reinterpret_cast<uint32_t *>(&hi);
    *reinterpret_cast<uint2 *>(dst) = w;
  } else {
    dst[0] = lo.x; dst[1] = lo.y; dst[2] = hi.x; dst[3] = hi.y;
  }
}

/* Two bf16 (rounded to nearest even) as one word, the first in the low half. */
__device__ __forceinline__ uint32_t bf16x2_bits(float v0, float v1) {
  const __nv_bfloat162 two = __floats2bfloat162_rn(v0, v1);
  return *reinterpret_cast<const uint32_t *>(&two);
}

/* Two bf16 to dst: one 4-byte store when aligned. */
__device__ __forceinline__ void store_bf16x2(__nv_bfloat16 *dst, float v0, float v1) {
  const __nv_bfloat162 two = __floats2bfloat162_rn(v0, v1);
  if (((uintptr_t)dst & 3) == 0) {
    *reinterpret_cast<__nv_bfloat162 *>(dst) = two;
  } else {
    dst[0] = two.x; dst[1] = two.y;
  }
}

/* Two e4m3 codes times rel as an f16 pair, rounded once (exact inside the window of
 * act_reference_exponent): for a factor per pair, where folded_f16x2's two factors cost more
 * (with them the one-token hand-off's widening made B = 1 +1.1 %, session 35). */
__device__ __forceinline__ uint32_t scaled_f16x2(uint32_t two_codes, float rel) {
  const uint32_t codes = e4m3x2_to_f16x2(two_codes);
  const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&codes));
  const __half2 out = __float22half2_rn(make_float2(f.x * rel, f.y * rel));
  return *reinterpret_cast<const uint32_t *>(&out);
}

/* 16 f16x2 words, pair k holding elements 2k and 2k + 1 (folded_f16x2), stored in MMA fragment
 * order (64 bytes, 16-byte aligned): lane t of a quad reads k = 2t, 2t+1, 2t+8, 2t+9, 2t+16, 2t+17,
 * 2t+24, 2t+25 (its B registers of both m16n8k16) as one 16-byte load from offset 16t. */
__device__ __forceinline__ void store_fragment_block(const uint32_t (&pairs)[kMxBlock / 2], uint8_t *dst) {
  uint4 *d = reinterpret_cast<uint4 *>(dst);
#pragma unroll
  for (int t = 0; t < 4; ++t) d[t] = make_uint4(pairs[t], pairs[t + 4], pairs[t + 8], pairs[t + 12]);
}

/* Stores an MXFP8 block (q: 32 e4m3 codes, 4 a word; scale: its E8M0 byte) for the MMAs: the
 * codes times 2^(e - ref_exp) as f16 (store_fragment_block). A NaN block's codes are NaN. */
__device__ __forceinline__ void fold_store(const uint32_t (&q)[kMxBlock / 4], uint32_t scale, int ref_exp,
                                           uint8_t *dst) {
  const FoldF16 fold = fold_f16((int)scale - kE8m0Bias, ref_exp);
  uint32_t pairs[kMxBlock / 2];
#pragma unroll
  for (int k = 0; k < kMxBlock / 2; ++k) pairs[k] = folded_f16x2(q[k / 2] >> 16 * (k % 2), fold);
  store_fragment_block(pairs, dst);
}

/* One block of 32 fp32 quantized to MXFP8 and stored as fold_store stores it. */
__device__ __forceinline__ void quantize_store(const float (&v)[kMxBlock], bool floor_mode, int ref_exp,
                                               uint8_t *dst) {
  uint32_t q[kMxBlock / 4];
  const uint32_t scale = quantize_block32(v, floor_mode, q);
  fold_store(q, scale, ref_exp, dst);
}

/* A block of x: its 32 bf16 as 16 words (element 2k in word k's low half) and the largest of
 * their |x| bits as fp32 bits (bf16 bits order like |x|, with Inf and then NaN above all). */
struct XBlock {
  uint32_t words[kMxBlock / 2];
  uint32_t amax_bits;
};

__device__ __forceinline__ XBlock load_x_block(const __nv_bfloat16 *src) {
  XBlock b;
  if (((uintptr_t)src & 15) == 0) {
#pragma unroll
    for (int i = 0; i < kMxBlock / 8; ++i) {
      const uint4 w = *reinterpret_cast<const uint4 *>(src + 8 * i);
      b.words[4 * i] = w.x; b.words[4 * i + 1] = w.y; b.words[4 * i + 2] = w.z; b.words[4 * i + 3] = w.w;
    }
  } else {
    const uint16_t *h = reinterpret_cast<const uint16_t *>(src);
#pragma unroll
    for (int k = 0; k < kMxBlock / 2; ++k) b.words[k] = h[2 * k] | (uint32_t)h[2 * k + 1] << 16;
  }
  uint32_t m = 0; /* both halves' max at once, on the bits without their signs */
#pragma unroll
  for (int k = 0; k < kMxBlock / 2; ++k) m = __vmaxu2(m, b.words[k] & 0x7FFF7FFFu);
  b.amax_bits = max(m & 0xFFFFu, m >> 16) << 16;
  return b;
}

/* quantize_store of an x block (rceil), bit for bit, on its bf16 pairs: no 32 floats, no
 * second max and one f16 product per pair instead of two conversions and two fp32 products
 * (B = 1's MMA warps had x ~0.85 kcycle sooner, session 35). */
__device__ __forceinline__ void quantize_store_x(const XBlock &b, int ref_exp, uint8_t *dst) {
  const bool finite = b.amax_bits < 0x7F800000u;
  const int e = finite ? mxfp8_exponent(__uint_as_float(b.amax_bits), false) : kE8m0Nan - kE8m0Bias;
  const float mul = finite ? exp2_exact(-e) : __uint_as_float(0x7FFFFFFFu); /* NaN: every code NaN */
  const FoldF16 fold = fold_f16(e, ref_exp);
  uint32_t pairs[kMxBlock / 2];
#pragma unroll
  for (int k = 0; k < kMxBlock / 2; ++k) {
    const uint32_t w = b.words[k];
    const float lo = __uint_as_float(w << 16) * mul, hi = __uint_as_float(w & 0xFFFF0000u) * mul;
    pairs[k] = folded_f16x2(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3), fold);
  }
  store_fragment_block(pairs, dst);
}

/* The same block spread over a warp, lane k holding element k: returns its e4m3 code and
 * sets *scale to the block's E8M0 byte, bit for bit quantize_block32's (and *amax_bits, if given,
 * to the block's max |v| as fp32 bits). */
__device__ __forceinline__ uint32_t quantize_lanes(float v, bool floor_mode, uint32_t *scale,
                                                   uint32_t *amax_bits = nullptr) {
  /* |v| bits order like |v|; Inf and NaN above all. One warp reduction, not five shuffles: on
   * the one-token hand-off's path, where each shuffle queues behind the MMA warps' shared loads */
  const uint32_t m = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(v) & 0x7FFFFFFFu);
  if (amax_bits) *amax_bits = m;
  const bool finite = m < 0x7F800000u;
  const int e = finite ? mxfp8_exponent(__uint_as_float(m), floor_mode) : 0;
  *scale = finite ? (uint32_t)(e + kE8m0Bias) : kE8m0Nan;
  return finite ? __nv_cvt_float_to_fp8(v * exp2_exact(-e), __NV_SATFINITE, __NV_E4M3) : 0x7Fu;
}

/* Word w of a block of tagged hand-off words (kHandoffTagShift) lands in the stage as
 * quantize_store's 32-bit word (w % 4) * 4 + w / 4 (elements 2w, 2w + 1 sit in lane quad
 * w % 4's 16 bytes, word w / 4). */
__device__ __forceinline__ int handoff_fragment_word(int w) { return (w % 4) * 4 + w / 4; }

/* The block's biased E8M0 scale in a tagged hand-off word. */
__device__ __forceinline__ uint32_t handoff_scale(unsigned long long word) {
  return (uint32_t)(word >> kHandoffScaleShift) & 0xFFu;
}

/* The warp's block (lane k: element k) quantized and stored as tagged words. */
__device__ __forceinline__ void store_handoff_block(unsigned long long *words, float v, bool floor_mode,
                                                    unsigned long long call) {
  const int lane = threadIdx.x & 31;
  uint32_t scale;
  const uint32_t code = quantize_lanes(v, floor_mode, &scale);
  const uint32_t next = __shfl_down_sync(0xFFFFFFFFu, code, 1);
  if (!(lane & 1))
    store_relaxed(words + lane / 2, call << kHandoffTagShift | scale << kHandoffScaleShift | next << 8 | code);
}

/* Shared-memory loads issued in program order (volatile), so a warp's units arrive one
 * after the other and the first unit's MMAs start while the rest are in flight; the
 * compiler would otherwise group them by type and the first MMA would wait for all. */
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ float lds32f(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ float2 lds64f(uint32_t addr) {
  const uint2 v = lds64(addr);
  return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

struct Stage {
  uint8_t *weights, *act;
};

__device__ __forceinline__ Stage stage_at(uint8_t *smem, const SmemLayout &L, int s) {
  uint8_t *base = smem + L.ring + s * kStageBytes;
  return Stage{base, base + kStageActOffset};
}

/* Which phase, unit and tile a global tile index names. */
struct TileRef {
  bool fc1;
  int unit, tile;
};

__device__ __forceinline__ TileRef tile_ref(const Params &p, int index, int fc1_tiles) {
  const bool fc1 = index < fc1_tiles;
  const int i = fc1 ? index : index - fc1_tiles;
  const PhaseShape &ph = fc1 ? p.fc1 : p.fc2;
  const int unit = ph.per_tiles(i);
  return TileRef{fc1, unit, i - unit * ph.tiles};
}

}  // namespace
}  // namespace kx
