"""``nn.Module`` for a mixture-of-experts layer: :class:`FlyMoE` (router + experts), inference only.

The forward is the router (an fp32 linear layer), the routing (:func:`fly_gemm.topk_softmax`, or
:func:`fly_gemm.grouped_topk` for sigmoid scores, expert groups, a correction bias or a routed scaling
factor) and :func:`fly_gemm.fused_moe` over the experts. Parameters use vLLM's expert layout (``w1``
``[E, 2I, H]``: gate rows then up rows; ``w2`` ``[E, H, I]``), so a ported model's weights need no repacking.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError

from .moe import MOE_ACTIVATIONS, MOE_DTYPES, fused_moe
from .moe_routing import grouped_topk, topk_softmax

__all__ = ["FlyMoE"]

_SCORINGS = ("softmax", "sigmoid")


def _count(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ArgumentError(f"{name}: expected an integer >= {minimum}, got {type(value).__name__} {value!r}")
    return int(value)


class FlyMoE(nn.Module):
    """A mixture-of-experts layer for inference: ``y[t] = sum_j w[t, j] * W2[e] @ (act(W1g[e] @ x[t]) *
    (W1u[e] @ x[t]))`` over the ``top_k`` experts ``e`` that the router picks for token t.

    Parameters (state dict keys):

    - ``router.weight`` ``[E, H]``: an ``nn.Linear(H, E, bias=False)`` created in **fp32** whatever ``dtype``
      is. The routing is a discrete choice, so logits rounded to bf16 would flip near-tied experts; the
      router reads ``H * E`` weights and does ``T * H * E`` multiply-adds, little next to the experts'
      ``3 * T * top_k * H * I``. The logits are computed in fp32 (``x`` cast up) even after ``.to(dtype)``
      has cast the router with the rest of the module (torch's rule for ``.to``); a bf16 checkpoint loads
      into it exactly.
    - ``w1`` ``[E, 2I, H]`` (each expert's gate rows ``[0, I)``, then up rows ``[I, 2I)``) and ``w2``
      ``[E, H, I]`` in ``dtype`` (bf16 / fp16 to run; vLLM's layout).
    - ``e_score_correction_bias`` ``[E]`` fp32, a buffer (DeepSeek-V3's load-balancing bias: it is set by
      the balancing rule, not learned by gradient), present when ``correction_bias=True``.

    Routing: softmax scores with plain top-k (Mixtral, Qwen3-MoE) run :func:`~fly_gemm.topk_softmax`;
    anything else (``scoring="sigmoid"``, ``num_expert_group`` / ``topk_group``, a correction bias or
    ``routed_scaling_factor != 1``) runs :func:`~fly_gemm.grouped_topk` (one group when
    ``num_expert_group`` is None). DeepSeek-V3: ``scoring="sigmoid", num_expert_group=8, topk_group=4,
    routed_scaling_factor=2.5, correction_bias=True``.

    **Inference only**: :func:`~fly_gemm.fused_moe` has no backward yet, so a forward that would need one
    (grad mode on and ``x`` or a parameter requiring grad) raises :class:`~flydsl.errors.UnsupportedError`
    rather than taking a silent slow path. Run under ``torch.no_grad()`` / ``torch.inference_mode()``, or
    call :meth:`prepack` (which freezes the parameters).

    Example::

        moe = FlyMoE(4096, 14336, num_experts=8, top_k=2, device="cuda", dtype=torch.bfloat16).prepack()
        y = moe(x)   # x [batch, seq, 4096] bf16
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        activation: str = "silu",
        renormalize: bool = True,
        scoring: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        h = _count("hidden_size", hidden_size)
        inter = _count("intermediate_size", intermediate_size)
        e = _count("num_experts", num_experts)
        k = _count("top_k", top_k)
        if k > e:
            raise ArgumentError(f"top_k: expected at most num_experts = {e}, got {k}")
        if not isinstance(activation, str) or activation.lower() not in MOE_ACTIVATIONS:
            raise ArgumentError(f"activation: expected one of {list(MOE_ACTIVATIONS)}, got {activation!r}")
        if scoring not in _SCORINGS:
            raise ArgumentError(f"scoring: expected one of {list(_SCORINGS)}, got {scoring!r}")
        if (num_expert_group is None) != (topk_group is None):
            raise ArgumentError(f"num_expert_group, topk_group: give both (grouped top-k) or neither, got "
                                f"num_expert_group={num_expert_group!r}, topk_group={topk_group!r}")  # fmt: skip
        if num_expert_group is not None:
            groups = _count("num_expert_group", num_expert_group)
            if e % groups:
                raise ArgumentError(f"num_expert_group: expected a divisor of num_experts = {e}, got {groups}")
            kept = _count("topk_group", topk_group)
            if kept > groups:
                raise ArgumentError(f"topk_group: expected at most num_expert_group = {groups}, got {kept}")
            if k > kept * (e // groups):
                raise ArgumentError(f"top_k: expected at most topk_group * num_experts / num_expert_group = "
                                    f"{kept * (e // groups)} (the experts of the kept groups), got {k}")  # fmt: skip
        if (
            isinstance(routed_scaling_factor, bool)
            or not isinstance(routed_scaling_factor, numbers.Real)
            or not (math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0)
        ):
            raise ArgumentError(f"routed_scaling_factor: expected a finite number > 0, got {routed_scaling_factor!r}")

        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = h, inter, e, k
        self.activation = activation.lower()
        self.renormalize = bool(renormalize)
        self.scoring = scoring
        self.num_expert_group = None if num_expert_group is None else int(num_expert_group)
        self.topk_group = None if topk_group is None else int(topk_group)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.prepacked = False

        self.router = nn.Linear(h, e, bias=False, device=device, dtype=torch.float32)
        self.w1 = nn.Parameter(torch.empty(e, 2 * inter, h, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, h, inter, device=device, dtype=dtype))
        bias = torch.empty(e, device=device, dtype=torch.float32) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.reset_parameters()

    # ----------------------------------------------------------------------------------------- construction

    def reset_parameters(self) -> None:
        """The router as ``nn.Linear`` initializes itself; each expert's projections as an ``nn.Linear`` of
        their shape would be (uniform in ``+-1 / sqrt(fan_in)``: fan-in H for ``w1``, I for ``w2``; a 3-D
        kaiming init would take ``2I * H`` as the fan-in); the correction bias zero."""
        self.router.reset_parameters()
        with torch.no_grad():
            b1 = 1.0 / math.sqrt(self.hidden_size)
            b2 = 1.0 / math.sqrt(self.intermediate_size)
            self.w1.uniform_(-b1, b1)
            self.w2.uniform_(-b2, b2)
            if self.e_score_correction_bias is not None:
                self.e_score_correction_bias.zero_()

    @classmethod
    def from_weights(
        cls,
        router_weight: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        *,
        top_k: int,
        e_score_correction_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> FlyMoE:
        """A module around a model's weights: ``router_weight`` ``[E, H]`` (copied to fp32), ``w1``
        ``[E, 2I, H]`` (gate rows then up rows), ``w2`` ``[E, H, I]``, and DeepSeek-V3's
        ``e_score_correction_bias`` ``[E]`` (copied to fp32) when given. Sizes, dtype and device come from
        the weights; ``kwargs`` are the constructor's routing options (``activation``, ``scoring``, ...).

        ``w1`` and ``w2`` are taken without a copy (the parameters share their storage, as
        ``nn.Parameter(t)`` does): a MoE layer's experts are most of a model's memory. ``.clone()`` them
        first to keep the two apart. Nothing is randomly initialized.

        Example::

            moe = FlyMoE.from_weights(gate.weight, w13, w2, top_k=2)   # vLLM's w13_weight / w2_weight
        """
        for bad in ("hidden_size", "intermediate_size", "num_experts", "device", "dtype", "correction_bias"):
            if bad in kwargs:
                raise ArgumentError(f"{bad}: taken from the weights by from_weights, not given")
        check_tensor("router_weight", router_weight, ndim=2)
        check_tensor("w1", w1, ndim=3)
        check_tensor("w2", w2, ndim=3)
        e, two_i, h = w1.shape
        if e == 0 or two_i == 0 or two_i % 2 or h == 0:
            raise ShapeError(f"w1: expected [E, 2 * I, H] (E, I, H >= 1; gate rows then up rows), got {describe(w1)}")
        inter = two_i // 2
        if tuple(w2.shape) != (e, h, inter):
            raise ShapeError(f"w2: expected [{e}, {h}, {inter}] ([E, H, I] with w1's E, I, H), got {describe(w2)}")
        if tuple(router_weight.shape) != (e, h):
            raise ShapeError(f"router_weight: expected [{e}, {h}] ([E, H] with w1's E and H), got "
                             f"{describe(router_weight)}")  # fmt: skip
        if w2.dtype != w1.dtype:
            raise DTypeError(f"w2: expected dtype {dtype_name(w1.dtype)} (w1's), got {describe(w2)}")
        if not w1.dtype.is_floating_point:
            raise DTypeError(f"w1: expected floating-point expert weights (bf16 / fp16 to run), got {describe(w1)}")
        if e_score_correction_bias is not None:
            check_tensor("e_score_correction_bias", e_score_correction_bias, ndim=1)
            if e_score_correction_bias.shape[0] != e:
                raise ShapeError(f"e_score_correction_bias: expected [{e}] (one per expert), got "
                                 f"{describe(e_score_correction_bias)}")  # fmt: skip
        check_same_device(w1=w1, w2=w2, router_weight=router_weight, e_score_correction_bias=e_score_correction_bias)

        # built on the meta device: no storage for, and no random init of, weights about to be replaced
        m = cls(h, inter, e, top_k, correction_bias=e_score_correction_bias is not None, device="meta",
                dtype=w1.dtype, **kwargs)  # fmt: skip
        m.router.weight = nn.Parameter(router_weight.detach().to(torch.float32, copy=True))
        m.w1 = nn.Parameter(w1.detach())
        m.w2 = nn.Parameter(w2.detach())
        if e_score_correction_bias is not None:
            m.e_score_correction_bias = e_score_correction_bias.detach().to(torch.float32, copy=True)
        return m

    # ------------------------------------------------------------------------------------------- inference

    def prepack(self) -> FlyMoE:
        """Ready the layer for inference; returns self.

        The expert weights already are in :func:`~fly_gemm.fused_moe`'s layout (vLLM's), so this makes
        ``w1`` / ``w2`` contiguous (a copy only where they are not; the parameter objects stay the same) and
        freezes every parameter (``requires_grad=False``), after which the forward runs in any grad mode.
        Needs bf16 / fp16 experts. Quantized prepacking (fp8 / int8 expert weights with their scales) is
        not done yet: it comes with quantized expert weights in ``FlyMoE``.
        """
        if self.w1.dtype not in MOE_DTYPES:
            raise DTypeError(f"w1: FlyMoE.prepack needs bf16 / fp16 experts (what fused_moe runs), got "
                             f"{describe(self.w1)}; convert the module (.to(torch.bfloat16)) first")  # fmt: skip
        with torch.no_grad():
            for p in (self.w1, self.w2):
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
        for p in self.parameters():
            p.requires_grad_(False)
        self.prepacked = True
        return self

    def unpack(self) -> FlyMoE:
        """Undo :meth:`prepack`'s freeze: the parameters require grad again (e.g. to train them with
        another implementation; this forward then needs ``torch.no_grad()``). Returns self."""
        for p in self.parameters():
            p.requires_grad_(True)
        self.prepacked = False
        return self

    def _check_input(self, x) -> None:
        check_tensor("x", x, min_ndim=1)
        if x.shape[-1] != self.hidden_size:
            raise ShapeError(f"x: expected [..., {self.hidden_size}] (the last dimension hidden_size), got "
                             f"{describe(x)}")  # fmt: skip
        if self.w1.dtype not in MOE_DTYPES:
            raise DTypeError(f"w1: FlyMoE runs bf16 / fp16 experts, got {describe(self.w1)}; convert the module "
                             f"(.to(torch.bfloat16)) first")  # fmt: skip
        if x.dtype not in MOE_DTYPES:
            raise DTypeError(f"x: expected dtype bf16 or fp16, got {describe(x)}")
        if x.dtype != self.w1.dtype:
            raise DTypeError(f"x: expected dtype {dtype_name(self.w1.dtype)} (the experts'), got {describe(x)}")
        check_same_device(w1=self.w1, x=x, w2=self.w2, router_weight=self.router.weight,
                          e_score_correction_bias=self.e_score_correction_bias)  # fmt: skip
        if torch.is_grad_enabled():
            needs = ["x"] if x.requires_grad else []
            needs += [name for name, p in self.named_parameters() if p.requires_grad]
            if needs:
                raise UnsupportedError(f"{', '.join(needs)}: FlyMoE is inference-only (fused_moe has no backward "
                                       f"yet) and these require grad; run under torch.no_grad() / "
                                       f"torch.inference_mode(), or call .prepack() to freeze the "
                                       f"parameters")  # fmt: skip

    def route(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router logits of tokens ``x2`` ``[T, H]`` (fp32) and their top-k: ``(weights fp32 [T, k],
        ids int32 [T, k])``."""
        logits = F.linear(x2.float(), self.router.weight.float())
        bias = self.e_score_correction_bias
        if (self.scoring == "softmax" and self.num_expert_group is None and bias is None
                and self.routed_scaling_factor == 1.0):  # fmt: skip
            return topk_softmax(logits, self.top_k, renormalize=self.renormalize)
        return grouped_topk(
            logits,
            self.top_k,
            self.num_expert_group or 1,
            self.topk_group or 1,
            correction_bias=bias,
            scoring=self.scoring,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., H]`` bf16 / fp16 (the experts' dtype) -> ``[..., H]`` in x's dtype."""
        self._check_input(x)
        x2 = x.reshape(-1, self.hidden_size)
        if x2.shape[0] == 0:
            return torch.empty_like(x)
        weights, ids = self.route(x2)
        return fused_moe(x2, self.w1, self.w2, weights, ids, activation=self.activation).reshape(x.shape)

    def extra_repr(self) -> str:
        s = (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
             f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation!r}, "
             f"scoring={self.scoring!r}, renormalize={self.renormalize}")  # fmt: skip
        if self.num_expert_group is not None:
            s += f", num_expert_group={self.num_expert_group}, topk_group={self.topk_group}"
        if self.routed_scaling_factor != 1.0:
            s += f", routed_scaling_factor={self.routed_scaling_factor}"
        if self.e_score_correction_bias is not None:
            s += ", correction_bias=True"
        if self.prepacked:
            s += ", prepacked=True"
        return s
