/* experts.c: _C.Experts (one MoE layer's routed experts) and _C.Scratch (its workspace).
 *
 * Life of a layer (SPEC 3, 5, 7):
 *   Experts(w13, s13, w2, s2, ...)  checks the weights once. CPU: keeps the caller's
 *                                   tensors (owners held). CUDA: packs them into a
 *                                   device copy (kx_moe_pack) and picks the launch
 *                                   config (kx_moe_configure); the caller's tensors are
 *                                   not needed afterwards.
 *   Scratch(*layers)                workspace for every layer that shares it on one
 *                                   stream. CUDA: kx_moe_scratch_bytes of device memory,
 *                                   zeroed once. CPU: nothing (the backend allocates per
 *                                   call).
 *   prepare(batch, scratch, out)    every check and choice for one batch size; keeps out.
 *   run(x, ids[, weights])          checks x/ids/weights against the prepared state,
 *                                   then one kx_moe_run on the stream (CUDA: no
 *                                   allocation, no synchronization) or kx_cpu_moe_run.
 *   check()                         the first bad id since the last check, as
 *                                   BadRoutingError; clears the record.
 * Any error is raised before anything is launched or written.
 */
#include "kx.h" /* Python.h first */

#include <string.h>

#include "cpu/cpu_backend.h"
#include "gpu.h"

enum { W13, S13, W2, S2, N_WEIGHTS };
static const char *const kWeightNames[N_WEIGHTS] = {"w13", "s13", "w2", "s2"};
static const char *const kScaleModes[] = {"rceil", "floor", NULL};

/* SPEC 3 limits. */
#define KX_MAX_TOP_K 32
#define KX_MAX_EXPERTS 4096
#define KX_HIDDEN_MULTIPLE 64
#define KX_INTER_MULTIPLE 32

typedef struct kx_scratch {
  PyObject_HEAD
  kx_device device;
  size_t nbytes;      /* device bytes (0 on the CPU) */
  void *dev_ptr;      /* CUDA: zeroed workspace, or NULL when nbytes == 0 */
} kx_scratch;

typedef struct kx_experts {
  PyObject_HEAD
  kx_moe_desc desc;
  kx_device device;
  kx_tensor w[N_WEIGHTS]; /* CPU: the caller's weights (owners held); empty on CUDA */
  kx_gpu_moe *gpu;        /* CUDA: packed weights + launch config + the fault record */
  kx_cpu_fault fault;     /* CPU: this layer's first bad id since the last check() */
  /* prepared state (prepare) */
  int prepared;
  int combine;
  int64_t batch;
  PyObject *scratch; /* kx_scratch */
  kx_tensor out;
  PyObject *out_obj; /* the object run() returns */
  uintptr_t last_stream;
} kx_experts;

static kx_state *state_of(PyTypeObject *defining_class) {
  return (kx_state *)PyType_GetModuleState(defining_class);
}

static const char *scale_name(int floor_mode) { return kScaleModes[floor_mode ? 1 : 0]; }

/* ============================== Scratch ============================================ */

static PyObject *scratch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  kx_state *st = kx_state_of_type(type);
  if (st == NULL) return NULL;
  if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
    PyErr_SetString(PyExc_TypeError, "Scratch() takes no keyword arguments");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n == 0) {
    PyErr_SetString(PyExc_TypeError,
                    "Scratch() needs at least one layer (an Experts) to size the workspace");
    return NULL;
  }
  kx_device device = {KX_DEVICE_CPU, 0};
  size_t nbytes = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *layer = PyTuple_GET_ITEM(args, i);
    if (!PyObject_TypeCheck(layer, st->experts_type)) {
      PyErr_Format(PyExc_TypeError, "layers[%zd]: expected a PersistentExperts, got %.100s", i,
                   Py_TYPE(layer)->tp_name);
      return NULL;
    }
    const kx_experts *e = (const kx_experts *)layer;
    if (i == 0) device = e->device;
    if (e->device.kind != device.kind || e->device.id != device.id) {
      char want[32], got[32];
      kx_device_str(device, want, sizeof want);
      kx_device_str(e->device, got, sizeof got);
      PyErr_Format(PyExc_ValueError,
                   "layers[%zd]: expected a layer on %s (like layers[0]), got one on %s", i,
                   want, got);
      return NULL;
    }
    if (e->gpu != NULL) {
      size_t need = kx_gpu_moe_scratch_bytes(e->gpu);
      if (need > nbytes) nbytes = need;
    }
  }
  kx_scratch *self = (kx_scratch *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->device = device;
  if (device.kind == KX_DEVICE_CUDA) {
    if (kx_gpu_alloc_zeroed(st, device.id, nbytes, &self->dev_ptr) < 0) {
      Py_DECREF(self);
      return NULL;
    }
    self->nbytes = nbytes;
  }
  return (PyObject *)self;
}

static void scratch_dealloc(PyObject *op) {
  kx_scratch *self = (kx_scratch *)op;
  PyTypeObject *type = Py_TYPE(op);
  if (self->dev_ptr != NULL) kx_gpu_free(self->device.id, self->dev_ptr);
  type->tp_free(op);
  Py_DECREF(type);
}

static PyObject *scratch_get_nbytes(PyObject *op, void *Py_UNUSED(closure)) {
  return PyLong_FromSize_t(((kx_scratch *)op)->nbytes);
}

static PyObject *scratch_get_device(PyObject *op, void *Py_UNUSED(closure)) {
  char buf[32];
  kx_device_str(((kx_scratch *)op)->device, buf, sizeof buf);
  return PyUnicode_FromString(buf);
}

static PyObject *scratch_repr(PyObject *op) {
  kx_scratch *self = (kx_scratch *)op;
  char dev[32];
  kx_device_str(self->device, dev, sizeof dev);
  return PyUnicode_FromFormat("<kimi_experts Scratch %zu bytes on %s>", self->nbytes, dev);
}

static PyGetSetDef scratch_getset[] = {
    {"nbytes", scratch_get_nbytes, NULL, PyDoc_STR("device bytes held (0 on the CPU)"), NULL},
    {"device", scratch_get_device, NULL, PyDoc_STR("'cpu' or 'cuda:N'"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot scratch_slots[] = {
    {Py_tp_doc, (void *)PyDoc_STR(
                    "Scratch(*layers)\n--\n\nWorkspace for every layer that shares it on one "
                    "stream, sized for the largest of `layers`.")},
    {Py_tp_new, scratch_new},
    {Py_tp_dealloc, scratch_dealloc},
    {Py_tp_getset, scratch_getset},
    {Py_tp_repr, scratch_repr},
    {0, NULL},
};

static PyType_Spec scratch_spec = {
    .name = "kimi_experts._C.Scratch",
    .basicsize = sizeof(kx_scratch),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = scratch_slots,
};

/* ============================== Experts: construction =============================== */

static int check_weights(kx_tensor *w, kx_moe_desc *desc) {
  const kx_tensor *w13 = &w[W13];
  int64_t any3[3] = {-1, -1, -1};
  if (kx_check_dtype(w13, "w13", KX_DTYPE_UINT8) < 0 ||
      kx_check_shape(w13, "w13", 3, any3) < 0)
    return -1;
  const int64_t e = w13->shape[0], two_i = w13->shape[1], half_h = w13->shape[2];
  const int64_t h = 2 * half_h, inter = two_i / 2;
  char got[96];
  kx_shape_str(3, w13->shape, got, sizeof got);
  if (e < 1 || e > KX_MAX_EXPERTS) {
    PyErr_Format(PyExc_ValueError,
                 "w13: expected 1 <= E <= %d experts in shape [E, 2I, H/2], got %s",
                 KX_MAX_EXPERTS, got);
    return -1;
  }
  if (two_i % (2 * KX_INTER_MULTIPLE) != 0 || two_i == 0) {
    PyErr_Format(PyExc_ValueError,
                 "w13: expected shape [E, 2I, H/2] with I a positive multiple of %d, got %s "
                 "(2I = %lld)",
                 KX_INTER_MULTIPLE, got, (long long)two_i);
    return -1;
  }
  if (h % KX_HIDDEN_MULTIPLE != 0 || h == 0) {
    PyErr_Format(PyExc_ValueError,
                 "w13: expected shape [E, 2I, H/2] with H a positive multiple of %d, got %s "
                 "(H = %lld)",
                 KX_HIDDEN_MULTIPLE, got, (long long)h);
    return -1;
  }
  if (h > INT32_MAX || inter > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "w13: shape %s is too large", got);
    return -1;
  }
  const int64_t shapes[N_WEIGHTS][3] = {
      {e, two_i, h / 2},
      {e, two_i, h / KX_MX_BLOCK},
      {e, h, inter / 2},
      {e, h, inter / KX_MX_BLOCK},
  };
  for (int i = 0; i < N_WEIGHTS; i++) {
    if (kx_check_dtype(&w[i], kWeightNames[i], KX_DTYPE_UINT8) < 0 ||
        kx_check_shape(&w[i], kWeightNames[i], 3, shapes[i]) < 0 ||
        kx_check_contiguous(&w[i], kWeightNames[i]) < 0 ||
        kx_check_device(&w[i], kWeightNames[i], w13->device) < 0)
      return -1;
  }
  if (w13->device.kind == KX_DEVICE_OTHER) return kx_check_cpu(w13, "w13", "or CUDA");
  desc->experts = (int32_t)e;
  desc->hidden = (int32_t)h;
  desc->inter = (int32_t)inter;
  return 0;
}

static int parse_cap(PyObject *obj, const char *arg, double dflt, float *out) {
  double v = dflt;
  if (obj != NULL && kx_arg_double(obj, arg, &v) < 0) return -1;
  *out = (float)v; /* inf stays inf: the cap is then the identity (SPEC 3) */
  if (!(*out > 0.0f)) { /* also a positive double that float32 rounds to 0 (cap(0, 0) is NaN) */
    PyErr_Format(PyExc_ValueError,
                 "%s: expected a positive float or float('inf') (at least float32's smallest, "
                 "1.4e-45), got %R", arg, obj);
    return -1;
  }
  return 0;
}

static PyObject *experts_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static const char *const names[] = {"w13",         "s13",          "w2",     "s2", "top_k",
                                      "beta",        "linear_beta",  "hidden_scale",
                                      "stream",      NULL};
  static const kx_argspec spec = {"PersistentExperts", names, 4, 4};
  PyObject *v[9];
  if (kx_parse_tuple(&spec, args, kwargs, v) < 0) return NULL;
  kx_state *st = kx_state_of_type(type);
  if (st == NULL) return NULL;

  kx_moe_desc desc = {0};
  int64_t top_k = 16;
  int floor_mode = 0;
  uintptr_t stream = 0;
  if ((v[4] != NULL && kx_arg_int64(v[4], "top_k", &top_k) < 0) ||
      parse_cap(v[5], "beta", 4.0, &desc.beta) < 0 ||
      parse_cap(v[6], "linear_beta", 25.0, &desc.linear_beta) < 0 ||
      (v[7] != NULL && kx_arg_choice(v[7], "hidden_scale", kScaleModes, &floor_mode) < 0) ||
      kx_arg_stream(v[8], "stream", &stream) < 0)
    return NULL;
  if (top_k < 1 || top_k > KX_MAX_TOP_K) {
    PyErr_Format(PyExc_ValueError, "top_k: expected 1 <= top_k <= %d, got %lld", KX_MAX_TOP_K,
                 (long long)top_k);
    return NULL;
  }
  desc.top_k = (int32_t)top_k;
  desc.hidden_floor = floor_mode;

  kx_experts *self = (kx_experts *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->desc = desc;
  for (int i = 0; i < N_WEIGHTS; i++)
    if (kx_tensor_import(v[i], kWeightNames[i], kx_dlpack_stream(stream), &self->w[i]) < 0)
      goto fail;
  if (check_weights(self->w, &self->desc) < 0) goto fail;
  self->device = self->w[W13].device;

  if (self->device.kind == KX_DEVICE_CUDA) {
    if (kx_gpu_require("w13", self->device.id) < 0) goto fail;
    self->gpu = kx_gpu_moe_create(st, &self->desc, self->w[W13].data, self->w[S13].data,
                                  self->w[W2].data, self->w[S2].data, self->device.id, stream);
    if (self->gpu == NULL) goto fail;
    /* The packed copy is complete (create synchronized): let the originals go. */
    for (int i = 0; i < N_WEIGHTS; i++) kx_tensor_release(&self->w[i]);
  }
  return (PyObject *)self;
fail:
  Py_DECREF(self);
  return NULL;
}

static void release_prepared(kx_experts *self) {
  self->prepared = 0;
  kx_tensor_release(&self->out);
  Py_CLEAR(self->out_obj);
  Py_CLEAR(self->scratch);
}

static int experts_traverse(PyObject *op, visitproc visit, void *arg) {
  kx_experts *self = (kx_experts *)op;
  Py_VISIT(Py_TYPE(op));
  for (int i = 0; i < N_WEIGHTS; i++) Py_VISIT(self->w[i].source);
  Py_VISIT(self->scratch);
  Py_VISIT(self->out.source);
  Py_VISIT(self->out_obj);
  return 0;
}

static int experts_clear(PyObject *op) {
  kx_experts *self = (kx_experts *)op;
  for (int i = 0; i < N_WEIGHTS; i++) kx_tensor_release(&self->w[i]);
  release_prepared(self);
  return 0;
}

static void experts_dealloc(PyObject *op) {
  kx_experts *self = (kx_experts *)op;
  PyTypeObject *type = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  experts_clear(op);
  kx_gpu_moe_destroy(self->gpu);
  self->gpu = NULL;
  type->tp_free(op);
  Py_DECREF(type);
}

/* ============================== Experts: prepare ==================================== */

static PyObject *experts_prepare(PyObject *op, PyTypeObject *cls, PyObject *const *args,
                                 Py_ssize_t nargs, PyObject *kwnames) {
  kx_experts *self = (kx_experts *)op;
  static const char *const names[] = {"batch", "scratch", "out", "combine", NULL};
  static const kx_argspec spec = {"prepare", names, 3, 3};
  PyObject *v[4];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  kx_state *st = state_of(cls);
  int64_t batch = 0;
  int combine = 0;
  if (kx_arg_int64(v[0], "batch", &batch) < 0 ||
      (v[3] != NULL && kx_arg_bool(v[3], "combine", &combine) < 0))
    return NULL;
  if (batch < 1 || batch > INT32_MAX / KX_MAX_TOP_K) {
    PyErr_Format(PyExc_ValueError, "batch: expected 1 <= batch <= %d, got %lld",
                 INT32_MAX / KX_MAX_TOP_K, (long long)batch);
    return NULL;
  }
  const int64_t rows = combine ? batch : batch * self->desc.top_k;

  PyObject *scratch_obj = v[1];
  if (!PyObject_TypeCheck(scratch_obj, st->scratch_type)) {
    PyErr_Format(PyExc_TypeError,
                 "scratch: expected a Scratch (from kimi_experts.scratch(moe)), got %.100s",
                 Py_TYPE(scratch_obj)->tp_name);
    return NULL;
  }
  const kx_scratch *scratch = (const kx_scratch *)scratch_obj;
  char want[32], got[32];
  kx_device_str(self->device, want, sizeof want);
  if (scratch->device.kind != self->device.kind || scratch->device.id != self->device.id) {
    kx_device_str(scratch->device, got, sizeof got);
    PyErr_Format(PyExc_ValueError, "scratch: expected scratch on %s (the layer's device), got %s",
                 want, got);
    return NULL;
  }
  const size_t need = self->gpu != NULL ? kx_gpu_moe_scratch_bytes(self->gpu) : 0;
  if (scratch->nbytes < need) {
    PyErr_Format(PyExc_ValueError,
                 "scratch: expected at least %zu bytes for this layer, got %zu (size it with "
                 "kimi_experts.scratch(*layers) over every layer that shares it)",
                 need, scratch->nbytes);
    return NULL;
  }

  kx_tensor out;
  const int64_t out_shape[2] = {rows, self->desc.hidden};
  if (kx_tensor_import(v[2], "out", KX_STREAM_NO_SYNC, &out) < 0) return NULL;
  if (kx_check_device(&out, "out", self->device) < 0 ||
      kx_check_dtype(&out, "out", KX_DTYPE_BFLOAT16) < 0 ||
      kx_check_shape(&out, "out", 2, out_shape) < 0 || kx_check_rows(&out, "out") < 0 ||
      kx_check_writable(&out, "out") < 0) {
    kx_tensor_release(&out);
    return NULL;
  }

  /* Everything checked: replace the prepared state in one step, and only then let the old one
   * go (its destructors may run Python code, which must not see a half state). */
  kx_tensor old_out = self->out;
  PyObject *old_out_obj = self->out_obj, *old_scratch = self->scratch;
  self->out = out;
  self->out_obj = Py_NewRef(v[2]);
  self->scratch = Py_NewRef(scratch_obj);
  self->batch = batch;
  self->combine = combine;
  self->prepared = 1;
  kx_tensor_release(&old_out);
  Py_XDECREF(old_out_obj);
  Py_XDECREF(old_scratch);
  Py_RETURN_NONE;
}

/* ============================== Experts: run / check ================================ */

static int raise_bad_routing(kx_state *st, const kx_experts *self, const kx_cpu_fault *f) {
  PyObject *exc = PyObject_CallFunction(st->routing_error, "N",
                                        PyUnicode_FromFormat(
                                            "ids[%lld, %d] = %d is out of range [0, %d)",
                                            (long long)f->token, (int)f->slot, (int)f->id,
                                            (int)self->desc.experts));
  if (exc == NULL) return -1;
  /* token, slot, id as attributes too, for code that handles the error. */
  const char *const attrs[] = {"token", "slot", "id"};
  const long long values[] = {(long long)f->token, f->slot, f->id};
  for (int i = 0; i < 3; i++) {
    PyObject *value = PyLong_FromLongLong(values[i]);
    if (value == NULL || PyObject_SetAttrString(exc, attrs[i], value) < 0) {
      Py_XDECREF(value);
      Py_DECREF(exc);
      return -1;
    }
    Py_DECREF(value);
  }
  PyErr_SetObject(st->routing_error, exc);
  Py_DECREF(exc);
  return -1;
}

/* Reads and clears this layer's first bad id; raises BadRoutingError when there was one. */
static int check_fault(kx_state *st, kx_experts *self, uintptr_t stream) {
  if (!self->prepared) return 0; /* it never ran */
  kx_cpu_fault fault = {0};
  if (self->gpu != NULL) {
    if (kx_gpu_moe_read_fault(st, self->gpu, &fault, stream) < 0) return -1;
  } else {
    fault = self->fault;
    memset(&self->fault, 0, sizeof self->fault);
  }
  return fault.bad ? raise_bad_routing(st, self, &fault) : 0;
}

static PyObject *experts_run(PyObject *op, PyTypeObject *cls, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames) {
  kx_experts *self = (kx_experts *)op;
  static const char *const names[] = {"x", "ids", "weights", "stream", "validate",
                                      "inputs_on_stream", NULL};
  static const kx_argspec spec = {"run", names, 3, 2};
  PyObject *v[6];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  kx_state *st = state_of(cls);
  uintptr_t stream = 0;
  int64_t dlstream = 0; /* only CUDA producers see it */
  int validate = 0;
  if (kx_arg_stream(v[3], "stream", &stream) < 0 ||
      (v[4] != NULL && kx_arg_bool(v[4], "validate", &validate) < 0) ||
      kx_arg_inputs_stream(v[5], stream, &dlstream) < 0)
    return NULL;
  PyObject *weights_obj = v[2] == Py_None ? NULL : v[2];
  kx_tensor x = {0}, ids = {0}, w = {0};
  PyObject *result = NULL, *out_obj = NULL, *out_owner = NULL, *scratch_obj = NULL;
  /* Every import first: a producer's __dlpack__ is Python code, during which another thread may
   * re-prepare this layer. The prepared state is read after the last one, and nothing below
   * runs Python code before the call is launched (or, on the CPU, its inputs are held). */
  if (kx_tensor_import(v[0], "x", dlstream, &x) < 0 || kx_tensor_import(v[1], "ids", dlstream, &ids) < 0 ||
      (weights_obj != NULL && kx_tensor_import(weights_obj, "weights", dlstream, &w) < 0))
    goto done;
  if (!self->prepared) {
    PyErr_SetString(PyExc_RuntimeError,
                    "run(): this layer has no prepared batch; call prepare() first");
    goto done;
  }
  const int64_t batch = self->batch;
  if (self->combine && weights_obj == NULL) {
    PyErr_Format(PyExc_ValueError,
                 "weights: required: the layer was prepared with combine=True "
                 "(expected float32 [%lld, %d])",
                 (long long)batch, (int)self->desc.top_k);
    goto done;
  }
  if (!self->combine && weights_obj != NULL) {
    PyErr_SetString(PyExc_ValueError,
                    "weights: expected None: the layer was prepared for per-slot rows "
                    "(prepare(..., combine=True) to combine)");
    goto done;
  }
  const int64_t x_shape[2] = {batch, self->desc.hidden};
  const int64_t k_shape[2] = {batch, self->desc.top_k};
  if (kx_check_device(&x, "x", self->device) < 0 || kx_check_dtype(&x, "x", KX_DTYPE_BFLOAT16) < 0 ||
      kx_check_shape(&x, "x", 2, x_shape) < 0 || kx_check_rows(&x, "x") < 0)
    goto done;
  if (kx_check_device(&ids, "ids", self->device) < 0 ||
      kx_check_dtype(&ids, "ids", KX_DTYPE_INT32) < 0 ||
      kx_check_shape(&ids, "ids", 2, k_shape) < 0 || kx_check_rows(&ids, "ids") < 0)
    goto done;
  if (weights_obj != NULL &&
      (kx_check_device(&w, "weights", self->device) < 0 ||
       kx_check_dtype(&w, "weights", KX_DTYPE_FLOAT32) < 0 ||
       kx_check_shape(&w, "weights", 2, k_shape) < 0 || kx_check_rows(&w, "weights") < 0))
    goto done;
  if (kx_check_disjoint(&self->out, "out", &x, "x") < 0 || kx_check_disjoint(&self->out, "out", &ids, "ids") < 0 ||
      (weights_obj != NULL && kx_check_disjoint(&self->out, "out", &w, "weights") < 0))
    goto done;
  /* What the call writes, held while other threads may run (and re-prepare). */
  out_obj = Py_NewRef(self->out_obj);
  out_owner = Py_NewRef(self->out.owner);
  scratch_obj = Py_NewRef(self->scratch);

  kx_cpu_moe_call call = {
      .x = x.data,
      .x_row_stride = kx_row_stride(&x),
      .ids = ids.data,
      .ids_row_stride = kx_row_stride(&ids),
      .route_weights = weights_obj != NULL ? w.data : NULL,
      .weights_row_stride = weights_obj != NULL ? kx_row_stride(&w) : 0,
      .batch = batch,
      .out = self->out.data,
      .out_row_stride = kx_row_stride(&self->out),
  };
  kx_scratch *scratch = (kx_scratch *)scratch_obj;
  if (self->gpu != NULL) {
    if (kx_gpu_moe_run(st, self->gpu, scratch->dev_ptr, &call, stream) < 0) goto done;
  } else {
    const kx_cpu_moe_layer layer = {
        .w13 = self->w[W13].data,
        .s13 = self->w[S13].data,
        .w2 = self->w[W2].data,
        .s2 = self->w[S2].data,
        .experts = self->desc.experts,
        .hidden = self->desc.hidden,
        .inter = self->desc.inter,
        .top_k = self->desc.top_k,
        .beta = self->desc.beta,
        .linear_beta = self->desc.linear_beta,
        .hidden_scale = self->desc.hidden_floor ? KX_SCALE_FLOOR : KX_SCALE_RCEIL,
    };
    kx_cpu_fault fault = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kx_cpu_moe_run(&layer, &call, &fault);
    Py_END_ALLOW_THREADS
    if (fault.bad && !self->fault.bad) self->fault = fault;
    if (rc != 0) {
      PyErr_SetString(PyExc_MemoryError, "run(): the CPU backend could not allocate its work lists");
      goto done;
    }
  }
  self->last_stream = stream;
  if (validate && check_fault(st, self, stream) < 0) goto done;
  result = Py_NewRef(out_obj);
done:
  kx_tensor_release(&x);
  kx_tensor_release(&ids);
  kx_tensor_release(&w);
  Py_XDECREF(out_obj);
  Py_XDECREF(out_owner);
  Py_XDECREF(scratch_obj);
  return result;
}

static PyObject *experts_check(PyObject *op, PyTypeObject *cls, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames) {
  kx_experts *self = (kx_experts *)op;
  static const char *const names[] = {"stream", NULL};
  static const kx_argspec spec = {"check", names, 0, 0};
  PyObject *v[1];
  if (kx_parse_fast(&spec, args, nargs, kwnames, v) < 0) return NULL;
  uintptr_t stream = self->last_stream;
  if (v[0] != NULL && v[0] != Py_None && kx_arg_stream(v[0], "stream", &stream) < 0) return NULL;
  if (check_fault(state_of(cls), self, stream) < 0) return NULL;
  Py_RETURN_NONE;
}

/* ============================== Experts: attributes ================================= */

#define INT_GETTER(name, expr)                                          \
  static PyObject *experts_get_##name(PyObject *op, void *Py_UNUSED(c)) { \
    const kx_experts *self = (const kx_experts *)op;                    \
    return PyLong_FromLongLong((long long)(expr));                      \
  }
INT_GETTER(experts, self->desc.experts)
INT_GETTER(hidden, self->desc.hidden)
INT_GETTER(inter, self->desc.inter)
INT_GETTER(top_k, self->desc.top_k)
INT_GETTER(packed_bytes, self->gpu != NULL ? kx_gpu_moe_packed_bytes(self->gpu) : 0)
INT_GETTER(scratch_bytes, self->gpu != NULL ? kx_gpu_moe_scratch_bytes(self->gpu) : 0)
#undef INT_GETTER

static PyObject *experts_get_beta(PyObject *op, void *Py_UNUSED(c)) {
  return PyFloat_FromDouble(((kx_experts *)op)->desc.beta);
}
static PyObject *experts_get_linear_beta(PyObject *op, void *Py_UNUSED(c)) {
  return PyFloat_FromDouble(((kx_experts *)op)->desc.linear_beta);
}
static PyObject *experts_get_hidden_scale(PyObject *op, void *Py_UNUSED(c)) {
  return PyUnicode_FromString(scale_name(((kx_experts *)op)->desc.hidden_floor));
}
static PyObject *experts_get_device(PyObject *op, void *Py_UNUSED(c)) {
  char buf[32];
  kx_device_str(((kx_experts *)op)->device, buf, sizeof buf);
  return PyUnicode_FromString(buf);
}
static PyObject *experts_get_batch(PyObject *op, void *Py_UNUSED(c)) {
  const kx_experts *self = (const kx_experts *)op;
  if (!self->prepared) Py_RETURN_NONE;
  return PyLong_FromLongLong(self->batch);
}
static PyObject *experts_get_combine(PyObject *op, void *Py_UNUSED(c)) {
  const kx_experts *self = (const kx_experts *)op;
  if (!self->prepared) Py_RETURN_NONE;
  return PyBool_FromLong(self->combine);
}

static PyObject *experts_repr(PyObject *op) {
  const kx_experts *self = (const kx_experts *)op;
  char dev[32];
  kx_device_str(self->device, dev, sizeof dev);
  return PyUnicode_FromFormat("<%s E=%d H=%d I=%d top_k=%d hidden_scale=%s on %s>",
                              Py_TYPE(op)->tp_name, (int)self->desc.experts,
                              (int)self->desc.hidden, (int)self->desc.inter,
                              (int)self->desc.top_k, scale_name(self->desc.hidden_floor), dev);
}

static PyGetSetDef experts_getset[] = {
    {"experts", experts_get_experts, NULL, PyDoc_STR("E, the number of experts"), NULL},
    {"hidden", experts_get_hidden, NULL, PyDoc_STR("H, the hidden size"), NULL},
    {"inter", experts_get_inter, NULL, PyDoc_STR("I, the intermediate size per expert"), NULL},
    {"top_k", experts_get_top_k, NULL, PyDoc_STR("K_top, routed slots per token"), NULL},
    {"beta", experts_get_beta, NULL, PyDoc_STR("SiTU cap on the gate (inf: none)"), NULL},
    {"linear_beta", experts_get_linear_beta, NULL, PyDoc_STR("SiTU cap on the up half"), NULL},
    {"hidden_scale", experts_get_hidden_scale, NULL, PyDoc_STR("'rceil' or 'floor'"), NULL},
    {"device", experts_get_device, NULL, PyDoc_STR("'cpu' or 'cuda:N'"), NULL},
    {"packed_bytes", experts_get_packed_bytes, NULL,
     PyDoc_STR("extra device bytes of the kernel-layout weight copy (0 on the CPU)"), NULL},
    {"scratch_bytes", experts_get_scratch_bytes, NULL,
     PyDoc_STR("scratch bytes this layer needs (0 on the CPU)"), NULL},
    {"batch", experts_get_batch, NULL, PyDoc_STR("prepared batch, or None"), NULL},
    {"combine", experts_get_combine, NULL, PyDoc_STR("prepared combine flag, or None"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define KX_METHOD(fn) (PyCFunction)(void (*)(void))(fn)
#define KX_METHOD_FLAGS (METH_METHOD | METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef experts_methods[] = {
    {"prepare", KX_METHOD(experts_prepare), KX_METHOD_FLAGS,
     PyDoc_STR("prepare(batch, scratch, out, *, combine=False)")},
    {"run", KX_METHOD(experts_run), KX_METHOD_FLAGS,
     PyDoc_STR("run(x, ids, weights=None, *, stream=0, validate=False, "
               "inputs_on_stream=False) -> out")},
    {"check", KX_METHOD(experts_check), KX_METHOD_FLAGS,
     PyDoc_STR("check(*, stream=None): raise BadRoutingError for the first bad id")},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot experts_slots[] = {
    {Py_tp_doc, (void *)PyDoc_STR(
                    "Experts(w13, s13, w2, s2, *, top_k=16, beta=4.0, linear_beta=25.0, "
                    "hidden_scale='rceil', stream=0)\n--\n\nOne MoE layer's routed experts "
                    "(see kimi_experts.PersistentExperts).")},
    {Py_tp_new, experts_new},
    {Py_tp_dealloc, experts_dealloc},
    {Py_tp_traverse, experts_traverse},
    {Py_tp_clear, experts_clear},
    {Py_tp_methods, experts_methods},
    {Py_tp_getset, experts_getset},
    {Py_tp_repr, experts_repr},
    {0, NULL},
};

static PyType_Spec experts_spec = {
    .name = "kimi_experts._C.Experts",
    .basicsize = sizeof(kx_experts),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = experts_slots,
};

PyObject *kx_experts_types_create(PyObject *module, kx_state *st) {
  st->experts_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &experts_spec, NULL);
  if (st->experts_type == NULL) return NULL;
  st->scratch_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &scratch_spec, NULL);
  if (st->scratch_type == NULL) return NULL;
  return module;
}
