"""Actor and critic as modules whose forward takes a `PackedBatch`.

`Actor(lm, scoring)(batch, teacher_hidden, teacher_head)` gives, per action token, the
student's log-prob of the sampled id, its entropy and the reverse KL to the teacher, from
one fused pass over the vocabulary; `token_logprobs` gives the same log-probs without
gradients (old and reference); `Critic(lm)(batch)` gives a value per action token, read
at its prediction position. `Scoring` is the sampler's distribution (temperature, the
first `vocab_size` head rows): docs/design.md §7.6. The lm_head use stays inside
`Actor.forward` so that ZeRO-3 gathers the weight the fused op reads (docs/deepspeed.md §4).
With a served teacher's top-k log-probs (`teacher_topk=`) instead of its hidden states, the
KL term is the top-k reverse KL (`memopd.ops.topk_kl`) added to the teacher-less actor loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from memopd.hf import LMHead, head_of, lm_head_of, packed_forward
from memopd.layout import PackedBatch
from memopd.ops import DistillOutput, fused_linear_actor_loss, fused_linear_logprob_entropy, fused_linear_reverse_kl

from .settings import ActorLossCoefs

__all__ = ["Actor", "Critic", "PPOInputs", "Scoring", "scored_rows", "token_logprobs", "register_zero3_external_params"]


@dataclass(frozen=True)
class PPOInputs:
    """Per-entry inputs of the actor loss for one micro-batch and the update's `coefs`.

    `normalizer` and `kl_normalizer` are the global counts (all micro-batches, all ranks)
    divided by the world size, so that summing micro-batches and averaging ranks gives
    the gradient of one batch (docs/design.md §7.5, docs/deepspeed.md §1). `coefs` come
    from `PPOSettings.loss_coefs` (trainer/settings.py), once per update."""

    logp_old: torch.Tensor
    advantages: torch.Tensor
    kl_mask: torch.Tensor
    coefs: ActorLossCoefs
    normalizer: float
    kl_normalizer: float


@dataclass(frozen=True)
class Scoring:
    """The sampling distribution every log-prob is computed under."""

    temperature: float = 1.0
    vocab_size: int | None = None  # head rows scored; None: all rows of the student's head

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")


def scored_rows(scoring: Scoring, *heads: LMHead) -> int:
    """The head rows every distribution is over; every head given must have them."""
    rows = min(int(h.weight.shape[0]) for h in heads)
    v = scoring.vocab_size or int(heads[0].weight.shape[0])
    if v > rows:
        raise ValueError(f"vocab_size={v} exceeds an lm_head's rows ({rows}): every scored id needs a row")
    return v


def token_logprobs(lm: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    """Log-probs [A] of `targets` under `lm`'s sampling distribution, from its last
    hidden states at the prediction positions (fused: no [A x vocab] logits)."""
    head = head_of(lm)
    return fused_linear_logprob_entropy(
        hidden, head.weight, targets.to(hidden.device), bias=head.bias,
        temperature=scoring.temperature / head.scale, vocab_size=scored_rows(scoring, head),
    ).logprobs


class Actor(nn.Module):
    def __init__(self, lm: nn.Module, attention_backend: str = "auto", scoring: Scoring | None = None):
        super().__init__()
        self.lm = lm
        self.attention_backend = attention_backend
        self.scoring = scoring or Scoring()

    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        return packed_forward(self.lm, batch, output="hidden", attention_backend=self.attention_backend)

    def forward(self, batch: PackedBatch, teacher_hidden: torch.Tensor | None = None,
                teacher_head: LMHead | None = None, ppo: PPOInputs | None = None,
                teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`DistillOutput` per entry; with `ppo`, the whole actor loss from one fused op
        (`ActorLossOutput`: PPO surrogate + entropy bonus + teacher KL, gradients computed
        in its forward). `teacher_topk` ([A, k] ids, [A, k] log-probs), with `ppo`: the KL
        term is the top-k reverse KL of a served teacher's top-k log-probs."""
        h = self.hidden(batch)
        head = head_of(self.lm)
        targets = batch.target_ids.to(h.device)
        # logits / T = (scale * z) / T: the head's scale folds into the op's temperature
        temperature = self.scoring.temperature / head.scale
        if ppo is not None and teacher_topk is not None:
            return self._topk_actor_loss(h, head, targets, temperature, ppo, teacher_topk)
        if ppo is not None:
            th = tw = tb = None
            if teacher_hidden is not None:
                th, tw, tb = self._teacher_operands(head, teacher_hidden, teacher_head, h.dtype)
            return fused_linear_actor_loss(
                h, head.weight, targets, ppo.advantages, ppo.logp_old, teacher_hidden=th, teacher_weight=tw,
                student_bias=head.bias, teacher_bias=tb, kl_mask=ppo.kl_mask, clip_eps=ppo.coefs.clip_eps,
                entropy_coef=ppo.coefs.entropy_coef, teacher_kl_coef=ppo.coefs.teacher_kl_coef,
                temperature=temperature, normalizer=ppo.normalizer, kl_normalizer=ppo.kl_normalizer,
                vocab_size=scored_rows(self.scoring, head, *(() if th is None else (teacher_head,))),
            )
        if teacher_hidden is None:
            # no teacher: the teacher-less mode of the fused op (no teacher matmuls), KL = 0
            lp = fused_linear_logprob_entropy(h, head.weight, targets, bias=head.bias, temperature=temperature,
                                              vocab_size=scored_rows(self.scoring, head))
            return DistillOutput(lp.logprobs.new_zeros(()), torch.zeros_like(lp.logprobs), lp.logprobs, lp.entropy)
        th, tw, tb = self._teacher_operands(head, teacher_hidden, teacher_head, h.dtype)
        return fused_linear_reverse_kl(
            h, head.weight, th, tw, targets, student_bias=head.bias, teacher_bias=tb, reduction="none",
            temperature=temperature, vocab_size=scored_rows(self.scoring, head, teacher_head),
        )

    def _topk_actor_loss(self, h, head: LMHead, targets, temperature: float, ppo: PPOInputs, teacher_topk):
        """The teacher-less fused actor loss plus teacher_kl_coef * sum(top-k KL over the
        KL mask) / kl_normalizer, the same weighting the fused op gives the full KL."""
        from memopd.ops.topk_kl import PAD_ID, fused_linear_topk_reverse_kl

        V = scored_rows(self.scoring, head)
        out = fused_linear_actor_loss(
            h, head.weight, targets, ppo.advantages, ppo.logp_old, student_bias=head.bias, kl_mask=ppo.kl_mask,
            clip_eps=ppo.coefs.clip_eps, entropy_coef=ppo.coefs.entropy_coef, teacher_kl_coef=0.0,
            temperature=temperature, normalizer=ppo.normalizer, kl_normalizer=ppo.kl_normalizer, vocab_size=V)
        ids, lps = (t.to(h.device) for t in teacher_topk)
        keep = ppo.kl_mask.to(h.device).bool()
        ids = torch.where(keep[:, None], ids, PAD_ID)  # rows outside the KL mask contribute nothing
        kl = fused_linear_topk_reverse_kl(h, head.weight[:V], ids, lps, temperature=temperature, reduction="none",
                                          student_bias=None if head.bias is None else head.bias[:V])
        kl = kl * keep
        loss = out.loss + kl.sum() * (ppo.coefs.teacher_kl_coef / ppo.kl_normalizer)
        return out._replace(loss=loss, kl=kl.detach().float())

    @staticmethod
    def _teacher_operands(head: LMHead, teacher_hidden, teacher_head: LMHead | None, dtype):
        """The frozen teacher's (hidden, weight, bias) for a fused op that applies one
        temperature to both models: the teacher's logit scale relative to the student's
        goes into its hidden states and bias."""
        if teacher_head is None:
            raise ValueError("teacher_hidden given without teacher_head")
        rel = teacher_head.scale / head.scale
        th = teacher_hidden.detach().to(dtype)
        tb = teacher_head.bias.detach() if teacher_head.bias is not None else None
        if rel != 1.0:
            th = th * rel
            tb = tb * rel if tb is not None else None
        return th, teacher_head.weight.detach().to(head.weight.dtype), tb


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
