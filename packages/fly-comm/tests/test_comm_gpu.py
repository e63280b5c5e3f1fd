"""CustomAllReduce on 2, 4 and 8 GPUs of one host (gpu-marked; each test skips, saying so, where the host has
fewer GPUs than it needs). Each test spawns one process a GPU with an NCCL group (torchrun's layout: rank r
on cuda:r, every GPU visible to every rank) and fails, instead of hanging, if the group has not finished
within its timeout. Results must be the kernels' exact bits (the fp32 sum in rank order, rounded once) and
equal NCCL's within the dtype's rounding, for 1 element to 64 MiB."""

from __future__ import annotations

import comm_gpu_workers as w
import pytest
import torch
from comm_helpers import run_group

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(world: int) -> None:
    if _gpus() < world:
        pytest.skip(f"needs >= {world} GPUs, this host has {_gpus()}")


def _run(fn, world, *args, timeout=600.0):
    needs(world)
    failures = [f"rank {r}: {m}" for r, msgs in enumerate(run_group(fn, world, *args, backend="nccl",
                                                                     timeout=timeout)) for m in msgs]  # fmt: skip
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_matches_nccl_from_one_element_to_64_mib(world):
    _run(w.sizes_against_nccl, world, [torch.bfloat16, torch.float16, torch.float32], timeout=1200.0)


def test_ipc_transport():
    _run(w.sizes_against_nccl, 2, [torch.bfloat16], "ipc", timeout=900.0)


@pytest.mark.parametrize("world", [2, 8])
def test_cuda_graph_capture_and_replay(world):
    _run(w.graph_capture_and_replay, world)


@pytest.mark.parametrize("world", [2, 4])
def test_many_calls_in_a_loop_without_a_hang(world):
    _run(w.many_calls, world, 5000, timeout=300.0)


@pytest.mark.parametrize("world", [2, 4])
def test_a_late_rank_does_not_deadlock(world):
    _run(w.late_rank, world, timeout=300.0)


def test_a_cpu_tensor_is_refused_on_every_rank():
    _run(w.wrong_device, 2, timeout=120.0)
