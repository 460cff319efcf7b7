/* kx.h: what the files of the CPython module share: the module state, argument parsing
 * and the Python-facing types' constructors. No CUDA types here (see gpu.h), so every
 * file builds the same with and without the CUDA kernels.
 *
 * References: functions returning PyObject* return new references unless their comment
 * says "borrowed".
 */
#ifndef KX_H
#define KX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack.h"

/* Most CUDA devices one process addresses; bounds the per-device probe sinks. */
#define KX_MAX_GPUS 64

/* ---- module state (one per module object: no C globals) ------------------------- */

typedef struct kx_state {
  PyObject *error;         /* kimi_experts.KimiExpertsError(Exception) */
  PyObject *cuda_error;    /* kimi_experts.CudaError(KimiExpertsError, RuntimeError) */
  PyObject *routing_error; /* kimi_experts.BadRoutingError(KimiExpertsError, ValueError) */
  PyTypeObject *experts_type;
  PyTypeObject *scratch_type;
  PyTypeObject *gemm_type;
  PyTypeObject *view_type;
  void *probe_sink[KX_MAX_GPUS]; /* device words probe_read folds into (lazily made) */
} kx_state;

extern PyModuleDef kx_module_def;

/* Borrowed state of the module (module functions) or of the module that defined a
 * heap type (methods). Never NULL for our own objects. */
kx_state *kx_state_of_module(PyObject *module);
kx_state *kx_state_of_type(PyTypeObject *type);

/* ---- argument parsing (METH_FASTCALL | METH_KEYWORDS and tp_new) ------------------ */

typedef struct kx_argspec {
  const char *fname;         /* "prepare" -> messages say "prepare()" */
  const char *const *names;  /* NULL-terminated parameter names, in order */
  int max_positional;        /* names[max_positional:] are keyword-only */
  int required;              /* names[:required] must be given */
} kx_argspec;

/* Fill values[i] (borrowed, NULL when not given) for every name. TypeError with a
 * message like Python's own for unknown, missing, duplicate or excess arguments. */
int kx_parse_fast(const kx_argspec *spec, PyObject *const *args, Py_ssize_t nargsf,
                  PyObject *kwnames, PyObject **values);
int kx_parse_tuple(const kx_argspec *spec, PyObject *args, PyObject *kwargs,
                   PyObject **values);

/* Converters: each names the argument in its TypeError/ValueError. */
int kx_arg_int64(PyObject *obj, const char *arg, int64_t *value);
int kx_arg_double(PyObject *obj, const char *arg, double *value);
int kx_arg_bool(PyObject *obj, const char *arg, int *value);
/* obj must be one of the NULL-terminated strings in choices; *index is its position. */
int kx_arg_choice(PyObject *obj, const char *arg, const char *const *choices, int *index);
/* An int cudaStream_t handle (None or missing means 0, the legacy default stream). */
int kx_arg_stream(PyObject *obj, const char *arg, uintptr_t *stream);

/* The int64 to pass to __dlpack__(stream=...) for a stream handle: the protocol spells
 * the legacy default stream 1, since 0 is ambiguous there. */
int64_t kx_dlpack_stream(uintptr_t stream);
/* The DLPack stream a run asks its inputs' producers to order them on: the run's stream,
 * or KX_STREAM_ORDERED_CUDA (passed on as -1, DLPack's "no synchronization", without
 * querying the producers' device) when the bool inputs_on_stream (NULL: False) says the
 * caller knows they are CUDA tensors ordered there already; the Python layer says so when
 * the stream is the inputs' own PyTorch current stream, which spares torch's __dlpack__ its
 * stream objects and comparisons (most of an eager run's host time). */
int kx_arg_inputs_stream(PyObject *inputs_on_stream, uintptr_t stream, int64_t *dlstream);

/* ---- the Python-facing types (each file creates its own from a PyType_Spec) ------- */

PyObject *kx_experts_types_create(PyObject *module, kx_state *st); /* Experts, Scratch */
PyObject *kx_gemm_type_create(PyObject *module, kx_state *st);

/* ---- module functions defined outside module.c ------------------------------------ */

PyObject *kx_fn_quantize_mxfp8(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames);
PyObject *kx_fn_quantize_mxfp4(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames);
PyObject *kx_fn_dequantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames);
/* NumPy's C API for the formats' outputs; called once from module exec. */
int kx_formats_init(void);

/* Raise `type` with a formatted message, chaining the pending exception (if any) as
 * __cause__. Always returns -1. */
int kx_raise_from(PyObject *type, const char *fmt, ...);

#endif /* KX_H */
