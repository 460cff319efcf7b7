/* dlpack.c: DLPack import (any object with __dlpack__, or a capsule), the checks every
 * argument goes through, and a small export type (_C.DLPackView) for re-typed views.
 *
 * Protocol, as the consumer:
 *   1. __dlpack_device__() says where the tensor lives; for CUDA we pass the stream we
 *      will use the memory on (__dlpack__(stream=s)), so the producer orders its pending
 *      work before ours; CPU producers get no stream (NumPy refuses one). A caller that
 *      knows its producers are CUDA ones ordered on our stream already skips the query
 *      and asks for no synchronization (KX_STREAM_ORDERED_CUDA).
 *   2. We ask for max_version=(1, 0) (a "dltensor_versioned" capsule, which can say
 *      "read-only"); producers that predate it raise TypeError and get a plain call.
 *   3. A consumed capsule is renamed "used_dltensor[_versioned]" so its own destructor
 *      leaves the tensor alone; from then on an owner capsule of ours holds the managed
 *      tensor and calls the deleter exactly once when dropped. The kx_tensor also keeps
 *      a reference to the object passed in (kx_tensor.source), which the owning types
 *      show to the GC (a capsule cannot).
 * A capsule whose DLTensor we cannot read at all (version, ndim, lanes, alignment) is
 * refused before step 3, so the producer's capsule still frees it; checks of dtype,
 * shape and device come after, and a refused argument is then released by us (the
 * deleter runs, once, when the error is raised).
 */
#include "dlpack.h"

#include <stdio.h>
#include <string.h>

#include "kx.h"

static const char kCapsule[] = "dltensor";
static const char kCapsuleVersioned[] = "dltensor_versioned";
static const char kUsedCapsule[] = "used_dltensor";
static const char kUsedCapsuleVersioned[] = "used_dltensor_versioned";
static const char kOwner[] = "kimi_experts._C.dlpack_owner";
static const char kOwnerVersioned[] = "kimi_experts._C.dlpack_owner_versioned";

/* ---- names for messages ------------------------------------------------------------ */

size_t kx_dtype_size(kx_dtype dtype) {
  switch (dtype) {
    case KX_DTYPE_UINT8: return 1;
    case KX_DTYPE_BFLOAT16:
    case KX_DTYPE_FLOAT16: return 2;
    case KX_DTYPE_INT32:
    case KX_DTYPE_FLOAT32: return 4;
    default: return 0;
  }
}

const char *kx_dtype_name(kx_dtype dtype) {
  switch (dtype) {
    case KX_DTYPE_UINT8: return "uint8";
    case KX_DTYPE_INT32: return "int32";
    case KX_DTYPE_FLOAT32: return "float32";
    case KX_DTYPE_BFLOAT16: return "bfloat16";
    case KX_DTYPE_FLOAT16: return "float16";
    default: return "other";
  }
}

kx_dtype kx_dtype_from_name(const char *name) {
  static const kx_dtype all[] = {KX_DTYPE_UINT8, KX_DTYPE_INT32, KX_DTYPE_FLOAT32,
                                 KX_DTYPE_BFLOAT16, KX_DTYPE_FLOAT16};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (strcmp(name, kx_dtype_name(all[i])) == 0) return all[i];
  return KX_DTYPE_OTHER;
}

static kx_dtype dtype_of(DLDataType t) {
  if (t.lanes != 1) return KX_DTYPE_OTHER;
  if (t.code == kDLUInt && t.bits == 8) return KX_DTYPE_UINT8;
  if (t.code == kDLInt && t.bits == 32) return KX_DTYPE_INT32;
  if (t.code == kDLFloat && t.bits == 32) return KX_DTYPE_FLOAT32;
  if (t.code == kDLBfloat && t.bits == 16) return KX_DTYPE_BFLOAT16;
  if (t.code == kDLFloat && t.bits == 16) return KX_DTYPE_FLOAT16;
  return KX_DTYPE_OTHER;
}

static DLDataType dl_dtype_of(kx_dtype dtype) {
  DLDataType t = {kDLUInt, 8, 1};
  switch (dtype) {
    case KX_DTYPE_INT32: t.code = kDLInt; t.bits = 32; break;
    case KX_DTYPE_FLOAT32: t.code = kDLFloat; t.bits = 32; break;
    case KX_DTYPE_BFLOAT16: t.code = kDLBfloat; t.bits = 16; break;
    case KX_DTYPE_FLOAT16: t.code = kDLFloat; t.bits = 16; break;
    default: break;
  }
  return t;
}

/* Any DLPack dtype, named the way NumPy/PyTorch users know it. */
static void dl_dtype_str(DLDataType t, char *buf, size_t n) {
  const char *base = NULL;
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLComplex: base = "complex"; break;
    case kDLBool: snprintf(buf, n, "bool"); return;
    default: break;
  }
  if (base == NULL)
    snprintf(buf, n, "dtype(code=%u, bits=%u, lanes=%u)", t.code, t.bits, t.lanes);
  else if (t.lanes != 1)
    snprintf(buf, n, "%s%u x%u", base, t.bits, t.lanes);
  else
    snprintf(buf, n, "%s%u", base, t.bits);
}

void kx_dl_device_str(DLDevice d, char *buf, size_t n) {
  switch (d.device_type) {
    case kDLCPU: snprintf(buf, n, "cpu"); break;
    case kDLCUDA: snprintf(buf, n, "cuda:%d", (int)d.device_id); break;
    case kDLCUDAHost: snprintf(buf, n, "cuda_host (pinned cpu)"); break;
    case kDLCUDAManaged: snprintf(buf, n, "cuda_managed:%d", (int)d.device_id); break;
    case kDLROCM: snprintf(buf, n, "rocm:%d", (int)d.device_id); break;
    case kDLOneAPI: snprintf(buf, n, "oneapi:%d", (int)d.device_id); break;
    case kDLMetal: snprintf(buf, n, "metal:%d", (int)d.device_id); break;
    default:
      snprintf(buf, n, "device_type %d:%d", (int)d.device_type, (int)d.device_id);
      break;
  }
}

void kx_device_str(kx_device d, char *buf, size_t n) {
  if (d.kind == KX_DEVICE_CPU)
    snprintf(buf, n, "cpu");
  else if (d.kind == KX_DEVICE_CUDA)
    snprintf(buf, n, "cuda:%d", (int)d.id);
  else
    snprintf(buf, n, "an unsupported device");
}

/* "[a, b, ...]"; with any_sizes, a negative entry (a wanted shape's "any size") prints as *. */
static void dims_str(int ndim, const int64_t *dims, int any_sizes, char *buf, size_t n) {
  size_t used = 0;
  int w = snprintf(buf, n, "[");
  if (w > 0) used = (size_t)w;
  for (int i = 0; i < ndim && used < n; i++) {
    if (any_sizes && dims[i] < 0)
      w = snprintf(buf + used, n - used, i ? ", *" : "*");
    else
      w = snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)dims[i]);
    if (w < 0) return;
    used += (size_t)w;
  }
  if (used < n) snprintf(buf + used, n - used, "]");
}

void kx_shape_str(int ndim, const int64_t *dims, char *buf, size_t n) {
  dims_str(ndim, dims, 0, buf, n);
}

static kx_device device_of(DLDevice d) {
  kx_device out = {KX_DEVICE_OTHER, d.device_id};
  if (d.device_type == kDLCPU || d.device_type == kDLCUDAHost) {
    out.kind = KX_DEVICE_CPU;
    out.id = 0;
  } else if (d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged) {
    out.kind = KX_DEVICE_CUDA;
  }
  return out;
}

/* ---- the owner: keeps the source alive and calls the deleter exactly once ----------- */

static void owner_destructor(PyObject *owner) {
  const char *name = PyCapsule_GetName(owner);
  void *managed = PyCapsule_GetPointer(owner, name);
  /* A deleter may run Python code (NumPy's does); keep any pending exception intact. */
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *pending = PyErr_GetRaisedException();
#else
  PyObject *ptype, *pvalue, *ptb;
  PyErr_Fetch(&ptype, &pvalue, &ptb);
#endif
  if (managed != NULL) {
    if (name == kOwnerVersioned) {
      DLManagedTensorVersioned *m = (DLManagedTensorVersioned *)managed;
      if (m->deleter != NULL) m->deleter(m);
    } else {
      DLManagedTensor *m = (DLManagedTensor *)managed;
      if (m->deleter != NULL) m->deleter(m);
    }
  }
  PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(pending);
#else
  PyErr_Restore(ptype, pvalue, ptb);
#endif
}

/* ---- import ------------------------------------------------------------------------ */

/* Calls obj.__dlpack__ the protocol's way; returns the capsule (new reference). */
static PyObject *call_dlpack(PyObject *obj, const char *arg, int64_t stream) {
  DLDevice dev = {kDLCPU, 0};
  PyObject *devobj = NULL;
  if (stream == KX_STREAM_ORDERED_CUDA) {
    dev.device_type = kDLCUDA; /* the caller's word; the import's device check still applies */
    stream = KX_STREAM_NO_SYNC;
  } else if ((devobj = PyObject_CallMethod(obj, "__dlpack_device__", NULL)) == NULL) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
      kx_raise_from(PyExc_ValueError, "%s: __dlpack_device__() failed", arg);
      return NULL;
    }
    PyErr_Clear(); /* a producer without __dlpack_device__: take it as a CPU one */
  } else {
    long type = -1, id = -1;
    if (PyTuple_Check(devobj) && PyTuple_GET_SIZE(devobj) == 2) {
      type = PyLong_AsLong(PyTuple_GET_ITEM(devobj, 0));
      id = PyLong_AsLong(PyTuple_GET_ITEM(devobj, 1));
    }
    Py_DECREF(devobj);
    if (PyErr_Occurred() || type < 0) {
      kx_raise_from(PyExc_TypeError,
                    "%s: __dlpack_device__() must return a (device_type, device_id) tuple",
                    arg);
      return NULL;
    }
    dev.device_type = (int32_t)type;
    dev.device_id = (int32_t)id;
  }

  const int cuda = dev.device_type == kDLCUDA || dev.device_type == kDLCUDAManaged;
  if (!cuda && dev.device_type != kDLCPU && dev.device_type != kDLCUDAHost) {
    char where[64];
    kx_dl_device_str(dev, where, sizeof where);
    PyErr_Format(PyExc_ValueError, "%s: expected a CPU or CUDA tensor, got one on %s", arg,
                 where);
    return NULL;
  }

  PyObject *method = PyUnicode_InternFromString("__dlpack__");
  PyObject *version = Py_BuildValue("(ii)", KX_DLPACK_MAJOR, KX_DLPACK_MINOR);
  PyObject *stream_obj = cuda ? PyLong_FromLongLong(stream) : NULL;
  PyObject *kwnames = cuda ? Py_BuildValue("(ss)", "stream", "max_version")
                           : Py_BuildValue("(s)", "max_version");
  PyObject *capsule = NULL;
  if (method == NULL || version == NULL || kwnames == NULL || (cuda && stream_obj == NULL))
    goto done;
  {
    PyObject *argv[3] = {obj, cuda ? stream_obj : version, version};
    size_t nargs = 1 | PY_VECTORCALL_ARGUMENTS_OFFSET;
    capsule = PyObject_VectorcallMethod(method, argv, nargs, kwnames);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
      /* A producer older than DLPack 1.0 does not know max_version. */
      PyErr_Clear();
      Py_CLEAR(kwnames);
      if (cuda && (kwnames = Py_BuildValue("(s)", "stream")) == NULL) goto done;
      capsule = PyObject_VectorcallMethod(method, argv, nargs, kwnames); /* NULL: none */
    }
  }
  if (capsule == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError))
      kx_raise_from(PyExc_TypeError, "%s: __dlpack__() is missing or failed", arg);
    else
      kx_raise_from(PyErr_ExceptionMatches(PyExc_TypeError) ? PyExc_TypeError
                                                              : PyExc_ValueError,
                    "%s: __dlpack__() failed", arg);
  } else if (!PyCapsule_CheckExact(capsule)) {
    PyErr_Format(PyExc_TypeError, "%s: __dlpack__() returned %.100s, expected a capsule", arg,
                 Py_TYPE(capsule)->tp_name);
    Py_CLEAR(capsule);
  }
done:
  Py_XDECREF(method);
  Py_XDECREF(version);
  Py_XDECREF(stream_obj);
  Py_XDECREF(kwnames);
  return capsule;
}

/* Checks the DLTensor and fills `out` (all but the owner). Consumes nothing. */
static int read_dltensor(const DLTensor *dl, const char *arg, kx_tensor *out) {
  if (dl->ndim < 0 || dl->ndim > KX_MAX_DIMS) {
    PyErr_Format(PyExc_ValueError, "%s: tensors of up to %d dimensions are supported, got %d",
                 arg, KX_MAX_DIMS, (int)dl->ndim);
    return -1;
  }
  if (dl->dtype.lanes != 1) {
    char name[64];
    dl_dtype_str(dl->dtype, name, sizeof name);
    PyErr_Format(PyExc_ValueError, "%s: vector dtypes are not supported, got %s", arg, name);
    return -1;
  }
  out->ndim = dl->ndim;
  int64_t numel = 1;
  for (int i = 0; i < dl->ndim; i++) {
    if (dl->shape[i] < 0) {
      PyErr_Format(PyExc_ValueError, "%s: negative extent %lld in dimension %d", arg,
                   (long long)dl->shape[i], i);
      return -1;
    }
    out->shape[i] = dl->shape[i];
    numel *= dl->shape[i];
  }
  if (dl->strides != NULL) {
    for (int i = 0; i < dl->ndim; i++) out->strides[i] = dl->strides[i];
  } else {
    int64_t s = 1;
    for (int i = dl->ndim - 1; i >= 0; i--) {
      out->strides[i] = s;
      s *= out->shape[i] > 0 ? out->shape[i] : 1;
    }
  }
  out->data = (char *)dl->data + dl->byte_offset;
  out->dl_dtype = dl->dtype;
  out->dtype = dtype_of(dl->dtype);
  out->dl_device = dl->device;
  out->device = device_of(dl->device);
  size_t item = kx_dtype_size(out->dtype);
  if (numel > 0 && out->data == NULL) {
    PyErr_Format(PyExc_ValueError, "%s: the tensor has %lld elements but a NULL data pointer",
                 arg, (long long)numel);
    return -1;
  }
  if (item > 1 && ((uintptr_t)out->data % item) != 0) {
    PyErr_Format(PyExc_ValueError, "%s: data pointer %p is not aligned to its %zu-byte elements",
                 arg, out->data, item);
    return -1;
  }
  return 0;
}

static int consume_capsule(PyObject *capsule, PyObject *source, const char *arg,
                           kx_tensor *out) {
  const int versioned = PyCapsule_IsValid(capsule, kCapsuleVersioned);
  if (!versioned && !PyCapsule_IsValid(capsule, kCapsule)) {
    const char *name = PyCapsule_GetName(capsule);
    PyErr_Clear();
    if (name != NULL &&
        (strcmp(name, kUsedCapsule) == 0 || strcmp(name, kUsedCapsuleVersioned) == 0))
      PyErr_Format(PyExc_ValueError,
                   "%s: this DLPack capsule was already consumed (a capsule can be used once)",
                   arg);
    else
      PyErr_Format(PyExc_TypeError,
                   "%s: expected a DLPack capsule named 'dltensor' or 'dltensor_versioned', "
                   "got a capsule named '%s'",
                   arg, name != NULL ? name : "(null)");
    return -1;
  }
  void *managed = PyCapsule_GetPointer(capsule, versioned ? kCapsuleVersioned : kCapsule);
  if (managed == NULL) return -1;
  const DLTensor *dl;
  if (versioned) {
    const DLManagedTensorVersioned *m = (const DLManagedTensorVersioned *)managed;
    if (m->version.major > KX_DLPACK_MAJOR) {
      PyErr_Format(PyExc_BufferError,
                   "%s: the producer exported DLPack %u.%u, this library reads up to %d.x", arg,
                   m->version.major, m->version.minor, KX_DLPACK_MAJOR);
      return -1;
    }
    dl = &m->dl_tensor;
    out->readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    out->copied = (m->flags & DLPACK_FLAG_BITMASK_IS_COPIED) != 0;
  } else {
    dl = &((const DLManagedTensor *)managed)->dl_tensor;
    out->readonly = 0;
    out->copied = 0;
  }
  if (read_dltensor(dl, arg, out) < 0) return -1;

  PyObject *owner = PyCapsule_New(managed, versioned ? kOwnerVersioned : kOwner,
                                  owner_destructor);
  if (owner == NULL) return -1;
  if (PyCapsule_SetName(capsule, versioned ? kUsedCapsuleVersioned : kUsedCapsule) < 0) {
    PyCapsule_SetDestructor(owner, NULL); /* still the producer's to free */
    Py_DECREF(owner);
    return -1;
  }
  out->owner = owner;
  out->source = Py_NewRef(source != NULL ? source : capsule);
  return 0;
}

int kx_tensor_import(PyObject *obj, const char *arg, int64_t stream, kx_tensor *out) {
  memset(out, 0, sizeof *out);
  if (PyCapsule_CheckExact(obj)) return consume_capsule(obj, NULL, arg, out);
  if (obj == Py_None || !PyObject_HasAttrString(obj, "__dlpack__")) {
    PyErr_Format(PyExc_TypeError,
                 "%s: expected a tensor (an object with __dlpack__, or a DLPack capsule), "
                 "got %.100s",
                 arg, Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyObject *capsule = call_dlpack(obj, arg, stream);
  if (capsule == NULL) return -1;
  int rc = consume_capsule(capsule, obj, arg, out);
  Py_DECREF(capsule); /* renamed when consumed: its destructor then leaves it alone */
  return rc;
}

void kx_tensor_release(kx_tensor *t) {
  Py_CLEAR(t->owner); /* the deleter runs first, while the source is still alive */
  Py_CLEAR(t->source);
}

/* ---- checks ------------------------------------------------------------------------ */

void kx_tensor_dtype_str(const kx_tensor *t, char *buf, size_t n) {
  dl_dtype_str(t->dl_dtype, buf, n);
  if (t->dtype == KX_DTYPE_BFLOAT16) snprintf(buf, n, "bfloat16");
}

int kx_check_dtype(const kx_tensor *t, const char *arg, kx_dtype expected) {
  if (t->dtype == expected) return 0;
  char got[64];
  kx_tensor_dtype_str(t, got, sizeof got);
  PyErr_Format(PyExc_ValueError, "%s: expected dtype %s, got %s", arg, kx_dtype_name(expected),
               got);
  return -1;
}

int kx_check_device(const kx_tensor *t, const char *arg, kx_device expected) {
  if (t->device.kind == expected.kind && t->device.id == expected.id) return 0;
  char want[48], got[48];
  kx_device_str(expected, want, sizeof want);
  kx_dl_device_str(t->dl_device, got, sizeof got);
  PyErr_Format(PyExc_ValueError, "%s: expected a tensor on %s, got one on %s", arg, want, got);
  return -1;
}

int kx_check_cpu(const kx_tensor *t, const char *arg, const char *why) {
  if (t->device.kind == KX_DEVICE_CPU) return 0;
  char got[48];
  kx_dl_device_str(t->dl_device, got, sizeof got);
  PyErr_Format(PyExc_ValueError, "%s: expected a CPU tensor (%s), got one on %s", arg, why,
               got);
  return -1;
}

int kx_check_shape(const kx_tensor *t, const char *arg, int ndim, const int64_t *shape) {
  int ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || shape[i] == t->shape[i];
  if (ok) return 0;
  char want[160], got[160];
  dims_str(ndim, shape, 1, want, sizeof want);
  kx_shape_str(t->ndim, t->shape, got, sizeof got);
  if (t->ndim != ndim)
    PyErr_Format(PyExc_ValueError, "%s: expected a %d-D tensor of shape %s, got %d-D shape %s",
                 arg, ndim, want, t->ndim, got);
  else
    PyErr_Format(PyExc_ValueError, "%s: expected shape %s, got %s", arg, want, got);
  return -1;
}

int64_t kx_row_stride(const kx_tensor *t) {
  return t->shape[0] <= 1 ? t->shape[1] : t->strides[0];
}

int64_t kx_numel(const kx_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

int kx_check_rows(const kx_tensor *t, const char *arg) {
  /* Strides of extent-1 (or empty) dimensions never address anything. */
  const int cols_ok = t->shape[1] <= 1 || t->strides[1] == 1;
  const int rows_ok = t->shape[0] <= 1 || t->shape[1] == 0 || t->strides[0] >= t->shape[1];
  if (cols_ok && rows_ok) return 0;
  char strides[160];
  kx_shape_str(2, t->strides, strides, sizeof strides);
  PyErr_Format(PyExc_ValueError,
               "%s: expected rows with column stride 1 and row stride >= %lld, got strides %s "
               "(make it contiguous, e.g. .contiguous())",
               arg, (long long)t->shape[1], strides);
  return -1;
}

/* Rows of a 2-D tensor that passed kx_check_rows, in bytes from `base`. */
typedef struct byte_rows {
  int64_t first, stride, width, count;
} byte_rows;

static byte_rows rows_in_bytes(const kx_tensor *t, uintptr_t base) {
  const int64_t item = (int64_t)kx_dtype_size(t->dtype);
  return (byte_rows){(int64_t)((uintptr_t)t->data - base), kx_row_stride(t) * item,
                     t->shape[1] * item, t->shape[0]};
}

static int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

int kx_check_disjoint(const kx_tensor *out, const char *out_arg, const kx_tensor *in, const char *in_arg) {
  if (kx_numel(out) == 0 || kx_numel(in) == 0) return 0;
  const uintptr_t base = (uintptr_t)out->data < (uintptr_t)in->data ? (uintptr_t)out->data : (uintptr_t)in->data;
  byte_rows a = rows_in_bytes(out, base), b = rows_in_bytes(in, base);
  if (a.count > b.count) { /* walk the shorter */
    const byte_rows t = a;
    a = b;
    b = t;
  }
  for (int64_t i = 0; i < a.count; i++) {
    const int64_t start = a.first + i * a.stride, end = start + a.width;
    /* b's rows end in increasing order: the first to end after `start` is the only candidate */
    int64_t j = floor_div(start - b.width - b.first, b.stride) + 1;
    if (j < 0) j = 0;
    if (j < b.count && b.first + j * b.stride < end) {
      PyErr_Format(PyExc_ValueError, "%s: shares memory with %s (an output may not overlap an input "
                   "or another output)", out_arg, in_arg);
      return -1;
    }
  }
  return 0;
}

int kx_check_contiguous(const kx_tensor *t, const char *arg) {
  int64_t expect = 1;
  int ok = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->strides[i] != expect) ok = 0;
    expect *= t->shape[i];
  }
  if (ok || expect == 0) return 0;
  return kx_raise_layout(t, arg, "a contiguous tensor");
}

int kx_raise_layout(const kx_tensor *t, const char *arg, const char *expected) {
  char strides[160], shape[160];
  kx_shape_str(t->ndim, t->strides, strides, sizeof strides);
  kx_shape_str(t->ndim, t->shape, shape, sizeof shape);
  PyErr_Format(PyExc_ValueError,
               "%s: expected %s, got strides %s for shape %s "
               "(make it contiguous, e.g. .contiguous())",
               arg, expected, strides, shape);
  return -1;
}

int kx_check_writable(const kx_tensor *t, const char *arg) {
  if (t->readonly) {
    PyErr_Format(PyExc_ValueError, "%s: expected a writable tensor, got a read-only one", arg);
    return -1;
  }
  if (t->copied) {
    PyErr_Format(PyExc_ValueError,
                 "%s: expected the tensor's own memory, its producer exported a copy "
                 "(results written there would never reach it)", arg);
    return -1;
  }
  return 0;
}

/* ---- export: _C.DLPackView ------------------------------------------------------------
 * A view of memory some producer gave us, under another dtype of the same element size
 * (numpy uint16 -> bfloat16, the one NumPy cannot spell). Each export holds a reference
 * to the view, which holds the original owner, so the memory outlives every consumer. */

typedef struct kx_view {
  PyObject_HEAD
  kx_tensor t;
} kx_view;

typedef struct export_legacy {
  DLManagedTensor managed;
  int64_t shape[KX_MAX_DIMS], strides[KX_MAX_DIMS];
} export_legacy;

typedef struct export_versioned {
  DLManagedTensorVersioned managed;
  int64_t shape[KX_MAX_DIMS], strides[KX_MAX_DIMS];
} export_versioned;

static void release_ctx(void *ctx, void *block) {
  /* Consumers may call the deleter from any thread, and after Python has gone. */
  if (Py_IsInitialized()) {
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF((PyObject *)ctx);
    PyGILState_Release(g);
  }
  PyMem_RawFree(block);
}

static void export_legacy_deleter(DLManagedTensor *m) { release_ctx(m->manager_ctx, m); }
static void export_versioned_deleter(DLManagedTensorVersioned *m) {
  release_ctx(m->manager_ctx, m);
}

/* Called when an exported capsule dies: only an unconsumed one is still ours to free. */
static void export_capsule_destructor(PyObject *capsule) {
  if (PyCapsule_IsValid(capsule, kCapsuleVersioned)) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, kCapsuleVersioned);
    m->deleter(m);
  } else if (PyCapsule_IsValid(capsule, kCapsule)) {
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, kCapsule);
    m->deleter(m);
  }
}

static void fill_dltensor(kx_view *self, DLTensor *dl, int64_t *shape, int64_t *strides) {
  memcpy(shape, self->t.shape, sizeof(int64_t) * (size_t)self->t.ndim);
  memcpy(strides, self->t.strides, sizeof(int64_t) * (size_t)self->t.ndim);
  dl->data = self->t.data;
  dl->device = self->t.dl_device;
  dl->ndim = self->t.ndim;
  dl->dtype = self->t.dl_dtype;
  dl->shape = shape;
  dl->strides = strides;
  dl->byte_offset = 0;
}

/* The view's memory is its source's, whose producer may still have work pending on it: a
 * consumer's stream must wait for that as it would had it imported the source itself, so
 * the request is passed on (the capsule that comes back is dropped; the ordering is done).
 * A source that was a bare capsule can order nothing, as when imported directly. */
static int order_source_on(kx_view *self, PyObject *stream) {
  PyObject *source = self->t.source;
  if (stream == NULL || stream == Py_None || self->t.device.kind != KX_DEVICE_CUDA ||
      PyCapsule_CheckExact(source))
    return 0;
  PyObject *kwnames = Py_BuildValue("(s)", "stream");
  PyObject *method = PyUnicode_InternFromString("__dlpack__");
  PyObject *capsule = NULL;
  if (kwnames != NULL && method != NULL) {
    PyObject *argv[2] = {source, stream};
    capsule = PyObject_VectorcallMethod(method, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
    if (capsule == NULL)
      kx_raise_from(PyExc_BufferError,
                    "stream: the viewed tensor's __dlpack__(stream=...) failed, so its pending "
                    "work cannot be ordered before the consumer's");
  }
  Py_XDECREF(kwnames);
  Py_XDECREF(method);
  Py_XDECREF(capsule);
  return capsule == NULL ? -1 : 0;
}

static PyObject *view_dlpack(PyObject *op, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
  kx_view *self = (kx_view *)op;
  static const char *const names[] = {"stream", "max_version", "dl_device", "copy", NULL};
  static const kx_argspec spec = {"__dlpack__", names, 0, 0};
  PyObject *v[4];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  int versioned = 0;
  if (v[1] != NULL && v[1] != Py_None) {
    if (!PyTuple_Check(v[1]) || PyTuple_GET_SIZE(v[1]) != 2) {
      PyErr_SetString(PyExc_TypeError, "max_version: expected a (major, minor) tuple");
      return NULL;
    }
    long major = PyLong_AsLong(PyTuple_GET_ITEM(v[1], 0));
    if (major == -1 && PyErr_Occurred()) return NULL;
    versioned = major >= 1;
  }
  if (v[2] != NULL && v[2] != Py_None) {
    long type = -1, id = -1;
    if (PyTuple_Check(v[2]) && PyTuple_GET_SIZE(v[2]) == 2) {
      type = PyLong_AsLong(PyTuple_GET_ITEM(v[2], 0));
      id = PyLong_AsLong(PyTuple_GET_ITEM(v[2], 1));
      if (PyErr_Occurred()) return NULL;
    }
    if (type != self->t.dl_device.device_type || id != self->t.dl_device.device_id) {
      PyErr_SetString(PyExc_BufferError, "dl_device: a DLPackView cannot change device");
      return NULL;
    }
  }
  if (v[3] != NULL && v[3] != Py_None) {
    int copy = PyObject_IsTrue(v[3]);
    if (copy < 0) return NULL;
    if (copy) {
      PyErr_SetString(PyExc_BufferError, "copy=True: a DLPackView only exports its memory");
      return NULL;
    }
  }
  if (!versioned && self->t.readonly) {
    PyErr_SetString(PyExc_BufferError,
                    "read-only memory can only be exported as DLPack >= 1.0 "
                    "(pass max_version=(1, 0))");
    return NULL;
  }
  if (order_source_on(self, v[0]) < 0) return NULL;

  PyObject *capsule;
  if (versioned) {
    export_versioned *e = PyMem_RawCalloc(1, sizeof *e);
    if (e == NULL) return PyErr_NoMemory();
    e->managed.version.major = KX_DLPACK_MAJOR;
    e->managed.version.minor = KX_DLPACK_MINOR;
    e->managed.flags = (self->t.readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0) |
                       (self->t.copied ? DLPACK_FLAG_BITMASK_IS_COPIED : 0);
    e->managed.manager_ctx = Py_NewRef(op);
    e->managed.deleter = export_versioned_deleter;
    fill_dltensor(self, &e->managed.dl_tensor, e->shape, e->strides);
    capsule = PyCapsule_New(&e->managed, kCapsuleVersioned, export_capsule_destructor);
    if (capsule == NULL) export_versioned_deleter(&e->managed);
  } else {
    export_legacy *e = PyMem_RawCalloc(1, sizeof *e);
    if (e == NULL) return PyErr_NoMemory();
    e->managed.manager_ctx = Py_NewRef(op);
    e->managed.deleter = export_legacy_deleter;
    fill_dltensor(self, &e->managed.dl_tensor, e->shape, e->strides);
    capsule = PyCapsule_New(&e->managed, kCapsule, export_capsule_destructor);
    if (capsule == NULL) export_legacy_deleter(&e->managed);
  }
  return capsule;
}

static PyObject *view_dlpack_device(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  kx_view *self = (kx_view *)op;
  return Py_BuildValue("(ii)", (int)self->t.dl_device.device_type,
                       (int)self->t.dl_device.device_id);
}

static PyObject *view_get_shape(PyObject *op, void *Py_UNUSED(closure)) {
  kx_view *self = (kx_view *)op;
  PyObject *shape = PyTuple_New(self->t.ndim);
  if (shape == NULL) return NULL;
  for (int i = 0; i < self->t.ndim; i++) {
    PyObject *n = PyLong_FromLongLong(self->t.shape[i]);
    if (n == NULL) {
      Py_DECREF(shape);
      return NULL;
    }
    PyTuple_SET_ITEM(shape, i, n);
  }
  return shape;
}

static PyObject *view_get_dtype(PyObject *op, void *Py_UNUSED(closure)) {
  return PyUnicode_FromString(kx_dtype_name(((kx_view *)op)->t.dtype));
}

static PyObject *view_get_device(PyObject *op, void *Py_UNUSED(closure)) {
  char buf[48];
  kx_dl_device_str(((kx_view *)op)->t.dl_device, buf, sizeof buf);
  return PyUnicode_FromString(buf);
}

static PyObject *view_repr(PyObject *op) {
  kx_view *self = (kx_view *)op;
  char shape[160], dev[48];
  kx_shape_str(self->t.ndim, self->t.shape, shape, sizeof shape);
  kx_dl_device_str(self->t.dl_device, dev, sizeof dev);
  return PyUnicode_FromFormat("<kimi_experts DLPackView %s %s on %s>",
                              kx_dtype_name(self->t.dtype), shape, dev);
}

static int view_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(((kx_view *)op)->t.source);
  return 0;
}

static int view_clear(PyObject *op) {
  kx_tensor_release(&((kx_view *)op)->t);
  return 0;
}

static void view_dealloc(PyObject *op) {
  PyTypeObject *type = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  view_clear(op);
  type->tp_free(op);
  Py_DECREF(type);
}

static PyMethodDef view_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))view_dlpack, METH_FASTCALL | METH_KEYWORDS,
     PyDoc_STR("__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n"
               "Export the view as a DLPack capsule (versioned when max_version >= (1, 0)).")},
    {"__dlpack_device__", view_dlpack_device, METH_NOARGS,
     PyDoc_STR("(device_type, device_id) of the viewed memory.")},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef view_getset[] = {
    {"shape", view_get_shape, NULL, PyDoc_STR("tuple of extents"), NULL},
    {"dtype", view_get_dtype, NULL, PyDoc_STR("element type name, e.g. 'bfloat16'"), NULL},
    {"device", view_get_device, NULL, PyDoc_STR("'cpu' or 'cuda:N'"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot view_slots[] = {
    {Py_tp_doc, (void *)PyDoc_STR(
                    "A DLPack view of another tensor's memory under a dtype of the same size "
                    "(made by kimi_experts.as_bfloat16 / _C.reinterpret). Holds the original "
                    "alive.")},
    {Py_tp_methods, view_methods},
    {Py_tp_getset, view_getset},
    {Py_tp_repr, view_repr},
    {Py_tp_traverse, view_traverse},
    {Py_tp_clear, view_clear},
    {Py_tp_dealloc, view_dealloc},
    {0, NULL},
};

static PyType_Spec view_spec = {
    .name = "kimi_experts._C.DLPackView",
    .basicsize = sizeof(kx_view),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = view_slots,
};

PyObject *kx_dlpack_view_type_create(PyObject *module) {
  return PyType_FromModuleAndSpec(module, &view_spec, NULL);
}

PyObject *kx_dlpack_view_new(PyTypeObject *type, const kx_tensor *src, kx_dtype dtype) {
  kx_view *self = PyObject_GC_New(kx_view, type);
  if (self == NULL) return NULL;
  self->t = *src;
  self->t.dtype = dtype;
  self->t.dl_dtype = dl_dtype_of(dtype);
  Py_XINCREF(self->t.owner);
  Py_XINCREF(self->t.source);
  PyObject_GC_Track((PyObject *)self);
  return (PyObject *)self;
}
