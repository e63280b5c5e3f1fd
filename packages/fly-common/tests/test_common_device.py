"""Device building blocks against torch references, through whatever backend this process uses."""

from __future__ import annotations

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, empty_poisoned
from flydsl_common import device as dev
from flydsl_common.reference import activation_ref


@flyc.kernel
def _act_kernel(x_ptr, y_ptr, n, ACT: fx.constexpr, B: fx.constexpr):
    offs = fx.program_id(0) * B + fx.arange(0, B)
    x = dev.load_row_f32(x_ptr, offs, n, 0.0, 1)
    dev.store_row(y_ptr, offs, n, dev.activation(x, ACT), 1)


@pytest.mark.parametrize("name", ["none", "relu", "silu", "gelu_tanh", "gelu", "gelu_erf"])
def test_activations_match_fp64(device, name):
    x = torch.cat([torch.randn(1000, device=device) * 4, torch.tensor([0.0, -30.0, 30.0, 1e-3], device=device)])
    y = empty_poisoned(x.shape, dtype=torch.float32, device=device)
    _act_kernel[(flyc.cdiv(x.numel(), 256),)](x, y, x.numel(), dev.activation_code(name), 256)
    assert_rel_close(y, activation_ref(x, name), tol=2e-6)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_activations_keep_relative_accuracy_in_the_tails(device, name):
    # element by element, not in norm: the negative tail of GELU is where 0.5 * (1 + erf) cancels
    x = torch.linspace(-6.0, 6.0, 12001, device=device)
    y = empty_poisoned(x.shape, dtype=torch.float32, device=device)
    _act_kernel[(flyc.cdiv(x.numel(), 256),)](x, y, x.numel(), dev.activation_code(name), 256)
    ref = activation_ref(x, name)
    rel = ((y.double() - ref) / ref.abs().clamp_min(1e-300)).abs()
    rel = torch.where(ref == 0, (y.double() - ref).abs(), rel).cpu()
    xs = x.cpu()
    bounds = [(0.0, 6.01, 2e-6), (-3.0, 0.0, 1e-4), (-6.01, -3.0, 5e-3)] if name == "gelu" else [(-6.01, 6.01, 1e-5)]
    for lo, hi, bound in bounds:
        sel = (xs >= lo) & (xs < hi)
        assert rel[sel].max().item() <= bound, (name, lo, hi, rel[sel].max().item())


def test_activation_names_are_checked():
    assert dev.activation_code(None) == dev.ACT_NONE
    assert dev.activation_code("GELU") == dev.ACT_GELU_ERF
    with pytest.raises(ArgumentError, match="activation: expected None or one of"):
        dev.activation_code("swish")


@flyc.kernel
def _reduce_kernel(x_ptr, out_ptr, n, stride, B: fx.constexpr):
    row = fx.program_id(0)
    cols = fx.arange(0, B)
    x = dev.load_row_f32(x_ptr + dev.row_offset(row, stride), cols, n, 0.0, 1)
    fx.store(out_ptr + row * 8 + 0, dev.sum_f32(x, 0))
    fx.store(out_ptr + row * 8 + 1, dev.sumsq_f32(x, 0))
    fx.store(out_ptr + row * 8 + 2, dev.absmax_f32(x, 0))
    xm = fx.load(x_ptr + dev.row_offset(row, stride) + cols, mask=cols < n, other=-float("inf"))
    fx.store(out_ptr + row * 8 + 3, dev.max_f32(xm, 0))
    s, sq = dev.sum2_f32(x, x * x, 0)  # both sums in one reduction
    fx.store(out_ptr + row * 8 + 4, s)
    fx.store(out_ptr + row * 8 + 5, sq)
    sq2, amax2 = dev.sum_absmax_f32(x * x, x * -2.0, 0)  # a sum and an abs-max in one reduction
    fx.store(out_ptr + row * 8 + 6, sq2)
    fx.store(out_ptr + row * 8 + 7, amax2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 100, 128])
def test_reductions_in_fp32_on_strided_rows(device, dtype, n):
    base = torch.randn(5, 160, device=device).to(dtype)
    x = base[:, 3 : 3 + n]  # row stride 160, offset start: strided rows
    out = empty_poisoned(5, 8, dtype=torch.float32, device=device)
    _reduce_kernel[(5,)](x, out, n, x.stride(0), 128)
    xd = x.double()
    sq, amax = (xd * xd).sum(1), xd.abs().amax(1)
    ref = torch.stack([xd.sum(1), sq, amax, xd.amax(1), xd.sum(1), sq, sq, 2 * amax], 1)
    assert_rel_close(out, ref, tol=1e-6)


@flyc.kernel
def _cast_kernel(x_ptr, i8_ptr, f8_ptr, r_ptr, n, B: fx.constexpr):
    offs = fx.program_id(0) * B + fx.arange(0, B)
    m = offs < n
    x = fx.load(x_ptr + offs, mask=m, other=0.0)
    fx.store(i8_ptr + offs, dev.cast_sat_int8(x), mask=m)
    fx.store(f8_ptr + offs, dev.cast_sat_fp8e4m3(x), mask=m)
    fx.store(r_ptr + offs, dev.round_half_even(x), mask=m)


def test_saturating_casts_are_exact(device):
    # Every fp8 value, every midpoint between neighbours (ties), out-of-range values, randoms.
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].sort().values
    x = torch.cat([vals, (vals[1:] + vals[:-1]) / 2, torch.randn(3000) * 60,
                   torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, -127.5, 1e6, -1e6, 5e6])]).to(device)
    n = x.numel()
    i8 = empty_poisoned(n, dtype=torch.int8, device=device)
    f8 = empty_poisoned(n, dtype=torch.float8_e4m3fn, device=device)
    r = empty_poisoned(n, dtype=torch.float32, device=device)
    _cast_kernel[(flyc.cdiv(n, 1024),)](x, i8, f8, r, n, 1024)
    assert torch.equal(r.cpu(), torch.where(x.abs() < 2**22, torch.round(x), x).cpu())
    assert torch.equal(i8.cpu(), torch.round(x.clamp(-127, 127)).to(torch.int8).cpu())
    ref8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    nonzero = x != 0  # the sign of zero is not part of the contract
    assert torch.equal(f8.view(torch.uint8)[nonzero].cpu(), ref8.view(torch.uint8)[nonzero].cpu())


@flyc.func
def _store_pair(ptr, c, even, odd):
    fx.store(ptr + 2 * c, even)
    fx.store(ptr + 2 * c + 1, odd)


@flyc.kernel
def _pairs_kernel(x_ptr, f_ptr, wide_ptr, out_ptr, B: fx.constexpr):
    """bf16 x (2B columns) read as B int32 words: the three widenings, and f (fp32) packed to bf16 words."""
    c = fx.arange(0, B)[None, :]
    words = fx.load(x_ptr.to(fx.pointer_type(fx.int32), bitcast=True) + c)
    e1, o1 = dev.bf16_pairs(words)
    e2, o2 = dev.bf16_pairs_again(words)
    zero = (fx.sum(e1 * e1, axis=1) + 1.0).to(fx.int32, bitcast=True) >> 31  # a positive value's sign bit
    e3, o3 = dev.bf16_pairs_third(words, zero[:, None])
    _store_pair(wide_ptr, c, e1, o1)
    _store_pair(wide_ptr + 2 * B, c, e2, o2)
    _store_pair(wide_ptr + 4 * B, c, e3, o3)
    late = dev.offsets_after(c + fx.zeros_like(words), words, 4)
    packed = dev.bf16_words(fx.load(f_ptr + 2 * late), fx.load(f_ptr + 2 * late + 1))
    fx.store(out_ptr.to(fx.pointer_type(fx.int32), bitcast=True) + c, packed)


def test_packed_bf16_pairs_round_trip(device):
    """Each widening of bf16 pairs read as int32 words is exact; fp32 rounded to bf16 words (ties to even,
    as torch) through offsets ordered after another value."""
    b = 64
    x = torch.randn(2 * b, device=device).to(torch.bfloat16)
    f = torch.randn(2 * b, device=device)
    f[:4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3e38], device=device)  # ties, large
    wide = empty_poisoned((3, 2 * b), dtype=torch.float32, device=device)
    out = empty_poisoned((2 * b,), dtype=torch.bfloat16, device=device)
    _pairs_kernel[(1,)](x, f, wide, out, b)
    for k in range(3):
        assert torch.equal(wide[k], x.float()), k
    assert torch.equal(out, f.to(torch.bfloat16))


@flyc.kernel
def _max_words_kernel(x_ptr, out_ptr, n_words, B: fx.constexpr):
    """out[r] = the max of row r's bf16 (rows of 2 * B columns read as B words, the first n_words of them:
    the rest as a masked load reads them, two -inf)."""
    r = fx.program_id(0)
    c = fx.arange(0, B)
    words = fx.load(dev.as_words(x_ptr) + r * B + c, mask=c < n_words, other=dev.NEG_INF_BF16_PAIR)
    fx.store(out_ptr + r, dev.max_bf16_words(words, 0))


def test_max_bf16_words_is_the_max_of_every_half(device):
    """The max of bf16 rows held as words equals torch's max in every case: either half holding it, all
    negative, -inf entries, the masked-off tail (read as -inf pairs) beyond a larger value, the extremes."""
    b, n_words = 64, 50
    x = torch.randn(6, 2 * b, device=device).to(torch.bfloat16)
    x[1, 37] = 9.0  # an odd column (a word's high half)
    x[2] = -torch.rand(2 * b, device=device).to(torch.bfloat16) - 1.0  # all negative
    x[3, ::2] = float("-inf")
    x[4, 2 * n_words :] = 100.0  # past the masked load: not part of the row
    x[5, 11] = 3.0e38
    out = empty_poisoned((6,), dtype=torch.float32, device=device)
    _max_words_kernel[(6,)](x, out, n_words, b)
    assert torch.equal(out, x[:, : 2 * n_words].float().amax(-1))


@flyc.kernel
def _exchange_kernel(slot_ptr, out_ptr, P, ROUNDS: fx.constexpr, B: fx.constexpr, SPIN_LIMIT: fx.constexpr):
    """Each of P programs publishes (pid + 1) * (r + 1) in its slot of round r, then sums every program's
    slot of that round through peek + collect_from, inside a pipelined loop; out[pid, r] = the sum."""
    pid = fx.program_id(0)
    k = fx.arange(0, B)
    for r in fx.range(0, ROUNDS, num_stages=2):
        slots = slot_ptr + r * B + k
        early = dev.peek(slots)
        dev.publish(slot_ptr + r * B + pid, ((pid + 1) * (r + 1)).to(fx.float32), pid < P)
        vals = dev.collect_from(early, slots, k < P, SPIN_LIMIT)
        fx.store(out_ptr + pid * ROUNDS + r, fx.sum(vals, axis=0))


def test_collect_from_sums_every_published_slot(device):
    """peek + collect_from between the programs of one wave: on a GPU every program sees every slot of each
    round (also the ones published after its peek); in the interpreter (programs one after another) only the
    last program does, and the earlier ones give up after SPIN_LIMIT reads and return NaN (no hang)."""
    p, rounds, b = 4, 3, 8
    slots = torch.zeros(rounds, b, dtype=torch.int64, device=device)
    out = empty_poisoned(p, rounds, dtype=torch.float32, device=device)
    _exchange_kernel[(p,)](slots, out, p, rounds, b, 1 << 20 if device == "cuda" else 3)
    expected = torch.tensor([float(sum(range(1, p + 1)) * (r + 1)) for r in range(rounds)], device=device)
    if flyc.interpreting():
        assert torch.isnan(out[:-1]).all()
        torch.testing.assert_close(out[-1], expected)
    else:
        torch.testing.assert_close(out, expected.expand(p, rounds))


@flyc.kernel
def _sum_exchange_kernel(slot_ptr, out_ptr, ok_ptr, P, ROUNDS: fx.constexpr, SPIN_LIMIT: fx.constexpr,
                         LANES: fx.constexpr):  # fmt: skip
    """Each of P programs publishes (pid + 1) * (r + 1) in its slot of round r (rounds of P slots), then
    waits for the round's sum through collect_sum; out[pid, r] = the sum, ok[pid, r] = its ok."""
    pid = fx.program_id(0)
    for r in range(0, ROUNDS):
        dev.publish(slot_ptr + r * P + pid, ((pid + 1) * (r + 1)).to(fx.float32), pid < P)
        total, ok = dev.collect_sum(slot_ptr + r * P, P, SPIN_LIMIT, LANES)
        fx.store(out_ptr + pid * ROUNDS + r, total)
        fx.store(ok_ptr + pid * ROUNDS + r, ok.to(fx.int32))


@pytest.mark.parametrize("p, warps", [(3, 1), (8, 4), (64, 4), (130, 8)])
def test_collect_sum_sums_every_published_slot(device, p, warps):
    """publish + collect_sum between the programs of one wave (slots fewer and more than a warp's threads,
    programs of 1-8 warps, LANES from slot_lanes): on a GPU every program returns every round's exact sum with
    ok; in the interpreter (programs one after another) only the last program does, the earlier ones give up
    (ok False) after SPIN_LIMIT reads instead of hanging."""
    if flyc.interpreting() and p > 8:
        pytest.skip("interpreter: 16-60 s a case; the small ones run the same code there")
    rounds = 3
    lanes = dev.slot_lanes(flyc.next_power_of_2(p), warps, 32)
    assert lanes >= 2 * warps * 32 and lanes >= p
    slots = torch.zeros(rounds, p, dtype=torch.int64, device=device)
    out = empty_poisoned(p, rounds, dtype=torch.float32, device=device)
    ok = torch.full((p, rounds), -1, dtype=torch.int32, device=device)
    _sum_exchange_kernel[(p,)](slots, out, ok, p, rounds, 1 << 20 if device == "cuda" else 3, lanes,
                               num_warps=warps)  # fmt: skip
    expected = torch.tensor([float(p * (p + 1) // 2 * (r + 1)) for r in range(rounds)], device=device)
    if flyc.interpreting():
        assert (ok[:-1] == 0).all() and (ok[-1] == 1).all()
        torch.testing.assert_close(out[-1], expected)
    else:
        assert (ok == 1).all()
        torch.testing.assert_close(out, expected.expand(p, rounds), rtol=0, atol=0)


@flyc.kernel
def _pair_exchange_kernel(slot_ptr, out_ptr, P, ROUNDS: fx.constexpr, B: fx.constexpr, SPIN_LIMIT: fx.constexpr):
    """_exchange_kernel with pairs: each program publishes ((pid + 1) * (r + 1), (pid + 1)^2 / (r + 1)) in one
    slot (publish_pair); out[pid, r] = (sum of the low values, sum of the high values)."""
    pid = fx.program_id(0)
    k = fx.arange(0, B)
    for r in fx.range(0, ROUNDS, num_stages=2):
        slots = slot_ptr + r * B + k
        early = dev.peek(slots)
        lo = ((pid + 1) * (r + 1)).to(fx.float32)
        dev.publish_pair(slot_ptr + r * B + pid, lo, ((pid + 1) * (pid + 1)).to(fx.float32) / (r + 1), pid < P)
        los, his = dev.collect_pairs_from(early, slots, k < P, SPIN_LIMIT)
        fx.store(out_ptr + (pid * ROUNDS + r) * 2, fx.sum(los, axis=0))
        fx.store(out_ptr + (pid * ROUNDS + r) * 2 + 1, fx.sum(his, axis=0))


def test_collect_pairs_from_sums_both_halves_of_every_slot(device):
    """publish_pair + collect_pairs_from: both values of every program's slot, masked-off slots as zeros, a
    high value of 0 still published (the tag is its sign bit, not its value); in the interpreter the earlier
    programs give up (NaN), as collect_from's."""
    p, rounds, b = 4, 3, 8
    slots = torch.zeros(rounds, b, dtype=torch.int64, device=device)
    out = empty_poisoned(p, rounds, 2, dtype=torch.float32, device=device)
    _pair_exchange_kernel[(p,)](slots, out, p, rounds, b, 1 << 20 if device == "cuda" else 3)
    lo = torch.tensor([float(sum(range(1, p + 1)) * (r + 1)) for r in range(rounds)], device=device)
    hi = torch.tensor([sum((i + 1) ** 2 for i in range(p)) / (r + 1) for r in range(rounds)], device=device)
    expected = torch.stack([lo, hi], -1)
    if flyc.interpreting():
        assert torch.isnan(out[:-1]).all()
        torch.testing.assert_close(out[-1], expected)
    else:
        torch.testing.assert_close(out, expected.expand(p, rounds, 2))
    zero = torch.zeros(1, b, dtype=torch.int64, device=device)
    out1 = empty_poisoned(1, 1, 2, dtype=torch.float32, device=device)
    _zero_pair_kernel[(1,)](zero, out1, -2.5, 0.0, b, 3)  # a high value of 0: still published
    assert out1.flatten().tolist() == [-2.5, 0.0]


@flyc.kernel
def _zero_pair_kernel(slot_ptr, out_ptr, lo, hi, B: fx.constexpr, SPIN_LIMIT: fx.constexpr,
                      SIGNED: fx.constexpr = False):  # fmt: skip
    k = fx.arange(0, B)
    early = dev.peek(slot_ptr + k)
    first = k == 0  # the values as tensors (the interpreter passes float arguments as Python floats)
    lo_t, hi_t = fx.sum(fx.where(first, lo, 0.0), axis=0), fx.sum(fx.where(first, hi, 0.0), axis=0)
    dev.publish_pair(slot_ptr, lo_t, hi_t, fx.max(first.to(fx.int32), axis=0) > 0, SIGNED)
    los, his = dev.collect_pairs_from(early, slot_ptr + k, k < 1, SPIN_LIMIT, SIGNED)
    fx.store(out_ptr, fx.sum(los, axis=0))
    fx.store(out_ptr + 1, fx.sum(his, axis=0))


@pytest.mark.parametrize("hi", [-3.75, 0.0, -0.0, 2.5e-38, -1.0e30, float("inf")])
def test_signed_pairs_keep_the_high_value_of_any_sign(device, hi):
    """publish_pair / collect_pairs_from with SIGNED: the high value comes back as published whatever its sign
    (+0 published as -0, still read as zero), and the slot reads as published (one read, no give-up); the
    unsigned form would have taken a negative value's sign bit for the tag and dropped it."""
    slot = torch.zeros(1, 8, dtype=torch.int64, device=device)
    out = empty_poisoned(1, 1, 2, dtype=torch.float32, device=device)
    _zero_pair_kernel[(1,)](slot, out, 1.5, hi, 8, 3, True)
    got_lo, got_hi = out.flatten().tolist()
    assert got_lo == 1.5 and got_hi == torch.tensor(hi, dtype=torch.float32).item()  # hi as fp32 holds it
    assert slot[0, 0].item() != 0 and slot[0, 0].item() >> 32 != 0  # the tag: the high half is never 0
