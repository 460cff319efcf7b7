/* cpu_backend.h: SPEC 2-4 in plain C11 (OpenMP when available). No Python here.
 *
 * bf16 values travel as uint16_t bit patterns. All strides are in elements.
 */
#ifndef KX_CPU_BACKEND_H
#define KX_CPU_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#define KX_MX_BLOCK 32

typedef enum kx_scale_mode { KX_SCALE_RCEIL = 0, KX_SCALE_FLOOR = 1 } kx_scale_mode;
typedef enum kx_elem_type { KX_ELEM_F32 = 0, KX_ELEM_BF16 = 1, KX_ELEM_F16 = 2 } kx_elem_type;

/* ---- scalar codecs (SPEC 2) ---- */
float kx_f16_to_float(uint16_t bits);

/* ---- block quantizers over a [rows, cols] matrix, cols % 32 == 0 ----
 * x: rows with x_row_stride elements apart, of the given element type.
 * mxfp8: q [rows, cols] bytes, scales [rows, cols / 32].
 * mxfp4: q [rows, cols / 2] bytes (low nibble = even column), scales [rows, cols / 32]. */
void kx_cpu_quantize_mxfp8(const void *x, kx_elem_type type, int64_t rows, int64_t cols,
                           int64_t x_row_stride, kx_scale_mode mode, uint8_t *q,
                           uint8_t *scales);
void kx_cpu_quantize_mxfp4(const void *x, kx_elem_type type, int64_t rows, int64_t cols,
                           int64_t x_row_stride, uint8_t *q, uint8_t *scales);
/* out [rows, cols] fp32 (exact). */
void kx_cpu_dequantize_mxfp8(const uint8_t *q, const uint8_t *scales, int64_t rows,
                             int64_t cols, float *out);
void kx_cpu_dequantize_mxfp4(const uint8_t *q, const uint8_t *scales, int64_t rows,
                             int64_t cols, float *out);

/* ---- the MoE layer (SPEC 3) ---- */
typedef struct kx_cpu_moe_layer {
  const uint8_t *w13, *s13, *w2, *s2;  /* standard layout, contiguous */
  int32_t experts, hidden, inter, top_k;
  float beta, linear_beta;             /* INFINITY disables a cap */
  kx_scale_mode hidden_scale;
} kx_cpu_moe_layer;

typedef struct kx_cpu_moe_call {
  const uint16_t *x;            /* bf16 [batch, H] */
  int64_t x_row_stride;
  const int32_t *ids;           /* [batch, top_k] */
  int64_t ids_row_stride;
  const float *route_weights;   /* [batch, top_k] or NULL: per-slot rows */
  int64_t weights_row_stride;
  int64_t batch;
  uint16_t *out;                /* [batch * top_k, H] or [batch, H] when combining */
  int64_t out_row_stride;
} kx_cpu_moe_call;

typedef struct kx_cpu_fault {
  int32_t bad;                  /* 0: every id was in range */
  int64_t token;
  int32_t slot, id;             /* the first bad (token, slot) in row-major order */
} kx_cpu_fault;

/* Rows of bad ids come out NaN (and so do combined rows that use them).
 * Returns 0, or -1 when memory for the work lists could not be allocated
 * (nothing is written then). */
int kx_cpu_moe_run(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                   kx_cpu_fault *fault);

/* ---- the skinny GEMM (SPEC 4) ---- */
typedef struct kx_cpu_gemm_call {
  const uint16_t *w;            /* bf16 [N, K] contiguous */
  int64_t n, k;
  const uint16_t *x;            /* bf16 [M, K] */
  int64_t x_row_stride, m;
  int32_t split_epilogue;       /* 0: plain y; 1: logits + latent */
  uint16_t *y; int64_t y_row_stride;
  float *logits; int64_t logits_row_stride; int64_t valid;
  uint16_t *latent; int64_t latent_row_stride; int64_t split;
} kx_cpu_gemm_call;

void kx_cpu_gemm(const kx_cpu_gemm_call *call);

#endif /* KX_CPU_BACKEND_H */
