"""Liger-compatible fused linear JSD loss on memopd's op: replacing the import is the change.

    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss        # before
    from memopd.integrations.liger import LigerFusedLinearJSDLoss         # after

`LigerFusedLinearJSDLoss` (module) and `liger_fused_linear_jsd` (function) take Liger
0.8.5's constructor arguments, forward arguments in Liger's order (biases positional,
after the labels) and return what Liger returns: the scalar

    loss = weight_hard_loss * hard + weight_soft_loss * soft

or `(loss, soft, hard)` with `return_soft_hard_loss=True`, where, over the tokens whose
label is not `ignore_index` (K of them, counted at least once):

- soft = Σ_i JSD_beta(p_s,i ‖ p_t,i) / K at `temperature` (mixture beta p_t + (1 - beta) p_s;
  beta = 0 forward KL, 1 reverse KL): `memopd.ops.fused_linear_distill(divergence="jsd")`;
- hard = -Σ_i log softmax(student logits_i)[label_i] / K at temperature **1**, as Liger
  computes it on the untempered logits. At `temperature != 1` it is a second,
  teacher-less fused pass (`fused_linear_logprob_entropy` with its loss declared, its
  gradients taken in the forward): the tempered log-probs of the JSD pass are not the hard loss's.

Differences kept out of sight of the caller:

- A student head with fewer rows than the teacher's is padded as Liger pads it: the
  extra columns are student logits of exactly 0 (they carry student mass). Pass
  `vocab_size=` (keyword, memopd's own option) to drop the padded rows of *both* heads
  instead (the right thing when they are padding of one tokenizer).
- `chunk_size` is Liger's tokens per chunk; it becomes the op's `token_chunk_size`.
  `compiled` is accepted and ignored (the op is a registered custom op already).
- The teacher gets no gradient (as in Liger): its tensors are detached here.

Option meanings beside TRL's and memopd's: docs/integrations.md.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["LigerFusedLinearJSDLoss", "liger_fused_linear_jsd"]


def _pad_student_head(weight: Tensor, bias: Optional[Tensor], rows: int):
    """Liger's padding of a smaller student head: extra rows whose logit is exactly 0."""
    extra = rows - weight.shape[0]
    weight = torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
    if bias is not None:
        bias = torch.cat([bias, bias.new_zeros(extra)])
    return weight, bias


def liger_fused_linear_jsd(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    true_labels: Tensor,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    compiled: bool = True,
    chunk_size: int = 1024,
    return_soft_hard_loss: bool = False,
    *,
    vocab_size: Optional[int] = None,
):
    """`liger_kernel.chunked_loss.functional.liger_fused_linear_jsd` on memopd's fused op
    (same positional order and results; see the module docstring)."""
    from memopd.ops import fused_linear_distill, fused_linear_logprob_entropy

    if temperature == 0:
        raise ValueError("Temperature cannot be 0.")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size is Liger's tokens per chunk and must be >= 1, got {chunk_size}")
    v_s, v_t = student_weight.shape[0], teacher_weight.shape[0]
    w_s, b_s = student_weight, student_bias
    if vocab_size is None and v_s < v_t:
        w_s, b_s = _pad_student_head(student_weight, student_bias, v_t)
    elif vocab_size is None and v_s > v_t:
        raise ValueError(f"the student head has more rows ({v_s}) than the teacher's ({v_t}); Liger cannot pad the "
                         f"teacher either. Pass vocab_size=<true vocabulary> to use the first vocab_size rows of both")
    token_chunk = int(chunk_size) if chunk_size else None
    need_hard = weight_hard_loss != 0 or return_soft_hard_loss
    # one pass gives the hard loss too when its log-probs are the JSD pass's: temperature 1, unpadded student
    shared = need_hard and temperature == 1.0 and w_s is student_weight
    kept = true_labels != ignore_index
    # Liger's JSD reads the labels only for the ignore mask: without the hard loss on this
    # pass, any other label (even -100 under another ignore_index) is a valid token
    jsd_targets = true_labels if shared else torch.zeros_like(true_labels)
    out = fused_linear_distill(
        student_input, w_s, teacher_input.detach(), teacher_weight.detach(), jsd_targets, mask=kept,
        student_bias=b_s, teacher_bias=None if teacher_bias is None else teacher_bias.detach(),
        temperature=temperature, vocab_size=vocab_size, token_chunk_size=token_chunk, reduction="mean",
        divergence="jsd", beta=beta, ignore_index=None,
        # the hard loss backpropagates through this call's logprobs too: one recomputing
        # backward for both beats gradients in the forward plus a second, recomputing one
        gradients="recompute" if need_hard and shared else None)
    soft = out.loss
    hard = soft.new_zeros(())
    if need_hard:
        if shared:
            hard = -out.logprobs.sum() / kept.sum().clamp_min(1).to(out.logprobs.dtype)
        else:
            # the hard loss declared to the op (-1/K per kept token): its gradients are taken in
            # the forward (3 lm-head matmuls), the count stays on the device (no host sync)
            per_token = kept.to(torch.float32) / kept.sum().clamp_min(1).to(torch.float32)
            hard = fused_linear_logprob_entropy(
                student_input, student_weight, true_labels, logprob_weight=-per_token,
                bias=student_bias, temperature=1.0, mask=kept,
                vocab_size=None if vocab_size is None else min(vocab_size, v_s), token_chunk_size=token_chunk,
                ignore_index=None).loss
    loss = weight_hard_loss * hard + weight_soft_loss * soft
    if return_soft_hard_loss:
        return loss, soft, hard
    return loss


class LigerFusedLinearJSDLoss(torch.nn.Module):
    """Drop-in for `liger_kernel.chunked_loss.LigerFusedLinearJSDLoss` (0.8.5): same
    constructor, same `forward(student_input, student_weight, teacher_input, teacher_weight,
    true_labels, student_bias=None, teacher_bias=None)`, same return; plus the keyword
    `vocab_size` (see the module docstring)."""

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        compiled: bool = True,
        chunk_size: int = 1024,
        return_soft_hard_loss: bool = False,
        *,
        vocab_size: Optional[int] = None,
    ):
        super().__init__()
        if temperature == 0:
            raise ValueError("Temperature cannot be 0.")
        self.weight_hard_loss = weight_hard_loss
        self.weight_soft_loss = weight_soft_loss
        self.beta = beta
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.compiled = compiled
        self.chunk_size = chunk_size
        self.return_soft_hard_loss = return_soft_hard_loss
        self.vocab_size = vocab_size

    def forward(self, student_input: Tensor, student_weight: Tensor, teacher_input: Tensor, teacher_weight: Tensor,
                true_labels: Tensor, student_bias: Optional[Tensor] = None, teacher_bias: Optional[Tensor] = None):
        return liger_fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            self.weight_hard_loss, self.weight_soft_loss, self.beta, self.ignore_index, self.temperature,
            self.compiled, self.chunk_size, self.return_soft_hard_loss, vocab_size=self.vocab_size)
