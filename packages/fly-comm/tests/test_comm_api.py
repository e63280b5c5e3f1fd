"""CustomAllReduce on the CPU: argument checks (a one-rank gloo group in this process) and the API end to end
over two gloo processes (sums, max / min, in place, repeated calls, the errors every rank raises)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from comm_helpers import inputs, run_group

from fly_comm import CustomAllReduce
from flydsl.errors import (
    ArgumentError,
    BackendError,
    DeviceError,
    DTypeError,
    FlyDSLError,
    LayoutError,
    ShapeError,
    UnsupportedError,
)  # fmt: skip


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (an in-memory store: nothing listens on a port)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_an_initialized_group():
    assert not dist.is_initialized()
    with pytest.raises(BackendError, match="init_process_group"):
        CustomAllReduce()


def test_cpu_object_goes_to_torch_distributed(one_rank):
    ar = CustomAllReduce(max_size=4096)
    assert ar.device == torch.device("cpu") and ar.world_size == 1 and ar.rank == 0
    assert not ar.kernels_enabled and ar.transport == "torch.distributed"
    assert ar.algorithm(1024) == "nccl"
    x = torch.randn(100, dtype=torch.bfloat16)
    y = ar.all_reduce(x)
    assert y is not x and torch.equal(y, x)  # one rank: the sum is the input
    assert ar.all_reduce(torch.empty(0)).numel() == 0
    assert "world_size=1" in repr(ar)
    ar.close()
    ar.close()  # idempotent
    assert "closed" in repr(ar)
    with pytest.raises(BackendError, match="after close"):
        ar.all_reduce(x)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: torch.zeros(4, dtype=torch.int32), DTypeError, "dtype"),
        (lambda: torch.zeros(4, dtype=torch.float64), DTypeError, "dtype"),
        (lambda: torch.zeros(8, 8)[:, ::2], LayoutError, "contiguous"),
        (lambda: torch.zeros(4, device="meta"), DeviceError, "meta"),
        (lambda: torch.zeros(1025), ShapeError, "max_size=4096"),
        (lambda: [1.0, 2.0], ArgumentError, "torch.Tensor"),
    ],
)
def test_bad_tensors_are_refused_by_name(one_rank, make, error, words):
    ar = CustomAllReduce(max_size=4096)
    with pytest.raises(error, match=words):
        ar.all_reduce(make())


def test_bad_op_out_and_algorithm(one_rank):
    ar = CustomAllReduce(max_size=4096)
    x = torch.zeros(16)
    with pytest.raises(ArgumentError, match="op"):
        ar.all_reduce(x, op="prod")
    with pytest.raises(ShapeError, match="out"):
        ar.all_reduce(x, out=torch.zeros(15))
    with pytest.raises(DTypeError, match="out"):
        ar.all_reduce(x, out=torch.zeros(16, dtype=torch.float16))
    with pytest.raises(LayoutError, match="out"):
        ar.all_reduce(x, out=torch.zeros(32)[::2])
    with pytest.raises(DeviceError, match="out"):
        ar.all_reduce(x, out=torch.zeros(16, device="meta"))
    with pytest.raises(ArgumentError, match="out"):
        ar.all_reduce(x, out="y")
    with pytest.raises(ArgumentError, match="algorithm"):
        ar.all_reduce(x, algorithm="ring")
    with pytest.raises(UnsupportedError, match="no kernels"):
        ar.all_reduce(x, algorithm="one_shot")
    assert ar.all_reduce(x, algorithm="nccl") is not x


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(max_size=0), ArgumentError, "max_size"),
        (dict(max_size=1.5), ArgumentError, "max_size"),
        (dict(transport="nvshmem"), ArgumentError, "transport"),
        (dict(programs=0), ArgumentError, "programs"),
        (dict(programs=65), ArgumentError, "programs"),
        (dict(spin_limit=-1), ArgumentError, "spin_limit"),
        (dict(cutoffs=(-1, 10)), ArgumentError, "one_shot_max"),
        (dict(cutoffs=(1.5, 10)), ArgumentError, "one_shot_max"),
        (dict(cutoffs=5), ArgumentError, "cutoffs"),
        (dict(device="cuda:0"), DeviceError, "device"),
        (dict(device="meta"), DeviceError, "device"),
        (dict(device="nonsense"), DeviceError, "device"),
    ],
)
def test_bad_constructor_arguments(one_rank, kwargs, error, words):
    if kwargs.get("device") == "cuda:0" and torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    with pytest.raises(error, match=words):
        CustomAllReduce(**kwargs)


def test_errors_are_flydsl_errors_and_builtins():
    assert issubclass(ShapeError, FlyDSLError) and issubclass(ShapeError, ValueError)
    assert issubclass(DTypeError, TypeError) and issubclass(UnsupportedError, NotImplementedError)


# ------------------------------------------------------------ two gloo processes

SIZES = [1, 7, 1000, 4099]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _end_to_end(rank: int, world: int) -> dict:
    """Every scenario of the two-rank test in one process group (a group costs a fork and a rendezvous)."""
    out: dict = {}
    with CustomAllReduce(max_size=64 << 10) as ar:
        out["setup"] = (ar.world_size, ar.rank, str(ar.device), ar.kernels_enabled, ar.algorithm(4096))
        for dtype in DTYPES:
            for n in SIZES:
                out[("sum", dtype, n)] = ar.all_reduce(inputs(rank, n, dtype))
        for op in ("max", "min"):
            out[(op, 257)] = ar.all_reduce(inputs(rank, 257, torch.float32), op=op)
        x = inputs(rank, 300, torch.float16)
        y = ar.all_reduce(x, out=x)
        out["in_place"] = (y is x, x.clone())
        given = torch.empty(300, dtype=torch.float16)
        out["out_given"] = ar.all_reduce(inputs(rank, 300, torch.float16), out=given) is given
        acc = torch.zeros(64)
        for i in range(20):
            acc += ar.all_reduce(torch.full((64,), float(rank + i)))
        out["repeated"] = acc
        try:
            ar.all_reduce(torch.zeros((64 << 10) // 4 + 1))  # raised on every rank, before any collective
        except ShapeError as e:
            out["too_large"] = str(e)
        out["after_error"] = ar.all_reduce(torch.ones(3))  # the group is still usable
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_group(_end_to_end, 2)


def test_gloo_setup(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert res["setup"] == (2, rank, "cpu", False, "nccl")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_gloo_sum_matches_the_fp32_sum(two_ranks, dtype, n):
    xs = [inputs(r, n, dtype).float() for r in range(2)]
    ref = xs[0] + xs[1]  # exact in fp32 for two 16-bit inputs; one fp32 rounding for fp32
    scale = xs[0].abs() + xs[1].abs()
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
    for res in two_ranks:
        got = res[("sum", dtype, n)]
        assert got.dtype == dtype and got.shape == (n,)
        # gloo adds in the dtype: one rounding, at most one unit roundoff of the result's magnitude
        assert ((got.float() - ref).abs() <= unit * scale + torch.finfo(dtype).tiny).all()
    assert torch.equal(two_ranks[0][("sum", dtype, n)], two_ranks[1][("sum", dtype, n)])


def test_gloo_max_min_in_place_and_repeated(two_ranks):
    xs = [inputs(r, 257, torch.float32) for r in range(2)]
    for res in two_ranks:
        assert torch.equal(res[("max", 257)], torch.maximum(*xs))
        assert torch.equal(res[("min", 257)], torch.minimum(*xs))
        same, value = res["in_place"]
        assert same and torch.equal(value, (inputs(0, 300, torch.float16) + inputs(1, 300, torch.float16)))
        assert res["out_given"]
        # call i sums rank + i over both ranks: (0 + i) + (1 + i) = 2i + 1
        assert torch.equal(res["repeated"], torch.full((64,), float(sum(2 * i + 1 for i in range(20)))))
        assert "max_size=65536" in res["too_large"]
        assert torch.equal(res["after_error"], torch.full((3,), 2.0))


def _spans_hosts(rank: int, world: int) -> str:
    import fly_comm.allreduce as mod

    if rank == 1:
        mod._hostname = lambda: "another-host"  # this forked rank only
    try:
        CustomAllReduce()
    except UnsupportedError as e:
        return str(e)
    return "no error"


def test_a_group_spanning_hosts_is_refused_on_every_rank():
    for msg in run_group(_spans_hosts, 2):
        assert "spans 2 hosts" in msg and "another-host" in msg


def _mismatched_settings(rank: int, world: int) -> str:
    try:
        CustomAllReduce(max_size=4096 * (rank + 1))
    except ArgumentError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_settings_are_refused_on_every_rank():
    """Different max_size (or grid, cutoffs, transport) would make ranks wait on flags nobody sets: refused."""
    for msg in run_group(_mismatched_settings, 2):
        assert "different" in msg and "4096" in msg and "8192" in msg
