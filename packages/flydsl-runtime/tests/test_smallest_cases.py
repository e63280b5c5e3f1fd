"""flydsl.testing.cases: which parametrized cases ``--smallest-cases`` keeps; and the plugin's skip of
``interpreter``-marked tests where kernels compile."""

import dataclasses
from collections import namedtuple
from types import SimpleNamespace

import torch

from flydsl.testing.cases import case_size_and_shape, smallest_cases


def _item(nodeid, **params):
    return SimpleNamespace(nodeid=nodeid, callspec=SimpleNamespace(params=params) if params else None)


@dataclasses.dataclass(frozen=True)
class _Case:
    n: int
    c: int
    mode: str


def test_size_is_the_product_of_the_integers_and_the_shape_blanks_them():
    size, shape = case_size_and_shape({"M": 256, "N": 4096, "dtype": torch.bfloat16, "flag": True})
    assert size == 256 * 4096
    other_size, other_shape = case_size_and_shape({"M": 1, "N": 1000, "dtype": torch.bfloat16, "flag": True})
    assert other_size == 1000 and other_shape == shape
    # booleans are options, not sizes: True and False are different groups
    assert case_size_and_shape({"M": 1, "flag": False})[1] != case_size_and_shape({"M": 1, "flag": True})[1]
    # zero and negative numbers count as 1 and |n|: a size is never 0 or negative
    assert case_size_and_shape({"shape": (0, -3, 5)})[0] == 15


def test_integers_inside_containers_dataclasses_and_named_tuples_are_sizes():
    pair = namedtuple("Pair", "a b")
    assert case_size_and_shape({"case": _Case(2, 3, "x")})[0] == 6
    assert case_size_and_shape({"case": pair(4, "y")})[0] == 4
    assert case_size_and_shape({"d": {"k": [2, (3,)]}})[0] == 6
    assert case_size_and_shape({"case": _Case(2, 3, "x")})[1] == case_size_and_shape({"case": _Case(9, 9, "x")})[1]
    assert case_size_and_shape({"case": _Case(2, 3, "x")})[1] != case_size_and_shape({"case": _Case(2, 3, "z")})[1]


def test_each_group_keeps_its_smallest_case_in_collection_order():
    items = [
        _item("t.py::test_a[big-bf16]", M=4096, dtype=torch.bfloat16),
        _item("t.py::test_a[small-bf16]", M=8, dtype=torch.bfloat16),
        _item("t.py::test_a[big-fp16]", M=4096, dtype=torch.float16),
        _item("t.py::test_plain"),
        _item("t.py::test_b[x-2]", case=_Case(2, 64, "x")),
        _item("t.py::test_b[x-1]", case=_Case(1, 64, "x")),
        _item("t.py::test_b[y-9]", case=_Case(9, 64, "y")),
        _item("t.py::test_a2[tie-1]", M=8, dtype=torch.bfloat16),  # another function: its own group
        _item("t.py::test_a2[tie-2]", M=8, dtype=torch.bfloat16),  # a tie: the first collected stays
    ]
    kept, dropped = smallest_cases(items)
    assert [i.nodeid for i in kept] == [
        "t.py::test_a[small-bf16]",
        "t.py::test_a[big-fp16]",  # alone in its dtype's group
        "t.py::test_plain",
        "t.py::test_b[x-1]",
        "t.py::test_b[y-9]",
        "t.py::test_a2[tie-1]",
    ]
    assert [i.nodeid for i in dropped] == ["t.py::test_a[big-bf16]", "t.py::test_b[x-2]", "t.py::test_a2[tie-2]"]
    assert smallest_cases([]) == ([], [])


def test_the_plugin_option_deselects_after_the_marker_expression(tmp_path):
    """End to end through pytest: ``-m`` first (a gpu-marked group's smallest case is among the gpu-marked
    ones), then the smallest of what is left; without the option every case runs."""
    import subprocess
    import sys

    (tmp_path / "test_sizes.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('n', [1, 64, 4096])\n"
        "def test_n(n):\n"
        "    pass\n"
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.slow), 32, 512])\n"
        "@pytest.mark.parametrize('mode', ['a', 'b'])\n"
        "def test_modes(mode, n):\n"
        "    pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a mark to deselect\n")

    def run(*args):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "flydsl.testing.plugin", "-p", "no:cacheprovider", "-q",
             "--collect-only", *args, str(tmp_path)],
            capture_output=True, text=True, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return sorted(line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line)

    assert len(run()) == 9
    assert run("--smallest-cases", "-m", "not slow") == ["test_modes[a-32]", "test_modes[b-32]", "test_n[1]"]


def test_interpreter_marked_tests_are_skipped_where_kernels_compile(tmp_path):
    """The plugin's ``interpreter`` marker: on a GPU machine (here a stand-in for one) those tests are skipped
    with the reason, the gpu-marked and unmarked ones run; under the interpreter the gpu-marked one is skipped
    and the interpreter-marked one runs."""
    import subprocess
    import sys

    (tmp_path / "test_marks.py").write_text(
        "import pytest\n"
        "@pytest.mark.interpreter\n"
        "def test_host_path():\n"
        "    pass\n"
        "@pytest.mark.gpu\n"
        "def test_on_gpu():\n"
        "    pass\n"
        "def test_plain():\n"
        "    pass\n"
    )

    def run(gpu: bool):
        # the stand-in answers both ways, so the run is the same on a GPU machine and on a CPU one
        (tmp_path / "conftest.py").write_text(f"import flydsl.testing.plugin as p; p.gpu_available = lambda: {gpu}\n")
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "flydsl.testing.plugin", "-p", "no:cacheprovider", "-rs", "-v",
             str(tmp_path)],
            capture_output=True, text=True, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return {line.split("::", 1)[1].split()[0]: line.split()[1] for line in out.stdout.splitlines()
                if line.startswith("test_marks.py::")}  # fmt: skip

    assert run(gpu=True) == {"test_host_path": "SKIPPED", "test_on_gpu": "PASSED", "test_plain": "PASSED"}
    assert run(gpu=False) == {"test_host_path": "PASSED", "test_on_gpu": "SKIPPED", "test_plain": "PASSED"}
