/* mx.c: the MX number formats of SPEC 2, bit-exact.
 *
 *   E8M0 scale byte s      2^(s - 127); 0xFF is NaN
 *   e4m3fn element (MXFP8) bias 7, max 448, no Inf, NaN = S.1111.111
 *   e2m1 element (MXFP4)   magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; two per byte, low nibble first
 *
 * A block of 32 values v (widened exactly to fp32 first) with amax = max|v| gets the
 * scale exponent e ("rceil": smallest e with amax <= elem_max * 2^e; "floor":
 * floor(log2 amax) - 8), clamped to [-127, 127], amax = 0 giving -127, and elements
 * round-to-nearest-even(v * 2^-e) saturated to the element range. Any NaN or Inf in a
 * block makes its scale 0xFF and its elements NaN (MXFP8) or 0 (MXFP4, which has no
 * NaN; the NaN scale still poisons every decoded element).
 *
 * Exactness: exponents are read from the fp32 bits (never log2f), powers of two are
 * built from bits (2^-127 is an fp32 subnormal), and v * 2^-e is a pure exponent shift,
 * so the only rounding is the one the format defines. e4m3 and e2m1 share one
 * "minifloat" encoder and decoder, parameterized by mantissa bits and bias.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_parallel.h"
#include "mx_internal.h"

#define FP32_MANT_BITS KX_FP32_MANT_BITS
#define FP32_EXP_BIAS 127
#define FP32_FRACTION_MASK 0x007FFFFFu
#define FP32_EXP_MASK 0x7F800000u
#define SUBNORMAL_LIFT_EXP 64  /* scaling an fp32 subnormal by 2^64 makes it normal, exactly */

#define E8M0_BIAS 127
#define E8M0_NAN KX_E8M0_NAN
#define SCALE_EXP_MIN (-127)
#define SCALE_EXP_MAX 127

#define E4M3_NAN 0x7Fu
#define E4M3_SIGN 0x80u
#define E2M1_SIGN 0x8u
#define E2M1_BITS 4
#define E2M1_NIBBLE_MASK 0xFu
#define E2M1_MAG_MASK 0x7u

/* Weight bytes decoded per cache line, and how far ahead to ask for them: the decode
 * loop does too little work per byte for out-of-order execution alone to keep enough
 * DRAM reads in flight (measured on k3-tp8: 1 KiB ahead cuts B=1 from ~10 to ~6.5 ms). */
#define CACHE_LINE 64
#define PREFETCH_AHEAD 1024
_Static_assert(CACHE_LINE % (KX_MX_BLOCK / 2) == 0, "a cache line holds whole MXFP4 blocks");
#if defined(__GNUC__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

#define F16_EXP_MASK 0x1Fu
#define F16_MANT_BITS 10
#define F16_EXP_BIAS 15

/* ---- formats ---- */

/* A sign-less small float: mant_bits of mantissa, exponent bias, largest finite code. */
typedef struct minifloat {
  int mant_bits, bias;
  uint32_t max_code;
  float max_value;
} minifloat;

static const minifloat E4M3 = {3, 7, 0x7E, 448.0f};  /* 0x7F is NaN, so 0x7E is the max */
static const minifloat E2M1 = {1, 1, 0x7, 6.0f};

/* ---- scalar codecs ---- */

/* 2^e for e in [-127, 127], exact. */
static float exp2_exact(int32_t e) { return kx_e8m0_value((uint8_t)(e + E8M0_BIAS)); }

float kx_f16_to_float(uint16_t bits) {
  const uint32_t sign = (uint32_t)(bits >> 15) << 31; /* the sign bit moves to bit 31 */
  const uint32_t exp_field = (bits >> F16_MANT_BITS) & F16_EXP_MASK;
  const uint32_t mant = bits & ((1u << F16_MANT_BITS) - 1);
  const uint32_t mant_shift = FP32_MANT_BITS - F16_MANT_BITS;
  if (exp_field == 0) { /* zero or subnormal: mant * 2^-24 */
    const float mag = (float)mant * exp2_exact(1 - F16_EXP_BIAS - F16_MANT_BITS);
    return kx_f32_from_bits(kx_f32_bits(mag) | sign);
  }
  if (exp_field == F16_EXP_MASK) /* Inf or NaN, payload kept */
    return kx_f32_from_bits(sign | FP32_EXP_MASK | (mant << mant_shift));
  return kx_f32_from_bits(sign | ((exp_field + FP32_EXP_BIAS - F16_EXP_BIAS) << FP32_MANT_BITS) |
                          (mant << mant_shift));
}

/* Value of a magnitude code: mant * 2^(1 - bias - mant_bits) when the exponent field is
 * 0 (subnormal), else (2^mant_bits + mant) * 2^(exp - bias - mant_bits). */
static float minifloat_decode(uint32_t code, const minifloat *f) {
  const uint32_t exp_field = code >> f->mant_bits;
  const uint32_t mant = code & ((1u << f->mant_bits) - 1);
  if (exp_field == 0) return (float)mant * exp2_exact(1 - f->bias - f->mant_bits);
  return (float)((1u << f->mant_bits) | mant) *
         exp2_exact((int32_t)exp_field - f->bias - f->mant_bits);
}

/* Magnitude code of a >= 0 (not NaN): round to nearest even onto the format's grid,
 * subnormals included, saturating at the largest finite value (Inf saturates too). */
static uint32_t minifloat_encode(float a, const minifloat *f) {
  const int32_t min_exp = 1 - f->bias; /* exponent of the smallest normal */
  if (a < exp2_exact(min_exp)) {
    /* Subnormal range: a whole number of quanta 2^(min_exp - mant_bits). Rounding up to
     * 2^mant_bits quanta gives the smallest normal's code, so one formula covers both. */
    return (uint32_t)nearbyintf(a * exp2_exact(f->mant_bits - min_exp));
  }
  /* Normal range: keep mant_bits of the fp32 fraction, rounding the dropped bits to
   * nearest even (a carry moves into the exponent, as it should), then rebias. */
  const int shift = FP32_MANT_BITS - f->mant_bits;
  uint32_t u = kx_f32_bits(a);
  u += ((1u << (shift - 1)) - 1) + ((u >> shift) & 1u);
  const uint32_t code = (u >> shift) - ((uint32_t)(FP32_EXP_BIAS - f->bias) << f->mant_bits);
  return code < f->max_code ? code : f->max_code;
}

static float e4m3_decode(uint8_t q) {
  if ((q & ~E4M3_SIGN) == E4M3_NAN) return NAN;
  const float mag = minifloat_decode(q & ~E4M3_SIGN, &E4M3);
  return (q & E4M3_SIGN) ? -mag : mag;
}

static uint8_t e4m3_encode(float v) {
  if (isnan(v)) return E4M3_NAN;
  const uint8_t sign = signbit(v) ? E4M3_SIGN : 0;
  return (uint8_t)(sign | minifloat_encode(fabsf(v), &E4M3));
}

static float e2m1_decode(uint8_t nibble) {
  const float mag = minifloat_decode(nibble & E2M1_MAG_MASK, &E2M1);
  return (nibble & E2M1_SIGN) ? -mag : mag;
}

/* e2m1 has no NaN: NaN encodes as 0 (a non-finite block gets the NaN scale instead). */
static uint8_t e2m1_encode(float v) {
  if (isnan(v)) return 0;
  const uint8_t sign = signbit(v) ? E2M1_SIGN : 0;
  return (uint8_t)(sign | minifloat_encode(fabsf(v), &E2M1));
}

/* ---- block scales ---- */

/* a = (1 + fraction / 2^23) * 2^returned, for finite a > 0 (subnormals included). */
static int32_t fp32_exponent(float a, uint32_t *fraction) {
  int32_t lift = 0;
  if (a < FLT_MIN) {
    a *= exp2_exact(SUBNORMAL_LIFT_EXP);
    lift = SUBNORMAL_LIFT_EXP;
  }
  const uint32_t u = kx_f32_bits(a);
  *fraction = u & FP32_FRACTION_MASK;
  return (int32_t)(u >> FP32_MANT_BITS) - FP32_EXP_BIAS - lift;
}

/* The scale byte for a block with this amax and element format. rceil: the smallest e
 * with amax <= max_value * 2^e, i.e. the exponent difference, plus one when amax's
 * fraction exceeds max_value's. floor: just the exponent difference. */
static uint8_t scale_byte(float amax, const minifloat *f, kx_scale_mode mode) {
  if (!isfinite(amax)) return E8M0_NAN;
  int32_t e = SCALE_EXP_MIN;
  if (amax > 0.0f) {
    uint32_t amax_fraction, max_fraction;
    e = fp32_exponent(amax, &amax_fraction) - fp32_exponent(f->max_value, &max_fraction);
    if (mode == KX_SCALE_RCEIL && amax_fraction > max_fraction) e += 1;
  }
  e = e < SCALE_EXP_MIN ? SCALE_EXP_MIN : (e > SCALE_EXP_MAX ? SCALE_EXP_MAX : e);
  return (uint8_t)(e + E8M0_BIAS);
}

/* max|v| over one block, or NaN when any element is NaN or infinite. */
static float block_amax(const float *v) {
  float amax = 0.0f;
  int finite = 1;
  for (int k = 0; k < KX_MX_BLOCK; ++k) {
    const float a = fabsf(v[k]);
    finite &= a <= FLT_MAX;
    amax = a > amax ? a : amax;
  }
  return finite ? amax : NAN;
}

/* 2^-e for the block exponent e of scale byte s (s != 0xFF). */
static float inverse_scale(uint8_t s) { return exp2_exact(E8M0_BIAS - (int32_t)s); }

/* ---- block quantizers: the one core behind every entry point ---- */

static uint8_t quantize_block_mxfp8(const float *v, kx_scale_mode mode, uint8_t *q) {
  const uint8_t s = scale_byte(block_amax(v), &E4M3, mode);
  if (s == E8M0_NAN) {
    memset(q, E4M3_NAN, KX_MX_BLOCK);
    return s;
  }
  const float inv = inverse_scale(s);
  for (int k = 0; k < KX_MX_BLOCK; ++k) q[k] = e4m3_encode(v[k] * inv);
  return s;
}

static uint8_t quantize_block_mxfp4(const float *v, uint8_t *q) {
  const uint8_t s = scale_byte(block_amax(v), &E2M1, KX_SCALE_RCEIL);
  if (s == E8M0_NAN) {
    memset(q, 0, KX_MX_BLOCK / 2);
    return s;
  }
  const float inv = inverse_scale(s);
  for (int k = 0; k < KX_MX_BLOCK; k += 2)
    q[k / 2] = (uint8_t)(e2m1_encode(v[k] * inv) |
                         e2m1_encode(v[k + 1] * inv) << E2M1_BITS);
  return s;
}

static void dequantize_block_mxfp8(const uint8_t *q, uint8_t s, float *out) {
  const float scale = kx_e8m0_value(s);
  for (int k = 0; k < KX_MX_BLOCK; ++k) out[k] = e4m3_decode(q[k]) * scale;
}

void kx_mxfp8_roundtrip_row(const float *v, int64_t cols, kx_scale_mode mode, float *out) {
  for (int64_t c = 0; c < cols; c += KX_MX_BLOCK) {
    uint8_t q[KX_MX_BLOCK];
    const uint8_t s = quantize_block_mxfp8(v + c, mode, q);
    dequantize_block_mxfp8(q, s, out + c);
  }
}

void kx_e2m1_pair_lut_init(kx_e2m1_pair_lut *lut) {
  for (unsigned b = 0; b < 256; ++b) {
    lut->pair[b][0] = e2m1_decode((uint8_t)(b & E2M1_NIBBLE_MASK));
    lut->pair[b][1] = e2m1_decode((uint8_t)(b >> E2M1_BITS));
  }
}

void kx_mxfp4_decode_row(const uint8_t *q, const uint8_t *scales, int64_t cols,
                         const kx_e2m1_pair_lut *lut, float *out) {
  for (int64_t b = 0; b < cols / KX_MX_BLOCK; ++b) {
    /* Unscaled pairs first (one 8-byte copy per byte), then one vectorizable scaling. */
    float block[KX_MX_BLOCK];
    const uint8_t *qb = q + b * (KX_MX_BLOCK / 2);
    if (b % (CACHE_LINE / (KX_MX_BLOCK / 2)) == 0) PREFETCH(qb + PREFETCH_AHEAD);
    for (int i = 0; i < KX_MX_BLOCK / 2; ++i)
      memcpy(&block[2 * i], lut->pair[qb[i]], sizeof lut->pair[0]);
    const float scale = kx_e8m0_value(scales[b]);
    for (int k = 0; k < KX_MX_BLOCK; ++k) out[b * KX_MX_BLOCK + k] = block[k] * scale;
  }
}

/* ---- matrix entry points ---- */

static size_t elem_size(kx_elem_type type) { return type == KX_ELEM_F32 ? 4 : 2; }

/* Widens x[col .. col + 32) of one row to fp32 (exact for every input type). */
static void widen_block(const void *row, kx_elem_type type, int64_t col, float *out) {
  if (type == KX_ELEM_F32) {
    memcpy(out, (const float *)row + col, KX_MX_BLOCK * sizeof(float));
    return;
  }
  const uint16_t *src = (const uint16_t *)row + col;
  for (int k = 0; k < KX_MX_BLOCK; ++k)
    out[k] = type == KX_ELEM_BF16 ? kx_bf16_widen(src[k]) : kx_f16_to_float(src[k]);
}

static const void *row_at(const void *x, kx_elem_type type, int64_t r, int64_t stride) {
  return (const char *)x + (size_t)(r * stride) * elem_size(type);
}

/* One block quantizer for both formats: `nibbles` says whether elements are packed two
 * per byte (MXFP4) or one per byte (MXFP8, with its scale mode). */
static void quantize_rows(const void *x, kx_elem_type type, int64_t rows, int64_t cols,
                          int64_t x_row_stride, int nibbles, kx_scale_mode mode, uint8_t *q,
                          uint8_t *scales) {
  const int64_t blocks = cols / KX_MX_BLOCK;
  KX_OMP(parallel for schedule(static))
  for (int64_t r = 0; r < rows; ++r) {
    const void *row = row_at(x, type, r, x_row_stride);
    for (int64_t b = 0; b < blocks; ++b) {
      float v[KX_MX_BLOCK];
      widen_block(row, type, b * KX_MX_BLOCK, v);
      const int64_t at = r * cols + b * KX_MX_BLOCK;
      scales[r * blocks + b] = nibbles ? quantize_block_mxfp4(v, q + at / 2)
                                       : quantize_block_mxfp8(v, mode, q + at);
    }
  }
}

void kx_cpu_quantize_mxfp8(const void *x, kx_elem_type type, int64_t rows, int64_t cols,
                           int64_t x_row_stride, kx_scale_mode mode, uint8_t *q,
                           uint8_t *scales) {
  quantize_rows(x, type, rows, cols, x_row_stride, 0, mode, q, scales);
}

void kx_cpu_quantize_mxfp4(const void *x, kx_elem_type type, int64_t rows, int64_t cols,
                           int64_t x_row_stride, uint8_t *q, uint8_t *scales) {
  quantize_rows(x, type, rows, cols, x_row_stride, 1, KX_SCALE_RCEIL, q, scales);
}

void kx_cpu_dequantize_mxfp8(const uint8_t *q, const uint8_t *scales, int64_t rows,
                             int64_t cols, float *out) {
  const int64_t blocks = cols / KX_MX_BLOCK;
  KX_OMP(parallel for schedule(static))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      dequantize_block_mxfp8(q + r * cols + b * KX_MX_BLOCK, scales[r * blocks + b],
                             out + r * cols + b * KX_MX_BLOCK);
}

void kx_cpu_dequantize_mxfp4(const uint8_t *q, const uint8_t *scales, int64_t rows,
                             int64_t cols, float *out) {
  kx_e2m1_pair_lut lut;
  kx_e2m1_pair_lut_init(&lut);
  KX_OMP(parallel for schedule(static))
  for (int64_t r = 0; r < rows; ++r)
    kx_mxfp4_decode_row(q + r * (cols / 2), scales + r * (cols / KX_MX_BLOCK), cols, &lut,
                        out + r * cols);
}
