/* ws_gemm.c: _C.WsGemm, the skinny GEMM in front of the MoE (SPEC 4).
 *
 *   WsGemm(W, *, split=None, valid=None)   W bf16 [N, K], K % 64 == 0, held (the kernel
 *                                          reads it in place); CUDA: kx_gemm_configure.
 *   prepare(m, out)                        plain: out bf16 [m, N]
 *   prepare(m, logits=L, latent=T)         split: L fp32 [m, valid], T bf16 [m, N - split]
 *   run(x, *, stream=0)                    x bf16 [m, K] -> out, or (logits, latent)
 * Outputs may be strided views (row stride free, column stride 1), e.g. two views of one
 * mailbox row. The split/valid choice is fixed at construction; prepare picks m.
 */
#include "kx.h" /* Python.h first */

#include "cpu/cpu_backend.h"
#include "gpu.h"

/* The kernel's K tile (SPEC 4 / kernels/ws_gemm.cu). */
#define KX_GEMM_K_MULTIPLE 64

typedef struct kx_wsgemm {
  PyObject_HEAD
  kx_tensor w;
  int64_t n, k, split, valid;
  int split_mode;
  kx_device device;
  kx_gpu_gemm *gpu;
  /* prepared state */
  int prepared;
  int64_t m;
  kx_tensor y, logits, latent;
  PyObject *result; /* out, or the (logits, latent) tuple, as given to prepare */
} kx_wsgemm;

static kx_state *state_of(PyTypeObject *defining_class) {
  return (kx_state *)PyType_GetModuleState(defining_class);
}

/* The CUDA kernel reads W and x through tensor maps (kimi_kernels.h): 16-byte aligned starts and
 * x's rows a multiple of 8 elements apart (a single row has no stride to speak of). */
static int check_tma_operand(const kx_tensor *t, const char *arg, int64_t rows) {
  const unsigned misaligned = (unsigned)((uintptr_t)t->data & 15);
  const int64_t stride = kx_row_stride(t);
  if (misaligned == 0 && (rows <= 1 || stride % 8 == 0)) return 0;
  PyErr_Format(PyExc_ValueError,
               "%s: the CUDA kernel expects a 16-byte aligned start and a row stride that is a "
               "multiple of 8 elements, got an address %u bytes past 16-byte alignment and row "
               "stride %lld (make it contiguous, e.g. .contiguous())",
               arg, misaligned, (long long)stride);
  return -1;
}

static PyObject *gemm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static const char *const names[] = {"W", "split", "valid", NULL};
  static const kx_argspec spec = {"WsGemm", names, 1, 1};
  PyObject *v[3];
  if (kx_parse_tuple(&spec, args, kwargs, v) < 0) return NULL;
  kx_state *st = kx_state_of_type(type);
  if (st == NULL) return NULL;
  const int has_split = v[1] != NULL && v[1] != Py_None;
  const int has_valid = v[2] != NULL && v[2] != Py_None;
  int64_t split = 0, valid = 0;
  if ((has_split && kx_arg_int64(v[1], "split", &split) < 0) ||
      (has_valid && kx_arg_int64(v[2], "valid", &valid) < 0))
    return NULL;
  if (has_split != has_valid) {
    PyErr_SetString(PyExc_ValueError,
                    "split, valid: expected both None (plain output) or both given "
                    "(split epilogue)");
    return NULL;
  }

  kx_wsgemm *self = (kx_wsgemm *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  const int64_t any2[2] = {-1, -1};
  if (kx_tensor_import(v[0], "W", KX_STREAM_NO_SYNC, &self->w) < 0 ||
      kx_check_dtype(&self->w, "W", KX_DTYPE_BFLOAT16) < 0 ||
      kx_check_shape(&self->w, "W", 2, any2) < 0 || kx_check_contiguous(&self->w, "W") < 0)
    goto fail;
  self->n = self->w.shape[0];
  self->k = self->w.shape[1];
  if (self->n < 1 || self->k < 1 || self->k % KX_GEMM_K_MULTIPLE != 0 || self->n > INT32_MAX ||
      self->k > INT32_MAX) {
    char got[64];
    kx_shape_str(2, self->w.shape, got, sizeof got);
    PyErr_Format(PyExc_ValueError,
                 "W: expected shape [N, K] with N >= 1 and K a positive multiple of %d, got %s",
                 KX_GEMM_K_MULTIPLE, got);
    goto fail;
  }
  if (has_split && !(0 <= valid && valid <= split && split <= self->n)) {
    PyErr_Format(PyExc_ValueError,
                 "split, valid: expected 0 <= valid <= split <= N = %lld, got split=%lld, "
                 "valid=%lld",
                 (long long)self->n, (long long)split, (long long)valid);
    goto fail;
  }
  self->split_mode = has_split;
  self->split = split;
  self->valid = valid;
  self->device = self->w.device;
  if (self->device.kind == KX_DEVICE_OTHER) {
    kx_check_cpu(&self->w, "W", "or CUDA");
    goto fail;
  }
  if (self->device.kind == KX_DEVICE_CUDA) {
    if (check_tma_operand(&self->w, "W", self->n) < 0 || kx_gpu_require("W", self->device.id) < 0)
      goto fail;
    self->gpu = kx_gpu_gemm_create(st, (int32_t)self->n, (int32_t)self->k, self->device.id);
    if (self->gpu == NULL) goto fail;
  }
  return (PyObject *)self;
fail:
  Py_DECREF(self);
  return NULL;
}

static void release_prepared(kx_wsgemm *self) {
  self->prepared = 0;
  kx_tensor_release(&self->y);
  kx_tensor_release(&self->logits);
  kx_tensor_release(&self->latent);
  Py_CLEAR(self->result);
}

static int gemm_traverse(PyObject *op, visitproc visit, void *arg) {
  kx_wsgemm *self = (kx_wsgemm *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->w.source);
  Py_VISIT(self->y.source);
  Py_VISIT(self->logits.source);
  Py_VISIT(self->latent.source);
  Py_VISIT(self->result);
  return 0;
}

static int gemm_clear(PyObject *op) {
  kx_wsgemm *self = (kx_wsgemm *)op;
  release_prepared(self);
  kx_tensor_release(&self->w);
  return 0;
}

static void gemm_dealloc(PyObject *op) {
  kx_wsgemm *self = (kx_wsgemm *)op;
  PyTypeObject *type = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  gemm_clear(op);
  kx_gpu_gemm_destroy(self->gpu);
  self->gpu = NULL;
  type->tp_free(op);
  Py_DECREF(type);
}

/* Imports one output and checks it against [m, cols] of `dtype` on the GEMM's device. */
static int import_output(kx_wsgemm *self, PyObject *obj, const char *arg, kx_dtype dtype,
                         int64_t m, int64_t cols, kx_tensor *out) {
  const int64_t shape[2] = {m, cols};
  if (kx_tensor_import(obj, arg, KX_STREAM_NO_SYNC, out) < 0) return -1;
  if (kx_check_device(out, arg, self->device) < 0 || kx_check_dtype(out, arg, dtype) < 0 ||
      kx_check_shape(out, arg, 2, shape) < 0 || kx_check_rows(out, arg) < 0 ||
      kx_check_writable(out, arg) < 0) {
    kx_tensor_release(out);
    return -1;
  }
  return 0;
}

/* Raises unless the outputs (y; or logits and latent with the split epilogue) share no memory
 * with `t` (W at prepare, x at each run). */
static int check_outputs_apart(int split, const kx_tensor *y, const kx_tensor *lg, const kx_tensor *lt,
                               const kx_tensor *t, const char *arg) {
  if (!split) return kx_check_disjoint(y, "out", t, arg);
  return kx_check_disjoint(lg, "logits", t, arg) < 0 || kx_check_disjoint(lt, "latent", t, arg) < 0 ? -1 : 0;
}

static PyObject *gemm_prepare(PyObject *op, PyTypeObject *Py_UNUSED(cls), PyObject *const *args,
                              Py_ssize_t nargs, PyObject *kwnames) {
  kx_wsgemm *self = (kx_wsgemm *)op;
  static const char *const names[] = {"m", "out", "logits", "latent", NULL};
  static const kx_argspec spec = {"prepare", names, 2, 1};
  PyObject *v[4];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  int64_t m = 0;
  if (kx_arg_int64(v[0], "m", &m) < 0) return NULL;
  if (m < 1 || m > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "m: expected 1 <= m <= %d, got %lld", INT32_MAX,
                 (long long)m);
    return NULL;
  }
  PyObject *out = v[1] == Py_None ? NULL : v[1];
  PyObject *logits = v[2] == Py_None ? NULL : v[2];
  PyObject *latent = v[3] == Py_None ? NULL : v[3];

  kx_tensor y = {0}, lg = {0}, lt = {0};
  PyObject *result;
  if (!self->split_mode) {
    if (out == NULL || logits != NULL || latent != NULL) {
      PyErr_Format(PyExc_ValueError,
                   "out: expected out=bf16 [m, %lld] and no logits/latent (this WsGemm has no "
                   "split epilogue; build it with split= and valid= for one)",
                   (long long)self->n);
      return NULL;
    }
    if (import_output(self, out, "out", KX_DTYPE_BFLOAT16, m, self->n, &y) < 0) return NULL;
    result = Py_NewRef(out);
  } else {
    if (out != NULL || logits == NULL || latent == NULL) {
      PyErr_Format(PyExc_ValueError,
                   "logits, latent: expected logits=float32 [m, %lld] and latent=bfloat16 "
                   "[m, %lld] and no out (this WsGemm has a split epilogue)",
                   (long long)self->valid, (long long)(self->n - self->split));
      return NULL;
    }
    if (import_output(self, logits, "logits", KX_DTYPE_FLOAT32, m, self->valid, &lg) < 0)
      return NULL;
    if (import_output(self, latent, "latent", KX_DTYPE_BFLOAT16, m, self->n - self->split, &lt) <
        0) {
      kx_tensor_release(&lg);
      return NULL;
    }
    result = kx_check_disjoint(&lg, "logits", &lt, "latent") < 0 ? NULL : PyTuple_Pack(2, logits, latent);
    if (result == NULL) {
      kx_tensor_release(&lg);
      kx_tensor_release(&lt);
      return NULL;
    }
  }
  if (check_outputs_apart(self->split_mode, &y, &lg, &lt, &self->w, "W") < 0) {
    kx_tensor_release(&y);
    kx_tensor_release(&lg);
    kx_tensor_release(&lt);
    Py_DECREF(result);
    return NULL;
  }
  /* Replace the prepared state in one step, and only then let the old one go (its destructors
   * may run Python code, which must not see a half state). */
  kx_tensor old[3] = {self->y, self->logits, self->latent};
  PyObject *old_result = self->result;
  self->y = y;
  self->logits = lg;
  self->latent = lt;
  self->result = result;
  self->m = m;
  self->prepared = 1;
  for (int i = 0; i < 3; i++) kx_tensor_release(&old[i]);
  Py_XDECREF(old_result);
  Py_RETURN_NONE;
}

static PyObject *gemm_run(PyObject *op, PyTypeObject *cls, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames) {
  kx_wsgemm *self = (kx_wsgemm *)op;
  static const char *const names[] = {"x", "stream", "inputs_on_stream", NULL};
  static const kx_argspec spec = {"run", names, 1, 1};
  PyObject *v[3];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  uintptr_t stream = 0;
  int64_t dlstream = 0; /* only CUDA producers see it */
  if (kx_arg_stream(v[1], "stream", &stream) < 0 ||
      kx_arg_inputs_stream(v[2], stream, &dlstream) < 0)
    return NULL;
  /* Import first: a producer's __dlpack__ is Python code, during which another thread may
   * re-prepare; the prepared state is read after it, and nothing below runs Python code before
   * the call is launched (or, on the CPU, its outputs are held). */
  kx_tensor x;
  if (kx_tensor_import(v[0], "x", dlstream, &x) < 0) return NULL;
  if (!self->prepared) {
    PyErr_SetString(PyExc_RuntimeError, "run(): this WsGemm has no prepared m; call prepare() first");
    kx_tensor_release(&x);
    return NULL;
  }
  const int64_t x_shape[2] = {self->m, self->k};
  if (kx_check_device(&x, "x", self->device) < 0 ||
      kx_check_dtype(&x, "x", KX_DTYPE_BFLOAT16) < 0 || kx_check_shape(&x, "x", 2, x_shape) < 0 ||
      kx_check_rows(&x, "x") < 0 ||
      (self->gpu != NULL && check_tma_operand(&x, "x", self->m) < 0) ||
      check_outputs_apart(self->split_mode, &self->y, &self->logits, &self->latent, &x, "x") < 0) {
    kx_tensor_release(&x);
    return NULL;
  }
  /* The outputs' owners (result may be a consumed capsule, which keeps nothing alive). */
  PyObject *result = Py_NewRef(self->result);
  PyObject *keep[3] = {Py_XNewRef(self->y.owner), Py_XNewRef(self->logits.owner),
                       Py_XNewRef(self->latent.owner)};
  const int split = self->split_mode;
  kx_cpu_gemm_call call = {
      .w = self->w.data,
      .n = self->n,
      .k = self->k,
      .x = x.data,
      .x_row_stride = kx_row_stride(&x),
      .m = self->m,
      .split_epilogue = split,
      .y = split ? NULL : self->y.data,
      .y_row_stride = split ? 0 : kx_row_stride(&self->y),
      .logits = split ? self->logits.data : NULL,
      .logits_row_stride = split ? kx_row_stride(&self->logits) : 0,
      .valid = self->valid,
      .latent = split ? self->latent.data : NULL,
      .latent_row_stride = split ? kx_row_stride(&self->latent) : 0,
      .split = self->split,
  };
  int rc = 0;
  if (self->gpu != NULL) {
    rc = kx_gpu_gemm_run(state_of(cls), self->gpu, &call, stream);
  } else {
    Py_BEGIN_ALLOW_THREADS
    kx_cpu_gemm(&call);
    Py_END_ALLOW_THREADS
  }
  for (int i = 0; i < 3; i++) Py_XDECREF(keep[i]);
  kx_tensor_release(&x);
  if (rc < 0) Py_CLEAR(result);
  return result;
}

#define INT_GETTER(name, expr)                                         \
  static PyObject *gemm_get_##name(PyObject *op, void *Py_UNUSED(c)) { \
    const kx_wsgemm *self = (const kx_wsgemm *)op;                     \
    return PyLong_FromLongLong((long long)(expr));                     \
  }
INT_GETTER(n, self->n)
INT_GETTER(k, self->k)
#undef INT_GETTER

static PyObject *gemm_get_split(PyObject *op, void *Py_UNUSED(c)) {
  const kx_wsgemm *self = (const kx_wsgemm *)op;
  if (!self->split_mode) Py_RETURN_NONE;
  return PyLong_FromLongLong(self->split);
}
static PyObject *gemm_get_valid(PyObject *op, void *Py_UNUSED(c)) {
  const kx_wsgemm *self = (const kx_wsgemm *)op;
  if (!self->split_mode) Py_RETURN_NONE;
  return PyLong_FromLongLong(self->valid);
}
static PyObject *gemm_get_m(PyObject *op, void *Py_UNUSED(c)) {
  const kx_wsgemm *self = (const kx_wsgemm *)op;
  if (!self->prepared) Py_RETURN_NONE;
  return PyLong_FromLongLong(self->m);
}
static PyObject *gemm_get_device(PyObject *op, void *Py_UNUSED(c)) {
  char buf[32];
  kx_device_str(((kx_wsgemm *)op)->device, buf, sizeof buf);
  return PyUnicode_FromString(buf);
}

static PyObject *gemm_repr(PyObject *op) {
  const kx_wsgemm *self = (const kx_wsgemm *)op;
  char dev[32];
  kx_device_str(self->device, dev, sizeof dev);
  if (self->split_mode)
    return PyUnicode_FromFormat("<%s N=%lld K=%lld split=%lld valid=%lld on %s>",
                                Py_TYPE(op)->tp_name, (long long)self->n, (long long)self->k,
                                (long long)self->split, (long long)self->valid, dev);
  return PyUnicode_FromFormat("<%s N=%lld K=%lld on %s>", Py_TYPE(op)->tp_name,
                              (long long)self->n, (long long)self->k, dev);
}

static PyGetSetDef gemm_getset[] = {
    {"n", gemm_get_n, NULL, PyDoc_STR("N, output columns"), NULL},
    {"k", gemm_get_k, NULL, PyDoc_STR("K, the reduction size"), NULL},
    {"split", gemm_get_split, NULL, PyDoc_STR("first latent column, or None (plain)"), NULL},
    {"valid", gemm_get_valid, NULL, PyDoc_STR("fp32 logit columns, or None (plain)"), NULL},
    {"m", gemm_get_m, NULL, PyDoc_STR("prepared m, or None"), NULL},
    {"device", gemm_get_device, NULL, PyDoc_STR("'cpu' or 'cuda:N'"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define KX_METHOD(fn) (PyCFunction)(void (*)(void))(fn)
#define KX_METHOD_FLAGS (METH_METHOD | METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef gemm_methods[] = {
    {"prepare", KX_METHOD(gemm_prepare), KX_METHOD_FLAGS,
     PyDoc_STR("prepare(m, out=None, *, logits=None, latent=None)")},
    {"run", KX_METHOD(gemm_run), KX_METHOD_FLAGS,
     PyDoc_STR("run(x, *, stream=0, inputs_on_stream=False) -> out, or (logits, latent)")},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gemm_slots[] = {
    {Py_tp_doc, (void *)PyDoc_STR("WsGemm(W, *, split=None, valid=None)\n--\n\n"
                                  "y = x @ W^T for small M (see kimi_experts.WsGemm).")},
    {Py_tp_new, gemm_new},
    {Py_tp_dealloc, gemm_dealloc},
    {Py_tp_traverse, gemm_traverse},
    {Py_tp_clear, gemm_clear},
    {Py_tp_methods, gemm_methods},
    {Py_tp_getset, gemm_getset},
    {Py_tp_repr, gemm_repr},
    {0, NULL},
};

static PyType_Spec gemm_spec = {
    .name = "kimi_experts._C.WsGemm",
    .basicsize = sizeof(kx_wsgemm),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = gemm_slots,
};

PyObject *kx_gemm_type_create(PyObject *module, kx_state *st) {
  st->gemm_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &gemm_spec, NULL);
  return (PyObject *)st->gemm_type;
}
