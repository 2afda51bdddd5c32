"""Argument checks and argument normalisation shared by the fused ops (distillation,
log-prob + entropy, actor loss) and their references: tensor shapes, dtypes and devices,
the temperature, the kept-token mask, the loss reduction, the target-range check, the
finiteness of hidden states and heads under MEMOPD_DEBUG_CHECKS=1, and the backend choice
(memopd.ops.dispatch) for these ops.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from ._protocol import DIVERGENCE_NAMES
from .dispatch import choose_backend

REDUCTIONS = ("mean", "sum", "none")


def check_tensor(x, name, ndim):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def validate_head(h, w, b, names):
    """One lm_head: hidden [N, H], weight [V, H], optional bias [V], one floating dtype."""
    hname, wname, bname = names
    check_tensor(h, hname, 2)
    check_tensor(w, wname, 2)
    if w.shape[1] != h.shape[1]:
        raise ValueError(f"{wname} must be [V, {h.shape[1]}] to match {hname} "
                         f"{tuple(h.shape)}, got {tuple(w.shape)}")
    for name, x in ((hname, h), (wname, w)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if h.dtype != w.dtype:
        raise TypeError(f"dtype mismatch: {hname} is {h.dtype}, {wname} is {w.dtype}")
    if b is not None:
        check_tensor(b, bname, 1)
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"{bname} must have {w.shape[0]} entries, got {b.shape[0]}")
        if b.dtype != w.dtype:
            raise TypeError(f"dtype mismatch: {bname} is {b.dtype}, its weight is {w.dtype}")
    if debug_checks():
        for name, x in ((hname, h), (wname, w), (bname, b)):
            check_finite(x, name)


def debug_checks() -> bool:
    """MEMOPD_DEBUG_CHECKS=1: the checks that cost a pass over the inputs and a host sync."""
    return os.environ.get("MEMOPD_DEBUG_CHECKS") == "1"


def check_finite(x: Optional[Tensor], name: str) -> None:
    """A NaN or inf in a hidden state or head would make every output NaN without a word:
    name the tensor and the first bad row instead."""
    if x is None:
        return
    bad = ~torch.isfinite(x.detach())
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() > 1 else bad
        first = int(rows.nonzero()[0, 0])
        raise ValueError(f"{name} holds {int(bad.sum())} non-finite values (NaN or inf), first in row {first}: "
                         "the outputs would be NaN (found by MEMOPD_DEBUG_CHECKS=1)")


def validate_tokens(N, targets, mask):
    check_tensor(targets, "targets", 1)
    if mask is not None:
        check_tensor(mask, "mask", 1)
    if targets.shape[0] != N:
        raise ValueError(f"targets has {targets.shape[0]} entries, expected N={N}")
    if mask is not None and mask.shape[0] != N:
        raise ValueError(f"mask has {mask.shape[0]} entries, expected N={N}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(f"mask must be bool (or integer 0/1), got {mask.dtype}")


def validate_one_device(tensors):
    devices = {x.device for x in tensors if x is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def validate_temperature(temperature) -> float:
    if isinstance(temperature, Tensor):
        raise TypeError("temperature must be a Python float, not a tensor")
    temperature = float(temperature)
    if not (temperature > 0.0) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


_STUDENT_NAMES = ("student_hidden", "student_weight", "student_bias")
_TEACHER_NAMES = ("teacher_hidden", "teacher_weight", "teacher_bias")
_HEAD_NAMES = ("hidden", "weight", "bias")  # fused_linear_logprob_entropy's arguments


def validate_distill(hs, ws, ht, wt, targets, mask, bs, bt, temperature, vocab_size, reduction,
              divergence, beta):
    check_tensor(hs, "student_hidden", 2)
    check_tensor(ws, "student_weight", 2)
    check_tensor(ht, "teacher_hidden", 2)
    check_tensor(wt, "teacher_weight", 2)
    validate_head(hs, ws, bs, _STUDENT_NAMES)
    validate_head(ht, wt, bt, _TEACHER_NAMES)
    N = hs.shape[0]
    V = ws.shape[0]
    Vt = wt.shape[0]
    if ht.shape[0] != N:
        raise ValueError(f"teacher_hidden has {ht.shape[0]} tokens, student_hidden has {N}")
    validate_tokens(N, targets, mask)
    validate_one_device([hs, ws, ht, wt, targets, mask, bs, bt])
    for name, x in zip(_TEACHER_NAMES, (ht, wt, bt)):
        if x is not None and x.requires_grad:
            raise ValueError(f"the teacher is frozen but {name} requires grad: pass it "
                             f"detached (x.detach()) or compute it under torch.no_grad()")
    temperature = validate_temperature(temperature)
    if vocab_size is None:
        if V != Vt:
            raise ValueError(f"student vocabulary ({V} rows) and teacher vocabulary ({Vt} rows) "
                             f"differ: pass vocab_size=<true vocabulary size> so padded rows "
                             f"are excluded")
        vocab_size = V
    vocab_size = int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > V or vocab_size > Vt:
        raise ValueError(f"vocab_size={vocab_size} exceeds the lm_head rows (student V={V}, "
                         f"teacher Vt={Vt})")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if divergence not in DIVERGENCE_NAMES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {DIVERGENCE_NAMES}")
    beta = float(beta)
    if not (0.0 <= beta <= 1.0):
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    return temperature, vocab_size, beta


def validate_student_only(h, w, b, targets, mask, temperature, vocab_size):
    """Validation of the teacher-less op (same rules and messages as `validate_distill`)."""
    validate_head(h, w, b, _HEAD_NAMES)
    validate_tokens(h.shape[0], targets, mask)
    validate_one_device([h, w, targets, mask, b])
    temperature = validate_temperature(temperature)
    V = w.shape[0]
    vocab_size = V if vocab_size is None else int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > V:
        raise ValueError(f"vocab_size={vocab_size} exceeds the lm_head rows (V={V})")
    return temperature, vocab_size


def check_target_range(targets: Tensor, keep: Tensor, vocab_size: int) -> None:
    kept = targets[keep]
    if kept.numel() and (bool((kept < 0).any()) or bool((kept >= vocab_size).any())):
        bad = kept[(kept < 0) | (kept >= vocab_size)][:5].tolist()
        raise ValueError(f"targets out of range [0, {vocab_size}) at kept tokens: {bad} ...")


def keep_mask(targets: Tensor, mask: Optional[Tensor], ignore_index: Optional[int]) -> Tensor:
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    if ignore_index is not None:
        keep = keep & (targets != ignore_index)
    return keep


def reduce_loss(div: Tensor, keep: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        # device-side count: no host sync; an all-masked batch gives 0 / 1 = 0
        return div.sum() / keep.sum().clamp_min(1).to(div.dtype)
    if reduction == "sum":
        return div.sum()
    return div


def choose_op_backend(op: str, backend: Optional[str], device: torch.device, *dtypes: torch.dtype) -> str:
    """`choose_backend` for the fused ops, whose Triton kernels take fp32/bf16/fp16 only."""
    refusal = "float64 inputs" if torch.float64 in dtypes else None
    return choose_backend(op, backend, device, triton_refusal=refusal)


def teacher_kl_weight(teacher_kl_coef: Optional[float], kl_coef: Optional[float], op: str) -> float:
    """The teacher-KL loss weight of `op` from its `teacher_kl_coef=` and the deprecated
    `kl_coef=` (its old name, kept so that existing callers run; it warns)."""
    if kl_coef is None:
        return 0.0 if teacher_kl_coef is None else float(teacher_kl_coef)
    if teacher_kl_coef is not None:
        raise TypeError(f"{op}: pass teacher_kl_coef= only; kl_coef= is its deprecated old name and both were given")
    if not torch.compiler.is_compiling():  # Dynamo cannot trace warnings.warn (fullgraph would fail)
        warnings.warn(f"{op}: kl_coef= is deprecated, use teacher_kl_coef= (the weight of the KL to the teacher)",
                      DeprecationWarning, stacklevel=3)
    return float(kl_coef)


def resolve_check_targets(check_targets: Optional[bool], device: torch.device) -> bool:
    """Default: check on CPU; on CUDA only with MEMOPD_DEBUG_CHECKS=1 (the check syncs)."""
    if check_targets is None:
        return device.type == "cpu" or debug_checks()
    return bool(check_targets)
