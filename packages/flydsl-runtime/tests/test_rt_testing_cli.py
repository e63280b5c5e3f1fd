"""flydsl.testing helpers and the flydsl CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flydsl import cli, testing
from flydsl.families import DemoCase, DemoRun, Family, discover


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8,
                                   torch.int32])
def test_poison_is_never_a_normal_value(dtype):
    t = testing.empty_poisoned(4, 3, dtype=dtype)
    if dtype.is_floating_point:
        assert torch.isnan(t.float()).all()
    else:
        assert (t == torch.iinfo(dtype).min).all()


def test_rel_error_and_nan_never_passes():
    ref = torch.tensor([1.0, 2.0, 2.0])
    assert testing.rel_error(ref, ref) == 0.0
    assert math.isclose(testing.rel_error(ref + torch.tensor([0.0, 0.0, 0.3]), ref), 0.1, rel_tol=1e-6)
    assert math.isnan(testing.rel_error(torch.tensor([1.0, float("nan"), 2.0]), ref))
    with pytest.raises(AssertionError, match="non-finite elements 1"):
        testing.assert_rel_close(torch.tensor([1.0, float("nan"), 2.0]), ref, tol=1.0)
    with pytest.raises(AssertionError, match="relative error"):
        testing.assert_rel_close(ref * 1.01, ref, dtype=torch.float32)
    testing.assert_rel_close(ref.half(), ref, dtype=torch.float16)
    with pytest.raises(AssertionError, match="shape mismatch"):
        testing.rel_error(ref, ref[:2])


def test_rel_error_relative_to_the_terms_of_a_cancelling_result():
    """Given the size of the terms a result sums, the error is relative to the larger of the two: a result
    that cancelled is held to its terms' size, any other to its own."""
    ref = torch.tensor([3e-4, -4e-4])  # ||ref|| = 5e-4, from terms of size ~1
    out = ref + torch.tensor([1e-6, 0.0])
    assert math.isclose(testing.rel_error(out, ref), 2e-3, rel_tol=1e-5)
    assert math.isclose(testing.rel_error(out, ref, terms=1.0), 1e-6, rel_tol=1e-5)
    assert testing.rel_error(out, ref, terms=1e-9) == testing.rel_error(out, ref)  # the larger one counts
    testing.assert_rel_close(out, ref, tol=1e-5, terms=1.0)
    with pytest.raises(AssertionError, match=r"to max\(\|\|ref\|\|, terms\)"):
        testing.assert_rel_close(out, ref, tol=1e-7, terms=1.0)


@pytest.mark.gpu
def test_rel_error_on_the_gpu_matches_the_cpu():
    """rel_error works where out lives (a CPU reference is moved to it), with the CPU's result."""
    ref = torch.randn(1000, dtype=torch.float64)
    out = (ref * (1 + 1e-3 * torch.randn(1000, dtype=torch.float64))).float()
    on_cpu = testing.rel_error(out, ref)
    assert math.isclose(testing.rel_error(out.cuda(), ref), on_cpu, rel_tol=1e-9)
    assert math.isclose(testing.rel_error(out.cuda(), ref.cuda()), on_cpu, rel_tol=1e-9)
    assert math.isnan(testing.rel_error(torch.tensor([1.0, float("nan")]).cuda(), torch.ones(2)))


def test_tolerances():
    assert testing.tolerance(torch.float32) == 1e-5
    assert testing.tolerance(torch.float32, tf32=True) == 3e-4
    assert testing.tolerance(torch.bfloat16) == 1e-2
    with pytest.raises(KeyError):
        testing.tolerance(torch.complex64)


def test_device_fixture_matches_backend(device):
    assert device == testing.default_device()


def test_cli_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("backend", "arch", "sm_count", "torch", "triton", "families", "env", "cache_root"):
        assert key in info
    assert isinstance(info["families"], dict)  # the runtime alone may have none installed


def test_cli_cache_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    (tmp_path / "tuning" / "x").mkdir(parents=True)
    (tmp_path / "tuning" / "x" / "a.json").write_text("{}")
    assert cli.main(["cache", "ls"]) == 0
    assert "tuning" in capsys.readouterr().out
    assert cli.main(["cache", "size", "--kind", "tuning"]) == 0
    assert "2 B" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert not (tmp_path / "tuning").exists()


def test_cli_unknown_family_is_named():
    with pytest.raises(SystemExit, match="unknown family nope"):
        cli.main(["demo", "nope"])


def test_cli_tune_refuses_the_interpreter(capsys):
    if testing.gpu_available():
        pytest.skip("checks the GPU-less refusal")
    assert cli.main(["tune"]) == 2
    assert "no GPU" in capsys.readouterr().err


FAKE = Family(name="fake", distribution="fly-fake", module="fake_mod", version="9.9")
NOT_A_FAMILY = object()


def _entry_points(monkeypatch, *specs):
    from importlib import metadata

    from flydsl import families

    eps = [metadata.EntryPoint(name=n, value=v, group=families.GROUP) for n, v in specs]
    monkeypatch.setattr(families.metadata, "entry_points", lambda group: [e for e in eps if e.group == group])


def test_families_are_discovered_through_entry_points(monkeypatch, caplog):
    _entry_points(
        monkeypatch,
        ("fake", f"{__name__}:FAKE"),
        ("broken", "no_such_module_anywhere:FAMILY"),
        ("wrong", f"{__name__}:NOT_A_FAMILY"),
    )
    fams = discover()
    assert list(fams) == ["fake"] and fams["fake"] is FAKE
    assert "broken" in caplog.text and "wrong" in caplog.text  # logged and skipped, never fatal


def test_cli_demo_runs_family_cases(monkeypatch, capsys):
    import torch

    def prepare(device):
        x = torch.arange(4.0, device=device)
        return DemoRun(ours=lambda: x * 2, reference=lambda: x.double() * 2, torch_op=lambda: x * 2,
                       torch_name="mul", tolerance=1e-6)

    def prepare_wrong(device):
        x = torch.arange(4.0, device=device)
        return DemoRun(ours=lambda: x * 3, reference=lambda: x.double() * 2, torch_op=lambda: x * 2,
                       torch_name="mul", tolerance=1e-6)

    fam = Family(name="fake", distribution="fly-fake", module="fake_mod", version="9.9",
                 demo_cases=lambda: [DemoCase("double", prepare), DemoCase("wrong", prepare_wrong)])
    monkeypatch.setattr(cli, "discover", lambda: {"fake": fam})
    assert cli.main(["demo", "--no-time"]) == 1  # the wrong case fails the command
    out = capsys.readouterr().out
    assert "double" in out and "wrong" in out and "1 passed, 1 failed" in out


def test_cli_tune_passes_jobs_and_the_selected_keys(monkeypatch, tmp_path):
    """``flydsl tune FAMILY --jobs N --match ...`` searches the family's matching keys with N compile workers."""
    import flydsl.autotune

    class Toy:
        name, artifact_dir = "toy_fwd", tmp_path

        def tune_keys(self, arch):
            return [{"n": 1}, {"n": 2}]

    calls = []
    monkeypatch.setattr(cli, "discover", lambda: {"toy": Family("toy", "toy", "toy", "0", tunables=lambda: [Toy()])})
    monkeypatch.setattr(flydsl.autotune, "tune_artifact",
                        lambda t, keys, arch, device, out_path=None, jobs=1: calls.append((keys, jobs)) or tmp_path)
    assert cli.main(["tune", "toy", "--jobs", "3", "--match", '{"n": 2}', "--allow-interpreter"]) == 0
    assert calls == [([{"n": 2}], 3)]


def test_cli_tune_candidates_narrows_each_tunable(monkeypatch, tmp_path, capsys):
    """``--candidates JSON`` hands tune_artifact the tunable narrowed to those candidates (against the artifact
    being written); JSON that is not an object of config fields is refused naming the option."""
    import dataclasses as dc

    import flydsl.autotune
    from flydsl.autotune import Tunable

    @dc.dataclass(frozen=True)
    class Cfg:
        block: int
        warps: int = 4

    toy = Tunable("toy_fwd", Cfg, default=lambda key, arch: Cfg(128),
                  candidates=lambda key, arch: [Cfg(64), Cfg(64, 8), Cfg(256, 8)], is_valid=lambda c, k, a: True,
                  artifact_dir=tmp_path,
                  tune_keys=lambda arch: [{"n": 1}])  # fmt: skip
    seen = []
    monkeypatch.setattr(cli, "discover", lambda: {"toy": Family("toy", "toy", "toy", "0", tunables=lambda: [toy])})
    monkeypatch.setattr(flydsl.autotune, "tune_artifact",
                        lambda t, keys, arch, device, out_path=None, jobs=1: seen.append(t) or tmp_path)
    from flydsl.autotune import write_artifact

    write_artifact(tmp_path / "toy_fwd.json", "toy_fwd",
                   [{"arch": "cpu", "key": {"n": 1}, "config": {"block": 256, "warps": 4}, "time_us": 1.0}])
    assert cli.main(["tune", "toy", "--candidates", '{"warps": 8}', "--allow-interpreter"]) == 0
    assert seen[0] is not toy and seen[0].candidates({"n": 1}, "cpu") == [Cfg(256), Cfg(64, 8), Cfg(256, 8)]
    assert seen[0].candidates({"n": 2}, "cpu") == [Cfg(64), Cfg(64, 8), Cfg(256, 8)]  # no entry: all
    assert cli.main(["tune", "toy", "--candidates", '{"warps": 8}', "--out", str(tmp_path / "new"),
                     "--allow-interpreter"]) == 0  # fmt: skip
    assert seen[1].candidates({"n": 1}, "cpu") == [Cfg(64), Cfg(64, 8), Cfg(256, 8)]  # new file: no entry
    assert cli.main(["tune", "toy", "--candidates", "warps=8", "--allow-interpreter"]) == 2
    assert "--candidates: expected a JSON object" in capsys.readouterr().err
    assert cli.main(["tune", "toy", "--candidates", '{"tiles": 2}', "--allow-interpreter"]) == 2
    assert "tiles not a field of Cfg" in capsys.readouterr().err
    assert len(seen) == 2
