/* gpu.h: the CUDA side of csrc/. Every call into the CUDA runtime and into
 * kernels/kimi_kernels.h lives in gpu.c; the Python-facing types call only these
 * functions, so they read the same with and without CUDA. Built without KX_WITH_CUDA,
 * the same functions exist and refuse with a clear error.
 *
 * Conventions: int functions return 0, or -1 with a Python exception set (CUDA failures
 * raise kimi_experts.CudaError naming the CUDA error and the function that failed).
 * Every call that touches a device switches to it first and switches back after, so the
 * caller's current device is never changed. Nothing here synchronizes unless it says so.
 */
#ifndef KX_GPU_H
#define KX_GPU_H

#include "kx.h" /* Python.h first */

#include <stddef.h>
#include <stdint.h>

#include "cpu/cpu_backend.h" /* the call structs are shared with the CPU backend */

/* Backend status for backend_info(): never raises. `reason` is "" when available. */
typedef struct kx_gpu_status {
  int built_with_cuda;
  int available;
  char reason[160];
  char device[256]; /* name of the current device, "" when none */
} kx_gpu_status;

void kx_gpu_query(kx_gpu_status *status);

/* ValueError naming `arg` unless CUDA device `device` can run the kernels (built with
 * CUDA, a driver, the device exists and is sm_90). */
int kx_gpu_require(const char *arg, int device);

/* ---- memory ---- */
/* *ptr = cudaMalloc(bytes) on `device`, zeroed and synchronized; NULL when bytes == 0. */
int kx_gpu_alloc_zeroed(kx_state *st, int device, size_t bytes, void **ptr);
/* Frees without raising (deallocators); errors are cleared. */
void kx_gpu_free(int device, void *ptr);

/* ---- routed experts ---- */
typedef struct kx_gpu_moe kx_gpu_moe; /* packed weights + launch config on one device */

typedef struct kx_moe_desc {
  int32_t experts, hidden, inter, top_k;
  float beta, linear_beta;
  int32_t hidden_floor; /* 0: rceil, 1: floor */
} kx_moe_desc;

/* Packs the standard-layout device weights into a new device buffer on `stream` and
 * waits for it, so the caller's tensors may be freed as soon as this returns. */
kx_gpu_moe *kx_gpu_moe_create(kx_state *st, const kx_moe_desc *desc, const uint8_t *w13,
                              const uint8_t *s13, const uint8_t *w2, const uint8_t *s2,
                              int device, uintptr_t stream);
void kx_gpu_moe_destroy(kx_gpu_moe *moe);
size_t kx_gpu_moe_packed_bytes(const kx_gpu_moe *moe);
size_t kx_gpu_moe_scratch_bytes(const kx_gpu_moe *moe);
/* One kx_moe_run on `stream`: no allocation, no synchronization. */
int kx_gpu_moe_run(kx_state *st, const kx_gpu_moe *moe, void *scratch,
                   const kx_cpu_moe_call *call, uintptr_t stream);
/* Synchronizes `stream`, reads and clears the first bad id this layer's runs met (its own
 * record: layers sharing a scratch do not see each other's). */
int kx_gpu_moe_read_fault(kx_state *st, const kx_gpu_moe *moe, kx_cpu_fault *fault,
                          uintptr_t stream);

/* ---- skinny GEMM ---- */
typedef struct kx_gpu_gemm kx_gpu_gemm;

kx_gpu_gemm *kx_gpu_gemm_create(kx_state *st, int32_t n, int32_t k, int device);
void kx_gpu_gemm_destroy(kx_gpu_gemm *gemm);
/* Launches on `stream`, in chunks of the config's largest M when m is larger. */
int kx_gpu_gemm_run(kx_state *st, const kx_gpu_gemm *gemm, const kx_cpu_gemm_call *call,
                    uintptr_t stream);

/* ---- formats and probes ---- */
int kx_gpu_quantize_mxfp8(kx_state *st, int device, const uint16_t *x, int64_t rows,
                          int64_t cols, int64_t x_row_stride, int floor_mode, uint8_t *q,
                          uint8_t *scales, uintptr_t stream);
int kx_gpu_probe_add(kx_state *st, int device, const float *in, float *out, float value,
                     int64_t n, uintptr_t stream);
/* sink: a device word, or NULL for the module's own per-device word. */
int kx_gpu_probe_read(kx_state *st, int device, const void *data, int64_t n_bytes,
                      uint32_t *sink, uintptr_t stream);
/* Frees what kx_state holds on devices (module free). */
void kx_gpu_state_clear(kx_state *st);

#endif /* KX_GPU_H */
