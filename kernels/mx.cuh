/* mx.cuh: MX formats on the device (SPEC 2) and the SiTU activation (SPEC 3).
 *
 * Scales are E8M0 bytes s meaning 2^(s-127). Quantizing a block of 32 fp32 values:
 *   rceil: e = smallest integer with amax <= 448 * 2^e;  floor: e = floor(log2 amax) - 8;
 *   both clamped to [-127, 127], amax = 0 -> -127; elements e4m3(v * 2^-e), round to
 *   nearest even, saturating. Any non-finite value makes the block NaN (scale 0xFF).
 * The exponent is read off the float's bits, never through log2f/exp2f, so host and
 * device agree bit for bit.
 *
 * FP4 decode: Hopper has no e2m1 MMA, and its e4m3 mma.sync is emulated (every
 * operand byte goes through a conversion unit that runs at a fraction of ALU rate), so
 * weights are widened straight to f16 in registers with plain bit operations. An e2m1
 * nibble s.e1e0.m placed as s at bit 15 and e1e0m at bits 11..9 of a half is the f16
 * with the same digits, 2^-14 times the e2m1 value (e2m1 0.5 becomes an f16 subnormal).
 * Activations travel as f16 values with their block scales folded in, relative to one
 * reference exponent per row (act_reference_exponent), so the MMA loop multiplies by the
 * weight scale alone; the sums are multiplied by 2^(R + 14) once per output (the 2^14
 * undoes the FP4 placement, 2^R the reference). Tagged launches' hidden blocks (launches
 * whose FC1 takes few rounds) are folded the same way relative to each row's largest block in
 * an FC2 chunk instead, and the chunk's sums take 2^R once per row (kTaggedFc1Rounds in
 * experts_layout.cuh, gather_hidden_blocks in experts_producers.cuh).
 */
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

namespace kx {

constexpr int kMxBlock = 32;           /* elements sharing one scale */
constexpr int kE8m0Bias = 127;
constexpr uint8_t kE8m0Nan = 0xFF;
constexpr uint32_t kE4m3NanX4 = 0x7F7F7F7Fu; /* four e4m3 NaN codes */
constexpr int kFp4AsF16GainLog2 = 14; /* 2^14 undoes the placement in decode_fp4x8 */

/* 2^(s-127) as fp32 for a weight scale, which the packer has made safe for a bare shift:
 * a 0xFF (NaN) block has zero elements, so 0 * inf = NaN still reaches every sum it is
 * part of; a 0 byte (2^-127, elements below 4e-38) reads as 0. */
__device__ __forceinline__ float e8m0_to_float_nonzero(uint32_t s) { return __uint_as_float(s << 23); }

/* e clamped to an E8M0 scale's range of exponents, [-127, 127]. */
__device__ __forceinline__ int clamp_e8m0_exponent(int e) {
  return e < -kE8m0Bias ? -kE8m0Bias : (e > kE8m0Bias ? kE8m0Bias : e);
}

/* 2^p for p in [-127, 127], exact. */
__device__ __forceinline__ float exp2_exact(int p) {
  return p >= -126 ? __uint_as_float((uint32_t)(p + kE8m0Bias) << 23) : __uint_as_float(0x00400000u);
}

/* floor(log2(a)) and the 23-bit fraction of a normalized, for finite a > 0. */
__device__ __forceinline__ void split_exponent(float a, int *k, uint32_t *frac) {
  uint32_t bits = __float_as_uint(a);
  int biased = (int)(bits >> 23);
  uint32_t man = bits & 0x7FFFFFu;
  if (biased == 0) { /* subnormal: value = man * 2^-149 */
    int top = 31 - __clz(man);
    *k = top - 149;
    *frac = (man << (23 - top)) & 0x7FFFFFu;
  } else {
    *k = biased - kE8m0Bias;
    *frac = man;
  }
}

/* The block exponent e of SPEC 2 for this amax (finite, >= 0). */
__device__ __forceinline__ int mxfp8_exponent(float amax, bool floor_mode) {
  if (amax == 0.0f) return -kE8m0Bias;
  int k;
  uint32_t frac;
  split_exponent(amax, &k, &frac);
  /* 448 = 1.75 * 2^8: amax = 2^k * (1 + f) fits 448 * 2^(k-8) iff f <= 0.75 */
  const uint32_t kFracOf1p75 = 0x600000u;
  int e = k - 8 + ((!floor_mode && frac > kFracOf1p75) ? 1 : 0);
  return clamp_e8m0_exponent(e);
}

/* How far below the largest block exponent the reference R of a fold sits: 448 * 2^7 fits f16. */
constexpr int kFoldHeadroomLog2 = 7;

/* An activation block reaches the MMAs as q * 2^(e - R): its e4m3 codes q times its
 * scale relative to R = E - 7, where E is the largest block exponent of the row (that of
 * the row's amax, as the block rule is monotonic). Then q * 2^(e - R) <= 448 * 2^7 fits
 * f16, every block within 22 binades of the row's largest is exact (smaller ones round
 * at 2^-24 * 2^R, ~2^-39 of the row's amax), and scaling by powers of two commutes with
 * fp32 rounding: the sums carry the same bits as with every block's own scale applied
 * in the MMA loop (that loop's scale loads and products cost 8 % at B = 8), as long as
 * the partial sums stay in fp32's normal range (they are 2^-R times the old ones, at
 * most |w| * 2^16 * K: weights below ~2^100). A row with a non-finite value is NaN in
 * every output whatever R is (0 then). */
__device__ __forceinline__ int act_reference_exponent(float row_amax, bool floor_mode) {
  if (!isfinite(row_amax)) return 0;
  return mxfp8_exponent(row_amax, floor_mode) - kFoldHeadroomLog2; /* <= 113 for finite fp32: 2^(R + 14) is finite */
}

/* A block's factor in a fold, 2^(e - R) for its exponent e and the fold's reference R: <= 2^7
 * by the choice of R; blocks more than 127 binades below R get 2^-127 (they round to 0 in f16). */
__device__ __forceinline__ float fold_factor(int block_exp, int ref_exp) {
  return exp2_exact(clamp_e8m0_exponent(block_exp - ref_exp));
}

/* The same factor for a whole block, 2^d for d = e - R, as two f16x2 factors: f16 products
 * give q * 2^d rounded once, the bits of q * fold_factor in fp32 rounded to f16 (checked for
 * every e4m3 q and d in [-140, 40), session 35). q * first is exact (q's last bit >= 2^-9 *
 * 2^-14, f16's smallest step 2^-24); second, used only when d < -14, rounds it once (0 below
 * 2^-24: q * 2^d < 2^-30 rounds to 0 anyway). Past 2^15 (only a NaN row's finite blocks,
 * whose sums are NaN anyway) the product overflows as in fp32. */
struct FoldF16 {
  uint32_t first, second; /* f16x2 bit patterns */
  bool twice;             /* second is not 1 */
};

/* f16 bits of 2^k for k in [-24, 15]; 0 below. */
__device__ __forceinline__ uint32_t f16_pow2_bits(int k) {
  return k >= -14 ? (uint32_t)(k + 15) << 10 : (k >= -24 ? 1u << (k + 24) : 0u);
}

__device__ __forceinline__ FoldF16 fold_f16(int block_exp, int ref_exp) {
  const int d = block_exp - ref_exp, d1 = min(max(d, -14), 15), d2 = min(d - d1, 15);
  const uint32_t a = f16_pow2_bits(d1), b = f16_pow2_bits(d2);
  return FoldF16{a * 0x10001u, b * 0x10001u, d2 != 0};
}

/* A row's multiplier for its sums, 2^(R + 14) (above and decode_fp4x8). */
__device__ __forceinline__ float row_multiplier(int ref_exp) { return exp2_exact(ref_exp + kFp4AsF16GainLog2); }

/* Four e4m3 bytes (little end = first) of v[0..3] * mul, RNE, saturating. */
__device__ __forceinline__ uint32_t e4m3x4(float v0, float v1, float v2, float v3, float mul) {
  uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v0 * mul, v1 * mul), __NV_SATFINITE, __NV_E4M3);
  uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v2 * mul, v3 * mul), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

/* Quantizes one block of 32 values: q receives 8 words of 4 e4m3 bytes each.
 * Returns the scale byte. */
__device__ __forceinline__ uint8_t quantize_block32(const float (&v)[kMxBlock], bool floor_mode,
                                                    uint32_t (&q)[kMxBlock / 4]) {
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kMxBlock; ++i) {
    finite &= isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  if (!finite) {
#pragma unroll
    for (int i = 0; i < kMxBlock / 4; ++i) q[i] = kE4m3NanX4;
    return kE8m0Nan;
  }
  int e = mxfp8_exponent(amax, floor_mode);
  float mul = exp2_exact(-e);
#pragma unroll
  for (int i = 0; i < kMxBlock / 4; ++i) q[i] = e4m3x4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], mul);
  return (uint8_t)(e + kE8m0Bias);
}

/* One packed word holds 8 e2m1 nibbles for four f16x2 MMA registers, placed by the
 * packer per nibble_word_bit (moe_layout.cuh): the word and its bit reversal, each
 * masked as it is and shifted left by 8. */
__device__ __forceinline__ void decode_fp4x8(uint32_t w, uint32_t (&reg)[4]) {
  constexpr uint32_t kNibbleBits = 0x8E008E00u; /* sign 15 / 31, e1 e0 m 11..9 / 27..25 */
  const uint32_t r = __brev(w);
  reg[0] = w & kNibbleBits;
  reg[1] = (w << 8) & kNibbleBits;
  reg[2] = r & kNibbleBits;
  reg[3] = (r << 8) & kNibbleBits;
}

/* The f16 value of each e4m3 byte in q (exact), as f16x2 words: low byte first. */
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two_bytes, __NV_E4M3);
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

/* Two e4m3 codes (low byte first) as the f16 pair of their values folded by f. */
__device__ __forceinline__ uint32_t folded_f16x2(uint32_t two_codes, const FoldF16 &f) {
  const uint32_t codes = e4m3x2_to_f16x2(two_codes);
  __half2 h = __hmul2(*reinterpret_cast<const __half2 *>(&codes), *reinterpret_cast<const __half2 *>(&f.first));
  if (f.twice) h = __hmul2(h, *reinterpret_cast<const __half2 *>(&f.second));
  return *reinterpret_cast<const uint32_t *>(&h);
}

/* SiTU (SPEC 3): silu(cap(gate, beta)) * cap(up, linear_beta), cap(v, c) = c tanh(v / c). */
__device__ __forceinline__ float soft_cap(float v, float c) { return isinf(c) ? v : c * tanhf(v / c); }

__device__ __forceinline__ float situ(float gate, float up, float beta, float linear_beta) {
  float z = soft_cap(gate, beta);
  return z / (1.0f + expf(-z)) * soft_cap(up, linear_beta);
}

}  // namespace kx
