/* args.c: argument parsing for METH_FASTCALL | METH_KEYWORDS methods and tp_new.
 *
 * One small parser instead of PyArg_ParseTupleAndKeywords format strings: every
 * argument arrives as a borrowed object, and the converters below turn it into a C value
 * with a message that names the argument. Messages follow Python's own wording.
 */
#include "kx.h"

#include <stdarg.h>

static int count_names(const kx_argspec *spec) {
  int n = 0;
  while (spec->names[n] != NULL) n++;
  return n;
}

static int find_name(const kx_argspec *spec, int nnames, PyObject *key) {
  for (int i = 0; i < nnames; i++)
    if (PyUnicode_CompareWithASCIIString(key, spec->names[i]) == 0) return i;
  return -1;
}

/* Shared by both front ends once positional values are placed. */
static int place_keyword(const kx_argspec *spec, int nnames, PyObject *key, PyObject *value,
                         PyObject **values) {
  if (!PyUnicode_Check(key)) {
    PyErr_Format(PyExc_TypeError, "%s() keywords must be strings", spec->fname);
    return -1;
  }
  int i = find_name(spec, nnames, key);
  if (i < 0) {
    PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'",
                 spec->fname, key);
    return -1;
  }
  if (values[i] != NULL) {
    PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", spec->fname,
                 spec->names[i]);
    return -1;
  }
  values[i] = value;
  return 0;
}

static int place_positional(const kx_argspec *spec, int nnames, PyObject *const *args,
                            Py_ssize_t nargs, PyObject **values) {
  for (int i = 0; i < nnames; i++) values[i] = NULL;
  if (nargs > spec->max_positional) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional argument%s (%zd given)",
                 spec->fname, spec->max_positional, spec->max_positional == 1 ? "" : "s",
                 nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) values[i] = args[i];
  return 0;
}

static int check_required(const kx_argspec *spec, PyObject **values) {
  for (int i = 0; i < spec->required; i++) {
    if (values[i] == NULL) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)",
                   spec->fname, spec->names[i], i + 1);
      return -1;
    }
  }
  return 0;
}

int kx_parse_fast(const kx_argspec *spec, PyObject *const *args, Py_ssize_t nargsf,
                  PyObject *kwnames, PyObject **values) {
  int nnames = count_names(spec);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (place_positional(spec, nnames, args, nargs, values) < 0) return -1;
  if (kwnames != NULL) {
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++)
      if (place_keyword(spec, nnames, PyTuple_GET_ITEM(kwnames, i), args[nargs + i], values) <
          0)
        return -1;
  }
  return check_required(spec, values);
}

int kx_parse_tuple(const kx_argspec *spec, PyObject *args, PyObject *kwargs,
                   PyObject **values) {
  int nnames = count_names(spec);
  if (place_positional(spec, nnames, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args),
                       values) < 0)
    return -1;
  if (kwargs != NULL) {
    PyObject *key, *value; /* borrowed */
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &value))
      if (place_keyword(spec, nnames, key, value, values) < 0) return -1;
  }
  return check_required(spec, values);
}

/* ---- converters ------------------------------------------------------------------- */

int kx_arg_int64(PyObject *obj, const char *arg, int64_t *value) {
  if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", arg,
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyObject *index = PyNumber_Index(obj);
  if (index == NULL) return -1;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
  Py_DECREF(index);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (overflow != 0) {
    PyErr_Format(PyExc_ValueError, "%s: value does not fit in 64 bits", arg);
    return -1;
  }
  *value = (int64_t)v;
  return 0;
}

int kx_arg_double(PyObject *obj, const char *arg, double *value) {
  double v = PyFloat_AsDouble(obj); /* floats, ints, and anything with __float__ */
  if (v == -1.0 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s: expected a float, got %.100s", arg,
                   Py_TYPE(obj)->tp_name);
    }
    return -1;
  }
  *value = v;
  return 0;
}

int kx_arg_bool(PyObject *obj, const char *arg, int *value) {
  int v = PyObject_IsTrue(obj);
  if (v < 0) return kx_raise_from(PyExc_TypeError, "%s: expected a bool", arg);
  *value = v;
  return 0;
}

int kx_arg_choice(PyObject *obj, const char *arg, const char *const *choices, int *index) {
  if (PyUnicode_Check(obj)) {
    for (int i = 0; choices[i] != NULL; i++) {
      if (PyUnicode_CompareWithASCIIString(obj, choices[i]) == 0) {
        *index = i;
        return 0;
      }
    }
  }
  char expected[160] = "";
  size_t used = 0;
  for (int i = 0; choices[i] != NULL && used < sizeof expected; i++) {
    const char *sep = i == 0 ? "" : (choices[i + 1] == NULL ? " or " : ", ");
    int n = snprintf(expected + used, sizeof expected - used, "%s'%s'", sep, choices[i]);
    if (n < 0) break;
    used += (size_t)n;
  }
  PyErr_Format(PyUnicode_Check(obj) ? PyExc_ValueError : PyExc_TypeError,
               "%s: expected %s, got %R", arg, expected, obj);
  return -1;
}

int kx_arg_stream(PyObject *obj, const char *arg, uintptr_t *stream) {
  if (obj == NULL || obj == Py_None) {
    *stream = 0;
    return 0;
  }
  if (PyBool_Check(obj) || !PyLong_Check(obj)) {
    PyErr_Format(PyExc_TypeError,
                 "%s: expected an int cudaStream_t handle (e.g. torch.cuda.Stream()"
                 ".cuda_stream), got %.100s",
                 arg, Py_TYPE(obj)->tp_name);
    return -1;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred())
    return kx_raise_from(PyExc_ValueError,
                         "%s: expected a non-negative cudaStream_t handle, got %R", arg, obj);
  *stream = (uintptr_t)v;
  return 0;
}

int64_t kx_dlpack_stream(uintptr_t stream) {
  /* DLPack: None or 1 = legacy default stream, 2 = per-thread default, 0 disallowed. */
  return stream == 0 ? 1 : (int64_t)stream;
}

int kx_arg_inputs_stream(PyObject *inputs_on_stream, uintptr_t stream, int64_t *dlstream) {
  int on_stream = 0;
  if (inputs_on_stream != NULL && kx_arg_bool(inputs_on_stream, "inputs_on_stream", &on_stream) < 0)
    return -1;
  *dlstream = on_stream ? KX_STREAM_ORDERED_CUDA : kx_dlpack_stream(stream);
  return 0;
}

int kx_raise_from(PyObject *type, const char *fmt, ...) {
  PyObject *cause = NULL;
#if PY_VERSION_HEX >= 0x030C0000
  cause = PyErr_GetRaisedException();
#else
  PyObject *ctype, *ctb;
  PyErr_Fetch(&ctype, &cause, &ctb);
  if (ctype != NULL) {
    PyErr_NormalizeException(&ctype, &cause, &ctb);
    if (ctb != NULL && cause != NULL) PyException_SetTraceback(cause, ctb);
  }
  Py_XDECREF(ctype);
  Py_XDECREF(ctb);
#endif
  va_list ap;
  va_start(ap, fmt);
  PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
  va_end(ap);
  if (msg == NULL) {
    Py_XDECREF(cause);
    return -1;
  }
  if (cause != NULL) {
    /* "x: __dlpack__() failed: <the producer's message>" reads better than a chain. */
    PyObject *text = PyObject_Str(cause);
    if (text != NULL) {
      PyObject *joined = PyUnicode_FromFormat("%U: %U", msg, text);
      Py_DECREF(text);
      if (joined != NULL) Py_SETREF(msg, joined);
    }
    PyErr_Clear();
  }
  PyObject *exc = PyObject_CallOneArg(type, msg);
  Py_DECREF(msg);
  if (exc == NULL) {
    Py_XDECREF(cause);
    return -1;
  }
  if (cause != NULL) PyException_SetCause(exc, cause); /* steals cause */
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
  return -1;
}
