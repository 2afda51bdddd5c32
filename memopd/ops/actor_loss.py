"""Fused PPO actor loss: clipped surrogate + entropy bonus + full-vocabulary reverse KL to
a frozen teacher, from last hidden states and lm_head weights, with the gradients
computed during the forward pass.

For every kept token i (s = student logits / T, t = teacher logits / T, over the first
`vocab_size` rows; p = softmax(s), q = softmax(t)):

    logprob_i = log p(y_i)                   ratio_i = exp(logprob_i - old_logprob_i)
    pg_i      = max(-A_i ratio_i, -A_i clip(ratio_i, 1 - eps_low, 1 + eps_high))
                (with dual_clip = c > 1: min(pg_i, -c A_i) where A_i < 0)
    H_i       = -Σ_v p_v log p_v             KL_i = Σ_v p_v (log p_v - log q_v)

    loss = [Σ_i pg_i - entropy_coef Σ_i H_i] / normalizer
           + teacher_kl_coef Σ_{i in kl_mask} KL_i / kl_normalizer

`normalizer` defaults to the number of kept tokens and `kl_normalizer` to the number
of kept tokens in `kl_mask`; pass the global counts (all micro-batches and ranks) to
make gradient accumulation and data parallelism equal one big batch.

Why it is fast: the loss is known in the forward, so each block of tokens is done in
one visit. The block's student and teacher logits [rows, vocab_size] are computed
(2 lm_head-sized matmuls in all), reduced to per-token statistics, turned into dL/ds in
place, and multiplied out into dH and dW (2 more): 4 lm_head-sized matmuls against the
6 of a forward + recomputing backward, and 3 without a teacher. The backward only scales
the stored gradients by the incoming scalar. Nothing of size [N, vocab] is ever held:
the largest temporaries are one block's [rows, vocab] logits per model (`token_chunk_size`
rows; by default sized from the batch and the vocabulary, docs/design.md §6.2).

With δ_v = log p_v - log q_v and g_pg = dpg/dlogprob, the gradient per token is

    dL/ds_v = g_pg (1[v = y] - p_v) - g_H p_v (log p_v + H) + g_kl p_v (δ_v - KL)

(g_H = -entropy_coef / normalizer, g_kl = teacher_kl_coef / kl_normalizer on kl_mask tokens),
and dL/dh = (dL/ds) W / T, dL/dW = (dL/ds)^T h / T, dL/db = Σ dL/ds / T. KL and δ use
a' = (s - max s) - (t - max t), where the teacher and student agree to float noise
when p ≈ q: KL = E_p[a'] - log1p(Σ_v q_v expm1(a'_v)), accurate (and >= 0) for close
distributions where the textbook E_p[log p] - E_p[log q] would cancel two O(10)
numbers. The PyTorch path is the distillation op's sweep (`memopd.ops.distill_torch`,
whose log-normaliser difference is exact and overflow-free at any a'); the Triton
kernels use the plain log-sum-exp difference where a' exceeds 30 (expm1 would overflow).

This module holds the public function, the `torch.library` custom op
(`memopd::fused_actor_loss`) and its autograd glue. Back ends, chosen by
`memopd.ops.dispatch` (docs/design.md §6.3): the PyTorch path
`memopd.ops.actor_loss_torch` (any device, float64 capable) and on CUDA the Triton
kernels of `memopd.kernels.actor_loss`. The argument checks are
`memopd.ops._validate.resolve_actor_loss`; `reference_actor_loss`
(`memopd.ops.reference_actor`, re-exported here) is the naive, materialising
float64-capable reference (tests, benchmarks).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from ..kernels.contract import ActorLossParams, ActorStat, LinearHead
from . import _held_grads as held_grads
from ._validate import (
    check_actor_inputs,
    check_target_range,
    choose_op_backend,
    chunk_args,
    resolve_actor_loss,
    resolve_check_targets,
    teacher_kl_weight,
)
from .actor_loss_torch import torch_actor_loss
from .reference_actor import reference_actor_loss
from .results import ActorLossOutput

__all__ = ["ActorLossOutput", "fused_linear_actor_loss", "reference_actor_loss"]


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("memopd::fused_actor_loss", mutates_args=())
def _actor_loss_op(hs: Tensor, ws: Tensor, bs: Optional[Tensor], need_dh: bool, need_dw: bool, need_db: bool,
                   ht: Optional[Tensor], wt: Optional[Tensor],
                   bt: Optional[Tensor], targets: Tensor, adv: Tensor, old_lp: Tensor, keep: Tensor,
                   kl_keep: Tensor, clip_low: float, clip_high: float, dual_clip: float, entropy_coef: float,
                   teacher_kl_coef: float, temperature: float, vocab_size: int, normalizer: float, kl_normalizer: float,
                   token_chunk: int, backend: str, check_targets: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, stats [5, N], dh, dw, db); absent gradients are empty tensors."""
    if check_targets:
        check_target_range(targets, keep, vocab_size)
        check_actor_inputs(adv, old_lp, keep, ht)
    params = ActorLossParams(clip_low, clip_high, None if dual_clip <= 0 else dual_clip, entropy_coef,
                             teacher_kl_coef, temperature, vocab_size, normalizer, kl_normalizer)
    student = LinearHead(hs, ws, bs)
    teacher = None if ht is None else LinearHead(ht, wt, bt)
    args = (student, teacher, targets, adv, old_lp, keep, kl_keep, params, (need_dh, need_dw, need_db), token_chunk)
    if backend == "triton":
        from memopd.kernels import actor_loss as k

        total, stats, dh, dw, db = k.actor_loss_forward(*args)
    else:
        total, stats, dh, dw, db = torch_actor_loss(*args)
    out_dtype = torch.float64 if hs.dtype == torch.float64 else torch.float32
    return (total.to(out_dtype), stats.to(out_dtype), dh if dh is not None else hs.new_empty(0),
            (dw.to(ws.dtype) if dw.dtype != ws.dtype else dw) if dw is not None else hs.new_empty(0),
            (db.to(bs.dtype) if db.dtype != bs.dtype else db) if db is not None else hs.new_empty(0))


@_actor_loss_op.register_fake
def _actor_loss_fake(hs, ws, bs, need_dh, need_dw, need_db, ht, wt, bt, targets, adv, old_lp, keep, kl_keep,
                     clip_low, clip_high, dual_clip, entropy_coef, teacher_kl_coef, temperature, vocab_size, normalizer,
                     kl_normalizer, token_chunk, backend, check_targets):
    dt = torch.float64 if hs.dtype == torch.float64 else torch.float32
    return (hs.new_empty((), dtype=dt), hs.new_empty((len(ActorStat), hs.shape[0]), dtype=dt),
            torch.empty_like(hs) if need_dh else hs.new_empty(0),
            torch.empty_like(ws) if need_dw else hs.new_empty(0),
            torch.empty_like(bs) if need_db else hs.new_empty(0))


class _ActorLoss(torch.autograd.Function):
    """Autograd around the custom op: its forward already computed the gradients
    (`memopd.ops._held_grads`), so the backward only scales them. Every input is named
    (the custom op's schema); only hs, ws and bs get gradients."""

    @staticmethod
    def forward(ctx, hs, ws, bs, need: tuple, ht, wt, bt, targets, adv, old_lp, keep, kl_keep, clip_low, clip_high,
                dual_clip, entropy_coef, teacher_kl_coef, temperature, vocab_size, normalizer, kl_normalizer,
                token_chunk, backend, check_targets):
        need_dh, need_dw, need_db = need
        loss, stats, dh, dw, db = _actor_loss_op(
            hs, ws, bs, need_dh, need_dw, need_db, ht, wt, bt, targets, adv, old_lp, keep, kl_keep, clip_low,
            clip_high, dual_clip, entropy_coef, teacher_kl_coef, temperature, vocab_size, normalizer, kl_normalizer,
            token_chunk, backend, check_targets)
        ctx.mark_non_differentiable(stats)
        ctx.need = need
        held_grads.hold(ctx, (dh, dw, db))
        return loss, stats

    @staticmethod
    def backward(ctx, g_loss, _g_stats):
        grads, _ = held_grads.take(ctx, "fused_linear_actor_loss")
        out = tuple(held_grads.scaled(g_loss, g) if need else None for g, need in zip(grads, ctx.need))
        del grads
        return out + (None,) * (_ACTOR_LOSS_INPUTS - len(out))


# inputs of _ActorLoss.forward after ctx: backward returns one gradient (or None) per input
_ACTOR_LOSS_INPUTS = len(inspect.signature(_ActorLoss.forward).parameters) - 1


# --------------------------------------------------------------------------- public op


def fused_linear_actor_loss(
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
    token_chunk_size: Optional[int] = None,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
    kl_coef: Optional[float] = None,
) -> ActorLossOutput:
    """The PPO actor loss of a batch of sampled tokens, fused over the vocabulary.

    Args:
        student_hidden [N, H], student_weight [V, H] (+ student_bias [V]): the policy's last
            hidden states at the prediction positions and its lm_head.
        targets [N] (int): the sampled ids. advantages [N], old_logprobs [N]: per token,
            old_logprobs at the same temperature and vocabulary as this op computes.
        teacher_hidden [N, Ht], teacher_weight [Vt, Ht] (+ teacher_bias): a frozen teacher
            (detached); without it the KL term and every teacher matmul are skipped.
        mask [N] (bool): tokens that enter the loss (default all). kl_mask [N]: tokens
            whose KL enters (default: mask); always intersected with mask.
        clip_eps (and clip_eps_high for an asymmetric range): ratio clipped to
            [1 - clip_eps, 1 + clip_eps_high]. dual_clip: c > 1 caps the loss of
            negative-advantage tokens at -c A (None: off).
        entropy_coef, teacher_kl_coef: the coefficients of -H and of KL(student || teacher)
            (`kl_coef=` is the deprecated old name of teacher_kl_coef). With a teacher,
            teacher_kl_coef is required (1.0 distils as the trainer's ppo.teacher_kl_coef default;
            0.0 only measures the KL); without one it is unused.
        temperature: divides both models' logits (the sampling temperature).
        vocab_size: rows of both heads that form the distributions (the tokenizer's size;
            required when the heads differ in rows); padded rows get zero gradient.
        normalizer, kl_normalizer: the denominators of the two means (defaults: the local
            kept-token counts). Pass global counts for micro-batches and ranks.
        token_chunk_size: tokens per block, a positive integer (clamped to N; default: sized
            from N, V and H; docs/design.md §6.2).
        check_targets: check the targets' range and the per-token inputs (finite
            advantages, old log-probs <= 0, finite teacher hidden states); default: on
            CPU always, on CUDA with MEMOPD_DEBUG_CHECKS=1 (the check syncs).
        backend: "auto" (Triton on CUDA, PyTorch elsewhere; env MEMOPD_BACKEND), "torch" or
            "triton" (memopd.ops.dispatch).

    Returns `ActorLossOutput`: `loss` (scalar, differentiable w.r.t. the student hidden
    states, weight and bias) and detached per-token `logprobs`, `entropy`, `kl`,
    `ratio`, `clipped`.
    """
    teacher_kl_coef = teacher_kl_weight(teacher_kl_coef, kl_coef, "fused_linear_actor_loss", teacher_hidden is not None)
    clip_high, temperature, V, keep, kl_keep, normalizer, kl_normalizer = resolve_actor_loss(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, targets,
        advantages, old_logprobs, mask, kl_mask, clip_eps, clip_eps_high, dual_clip, temperature, vocab_size,
        normalizer, kl_normalizer)
    _, token_chunk = chunk_args(None, token_chunk_size, student_hidden.shape[0], V)
    dev = student_hidden.device
    check_targets = resolve_check_targets(check_targets, dev)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and student_hidden.requires_grad, grad_on and student_weight.requires_grad,
            grad_on and student_bias is not None and student_bias.requires_grad)
    backend = choose_op_backend("fused_linear_actor_loss", backend, dev, student_hidden.dtype,
                                *(() if teacher_hidden is None else (teacher_hidden.dtype,)))
    loss, stats = _ActorLoss.apply(
        student_hidden, student_weight, student_bias, need, teacher_hidden, teacher_weight, teacher_bias,
        targets.contiguous(), advantages.detach().contiguous(), old_logprobs.detach().contiguous(), keep.contiguous(),
        kl_keep.contiguous(), float(clip_eps), clip_high, float(dual_clip or 0.0), float(entropy_coef),
        teacher_kl_coef, temperature, V, normalizer, kl_normalizer, token_chunk, backend,
        check_targets)
    stats = stats.detach()
    return ActorLossOutput(loss, stats[ActorStat.LOGPROB], stats[ActorStat.ENTROPY], stats[ActorStat.KL],
                           stats[ActorStat.RATIO], stats[ActorStat.CLIPPED] > 0.5)
