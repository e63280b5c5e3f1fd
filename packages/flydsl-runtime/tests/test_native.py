"""flydsl.native.load: C source to an imported extension module, or None with a warning."""

from __future__ import annotations

import pytest

from flydsl import native

SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flydsl_native_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_flydsl_native_probe(void) { return PyModule_Create(&module); }
"""


def test_load_builds_imports_and_caches():
    mod = native.load("flydsl_native_probe", SOURCE)
    if mod is None:
        pytest.skip("no C compiler or Python headers here")
    assert mod.answer() == 42
    assert native.load("flydsl_native_probe", SOURCE) is mod  # built once a process


def test_a_module_that_cannot_be_built_is_none_with_a_warning():
    with pytest.warns(RuntimeWarning, match="flydsl_native_broken could not be built"):
        assert native.load("flydsl_native_broken", "this is not C") is None
    assert native.load("flydsl_native_broken", "this is not C") is None  # remembered: one warning


@pytest.fixture(scope="module")
def api_module():
    """flydsl.native.tensor_api's module, built here (against this torch's headers) or taken from the cache."""
    if native.tensor_api(wait=True) is None:
        pytest.skip(f"the C++ tensor API cannot be built here: {native._api['error']!r:.200}")
    return native._api_module()  # from the cache now


def test_tensor_api_reads_every_field(api_module):
    """info(t) against torch's own answers: contiguous and strided views, 0-d, requires_grad, every dtype; None
    for what it does not read (not a tensor, more than 8 dims, a sparse layout)."""
    import torch

    cases = (torch.randn(3, 5), torch.randn(4, 6)[:, 1:5], torch.tensor(2.5), torch.zeros(0, 7, dtype=torch.int8),
             torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True), torch.randn(2, 3, 4).transpose(0, 2))
    for t in cases:
        ptr, sizes, device, contiguous, requires_grad, dtype = api_module.info(t)
        assert (ptr, sizes, contiguous, requires_grad) == (t.data_ptr(), tuple(t.shape), t.is_contiguous(),
                                                           t.requires_grad)  # fmt: skip
        assert device == -1 and dtype is t.dtype
    assert api_module.info(torch.zeros([1] * 9)) is None
    assert api_module.info(torch.eye(3).to_sparse()) is None
    assert api_module.info([1, 2]) is None and api_module.info(None) is None


def test_tensor_api_allocates_like_and_reads_grad_mode(api_module):
    import torch

    x = torch.randn(5, 3, dtype=torch.float16)
    y, ptr = api_module.empty_like(x)
    assert type(y) is torch.Tensor and y.shape == x.shape and y.dtype == x.dtype and ptr == y.data_ptr()
    assert y.data_ptr() != x.data_ptr()
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        api_module.empty_like("x")
    assert api_module.grad_enabled() is True
    with torch.no_grad():
        assert api_module.grad_enabled() is False
    with torch.inference_mode():
        assert api_module.grad_enabled() is False


def test_tensor_api_off_calls_back_with_none(monkeypatch):
    """FLYDSL_NATIVE_TORCH=0: nothing is built; a waiter hears None at once."""
    monkeypatch.setattr(native, "_api", {"state": "idle", "capsule": None, "waiters": [], "error": None})
    monkeypatch.setenv("FLYDSL_NATIVE_TORCH", "0")
    heard = []
    assert native.tensor_api(heard.append) is None
    assert heard == [None] and native._api["state"] == "failed"


def test_tensor_api_waiters_hear_the_capsule(api_module, monkeypatch):
    """A fresh state, the module in the cache: the first call returns at once (the build, cache check included,
    runs on a background thread) and its waiter hears the capsule once it is ready; a later caller hears it at
    once."""
    monkeypatch.setattr(native, "_api", {"state": "idle", "capsule": None, "waiters": [], "error": None})
    heard = []
    native.tensor_api(heard.append)
    cap = native.tensor_api(wait=True)
    assert cap is not None and heard == [cap]
    native.tensor_api(heard.append)
    assert heard == [cap, cap]
