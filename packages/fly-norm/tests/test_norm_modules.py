"""nn.Module drop-ins against the torch modules they replace; the benchmark's plumbing; the demo cases."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fly_norm import FlyLayerNorm, FlyRMSNorm, FlySoftmax
from fly_norm._family import FAMILY
from flydsl.testing import assert_rel_close, rel_error


def _copy_params(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for p in src.parameters():
            p.uniform_(-1.5, 1.5)
        dst.load_state_dict(src.state_dict())  # same keys: a drop-in


@pytest.mark.parametrize(
    "make,ours",
    [
        (lambda: nn.LayerNorm(40), lambda: FlyLayerNorm(40)),
        (lambda: nn.LayerNorm((3, 8), bias=False), lambda: FlyLayerNorm((3, 8), bias=False)),
        (lambda: nn.LayerNorm(40, elementwise_affine=False), lambda: FlyLayerNorm(40, elementwise_affine=False)),
        (lambda: nn.RMSNorm(40, eps=1e-6), lambda: FlyRMSNorm(40, eps=1e-6)),
        (lambda: nn.RMSNorm((3, 8)), lambda: FlyRMSNorm((3, 8))),  # eps None: the dtype's epsilon
    ],
)
def test_norm_modules_match_torch_forward_and_backward(device, make, ours):
    ref_mod, mod = make().to(device), ours().to(device)
    assert isinstance(mod, type(ref_mod))
    _copy_params(mod, ref_mod)
    shape = (2, 5, *ref_mod.normalized_shape)
    x = torch.randn(*shape, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = mod(x), ref_mod(x_ref)
    assert y.shape == y_ref.shape
    assert_rel_close(y, y_ref, tol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert_rel_close(x.grad, x_ref.grad, tol=1e-4)
    for (name, p), p_ref in zip(mod.named_parameters(), ref_mod.parameters(), strict=True):
        assert rel_error(p.grad, p_ref.grad) <= 1e-4, name


def test_softmax_module(device):
    x = torch.randn(3, 7, 9, device=device)
    for dim in (0, 1, -1):
        assert_rel_close(FlySoftmax(dim)(x), nn.Softmax(dim)(x), tol=1e-5)
    assert isinstance(FlySoftmax(1), nn.Softmax)
    with pytest.raises(ValueError, match="dim"):
        FlySoftmax()


def test_module_rejects_wrong_trailing_shape(device):
    with pytest.raises(ValueError, match="trailing shape"):
        FlyRMSNorm(8).to(device)(torch.randn(2, 9, device=device))


def test_demo_cases_pass(device):
    for case in FAMILY.demo_cases():
        run = case.prepare(device)
        err = rel_error(run.ours(), run.reference())
        assert err <= run.tolerance, (case.name, err)


def test_bench_quick_runs_end_to_end(tmp_path):
    from fly_norm.bench import main
    from flydsl_common.bench import Results

    assert main(["--quick", "--no-ceilings", "--only", "rmsnorm_fwd", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    rows = Results.load(path).rows()
    ours = [r for r in rows if r.provider == "flydsl"]
    assert ours and all(r.status == "ok" for r in ours)
