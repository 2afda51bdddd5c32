"""Naive references of the fused distillation ops: full [N, V] logits, log_softmax and
plain autograd, float64-capable. Tests and benchmarks compare the fused ops against
these; they take the same arguments and validate them the same way.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.contract import Divergence
from ._validate import keep_mask, reduce_loss, validate_distill, validate_student_only
from .results import DistillOutput, LogProbEntropy

__all__ = ["reference_linear_distill", "reference_linear_logprob_entropy",
           "reference_linear_reverse_kl"]


def reference_linear_distill(
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
    compute_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
) -> DistillOutput:
    """Naive reference: full [N, V] logits in `compute_dtype`, plain autograd.

    `compute_dtype` defaults to float64 if any input is float64, else float32. Per-token
    outputs are returned in `compute_dtype`. The JSD is TRL's formula verbatim (β = 0 /
    1 special-cased to the KLs). `chunk_size`, `token_chunk_size`, `backend` and
    `check_targets` are accepted for signature compatibility and ignored.
    """
    temperature, vocab_size, beta = validate_distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, mask,
        student_bias, teacher_bias, temperature, vocab_size, reduction, divergence, beta)
    if compute_dtype is None:
        any64 = any(x is not None and x.dtype == torch.float64 for x in
                    (student_hidden, student_weight, teacher_hidden, teacher_weight))
        compute_dtype = torch.float64 if any64 else torch.float32
    cd = compute_dtype
    V = vocab_size
    ls = _reference_log_softmax(student_hidden, student_weight, student_bias, V, temperature, cd)
    lt = _reference_log_softmax(teacher_hidden, teacher_weight, teacher_bias, V, temperature, cd)
    p = ls.exp()
    code = Divergence.from_name(divergence, beta)
    if code == Divergence.REVERSE_KL:
        div = (p * (ls - lt)).sum(-1)
    elif code == Divergence.FORWARD_KL:
        div = (lt.exp() * (lt - ls)).sum(-1)
    else:
        bt_ = torch.tensor(beta, dtype=cd, device=ls.device)
        lm = torch.logsumexp(torch.stack([ls + torch.log1p(-bt_), lt + torch.log(bt_)]), dim=0)
        kl_t = torch.nn.functional.kl_div(lm, lt, reduction="none", log_target=True).sum(-1)
        kl_s = torch.nn.functional.kl_div(lm, ls, reduction="none", log_target=True).sum(-1)
        div = beta * kl_t + (1.0 - beta) * kl_s
    keep = keep_mask(targets, mask, ignore_index)
    lp, ent = _reference_lp_ent(ls, targets, keep)
    div = torch.where(keep, div, torch.zeros((), dtype=cd, device=ls.device))
    return DistillOutput(reduce_loss(div, keep, reduction), div, lp, ent)


def _reference_log_softmax(h, w, b, V, temperature, cd):
    """Naive [N, V] log-softmax of (h @ w[:V]^T + b[:V]) / T in dtype `cd`."""
    s = h.to(cd) @ w[:V].to(cd).t()
    if b is not None:
        s = s + b[:V].to(cd)
    return torch.log_softmax(s / temperature, dim=-1)


def _reference_lp_ent(ls, targets, keep):
    """Log-prob of the targets and entropy from [N, V] log-probs, zero where not kept."""
    V = ls.shape[1]
    ent = -(ls.exp() * ls).sum(-1)
    lp = ls.gather(1, targets.long().clamp(0, V - 1)[:, None])[:, 0]
    zero = torch.zeros((), dtype=ls.dtype, device=ls.device)
    return torch.where(keep, lp, zero), torch.where(keep, ent, zero)


def reference_linear_logprob_entropy(
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
    compute_dtype: Optional[torch.dtype] = None,
) -> LogProbEntropy:
    """Naive reference of `fused_linear_logprob_entropy`: [N, V] log_softmax + gather.

    `compute_dtype` defaults to float64 for float64 inputs, else float32; outputs are
    in it. `chunk_size`, `token_chunk_size`, `backend` and `check_targets` are accepted
    for signature compatibility and ignored.
    """
    temperature, vocab_size = validate_student_only(hidden, weight, bias, targets, mask,
                                                     temperature, vocab_size)
    if compute_dtype is None:
        compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    ls = _reference_log_softmax(hidden, weight, bias, vocab_size, temperature, compute_dtype)
    lp, ent = _reference_lp_ent(ls, targets, keep_mask(targets, mask, ignore_index))
    return LogProbEntropy(lp, ent)


def reference_linear_reverse_kl(student_hidden: Tensor, student_weight: Tensor,
                                teacher_hidden: Tensor, teacher_weight: Tensor, targets: Tensor,
                                **kwargs) -> DistillOutput:
    """Naive reverse-KL reference (see `reference_linear_distill`)."""
    kwargs.pop("divergence", None)
    return reference_linear_distill(student_hidden, student_weight, teacher_hidden,
                                    teacher_weight, targets, divergence="reverse_kl", **kwargs)
