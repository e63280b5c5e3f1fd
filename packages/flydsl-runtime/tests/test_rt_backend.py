"""The interpreter/compiled choice: made once, before triton is imported, with a clear error otherwise."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less machine's behaviour")

DROP = ("FLYDSL_INTERPRET", "TRITON_INTERPRET")


def test_no_gpu_chooses_interpreter_without_any_variable(fresh_python):
    r = fresh_python(
        """
        import os, flydsl
        print(flydsl.INTERPRET, os.environ["TRITON_INTERPRET"])
        """,
        env_drop=DROP,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1"]


def test_kernel_runs_on_cpu_tensors_without_any_variable(fresh_python):
    r = fresh_python(
        """
        import torch, flydsl.compiler as flyc, flydsl.expr as fx
        @flyc.kernel
        def k(x, y, n, B: fx.constexpr):
            o = fx.arange(0, B)
            fx.store(y + o, fx.load(x + o, mask=o < n) + 1.0, mask=o < n)
        x = torch.arange(5.0); y = torch.zeros(5)
        k[(1,)](x, y, 5, B=8)
        print(y.tolist())
        """,
        env_drop=DROP,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[1.0, 2.0, 3.0, 4.0, 5.0]"


def test_forcing_compiled_mode_refuses_cpu_tensors_clearly(fresh_python):
    r = fresh_python(
        """
        import torch, flydsl, flydsl.compiler as flyc
        from flydsl.errors import DeviceError
        assert flydsl.INTERPRET is False
        @flyc.jit
        def launch(x):
            raise AssertionError("must not be reached")
        try:
            launch(torch.ones(3))
        except DeviceError as e:
            print("DeviceError:", e)
        """,
        env_extra={"FLYDSL_INTERPRET": "0"},
        env_drop=("TRITON_INTERPRET",),
    )
    assert r.returncode == 0, r.stderr
    assert "FLYDSL_INTERPRET=1" in r.stdout


def test_triton_imported_first_gives_an_actionable_error(fresh_python):
    r = fresh_python("import triton, flydsl", env_drop=DROP)
    assert r.returncode != 0
    assert "BackendError" in r.stderr and "Import flydsl before triton" in r.stderr


def test_triton_imported_first_but_already_interpreting_is_accepted(fresh_python):
    r = fresh_python("import triton, flydsl; print(flydsl.INTERPRET)", env_extra={"TRITON_INTERPRET": "1"},
                   env_drop=("FLYDSL_INTERPRET",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_bad_flydsl_interpret_value_names_the_variable(fresh_python):
    r = fresh_python("import flydsl", env_extra={"FLYDSL_INTERPRET": "maybe"})
    assert r.returncode != 0 and "FLYDSL_INTERPRET" in r.stderr
