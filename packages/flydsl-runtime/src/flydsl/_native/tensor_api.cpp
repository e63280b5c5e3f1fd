// flydsl's tensor API (tensor_api.h) on torch's C++ API: one call reads every field a fast host path
// needs of a tensor, without a Python method call each; empty_like allocates without torch's argument
// parser. Built at first use by flydsl.native.tensor_api against the installed torch's headers (a
// module per torch version, in Triton's cache), then handed to C modules as a capsule.
#include <Python.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>

extern "C" {
#include <flydsl/tensor_api.h>
}

static int info(PyObject *obj, flydsl_tensor_info *out) {
    if (!THPVariable_Check(obj)) return 0;
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return 0;
        const int64_t nd = t.dim();
        if (nd > FLYDSL_TENSOR_MAX_DIMS) return 0;
        const auto sizes = t.sizes();
        for (int64_t i = 0; i < nd; i++) out->sizes[i] = sizes[i];
        out->ndim = static_cast<int>(nd);
        out->device = t.is_cuda() ? static_cast<int>(t.get_device()) : -1;
        out->contiguous = t.is_contiguous();
        out->requires_grad = t.requires_grad();
        out->data_ptr = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(t.data_ptr()));
        out->dtype = reinterpret_cast<PyObject *>(torch::getTHPDtype(t.scalar_type()));
        return 1;
    } catch (...) {
        return 0;  // whatever torch refuses here, the caller's Python path reads (and reports) properly
    }
}

static PyObject *empty_like(PyObject *obj, unsigned long long *data_ptr) {
    if (!THPVariable_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "flydsl tensor API: empty_like expects a torch.Tensor");
        return nullptr;
    }
    try {
        at::Tensor y = at::empty_like(THPVariable_Unpack(obj));
        *data_ptr = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(y.data_ptr()));
        return THPVariable_Wrap(std::move(y));
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }
}

static int grad_enabled(void) { return at::GradMode::is_enabled(); }

static flydsl_tensor_api api = {info, empty_like, grad_enabled};

// The same functions from Python, for tests: info(t) -> (data_ptr, sizes, device, contiguous,
// requires_grad, dtype) or None; empty_like(t) -> (tensor, data_ptr); grad_enabled() -> bool.
static PyObject *py_info(PyObject *, PyObject *t) {
    flydsl_tensor_info f;
    if (!info(t, &f)) Py_RETURN_NONE;
    PyObject *sizes = PyTuple_New(f.ndim);
    if (!sizes) return nullptr;
    for (int i = 0; i < f.ndim; i++) PyTuple_SET_ITEM(sizes, i, PyLong_FromLongLong(f.sizes[i]));
    return Py_BuildValue("(KNiiiO)", f.data_ptr, sizes, f.device, f.contiguous, f.requires_grad, f.dtype);
}

static PyObject *py_empty_like(PyObject *, PyObject *t) {
    unsigned long long ptr = 0;
    PyObject *y = empty_like(t, &ptr);
    return y ? Py_BuildValue("(NK)", y, ptr) : nullptr;
}

static PyObject *py_grad_enabled(PyObject *, PyObject *) { return PyBool_FromLong(grad_enabled()); }

static PyMethodDef methods[] = {
    {"info", py_info, METH_O, "info(t) -> (data_ptr, sizes, device, contiguous, requires_grad, dtype) or None"},
    {"empty_like", py_empty_like, METH_O, "empty_like(t) -> (new tensor, its data_ptr)"},
    {"grad_enabled", py_grad_enabled, METH_NOARGS, "torch.is_grad_enabled()"},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flydsl_tensor_api", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_flydsl_tensor_api(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return nullptr;
    PyObject *cap = PyCapsule_New(&api, FLYDSL_TENSOR_API_CAPSULE, nullptr);
    if (!cap || PyModule_AddObject(m, "API", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
