"""The result types of the ops (memopd.ops names them): what the fused losses, their
teacher-less modes and their references return, as named tuples of tensors.
"""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["DistillOutput", "LogProbEntropy", "LogProbEntropyLoss", "ActorLossOutput"]


class DistillOutput(NamedTuple):
    """Result of the fused op: reduced loss and per-token fp32 tensors (0 where masked)."""

    loss: Tensor
    kl: Tensor
    logprobs: Tensor
    entropy: Tensor


class LogProbEntropy(NamedTuple):
    """Result of the teacher-less op: per-token fp32 tensors [N] (0 where masked)."""

    logprobs: Tensor
    entropy: Tensor


class LogProbEntropyLoss(NamedTuple):
    """Result of the teacher-less op with a declared loss: the scalar loss and the
    per-token fp32 tensors [N] (0 where masked), all three differentiable."""

    loss: Tensor
    logprobs: Tensor
    entropy: Tensor


class ActorLossOutput(NamedTuple):
    """Result of the fused actor loss: the scalar loss (differentiable) and detached
    per-token fp32 [N] statistics; masked tokens hold 0 (ratio 1, clipped False)."""

    loss: Tensor
    logprobs: Tensor
    entropy: Tensor
    kl: Tensor
    ratio: Tensor
    clipped: Tensor  # bool: the clipped branch was taken (no policy gradient)
