"""Reference packed attention: plain PyTorch with a dense [T, T] mask from the metadata.

The oracle for every faster path (Triton kernel, per-segment SDPA). O(T^2) memory: use
it for tests and audits, not for training at scale.
"""
from __future__ import annotations

import math

import torch

from ..layout import AttentionMeta
from ._validate import check_attention_inputs

__all__ = ["reference_packed_attention", "dense_visibility_mask"]


def dense_visibility_mask(meta: AttentionMeta) -> torch.Tensor:
    """[T, T] bool: True where query i may attend to key j (docs/design.md §3.1)."""
    return meta.visible()


def reference_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over k/v [T, Hkv, D] under the packed visibility.

    Computed in float64 for float64 inputs and float32 otherwise; fully masked rows
    (padding) give zeros. Keys and values a row cannot see take no part in its output, even
    non-finite ones (a NaN in one trajectory's k or v never reaches another's rows).
    Differentiable.
    """
    check_attention_inputs(q, k, v, meta)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
    rep = Hq // Hkv
    kf = kf.repeat_interleave(rep, dim=1)
    vf = vf.repeat_interleave(rep, dim=1)
    scores = torch.einsum("ihd,jhd->hij", qf, kf) * scale
    vis = dense_visibility_mask(meta).unsqueeze(0)
    scores = scores.masked_fill(~vis, float("-inf"))
    any_vis = vis.any(-1, keepdim=True)
    # fully masked rows: softmax of all -inf is NaN; give them zeros instead
    scores = torch.where(any_vis, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * any_vis
    finite = torch.isfinite(vf)
    if bool(finite.all()):
        out = torch.einsum("hij,jhd->ihd", probs, vf)
    else:
        # masked keys must contribute exactly nothing, but a dense product would give them
        # 0 * NaN = NaN: multiply the finite values densely, then add the non-finite ones
        # (few keys) only where they are visible, so a NaN reaches exactly the rows that see it
        out = torch.einsum("hij,jhd->ihd", probs, torch.where(finite, vf, torch.zeros_like(vf)))
        bad = (~finite).flatten(1).any(1).nonzero().squeeze(1)  # keys holding a non-finite value
        vb = torch.where(finite[bad], torch.zeros_like(vf[bad]), vf[bad]).permute(1, 0, 2)  # [H, J, D]
        contrib = probs[:, :, bad].unsqueeze(-1) * vb.unsqueeze(1)  # [H, T, J, D]
        contrib = torch.where(vis[..., bad].unsqueeze(-1), contrib, torch.zeros_like(contrib))
        out = out + contrib.sum(2).transpose(0, 1)
    return out.to(q.dtype)
