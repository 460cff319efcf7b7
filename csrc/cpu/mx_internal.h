/* mx_internal.h: what mx.c, moe.c and gemm.c share (not exported): bit casts, the
 * scalar codecs hot loops inline, MX row codecs, and the fixed-order dot product.
 *
 * The MX row codecs are exact: decoded MXFP4/MXFP8 values are small-mantissa numbers
 * times a power of two, so fp32 holds them without rounding.
 */
#ifndef KX_CPU_MX_INTERNAL_H
#define KX_CPU_MX_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_backend.h"

#define KX_BF16_NAN 0x7FC0u /* the quiet NaN written for rows of bad expert ids */
#define KX_BF16_QUIET_BIT 0x0040u
#define KX_E8M0_NAN 0xFFu
#define KX_FP32_MANT_BITS 23

static inline uint32_t kx_f32_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

static inline float kx_f32_from_bits(uint32_t u) {
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
}

/* The scalar codecs hot loops need are defined here, inline: a call to the exported
 * versions would go through the PLT of the shared library and spill the vector registers
 * of the loop around it. */

/* bf16 is the top half of an fp32: widening is exact. */
static inline float kx_bf16_widen(uint16_t bits) { return kx_f32_from_bits((uint32_t)bits << 16); }

/* Round to nearest even; a NaN keeps sign and payload and becomes quiet. */
static inline uint16_t kx_bf16_round(float v) {
  uint32_t u = kx_f32_bits(v);
  if (isnan(v)) return (uint16_t)((u >> 16) | KX_BF16_QUIET_BIT);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* 2^(s - 127), built from bits (s = 0 gives the fp32 subnormal 2^-127); 0xFF is NaN. */
static inline float kx_e8m0_value(uint8_t s) {
  if (s == KX_E8M0_NAN) return NAN;
  if (s == 0) return kx_f32_from_bits(1u << (KX_FP32_MANT_BITS - 1));
  return kx_f32_from_bits((uint32_t)s << KX_FP32_MANT_BITS);
}

/* Decoding MXFP4 a byte at a time: entry b holds the e2m1 values of its low and high
 * nibble (low nibble = even column), unscaled. Built per call: no global state. */
typedef struct kx_e2m1_pair_lut {
  float pair[256][2];
} kx_e2m1_pair_lut;
void kx_e2m1_pair_lut_init(kx_e2m1_pair_lut *lut);

/* One MXFP4 row of `cols` elements (cols % 32 == 0) to fp32: q [cols / 2], scales [cols / 32]. */
void kx_mxfp4_decode_row(const uint8_t *q, const uint8_t *scales, int64_t cols,
                         const kx_e2m1_pair_lut *lut, float *out);

/* out = dequantize(quantize_mxfp8(v)) for one row, cols % 32 == 0. v and out may alias
 * (each block is read in full before it is written). */
void kx_mxfp8_roundtrip_row(const float *v, int64_t cols, kx_scale_mode mode, float *out);

/* Lanes of the dot-product accumulator: enough independent add chains to hide FP add
 * latency, and a fixed summation order (lane l sums elements l, l + LANES, ...; lanes
 * are then added 0..LANES-1), so results never depend on threads. */
#define KX_DOT_LANES 16

/* sum_k a[k] * b[k] in fp32, n % KX_DOT_LANES == 0. */
static inline float kx_dot_f32(const float *a, const float *b, int64_t n) {
  float acc[KX_DOT_LANES] = {0};
  for (int64_t k = 0; k < n; k += KX_DOT_LANES)
    for (int l = 0; l < KX_DOT_LANES; ++l) acc[l] += a[k + l] * b[k + l];
  float sum = 0.0f;
  for (int l = 0; l < KX_DOT_LANES; ++l) sum += acc[l];
  return sum;
}

#endif /* KX_CPU_MX_INTERNAL_H */
