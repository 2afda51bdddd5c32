"""Actor and critic as modules whose forward takes a `PackedBatch`.

Keeping the lm_head use inside `Actor.forward` matters for ZeRO-3: DeepSpeed gathers a
module's parameters around its forward, and the fused op reads `lm_head.weight`
directly, so the actor registers that weight as an external parameter of itself when
running under ZeRO-3.

- `Actor(lm)(batch, teacher_hidden, teacher_weight)` -> `DistillOutput` per action token
  (student log-prob of the sampled id, student entropy, reverse KL to the teacher),
  from one fused pass over the vocabulary. Without a teacher the KL is zero and the
  teacher-less op (`fused_linear_logprob_entropy`) does only the student's matmuls.
- `Critic(lm)(batch)` -> value per action token, read at its prediction position (the
  state in which the token was chosen).
"""
from __future__ import annotations

import torch
from torch import nn

from memopd.hf import lm_head_of, packed_forward
from memopd.layout import PackedBatch
from memopd.ops import DistillOutput, fused_linear_logprob_entropy, fused_linear_reverse_kl

__all__ = ["Actor", "Critic", "register_zero3_external_params"]


class Actor(nn.Module):
    def __init__(self, lm: nn.Module, attention_backend: str = "auto"):
        super().__init__()
        self.lm = lm
        self.attention_backend = attention_backend

    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        return packed_forward(self.lm, batch, output="hidden", attention_backend=self.attention_backend)

    def forward(self, batch: PackedBatch, teacher_hidden: torch.Tensor | None = None,
                teacher_weight: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None):
        h = self.hidden(batch)
        head = lm_head_of(self.lm)
        w = head.weight
        b = getattr(head, "bias", None)
        targets = batch.target_ids.to(h.device)
        if teacher_hidden is None:
            # no teacher: the teacher-less mode of the fused op (no teacher matmuls), KL = 0
            lp = fused_linear_logprob_entropy(h, w, targets, bias=b)
            return DistillOutput(lp.logprobs.new_zeros(()), torch.zeros_like(lp.logprobs), lp.logprobs, lp.entropy)
        return fused_linear_reverse_kl(
            h, w, teacher_hidden.to(h.dtype), teacher_weight.to(w.dtype), targets,
            student_bias=b, teacher_bias=teacher_bias, reduction="none",
            # one padded lm_head: score only the vocabulary both heads have
            vocab_size=min(w.shape[0], teacher_weight.shape[0]),
        )


class Critic(nn.Module):
    """A causal LM body with a scalar value head (the LM's own head is unused)."""

    def __init__(self, lm: nn.Module, attention_backend: str = "auto"):
        super().__init__()
        self.lm = lm
        self.attention_backend = attention_backend
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        h = packed_forward(self.lm, batch, output="hidden", attention_backend=self.attention_backend)
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()


def register_zero3_external_params(actor: Actor) -> None:
    """Under ZeRO-3, let DeepSpeed gather lm_head.weight around `Actor.forward`."""
    try:
        from deepspeed.zero import register_external_parameter
    except ImportError:  # pragma: no cover
        return
    register_external_parameter(actor, lm_head_of(actor.lm).weight)
