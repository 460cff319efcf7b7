/* gemm.c: the skinny GEMM in front of the MoE layer on the CPU (SPEC 4).
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k]      bf16 inputs, fp32 products and accumulation
 *
 * Epilogues: plain (y as bf16), or split (columns [0, valid) as fp32 router logits,
 * columns [split, N) as bf16 latent at column n - split; [valid, split) is not
 * computed). -0.0 is never written, also not when a tiny negative rounds to bf16 -0.0:
 * consumers use the -0.0 pattern as a "not yet written" sentinel.
 *
 * Threads split the computed columns statically; each column's W row is streamed
 * once and dotted with every x row (M is small, so all of x stays in cache).
 */
#include <stdint.h>

#include "cpu_backend.h"
#include "cpu_parallel.h"
#include "mx_internal.h"

#define BF16_NEGATIVE_ZERO 0x8000u

/* sum_k a[k] * b[k] for bf16 rows of any length, in the fixed lane order of
 * kx_dot_f32 (the tail goes to the first lanes). */
static float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t k) {
  float acc[KX_DOT_LANES] = {0};
  const int64_t whole = k - k % KX_DOT_LANES;
  for (int64_t i = 0; i < whole; i += KX_DOT_LANES)
    for (int l = 0; l < KX_DOT_LANES; ++l)
      acc[l] += kx_bf16_widen(a[i + l]) * kx_bf16_widen(b[i + l]);
  for (int64_t i = whole; i < k; ++i) acc[i - whole] += kx_bf16_widen(a[i]) * kx_bf16_widen(b[i]);
  float sum = 0.0f;
  for (int l = 0; l < KX_DOT_LANES; ++l) sum += acc[l];
  return sum;
}

static float f32_without_negative_zero(float v) { return v == 0.0f ? 0.0f : v; }

static uint16_t bf16_without_negative_zero(float v) {
  const uint16_t bits = kx_bf16_round(v);
  return bits == BF16_NEGATIVE_ZERO ? 0 : bits;
}

/* Columns that get written, numbered densely: all N (plain), or [0, valid) then
 * [split, N) (split epilogue). */
static int64_t computed_columns(const kx_cpu_gemm_call *c) {
  return c->split_epilogue ? c->valid + (c->n - c->split) : c->n;
}

static int64_t column_of(const kx_cpu_gemm_call *c, int64_t i) {
  return c->split_epilogue && i >= c->valid ? c->split + (i - c->valid) : i;
}

static void store(const kx_cpu_gemm_call *c, int64_t m, int64_t n, float v) {
  if (!c->split_epilogue)
    c->y[m * c->y_row_stride + n] = bf16_without_negative_zero(v);
  else if (n < c->valid)
    c->logits[m * c->logits_row_stride + n] = f32_without_negative_zero(v);
  else
    c->latent[m * c->latent_row_stride + (n - c->split)] = bf16_without_negative_zero(v);
}

void kx_cpu_gemm(const kx_cpu_gemm_call *call) {
  const int64_t columns = computed_columns(call);
  KX_OMP(parallel for schedule(static))
  for (int64_t i = 0; i < columns; ++i) {
    const int64_t n = column_of(call, i);
    const uint16_t *w = call->w + n * call->k;
    for (int64_t m = 0; m < call->m; ++m)
      store(call, m, n, dot_bf16(w, call->x + m * call->x_row_stride, call->k));
  }
}
