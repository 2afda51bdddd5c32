"""The PyTorch path of the fused PPO actor loss (`memopd.ops.fused_linear_actor_loss`):
the distillation op's blocked sweep (`memopd.ops.distill_torch`, reverse KL or its
teacher-less mode) with the PPO surrogate and the entropy bonus folded into the per-token
gradient coefficients, so the gradients are taken during the forward. Any device, float64
capable; the math is in `memopd.ops.actor_loss` and docs/design.md §6.3.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.contract import ActorLossParams, ActorStat, DistillParams, Divergence, LinearHead
from .distill_torch import compute_dtype, torch_forward_with_grads

__all__ = ["policy_terms", "torch_actor_loss"]


def policy_terms(lp, old_lp, adv, clip_low, clip_high, dual_clip):
    """Per-token surrogate loss, ratio, clipped flag and d(loss)/d(logprob)."""
    ratio = torch.exp(lp - old_lp)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(l1, l2)
    grad = torch.where(l1 >= l2, l1, torch.zeros_like(l1))  # d(-A r)/dlp = -A r; the clip branch is flat
    clipped = l2 > l1
    if dual_clip is not None:
        cap = -dual_clip * adv
        capped = (adv < 0) & (pg > cap)
        pg = torch.where(capped, cap, pg)
        grad = torch.where(capped, torch.zeros_like(grad), grad)
        clipped = clipped | capped
    return pg, ratio, clipped, grad


def torch_actor_loss(student: LinearHead, teacher: Optional[LinearHead], targets, adv, old_lp, keep, kl_keep,
                      params: ActorLossParams, need_grad: tuple, token_chunk: int):
    """(loss, stats [len(ActorStat), N], dh | None, dw | None, db | None), gradients already
    taken (the Triton path `memopd.kernels.actor_loss.actor_loss_forward` returns the same).

    The sweep is the distillation op's (`distill_torch.torch_forward_with_grads`, reverse
    KL, or its teacher-less mode): per token block the logits are computed once, reduced
    to log-prob, entropy and KL, and the PPO terms of the block set the per-token
    gradient coefficients dL/dlogprob = g_pg, dL/dH = g_H, dL/dKL = g_kl.
    """
    N = student.hidden.shape[0]
    cdt = compute_dtype(student.hidden, None if teacher is None else teacher.hidden)
    f = dict(device=student.hidden.device, dtype=cdt)
    stats = torch.zeros(len(ActorStat), N, **f)
    stats[ActorStat.RATIO] = 1.0
    total = torch.zeros((), **f)
    g_h = -params.entropy_coef / params.normalizer
    kl_weight = params.teacher_kl_coef / params.kl_normalizer

    def block_grads(rows, kl, lp, ent, _st):
        nonlocal total
        pg, ratio, clipped, g_lp = policy_terms(lp, old_lp.index_select(0, rows).to(cdt),
                                                 adv.index_select(0, rows).to(cdt), params.clip_low,
                                                 params.clip_high, params.dual_clip)
        part = pg.sum() / params.normalizer + g_h * ent.sum()
        g_kl = None
        if teacher is not None:
            g_kl = kl_keep.index_select(0, rows).to(cdt) * kl_weight
            part = part + (g_kl * kl).sum()
        total += part
        stats[ActorStat.RATIO].index_copy_(0, rows, ratio)
        stats[ActorStat.CLIPPED].index_copy_(0, rows, clipped.to(cdt))
        return g_kl, g_lp / params.normalizer, (torch.full_like(ent, g_h) if g_h != 0.0 else None)

    dparams = DistillParams(params.temperature, params.vocab_size, Divergence.REVERSE_KL, 0.5, 0, token_chunk)
    kl, lp, ent, _, dh, dw, db = torch_forward_with_grads(student, teacher, targets, keep, dparams, block_grads,
                                                         need_grad)
    stats[ActorStat.LOGPROB] = lp
    stats[ActorStat.ENTROPY] = ent
    stats[ActorStat.KL] = kl
    return total, stats, dh, dw, db
