"""The optimiser and learning-rate schedule that every memopd training job uses: AdamW
with weight decay on matrices only (`build_optimizer`) and a warm-up + constant / cosine /
linear multiplier for `torch.optim.lr_scheduler.LambdaLR` (`build_lr_lambda`).

It sits below both users: the trainer's backends (memopd.trainer.backend) and the SFT
stage (memopd.env.qa.sft), which must not import each other's modules for it.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["SCHEDULES", "build_optimizer", "build_lr_lambda"]

SCHEDULES = ("constant", "cosine", "linear")


def build_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; decay on ndim >= 2 only (not biases/norm gains)."""
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("model has no trainable parameters")
    groups = [
        {"params": ps, "weight_decay": wd}
        for ps, wd in ((decay, float(weight_decay)), (no_decay, 0.0))
        if ps  # DeepSpeed's ZeRO flattening does not like empty groups
    ]
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    kw: dict[str, Any] = {} if on_cuda else {"fused": False}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **kw)


def build_lr_lambda(
    warmup_steps: int, total_steps: int, schedule: str = "constant", min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """LR multiplier as a function of the number of optimiser steps already taken."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    decay_steps = max(1, total_steps - warmup_steps)

    def lr_lambda(taken: int) -> float:
        k = taken + 1  # the step this rate is used for, 1-based
        if warmup_steps > 0 and k <= warmup_steps:
            return k / warmup_steps
        if schedule == "constant":
            return 1.0
        # first post-warmup step uses the full rate; never reaches the floor within total_steps
        progress = min(1.0, (k - warmup_steps - 1) / decay_steps)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return lr_lambda
