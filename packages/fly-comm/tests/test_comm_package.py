"""Packaging contract of fly-comm (flydsl.testing.package), the benchmark script's plumbing on CPU processes,
and the kernels compiled for sm_90 (PTX checked for the memory-ordering instructions the protocol needs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fly_comm
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_comm, distribution="fly-comm", name="comm")


def test_bench_helpers():
    from fly_comm.bench import bus_bandwidth, default_sizes, parse_size

    assert [parse_size(s) for s in ("4K", "1M", "64MiB", "1000", "2g")] == [4096, 1 << 20, 64 << 20, 1000, 2 << 30]
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")
    assert default_sizes()[0] == 4096 and default_sizes()[-1] == 64 << 20
    assert bus_bandwidth(10**9, 2, 1.0) == pytest.approx(1.0)  # 2 (w - 1) / w = 1 at w = 2


def test_bench_runs_end_to_end_on_gloo(tmp_path, capsys):
    """The multi-process plumbing (spawn a group, time, check against the fp32 sum, gather, report) on CPU
    processes; on CPU every call is torch.distributed's, so only ``custom`` and ``nccl`` rows exist."""
    from fly_comm.bench import main

    assert main(["--backend", "gloo", "--sizes", "4K,1000", "--iters", "2", "--repeats", "2", "--dtype", "fp16",
                 "--out", str(tmp_path), "--stem", "smoke"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["world"] == 2 and [r["bytes"] for r in result["rows"]] == [4096, 1000]
    for row in result["rows"]:
        assert set(row["us"]) == {"custom", "nccl"} and all(v > 0 for v in row["us"].values())
        assert row["chosen"] == "nccl" and all(e <= 2 * 2 * 2.0**-11 for e in row["rel_err"].values())
    assert "| 4096 | nccl |" in (tmp_path / "smoke.md").read_text()
    assert "all-reduce, 2 ranks" in capsys.readouterr().out


def test_bench_without_gpus_says_so(capsys):
    import torch

    from fly_comm.bench import main

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this host has several GPUs: the NCCL benchmark would run")
    assert main([]) == 0
    assert "needs >= 2 GPUs" in capsys.readouterr().out


def test_kernels_compile_for_sm90():
    """Each variant compiles for sm_90 (a process of its own: the interpreter accepts code the compiler does not),
    without spills, and its PTX has the release signal, the acquire wait at system scope, the CTA barrier and
    16-byte vector accesses (peer loads through L2)."""
    from comm_compile_sm90 import VARIANTS

    from flydsl.testing.sm90 import run_compile_script

    lines = run_compile_script(Path(__file__).with_name("comm_compile_sm90.py"))
    assert len(lines) == len(VARIANTS) + 1, "\n".join(lines)
    needed = {"atom.global.sys.release.exch.b64", "bar.sync", "ld.global.cg.v4.b32", "st.global.v4.b32"}
    for line in lines[:-1]:
        assert line.startswith("ok "), line
        assert "STACK:0" in line, f"spills: {line}"
        found = set(line.split()[-1].split(","))
        assert needed <= found, f"missing {needed - found}: {line}"
        # the wait: an acquire at system scope (Triton turns atomic_add(ptr, 0) into an acquire load)
        assert found & {"ld.global.sys.acquire.b64", "atom.global.sys.acquire.add.u64"}, line
    assert lines[-1].startswith("ok spin_limit") and "STACK:0" in lines[-1]
