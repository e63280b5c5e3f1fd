"""flydsl.env (the only reader of FLYDSL_* variables), flydsl.cache, flydsl.arch, flydsl.checks."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import flydsl
from flydsl import arch, cache, checks, env
from flydsl.errors import DeviceError, DTypeError, LayoutError, ShapeError

SRC = pathlib.Path(flydsl.__file__).parent


def test_every_variable_is_documented_and_typed():
    for name, var in env.VARS.items():
        assert name.startswith("FLYDSL_") and var.help and var.type_name in {"bool", "int", "path", "level", "str"}
    assert {"FLYDSL_INTERPRET", "FLYDSL_CACHE_DIR", "FLYDSL_AUTOTUNE"} <= set(env.VARS)


def test_typed_values_and_errors(monkeypatch):
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "yes")
    assert env.get("FLYDSL_AUTOTUNE") is True
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "0")
    assert env.get("FLYDSL_AUTOTUNE") is False
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "perhaps")
    with pytest.raises(ValueError, match="FLYDSL_AUTOTUNE"):
        env.get("FLYDSL_AUTOTUNE")
    monkeypatch.delenv("FLYDSL_AUTOTUNE")
    assert env.get("FLYDSL_AUTOTUNE") is False
    with pytest.raises(KeyError, match="not a FlyDSL environment variable"):
        env.get("FLYDSL_NOPE")
    assert any(row[0] == "FLYDSL_CACHE_DIR" for row in env.describe())


def test_nothing_else_reads_the_environment():
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "env.py":
            continue
        if re.search(r"os\.environ|os\.getenv|getenv\(", path.read_text()):
            offenders.append(str(path.relative_to(SRC)))
    assert offenders == []


def test_cache_root_listing_size_and_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    assert cache.root() == tmp_path and cache.triton_dir() == tmp_path / "triton"
    (tmp_path / "triton" / "abc").mkdir(parents=True)
    (tmp_path / "triton" / "abc" / "k.cubin").write_bytes(b"x" * 100)
    (tmp_path / "tuning" / "softmax_fwd").mkdir(parents=True)
    (tmp_path / "tuning" / "softmax_fwd" / "e.json").write_text("{}")
    kinds = sorted((e.kind, e.path.name, e.bytes) for e in cache.entries())
    assert kinds == [("triton", "abc", 100), ("tuning", "softmax_fwd", 2)]
    assert cache.size() == 102 and cache.size("tuning") == 2
    assert cache.clear("tuning") == 2
    assert cache.size() == 100 and not (tmp_path / "tuning").exists()
    assert cache.clear() == 100 and cache.entries() == []
    with pytest.raises(ValueError, match="cache kind"):
        cache.size("bogus")


def test_triton_dir_set_by_flydsl_follows_the_root(tmp_path, monkeypatch):
    # flydsl exported TRITON_CACHE_DIR at import; changing the root must not
    # leave cache commands pointing at the real Triton cache.
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    assert cache.triton_dir() == tmp_path / "triton"


def test_user_triton_cache_dir_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.triton_dir() == tmp_path / "mine"


def test_arch_of_cpu_is_the_interpreter():
    a = arch.current("cpu")
    assert a is arch.INTERPRETER and a.is_interpreter and a.name == "cpu"
    assert arch.SM90.is_hopper and arch.SM90.name == "sm_90"


def test_tma_is_sm90_and_later_or_the_interpreter():
    assert arch.INTERPRETER.has_tma and arch.SM90.has_tma
    assert dataclasses.replace(arch.SM90, capability=(10, 0)).has_tma
    assert not dataclasses.replace(arch.SM90, capability=(8, 9)).has_tma
    assert not dataclasses.replace(arch.SM90, backend="hip", capability=None).has_tma


@pytest.mark.gpu
def test_arch_of_gpu():
    a = arch.current()
    assert a.backend in ("cuda", "hip") and a.sm_count > 0 and a.l2_bytes > 0 and a.smem_per_block >= 48 * 1024
    if a.backend == "cuda":
        assert a.name == f"sm_{a.capability[0]}{a.capability[1]}"


def test_checks_name_the_argument():
    x = torch.zeros(2, 3, dtype=torch.float16)
    with pytest.raises(DTypeError, match=r"^weight: expected dtype fp32 or bf16, got fp16 tensor of shape \(2, 3\)"):
        checks.check_tensor("weight", x, dtypes=(torch.float32, torch.bfloat16))
    with pytest.raises(ShapeError, match="bias: expected a 1-D tensor"):
        checks.check_tensor("bias", x, ndim=1)
    with pytest.raises(DTypeError, match="residual: expected dtype fp16 \\(the dtype of x\\)"):
        checks.check_same_dtype(x=x, residual=x.float())
    with pytest.raises(DeviceError, match="w: expected a tensor on cpu"):
        checks.check_same_device(x=x, w=torch.zeros(1, device="meta"))
    with pytest.raises(LayoutError, match="x: the last dimension must be contiguous"):
        checks.check_last_dim_contiguous("x", x.t())
    with pytest.raises(ShapeError, match=r"b: expected shape \(2, 3\) \(the shape of a\)"):
        checks.check_shape("b", torch.zeros(3), (2, 3), "the shape of a")
    with pytest.raises(DTypeError, match="in_dtype: unknown dtype"):
        checks.parse_dtype("in_dtype", "fp7")
    assert checks.parse_dtype("in_dtype", "bf16") is torch.bfloat16
    assert checks.check_alignment("x", torch.zeros(4, 8), 16)
    assert not checks.check_alignment("x", torch.zeros(4, 9)[:, :8], 16)


def test_from_name_maps_tuning_key_arch_names():
    """'cpu' is the interpreter; 'sm_90' on a machine without one is the named Hopper description; this
    process's own arch name is its own Arch."""
    from flydsl import arch

    assert arch.from_name("cpu") is arch.INTERPRETER
    here = arch.current()
    assert arch.from_name(here.name) is here
    assert arch.from_name("sm_90") is (here if here.name == "sm_90" else arch.SM90)
