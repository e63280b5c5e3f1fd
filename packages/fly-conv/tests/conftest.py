"""Load FlyDSL's pytest plugin for this suite: the ``gpu`` marker, the ``device``
fixture, ``--require-gpu``, and ``import flydsl`` before any test module imports
Triton. Installing FlyDSL does not load it into other projects' test runs.

The ``poisoned`` fixture: every output the ops allocate starts as NaN (fp) so an
element a kernel leaves unwritten fails the check."""

import importlib

import pytest

pytest_plugins = ["flydsl.testing.plugin"]


@pytest.fixture
def poisoned(monkeypatch):
    """Poison every buffer fly_conv's host code allocates for a kernel to write (outputs, gradients, partials)."""
    from flydsl.testing import poison

    conv_mod = importlib.import_module("fly_conv.conv")  # the module: the package's ``conv`` is the function
    alloc, empty = conv_mod._alloc, conv_mod._empty
    monkeypatch.setattr(conv_mod, "_alloc", lambda *args: poison(alloc(*args)))
    monkeypatch.setattr(conv_mod, "_empty", lambda *args: poison(empty(*args)))
    return True
