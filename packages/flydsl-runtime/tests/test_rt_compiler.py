"""@flyc.kernel and @flyc.jit: interpreter execution, empty inputs, devices, streams, cache keys."""

from __future__ import annotations

import pytest
import torch
import triton

import flydsl.arch
import flydsl.compiler as flyc
import flydsl.expr as fx
import flydsl.gexpr as gx
from flydsl.errors import ArgumentError, DeviceError
from flydsl.testing import empty_poisoned


@flyc.kernel(do_not_specialize=["n"])
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: fx.constexpr):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    x = fx.load(x_ptr + offs, mask=mask)
    y = fx.load(y_ptr + offs, mask=mask)
    fx.store(out_ptr + offs, alpha * x + y, mask=mask)


calls = []


@flyc.jit
def axpy(x, y, out, alpha, stream=None):
    calls.append(stream)
    n = x.numel()
    _axpy_kernel[(flyc.cdiv(n, 64),)](x, y, out, n, alpha, BLOCK=64)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000])
def test_kernel_matches_reference(device, n):
    x = torch.randn(n, device=device)
    y = torch.randn(n, device=device)
    out = empty_poisoned(n, dtype=torch.float32, device=device)
    axpy(x, y, out, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)


def test_empty_input_returns_early_without_launch(device):
    calls.clear()
    x = torch.empty(0, device=device)
    assert axpy(x, x, x, 1.0) is None
    assert calls == []


def test_skip_empty_false_still_calls(device):
    seen = []

    @flyc.jit(skip_empty=False)
    def launch(x):
        seen.append(x.numel())

    launch(torch.empty(0, device=device))
    assert seen == [0]


def test_stream_none_is_passed_through(device):
    calls.clear()
    x = torch.ones(4, device=device)
    axpy(x, x, x.clone(), 1.0)
    assert calls == [None]


def test_mixed_devices_are_refused_before_launch(device):
    calls.clear()
    with pytest.raises(DeviceError, match=r"different devices \(argument 0 on .*, argument 1 on meta\)"):
        axpy(torch.ones(2, device=device), torch.ones(2, device="meta"), torch.ones(2, device=device), 1.0)
    with pytest.raises(DeviceError, match="different devices"):
        axpy(torch.ones(2, device="meta"), torch.ones(2, device=device), torch.ones(2, device=device), 1.0)
    assert calls == []


def test_launcher_keeps_name_and_raw_function():
    assert axpy.__name__ == "axpy"
    assert callable(axpy.__wrapped__)
    assert axpy.__flydsl_launcher__


def test_bad_stream_argument_is_named():
    from flydsl.compiler import _as_stream

    with pytest.raises(ArgumentError, match="stream"):
        _as_stream("fast", torch.device("cuda", 0))


@pytest.mark.parametrize("a,b,q", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (1023, 16, 64)])
def test_cdiv(a, b, q):
    assert flyc.cdiv(a, b) == q


@pytest.mark.parametrize("n,p", [(0, 1), (1, 1), (2, 2), (3, 4), (1024, 1024), (1025, 2048)])
def test_next_power_of_2(n, p):
    assert flyc.next_power_of_2(n) == p


def test_cache_key_follows_helper_source(tmp_path, fresh_python):
    """Changing a helper a kernel calls must change the kernel's cache key (a known FlyDSL bug to design out)."""
    code = """
        import importlib, sys, pathlib
        sys.path.insert(0, {path!r})
        import flydsl
        assert flydsl.INTERPRET is False
        def key(helper_body):
            pathlib.Path({path!r}, "kmod.py").write_text(
                "import flydsl.compiler as flyc\\nimport flydsl.expr as fx\\n"
                "@flyc.func\\ndef helper(x):\\n    return " + helper_body + "\\n"
                "@flyc.kernel\\ndef k(p, N: fx.constexpr):\\n"
                "    o = fx.arange(0, N)\\n    fx.store(p + o, helper(fx.load(p + o)))\\n")
            sys.modules.pop("kmod", None)
            importlib.invalidate_caches()
            import kmod
            return kmod.k.cache_key
        a, a2, b = key("x + 1"), key("x + 1"), key("x + 2")
        print(a == a2, a != b)
    """.format(path=str(tmp_path))
    # Compiled mode (no launch) is where Triton computes cache keys.
    r = fresh_python(code, env_extra={"FLYDSL_INTERPRET": "0"}, env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


@pytest.mark.gpu
@pytest.mark.overlap
@pytest.mark.parametrize("as_handle", [False, True])
def test_launch_goes_to_the_given_stream(as_handle):
    """With the default stream held busy, a launch on a side stream must finish on its own."""
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    out = empty_poisoned(4096, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    axpy(x, y, out, 2.0, stream=side)  # compile first: a cold launch can outlast the sleep below
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.25 s of work queued on the default stream
    axpy(x, y, out, 2.0, stream=side.cuda_stream if as_handle else side)
    side.synchronize()  # returns once the side stream's work is done, while the default one still sleeps
    with torch.cuda.stream(side):
        got = out.clone()
    side.synchronize()
    assert not torch.cuda.default_stream().query()  # the default stream is still busy: ours did not wait for it
    torch.testing.assert_close(got, 2.0 * x + y)
    torch.cuda.synchronize()


# ---------------------------------------------------------------- lean launch


@flyc.kernel(do_not_specialize=["n"])
def _scale_kernel(x_ptr, out_ptr, n, stride, alpha, BLOCK: fx.constexpr):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    fx.store(out_ptr + offs * stride, alpha * fx.load(x_ptr + offs * stride, mask=mask), mask=mask)


def _lean_scale(x, out, stride, alpha):
    n = x.numel() // stride if stride else x.numel()
    flyc.launch(_scale_kernel, (flyc.cdiv(max(n, 1), 64),), x, out, n, stride, alpha, BLOCK=64)


def test_lean_launch_matches_reference(device):
    """Specializations change between calls (alignment, int value 1 / multiple of 16, dtype): each stays right."""
    for dtype in (torch.float32, torch.float16):
        base = torch.randn(4099, device=device, dtype=dtype)
        for offset, n, stride in [(0, 4096, 1), (1, 4096, 1), (0, 17, 1), (3, 1, 1), (0, 4096, 1), (0, 1000, 2)]:
            x = base[offset : offset + n * stride]
            out_base = empty_poisoned(4099, dtype=dtype, device=device)
            out = out_base[offset : offset + n * stride]
            _lean_scale(x, out, stride, 1.5)
            torch.testing.assert_close(out[::stride], (1.5 * x[::stride].float()).to(dtype))
            if stride > 1:  # every other element untouched
                assert torch.isnan(out[1::stride].float()).all()


def test_lean_spec_separates_what_triton_specializes():
    spec = flyc._spec
    assert spec(1) != spec(2) and spec(16) != spec(17) and spec(2**31) != spec(2**31 - 16)
    assert spec(2**63) != spec(2**63 - 16)
    assert spec(0.5) == spec(2.0)  # floats are never specialized
    assert spec(True) != spec(False) and spec(None) == spec(None)
    a = torch.zeros(8)
    assert spec(a) != spec(a.half()) and spec(a[1:]) != spec(a)


@pytest.mark.gpu
@pytest.mark.overlap
def test_lean_launch_follows_the_current_stream():
    x = torch.randn(4096, device="cuda")
    out = empty_poisoned(4096, dtype=torch.float32, device="cuda")
    _lean_scale(x, out, 1, 2.0)  # first launch: compiles, goes through Triton
    out.fill_(float("nan"))
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the default stream stays busy ~0.25 s
    with torch.cuda.stream(side):
        _lean_scale(x, out, 1, 2.0)  # lean path
        got = out.clone()
    side.synchronize()
    assert not torch.cuda.default_stream().query()
    torch.testing.assert_close(got, 2.0 * x)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.overlap
def test_bound_launch_matches_reference_and_follows_the_stream():
    x = torch.randn(4096, device="cuda")
    bound = flyc.bind(_scale_kernel, x, x, 4096, 1, 2.0, BLOCK=64)
    if triton.__version__.startswith("3.6."):  # the launcher's C function is called directly (host time)
        assert bound.entry[4] is not None
    for n in (4096, 1024):  # same specialization: multiples of 16, aligned
        out = empty_poisoned(4096, dtype=torch.float32, device="cuda")
        bound(flyc.cdiv(n, 64), x, out, n, 1, 3.0)
        torch.testing.assert_close(out[:n], 3.0 * x[:n])
        assert torch.isnan(out[n:]).all()
    side = torch.cuda.Stream()
    out = empty_poisoned(4096, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the default stream stays busy ~0.25 s
    with torch.cuda.stream(side):
        bound(64, x, out, 4096, 1, 0.5)
    side.synchronize()
    assert not torch.cuda.default_stream().query()
    torch.testing.assert_close(out, 0.5 * x)
    torch.cuda.synchronize()


def test_bind_needs_compiled_kernels_and_keyword_constexprs(device):
    x = torch.randn(64, device=device)
    if device.type != "cuda":
        with pytest.raises(RuntimeError, match="interpreter"):
            flyc.bind(_scale_kernel, x, x, 64, 1, 2.0, BLOCK=64)
        return
    with pytest.raises(TypeError, match="BLOCK"):
        flyc.bind(_scale_kernel, x, x, 64, 1, 2.0)


@flyc.kernel
def _scale_default_kernel(x_ptr, out_ptr, n, alpha, BLOCK: fx.constexpr, TWICE: fx.constexpr = False):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    y = alpha * fx.load(x_ptr + offs, mask=mask)
    if TWICE:
        y = 2.0 * y
    fx.store(out_ptr + offs, y, mask=mask)


def test_constexpr_tail_takes_defaults_and_refuses_missing_values():
    kernel = _scale_default_kernel
    assert flyc._constexpr_tail(kernel, 4, {"BLOCK": 64}) == (64, False)
    assert flyc._constexpr_tail(kernel, 4, {"BLOCK": 64, "TWICE": True}) == (64, True)
    assert flyc._constexpr_tail(kernel, 4, {"TWICE": True}) is None


@pytest.mark.gpu
def test_bind_fills_defaulted_constexprs():
    x = torch.randn(1000, device="cuda")
    for twice, meta in ((False, {}), (True, {"TWICE": True})):
        out = empty_poisoned(1000, dtype=torch.float32, device="cuda")
        flyc.bind(_scale_default_kernel, x, out, 1000, 3.0, BLOCK=64, **meta)(flyc.cdiv(1000, 64), x, out, 1000, 3.0)
        torch.testing.assert_close(out, (6.0 if twice else 3.0) * x)


def test_pdl_is_a_launch_attribute(device):
    """``launch_pdl`` does not key a specialization: launches with and without it share one compiled kernel
    (a CUDA graph capture after PDL launches compiles nothing), each right; the direct C launch takes it as
    its PDL flag, and the interpreter ignores it."""
    from flydsl.compiler import _fire

    x = torch.randn(4096, device=device)
    before = set(flyc._lean(_scale_kernel).table)
    for pdl in (True, True, False, True):
        out = empty_poisoned(4096, dtype=torch.float32, device=device)
        flyc.launch(_scale_kernel, (64,), x, out, 4096, 1, 2.0, BLOCK=64, launch_pdl=pdl)
        torch.testing.assert_close(out, 2.0 * x)
    if device.type == "cuda":
        added = set(flyc._lean(_scale_kernel).table) - before
        assert len(added) <= 1 and not any(item[0] == "launch_pdl" for k in added for item in k[1:]
                                           if isinstance(item, tuple))  # fmt: skip
        assert flyc.programs_per_sm(_scale_kernel, x, x, 4096, 1, 2.0, BLOCK=64, launch_pdl=True) >= 1
    seen = []
    entry = (None, "fn", "packed", ("tail",), (lambda *a: seen.append(a[6]), 0, False), None)
    for pdl in (False, True):
        _fire(entry, 1, 1, 1, 0, (), pdl)
    assert seen == [False, True]


@pytest.mark.gpu
@pytest.mark.graph
def test_cuda_graph_capture_after_pdl_launches():
    """Eager PDL launches, then a plain launch of the same specialization under CUDA graph capture (what the
    packages do): the capture neither compiles nor loads a module (capture forbids it), and replays right."""
    x = torch.randn(4096, device="cuda")
    out = empty_poisoned(4096, dtype=torch.float32, device="cuda")
    for _ in range(2):  # the first launch goes through Triton's path, the second through the direct one
        flyc.launch(_scale_kernel, (64,), x, out, 4096, 1, 3.0, BLOCK=64, launch_pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flyc.launch(_scale_kernel, (64,), x, out, 4096, 1, 3.0, BLOCK=64)
    x.copy_(torch.randn(4096, device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 3.0 * x)


def test_programs_per_sm_is_one_in_the_interpreter(device):
    if device.type == "cuda":
        pytest.skip("the compiled path is tested below")
    x = torch.randn(64, device=device)
    assert flyc.programs_per_sm(_scale_kernel, x, x, 64, 1, 2.0, BLOCK=64) == 1


@pytest.mark.gpu
def test_programs_per_sm_reads_the_compiled_kernel():
    x = torch.randn(4096, device="cuda")
    out = torch.empty_like(x)
    # One warp a program: 64 programs by threads, capped at 32 programs per SM.
    assert flyc.programs_per_sm(_scale_kernel, x, out, 4096, 1, 2.0, BLOCK=64, num_warps=1) == 32
    # 32 warps: 1024 threads a program, 2048 per SM.
    assert flyc.programs_per_sm(_scale_kernel, x, out, 4096, 1, 2.0, BLOCK=64, num_warps=32) == 2


def test_on_current_device(device):
    t = torch.zeros(2, device=device)
    assert flyc.on_current_device(t) == (device.type == "cuda")


def _allocator_in_a_fresh_thread(before=None):
    """Triton's scratch allocator in a new thread (whose context starts with none) after ``before`` (a
    caller's allocator it installs first, if any) and :func:`flyc.ensure_scratch_allocator`."""
    import threading

    from triton.runtime import _allocation

    out = []

    def run():
        if before is not None:
            triton.set_allocator(before)
        flyc.ensure_scratch_allocator()
        out.append(_allocation._allocator.get())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def _plain(size, alignment, stream):  # an allocator of the caller's, as torch.compile's launchers install
    return torch.empty(size, dtype=torch.int8)


def test_scratch_allocator_is_installed_per_thread_and_keeps_the_callers():
    """Device-side tensor descriptors need Triton's scratch allocator, kept in a context variable: each
    thread gets ours on first use, and an allocator the caller installed stays."""
    assert _allocator_in_a_fresh_thread() is flyc._torch_scratch
    buf = flyc._torch_scratch(256, 128, None)
    assert buf.numel() == 256 and buf.dtype == torch.int8
    assert _allocator_in_a_fresh_thread(_plain) is _plain


def test_scratch_is_zero_filled_under_flydsl_zero_scratch(monkeypatch):
    """FLYDSL_ZERO_SCRATCH=1 (the sanitize sessions' setting for initcheck) installs a zero-filling allocator,
    chosen when a thread's allocator is installed (no environment read a launch); unset, torch.empty."""
    monkeypatch.setenv("FLYDSL_ZERO_SCRATCH", "1")
    zeroing = _allocator_in_a_fresh_thread()
    assert zeroing is flyc._torch_zero_scratch
    assert not zeroing(4096, 128, None).any()
    monkeypatch.delenv("FLYDSL_ZERO_SCRATCH")
    assert _allocator_in_a_fresh_thread() is flyc._torch_scratch


def test_zero_scratch_replaces_an_allocator_torch_compile_installed(monkeypatch):
    """torch.compile's launchers set a plain torch.empty allocator on every run; under FLYDSL_ZERO_SCRATCH=1
    the next launch of ours puts the zero-filling one back (unset: the caller's allocator stays)."""
    monkeypatch.setenv("FLYDSL_ZERO_SCRATCH", "1")
    assert _allocator_in_a_fresh_thread(_plain) is flyc._torch_zero_scratch
    monkeypatch.delenv("FLYDSL_ZERO_SCRATCH")
    assert _allocator_in_a_fresh_thread(_plain) is _plain


@flyc.kernel
def _descriptor_double_kernel(x_ptr, out_ptr, M, N, stride_x, stride_o, BM: fx.constexpr, BN: fx.constexpr):
    x_desc = fx.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[stride_x, 1], block_shape=[BM, BN])
    o_desc = fx.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_o, 1], block_shape=[BM, BN])
    m0 = fx.program_id(0) * BM
    n0 = fx.program_id(1) * BN
    o_desc.store([m0, n0], x_desc.load([m0, n0]) * 2)


def _descriptor_double(x, out):
    m, n = x.shape
    flyc.ensure_scratch_allocator()  # the descriptors live in Triton's global scratch
    flyc.launch(_descriptor_double_kernel, (flyc.cdiv(m, 32), flyc.cdiv(n, 64)), x, out, m, n, x.stride(0),
                out.stride(0), BM=32, BN=64)  # fmt: skip


@pytest.mark.gpu  # the sanitize sessions run the gpu-marked tests (the interpreter's TMA is covered by fly-gemm's)
@pytest.mark.tma_store  # `fresh` is written by the descriptor store alone
def test_device_descriptors_load_and_store_tiles_clipped_to_the_shape():
    """Tensor descriptors built on the device (as the TMA kernels build theirs): tiles that overhang the
    shape load zeros and store only inside it (the poisoned columns past it stay NaN). The second output
    comes from torch.empty, written by nothing but the descriptor store: the probe of compute-sanitizer's
    initcheck, which does not count such a store as a write (on the H200 it reported 3,880 reads of
    ``fresh``, all in torch's comparison below, while the values matched); hence the ``tma_store`` mark."""
    m, n = 77, 200  # neither a multiple of the 32 x 64 tile; rows 16-byte aligned, as a descriptor needs
    device = torch.device("cuda")
    x = torch.randn(m, 256, device=device, dtype=torch.float16)[:, :n]
    arch = flydsl.arch.current(x.device)
    if not (arch.backend == "cuda" and arch.capability >= (9, 0)):
        pytest.skip(f"device-side tensor descriptors need TMA (sm_90+), not {arch.name}")
    out_base = empty_poisoned(m, 256, dtype=torch.float16, device=device)
    _descriptor_double(x, out_base[:, :n])
    assert torch.equal(out_base[:, :n], x * 2)
    assert torch.isnan(out_base[:, n:]).all()
    fresh = torch.empty(m, n, device=device, dtype=torch.float16)
    _descriptor_double(x, fresh)
    assert torch.equal(fresh, x * 2)


@pytest.mark.gpu
def test_driver_signature_names_each_argument():
    """One letter an argument in launch order: pointers, the ints as Triton typed them (i32, or constexpr when
    1), the fp32 scalar, the constexpr tail."""
    x = torch.randn(4096, device="cuda")
    assert flyc.bind(_scale_kernel, x, x, 4096, 16, 2.0, BLOCK=64).driver_signature() == "ppiifc"
    assert flyc.bind(_scale_kernel, x, x, 4096, 1, 2.0, BLOCK=64).driver_signature() == "ppicfc"  # stride 1
    assert flyc.bind(_scale_kernel, x, x, 1 << 40, 16, 2.0, BLOCK=64).driver_signature() == "pplifc"  # n as i64


def test_driver_signature_only_for_plain_launches():
    """The letters of each argument type, and None where a plain cuLaunchKernel cannot reproduce the launch
    (cluster, cooperative, PDL) or pass an argument (16-bit float scalars, tensor descriptors, tuples)."""
    from types import SimpleNamespace as NS

    from flydsl.compiler import _driver_signature

    def compiled(sig, **md):
        meta = dict(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False) | md
        return NS(src=NS(signature=sig), metadata=NS(**meta))

    sig = {"x": "*bf16", "n": "i32", "big": "i64", "u": "u32", "flag": "i1", "eps": "fp32", "B": "constexpr"}
    assert _driver_signature(compiled(sig)) == "pilIbfc"
    assert _driver_signature(compiled(sig, num_ctas=2)) is None
    assert _driver_signature(compiled(sig, launch_cooperative_grid=True)) is None
    assert _driver_signature(compiled(sig, launch_pdl=True)) is None
    for other in ("fp16", "bf16", "tensordesc<bf16[64, 64]>", ("i32", "i32")):
        assert _driver_signature(compiled(dict(sig, v=other))) is None, other
    assert _driver_signature(NS(src=None, metadata=NS(num_ctas=1))) is None


# ---------------------------------------------------------------- gluon kernels (flydsl.gexpr)


@flyc.gluon_kernel(do_not_specialize=["n"])
def _ring_copy_kernel(x_ptr, y_ptr, n, BLOCK: gx.constexpr):
    """y = x through shared memory: cp.async into a two-slot ring, read back once every copy has landed."""
    layout: gx.constexpr = gx.BlockedLayout([4], [32], [4], [0])
    ring = gx.allocate_shared_memory(gx.float32, [2, BLOCK], gx.SwizzledSharedLayout(1, 1, 1, [0]))
    offs = gx.program_id(0) * 2 * BLOCK + gx.arange(0, BLOCK, layout=layout)
    for j in gx.static_range(2):
        gx.async_copy.async_copy_global_to_shared(ring.index(j), x_ptr + offs + j * BLOCK, mask=offs + j * BLOCK < n)
        gx.async_copy.commit_group()
    gx.async_copy.wait_group(0)
    gx.thread_barrier()
    for j in gx.static_range(2):
        gx.store(y_ptr + offs + j * BLOCK, ring.index(j).load(layout), mask=offs + j * BLOCK < n)


def test_gexpr_is_gluons_language_with_async_copies():
    assert gx.BlockedLayout is not None and gx.allocate_shared_memory is not None
    assert callable(gx.async_copy.commit_group) and callable(gx.async_copy.wait_group)
    assert "BlockedLayout" in dir(gx) and "async_copy" in gx.__all__
    with pytest.raises(AttributeError, match="flydsl.gexpr"):
        gx.no_such_name  # noqa: B018


def test_gluon_kernel_refuses_the_interpreter():
    if not flyc.interpreting():
        pytest.skip("compiled process: the kernel runs (test_gluon_kernel_launches_lean)")
    x = torch.arange(10, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="gluon_kernel.*GPU only"):
        flyc.launch(_ring_copy_kernel, (1,), x, x.clone(), 10, BLOCK=512)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 1024, 5000])
def test_gluon_kernel_launches_lean(n):
    x = torch.randn(n, device="cuda")
    for _ in range(2):  # the second launch takes the lean path
        y = empty_poisoned(n, dtype=torch.float32, device="cuda")
        flyc.launch(_ring_copy_kernel, (flyc.cdiv(n, 1024),), x, y, n, BLOCK=512)
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert flyc.programs_per_sm(_ring_copy_kernel, x, y, n, BLOCK=512) >= 1
