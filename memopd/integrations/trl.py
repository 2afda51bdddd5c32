"""TRL's GKD trainer with memopd's fused JSD loss: `MemopdGKDTrainer`, and the loss itself
(`gkd_loss_from_hidden`) for any trainer that follows TRL's conventions.

TRL's `GKDTrainer.compute_loss` runs the student and the teacher to full `[B, T, V]`
logits and calls `generalized_jsd_loss` on them. `MemopdGKDTrainer` overrides only
`compute_loss`: both models return their last hidden states (`logits_to_keep=1`, so each
computes logits for one position only), and `memopd.ops.fused_linear_distill` evaluates
the same generalised JSD from hidden states and lm_head weights, never materialising
`[tokens x vocab]`. Everything else is TRL's own code: the data collator, the on-policy
(`lmbda`) and sequence-KD (`seq_kd`) generation in `training_step`, the optimiser step,
`num_items_in_batch`. The options keep TRL's meaning:

- `beta`: the JSD interpolation, mixture M = beta p_teacher + (1 - beta) p_student;
  0 is forward KL(teacher || student), 1 reverse KL(student || teacher).
- `temperature`: the *sampling* temperature of TRL's on-policy generation only. TRL's
  `compute_loss` scores the divergence at temperature 1, and so does this trainer.
- `lmbda`, `seq_kd`, `max_new_tokens`: untouched (TRL's `training_step`).
- reduction: TRL's default "batchmean" with labels, i.e. the sum over tokens whose label
  is not -100 divided by their number, or by `num_items_in_batch` when the Trainer
  passes it (gradient accumulation); that sum over tokens is memopd's per-token `kl`.

`import memopd.integrations.trl` never imports TRL; the class is built on first access.
Design of the op: docs/design.md §6.2; option meanings beside TRL's: docs/integrations.md.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# MemopdGKDTrainer is built on first access (module __getattr__), so TRL is imported only then
__all__ = ["MemopdGKDTrainer", "gkd_loss_from_hidden", "TRL_REDUCTIONS"]  # noqa: F822

TRL_REDUCTIONS = ("batchmean", "sum", "mean")


def gkd_loss_from_hidden(
    student_hidden: Tensor,
    student_head,
    teacher_hidden: Tensor,
    teacher_head,
    labels: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch=None,
    vocab_size: Optional[int] = None,
) -> Tensor:
    """TRL's `generalized_jsd_loss` on the causally shifted logits of two models, computed
    from their last hidden states.

    Args:
        student_hidden: [B, T, Hs] last hidden states of the student (unshifted: position t
            predicts token t + 1, as the model returns them).
        student_head, teacher_head: `memopd.hf.LMHead`s (`memopd.hf.head_of(model)`), so a
            constant logit scale of the model is honoured.
        teacher_hidden: [B, T, Ht], frozen (it is detached here).
        labels: [B, T] the batch's labels (unshifted, -100 where no loss), as in TRL.
        beta, temperature: as TRL's `generalized_jsd_loss` (its trainer passes temperature 1).
        reduction: TRL's "batchmean" (sum over kept tokens / their count), "sum" or "mean"
            (TRL's `jsd[mask].mean()` over [tokens, vocab] entries: the batchmean / V).
            TRL's "none" returns [tokens, V] entries, which the fused op never forms: refused.
        num_items_in_batch: when given, the sum over kept tokens divided by it, whatever the
            reduction (TRL's rule for gradient accumulation).
        vocab_size: distributions over the first `vocab_size` lm_head rows (default: all rows;
            required when the two heads differ in rows).
    """
    from memopd.ops import fused_linear_distill

    if reduction not in TRL_REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not available: TRL's 'none' is [tokens, vocab] and the fused op "
                         f"never forms it; use one of {TRL_REDUCTIONS}, or memopd.ops.fused_linear_distill("
                         f"reduction='none') for the per-token divergence [tokens]")
    if student_hidden.dim() != 3 or teacher_hidden.dim() != 3 or labels.dim() != 2:
        raise ValueError(f"expected hidden states [B, T, H] and labels [B, T], got {tuple(student_hidden.shape)}, "
                         f"{tuple(teacher_hidden.shape)} and {tuple(labels.shape)}")
    if student_hidden.shape[:2] != labels.shape or teacher_hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden states {tuple(student_hidden.shape[:2])} / {tuple(teacher_hidden.shape[:2])} and "
                         f"labels {tuple(labels.shape)} disagree in [B, T]")
    shifted = labels[:, 1:]
    keep = shifted != -100
    # only kept positions reach the op: [K, H] gathers instead of every padded position
    h_s = student_hidden[:, :-1][keep]
    h_t = teacher_hidden[:, :-1][keep].detach()
    targets = shifted[keep]
    # logits = scale * (h W^T + b): the student's scale goes into the temperature, the
    # teacher's relative scale into its (frozen) hidden states and bias
    t_eff = float(temperature) / student_head.scale
    rel = teacher_head.scale / student_head.scale
    b_t = teacher_head.bias
    if rel != 1.0:
        h_t = h_t * rel
        b_t = None if b_t is None else b_t * rel
    out = fused_linear_distill(
        h_s, student_head.weight, h_t, teacher_head.weight.detach(), targets,
        student_bias=student_head.bias, teacher_bias=None if b_t is None else b_t.detach(),
        temperature=t_eff, vocab_size=vocab_size, divergence="jsd", beta=float(beta), reduction="sum")
    total = out.loss
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    count = keep.sum().clamp_min(1).to(total.dtype)
    if reduction == "batchmean":
        return total / count
    vocab = vocab_size or student_head.weight.shape[0]
    return total / (count * vocab)


def _last_hidden(model, inputs) -> Tensor:
    """Last hidden states [B, T, H] through the (possibly wrapped) model's own forward,
    so DDP / DeepSpeed hooks run; `logits_to_keep=1` keeps its lm_head to one position."""
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                output_hidden_states=True, logits_to_keep=1, use_cache=False)
    return out.hidden_states[-1]


def _build_trainer_class():
    from memopd.integrations import require

    gkd = require("trl.experimental.gkd", "memopd.integrations.trl.MemopdGKDTrainer")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from memopd.hf import head_of

    class MemopdGKDTrainer(gkd.GKDTrainer):
        """`trl.experimental.gkd.GKDTrainer` whose loss is memopd's fused JSD on hidden
        states. Same constructor, plus `vocab_size` (keyword): the rows of both lm_heads
        that form the distributions (default all; needed when the heads differ in rows).

        `compute_loss(..., return_outputs=True)` returns a `CausalLMOutputWithPast` with
        the loss and no logits: evaluate with `prediction_loss_only=True`.
        """

        def __init__(self, model=None, teacher_model=None, *args, vocab_size: Optional[int] = None, **kwargs):
            # Each head's logit scale is measured (and cached on the model) before
            # accelerate may wrap the forward in mixed-precision autocast, under which a
            # bf16 lm_head no longer reproduces h @ W^T + b to fp32 rounding.
            for m in (model, teacher_model):
                if isinstance(m, torch.nn.Module):
                    head_of(m)
            super().__init__(model, teacher_model, *args, **kwargs)
            self.memopd_vocab_size = vocab_size

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            student_hidden = _last_hidden(model, inputs)
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_hidden = _last_hidden(self.teacher_model, inputs)
            loss = gkd_loss_from_hidden(
                student_hidden, head_of(self.accelerator.unwrap_model(model)),
                teacher_hidden, head_of(self.accelerator.unwrap_model(self.teacher_model)),
                inputs["labels"], beta=self.beta, temperature=1.0, reduction="batchmean",
                num_items_in_batch=num_items_in_batch, vocab_size=self.memopd_vocab_size)
            return (loss, CausalLMOutputWithPast(loss=loss)) if return_outputs else loss

    MemopdGKDTrainer.__module__ = __name__
    return MemopdGKDTrainer


def __getattr__(name: str):
    if name == "MemopdGKDTrainer":
        cls = _build_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
