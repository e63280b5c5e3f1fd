"""fp32 / fp64 references of fly-attention's ops from plain torch ops, imported by tests and benchmarks.

The mask is built explicitly (bottom-right aligned causal and window), softcap applied before it, GQA by
``repeat_interleave`` of the KV heads; varlen loops over the sequences.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_mask", "flash_attn_ref", "flash_attn_varlen_ref", "flash_attn_fp8_ref"]


def attention_mask(
    seqlen_q: int, seqlen_k: int, causal: bool = False, window=(-1, -1), device=None, rows: range | None = None
) -> torch.Tensor:
    """``[seqlen_q, seqlen_k]`` bool, True where query row i sees key j (only the query rows of ``rows``
    when given: ``[len(rows), seqlen_k]``).

    The diagonal is aligned to the bottom-right corner (``off = seqlen_k - seqlen_q``): causal keeps
    ``j <= i + off``; a window ``(left, right)`` keeps ``i + off - left <= j <= i + off + right`` (-1: that
    side unbounded). Causal with a window is the window with ``right = 0`` (flash-attention 2's rule).
    """
    left, right = window
    if causal:
        right = 0
    rows = rows if rows is not None else range(seqlen_q)
    i = torch.arange(rows.start, rows.stop, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    off = seqlen_k - seqlen_q
    ok = torch.ones(len(rows), seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + off + right
    if left >= 0:
        ok &= j >= i + off - left
    return ok


# Scores held at once (elements): longer sequences are computed in blocks of query rows, so a 16K x 16K
# benchmark case is checked in ~1 GB instead of tens.
_CHUNK_SCORES = 1 << 28


def _attend(q, k, v, causal, softmax_scale, window, softcap, dtype):
    """One sequence: q ``[Sq, Hq, D]``, k ``[Sk, Hkv, D]``, v ``[Sk, Hkv, Dv]`` -> (out ``[Sq, Hq, Dv]``,
    lse ``[Hq, Sq]``) in ``dtype``."""
    sq, hq = q.shape[0], q.shape[1]
    step = max(1, _CHUNK_SCORES // max(1, hq * k.shape[0]))
    if sq <= step:
        return _attend_rows(q, k, v, causal, softmax_scale, window, softcap, dtype, range(sq), sq)
    parts = [_attend_rows(q[r0 : r0 + step], k, v, causal, softmax_scale, window, softcap, dtype,
                          range(r0, min(sq, r0 + step)), sq) for r0 in range(0, sq, step)]  # fmt: skip
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=1)


def _attend_rows(q, k, v, causal, softmax_scale, window, softcap, dtype, rows, seqlen_q):
    """Query rows ``rows`` (q holds just them) of a sequence of ``seqlen_q`` queries."""
    hq, d = q.shape[1], q.shape[2]
    sk, hkv = k.shape[0], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    if hq != hkv:  # GQA / MQA: query head h reads KV head h // (hq // hkv)
        kf = kf.repeat_interleave(hq // hkv, dim=1)
        vf = vf.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    ok = attention_mask(seqlen_q, sk, causal, window, device=q.device, rows=rows)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees no key
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out, lse


def flash_attn_ref(
    q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, dtype=torch.float32,
    return_lse=False,
):  # fmt: skip
    """Attention of ``[B, Sq, Hq, D]`` q against ``[B, Sk, Hkv, D]`` k / ``[B, Sk, Hkv, Dv]`` v in ``dtype``
    (fp32 or fp64): ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`` with ``return_lse``, else ``out``. Rows that see
    no key give 0 and lse -inf."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse = _attend(q[b], k[b], v[b], causal, softmax_scale, window, softcap, dtype)
        outs.append(o)
        lses.append(lse)
    out = torch.stack(outs) if outs else q.new_empty(0, q.shape[1], q.shape[2], v.shape[-1], dtype=dtype)
    if not return_lse:
        return out
    lse = torch.stack(lses) if lses else q.new_empty(0, q.shape[2], q.shape[1], dtype=dtype)
    return out, lse


def flash_attn_varlen_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
    dtype=torch.float32, return_lse=False,
):  # fmt: skip
    """Packed ``[total, H, D]`` sequences (``cu_seqlens`` ``[batch + 1]``), each attended on its own with the
    causal alignment of its own lengths: ``(out [total_q, Hq, Dv], lse [Hq, total_q])`` with ``return_lse``."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        o, s = _attend(q[q0:q1], k[k0:k1], v[k0:k1], causal, softmax_scale, window, softcap, dtype)
        out[q0:q1] = o
        lse[:, q0:q1] = s
    return (out, lse) if return_lse else out


def _dequantize(t, descale, dtype):
    """An fp8 tensor in ``dtype`` times its per-tensor descale (None: 1; a number or a one-element tensor)."""
    x = t.to(dtype)
    if descale is None:
        return x
    if isinstance(descale, torch.Tensor):
        return x * descale.to(device=x.device, dtype=dtype).reshape(())
    return x * descale


def flash_attn_fp8_ref(
    q, k, v, q_descale=None, k_descale=None, v_descale=None, *, causal=False, softmax_scale=None, window=(-1, -1),
    softcap=0.0, dtype=torch.float32, return_lse=False,
):  # fmt: skip
    """The fp8 forward's reference: :func:`flash_attn_ref` on the dequantized inputs (``q.float() *
    q_descale``, ...), in ``dtype``. The kernel's own rounding (P to e4m3 for ``P @ V``) is not modelled:
    it is what a test's tolerance bounds."""
    return flash_attn_ref(_dequantize(q, q_descale, dtype), _dequantize(k, k_descale, dtype),
                          _dequantize(v, v_descale, dtype), causal=causal, softmax_scale=softmax_scale, window=window,
                          softcap=softcap, dtype=dtype, return_lse=return_lse)  # fmt: skip
