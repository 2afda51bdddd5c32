"""Argument checks and argument normalisation of every op (distillation, log-prob +
entropy, actor loss, packed attention), shared by each op and its reference: tensor
shapes, dtypes and devices, the temperature, the kept-token mask, the loss reduction, the
target-range check, the finiteness of hidden states and heads under MEMOPD_DEBUG_CHECKS=1,
the per-token loss weights of the teacher-less loss, the deprecated `kl_coef=` alias, and the backend choice (memopd.ops.dispatch) of the
fused lm-head ops.
"""
from __future__ import annotations

import math
import numbers
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from ..kernels.contract import DIVERGENCE_NAMES
from ..layout import AttentionMeta
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
    check_target_dtype(targets)
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(f"mask must be bool (or integer 0/1), got {mask.dtype}")


# token ids: int64 (torch's index type) or int32. An 8-bit or unsigned tensor cannot hold a
# real vocabulary, and comparing it with ignore_index=-100 in its own dtype wraps -100 to
# another id (156 for uint8), which would silently drop that token
TARGET_DTYPES = (torch.int64, torch.int32)


def check_target_dtype(targets: Tensor, name: str = "targets") -> None:
    if targets.dtype not in TARGET_DTYPES:
        raise TypeError(f"{name} must be an int64 (or int32) tensor of token ids, got {targets.dtype}: "
                        f"pass {name}.long()")


def check_int_arg(value, name: str, *, minimum: int = 1, optional: bool = True) -> Optional[int]:
    """An integer argument of an op: a Python (or numpy) integer >= `minimum`, or None when
    `optional`. Booleans, floats (240.7 would become 240) and tensors are refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def chunk_args(chunk_size, token_chunk_size, n_tokens: int, vocab_size: int) -> tuple[int, int]:
    """(vocabulary chunk, token chunk) of an op call, 0 meaning "sized automatically":
    positive integers when given, clamped to the vocabulary and to the token count (a
    larger block holds nothing more, and would only size buffers for rows that do not exist)."""
    chunk = check_int_arg(chunk_size, "chunk_size")
    token_chunk = check_int_arg(token_chunk_size, "token_chunk_size")
    return (0 if chunk is None else min(chunk, max(vocab_size, 1)),
            0 if token_chunk is None else min(token_chunk, max(n_tokens, 1)))


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
    vocab_size = check_int_arg(vocab_size, "vocab_size")
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
    vocab_size = V if vocab_size is None else check_int_arg(vocab_size, "vocab_size")
    if vocab_size > V:
        raise ValueError(f"vocab_size={vocab_size} exceeds the lm_head rows (V={V})")
    return temperature, vocab_size


def validate_actor_loss(hs, ws, bs, ht, wt, bt, targets, adv, old_lp, mask, kl_mask, clip_low, clip_high, dual_clip,
                        temperature, vocab_size):
    """Checks of `fused_linear_actor_loss` / `reference_actor_loss`: (temperature, vocab_size)."""
    validate_head(hs, ws, bs, ("student_hidden", "student_weight", "student_bias"))
    N = hs.shape[0]
    if (ht is None) != (wt is None):
        raise ValueError("pass teacher_hidden and teacher_weight together (or neither: no KL term)")
    if bt is not None and ht is None:
        raise ValueError("teacher_bias given without a teacher")
    if ht is not None:
        validate_head(ht, wt, bt, ("teacher_hidden", "teacher_weight", "teacher_bias"))
        if ht.shape[0] != N:
            raise ValueError(f"teacher_hidden has {ht.shape[0]} tokens, student_hidden has {N}")
        for name, x in (("teacher_hidden", ht), ("teacher_weight", wt), ("teacher_bias", bt)):
            if x is not None and x.requires_grad:
                raise ValueError(f"the teacher is frozen but {name} requires grad: pass it detached")
    for name, x, kind in (("targets", targets, "int"), ("advantages", adv, "float"),
                          ("old_logprobs", old_lp, "float"), ("mask", mask, "bool"), ("kl_mask", kl_mask, "bool")):
        if x is None:
            continue
        if not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] != N:
            raise ValueError(f"{name} must be a 1-D tensor of N={N} entries, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if kind == "int":
            check_target_dtype(x, name)
        if kind == "float" and not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        if kind == "bool" and x.dtype.is_floating_point:
            raise TypeError(f"{name} must be bool (or integer 0/1), got {x.dtype}")
    validate_one_device([hs, ws, bs, ht, wt, bt, targets, adv, old_lp, mask, kl_mask])
    if not (0.0 <= clip_low < 1.0) or not (clip_high >= 0.0):
        raise ValueError(f"clip range must satisfy 0 <= clip_eps < 1 and clip_eps_high >= 0, got "
                         f"{clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None, got {dual_clip}")
    temperature = validate_temperature(temperature)
    rows = min(ws.shape[0], wt.shape[0]) if wt is not None else ws.shape[0]
    if vocab_size is None:
        if wt is not None and wt.shape[0] != ws.shape[0]:
            raise ValueError(f"student ({ws.shape[0]} rows) and teacher ({wt.shape[0]} rows) lm_heads differ: "
                             "pass vocab_size=<the tokenizer's size>")
        vocab_size = ws.shape[0]
    vocab_size = check_int_arg(vocab_size, "vocab_size")
    if not 1 <= vocab_size <= rows:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {rows}] (the lm_head rows)")
    return temperature, vocab_size


def resolve_actor_loss(hs, ws, bs, ht, wt, bt, targets, adv, old_lp, mask, kl_mask, clip_eps, clip_eps_high,
                       dual_clip, temperature, vocab_size, normalizer, kl_normalizer):
    """Validated arguments of the actor loss, shared by the op and its reference:
    (clip_high, temperature, V, keep, kl_keep, normalizer, kl_normalizer). The default
    normalisers are the local kept counts (one host sync on CUDA: pass the global counts
    instead)."""
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    temperature, V = validate_actor_loss(hs, ws, bs, ht, wt, bt, targets, adv, old_lp, mask, kl_mask,
                                         float(clip_eps), float(clip_high), dual_clip, temperature, vocab_size)
    keep = torch.ones(targets.shape[0], dtype=torch.bool, device=hs.device) if mask is None else mask.bool()
    kl_keep = keep.clone() if kl_mask is None else (kl_mask.bool() & keep)  # distinct tensors for dynamo
    normalizer = max(float(keep.sum()), 1.0) if normalizer is None else float(normalizer)
    kl_normalizer = max(float(kl_keep.sum()), 1.0) if kl_normalizer is None else float(kl_normalizer)
    for name, x in (("normalizer", normalizer), ("kl_normalizer", kl_normalizer)):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return float(clip_high), temperature, V, keep, kl_keep, normalizer, kl_normalizer


def token_weight(value, name: str, N: int, device: torch.device, dtype: torch.dtype) -> Optional[Tensor]:
    """A per-token weight of a declared loss (`fused_linear_logprob_entropy`'s `logprob_weight=` / `entropy_weight=`) as an
    [N] `dtype` tensor on `device`, or None for the number 0 (that term then costs
    nothing). A number must be finite; a tensor must be a floating [N] tensor on `device`
    that does not require grad: the weights are constants of the loss, and a gradient
    to them would be silently missing, so it is refused rather than detached."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(f"{name} must be a Python float or an [N] floating tensor, got {type(value).__name__}")
    if not isinstance(value, Tensor):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        return None if value == 0.0 else torch.full((N,), value, device=device, dtype=dtype)
    if value.dim() != 1 or value.shape[0] != N:
        raise ValueError(f"{name} must be a Python float or a 1-D tensor of N={N} entries, got shape "
                         f"{tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, the hidden states on {device}: all tensors must be on one device")
    if value.requires_grad:
        raise ValueError(f"{name} requires grad, but the loss weights are constants of the declared loss (no "
                         f"gradient reaches them): pass {name}.detach()")
    return value.to(dtype).contiguous()


def check_weights_finite(weights: dict, keep: Tensor) -> None:
    """A NaN or inf weight at a kept token makes the loss and every gradient NaN: name the
    weight and the first such token (masked tokens' weights are never read). Syncs."""
    for name, w in weights.items():
        if w is None:
            continue
        bad = keep & ~torch.isfinite(w)
        if bool(bad.any()):
            raise ValueError(f"{name} holds {int(bad.sum())} non-finite values (NaN or inf) at kept tokens, first "
                             f"at token {int(bad.nonzero()[0, 0])}: the loss and its gradients would be NaN")


# an old log-probability above 0 is no probability; float rounding of a log-softmax stays
# below this (kept generous for log-probs an inference engine computed in bf16)
OLD_LOGPROB_TOLERANCE = 1e-3


def check_actor_inputs(adv: Tensor, old_lp: Tensor, keep: Tensor, teacher_hidden: Optional[Tensor]) -> None:
    """The per-token inputs of the actor loss that would otherwise miscount in silence
    (checked with the target range, so on CPU by default, on CUDA under
    MEMOPD_DEBUG_CHECKS=1 or check_targets=True): a NaN or inf advantage or old log-prob
    at a kept token (the loss would be NaN while that token's gradient is 0), an old
    log-prob > 0, and non-finite teacher hidden states (a NaN loss with finite log-probs)."""
    check_weights_finite({"advantages": adv, "old_logprobs": old_lp}, keep)
    high = keep & (old_lp > OLD_LOGPROB_TOLERANCE)
    if bool(high.any()):
        first = int(high.nonzero()[0, 0])
        raise ValueError(f"old_logprobs holds {int(high.sum())} values > 0 at kept tokens, first {float(old_lp[first]):.4g} "
                         f"at token {first}: a log-probability is <= 0 (pass log-probs, not probabilities or logits)")
    check_finite(teacher_hidden, "teacher_hidden")


def check_target_range(targets: Tensor, keep: Tensor, vocab_size: int) -> None:
    kept = targets[keep].long()  # compared as int64, whatever the ids' width
    if kept.numel() and (bool((kept < 0).any()) or bool((kept >= vocab_size).any())):
        bad = kept[(kept < 0) | (kept >= vocab_size)][:5].tolist()
        raise ValueError(f"targets out of range [0, {vocab_size}) at kept tokens: {bad} ...")


def keep_mask(targets: Tensor, mask: Optional[Tensor], ignore_index: Optional[int]) -> Tensor:
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    if ignore_index is not None:
        keep = keep & (targets.long() != int(ignore_index))  # in int64: -100 never wraps to an id
    return keep


def reduce_loss(div: Tensor, keep: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        # device-side count: no host sync; an all-masked batch gives 0 / 1 = 0
        return div.sum() / keep.sum().clamp_min(1).to(div.dtype)
    if reduction == "sum":
        return div.sum()
    return div


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> None:
    """Raise ValueError naming the problem for ill-shaped packed-attention inputs."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"packed attention expects q, k, v as [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in tokens or head dim")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    meta.validate()  # self-consistent metadata (checked once per object; see AttentionMeta.validate)
    if meta.num_tokens != T:
        raise ValueError(f"metadata describes {meta.num_tokens} tokens, q has {T}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device or meta.device != q.device:
        raise ValueError(f"q/k/v/meta devices differ: {q.device}, {k.device}, {v.device}, {meta.device}")


def choose_op_backend(op: str, backend: Optional[str], device: torch.device, *dtypes: torch.dtype) -> str:
    """`choose_backend` for the fused ops, whose Triton kernels take fp32/bf16/fp16 only."""
    refusal = "float64 inputs" if torch.float64 in dtypes else None
    return choose_backend(op, backend, device, triton_refusal=refusal)


def teacher_kl_weight(teacher_kl_coef: Optional[float], kl_coef: Optional[float], op: str,
                      teacher_given: bool = False) -> float:
    """The teacher-KL loss weight of `op` from its `teacher_kl_coef=` and the deprecated
    `kl_coef=` (its old name, kept so that existing callers run; it warns). With
    `teacher_given`, a weight must be given: a teacher with the default weight 0 would
    run its matmuls, report a healthy-looking KL and distil nothing."""
    if teacher_given and teacher_kl_coef is None and kl_coef is None:
        raise ValueError(f"{op}: a teacher is given but no teacher_kl_coef: pass teacher_kl_coef=1.0 to distil "
                         "(the trainer's ppo.teacher_kl_coef default), or teacher_kl_coef=0.0 to only measure the KL")
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
