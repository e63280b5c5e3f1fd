"""fp32 references of the decode attention and the fused RoPE + cache write, in plain torch (a loop over
sequences, the keys gathered through the block table by indexing): what tests and benchmarks compare the
kernels against. Slow on purpose: nothing here shares code with the kernels.
"""

from __future__ import annotations

import math

import torch

from flydsl.testing import cpu_select

__all__ = ["paged_attention_decode_ref", "gather_kv_ref", "rope_ref", "fused_rope_cache_ref"]


def _scale_of(scale, heads_kv: int) -> torch.Tensor:
    """A scale (None, a number, a 1-element or per-head tensor) as fp32 ``[heads_kv, 1]`` on the CPU."""
    if scale is None:
        return torch.ones(heads_kv, 1)
    if isinstance(scale, torch.Tensor):
        s = scale.detach().float().cpu().reshape(-1)
        return (s.expand(heads_kv) if s.numel() == 1 else s).reshape(heads_kv, 1).clone()
    return torch.full((heads_kv, 1), float(scale))


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, seq_len: int) -> torch.Tensor:
    """Sequence ``b``'s first ``seq_len`` cache rows ``[seq_len, heads_kv, D]`` (fp32, CPU): through its block
    table row (``cache [num_blocks, page, Hkv, D]``) or, without one, the dense ``cache [B, S, Hkv, D]``."""
    if block_table is None:
        return cache[b, :seq_len].float().cpu()
    page = cache.shape[1]
    t = torch.arange(seq_len)
    blocks = block_table[b].cpu().long()[t // page]
    return cpu_select(cache, (blocks, t % page)).float()


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, *, softmax_scale=None, k_scale=None,
                               v_scale=None, window=-1, softcap=0.0):  # fmt: skip
    """The decode in fp32 on the CPU, as :func:`fly_attention.paged_attention_decode` defines it; returns
    fp32 shaped as q. fp8 caches are dequantized (``cache.float() * scale``) before anything else."""
    squeeze = q.dim() == 3
    q4 = (q.unsqueeze(1) if squeeze else q).float().cpu()
    batch, q_len, hq, d = q4.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    ks, vs = _scale_of(k_scale, hkv), _scale_of(v_scale, hkv)
    cap_len = block_tables.shape[1] * k_cache.shape[1] if block_tables is not None else k_cache.shape[1]
    out = torch.zeros(batch, q_len, hq, d)
    for b in range(batch):
        n = cap_len if seq_lens is None else min(max(int(seq_lens[b]), 0), cap_len)
        k = gather_kv_ref(k_cache, block_tables, b, n) * ks.unsqueeze(0)  # [n, Hkv, D]
        v = gather_kv_ref(v_cache, block_tables, b, n) * vs.unsqueeze(0)
        k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q4[b], k) * scale  # [Hq, q_len, n]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = n - q_len + torch.arange(q_len)  # the new tokens are the sequence's last q_len positions
        j = torch.arange(n)
        ok = j[None, :] <= pos[:, None]
        if window >= 0:
            ok &= j[None, :] >= (pos - window)[:, None]
        s = s.masked_fill(~ok, float("-inf"))
        seen = ok.any(dim=1)  # [q_len]
        p = torch.softmax(s, dim=-1).nan_to_num(0.0) * seen[None, :, None]
        out[b] = torch.einsum("hqk,khd->qhd", p, v)
    return out.squeeze(1) if squeeze else out


def rope_ref(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotary embedding in fp32 of ``x [T, H, D]`` at ``positions [T]``: the first ``rot = cos_sin_cache.shape[1]``
    dims rotate (``cos_sin_cache[p] = [cos(p * f_0..f_{rot/2-1}), sin(...)]``), the rest pass through. NeoX
    pairs dim ``i`` with ``i + rot/2``; GPT-J pairs ``2i`` with ``2i + 1``."""
    x = x.float().cpu()
    cs = cos_sin_cache.float().cpu()[positions.cpu().long()]  # [T, rot]
    rot = cs.shape[1]
    half = rot // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    out = x.clone()
    if is_neox:
        a, b = x[..., :half], x[..., half:rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:rot] = b * cos + a * sin
    else:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = a * cos - b * sin
        out[..., 1:rot:2] = b * cos + a * sin
    return out


def fused_rope_cache_ref(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, *, is_neox=True,
                         k_scale=None, v_scale=None):  # fmt: skip
    """The fused op's results in fp32 on the CPU: (rotated q, the caches after the write). The caches come
    back in their own dtype (fp8 caches hold ``value / scale`` rounded by torch's conversion, saturated to
    +-448), as new tensors; the inputs are not modified."""
    q_rot = rope_ref(q, cos_sin_cache, positions, is_neox)
    k_rot = rope_ref(k, cos_sin_cache, positions, is_neox)
    kc, vc = k_cache.cpu().clone(), v_cache.cpu().clone()
    hkv = k.shape[1]
    ks, vs = _scale_of(k_scale, hkv), _scale_of(v_scale, hkv)
    page = kc.shape[1]
    fp8 = kc.dtype == torch.float8_e4m3fn
    for t, slot in enumerate(slot_mapping.cpu().tolist()):
        if slot < 0:
            continue
        kt, vt = k_rot[t], v[t].float().cpu()
        if fp8:
            kt, vt = (kt / ks).clamp(-448, 448), (vt / vs).clamp(-448, 448)
        kc[slot // page, slot % page] = kt.to(kc.dtype)
        vc[slot // page, slot % page] = vt.to(vc.dtype)
    return q_rot, kc, vc
