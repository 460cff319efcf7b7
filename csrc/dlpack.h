/* dlpack.h: the DLPack ABI (structs only) and kimi_experts' import/export on top of it.
 *
 * The struct layouts below are the DLPack C ABI (dmlc/dlpack, v1.x): the legacy
 * DLManagedTensor (capsule "dltensor", ABI 0.x) and DLManagedTensorVersioned (capsule
 * "dltensor_versioned", ABI >= 1.0). They are written out here rather than vendored so
 * the build needs no download; every field keeps the ABI's type, size and order.
 *
 * On top of the ABI, kx_tensor is what the rest of csrc/ sees: a data pointer with the
 * byte offset applied, shape and strides in elements (always filled, also for producers
 * that give NULL strides), a dtype we know by name, the device, and an owner object
 * whose destruction calls the producer's deleter exactly once.
 */
#ifndef KX_DLPACK_H
#define KX_DLPACK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* ---- the DLPack ABI -------------------------------------------------------------- */

enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3, /* pinned host memory: readable by the CPU */
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16,
  kDLMAIA = 17,
};

enum {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
};

/* The ABI declares device_type as a C enum, which is a 4-byte int on every platform
 * DLPack supports; int32_t states that size. */
typedef struct DLDevice {
  int32_t device_type;
  int32_t device_id;
} DLDevice;

typedef struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct DLTensor {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides; /* elements; NULL means compact row-major */
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The highest ABI version this consumer understands and the one its exports carry. */
#define KX_DLPACK_MAJOR 1
#define KX_DLPACK_MINOR 0

_Static_assert(sizeof(DLDevice) == 8, "DLDevice is two 4-byte ints in the DLPack ABI");
_Static_assert(sizeof(DLDataType) == 4, "DLDataType is 4 bytes in the DLPack ABI");
_Static_assert(sizeof(DLTensor) == 48, "DLTensor layout must match the DLPack ABI");

/* ---- what csrc/ works with ------------------------------------------------------- */

#define KX_MAX_DIMS 8

typedef enum kx_dtype {
  KX_DTYPE_OTHER = 0,
  KX_DTYPE_UINT8,
  KX_DTYPE_INT32,
  KX_DTYPE_FLOAT32,
  KX_DTYPE_BFLOAT16,
  KX_DTYPE_FLOAT16,
} kx_dtype;

/* Devices as this library distinguishes them. */
typedef enum kx_device_kind { KX_DEVICE_CPU = 0, KX_DEVICE_CUDA = 1, KX_DEVICE_OTHER = 2 } kx_device_kind;

typedef struct kx_device {
  kx_device_kind kind;
  int32_t id; /* CUDA ordinal; 0 on the CPU */
} kx_device;

typedef struct kx_tensor {
  void *data; /* byte_offset already applied */
  int ndim;
  int64_t shape[KX_MAX_DIMS];
  int64_t strides[KX_MAX_DIMS]; /* elements, always filled */
  DLDataType dl_dtype;
  kx_dtype dtype;
  DLDevice dl_device;
  kx_device device;
  int readonly;     /* the producer marked the memory read-only (DLPack >= 1.0) */
  int copied;       /* the producer exported a copy (DLPack >= 1.0): writes would not reach it */
  PyObject *owner;  /* strong ref; its destruction calls the producer's deleter once */
  PyObject *source; /* strong ref to the object passed in, kept alive with the memory;
                     * types that keep a kx_tensor visit it in tp_traverse, so cycles
                     * through it (out -> ... -> layer) stay collectable */
} kx_tensor;

/* Stream values to pass to a producer's __dlpack__(stream=...) (the array API's
 * conventions): KX_STREAM_NO_SYNC asks it not to synchronize at all. KX_STREAM_ORDERED_CUDA
 * is ours, never passed on: the caller vouches for a CUDA producer whose work is ordered on
 * the library's stream already, so it is asked for KX_STREAM_NO_SYNC without a
 * __dlpack_device__() call first (0.65 us a torch tensor). */
#define KX_STREAM_NO_SYNC ((int64_t)-1)
#define KX_STREAM_ORDERED_CUDA ((int64_t)-2)

/* Import `obj` (an object with __dlpack__, or an unconsumed DLPack capsule) for the
 * argument named `arg`. For CUDA tensors `stream` is the cudaStream_t the library will
 * use the memory on (0 is the legacy default stream), KX_STREAM_NO_SYNC or
 * KX_STREAM_ORDERED_CUDA. Raises TypeError when obj is no tensor at all,
 * ValueError/BufferError when it cannot be used.
 * On success *out holds new references in out->owner and out->source (release both with
 * kx_tensor_release). */
int kx_tensor_import(PyObject *obj, const char *arg, int64_t stream, kx_tensor *out);
void kx_tensor_release(kx_tensor *t);

/* ---- checks: each sets ValueError naming `arg` with expected vs actual, returns -1 -- */

int kx_check_dtype(const kx_tensor *t, const char *arg, kx_dtype expected);
int kx_check_device(const kx_tensor *t, const char *arg, kx_device expected);
/* shape: ndim entries; -1 matches any extent. */
int kx_check_shape(const kx_tensor *t, const char *arg, int ndim, const int64_t *shape);
/* A 2-D tensor whose rows are contiguous (column stride 1) and do not overlap
 * (row stride >= columns); the row stride may be larger (padded rows, views). */
int kx_check_rows(const kx_tensor *t, const char *arg);
/* Raises ValueError naming both when two tensors that passed kx_check_rows share a byte. */
int kx_check_disjoint(const kx_tensor *out, const char *out_arg, const kx_tensor *in, const char *in_arg);
int kx_check_contiguous(const kx_tensor *t, const char *arg);
int kx_check_writable(const kx_tensor *t, const char *arg);
/* For CPU-side code: device must be the CPU (or pinned host memory). */
int kx_check_cpu(const kx_tensor *t, const char *arg, const char *why);

/* Row stride of a 2-D tensor (elements); rows of a 1-row tensor count as packed. */
int64_t kx_row_stride(const kx_tensor *t);
int64_t kx_numel(const kx_tensor *t);
size_t kx_dtype_size(kx_dtype dtype);
const char *kx_dtype_name(kx_dtype dtype);
/* The tensor's actual dtype, also when it is none of kx_dtype: "int64", "uint16", ... */
void kx_tensor_dtype_str(const kx_tensor *t, char *buf, size_t n);
/* Parses "uint8", "int32", "float32", "bfloat16", "float16"; KX_DTYPE_OTHER if unknown. */
kx_dtype kx_dtype_from_name(const char *name);
/* "cpu", "cuda:N", "rocm:N", ... into buf. */
void kx_dl_device_str(DLDevice device, char *buf, size_t n);
void kx_device_str(kx_device device, char *buf, size_t n);
/* "[16, 3584]" into buf: a shape or strides (negative ones as they are). */
void kx_shape_str(int ndim, const int64_t *dims, char *buf, size_t n);
/* ValueError "<arg>: expected <expected>, got strides ... for shape ..."; returns -1. */
int kx_raise_layout(const kx_tensor *t, const char *arg, const char *expected);

/* ---- export: a DLPack view of memory we hold (see _C.reinterpret) ------------------ */

/* Creates the _C.DLPackView type (module exec). */
PyObject *kx_dlpack_view_type_create(PyObject *module);
/* A new view of `src` (borrowed; its owner is kept alive) with dtype `dtype`, which must
 * have the same element size. */
PyObject *kx_dlpack_view_new(PyTypeObject *type, const kx_tensor *src, kx_dtype dtype);

#endif /* KX_DLPACK_H */
