/* formats.c: the MX format helpers (SPEC 2) as module functions.
 *
 *   quantize_mxfp8(x, scale="rceil", *, q=None, scales=None, stream=0) -> (q, scales)
 *   quantize_mxfp4(w) -> (q, scales)
 *   dequantize(q, scales, fmt) -> float32 [..., K]
 *
 * CPU inputs run the CPU backend (csrc/cpu) and return new NumPy arrays made with the
 * NumPy C API (or fill q/scales when given). A CUDA bfloat16 x runs the device quantizer
 * (kx_quantize_mxfp8) into q/scales, which the caller allocates on the same device (the
 * Python layer does, with torch.empty / cupy.empty) and passes in as DLPack tensors.
 * The leading dimensions of an input are flattened to rows; they need one common row
 * stride (any contiguous or row-sliced tensor has one), and the last dimension must be
 * contiguous.
 */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "kx.h"

#include <numpy/arrayobject.h>

#include "cpu/cpu_backend.h"
#include "gpu.h"

static const char *const kScaleModes[] = {"rceil", "floor", NULL};
static const char *const kFormats[] = {"mxfp8", "mxfp4", NULL};

int kx_formats_init(void) {
  /* NumPy keeps its C API table in a static of this file; import_array fills it. */
  import_array1(-1);
  return 0;
}

/* Flattens t's leading dimensions into rows with one row stride (elements). */
static int as_rows(const kx_tensor *t, const char *arg, int64_t *rows, int64_t *row_stride) {
  if (t->ndim < 1) {
    PyErr_Format(PyExc_ValueError, "%s: expected at least 1 dimension [..., K], got a scalar",
                 arg);
    return -1;
  }
  const int last = t->ndim - 1;
  const int64_t cols = t->shape[last];
  for (int d = 0; d < t->ndim; d++) {
    if (t->shape[d] == 0) { /* nothing to read: any strides (NumPy gives empty arrays 0) */
      *rows = 0;
      *row_stride = cols;
      return 0;
    }
  }
  int64_t n = 1, stride = cols, expect = 0;
  int found = 0; /* a flag, not a sentinel stride: a reversed view has a negative one */
  int ok = cols <= 1 || t->strides[last] == 1;
  for (int d = last - 1; d >= 0; d--) {
    n *= t->shape[d];
    if (t->shape[d] == 1) continue;
    if (!found) {
      found = 1;
      stride = t->strides[d];
      expect = stride * t->shape[d];
    } else {
      ok = ok && t->strides[d] == expect;
      expect *= t->shape[d];
    }
  }
  ok = ok && (n <= 1 || cols == 0 || stride >= cols);
  if (!ok) return kx_raise_layout(t, arg, "a contiguous last dimension and evenly strided rows");
  *rows = n;
  *row_stride = stride;
  return 0;
}

static int check_block_multiple(const char *arg, int64_t k) {
  if (k % KX_MX_BLOCK == 0) return 0;
  PyErr_Format(PyExc_ValueError,
               "%s: expected the last dimension K to be a multiple of %d (one MX block), got %lld",
               arg, KX_MX_BLOCK, (long long)k);
  return -1;
}

static int elem_type_of(const kx_tensor *t, const char *arg, kx_elem_type *type) {
  switch (t->dtype) {
    case KX_DTYPE_FLOAT32: *type = KX_ELEM_F32; return 0;
    case KX_DTYPE_BFLOAT16: *type = KX_ELEM_BF16; return 0;
    case KX_DTYPE_FLOAT16: *type = KX_ELEM_F16; return 0;
    default: break;
  }
  char got[64];
  kx_tensor_dtype_str(t, got, sizeof got);
  PyErr_Format(PyExc_ValueError, "%s: expected dtype float32, bfloat16 or float16, got %s", arg,
               got);
  return -1;
}

/* A new uint8/float32 NumPy array: x's shape with the last extent replaced. */
static PyObject *new_array(const kx_tensor *like, int64_t last, int typenum) {
  npy_intp dims[KX_MAX_DIMS];
  for (int i = 0; i < like->ndim; i++) dims[i] = (npy_intp)like->shape[i];
  dims[like->ndim - 1] = (npy_intp)last;
  return PyArray_SimpleNew(like->ndim, dims, typenum);
}

/* Checks a caller-given output: uint8, contiguous, x's shape with `last` as last extent. */
static int import_given(PyObject *obj, const char *arg, const kx_tensor *like, int64_t last,
                        kx_tensor *out) {
  int64_t shape[KX_MAX_DIMS];
  for (int i = 0; i < like->ndim; i++) shape[i] = like->shape[i];
  shape[like->ndim - 1] = last;
  if (kx_tensor_import(obj, arg, KX_STREAM_NO_SYNC, out) < 0) return -1;
  if (kx_check_device(out, arg, like->device) < 0 ||
      kx_check_dtype(out, arg, KX_DTYPE_UINT8) < 0 ||
      kx_check_shape(out, arg, like->ndim, shape) < 0 || kx_check_contiguous(out, arg) < 0 ||
      kx_check_writable(out, arg) < 0) {
    kx_tensor_release(out);
    return -1;
  }
  return 0;
}

PyObject *kx_fn_quantize_mxfp8(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
  static const char *const names[] = {"x", "scale", "q", "scales", "stream", NULL};
  static const kx_argspec spec = {"quantize_mxfp8", names, 2, 1};
  PyObject *v[5];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  kx_state *st = kx_state_of_module(module);
  int floor_mode = 0;
  uintptr_t stream = 0;
  if ((v[1] != NULL && kx_arg_choice(v[1], "scale", kScaleModes, &floor_mode) < 0) ||
      kx_arg_stream(v[4], "stream", &stream) < 0)
    return NULL;
  PyObject *q_obj = v[2] == Py_None ? NULL : v[2];
  PyObject *s_obj = v[3] == Py_None ? NULL : v[3];
  if ((q_obj == NULL) != (s_obj == NULL)) {
    PyErr_SetString(PyExc_ValueError, "q, scales: expected both or neither");
    return NULL;
  }

  kx_tensor x, q = {0}, s = {0};
  if (kx_tensor_import(v[0], "x", kx_dlpack_stream(stream), &x) < 0) return NULL;
  PyObject *result = NULL, *q_out = NULL, *s_out = NULL;
  kx_elem_type type;
  int64_t rows = 0, row_stride = 0;
  if (elem_type_of(&x, "x", &type) < 0 || as_rows(&x, "x", &rows, &row_stride) < 0 ||
      check_block_multiple("x", x.shape[x.ndim - 1]) < 0)
    goto done;
  const int64_t k = x.shape[x.ndim - 1];

  if (x.device.kind == KX_DEVICE_CUDA) {
    if (x.dtype != KX_DTYPE_BFLOAT16) {
      kx_check_dtype(&x, "x", KX_DTYPE_BFLOAT16);
      goto done;
    }
    if (kx_gpu_require("x", x.device.id) < 0) goto done;
    if (q_obj == NULL) {
      PyErr_SetString(PyExc_ValueError,
                      "q, scales: required for a CUDA x (uint8 [..., K] and [..., K/32] on x's "
                      "device; kimi_experts.quantize_mxfp8 allocates them)");
      goto done;
    }
  } else if (x.device.kind != KX_DEVICE_CPU) {
    kx_check_cpu(&x, "x", "or CUDA");
    goto done;
  }

  if (q_obj != NULL) {
    if (import_given(q_obj, "q", &x, k, &q) < 0 ||
        import_given(s_obj, "scales", &x, k / KX_MX_BLOCK, &s) < 0)
      goto done;
    q_out = Py_NewRef(q_obj);
    s_out = Py_NewRef(s_obj);
  } else {
    q_out = new_array(&x, k, NPY_UINT8);
    s_out = q_out != NULL ? new_array(&x, k / KX_MX_BLOCK, NPY_UINT8) : NULL;
    if (s_out == NULL) goto done;
    q.data = PyArray_DATA((PyArrayObject *)q_out);
    s.data = PyArray_DATA((PyArrayObject *)s_out);
  }

  if (rows > 0 && k > 0) {
    if (x.device.kind == KX_DEVICE_CUDA) {
      if (kx_gpu_quantize_mxfp8(st, x.device.id, x.data, rows, k, row_stride, floor_mode, q.data,
                                s.data, stream) < 0)
        goto done;
    } else {
      Py_BEGIN_ALLOW_THREADS
      kx_cpu_quantize_mxfp8(x.data, type, rows, k, row_stride,
                            floor_mode ? KX_SCALE_FLOOR : KX_SCALE_RCEIL, q.data, s.data);
      Py_END_ALLOW_THREADS
    }
  }
  result = PyTuple_Pack(2, q_out, s_out);
done:
  Py_XDECREF(q_out);
  Py_XDECREF(s_out);
  kx_tensor_release(&x);
  kx_tensor_release(&q);
  kx_tensor_release(&s);
  return result;
}

PyObject *kx_fn_quantize_mxfp4(PyObject *Py_UNUSED(module), PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"w", NULL};
  static const kx_argspec spec = {"quantize_mxfp4", names, 1, 1};
  PyObject *v[1];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  kx_tensor w;
  if (kx_tensor_import(v[0], "w", KX_STREAM_NO_SYNC, &w) < 0) return NULL;
  PyObject *result = NULL, *q = NULL, *s = NULL;
  kx_elem_type type;
  int64_t rows = 0, row_stride = 0;
  if (kx_check_cpu(&w, "w", "quantize_mxfp4 runs on the CPU; move it with .cpu()") < 0 ||
      elem_type_of(&w, "w", &type) < 0 || as_rows(&w, "w", &rows, &row_stride) < 0 ||
      check_block_multiple("w", w.shape[w.ndim - 1]) < 0)
    goto done;
  const int64_t k = w.shape[w.ndim - 1];
  q = new_array(&w, k / 2, NPY_UINT8);
  s = q != NULL ? new_array(&w, k / KX_MX_BLOCK, NPY_UINT8) : NULL;
  if (s == NULL) goto done;
  if (rows > 0 && k > 0) {
    uint8_t *qd = PyArray_DATA((PyArrayObject *)q), *sd = PyArray_DATA((PyArrayObject *)s);
    Py_BEGIN_ALLOW_THREADS
    kx_cpu_quantize_mxfp4(w.data, type, rows, k, row_stride, qd, sd);
    Py_END_ALLOW_THREADS
  }
  result = PyTuple_Pack(2, q, s);
done:
  Py_XDECREF(q);
  Py_XDECREF(s);
  kx_tensor_release(&w);
  return result;
}

PyObject *kx_fn_dequantize(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
  static const char *const names[] = {"q", "scales", "fmt", NULL};
  static const kx_argspec spec = {"dequantize", names, 3, 3};
  PyObject *v[3];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  int fmt = 0;
  if (kx_arg_choice(v[2], "fmt", kFormats, &fmt) < 0) return NULL;
  const int fp4 = fmt == 1;
  static const char kWhy[] = "dequantize runs on the CPU; move it with .cpu()";
  kx_tensor q, s = {0};
  if (kx_tensor_import(v[0], "q", KX_STREAM_NO_SYNC, &q) < 0) return NULL;
  PyObject *out = NULL;
  if (kx_check_cpu(&q, "q", kWhy) < 0 || kx_check_dtype(&q, "q", KX_DTYPE_UINT8) < 0 ||
      kx_check_contiguous(&q, "q") < 0)
    goto done;
  if (q.ndim < 1) {
    PyErr_SetString(PyExc_ValueError, "q: expected at least 1 dimension [..., K], got a scalar");
    goto done;
  }
  const int64_t k = fp4 ? 2 * q.shape[q.ndim - 1] : q.shape[q.ndim - 1];
  if (k % KX_MX_BLOCK != 0) {
    PyErr_Format(PyExc_ValueError,
                 "q: expected K = %s%lld to be a multiple of %d (one MX block)",
                 fp4 ? "2 * " : "", (long long)q.shape[q.ndim - 1], KX_MX_BLOCK);
    goto done;
  }
  int64_t s_shape[KX_MAX_DIMS];
  for (int i = 0; i < q.ndim; i++) s_shape[i] = q.shape[i];
  s_shape[q.ndim - 1] = k / KX_MX_BLOCK;
  if (kx_tensor_import(v[1], "scales", KX_STREAM_NO_SYNC, &s) < 0 ||
      kx_check_cpu(&s, "scales", kWhy) < 0 || kx_check_dtype(&s, "scales", KX_DTYPE_UINT8) < 0 ||
      kx_check_shape(&s, "scales", q.ndim, s_shape) < 0 ||
      kx_check_contiguous(&s, "scales") < 0)
    goto done;
  out = new_array(&q, k, NPY_FLOAT32);
  if (out == NULL) goto done;
  const int64_t rows = k > 0 ? kx_numel(&q) / (fp4 ? k / 2 : k) : 0;
  if (rows > 0) {
    float *od = PyArray_DATA((PyArrayObject *)out);
    const uint8_t *qd = q.data, *sd = s.data;
    Py_BEGIN_ALLOW_THREADS
    if (fp4)
      kx_cpu_dequantize_mxfp4(qd, sd, rows, k, od);
    else
      kx_cpu_dequantize_mxfp8(qd, sd, rows, k, od);
    Py_END_ALLOW_THREADS
  }
done:
  kx_tensor_release(&q);
  kx_tensor_release(&s);
  return out;
}
