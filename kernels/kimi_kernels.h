/* kimi_kernels.h: the one door between csrc/ (C11 host code) and kernels/ (CUDA C).
 *
 * Only plain structs and C functions cross it: every call takes its arguments by
 * pointer to a params struct and a cudaStream_t, and returns cudaError_t. No templates,
 * no C++ types. Device pointers are plain pointers; bf16 values travel as uint16_t.
 */
#ifndef KIMI_KERNELS_H
#define KIMI_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- wiring probe: out[i] = in[i] + value (proves the build links kernels) ---- */
cudaError_t kx_probe_add(const float *in, float *out, float value, int64_t n,
                         cudaStream_t stream);

/* ---- HBM read probe: reads n_bytes once with 16-byte loads and folds them into
 * *sink so the loads stay; benchmarks quote it as the floor's bandwidth. ---- */
cudaError_t kx_probe_read(const void *data, int64_t n_bytes, uint32_t *sink,
                          cudaStream_t stream);

/* ---- MX formats on the device (SPEC 2) ----------------------------------------
 * q[r, c] = e4m3 of x[r, c] * 2^-e, scales[r, c / 32] = e + 127, blocks of 32 along
 * the row. cols % 32 == 0. Bit-identical to the CPU backend. */
typedef struct kx_quantize_args {
  const uint16_t *x;  /* bf16 [rows, cols], row stride in elements */
  int64_t rows, cols, x_row_stride;
  int32_t floor_mode; /* 0: rceil, 1: floor */
  uint8_t *q;         /* [rows, cols] contiguous */
  uint8_t *scales;    /* [rows, cols / 32] contiguous */
} kx_quantize_args;

cudaError_t kx_quantize_mxfp8(const kx_quantize_args *args, cudaStream_t stream);

/* ---- routed experts (SPEC 3) ---------------------------------------------------- */
typedef struct kx_moe_shape {
  int32_t experts; /* E, 1..4096 */
  int32_t hidden;  /* H, % 64 == 0, <= KX_MOE_MAX_DIM */
  int32_t inter;   /* I, % 32 == 0, <= KX_MOE_MAX_DIM */
  int32_t top_k;   /* K_top, 1..32 */
} kx_moe_shape;

/* The largest H and I the kernel takes: its tile indices are divided by multiplication,
 * exact while (tiles of a unit)^2 x units < 2^40. */
#define KX_MOE_MAX_DIM 65536

/* Bytes of the kernel-layout copy of the weights (w13 + s13 + w2 + s2 repacked). */
size_t kx_moe_packed_bytes(const kx_moe_shape *shape);

typedef struct kx_moe_pack_args {
  kx_moe_shape shape;
  const uint8_t *w13, *s13, *w2, *s2; /* standard layout (SPEC 3), device, contiguous */
  void *packed;                       /* kx_moe_packed_bytes(shape) bytes, device */
} kx_moe_pack_args;

cudaError_t kx_moe_pack(const kx_moe_pack_args *args, cudaStream_t stream);

/* Launch configuration chosen once per (shape, device) at prepare. */
typedef struct kx_moe_config {
  int32_t grid;          /* persistent CTAs, all co-resident */
  int32_t smem_bytes;    /* dynamic shared memory per CTA */
  int32_t chunk_tokens;  /* tokens per launch; run() launches ceil(B / chunk) times */
} kx_moe_config;

/* Picks the config for `device`, which must be the current device (the kernel attributes are
 * set there), and checks co-residency; raises the kernel's shared-memory limit. Returns
 * cudaErrorInvalidValue for a shape outside SPEC 3's limits, cudaErrorInvalidConfiguration if
 * the device cannot run it (shared memory, grid, residency). */
cudaError_t kx_moe_configure(const kx_moe_shape *shape, int device, kx_moe_config *config);

/* Scratch bytes one layer of this shape needs; every layer of a model may share one
 * scratch on one stream. Must be zeroed once when allocated. */
size_t kx_moe_scratch_bytes(const kx_moe_shape *shape, const kx_moe_config *config);

typedef struct kx_moe_args {
  kx_moe_shape shape;
  kx_moe_config config;
  const void *packed;        /* from kx_moe_pack */
  void *scratch;             /* kx_moe_scratch_bytes, zeroed at allocation */
  const uint16_t *x;         /* bf16 [batch, H] */
  int64_t x_row_stride;      /* elements */
  const int32_t *ids;        /* int32 [batch, top_k] */
  int64_t ids_row_stride;    /* elements */
  const float *route_weights;/* fp32 [batch, top_k], or NULL for per-slot rows */
  int64_t weights_row_stride;/* elements */
  uint16_t *out;             /* bf16 [batch * top_k, H] rows, or [batch, H] combined */
  int64_t out_row_stride;    /* elements */
  int32_t batch;
  float beta, linear_beta;   /* SiTU caps; INFINITY disables a cap */
  int32_t hidden_floor;      /* hidden MXFP8 scales: 0 rceil, 1 floor */
  unsigned long long *fault; /* the layer's fault word (8 bytes, zeroed at allocation): SPEC 7's
                                record of its first bad id, apart from the scratch that layers share */
} kx_moe_args;

cudaError_t kx_moe_run(const kx_moe_args *args, cudaStream_t stream);

/* The first bad id that the runs given this fault word met since its last read (SPEC 7).
 * Synchronizes the stream, then clears the word. */
typedef struct kx_moe_fault {
  int32_t bad;   /* 0: none */
  int32_t token, slot, id;
} kx_moe_fault;

cudaError_t kx_moe_read_fault(unsigned long long *word, const kx_moe_shape *shape,
                              kx_moe_fault *fault, cudaStream_t stream);

/* ---- the skinny GEMM (SPEC 4) ----------------------------------------------------
 * y[M, N] = x[M, K] @ W[N, K]^T. Plain: all N columns to y as bf16. Split: columns
 * [0, valid) to logits as fp32 and columns [split, N) to latent as bf16; -0.0 is
 * written as +0.0. Output pointers already point at the caller's column base.
 * Requires: K % 64 == 0; W contiguous and 16-byte aligned; x 16-byte aligned with
 * x_row_stride % 8 == 0 and >= K (ignored when M == 1); any N >= 1; any M >= 0 (each
 * launch covers max_m rows of x, kx_gemm_run launches ceil(M / max_m) times; M == 0 does
 * nothing). Outputs: any row stride, column stride 1. Results are deterministic and
 * independent of M (a token's row is bit-identical at every batch size). */
typedef struct kx_gemm_config {
  int32_t grid;         /* CTAs: ceil(N / tile_n) * cluster */
  int32_t cluster;      /* CTAs per cluster = split-K ways (1, 2, 4 or 8) */
  int32_t smem_bytes;   /* dynamic shared memory per CTA */
  int32_t max_m;        /* largest M one launch handles (64) */
  int32_t tile_n;       /* rows of W per cluster (64, 128 or 256) */
  int32_t threads;      /* threads per CTA */
  int32_t waves;        /* ceil(grid / co-resident CTAs) on this device; 1 is the goal */
  int32_t pdl;          /* 1: launched as a programmatic dependent of the previous kernel on
                           the stream (weights load before the wait); env KIMI_EXPERTS_PDL=0 at
                           configure time sets 0 (benchmarks compare the two) */
} kx_gemm_config;

/* Picks the config for (N, K) on `device` (sm_90 only: cudaErrorInvalidDevice otherwise),
 * raises the kernels' shared-memory limit there, restores the caller's current device.
 * Returns cudaErrorInvalidValue for N < 1 or K not a positive multiple of 64. */
cudaError_t kx_gemm_configure(int32_t n, int32_t k, int device, kx_gemm_config *config);

typedef struct kx_gemm_args {
  kx_gemm_config config;   /* from kx_gemm_configure(n, k, ...) for this n and k */
  const uint16_t *w;       /* bf16 [N, K], contiguous */
  int32_t n, k;
  const uint16_t *x;       /* bf16 [M, K] */
  int64_t x_row_stride;    /* elements */
  int32_t m;
  int32_t split_epilogue;  /* 0: plain, 1: split */
  uint16_t *y;             /* plain: bf16 [M, N] */
  int64_t y_row_stride;
  float *logits;           /* split: fp32 [M, valid]; may be NULL when valid == 0 */
  int64_t logits_row_stride;
  int32_t valid;
  uint16_t *latent;        /* split: bf16 [M, N - split]; may be NULL when split == N */
  int64_t latent_row_stride;
  int32_t split;
} kx_gemm_args;

/* Launches on `stream` with cudaLaunchKernelEx (cluster dims + programmatic stream
 * serialization when config.pdl): no allocation, no synchronization, graph-capturable.
 * Every argument is checked before the first launch (cudaErrorInvalidValue); the first
 * CUDA error is returned. Host cost: one tensor-map encode for W plus one per launch. */
cudaError_t kx_gemm_run(const kx_gemm_args *args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* KIMI_KERNELS_H */
