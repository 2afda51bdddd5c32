"""What the ops (memopd.ops), their back ends and their references agree on: divergence
codes, the rows of the statistics tensors they exchange, the parameter objects the
host-side launchers take, and the inputs the packed-attention kernels take (the ops'
result types, which no kernel uses, are memopd/ops/results.py's).

It sits in the kernel layer so that every import points down (trainer -> memopd.ops ->
memopd.kernels): the ops import it, the kernels import it, it imports neither. Plain
Python and torch, never Triton: importing it (or `memopd.kernels` itself) works on a
machine without Triton; the kernels use the integer values as tl.constexpr.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional

import torch
from torch import Tensor

__all__ = ["Divergence", "DistillStat", "Partial", "ActorStat", "PRECISE_LIMIT", "LinearHead", "head_tensors", "DistillParams",
           "ActorLossParams", "TRITON_HEAD_DIMS", "TRITON_DTYPES"]

# What the packed-attention kernels take (memopd.ops.attention refuses the rest for them).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Divergence(IntEnum):
    """The divergence a distillation call computes (the `divergence=` names, lower case)."""

    REVERSE_KL = 0
    FORWARD_KL = 1
    JSD = 2

    @classmethod
    def from_name(cls, name: str, beta: float) -> "Divergence":
        # TRL convention: the endpoints of the generalised JSD are the two KLs.
        if name == "jsd" and beta == 0.0:
            return cls.FORWARD_KL
        if name == "jsd" and beta == 1.0:
            return cls.REVERSE_KL
        return cls[name.upper()]


DIVERGENCE_NAMES = tuple(d.name.lower() for d in Divergence)


class DistillStat(IntEnum):
    """Rows of the [len(DistillStat), N] statistics the distillation forward saves for its
    backward (both back ends)."""

    LSE_S = 0    # log-sum-exp of the student logits / T
    LSE_T = 1    # ... of the teacher's
    DLSE = 2     # lse_s - lse_t, precise where p ~ q
    AUX = 3      # the per-token KL (KL divergences) or KL(p || M) (JSD)
    ENTROPY = 4  # student entropy


class Partial(IntEnum):
    """Rows of the online statistics the Triton forward writes per (row, vocabulary split)."""

    M_S = 0    # running max of s
    Z_S = 1    # sum exp(s - m_s)
    A_S = 2    # sum exp(s - m_s) (s - m_s)   (entropy)
    M_T = 3    # running max of t
    Z_T = 4    # sum exp(t - m_t)
    E_D = 5    # sum exp(s - m_s) d (reverse KL, JSD) or sum exp(t - m_t) d (forward KL), d = s - t
    M_J = 6    # joint max of s and t
    ZT_J = 7   # sum exp(t - m_j)
    DZ_J = 8   # sum exp(s - m_j) - exp(t - m_j)
    S_Y = 9    # target logit


class ActorStat(IntEnum):
    """Rows of the [len(ActorStat), N] per-token statistics of the fused actor loss."""

    LOGPROB = 0
    ENTROPY = 1
    KL = 2
    RATIO = 3
    CLIPPED = 4  # 1.0 where the clipped branch was taken


# Actor loss: rows with a' = (s - max s) - (t - max t) above this anywhere use the plain
# log-sum-exp difference (expm1 would overflow).
PRECISE_LIMIT = 30.0


@dataclass(frozen=True)
class LinearHead:
    """Last hidden states [N, H] and an lm_head weight [V, H] with its optional bias [V]."""

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor] = None


def head_tensors(head: Optional[LinearHead]) -> tuple:
    """(hidden, weight, bias) of a head; three Nones for an absent one (no teacher)."""
    return (None, None, None) if head is None else (head.hidden, head.weight, head.bias)


@dataclass(frozen=True)
class DistillParams:
    """Scalars of one distillation call. chunk_size / token_chunk: 0 = automatic."""

    temperature: float
    vocab_size: int
    divergence: Divergence
    beta: float
    chunk_size: int = 0
    token_chunk: int = 0


@dataclass(frozen=True)
class ActorLossParams:
    """Scalars of one actor-loss call (dual_clip None = off)."""

    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    entropy_coef: float
    teacher_kl_coef: float  # weight of KL(student || teacher) in the loss
    temperature: float
    vocab_size: int
    normalizer: float
    kl_normalizer: float
