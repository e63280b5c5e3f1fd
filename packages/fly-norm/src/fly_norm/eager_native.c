/* The eager plans' fast path in C (fly_norm._kernels.eager): the gate, the plan key and the launch of a
 * plain small call (rms_norm / layer_norm with no residual and no weight offset, softmax over the last
 * dim) with no Python bytecode between the caller and Triton's C launch function.
 *
 * call(plans, prefix, x, w, b, eps) returns y, or None when the Python path must take the call: anything
 * the gate does not accept, a key with no plan yet (the Python path makes it) or a plan of None. The
 * caller checks first that torch.compile is not tracing (this function is opaque to it). It makes the
 * checks eager.rows_device, eager.vector_key and the callers make, and builds the same key: (prefix,
 * dtype, n, device, m >> 31, x.data_ptr() % 16, weight key, bias key).
 * The plan is the tuple eager.make_plan makes: (C launch, function, cooperative, pdl, packed metadata,
 * constexpr tail, device, rows a program, argument layout, driver signature); the layout names, for each
 * runtime argument of the kernel, which value goes there (ARG_* below, eager.ARG_* in Python).
 *
 * The launch goes straight to the CUDA driver (cuLaunchKernel, the parameters packed here by the plan's
 * driver signature: flydsl's Bound.driver_signature) once driver() has found libcuda; Triton's C launch
 * function, which parses a Python tuple of every argument first, serves plans the driver path does not
 * take (no signature: among them cooperative, PDL and cluster launches) and calls on a thread with no current
 * context.
 *
 * The tensors' fields, grad mode and the output's allocation are read through torch's Python methods
 * (this module builds with the compiler and Python headers Triton's launchers need, nothing of torch's).
 *
 * Errors raised by the objects it calls are cleared and the call falls back to Python, which raises
 * them properly; an error from the launch itself propagates.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

enum { ARG_NONE, ARG_X, ARG_W, ARG_B, ARG_Y, ARG_M, ARG_N, ARG_EPS, ARG_ZERO };

static PyObject *tensor_type, *parameter_type, *off_list, *grad_enabled, *current_device, *current_stream,
    *runtime_knobs, *empty_like;
static PyObject *s_is_cuda, *s_is_contiguous, *s_shape, *s_get_device, *s_requires_grad, *s_data_ptr, *s_dtype,
    *s_enter, *s_exit, *s_calls;
static PyObject *zero, *one;

/* The driver entry points (libcuda's, or a test's stand-ins: driver()). CUresult is an int enum; CUfunction,
 * CUstream and CUcontext are pointers. */
typedef int (*cu_launch_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned shared, void *stream, void **params, void **extra);
typedef int (*cu_ctx_t)(void **ctx);
typedef int (*cu_error_t)(int err, const char **text);
static cu_launch_t cu_launch;
static cu_ctx_t cu_ctx;
static cu_error_t cu_error;
#define MAX_PARAMS 64

static PyObject *driver(PyObject *self, PyObject *args) {
    unsigned long long launch_fn = 0, ctx_fn = 0;
    if (PyTuple_GET_SIZE(args) == 0) { /* libcuda's (loaded already by whoever made the CUDA context) */
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        launch_fn = h ? (unsigned long long)(uintptr_t)dlsym(h, "cuLaunchKernel") : 0;
        ctx_fn = h ? (unsigned long long)(uintptr_t)dlsym(h, "cuCtxGetCurrent") : 0;
        cu_error = h ? (cu_error_t)dlsym(h, "cuGetErrorString") : NULL;
    } else if (!PyArg_ParseTuple(args, "KK", &launch_fn, &ctx_fn)) {
        return NULL;
    } else {
        cu_error = NULL;
    }
    cu_launch = launch_fn && ctx_fn ? (cu_launch_t)(uintptr_t)launch_fn : NULL;
    cu_ctx = cu_launch ? (cu_ctx_t)(uintptr_t)ctx_fn : NULL;
    return PyBool_FromLong(cu_launch != NULL);
}

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *objs[8];
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7]))
        return NULL;
    if (!PyType_Check(objs[0]) || !PyType_Check(objs[1]) || !PyList_Check(objs[2])) {
        PyErr_SetString(PyExc_TypeError, "setup: two types, then a list");
        return NULL;
    }
    PyObject **slots[8] = {&tensor_type, &parameter_type, &off_list, &grad_enabled, &current_device,
                           &current_stream, &runtime_knobs, &empty_like};
    for (int i = 0; i < 8; i++) {
        Py_INCREF(objs[i]);
        Py_XSETREF(*slots[i], objs[i]);
    }
    Py_RETURN_NONE;
}

/* 1 when r (a new reference, consumed) is True, 0 when anything else, -1 when NULL (an error is set). */
static int is_true(PyObject *r) {
    if (!r) return -1;
    int t = r == Py_True;
    Py_DECREF(r);
    return t;
}

/* 1 when Triton has no launch hook installed (flydsl.compiler.hooks_idle: a hook is a HookChain with no
 * calls, or None), 0 when it has one, -1 on error. */
static int hooks_idle(void) {
    PyObject *names[2] = {s_enter, s_exit};
    for (int i = 0; i < 2; i++) {
        PyObject *hook = PyObject_GetAttr(runtime_knobs, names[i]);
        if (!hook) return -1;
        PyObject *calls = PyObject_GetAttr(hook, s_calls);
        if (!calls) {
            PyErr_Clear();
            calls = Py_NewRef(hook); /* an older Triton's plain function (or None) */
        }
        Py_DECREF(hook);
        int set = PyObject_IsTrue(calls);
        Py_DECREF(calls);
        if (set) return set < 0 ? -1 : 0;
    }
    return 1;
}

/* An integer a method returns (-1 with an error set when it fails). */
static long long method_ll(PyObject *o, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(o, name);
    if (!r) return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return v;
}

static unsigned long long data_ptr(PyObject *o) {
    PyObject *r = PyObject_CallMethodNoArgs(o, s_data_ptr);
    if (!r) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    return v;
}

/* What the gate reads of a tensor. dtype and shape are new references; fields_clear releases them. */
typedef struct {
    unsigned long long ptr;
    long long numel, n; /* n: the last dimension (0 for a 0-d tensor) */
    int ndim, device, requires_grad;
    PyObject *dtype, *shape;
} fields;

static void fields_clear(fields *f) {
    Py_CLEAR(f->dtype);
    Py_CLEAR(f->shape);
}

/* t's fields when t is a contiguous CUDA tensor: 1; else 0 (or 0 with an error set, which the caller clears
 * before its Python path takes the call). requires_grad is read only when ``grad`` (else 0). Through the
 * tensor's Python attributes and methods. */
static int read_fields(PyObject *t, fields *f, int grad) {
    memset(f, 0, sizeof *f);
    if (is_true(PyObject_GetAttr(t, s_is_cuda)) != 1 || is_true(PyObject_CallMethodNoArgs(t, s_is_contiguous)) != 1)
        return 0;
    f->shape = PyObject_GetAttr(t, s_shape);
    if (!f->shape || !PyTuple_Check(f->shape)) return 0;
    f->ndim = (int)PyTuple_GET_SIZE(f->shape);
    f->numel = 1; /* numel from the shape: no method call */
    for (int i = 0; i < f->ndim; i++) {
        f->n = PyLong_AsLongLong(PyTuple_GET_ITEM(f->shape, i));
        f->numel *= f->n;
    }
    if (PyErr_Occurred()) return 0;
    long long dev = method_ll(t, s_get_device);
    if (dev < 0 || dev > INT32_MAX) return 0;
    f->device = (int)dev;
    if (grad && (f->requires_grad = is_true(PyObject_GetAttr(t, s_requires_grad))) < 0) return 0;
    f->ptr = data_ptr(t);
    if (PyErr_Occurred()) return 0;
    return (f->dtype = PyObject_GetAttr(t, s_dtype)) != NULL;
}

/* A weight's or bias's key part as eager.vector_key: a new reference to None or (dtype, shape, ptr % 16);
 * NULL with *ok = 0 when no plan can take it (another device, not contiguous, needing a gradient while
 * ``grad``, not a tensor), or on error. *ptr gets its data pointer (0 when absent). */
static PyObject *vector_key(PyObject *v, long long dev, int grad, unsigned long long *ptr, int *ok) {
    *ptr = 0;
    *ok = 1;
    if (v == Py_None) Py_RETURN_NONE;
    *ok = 0;
    if (Py_TYPE(v) != (PyTypeObject *)tensor_type && Py_TYPE(v) != (PyTypeObject *)parameter_type) return NULL;
    fields f;
    PyObject *key = NULL;
    if (read_fields(v, &f, grad) && f.device == dev && !f.requires_grad) {
        PyObject *low = PyLong_FromUnsignedLongLong(f.ptr & 15);
        key = low ? PyTuple_Pack(3, f.dtype, f.shape, low) : NULL;
        Py_XDECREF(low);
        *ptr = f.ptr;
    }
    fields_clear(&f);
    *ok = key != NULL;
    return key;
}

/* One kernel parameter of driver-signature letter t into *slot: 1, or 0 when it cannot be passed (the value
 * does not fit the type, a type this path does not pack). */
static int pack(char t, int is_float, long long i, double f, uint64_t *slot) {
    *slot = 0;
    if (t == 'f') {
        float v = (float)(is_float ? f : (double)i);
        memcpy(slot, &v, sizeof v);
        return 1;
    }
    if (is_float) return 0;
    switch (t) {
        case 'p': case 'l': case 'L': *slot = (uint64_t)i; return 1;
        case 'i': if (i < INT32_MIN || i > INT32_MAX) return 0; { int32_t v = (int32_t)i; memcpy(slot, &v, 4); } return 1;
        case 'I': if (i < 0 || i > UINT32_MAX) return 0; { uint32_t v = (uint32_t)i; memcpy(slot, &v, 4); } return 1;
        case 'h': if (i < INT16_MIN || i > INT16_MAX) return 0; { int16_t v = (int16_t)i; memcpy(slot, &v, 2); } return 1;
        case 'H': if (i < 0 || i > UINT16_MAX) return 0; { uint16_t v = (uint16_t)i; memcpy(slot, &v, 2); } return 1;
        case 'b': if (i < INT8_MIN || i > INT8_MAX) return 0; { int8_t v = (int8_t)i; memcpy(slot, &v, 1); } return 1;
        case 'B': if (i < 0 || i > UINT8_MAX) return 0; { uint8_t v = (uint8_t)i; memcpy(slot, &v, 1); } return 1;
        default: return 0;
    }
}

/* The launch through the driver: 1 launched, 0 not a plan or call for this path (the caller takes Triton's
 * launch function, which raises what is wrong), -1 the launch failed (an error set). */
static int driver_launch(PyObject *plan, long long grid, const unsigned long long *ptrs, long long m, long long n,
                         double eps) {
    PyObject *sig = PyTuple_GET_ITEM(plan, 9), *packed = PyTuple_GET_ITEM(plan, 4), *tail = PyTuple_GET_ITEM(plan, 5),
             *layout = PyTuple_GET_ITEM(plan, 8);
    /* A signature exists only for plain launches (no cluster, cooperative or PDL attribute: the runtime's
     * Bound.driver_signature), so the plan's flags need no check here. */
    if (!cu_launch || !PyUnicode_Check(sig) || !PyTuple_Check(packed) || PyTuple_GET_SIZE(packed) != 3) return 0;
    long warps = PyLong_AsLong(PyTuple_GET_ITEM(packed, 0)), shared = PyLong_AsLong(PyTuple_GET_ITEM(packed, 2));
    Py_ssize_t len, nl = PyTuple_GET_SIZE(layout);
    const char *s = PyUnicode_AsUTF8AndSize(sig, &len);
    if (!s || PyErr_Occurred() || warps <= 0 || warps > 32 || shared < 0 || grid > INT32_MAX
        || len != nl + PyTuple_GET_SIZE(tail))
        return 0;
    uint64_t slots[MAX_PARAMS + 2];
    void *params[MAX_PARAMS + 2];
    int np = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        if (s[i] == 'c') continue; /* a constexpr: compiled in, not a parameter */
        if (np == MAX_PARAMS) return 0;
        long long iv = 0;
        double fv = 0.0;
        int is_float = 0;
        if (i < nl) {
            switch (PyLong_AsLong(PyTuple_GET_ITEM(layout, i))) {
                case ARG_NONE: case ARG_ZERO: break;
                case ARG_X: iv = (long long)ptrs[0]; break;
                case ARG_W: iv = (long long)ptrs[1]; break;
                case ARG_B: iv = (long long)ptrs[2]; break;
                case ARG_Y: iv = (long long)ptrs[3]; break;
                case ARG_M: iv = m; break;
                case ARG_N: iv = n; break;
                case ARG_EPS: fv = eps; is_float = 1; break;
                default: return 0;
            }
        } else { /* a runtime argument given by keyword with the constexprs */
            PyObject *v = PyTuple_GET_ITEM(tail, i - nl);
            if (PyFloat_Check(v)) {
                fv = PyFloat_AS_DOUBLE(v);
                is_float = 1;
            } else if (PyLong_Check(v)) {
                iv = PyLong_AsLongLong(v);
            } else if (v != Py_None) {
                return 0;
            }
        }
        if (PyErr_Occurred() || !pack(s[i], is_float, iv, fv, &slots[np])) return 0;
        params[np] = &slots[np];
        np++;
    }
    for (int k = 0; k < 2; k++, np++) { /* Triton's global and profile scratch pointers: none */
        slots[np] = 0;
        params[np] = &slots[np];
    }
    void *ctx = NULL;
    if (cu_ctx(&ctx) != 0 || !ctx) return 0; /* no current context on this thread: Triton's launch makes it */
    if (grid == 0) return 1;
    PyObject *stream_obj = PyObject_CallOneArg(current_stream, PyTuple_GET_ITEM(plan, 6));
    unsigned long long stream = stream_obj ? PyLong_AsUnsignedLongLong(stream_obj) : 0;
    Py_XDECREF(stream_obj);
    if (PyErr_Occurred()) return -1;
    void *function = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(plan, 1));
    if (PyErr_Occurred()) return -1;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = cu_launch(function, (unsigned)grid, 1, 1, (unsigned)(32 * warps), 1, 1, (unsigned)shared,
                    (void *)(uintptr_t)stream, params, NULL);
    Py_END_ALLOW_THREADS
    if (err) {
        const char *text = NULL;
        if (!cu_error || cu_error(err, &text) != 0) text = NULL;
        PyErr_Format(PyExc_RuntimeError, "fly_norm: kernel launch failed: CUDA error %d (%s)", err,
                     text ? text : "no description");
        return -1;
    }
    return 1;
}

static PyObject *launch(PyObject *plan, unsigned long long xp, unsigned long long wp, unsigned long long bp,
                        unsigned long long yp, long long m, long long n, PyObject *eps) {
    PyObject *c_launch = PyTuple_GET_ITEM(plan, 0), *tail = PyTuple_GET_ITEM(plan, 5),
             *layout = PyTuple_GET_ITEM(plan, 8);
    long long block_m = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 7));
    if (block_m <= 0 || !PyTuple_Check(tail) || !PyTuple_Check(layout)) return NULL;
    unsigned long long ptrs[4] = {xp, wp, bp, yp};
    int done = driver_launch(plan, (m + block_m - 1) / block_m, ptrs, m, n, PyFloat_AsDouble(eps));
    if (done) return done > 0 ? Py_NewRef(Py_None) : NULL;
    PyErr_Clear(); /* not for the driver path (whatever it read that failed, Triton's launch reports) */
    PyObject *stream = PyObject_CallOneArg(current_stream, PyTuple_GET_ITEM(plan, 6));
    if (!stream) return NULL;
    Py_ssize_t nl = PyTuple_GET_SIZE(layout), nt = PyTuple_GET_SIZE(tail);
    PyObject *args = PyTuple_New(13 + nl + nt);
    if (!args) {
        Py_DECREF(stream);
        return NULL;
    }
    PyObject *head[13] = {PyLong_FromLongLong((m + block_m - 1) / block_m), one, one, stream,
                          PyTuple_GET_ITEM(plan, 1), PyTuple_GET_ITEM(plan, 2), PyTuple_GET_ITEM(plan, 3),
                          Py_None, Py_None, PyTuple_GET_ITEM(plan, 4), Py_None, Py_None, Py_None};
    PyTuple_SET_ITEM(args, 0, head[0]);  /* new references: grid and stream */
    PyTuple_SET_ITEM(args, 3, stream);
    for (int i = 1; i < 13; i++) {
        if (i == 3) continue;
        Py_INCREF(head[i]);
        PyTuple_SET_ITEM(args, i, head[i]);
    }
    int bad = head[0] == NULL;
    for (Py_ssize_t i = 0; i < nl && !bad; i++) {
        PyObject *v;
        switch (PyLong_AsLong(PyTuple_GET_ITEM(layout, i))) {
            case ARG_NONE: v = Py_NewRef(Py_None); break;
            case ARG_X: v = PyLong_FromUnsignedLongLong(xp); break;
            case ARG_W: v = wp ? PyLong_FromUnsignedLongLong(wp) : Py_NewRef(Py_None); break;
            case ARG_B: v = bp ? PyLong_FromUnsignedLongLong(bp) : Py_NewRef(Py_None); break;
            case ARG_Y: v = PyLong_FromUnsignedLongLong(yp); break;
            case ARG_M: v = PyLong_FromLongLong(m); break;
            case ARG_N: v = PyLong_FromLongLong(n); break;
            case ARG_EPS: v = Py_NewRef(eps); break;
            case ARG_ZERO: v = Py_NewRef(zero); break;
            default: v = NULL; /* a layout this path does not fill (residual operands): Python's */
        }
        if (!v) bad = 1;
        else PyTuple_SET_ITEM(args, 13 + i, v);
    }
    if (bad) { /* the slots not filled are NULL, which freeing a tuple allows */
        Py_DECREF(args);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nt; i++) PyTuple_SET_ITEM(args, 13 + nl + i, Py_NewRef(PyTuple_GET_ITEM(tail, i)));
    PyObject *r = PyObject_Call(c_launch, args, NULL);
    Py_DECREF(args);
    return r;
}

#define FALLBACK() \
    do { \
        PyErr_Clear(); \
        goto fallback; \
    } while (0)

static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "call(plans, prefix, x, w, b, eps)");
        return NULL;
    }
    PyObject *plans = args[0], *prefix = args[1], *x = args[2], *w = args[3], *b = args[4], *eps_in = args[5];
    PyObject *wkey = NULL, *bkey = NULL, *key = NULL, *eps = NULL, *y = NULL;
    fields xf = {0};
    /* The caller has checked that no tracing is on (torch.compile cannot trace this function). */
    if (!tensor_type || !PyDict_Check(plans) || PyList_GET_SIZE(off_list)) goto fallback;
    if (Py_TYPE(x) != (PyTypeObject *)tensor_type) goto fallback;
    int grad = is_true(PyObject_CallNoArgs(grad_enabled));
    if (grad < 0 || !read_fields(x, &xf, grad) || xf.ndim == 0 || xf.n <= 0 || xf.requires_grad) FALLBACK();
    long long dev = xf.device, n = xf.n, m = xf.numel / xf.n;
    PyObject *cur = PyObject_CallNoArgs(current_device);
    long long cur_dev = cur ? PyLong_AsLongLong(cur) : -2;
    Py_XDECREF(cur);
    if (dev != cur_dev || hooks_idle() != 1) FALLBACK();
    unsigned long long xp = xf.ptr, wp, bp;
    double e = 0.0;
    if (eps_in != Py_None) {
        e = PyFloat_AsDouble(eps_in);
        if (e == -1.0 && PyErr_Occurred()) FALLBACK();
    }
    int ok;
    wkey = vector_key(w, dev, grad, &wp, &ok);
    if (!ok) FALLBACK();
    bkey = vector_key(b, dev, grad, &bp, &ok);
    if (!ok) FALLBACK();
    key = Py_BuildValue("(OOLLLKOO)", prefix, xf.dtype, n, dev, m >> 31, xp & 15, wkey, bkey);
    if (!key) FALLBACK();
    PyObject *plan = PyDict_GetItemWithError(plans, key); /* borrowed */
    if (!plan || plan == Py_None || !PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 10) FALLBACK();
    Py_INCREF(plan); /* the dict may change under the calls below */
    eps = PyFloat_FromDouble(e);
    unsigned long long yp = 0;
    y = !eps ? NULL : PyObject_CallOneArg(empty_like, x);
    if (y) {
        yp = data_ptr(y);
        if (PyErr_Occurred()) Py_CLEAR(y);
    }
    if (!y) {
        Py_DECREF(plan);
        FALLBACK();
    }
    PyObject *r = launch(plan, xp, wp, bp, yp, m, n, eps);
    Py_DECREF(plan);
    if (!r) {
        Py_CLEAR(y);
        if (!PyErr_Occurred()) goto fallback; /* a plan this path cannot fill */
        goto done;                             /* the launch raised: propagate */
    }
    Py_DECREF(r);
    goto done;
fallback:
    Py_CLEAR(y);
    y = Py_NewRef(Py_None);
done:
    fields_clear(&xf);
    Py_XDECREF(wkey);
    Py_XDECREF(bkey);
    Py_XDECREF(key);
    Py_XDECREF(eps);
    return y;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, "setup(tensor type, Parameter type, off list, is_grad_enabled, current device, "
                                   "current raw stream, triton.knobs.runtime, empty_like)"},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "call(plans, prefix, x, w, b, eps) -> y or None"},
    {"driver", driver, METH_VARARGS, "driver() finds libcuda's launch; driver(launch address, current-context "
                                     "address) takes stand-ins (0, 0: none). True when the driver path is on"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fly_norm_eager_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_fly_norm_eager_native(void) {
    const char *names[] = {"is_cuda", "is_contiguous", "shape", "get_device", "requires_grad", "data_ptr", "dtype",
                           "launch_enter_hook", "launch_exit_hook", "calls"};
    PyObject **slots[] = {&s_is_cuda, &s_is_contiguous, &s_shape, &s_get_device, &s_requires_grad, &s_data_ptr,
                          &s_dtype, &s_enter, &s_exit, &s_calls};
    for (int i = 0; i < 10; i++)
        if (!(*slots[i] = PyUnicode_InternFromString(names[i]))) return NULL;
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    if (!zero || !one) return NULL;
    return PyModule_Create(&module);
}
