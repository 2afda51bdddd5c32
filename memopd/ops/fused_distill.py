"""Fused linear distillation (reverse KL / forward KL / JSD of a student against a frozen
teacher, plus the student's log-prob and entropy) and its teacher-less mode (log-prob +
entropy alone, per token or with a declared weighted loss), from last hidden states and
lm_head weights, never materialising [N, V].

This module holds the public functions, the `torch.library` custom ops
(`memopd::fused_distill_fwd` / `memopd::fused_distill_bwd`) with their autograd glue,
and the finalisation of the Triton kernels' statistics. The PyTorch implementation is
`memopd.ops.distill_torch`, the kernels `memopd.kernels.fused_distill` (and, for the
gradients taken in the forward, `memopd.kernels.distill_rows`), the argument
checks `memopd.ops._validate`, the float64 references `memopd.ops.reference_distill`
(re-exported here). Contract, algorithm and back ends: docs/design.md §6.2; ZeRO-3 /
FSDP: docs/deepspeed.md §4.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional, Union

import torch
from torch import Tensor

from ..kernels.contract import (
    DistillParams,
    DistillStat,
    Divergence,
    LinearHead,
    Partial,
)
from . import _held_grads as held_grads
from ._validate import (
    check_target_range,
    check_weights_finite,
    choose_op_backend,
    chunk_args,
    keep_mask,
    reduce_loss,
    resolve_check_targets,
    token_weight,
    validate_distill,
    validate_student_only,
)
from .distill_torch import (
    compute_dtype,
    kl_from_sums,
    log1p_or_plain,
    stack_stats,
    student_outputs,
    token_weight_grads,
    torch_backward,
    torch_forward,
    torch_forward_with_grads,
)
from .reference_distill import reference_linear_distill, reference_linear_logprob_entropy, reference_linear_reverse_kl
from .results import DistillOutput, LogProbEntropy, LogProbEntropyLoss

__all__ = [
    "DistillOutput",
    "LogProbEntropy",
    "LogProbEntropyLoss",
    "fused_linear_distill",
    "fused_linear_logprob_entropy",
    "fused_linear_logprob_entropy_loss",
    "fused_linear_reverse_kl",
    "reference_linear_distill",
    "reference_linear_logprob_entropy",
    "reference_linear_reverse_kl",
]


def _kernels():
    from memopd.kernels import fused_distill as k  # lazy: importing memopd.ops never imports Triton

    return k


def _rows_kernels():
    from memopd.kernels import distill_rows as k  # lazy, as `_kernels`

    return k


def _heads(hs, ws, bs, ht, wt, bt) -> tuple[LinearHead, Optional[LinearHead]]:
    return LinearHead(hs, ws, bs), (None if ht is None else LinearHead(ht, wt, bt))


# ----------------------------------------------------------------------------------
# Triton path: kernel statistics, finalised like the PyTorch path
# ----------------------------------------------------------------------------------
def _triton_forward(student: LinearHead, teacher: Optional[LinearHead], targets: Tensor, keep: Tensor,
                    params: DistillParams):
    """(divergence, logprobs, entropy, stats) from the kernels' merged online statistics."""
    k = _kernels()
    part = k.distill_forward(student, teacher, targets, keep, params)
    m_s, z_s, a_s, s_y = (part[r] for r in (Partial.M_S, Partial.Z_S, Partial.A_S, Partial.S_Y))
    zero = torch.zeros((), device=student.hidden.device, dtype=torch.float32)
    log_zs, lse_s, ent, lp = student_outputs(m_s, z_s, a_s, s_y)
    if teacher is None:
        # teacher-less kernel: the teacher rows of `part` were never written
        zeros = torch.zeros_like(lse_s)
        stats = torch.where(keep, stack_stats(lse_s=lse_s, lse_t=zeros, dlse=zeros, aux=zeros, entropy=ent), zero)
        return zeros, torch.where(keep, lp, zero), torch.where(keep, ent, zero), stats
    m_t, z_t, e_d = (part[r] for r in (Partial.M_T, Partial.Z_T, Partial.E_D))
    lse_t = m_t + torch.log(z_t)
    dlse = log1p_or_plain(part[Partial.DZ_J] / part[Partial.ZT_J], lse_s - lse_t)
    if params.divergence != Divergence.JSD:
        aux = kl_from_sums(params.divergence, e_d, z_s, z_t, dlse)
        div = aux.clamp_min(0.0)
    else:
        kl = k.jsd_second_pass(student, teacher, keep, torch.stack([lse_s, lse_t, dlse]).contiguous(), params)
        aux = kl[0]
        div = (params.beta * kl[1] + (1.0 - params.beta) * kl[0]).clamp_min(0.0)
    # masked rows hold untouched sums (log 0 = -inf there): zero them, outputs and stats alike
    stats = torch.where(keep, stack_stats(lse_s=lse_s, lse_t=lse_t, dlse=dlse, aux=aux, entropy=ent), zero)
    return (torch.where(keep, div, zero), torch.where(keep, lp, zero), torch.where(keep, ent, zero),
            stats)


# ----------------------------------------------------------------------------------
# custom ops + autograd (flat tensor / scalar signatures: torch.library needs them)
# ----------------------------------------------------------------------------------
@torch.library.custom_op("memopd::fused_distill_fwd", mutates_args=())
def _fwd_op(hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Optional[Tensor],
            wt: Optional[Tensor], bt: Optional[Tensor], targets: Tensor, keep: Tensor,
            temperature: float, vocab_size: int, divergence: int, beta: float,
            chunk_size: int, token_chunk: int, backend: str,
            check_targets: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if check_targets:
        check_target_range(targets, keep, vocab_size)
    student, teacher = _heads(hs, ws, bs, ht, wt, bt)
    params = DistillParams(temperature, vocab_size, Divergence(divergence), beta, chunk_size, token_chunk)
    if backend == "triton":
        return _triton_forward(student, teacher, targets, keep, params)
    return torch_forward(student, teacher, targets, keep, params)


@_fwd_op.register_fake
def _fwd_fake(hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size, divergence, beta,
              chunk_size, token_chunk, backend, check_targets):
    N = hs.shape[0]
    cdt = compute_dtype(hs, ht)
    vec = hs.new_empty((N,), dtype=cdt)
    return vec, torch.empty_like(vec), torch.empty_like(vec), hs.new_empty((len(DistillStat), N), dtype=cdt)


@torch.library.custom_op("memopd::fused_distill_bwd", mutates_args=())
def _bwd_op(g_div: Optional[Tensor], g_lp: Optional[Tensor], g_ent: Optional[Tensor],
            hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Optional[Tensor],
            wt: Optional[Tensor], bt: Optional[Tensor], targets: Tensor, keep: Tensor,
            stats: Tensor, temperature: float, vocab_size: int, divergence: int, beta: float,
            need_dh: bool, need_dw: bool, need_db: bool, chunk_size: int, token_chunk: int,
            backend: str) -> tuple[Tensor, Tensor, Tensor]:
    cdt = stats.dtype
    if ht is None:
        # teacher-less: the wrapper drops the (zero) divergence output, but under
        # torch.compile its gradient may still arrive materialised as zeros: ignore it
        g_div = None
    grads = tuple(None if g is None else g.to(cdt).contiguous() for g in (g_div, g_lp, g_ent))
    student, teacher = _heads(hs, ws, bs, ht, wt, bt)
    params = DistillParams(temperature, vocab_size, Divergence(divergence), beta, chunk_size, token_chunk)
    need = (need_dh, need_dw, need_db)
    if backend == "triton":
        dh, dw, db = _kernels().distill_backward(grads, student, teacher, targets, keep, stats, params, need)
    else:
        dh, dw, db = torch_backward(grads, student, teacher, targets, keep, stats, params, need)
    # one fresh empty per absent gradient: outputs of a custom op may not alias each other
    return tuple(g if g is not None else hs.new_empty((0,)) for g in (dh, dw, db))


@_bwd_op.register_fake
def _bwd_fake(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats, temperature,
              vocab_size, divergence, beta, need_dh, need_dw, need_db, chunk_size, token_chunk,
              backend):
    return (torch.empty_like(hs) if need_dh else hs.new_empty((0,)),
            torch.empty_like(ws) if need_dw else hs.new_empty((0,)),
            torch.empty_like(bs) if (need_db and bs is not None) else hs.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    (hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size, divergence, beta,
     chunk_size, token_chunk, backend, _check) = inputs
    # Unused outputs give None grads: a backward for log-probs / entropy alone then
    # skips every teacher matmul.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hs, ws, bs, ht, wt, bt, targets, keep, output[3])
    ctx.scalars = (temperature, vocab_size, divergence, beta, chunk_size, token_chunk, backend)


def _check_heads_unchanged(hs, ws, ht, wt, vocab_size: int) -> None:
    """A recomputing backward needs the weights the forward saw: refuse re-partitioned ones."""
    for name, w, h in (("student", ws, hs), ("teacher", wt, ht)):
        if w is None:  # teacher-less op
            continue
        if w.dim() != 2 or w.shape[0] < vocab_size or w.shape[1] != h.shape[1]:
            raise RuntimeError(
                f"the {name} lm_head weight changed shape between forward and backward "
                f"(now {tuple(w.shape)}): a ZeRO-3/FSDP parameter was re-partitioned. Keep "
                f"it gathered until the backward has run (see docs/deepspeed.md §4)")


def _backward(ctx, g_div, g_lp, g_ent, _g_stats):
    hs, ws, bs, ht, wt, bt, targets, keep, stats = ctx.saved_tensors
    temperature, vocab_size, divergence, beta, chunk_size, token_chunk, backend = ctx.scalars
    _check_heads_unchanged(hs, ws, ht, wt, vocab_size)
    need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    need_db = bool(need_db and bs is not None)
    if not (need_dh or need_dw or need_db):
        return (None,) * 16
    dh, dw, db = _bwd_op(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats,
                         temperature, vocab_size, divergence, beta, need_dh, need_dw, need_db,
                         chunk_size, token_chunk, backend)
    return (dh if need_dh else None, dw if need_dw else None, db if need_db else None) + (None,) * 13


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------
# gradients in the forward (both back ends): the loss's gradients taken during the sweep
# ----------------------------------------------------------------------------------
def _loss_weights_on_device(keep: Tensor, mean: bool, dtype: torch.dtype) -> Tensor:
    """dL/d div per token of loss = Σ_kept div (/ n_kept when `mean`), as an [N] tensor
    made on the device (the count is never read back: no host sync)."""
    g = torch.ones(keep.shape[0], device=keep.device, dtype=dtype)
    return g.div_(keep.sum(dtype=dtype).clamp_min(1.0)) if mean else g


@torch.library.custom_op("memopd::fused_distill_fwd_grad", mutates_args=())
def _fwd_grad_op(hs: Tensor, ws: Tensor, bs: Optional[Tensor], need_dh: bool, need_dw: bool, need_db: bool,
                 ht: Optional[Tensor], wt: Optional[Tensor], bt: Optional[Tensor], targets: Tensor, keep: Tensor,
                 g_div: Optional[Tensor], g_lp: Optional[Tensor], g_ent: Optional[Tensor],
                 temperature: float, vocab_size: int, divergence: int, beta: float, chunk_size: int,
                 token_chunk: int, check_targets: bool, backend: str
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(divergence, logprobs, entropy, stats, dh, dw, db) of the loss given by per-token
    weights, L = Σ_kept g_div·div + g_lp·logprob + g_ent·entropy (each [N] in the compute
    dtype, or None; no teacher: g_div None); absent gradients are empty tensors.
    `backend` "triton" runs `memopd.kernels.distill_rows.distill_forward_with_grads`,
    "torch" the PyTorch sweep."""
    if check_targets:
        check_target_range(targets, keep, vocab_size)
    student, teacher = _heads(hs, ws, bs, ht, wt, bt)
    params = DistillParams(temperature, vocab_size, Divergence(divergence), beta, chunk_size, token_chunk)
    need = (need_dh, need_dw, need_db)
    weights = (g_div, g_lp, g_ent)
    if backend == "triton":
        div, lp, ent, stats, dh, dw, db = _rows_kernels().distill_forward_with_grads(
            weights, student, teacher, targets, keep, params, need)
    else:
        div, lp, ent, stats, dh, dw, db = torch_forward_with_grads(student, teacher, targets, keep, params,
                                                                   token_weight_grads(weights), need)
    # one fresh empty per absent gradient: a custom op's outputs may not alias each other
    # (a frozen lm_head, with no bias, has two of them)
    return (div, lp, ent, stats) + tuple(g if g is not None else hs.new_empty((0,)) for g in (dh, dw, db))


@_fwd_grad_op.register_fake
def _fwd_grad_fake(hs, ws, bs, need_dh, need_dw, need_db, ht, wt, bt, targets, keep, g_div, g_lp, g_ent,
                   temperature, vocab_size, divergence, beta, chunk_size, token_chunk, check_targets, backend):
    div, lp, ent, stats = _fwd_fake(hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size, divergence,
                                    beta, chunk_size, token_chunk, "torch", check_targets)
    return (div, lp, ent, stats, torch.empty_like(hs) if need_dh else hs.new_empty((0,)),
            torch.empty_like(ws) if need_dw else hs.new_empty((0,)),
            torch.empty_like(bs) if (need_db and bs is not None) else hs.new_empty((0,)))


_WEIGHTED = "weighted"  # the `reduction` of `_DistillGradsInForward` for a loss given by per-token weights


def _declared_loss(div: Tensor, lp: Tensor, ent: Tensor, keep: Tensor, weights: tuple, reduction: str) -> Tensor:
    """The scalar loss whose gradients `_fwd_grad_op` takes: the distillation op's reduced
    divergence, or (`_WEIGHTED`) Σ_kept of the weighted per-token outputs (a weight at a
    masked token is never read, so it may be anything)."""
    if reduction != _WEIGHTED:
        return reduce_loss(div, keep, reduction)
    total = lp[:0].sum()  # 0, on the graph of `lp` even when every weight is the number 0
    for g, x in zip(weights, (div, lp, ent)):
        if g is not None:
            total = total + torch.where(keep, g * x, 0.0).sum()
    return total


class _DistillGradsInForward(torch.autograd.Function):
    """Autograd around `_fwd_grad_op`: the gradients of the declared loss (the reduced
    divergence, or the teacher-less weighted log-prob + entropy) were taken in the
    forward (held by `memopd.ops._held_grads`) and are only scaled here. Gradients that
    reach the per-token outputs (kl, logprobs, entropy) as well go through the
    recomputing backward and are added, so every output stays differentiable."""

    @staticmethod
    def forward(ctx, hs, ws, bs, need: tuple, ht, wt, bt, targets, keep, g_div, g_lp, g_ent, temperature,
                vocab_size, divergence, beta, chunk_size, token_chunk, reduction, check_targets, backend):
        div, lp, ent, stats, dh, dw, db = _fwd_grad_op(
            hs, ws, bs, *need, ht, wt, bt, targets, keep, g_div, g_lp, g_ent, temperature, vocab_size, divergence,
            beta, chunk_size, token_chunk, check_targets, backend)
        ctx.set_materialize_grads(False)
        ctx.need = need
        ctx.scalars = (temperature, vocab_size, divergence, beta, chunk_size, token_chunk, backend)
        ctx.op_name = ("fused_linear_logprob_entropy" if ht is None else "fused_linear_distill") + \
            "(gradients='forward')"
        held_grads.hold(ctx, (dh, dw, db), saved=(hs, ws, bs, ht, wt, bt, targets, keep, stats))
        return _declared_loss(div, lp, ent, keep, (g_div, g_lp, g_ent), reduction), div, lp, ent

    @staticmethod
    def backward(ctx, g_loss, g_div, g_lp, g_ent):
        grads, saved = held_grads.take(ctx, ctx.op_name)
        out = [held_grads.scaled(g_loss, g) if need else None for g, need in zip(grads, ctx.need)]
        del grads
        if g_div is not None or g_lp is not None or g_ent is not None:
            hs, ws, bs, ht, wt, bt, targets, keep, stats = saved
            temperature, vocab_size, divergence, beta, chunk_size, token_chunk, backend = ctx.scalars
            _check_heads_unchanged(hs, ws, ht, wt, vocab_size)
            more = _bwd_op(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats, temperature,
                           vocab_size, divergence, beta, *ctx.need, chunk_size, token_chunk, backend)
            out = [None if not need else (m if o is None else o + m) for o, m, need in zip(out, more, ctx.need)]
        return tuple(out) + (None,) * (_GRADS_IN_FORWARD_INPUTS - len(out))


# inputs of _DistillGradsInForward.forward after ctx: backward returns one entry per input
_GRADS_IN_FORWARD_INPUTS = len(inspect.signature(_DistillGradsInForward.forward).parameters) - 1


GRADIENT_MODES = ("auto", "forward", "recompute")


def _grads_needed(h: Tensor, w: Tensor, b: Optional[Tensor]) -> tuple[bool, bool, bool]:
    """(dh, dw, db) wanted by autograd from this call of a fused op."""
    on = torch.is_grad_enabled()
    return on and h.requires_grad, on and w.requires_grad, on and b is not None and b.requires_grad


def _gradient_mode(gradients: Optional[str], backend: str, reduction: str, need: tuple) -> str:
    """'forward' or 'recompute' for one call (`fused_linear_distill`'s `gradients`); the
    same rule on both back ends. "recompute" is only ever chosen explicitly or when
    there is no reduced loss / nothing to differentiate."""
    mode = "auto" if gradients is None else gradients
    if mode not in GRADIENT_MODES:
        raise ValueError(f"gradients must be one of {GRADIENT_MODES} (or None), got {gradients!r}")
    if mode == "auto":
        return "forward" if reduction != "none" and any(need) else "recompute"
    if mode == "forward" and reduction == "none":
        raise ValueError("gradients='forward' differentiates the reduced loss in the forward: it needs "
                         "reduction='mean' or 'sum', not 'none' (use gradients='recompute')")
    return mode


# ----------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------
def fused_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    *,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    token_chunk_size: Optional[int] = None,
    reduction: str = "mean",
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
    gradients: Optional[str] = None,
) -> DistillOutput:
    """Fused lm_head + divergence + student log-prob + entropy, without [N, V] logits.

    Args:
        student_hidden: [N, Hs] last hidden states of the student (requires grad as needed).
        student_weight: [V, Hs] student lm_head weight. student_bias: optional [V].
        teacher_hidden: [N, Ht], teacher_weight: [Vt, Ht], teacher_bias: optional [Vt];
            frozen (must not require grad).
        targets: [N] integer ids of the sampled tokens (ignored where masked).
        mask: optional [N] bool, True = token contributes. Targets equal to
            `ignore_index` are masked too (set ignore_index=None to disable).
        temperature: > 0, divides both student and teacher logits.
        vocab_size: true vocabulary (<= V and <= Vt); required when V != Vt.
        chunk_size: vocabulary columns per chunk of the PyTorch path (auto if None; an
            explicit value < vocab_size also makes the JSD forward walk chunks, in two
            matmul passes, instead of whole rows). The Triton kernels pick their own tiles.
        token_chunk_size: kept tokens per block (PyTorch path) / rows of the backward
            dlogits scratch (Triton path); auto if None.
        reduction: "mean" (over kept tokens), "sum" or "none" (loss = per-token kl).
        divergence: "reverse_kl" (KL(p_s‖p_t)), "forward_kl" (KL(p_t‖p_s)) or "jsd"
            (TRL/GKD generalised JSD with mixture β·p_t + (1-β)·p_s).
        beta: JSD β in [0, 1]; 0 → forward KL, 1 → reverse KL (as in TRL).
        backend: "auto" (default), "torch" or "triton": memopd.ops.dispatch, docs/design.md §6.2.
        check_targets: check 0 <= target < vocab_size on kept tokens. Default: on for
            CPU tensors, on for CUDA only with MEMOPD_DEBUG_CHECKS=1 (it syncs).
        gradients: when the gradients are taken. "forward": during the forward sweep, for
            `loss` (the backward only scales them; 4 lm-head-sized matmuls instead of 6,
            on both back ends; reduction "mean"/"sum"; the weight gradient is held from
            the forward on). "recompute": in the backward, which recomputes the logits:
            choose it for objectives built mostly from the per-token outputs (their
            gradients are recomputed either way), or when the weight gradient cannot be
            held from the forward to the backward: it is a whole [V, H] weight gradient per
            call (several calls alive before one backward; under ZeRO-3 / FSDP a full
            gradient of a head each rank otherwise keeps a shard of, held while the rest
            of the forward runs). None / "auto":
            "forward" where it applies and an input requires grad, else "recompute".
            Either way every output is differentiable (per-token outputs' gradients are
            recomputed).

    Returns:
        DistillOutput(loss, kl, logprobs, entropy); per-token tensors are fp32 [N].
    """
    temperature, vocab_size, beta = validate_distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, mask,
        student_bias, teacher_bias, temperature, vocab_size, reduction, divergence, beta)
    div_code = Divergence.from_name(divergence, beta)
    dev = student_hidden.device
    be = choose_op_backend("fused_linear_distill", backend, dev, student_hidden.dtype, teacher_hidden.dtype)
    check_targets = resolve_check_targets(check_targets, dev)
    chunk, token_chunk = chunk_args(chunk_size, token_chunk_size, student_hidden.shape[0], vocab_size)
    keep = keep_mask(targets, mask, ignore_index)
    hs = student_hidden.contiguous()
    ws = student_weight.contiguous()
    ht = teacher_hidden.contiguous()
    wt = teacher_weight.contiguous()
    bs = None if student_bias is None else student_bias.contiguous()
    bt = None if teacher_bias is None else teacher_bias.contiguous()
    need = _grads_needed(hs, ws, bs)
    if _gradient_mode(gradients, be, reduction, need) == "forward":
        keep = keep.contiguous()
        g_div = _loss_weights_on_device(keep, reduction == "mean", compute_dtype(hs, ht))
        loss, div, lp, ent = _DistillGradsInForward.apply(
            hs, ws, bs, need, ht, wt, bt, targets.contiguous(), keep, g_div, None, None, temperature, vocab_size,
            int(div_code), beta, chunk, token_chunk, reduction, check_targets, be)
        return DistillOutput(loss, div, lp, ent)
    div, lp, ent, _stats = _fwd_op(
        hs, ws, bs, ht, wt, bt, targets.contiguous(), keep.contiguous(), temperature, vocab_size,
        int(div_code), beta, chunk, token_chunk, be, check_targets)
    return DistillOutput(reduce_loss(div, keep, reduction), div, lp, ent)


def fused_linear_reverse_kl(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    *,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
    token_chunk_size: Optional[int] = None,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
    gradients: Optional[str] = None,
) -> DistillOutput:
    """Per-token reverse KL(p_student ‖ p_teacher), student log-probs and entropy, fused.

    `fused_linear_distill` with divergence="reverse_kl"; see it for the arguments.
    """
    return fused_linear_distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, mask=mask,
        temperature=temperature, student_bias=student_bias, teacher_bias=teacher_bias,
        vocab_size=vocab_size, chunk_size=chunk_size, token_chunk_size=token_chunk_size,
        reduction=reduction, divergence="reverse_kl", ignore_index=ignore_index,
        backend=backend, check_targets=check_targets, gradients=gradients)


def fused_linear_logprob_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    token_chunk_size: Optional[int] = None,
    check_targets: Optional[bool] = None,
    logprob_weight=None,
    entropy_weight=None,
    gradients: Optional[str] = None,
) -> Union[LogProbEntropy, LogProbEntropyLoss]:
    """Fused lm_head + log-prob of the target + entropy, no teacher, no [N, V] logits;
    with the loss declared (`logprob_weight=` / `entropy_weight=`), that loss too, its
    gradients taken in the forward.

    The teacher-less mode of `fused_linear_distill` (the same forward / backward with
    every teacher matmul and statistic removed), for PPO/GRPO actor losses and for
    scoring rollouts: with s = (hidden @ weight[:vocab_size]^T + bias) / T and
    p = softmax(s), per kept token i

        logprobs[i] = log p_{targets[i]},   entropy[i] = -Σ_v p_v log p_v,
        loss = Σ_kept (logprob_weight[i]·logprobs[i] + entropy_weight[i]·entropy[i]).

    A REINFORCE / GRPO-style `-Σ A·logprobs / n - c·Σ entropy / n` is
    `logprob_weight=-advantages / n, entropy_weight=-c / n`; fold any normalisation into
    the weights (the global token count for micro-batches and ranks). The PPO clipped
    surrogate is not linear in the log-probs: `fused_linear_actor_loss` takes it whole.

    Args:
        hidden: [N, H] last hidden states. weight: [V, H] lm_head weight, same dtype
            (fp32 / bf16 / fp16; float64 on the PyTorch path). bias: optional [V].
        targets: [N] integer ids of the sampled tokens (ignored where masked).
        mask: optional [N] bool, True = token is computed. Targets equal to
            `ignore_index` (default -100) are masked too; None disables that.
        temperature: > 0, divides the logits (the sampler's temperature).
        vocab_size: true vocabulary <= V (padded lm_head rows are excluded and get
            zero gradient); default V.
        chunk_size, token_chunk_size, backend: as in `fused_linear_distill`.
        check_targets: as in `fused_linear_distill`; also checks the loss weights.
        logprob_weight, entropy_weight: declare the loss (either one given; the other
            defaults to 0). Each a Python float (0 drops that term and its work) or an
            [N] floating tensor on the hidden states' device, constants of the loss: a
            tensor that requires grad is refused (pass it detached). Their entries at
            masked tokens are never read. A non-finite number is refused always, a
            non-finite tensor entry at a kept token where `check_targets` is on (eager
            calls: the check reads the tensor back, so a compiled graph skips it).
        gradients: with a declared loss, "forward" / "recompute" / None ("auto"), as in
            `fused_linear_distill`: "forward" (the default when an input requires grad)
            takes the loss's gradients in the forward sweep, 3 lm-head-sized matmuls
            (logits, dH, dW) against the 4 of a forward plus a recomputing backward, and
            holds the weight gradient from the forward on; "recompute" computes the
            outputs only and lets the backward recompute the logits (a ZeRO-3 / FSDP head
            gathered only for the forward: docs/deepspeed.md §4). Without a declared loss
            the backward always recomputes: "forward" is refused there.

    Returns:
        Without a declared loss, LogProbEntropy(logprobs, entropy): fp32 [N] (float64 for
        float64 inputs on the PyTorch path), 0 at masked tokens. Gradients reach hidden,
        weight and bias from both outputs (masked tokens get none), through a backward
        that recomputes the logits. Under `torch.no_grad()` (or with no input requiring
        grad) nothing is saved for a backward: memory is the inputs plus O(rows × chunk)
        working tiles.
        With a declared loss, LogProbEntropyLoss(loss, logprobs, entropy): the scalar
        loss (in the per-token outputs' dtype) and the same per-token outputs. All three
        are differentiable: gradients that reach the per-token outputs as well go
        through the recomputing backward and are added to the held ones (the cost of a
        "recompute" backward for them).
    """
    h, w, b, y, keep, scalars, be, check_targets = _student_only_call(
        "fused_linear_logprob_entropy", hidden, weight, bias, targets, mask, temperature, vocab_size, chunk_size,
        ignore_index, backend, token_chunk_size, check_targets)
    if logprob_weight is None and entropy_weight is None:
        if gradients == "forward":
            raise ValueError("gradients='forward' takes the gradients of a declared loss in the forward: pass "
                             "logprob_weight= and/or entropy_weight= (or use gradients='recompute')")
        _gradient_mode(gradients, be, "none", (False, False, False))  # the value's own check
        _div, lp, ent, _stats = _fwd_op(h, w, b, None, None, None, y, keep, *scalars, be, check_targets)
        return LogProbEntropy(lp, ent)
    N, dev, cdt = h.shape[0], h.device, compute_dtype(h)
    g_lp = token_weight(0.0 if logprob_weight is None else logprob_weight, "logprob_weight", N, dev, cdt)
    g_ent = token_weight(0.0 if entropy_weight is None else entropy_weight, "entropy_weight", N, dev, cdt)
    if check_targets and not torch.compiler.is_compiling():  # a host sync: eager only
        check_weights_finite({"logprob_weight": g_lp, "entropy_weight": g_ent}, keep)
    need = _grads_needed(h, w, b)
    if _gradient_mode(gradients, be, "sum", need) == "forward":
        loss, _div, lp, ent = _DistillGradsInForward.apply(h, w, b, need, None, None, None, y, keep, None, g_lp,
                                                           g_ent, *scalars, _WEIGHTED, check_targets, be)
    else:
        div, lp, ent, _stats = _fwd_op(h, w, b, None, None, None, y, keep, *scalars, be, check_targets)
        loss = _declared_loss(div, lp, ent, keep, (None, g_lp, g_ent), _WEIGHTED)
    return LogProbEntropyLoss(loss, lp, ent)


def _student_only_call(op: str, hidden, weight, bias, targets, mask, temperature, vocab_size, chunk_size,
                       ignore_index, backend, token_chunk_size, check_targets) -> tuple:
    """The checked, contiguous inputs of a teacher-less op call: (hidden, weight, bias,
    targets, keep, the `_fwd_op` scalars from temperature to token_chunk, backend,
    check_targets)."""
    temperature, vocab_size = validate_student_only(hidden, weight, bias, targets, mask, temperature, vocab_size)
    be = choose_op_backend(op, backend, hidden.device, hidden.dtype)
    check_targets = resolve_check_targets(check_targets, hidden.device)
    keep = keep_mask(targets, mask, ignore_index).contiguous()
    b = None if bias is None else bias.contiguous()
    chunk, token_chunk = chunk_args(chunk_size, token_chunk_size, hidden.shape[0], vocab_size)
    scalars = (temperature, vocab_size, int(Divergence.REVERSE_KL), 0.5, chunk, token_chunk)
    return hidden.contiguous(), weight.contiguous(), b, targets.contiguous(), keep, scalars, be, check_targets


def fused_linear_logprob_entropy_loss(hidden: Tensor, weight: Tensor, targets: Tensor, *, logprob_weight,
                                      entropy_weight, **kwargs) -> LogProbEntropyLoss:
    """Deprecated: `fused_linear_logprob_entropy` with `logprob_weight=` / `entropy_weight=`
    (the same call, the same result; this name warns)."""
    if not torch.compiler.is_compiling():  # Dynamo cannot trace warnings.warn (fullgraph would fail)
        warnings.warn("fused_linear_logprob_entropy_loss is deprecated: call fused_linear_logprob_entropy with "
                      "logprob_weight= and entropy_weight= (the same loss, on the same path)",
                      DeprecationWarning, stacklevel=2)
    return fused_linear_logprob_entropy(hidden, weight, targets, logprob_weight=logprob_weight,
                                        entropy_weight=entropy_weight, **kwargs)
