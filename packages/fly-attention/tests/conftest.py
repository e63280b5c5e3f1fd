"""Load FlyDSL's pytest plugin for this suite: the ``gpu`` marker, the ``device``
fixture, ``--require-gpu``, and ``import flydsl`` before any test module imports
Triton. Installing FlyDSL does not load it into other projects' test runs.

Every output the attention API allocates is poisoned here (NaN), so an element
the kernel should write and did not fails the comparison."""

import pytest

pytest_plugins = ["flydsl.testing.plugin"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from fly_attention import attention
    from flydsl.testing import empty_poisoned

    monkeypatch.setattr(attention, "_empty", lambda *shape, dtype, device: empty_poisoned(*shape, dtype=dtype,
                                                                                          device=device))  # fmt: skip
