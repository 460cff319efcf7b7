/* module.c: kimi_experts._C: module init (multi-phase, per-module state), the
 * exceptions, the method table, backend_info(), reinterpret() and the CUDA probes.
 *
 * Everything the module needs lives in its state (kx_state): exception classes, heap
 * types, the probe sinks. The only process-wide data is NumPy's C API table, which NumPy
 * owns (formats.c). No prints, no exit(): failures are exceptions.
 */
#include "kx.h"

#include <string.h>

#include "gpu.h"

#ifndef KX_BUILD_DESC
#define KX_BUILD_DESC "CPU backend only"
#endif

kx_state *kx_state_of_module(PyObject *module) { return (kx_state *)PyModule_GetState(module); }

kx_state *kx_state_of_type(PyTypeObject *type) {
  PyObject *module = PyType_GetModuleByDef(type, &kx_module_def); /* borrowed */
  return module != NULL ? (kx_state *)PyModule_GetState(module) : NULL;
}

/* ---- backend_info ------------------------------------------------------------------ */

static PyObject *fn_backend_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
  kx_gpu_status status;
  kx_gpu_query(&status);
  PyObject *reason = status.available ? Py_NewRef(Py_None) : PyUnicode_FromString(status.reason);
  PyObject *device = status.device[0] != '\0' ? PyUnicode_FromString(status.device)
                                              : Py_NewRef(Py_None);
  PyObject *info = NULL;
  if (reason != NULL && device != NULL)
    info = Py_BuildValue("{s:O,s:O,s:O,s:O,s:s}", "built_with_cuda",
                         status.built_with_cuda ? Py_True : Py_False, "cuda_available",
                         status.available ? Py_True : Py_False, "reason", reason, "device", device,
                         "build", KX_BUILD_DESC);
  Py_XDECREF(reason);
  Py_XDECREF(device);
  return info;
}

/* ---- reinterpret ------------------------------------------------------------------- */

static PyObject *fn_reinterpret(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
  static const char *const names[] = {"bits", "dtype", NULL};
  static const kx_argspec spec = {"reinterpret", names, 2, 2};
  static const char *const dtypes[] = {"bfloat16", "float16", "uint8", "int32", "float32", NULL};
  PyObject *v[2];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  int which = 0;
  if (kx_arg_choice(v[1], "dtype", dtypes, &which) < 0) return NULL;
  const kx_dtype dtype = kx_dtype_from_name(dtypes[which]);
  kx_tensor t;
  if (kx_tensor_import(v[0], "bits", KX_STREAM_NO_SYNC, &t) < 0) return NULL;
  PyObject *view = NULL;
  /* Integer bit patterns of the width, or the dtype itself: float16 has bfloat16's width but
   * holds values, which read as bf16 bits would be other numbers. */
  const int bits_or_same = t.dl_dtype.code == kDLInt || t.dl_dtype.code == kDLUInt || t.dtype == dtype;
  if ((size_t)t.dl_dtype.bits != 8 * kx_dtype_size(dtype) || t.dl_dtype.lanes != 1 || !bits_or_same) {
    char got[64];
    kx_tensor_dtype_str(&t, got, sizeof got);
    PyErr_Format(PyExc_TypeError,
                 "bits: expected %zu-bit integer bit patterns (or %s) to view as %s, got %s",
                 8 * kx_dtype_size(dtype), dtypes[which], dtypes[which], got);
  } else {
    view = kx_dlpack_view_new(kx_state_of_module(module)->view_type, &t, dtype);
  }
  kx_tensor_release(&t);
  return view;
}

/* ---- probes (CUDA) ----------------------------------------------------------------- */

static int import_cuda(PyObject *obj, const char *arg, uintptr_t stream, kx_tensor *t) {
  if (kx_tensor_import(obj, arg, kx_dlpack_stream(stream), t) < 0) return -1;
  if (t->device.kind != KX_DEVICE_CUDA) {
    char got[48];
    kx_dl_device_str(t->dl_device, got, sizeof got);
    PyErr_Format(PyExc_ValueError, "%s: expected a CUDA tensor (the probes are CUDA kernels), "
                 "got one on %s", arg, got);
  } else if (kx_gpu_require(arg, t->device.id) == 0 && kx_check_contiguous(t, arg) == 0) {
    return 0;
  }
  kx_tensor_release(t);
  return -1;
}

static PyObject *fn_probe_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
  static const char *const names[] = {"x", "out", "value", "stream", NULL};
  static const kx_argspec spec = {"probe_add", names, 4, 3};
  PyObject *v[4];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  double value = 0.0;
  uintptr_t stream = 0;
  if (kx_arg_double(v[2], "value", &value) < 0 || kx_arg_stream(v[3], "stream", &stream) < 0)
    return NULL;
  kx_tensor x, out = {0};
  if (import_cuda(v[0], "x", stream, &x) < 0) return NULL;
  PyObject *result = NULL;
  if (kx_check_dtype(&x, "x", KX_DTYPE_FLOAT32) < 0 || import_cuda(v[1], "out", stream, &out) < 0)
    goto done;
  if (kx_check_device(&out, "out", x.device) < 0 ||
      kx_check_dtype(&out, "out", KX_DTYPE_FLOAT32) < 0 ||
      kx_check_shape(&out, "out", x.ndim, x.shape) < 0 || kx_check_writable(&out, "out") < 0)
    goto done;
  if (kx_gpu_probe_add(kx_state_of_module(module), x.device.id, x.data, out.data, (float)value,
                       kx_numel(&x), stream) < 0)
    goto done;
  result = Py_NewRef(Py_None);
done:
  kx_tensor_release(&x);
  kx_tensor_release(&out);
  return result;
}

static PyObject *fn_probe_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
  static const char *const names[] = {"x", "stream", "sink", NULL};
  static const kx_argspec spec = {"probe_read", names, 2, 1};
  PyObject *v[3];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  uintptr_t stream = 0;
  if (kx_arg_stream(v[1], "stream", &stream) < 0) return NULL;
  kx_tensor x, sink = {0};
  if (import_cuda(v[0], "x", stream, &x) < 0) return NULL;
  PyObject *result = NULL;
  const int64_t n_bytes = kx_numel(&x) * (x.dl_dtype.bits / 8);
  if (v[2] != NULL && v[2] != Py_None) {
    if (import_cuda(v[2], "sink", stream, &sink) < 0 ||
        kx_check_device(&sink, "sink", x.device) < 0 || kx_check_writable(&sink, "sink") < 0)
      goto done;
    if (kx_numel(&sink) * (sink.dl_dtype.bits / 8) < 4 || ((uintptr_t)sink.data & 3) != 0) {
      PyErr_SetString(PyExc_ValueError, "sink: expected at least 4 bytes, 4-byte aligned");
      goto done;
    }
  }
  if (((uintptr_t)x.data & 15) != 0 || (n_bytes & 15) != 0) {
    PyErr_Format(PyExc_ValueError,
                 "x: expected a 16-byte aligned tensor of a multiple of 16 bytes, got %lld bytes "
                 "at %p",
                 (long long)n_bytes, x.data);
    goto done;
  }
  if (kx_gpu_probe_read(kx_state_of_module(module), x.device.id, x.data, n_bytes, sink.data,
                        stream) < 0)
    goto done;
  result = Py_NewRef(Py_None);
done:
  kx_tensor_release(&x);
  kx_tensor_release(&sink);
  return result;
}

/* ---- the module -------------------------------------------------------------------- */

#define KX_FASTCALL(fn) (PyCFunction)(void (*)(void))(fn), METH_FASTCALL | METH_KEYWORDS

static PyMethodDef module_methods[] = {
    {"backend_info", fn_backend_info, METH_NOARGS,
     PyDoc_STR("backend_info() -> dict(built_with_cuda, cuda_available, reason, device, build)")},
    {"quantize_mxfp8", KX_FASTCALL(kx_fn_quantize_mxfp8),
     PyDoc_STR("quantize_mxfp8(x, scale='rceil', *, q=None, scales=None, stream=0) -> (q, scales)")},
    {"quantize_mxfp4", KX_FASTCALL(kx_fn_quantize_mxfp4),
     PyDoc_STR("quantize_mxfp4(w) -> (q, scales)")},
    {"dequantize", KX_FASTCALL(kx_fn_dequantize),
     PyDoc_STR("dequantize(q, scales, fmt) -> float32 [..., K]")},
    {"reinterpret", KX_FASTCALL(fn_reinterpret),
     PyDoc_STR("reinterpret(bits, dtype) -> DLPackView of the same memory under `dtype`")},
    {"probe_add", KX_FASTCALL(fn_probe_add),
     PyDoc_STR("probe_add(x, out, value, stream=0): out = x + value on the GPU (wiring test)")},
    {"probe_read", KX_FASTCALL(fn_probe_read),
     PyDoc_STR("probe_read(x, stream=0, *, sink=None): read x's bytes once on the GPU")},
    {NULL, NULL, 0, NULL},
};

static int add_exception(PyObject *module, PyObject **slot, const char *name, const char *doc,
                         PyObject *bases) {
  *slot = PyErr_NewExceptionWithDoc(name, doc, bases, NULL);
  if (*slot == NULL) return -1;
  return PyModule_AddObjectRef(module, strrchr(name, '.') + 1, *slot);
}

static int module_exec(PyObject *module) {
  kx_state *st = kx_state_of_module(module); /* zeroed by the interpreter */
  if (kx_formats_init() < 0) return -1;

  if (add_exception(module, &st->error, "kimi_experts.KimiExpertsError",
                    "Base class of kimi_experts' own errors.", PyExc_Exception) < 0)
    return -1;
  PyObject *bases = PyTuple_Pack(2, st->error, PyExc_RuntimeError);
  if (bases == NULL) return -1;
  int rc = add_exception(module, &st->cuda_error, "kimi_experts.CudaError",
                         "A CUDA call failed; the message names the CUDA error and the call.",
                         bases);
  Py_DECREF(bases);
  if (rc < 0) return -1;
  bases = PyTuple_Pack(2, st->error, PyExc_ValueError);
  if (bases == NULL) return -1;
  rc = add_exception(module, &st->routing_error, "kimi_experts.BadRoutingError",
                     "An expert id was out of range; names the first bad (token, slot) and id "
                     "(attributes token, slot, id).",
                     bases);
  Py_DECREF(bases);
  if (rc < 0) return -1;

  if (kx_experts_types_create(module, st) == NULL || kx_gemm_type_create(module, st) == NULL)
    return -1;
  st->view_type = (PyTypeObject *)kx_dlpack_view_type_create(module);
  if (st->view_type == NULL) return -1;
  if (PyModule_AddType(module, st->experts_type) < 0 ||
      PyModule_AddType(module, st->scratch_type) < 0 ||
      PyModule_AddType(module, st->gemm_type) < 0 || PyModule_AddType(module, st->view_type) < 0)
    return -1;

#ifdef KX_WITH_CUDA
  const int built = 1;
#else
  const int built = 0;
#endif
  if (PyModule_AddObjectRef(module, "BUILT_WITH_CUDA", built ? Py_True : Py_False) < 0 ||
      PyModule_AddStringConstant(module, "BUILD", KX_BUILD_DESC) < 0)
    return -1;
  return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  kx_state *st = kx_state_of_module(module);
  Py_VISIT(st->error);
  Py_VISIT(st->cuda_error);
  Py_VISIT(st->routing_error);
  Py_VISIT(st->experts_type);
  Py_VISIT(st->scratch_type);
  Py_VISIT(st->gemm_type);
  Py_VISIT(st->view_type);
  return 0;
}

static int module_clear(PyObject *module) {
  kx_state *st = kx_state_of_module(module);
  Py_CLEAR(st->error);
  Py_CLEAR(st->cuda_error);
  Py_CLEAR(st->routing_error);
  Py_CLEAR(st->experts_type);
  Py_CLEAR(st->scratch_type);
  Py_CLEAR(st->gemm_type);
  Py_CLEAR(st->view_type);
  return 0;
}

static void module_free(void *module) {
  module_clear((PyObject *)module);
  kx_gpu_state_clear(kx_state_of_module((PyObject *)module));
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef kx_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kimi_experts._C",
    .m_doc = "kimi_experts' C core: DLPack import, the Experts/Scratch/WsGemm types, the MX "
             "format helpers and the CUDA kernels' door (see the kimi_experts package).",
    .m_size = sizeof(kx_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&kx_module_def); }
