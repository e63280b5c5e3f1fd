"""The exchange between the programs of one resident wave (:mod:`fly_norm._kernels.exchange`) against exact
sums, through whatever backend this process uses: on a GPU every program sees every slot; in the interpreter
(programs one after another) only the last one does, the earlier ones give up after SPIN_LIMIT reads."""

from __future__ import annotations

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from fly_norm._exchange_host import slot_lanes
from fly_norm._kernels.exchange import collect_from, collect_pairs_from, collect_sum, peek, publish, publish_pair
from flydsl.testing import empty_poisoned


@flyc.kernel
def _exchange_kernel(slot_ptr, out_ptr, P, ROUNDS: fx.constexpr, B: fx.constexpr, SPIN_LIMIT: fx.constexpr):
    """Each of P programs publishes (pid + 1) * (r + 1) in its slot of round r, then sums every program's
    slot of that round through peek + collect_from, inside a pipelined loop; out[pid, r] = the sum."""
    pid = fx.program_id(0)
    k = fx.arange(0, B)
    for r in fx.range(0, ROUNDS, num_stages=2):
        slots = slot_ptr + r * B + k
        early = peek(slots)
        publish(slot_ptr + r * B + pid, ((pid + 1) * (r + 1)).to(fx.float32), pid < P)
        vals = collect_from(early, slots, k < P, SPIN_LIMIT)
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
        publish(slot_ptr + r * P + pid, ((pid + 1) * (r + 1)).to(fx.float32), pid < P)
        total, ok = collect_sum(slot_ptr + r * P, P, SPIN_LIMIT, LANES)
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
    lanes = slot_lanes(flyc.next_power_of_2(p), warps, 32)
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
        early = peek(slots)
        lo = ((pid + 1) * (r + 1)).to(fx.float32)
        publish_pair(slot_ptr + r * B + pid, lo, ((pid + 1) * (pid + 1)).to(fx.float32) / (r + 1), pid < P)
        los, his = collect_pairs_from(early, slots, k < P, SPIN_LIMIT)
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
    early = peek(slot_ptr + k)
    first = k == 0  # the values as tensors (the interpreter passes float arguments as Python floats)
    lo_t, hi_t = fx.sum(fx.where(first, lo, 0.0), axis=0), fx.sum(fx.where(first, hi, 0.0), axis=0)
    publish_pair(slot_ptr, lo_t, hi_t, fx.max(first.to(fx.int32), axis=0) > 0, SIGNED)
    los, his = collect_pairs_from(early, slot_ptr + k, k < 1, SPIN_LIMIT, SIGNED)
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
