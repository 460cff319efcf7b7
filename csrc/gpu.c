/* gpu.c: host-side CUDA glue (see gpu.h). The only file in csrc/ that includes the CUDA
 * runtime or kernels/kimi_kernels.h. Two builds:
 *   KX_WITH_CUDA: the kernels are linked in (setup.py compiled the .cu files with nvcc);
 *                 availability is still decided at run time (driver, device, sm_90).
 *   otherwise:    every entry point refuses with the reason the build recorded.
 */
#include "gpu.h"

#include <stdio.h>
#include <string.h>

/* setup.py defines KX_BUILD_NOTE as why CUDA was left out (CPU-only builds). */
#ifndef KX_BUILD_NOTE
#define KX_BUILD_NOTE "built without CUDA kernels (no nvcc at build time)"
#endif

#ifndef KX_WITH_CUDA

void kx_gpu_query(kx_gpu_status *status) {
  memset(status, 0, sizeof *status);
  snprintf(status->reason, sizeof status->reason, "%s", KX_BUILD_NOTE);
}

int kx_gpu_require(const char *arg, int device) {
  PyErr_Format(PyExc_ValueError,
               "%s: got a tensor on cuda:%d, but this kimi_experts has no CUDA backend: %s "
               "(rebuild with nvcc on PATH or CUDA_HOME set, or pass CPU tensors)",
               arg, device, KX_BUILD_NOTE);
  return -1;
}

static int refuse(kx_state *st) {
  PyErr_Format(st->error, "this kimi_experts has no CUDA backend: %s", KX_BUILD_NOTE);
  return -1;
}

int kx_gpu_alloc_zeroed(kx_state *st, int device, size_t bytes, void **ptr) {
  (void)device, (void)bytes;
  *ptr = NULL;
  return refuse(st);
}
void kx_gpu_free(int device, void *ptr) { (void)device, (void)ptr; }

kx_gpu_moe *kx_gpu_moe_create(kx_state *st, const kx_moe_desc *desc, const uint8_t *w13,
                              const uint8_t *s13, const uint8_t *w2, const uint8_t *s2,
                              int device, uintptr_t stream) {
  (void)desc, (void)w13, (void)s13, (void)w2, (void)s2, (void)device, (void)stream;
  refuse(st);
  return NULL;
}
void kx_gpu_moe_destroy(kx_gpu_moe *moe) { (void)moe; }
size_t kx_gpu_moe_packed_bytes(const kx_gpu_moe *moe) { return (void)moe, 0; }
size_t kx_gpu_moe_scratch_bytes(const kx_gpu_moe *moe) { return (void)moe, 0; }
int kx_gpu_moe_run(kx_state *st, const kx_gpu_moe *moe, void *scratch,
                   const kx_cpu_moe_call *call, uintptr_t stream) {
  (void)moe, (void)scratch, (void)call, (void)stream;
  return refuse(st);
}
int kx_gpu_moe_read_fault(kx_state *st, const kx_gpu_moe *moe, kx_cpu_fault *fault,
                          uintptr_t stream) {
  (void)moe, (void)stream;
  memset(fault, 0, sizeof *fault);
  return refuse(st);
}
kx_gpu_gemm *kx_gpu_gemm_create(kx_state *st, int32_t n, int32_t k, int device) {
  (void)n, (void)k, (void)device;
  refuse(st);
  return NULL;
}
void kx_gpu_gemm_destroy(kx_gpu_gemm *gemm) { (void)gemm; }
int kx_gpu_gemm_run(kx_state *st, const kx_gpu_gemm *gemm, const kx_cpu_gemm_call *call,
                    uintptr_t stream) {
  (void)gemm, (void)call, (void)stream;
  return refuse(st);
}
int kx_gpu_quantize_mxfp8(kx_state *st, int device, const uint16_t *x, int64_t rows,
                          int64_t cols, int64_t x_row_stride, int floor_mode, uint8_t *q,
                          uint8_t *scales, uintptr_t stream) {
  (void)device, (void)x, (void)rows, (void)cols, (void)x_row_stride, (void)floor_mode;
  (void)q, (void)scales, (void)stream;
  return refuse(st);
}
int kx_gpu_probe_add(kx_state *st, int device, const float *in, float *out, float value,
                     int64_t n, uintptr_t stream) {
  (void)device, (void)in, (void)out, (void)value, (void)n, (void)stream;
  return refuse(st);
}
int kx_gpu_probe_read(kx_state *st, int device, const void *data, int64_t n_bytes,
                      uint32_t *sink, uintptr_t stream) {
  (void)device, (void)data, (void)n_bytes, (void)sink, (void)stream;
  return refuse(st);
}
void kx_gpu_state_clear(kx_state *st) { (void)st; }

#else /* KX_WITH_CUDA */

#include <cuda_runtime_api.h>

#include "kimi_kernels.h"

/* The device's major compute capability the kernels are built for (sm_90a). */
#define KX_SM_MAJOR 9

static int raise_cuda(kx_state *st, cudaError_t err, const char *where) {
  (void)cudaGetLastError(); /* clear a non-sticky error so later calls start clean */
  PyErr_Format(st->cuda_error, "%s failed: %s: %s", where, cudaGetErrorName(err),
               cudaGetErrorString(err));
  return -1;
}

static cudaStream_t as_stream(uintptr_t stream) { return (cudaStream_t)stream; }

/* ---- device guard: work on `device`, then give the caller its current device back -- */

typedef struct dev_guard {
  int prev;
  int switched;
} dev_guard;

static int guard_enter(kx_state *st, int device, dev_guard *g) {
  g->switched = 0;
  cudaError_t err = cudaGetDevice(&g->prev);
  if (err != cudaSuccess) return raise_cuda(st, err, "cudaGetDevice");
  if (g->prev != device) {
    err = cudaSetDevice(device);
    if (err != cudaSuccess) return raise_cuda(st, err, "cudaSetDevice");
    g->switched = 1;
  }
  return 0;
}

static void guard_leave(dev_guard *g) {
  if (g->switched) (void)cudaSetDevice(g->prev);
}

/* ---- availability ------------------------------------------------------------------ */

/* Why CUDA cannot be used (reason set), or 0 with *count devices. */
static int probe_runtime(int *count, char *reason, size_t n) {
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err == cudaSuccess && *count > 0) return 0;
  (void)cudaGetLastError();
  if (err == cudaSuccess || err == cudaErrorNoDevice) {
    snprintf(reason, n, "no CUDA device");
    return -1;
  }
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  if (driver == 0)
    snprintf(reason, n, "no CUDA driver");
  else if (err == cudaErrorInsufficientDriver)
    snprintf(reason, n, "CUDA driver %d.%d is older than the CUDA runtime %d.%d",
             driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
  else
    snprintf(reason, n, "CUDA initialization failed: %s: %s", cudaGetErrorName(err),
             cudaGetErrorString(err));
  (void)cudaGetLastError();
  return -1;
}

/* 0 when `device` is an sm_90 device; otherwise the reason. */
static int probe_device(int device, char *reason, size_t n, char *name, size_t name_n) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(reason, n, "cannot query cuda:%d", device);
    return -1;
  }
  if (name != NULL) {
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
      snprintf(name, name_n, "%s", prop.name);
    else
      (void)cudaGetLastError();
  }
  if (major != KX_SM_MAJOR) {
    snprintf(reason, n, "device sm_%d%d is not supported (needs sm_90)", major, minor);
    return -1;
  }
  return 0;
}

void kx_gpu_query(kx_gpu_status *status) {
  memset(status, 0, sizeof *status);
  status->built_with_cuda = 1;
  int count = 0, device = 0;
  if (probe_runtime(&count, status->reason, sizeof status->reason) < 0) return;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = 0;
  }
  if (probe_device(device, status->reason, sizeof status->reason, status->device,
                   sizeof status->device) < 0)
    return;
  status->available = 1;
}

int kx_gpu_require(const char *arg, int device) {
  char reason[160];
  int count = 0;
  if (probe_runtime(&count, reason, sizeof reason) == 0) {
    if (device < 0 || device >= count)
      snprintf(reason, sizeof reason, "cuda:%d does not exist (%d device%s)", device, count,
               count == 1 ? "" : "s");
    else if (probe_device(device, reason, sizeof reason, NULL, 0) == 0)
      return 0;
  }
  PyErr_Format(PyExc_ValueError,
               "%s: got a tensor on cuda:%d, but the CUDA backend cannot run there: %s", arg,
               device, reason);
  return -1;
}

/* ---- memory ------------------------------------------------------------------------ */

int kx_gpu_alloc_zeroed(kx_state *st, int device, size_t bytes, void **ptr) {
  *ptr = NULL;
  if (bytes == 0) return 0;
  dev_guard g;
  if (guard_enter(st, device, &g) < 0) return -1;
  void *p = NULL;
  cudaError_t err = cudaMalloc(&p, bytes);
  const char *where = "cudaMalloc";
  if (err == cudaSuccess) {
    /* Zeroed once at birth; the kernels keep it consistent from then on. */
    err = cudaMemset(p, 0, bytes);
    where = "cudaMemset";
    if (err == cudaSuccess) {
      err = cudaStreamSynchronize(0);
      where = "cudaStreamSynchronize";
    }
    if (err != cudaSuccess) (void)cudaFree(p);
  }
  guard_leave(&g);
  if (err != cudaSuccess) {
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      PyErr_Format(PyExc_MemoryError, "cudaMalloc of %zu bytes on cuda:%d failed: out of memory",
                   bytes, device);
      return -1;
    }
    return raise_cuda(st, err, where);
  }
  *ptr = p;
  return 0;
}

void kx_gpu_free(int device, void *ptr) {
  if (ptr == NULL) return;
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && prev != device) (void)cudaSetDevice(device);
  (void)cudaFree(ptr); /* may fail at interpreter exit once the runtime is gone */
  if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
  (void)cudaGetLastError();
}

/* ---- routed experts ---------------------------------------------------------------- */

struct kx_gpu_moe {
  kx_moe_shape shape;
  kx_moe_config config;
  void *packed;
  size_t packed_bytes;
  unsigned long long *fault; /* this layer's record of its first bad id (SPEC 7), zeroed */
  size_t scratch_bytes;
  int device;
  float beta, linear_beta;
  int32_t hidden_floor;
};

kx_gpu_moe *kx_gpu_moe_create(kx_state *st, const kx_moe_desc *desc, const uint8_t *w13,
                              const uint8_t *s13, const uint8_t *w2, const uint8_t *s2,
                              int device, uintptr_t stream) {
  kx_gpu_moe *moe = PyMem_Calloc(1, sizeof *moe);
  if (moe == NULL) {
    PyErr_NoMemory();
    return NULL;
  }
  if (desc->hidden > KX_MOE_MAX_DIM || desc->inter > KX_MOE_MAX_DIM) {
    PyErr_Format(PyExc_ValueError, "w13: the CUDA kernel takes H and I up to %d, got H = %d, I = %d",
                 KX_MOE_MAX_DIM, (int)desc->hidden, (int)desc->inter);
    PyMem_Free(moe);
    return NULL;
  }
  moe->shape = (kx_moe_shape){desc->experts, desc->hidden, desc->inter, desc->top_k};
  moe->device = device;
  moe->beta = desc->beta;
  moe->linear_beta = desc->linear_beta;
  moe->hidden_floor = desc->hidden_floor;

  dev_guard g;
  if (guard_enter(st, device, &g) < 0) {
    PyMem_Free(moe);
    return NULL;
  }
  cudaError_t err = kx_moe_configure(&moe->shape, device, &moe->config);
  const char *where = "kx_moe_configure";
  if (err == cudaSuccess) {
    moe->packed_bytes = kx_moe_packed_bytes(&moe->shape);
    moe->scratch_bytes = kx_moe_scratch_bytes(&moe->shape, &moe->config);
    if (moe->packed_bytes > 0) {
      err = cudaMalloc(&moe->packed, moe->packed_bytes);
      where = "cudaMalloc (packed weights)";
    }
  }
  if (err == cudaSuccess) {
    kx_moe_pack_args pack = {moe->shape, w13, s13, w2, s2, moe->packed};
    err = kx_moe_pack(&pack, as_stream(stream));
    where = "kx_moe_pack";
  }
  if (err == cudaSuccess) {
    /* The caller may drop its standard-layout tensors once we return. */
    err = cudaStreamSynchronize(as_stream(stream));
    where = "cudaStreamSynchronize (after kx_moe_pack)";
  }
  if (err != cudaSuccess) {
    raise_cuda(st, err, where);
    if (moe->packed != NULL) (void)cudaFree(moe->packed);
    (void)cudaGetLastError();
    guard_leave(&g);
    PyMem_Free(moe);
    return NULL;
  }
  guard_leave(&g);
  if (kx_gpu_alloc_zeroed(st, device, sizeof *moe->fault, (void **)&moe->fault) < 0) {
    kx_gpu_moe_destroy(moe);
    return NULL;
  }
  return moe;
}

void kx_gpu_moe_destroy(kx_gpu_moe *moe) {
  if (moe == NULL) return;
  kx_gpu_free(moe->device, moe->packed);
  kx_gpu_free(moe->device, moe->fault);
  PyMem_Free(moe);
}

size_t kx_gpu_moe_packed_bytes(const kx_gpu_moe *moe) { return moe->packed_bytes; }
size_t kx_gpu_moe_scratch_bytes(const kx_gpu_moe *moe) { return moe->scratch_bytes; }

int kx_gpu_moe_run(kx_state *st, const kx_gpu_moe *moe, void *scratch,
                   const kx_cpu_moe_call *call, uintptr_t stream) {
  kx_moe_args args = {
      .shape = moe->shape,
      .config = moe->config,
      .packed = moe->packed,
      .scratch = scratch,
      .x = call->x,
      .x_row_stride = call->x_row_stride,
      .ids = call->ids,
      .ids_row_stride = call->ids_row_stride,
      .route_weights = call->route_weights,
      .weights_row_stride = call->weights_row_stride,
      .out = call->out,
      .out_row_stride = call->out_row_stride,
      .batch = (int32_t)call->batch,
      .beta = moe->beta,
      .linear_beta = moe->linear_beta,
      .hidden_floor = moe->hidden_floor,
      .fault = moe->fault,
  };
  dev_guard g;
  if (guard_enter(st, moe->device, &g) < 0) return -1;
  cudaError_t err = kx_moe_run(&args, as_stream(stream));
  guard_leave(&g);
  if (err != cudaSuccess) return raise_cuda(st, err, "kx_moe_run");
  return 0;
}

int kx_gpu_moe_read_fault(kx_state *st, const kx_gpu_moe *moe, kx_cpu_fault *fault,
                          uintptr_t stream) {
  memset(fault, 0, sizeof *fault);
  kx_moe_fault f = {0, 0, 0, 0};
  dev_guard g;
  if (guard_enter(st, moe->device, &g) < 0) return -1;
  cudaError_t err;
  Py_BEGIN_ALLOW_THREADS /* it waits for the stream */
  err = kx_moe_read_fault(moe->fault, &moe->shape, &f, as_stream(stream));
  Py_END_ALLOW_THREADS
  guard_leave(&g);
  if (err != cudaSuccess) return raise_cuda(st, err, "kx_moe_read_fault");
  fault->bad = f.bad;
  fault->token = f.token;
  fault->slot = f.slot;
  fault->id = f.id;
  return 0;
}

/* ---- skinny GEMM ------------------------------------------------------------------- */

struct kx_gpu_gemm {
  kx_gemm_config config;
  int32_t n, k;
  int device;
};

kx_gpu_gemm *kx_gpu_gemm_create(kx_state *st, int32_t n, int32_t k, int device) {
  kx_gpu_gemm *gemm = PyMem_Calloc(1, sizeof *gemm);
  if (gemm == NULL) {
    PyErr_NoMemory();
    return NULL;
  }
  gemm->n = n;
  gemm->k = k;
  gemm->device = device;
  dev_guard g;
  if (guard_enter(st, device, &g) < 0) {
    PyMem_Free(gemm);
    return NULL;
  }
  cudaError_t err = kx_gemm_configure(n, k, device, &gemm->config);
  guard_leave(&g);
  if (err != cudaSuccess) {
    raise_cuda(st, err, "kx_gemm_configure");
    PyMem_Free(gemm);
    return NULL;
  }
  return gemm;
}

void kx_gpu_gemm_destroy(kx_gpu_gemm *gemm) { PyMem_Free(gemm); }

int kx_gpu_gemm_run(kx_state *st, const kx_gpu_gemm *gemm, const kx_cpu_gemm_call *call,
                    uintptr_t stream) {
  /* m <= INT32_MAX (prepare); kx_gemm_run checks everything, then launches per 64 rows */
  const kx_gemm_args args = {
      .config = gemm->config,
      .w = call->w,
      .n = gemm->n,
      .k = gemm->k,
      .x = call->x,
      .x_row_stride = call->x_row_stride,
      .m = (int32_t)call->m,
      .split_epilogue = call->split_epilogue,
      .y = call->y,
      .y_row_stride = call->y_row_stride,
      .logits = call->logits,
      .logits_row_stride = call->logits_row_stride,
      .valid = (int32_t)call->valid,
      .latent = call->latent,
      .latent_row_stride = call->latent_row_stride,
      .split = (int32_t)call->split,
  };
  dev_guard g;
  if (guard_enter(st, gemm->device, &g) < 0) return -1;
  const cudaError_t err = kx_gemm_run(&args, as_stream(stream));
  guard_leave(&g);
  if (err != cudaSuccess) return raise_cuda(st, err, "kx_gemm_run");
  return 0;
}

/* ---- formats and probes ------------------------------------------------------------ */

int kx_gpu_quantize_mxfp8(kx_state *st, int device, const uint16_t *x, int64_t rows,
                          int64_t cols, int64_t x_row_stride, int floor_mode, uint8_t *q,
                          uint8_t *scales, uintptr_t stream) {
  kx_quantize_args args = {x, rows, cols, x_row_stride, floor_mode, q, scales};
  dev_guard g;
  if (guard_enter(st, device, &g) < 0) return -1;
  cudaError_t err = kx_quantize_mxfp8(&args, as_stream(stream));
  guard_leave(&g);
  if (err != cudaSuccess) return raise_cuda(st, err, "kx_quantize_mxfp8");
  return 0;
}

int kx_gpu_probe_add(kx_state *st, int device, const float *in, float *out, float value,
                     int64_t n, uintptr_t stream) {
  dev_guard g;
  if (guard_enter(st, device, &g) < 0) return -1;
  cudaError_t err = kx_probe_add(in, out, value, n, as_stream(stream));
  guard_leave(&g);
  if (err != cudaSuccess) return raise_cuda(st, err, "kx_probe_add");
  return 0;
}

int kx_gpu_probe_read(kx_state *st, int device, const void *data, int64_t n_bytes,
                      uint32_t *sink, uintptr_t stream) {
  if (sink == NULL && (device < 0 || device >= KX_MAX_GPUS)) {
    PyErr_Format(PyExc_ValueError, "probe_read: device cuda:%d is beyond the %d supported",
                 device, KX_MAX_GPUS);
    return -1;
  }
  dev_guard g;
  if (guard_enter(st, device, &g) < 0) return -1;
  cudaError_t err = cudaSuccess;
  if (sink == NULL && st->probe_sink[device] == NULL) {
    /* Never read, so neither zeroed nor synchronized: the first (eager) call may
     * allocate it, later ones are capturable. */
    err = cudaMalloc(&st->probe_sink[device], sizeof(uint32_t));
    if (err != cudaSuccess) {
      st->probe_sink[device] = NULL;
      guard_leave(&g);
      return raise_cuda(st, err, "cudaMalloc (probe_read sink)");
    }
  }
  if (sink == NULL) sink = (uint32_t *)st->probe_sink[device];
  err = kx_probe_read(data, n_bytes, sink, as_stream(stream));
  guard_leave(&g);
  if (err != cudaSuccess) return raise_cuda(st, err, "kx_probe_read");
  return 0;
}

void kx_gpu_state_clear(kx_state *st) {
  for (int d = 0; d < KX_MAX_GPUS; d++) {
    kx_gpu_free(d, st->probe_sink[d]);
    st->probe_sink[d] = NULL;
  }
}

#endif /* KX_WITH_CUDA */
