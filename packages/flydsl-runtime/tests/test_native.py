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
