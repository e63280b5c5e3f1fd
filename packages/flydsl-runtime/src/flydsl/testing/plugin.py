"""FlyDSL's pytest plugin: the ``gpu`` marker, the ``device`` fixture, the
``--require-gpu`` option and ``--smallest-cases`` (each test's smallest cases only).

Opt-in: installing FlyDSL registers nothing with pytest, so other projects'
test runs are unchanged. A test suite loads it from its top-level
``conftest.py``::

    pytest_plugins = ["flydsl.testing.plugin"]

or per run with ``pytest -p flydsl.testing.plugin``. Loaded that way it comes
before any test module, so ``import flydsl`` picks compiled or interpreted
kernels (setting ``TRITON_INTERPRET`` on a machine without a GPU) before
anything imports Triton; on such a machine ``gpu``-marked tests are skipped.
"""

from __future__ import annotations

import pytest

import flydsl  # noqa: F401 - fixes the backend before test modules import triton

from .. import env
from . import default_device, gpu_available
from .cases import smallest_cases


def pytest_addoption(parser):
    group = parser.getgroup("flydsl")
    group.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail the session when no GPU is visible, instead of skipping gpu-marked tests (GPU CI shards)",
    )
    group.addoption(
        "--smallest-cases",
        action="store_true",
        default=False,
        help="of each test's parametrized cases that differ only in numbers, run the smallest (deselect the rest): "
        "for runs whose cost follows the kernels' work, such as compute-sanitizer's racecheck (flydsl.testing.cases)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA/HIP GPU; skipped where kernels run in the interpreter")
    config.addinivalue_line(
        "markers",
        "overlap: needs GPU work to run at once with other GPU work (two streams) or with the host's next steps "
        "(timings of queued launches); compute-sanitizer serializes every launch, so the sanitize sessions deselect "
        "it",
    )
    config.addinivalue_line(
        "markers",
        "host_refs: counts the host references a call keeps (under compute-sanitizer each call's Python frames "
        "stay alive, held from outside Python's reach, so the sanitize sessions deselect it)",
    )
    config.addinivalue_line(
        "markers",
        "graph: captures a CUDA graph (capture needs torch's caching allocator: skipped when "
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1, the sanitize sessions' exact-bounds pass, which runs them in a second "
        "pass with the allocator on)",
    )
    config.addinivalue_line(
        "markers",
        "interpreter: runs kernels on CPU tensors (host-path tests of launchers, benches and torch.compile on the "
        "CPU): needs Triton's interpreter, so it is skipped where kernels compile for a GPU",
    )
    config.addinivalue_line(
        "markers",
        "tma_store: reads a tensor that only TMA (tensor-descriptor) stores wrote; compute-sanitizer's initcheck "
        "does not count those stores as writes and reports every later read, so its sanitize runs deselect it",
    )
    if config.getoption("--require-gpu") and not gpu_available():
        raise pytest.UsageError(
            "--require-gpu: no GPU is visible to this process (or FLYDSL_INTERPRET=1 forces the interpreter)"
        )


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: the smallest of the cases that will run
def pytest_collection_modifyitems(config, items):
    if config.getoption("--smallest-cases"):
        kept, dropped = smallest_cases(items)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    if env.read_external("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        # Without the caching allocator a capture's allocations are cudaMalloc calls, which a capture refuses; the
        # failed capture leaves the process's CUDA state (its RNG, a pending error) unfit for the tests after it.
        no_graph = pytest.mark.skip(reason="captures a CUDA graph: needs torch's caching allocator")
        for item in items:
            if "graph" in item.keywords:
                item.add_marker(no_graph)
    if gpu_available():
        # a launcher compiled for the GPU refuses CPU tensors; these tests' GPU counterparts are gpu-marked
        cpu_only = pytest.mark.skip(reason="runs kernels on CPU tensors: needs the interpreter (FLYDSL_INTERPRET=1)")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(cpu_only)
        return
    skip = pytest.mark.skip(reason="needs a GPU (kernels run through the interpreter here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device tests run kernels on: the GPU when present, else the CPU (interpreter)."""
    return default_device()
