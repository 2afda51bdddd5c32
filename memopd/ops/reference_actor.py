"""The naive reference of the fused PPO actor loss: full [N, V] logits, log_softmax and
plain autograd, float64 capable (tests, benchmarks). Same arguments and checks as
`memopd.ops.fused_linear_actor_loss`, written independently of its blocked paths.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validate import resolve_actor_loss, teacher_kl_weight
from .results import ActorLossOutput

__all__ = ["reference_actor_loss"]


def reference_actor_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    targets: Tensor,
    advantages: Tensor,
    old_logprobs: Tensor,
    *,
    teacher_hidden: Optional[Tensor] = None,
    teacher_weight: Optional[Tensor] = None,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    kl_mask: Optional[Tensor] = None,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    entropy_coef: float = 0.0,
    teacher_kl_coef: Optional[float] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    normalizer: Optional[float] = None,
    kl_normalizer: Optional[float] = None,
    compute_dtype: Optional[torch.dtype] = None,
    kl_coef: Optional[float] = None,
) -> ActorLossOutput:
    """The same loss the naive way: full [N, V] logits, log_softmax, autograd (float64 with
    float64 inputs or `compute_dtype=torch.float64`); the arguments as in
    `fused_linear_actor_loss`."""
    teacher_kl_coef = teacher_kl_weight(teacher_kl_coef, kl_coef, "reference_actor_loss", teacher_hidden is not None)
    clip_high, temperature, V, keep, kl_keep, norm, kl_norm = resolve_actor_loss(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, targets,
        advantages, old_logprobs, mask, kl_mask, clip_eps, clip_eps_high, dual_clip, temperature, vocab_size,
        normalizer, kl_normalizer)
    cd = compute_dtype or (torch.float64 if student_hidden.dtype == torch.float64 else torch.float32)

    def logits(h, w, b):
        z = h.to(cd) @ w[:V].to(cd).T
        if b is not None:
            z = z + b[:V].to(cd)
        return z / temperature

    ls = torch.log_softmax(logits(student_hidden, student_weight, student_bias), -1)
    p = ls.exp()
    ent = -(p * ls).sum(-1)
    lp = ls.gather(1, targets.long().clamp(0, V - 1)[:, None])[:, 0]
    adv, old = advantages.to(cd), old_logprobs.to(cd)
    ratio = torch.exp(lp - old)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_high)
    pg = torch.maximum(l1, l2)
    clipped = l2 > l1
    if dual_clip is not None:
        cap = -dual_clip * adv
        capped = (adv < 0) & (pg > cap)
        pg = torch.where(capped, cap, pg)
        clipped = clipped | capped
    kf = keep.to(cd)
    loss = ((pg * kf).sum() - entropy_coef * (ent * kf).sum()) / norm
    kl = torch.zeros_like(ent)
    if teacher_hidden is not None:
        lt = torch.log_softmax(logits(teacher_hidden, teacher_weight, teacher_bias), -1)
        kl = (p * (ls - lt)).sum(-1)
        loss = loss + teacher_kl_coef * (kl * kl_keep.to(cd)).sum() / kl_norm
    z = torch.zeros_like(ent)
    return ActorLossOutput(loss, torch.where(keep, lp, z).detach(), torch.where(keep, ent, z).detach(),
                           torch.where(keep, kl, z).detach(), torch.where(keep, ratio, torch.ones_like(z)).detach(),
                           clipped & keep)
