"""The reverse KL of a student against a served teacher that sent only its top-k
log-probs per token (ids + log-probs), from the student's last hidden states and lm_head,
with the student's log-probs normalised over the full vocabulary and never [N, V] logits.

The full-vocabulary log-sum-exp and its gradient come from the fused teacher-less op
(`fused_linear_logprob_entropy`, chunked over the vocabulary, its backward recomputing the
logits); this module adds the logits at the k served ids (`_SelectedLogits`, one GEMM per
block of rows against the union of their ids) and the argument checks of the top-k inputs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._validate import (
    OLD_LOGPROB_TOLERANCE,
    REDUCTIONS,
    check_target_dtype,
    check_tensor,
    reduce_loss,
    resolve_check_targets,
    validate_head,
    validate_one_device,
    validate_temperature,
)
from .distill_torch import compute_dtype
from .fused_distill import fused_linear_logprob_entropy

__all__ = ["fused_linear_topk_reverse_kl", "PAD_ID"]

PAD_ID = -100  # a top-k entry with this id is padding: it contributes nothing (a row of them is masked)
_BLOCK_ELEMS = 1 << 22  # [rows, union of their ids] logits of one block of `_SelectedLogits` (16 MiB fp32)


def _row_block(n_rows: int, k: int, V: int) -> int:
    """Rows per block of `_SelectedLogits`: rows × min(V, rows·k) (the most ids a block can
    hold) stays within `_BLOCK_ELEMS`."""
    r = int(math.isqrt(max(_BLOCK_ELEMS // max(k, 1), 1)))
    if r * k > V:
        r = _BLOCK_ELEMS // max(V, 1)
    return max(1, min(n_rows, r))


class _SelectedLogits(torch.autograd.Function):
    """s[i, j] = (h_i · W[ids[i, j]] + b[ids[i, j]]) / T in the compute dtype, [N, k].

    Per block of rows, the logits are computed against the union of the block's ids (one
    GEMM, [rows, U], U <= min(V, rows·k)) and gathered; the backward scatters the [N, k]
    gradient back onto that union and runs the two GEMMs dH and dW[union]. Only h, W, b and
    the ids are saved.
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, b: Optional[Tensor], ids: Tensor, inv_t: float, cdt: torch.dtype):
        N, k = ids.shape
        out = torch.empty((N, k), dtype=cdt, device=h.device)
        step = _row_block(N, k, w.shape[0])
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            uniq, inv = torch.unique(ids[r0:r1], return_inverse=True)
            s = _union_logits(h[r0:r1], w, b, uniq, inv_t, cdt)
            out[r0:r1] = s.gather(1, inv)
        ctx.save_for_backward(h, w, b, ids)
        ctx.inv_t, ctx.cdt, ctx.step = inv_t, cdt, step
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        h, w, b, ids = ctx.saved_tensors
        inv_t, cdt, step = ctx.inv_t, ctx.cdt, ctx.step
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if need_dh else None
        dw = torch.zeros(w.shape, dtype=cdt, device=w.device) if need_dw else None
        db = torch.zeros(w.shape[0], dtype=cdt, device=w.device) if (need_db and b is not None) else None
        g = g.to(cdt)
        for r0 in range(0, ids.shape[0], step):
            r1 = min(ids.shape[0], r0 + step)
            uniq, inv = torch.unique(ids[r0:r1], return_inverse=True)
            ds = torch.zeros((r1 - r0, uniq.shape[0]), dtype=cdt, device=g.device).scatter_add_(1, inv, g[r0:r1])
            ds.mul_(inv_t)
            if dh is not None:
                dh[r0:r1] = (ds @ w[uniq].to(cdt)).to(h.dtype)
            if dw is not None:
                dw.index_add_(0, uniq, ds.t() @ h[r0:r1].to(cdt))
            if db is not None:
                db.index_add_(0, uniq, ds.sum(0))
        return (dh, None if dw is None else dw.to(w.dtype), None if db is None else db.to(b.dtype),
                None, None, None)


def _union_logits(h: Tensor, w: Tensor, b: Optional[Tensor], uniq: Tensor, inv_t: float,
                  cdt: torch.dtype) -> Tensor:
    """[rows, U] logits / T of the rows `h` against the lm_head rows `uniq`, in `cdt`."""
    s = (h.to(cdt) * inv_t) @ w[uniq].to(cdt).t()
    return s if b is None else s.add_(b[uniq].to(cdt) * inv_t)


def _validate(hs, ws, bs, ids, lt, temperature, reduction):
    """Checks of `fused_linear_topk_reverse_kl`: (temperature, kept entries [N, k], kept
    rows [N]). Shapes, dtypes and devices always; the values (ids in range, no repeated id
    in a row, log-probs finite and <= 0, a row's mass <= 1) on CPU, and on CUDA under
    MEMOPD_DEBUG_CHECKS=1 (they read the tensors back)."""
    validate_head(hs, ws, bs, ("student_hidden", "student_weight", "student_bias"))
    check_tensor(ids, "topk_ids", 2)
    check_tensor(lt, "topk_logprobs", 2)
    N, V = hs.shape[0], ws.shape[0]
    if ids.shape[0] != N:
        raise ValueError(f"topk_ids has {ids.shape[0]} rows, student_hidden has N={N}")
    if lt.shape != ids.shape:
        raise ValueError(f"topk_logprobs {tuple(lt.shape)} must have the shape of topk_ids {tuple(ids.shape)}")
    k = ids.shape[1]
    if not 1 <= k <= V:
        raise ValueError(f"topk_ids has k={k} entries a row: k must be in [1, V={V}]")
    check_target_dtype(ids, "topk_ids")
    if not lt.is_floating_point():
        raise TypeError(f"topk_logprobs must be a floating tensor of log-probabilities, got {lt.dtype}")
    if lt.requires_grad:
        raise ValueError("the teacher is frozen but topk_logprobs requires grad: pass topk_logprobs.detach()")
    validate_one_device([hs, ws, bs, ids, lt])
    temperature = validate_temperature(temperature)
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    keep = ids.long() != PAD_ID
    if resolve_check_targets(None, hs.device):
        _check_values(ids.long(), lt, keep, V)
    return temperature, keep, keep.any(dim=1)


def _check_values(ids: Tensor, lt: Tensor, keep: Tensor, V: int) -> None:
    """The top-k inputs that would give a silently wrong loss, each named with its first row."""
    def first_row(bad: Tensor) -> int:
        return int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0])

    bad = keep & ((ids < 0) | (ids >= V))
    if bool(bad.any()):
        raise ValueError(f"topk_ids out of range [0, {V}) (and not the padding id {PAD_ID}): "
                         f"{ids[bad][:5].tolist()} ..., first in row {first_row(bad)}")
    srt = ids.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != PAD_ID)
    if bool(dup.any()):
        row = first_row(dup)
        raise ValueError(f"topk_ids repeats id {int(srt[row, 1:][dup[row]][0])} in row {row}: each row must list "
                         f"distinct ids (a repeated id would count twice)")
    lt = lt.double()
    bad = keep & ~torch.isfinite(lt)
    if bool(bad.any()):
        raise ValueError(f"topk_logprobs holds {int(bad.sum())} non-finite values (NaN or inf) at served ids, first "
                         f"in row {first_row(bad)}: give a floor such as -1e4 for an id of probability 0, or pad "
                         f"the entry with id {PAD_ID}")
    bad = keep & (lt > OLD_LOGPROB_TOLERANCE)
    if bool(bad.any()):
        raise ValueError(f"topk_logprobs holds {int(bad.sum())} values > 0, first {float(lt[bad][0]):.4g} in row "
                         f"{first_row(bad)}: pass log-probabilities, not probabilities or logits")
    mass = torch.where(keep, lt, -math.inf).logsumexp(dim=1)
    bad = mass > math.log1p(OLD_LOGPROB_TOLERANCE)
    if bool(bad.any()):
        row = first_row(bad)
        raise ValueError(f"topk_logprobs of row {row} hold probability {math.exp(float(mass[row])):.6g} > 1 in all: "
                         f"they must be the teacher's log-probabilities over the full vocabulary")


def fused_linear_topk_reverse_kl(
    student_hidden: Tensor,
    student_weight: Tensor,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    *,
    student_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    reduction: str = "mean",
) -> Tensor:
    """Reverse KL of the student against a teacher known only by its top-k log-probs.

    Definition, per token i with served support S_i = {topk_ids[i, j]} (the teacher's k
    most likely ids, as a vLLM / SGLang teacher server returns them):

        kl_i = Σ_{v ∈ S_i} p_s(v) · (log p_s(v) - log q(v))

    - log p_s is the student's log-softmax over the **full** vocabulary of the logits
      (student_hidden @ student_weight^T + student_bias) / temperature, computed chunked
      over V (the fused teacher-less op's log-sum-exp): not renormalised over S_i.
    - log q(v) = topk_logprobs[i, j] is taken as served: the teacher's full-vocabulary
      log-probability (its sampler's temperature already applied by the server), not
      renormalised over S_i either.
    - The tail, every id outside S_i, contributes nothing, for student and teacher alike:
      no tail bucket, no renormalisation. The sum is therefore not a divergence (it can
      be negative) and it is returned unclamped.

    This is the support and normalisation convention of verl 0.9.1's top-k distillation
    loss (`forward_kl_topk`, the only top-k loss verl has: the teacher's top-k ids, both
    sides' full-vocabulary log-probs gathered there, the tail dropped), with the
    direction reversed, the student's probability weighting the log-ratio instead of the
    teacher's, so that it approximates the full-vocabulary reverse KL that
    `fused_linear_reverse_kl` computes exactly. Not applied, unlike verl's defaults: its
    floor on both log-probs (log_prob_min_clamp = -10) and its clamp of the per-token loss
    to [0, loss_max_clamp = 10]. TRL's top-k self-distillation modes (SDFT / SDPO with a
    teacher server) use the same served support but renormalise both distributions over
    it (or append one tail bucket holding 1 - mass); that is a different quantity.

    Gradient w.r.t. the student's logits s (per token, with a_v = p_s(v)(log p_s(v) -
    log q(v) + 1) on S and A = Σ_S a_v): dkl/ds_u = a_u·[u ∈ S] - p_s(u)·A, dense over the
    vocabulary through the log-sum-exp.

    Args:
        student_hidden: [N, H] last hidden states (fp32 / bf16 / fp16, float64 on CPU).
        student_weight: [V, H] lm_head weight, same dtype. student_bias: optional [V].
        topk_ids: [N, k] int64 (or int32) ids, 1 <= k <= V, distinct within a row. An
            entry equal to -100 (`PAD_ID`) is padding and contributes nothing; a row of
            padding only is a masked token (0 in "none", left out of the "mean").
        topk_logprobs: [N, k] floating, the teacher's log-probs at those ids (constants:
            requiring grad is refused), each <= 0 and finite, a row's total probability <= 1.
        temperature: > 0, divides the student's logits only.
        reduction: "mean" over rows with at least one served id, "sum", or "none" ([N]).

    Returns:
        The loss (a scalar, or [N] for "none"), fp32 (float64 for float64 inputs), with
        gradients to student_hidden, student_weight and student_bias.

    Checks: shapes, dtypes and devices always; the values (ids in range, no repeated id
    in a row, finite log-probs <= 0 whose row mass is <= 1, each to 1e-3) on CPU, and on
    CUDA with MEMOPD_DEBUG_CHECKS=1 (they read the tensors back).
    """
    temperature, keep, keep_row = _validate(student_hidden, student_weight, student_bias, topk_ids, topk_logprobs,
                                            temperature, reduction)
    cdt = compute_dtype(student_hidden)
    ids = torch.where(keep, topk_ids.long(), 0)
    # the anchor: each row's first served id, whose full-vocabulary log-prob (chunked over V,
    # differentiable) gives the row's log-sum-exp as s_anchor - logprob_anchor
    first = keep.to(torch.int8).argmax(dim=1, keepdim=True)
    anchor = ids.gather(1, first).squeeze(1)
    lp_anchor = fused_linear_logprob_entropy(student_hidden, student_weight, anchor, bias=student_bias,
                                             mask=keep_row, temperature=temperature, ignore_index=None).logprobs
    s = _SelectedLogits.apply(student_hidden.contiguous(), student_weight, student_bias, ids, 1.0 / temperature, cdt)
    log_p = lp_anchor.to(cdt)[:, None] + (s - s.gather(1, first))  # log p_s at the served ids
    log_q = torch.where(keep, topk_logprobs.to(cdt), 0.0)
    kl = torch.where(keep, log_p.exp() * (log_p - log_q), 0.0).sum(dim=1)
    kl = torch.where(keep_row, kl, 0.0)
    return reduce_loss(kl, keep_row, reduction)
