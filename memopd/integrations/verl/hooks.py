"""Tensor-level hooks in verl's `[B, R]` response layout, on memopd's fused ops.

verl 0.9's losses (`verl.workers.utils.losses.ppo_loss`) turn the engine's unpadded
output back into `[B, R]` response tensors (prompt left, response right, `R` response
columns) and aggregate with `core_algos.agg_loss`. These functions follow those
conventions, taking the last hidden states and the lm_head instead of `[B, R, V]` logits:

- `compute_log_prob(hidden_states [B, L, H], weight, responses [B, R], response_mask)`
  -> `(log_probs [B, R], entropy [B, R] | None)` at the sampling temperature (0 where
  `response_mask` is 0).
- `policy_loss(...)` -> `(loss, metrics)`: verl's `ppo_loss` for the vanilla surrogate
  (`core_algos.compute_policy_loss_vanilla`: log-ratio clamped to [-20, 20], ratio
  clipped to [1 - clip_ratio_low, 1 + clip_ratio_high], dual clip `clip_ratio_c`) minus
  `entropy_coeff` x entropy, aggregated by `agg_loss` (every `loss_agg_mode`, with verl's
  `global_batch_info`); optionally plus `teacher_kl_coef` x the full-vocabulary reverse KL
  to a frozen teacher, aggregated the same way.
- `packed_log_prob(model, input_ids, attention_mask, position_ids, responses,
  response_mask)`: the same `[B, R]` log-probs from a padded batch through memopd's packed
  forward (one segment per row at its own positions), no compute on padding.

verl need not be installed: these functions only follow its tensor conventions
(tests/integrations/test_integrations_verl.py compares them with verl 0.9.1's own
functions). The session recipe (agent loop, teacher scoring of every call, packed
training of a session's calls) is the rest of `memopd.integrations.verl`; docs/verl.md.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["LOSS_AGG_MODES", "agg_loss", "compute_log_prob", "policy_loss", "packed_log_prob", "padded_to_packed"]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _response_hidden(hidden_states: Tensor, responses: Tensor) -> Tensor:
    """[B, R, H] hidden states of the positions that predict the R response tokens."""
    if hidden_states.dim() != 3 or responses.dim() != 2:
        raise ValueError(f"expected hidden_states [B, L, H] and responses [B, R], got {tuple(hidden_states.shape)} "
                         f"and {tuple(responses.shape)}")
    B, L, _ = hidden_states.shape
    R = responses.shape[1]
    if responses.shape[0] != B or not 0 < R < L:
        raise ValueError(f"responses {tuple(responses.shape)} must be [B={B}, R] with 0 < R < L={L}: the response is "
                         f"the last R tokens of the sequence and position t predicts token t + 1")
    return hidden_states[:, L - R - 1:L - 1]


def _response_mask(response_mask: Optional[Tensor], responses: Tensor) -> Tensor:
    if response_mask is None:
        return torch.ones_like(responses, dtype=torch.bool)
    if response_mask.shape != responses.shape:
        raise ValueError(f"response_mask {tuple(response_mask.shape)} must match responses {tuple(responses.shape)}")
    return response_mask.to(torch.bool)


def compute_log_prob(
    hidden_states: Tensor,
    weight: Tensor,
    responses: Tensor,
    response_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    vocab_size: Optional[int] = None,
):
    """Response log-probs and entropy `[B, R]` from last hidden states `[B, L, H]` and
    the lm_head `weight [V, H]` (+ `bias`), at the sampling `temperature`.

    Differentiable (use it inside `update_policy` too); under `torch.no_grad()` it keeps
    nothing for a backward. Positions where `response_mask` is 0 hold 0. `vocab_size`:
    the rows of the head that form the distribution (default all).
    """
    from memopd.ops import fused_linear_logprob_entropy

    h = _response_hidden(hidden_states, responses)
    mask = _response_mask(response_mask, responses)
    B, R = responses.shape
    out = fused_linear_logprob_entropy(h.reshape(B * R, -1), weight, responses.reshape(-1), bias=bias,
                                       mask=mask.reshape(-1), temperature=temperature, vocab_size=vocab_size,
                                       ignore_index=None)
    entropy = out.entropy.view(B, R) if calculate_entropy else None
    return out.logprobs.view(B, R), entropy


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str = "token-mean", *, dp_size: int = 1,
             batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None) -> Tensor:
    """verl's aggregation of a `[B, R]` per-token loss into a scalar (verl 0.9's
    `core_algos.agg_loss`, same arguments). With `dp_size > 1` the global token count
    (`batch_num_tokens`) or sequence count (`global_batch_size`) must be given, and the
    loss is scaled by `dp_size`, so the gradient averaged over data-parallel ranks is that
    of the global batch. Sequences without a kept token do not count in the seq-mean
    modes. One difference: a micro-batch without any kept token gives 0, not 0/0."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    keep = loss_mask.to(torch.bool)
    m = keep.to(loss_mat.dtype)
    kept = torch.where(keep, loss_mat, 0.0) * m  # NaN at masked positions never reaches the sum
    if loss_agg_mode == "token-sum":
        return kept.sum() * dp_size
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("loss_agg_mode='token-mean' with dp_size > 1 needs batch_num_tokens (global count)")
            batch_num_tokens = m.sum().clamp_min(1)
        return kept.sum() / batch_num_tokens * dp_size
    counts = m.sum(-1)
    seq_losses = kept.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / counts.clamp_min(1)  # verl adds 1e-8 to an integer count: lost in rounding
    seq_mask = (counts > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"loss_agg_mode={loss_agg_mode!r} with dp_size > 1 needs global_batch_size")
        global_batch_size = seq_mask.sum().clamp_min(1)
    loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def policy_loss(
    hidden_states: Tensor,
    weight: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    bias: Optional[Tensor] = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    entropy_coeff: float = 0.0,
    loss_agg_mode: str = "token-mean",
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    teacher_hidden_states: Optional[Tensor] = None,
    teacher_weight: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    teacher_kl_coef: Optional[float] = None,
    global_batch_info: Optional[dict] = None,
    kl_coef: Optional[float] = None,
):
    """verl's actor loss of one micro-batch from hidden states: `(loss, metrics)`.

    `global_batch_info`: verl's `config.global_batch_info` (`dp_size`,
    `batch_num_tokens`, `global_batch_size`, `loss_scale_factor`), passed to every
    `agg_loss` as verl does.

    `old_log_prob`, `advantages`: `[B, R]`, as verl's batch holds them. With
    `teacher_hidden_states [B, L, Ht]` and `teacher_weight` (frozen), `teacher_kl_coef` (default 0) x the
    per-token reverse KL(student || teacher) over the full vocabulary is added, with the
    same aggregation. `metrics` holds detached `pg_loss`, `pg_clipfrac`, `ppo_kl`,
    `pg_clipfrac_lower`, `entropy` and (with a teacher) `kl` as verl logs them. `kl_coef=`
    is the deprecated old name of `teacher_kl_coef=` (it warns).

    Where the aggregation allows, the loss takes its gradients in the forward
    (`fused_linear_actor_loss`: 3 lm-head GEMMs, 4 with a teacher): every mode weights the
    per-token losses linearly, and the surrogate takes any positive per-token weight
    through the advantages; the entropy and KL terms need one weight for all kept tokens
    (every mode but seq-mean-token-mean), and the old log-probs must be >= -20 (verl's
    log-ratio clamp; a log-ratio below -20 with A > 0, seen after the forward, also
    sends the loss to the recomputing path). Otherwise (seq-mean-token-mean with an
    entropy bonus or a teacher) the log-probs, entropy and KL come from the recomputing
    ops and the loss is built from them in torch.
    """
    from memopd.ops import fused_linear_distill, fused_linear_logprob_entropy
    from memopd.ops._validate import teacher_kl_weight

    teacher_kl_coef = teacher_kl_weight(teacher_kl_coef, kl_coef, "policy_loss")

    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (verl's dual clip), got {clip_ratio_c}")
    if old_log_prob.shape != responses.shape or advantages.shape != responses.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)} and advantages {tuple(advantages.shape)} must be "
                         f"[B, R] = {tuple(responses.shape)}")
    if (teacher_hidden_states is None) != (teacher_weight is None):
        raise ValueError("pass teacher_hidden_states and teacher_weight together (or neither)")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    mask = _response_mask(response_mask, responses)
    B, R = responses.shape
    h = _response_hidden(hidden_states, responses).reshape(B * R, -1)
    info = dict(global_batch_info or {})
    with_teacher = teacher_hidden_states is not None
    # the dtype the ops compute their per-token statistics in (fp32 for bf16/fp16 heads)
    weights = _agg_weights(mask, loss_agg_mode, info, torch.float64 if h.dtype == torch.float64 else torch.float32)
    if _weights_fold(weights, mask, entropy_coeff != 0.0 or with_teacher) and _ratio_bounded(old_log_prob, mask):
        fused = _fused_policy_loss(h, weight, responses, mask, old_log_prob, advantages, weights, bias=bias, low=low,
                                  high=high, clip_ratio_c=clip_ratio_c, entropy_coeff=entropy_coeff,
                                  temperature=temperature, vocab_size=vocab_size,
                                  teacher=(_response_hidden(teacher_hidden_states, responses).reshape(B * R, -1),
                                           teacher_weight, teacher_bias) if with_teacher else None,
                                  teacher_kl_coef=teacher_kl_coef, mode=loss_agg_mode, info=info)
        if fused is not None:
            return fused
    common = dict(mask=mask.reshape(-1), temperature=temperature, vocab_size=vocab_size, ignore_index=None)
    kl = None
    if teacher_hidden_states is None:
        out = fused_linear_logprob_entropy(h, weight, responses.reshape(-1), bias=bias, **common)
    else:
        h_t = _response_hidden(teacher_hidden_states, responses).reshape(B * R, -1).detach()
        out = fused_linear_distill(h, weight, h_t, teacher_weight.detach(), responses.reshape(-1), student_bias=bias,
                                   teacher_bias=None if teacher_bias is None else teacher_bias.detach(),
                                   reduction="none", **common)
        kl = out.kl.view(B, R)
    log_prob = out.logprobs.view(B, R)
    entropy = out.entropy.view(B, R)

    adv = advantages.to(log_prob.dtype)
    log_ratio, unclipped, clipped, pg_clip, pg_losses = _surrogate(log_prob, old_log_prob, adv, low, high, clip_ratio_c)
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **info)
    entropy_loss = agg_loss(entropy, mask, loss_agg_mode, **info)
    loss = pg_loss - entropy_coeff * entropy_loss
    metrics = {}
    if kl is not None:
        kl_loss = agg_loss(kl, mask, loss_agg_mode, **info)
        loss = loss + teacher_kl_coef * kl_loss
        metrics["kl"] = kl_loss.detach()
    metrics.update(_surrogate_metrics(log_ratio, adv, mask, clipped, unclipped, pg_clip, clip_ratio_c),
                   pg_loss=pg_loss.detach(), entropy=entropy_loss.detach())
    return loss, metrics


def _surrogate(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, low: float, high: float, clip_ratio_c: float):
    """verl's vanilla surrogate per token: (log_ratio, unclipped, clipped, pg_clip, pg_losses)."""
    log_ratio = torch.clamp(log_prob - old_log_prob.to(log_prob.dtype), -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pg_clip = torch.maximum(unclipped, clipped)
    dual = torch.minimum(-adv * clip_ratio_c, pg_clip)
    return log_ratio, unclipped, clipped, pg_clip, torch.where(adv < 0, dual, pg_clip)


def _surrogate_metrics(log_ratio, adv, mask, clipped, unclipped, pg_clip, clip_ratio_c) -> dict:
    """The clip statistics verl logs, as token means over the kept tokens (detached)."""
    with torch.no_grad():
        m = mask.to(log_ratio.dtype)

        def token_mean(x):  # verl's masked_mean: its 1e-8 added to an integer count rounds away
            return (x * m).sum() / m.sum().clamp_min(1)

        return dict(pg_clipfrac=token_mean(torch.gt(clipped, unclipped).to(m.dtype)),
                    ppo_kl=token_mean(-log_ratio),
                    pg_clipfrac_lower=token_mean((torch.gt(pg_clip, -adv * clip_ratio_c) & (adv < 0)).to(m.dtype)))


def _agg_weights(mask: Tensor, mode: str, info: dict, dtype: torch.dtype) -> Tensor:
    """The `[B, R]` weights w with agg_loss(x) = Σ w x for every x: each mode is linear in
    the per-token losses, so w is its gradient at any point (0 off the mask)."""
    x = torch.zeros(mask.shape, dtype=dtype, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (w,) = torch.autograd.grad(agg_loss(x, mask, mode, **info), x)
    return w


def _weights_fold(weights: Tensor, mask: Tensor, uniform_needed: bool) -> bool:
    """Whether the fused actor loss computes this aggregation: its surrogate is positively
    homogeneous in the advantage, so any positive per-token weight folds into the
    advantages; the entropy and teacher-KL terms take one weight for all tokens, so with
    either present the weights must be equal on the kept tokens (all modes but
    seq-mean-token-mean, whose weight is 1 / the sequence's kept tokens)."""
    kept = weights[mask]
    if kept.numel() == 0 or not bool((kept > 0).all()):
        return False
    return not uniform_needed or bool((kept == kept[0]).all())


def _ratio_bounded(old_log_prob: Tensor, mask: Tensor) -> bool:
    """Old log-probs >= -20 on the kept tokens: with log-probs <= 0 the log-ratio then never
    reaches verl's upper clamp (+20), which the fused op does not apply."""
    kept = old_log_prob[mask]
    return kept.numel() > 0 and bool((kept >= -20.0).all())


def _fused_policy_loss(h, weight, responses, mask, old_log_prob, advantages, weights, *, bias, low, high, clip_ratio_c,
                       entropy_coeff, temperature, vocab_size, teacher, teacher_kl_coef, mode, info):
    """`policy_loss` through `fused_linear_actor_loss` (3 lm-head GEMMs without a teacher,
    4 with one, gradients taken in the forward): the aggregation weights w_i become
    advantages A_i w_i / w_0 and a normalizer 1 / w_0 (w_0: the first kept token's).
    None where a kept token's log-ratio fell below verl's -20 clamp with A > 0."""
    from memopd.ops import fused_linear_actor_loss

    B, R = responses.shape
    w0 = float(weights[mask][0])
    # advantages and old log-probs in the weights' dtype, the one the op's log-probs come in
    # (never rounded to a bf16 head's dtype)
    adv = advantages.detach().to(weights.dtype)
    old = old_log_prob.detach().to(weights.dtype)
    scaled = torch.where(mask, adv * (weights / w0), 0.0)
    # verl clamps the log-ratio to [-20, 20] before exp; the fused op does not. With the old
    # log-probs >= -20 (`_ratio_bounded`) the two agree except where log_ratio < -20 with
    # A > 0 (a loss term below A e^-20, whose gradient verl's clamp sets to 0): checked
    # after the forward, and the caller then takes the recomputing path (None).
    t_h, t_w, t_b = teacher if teacher is not None else (None, None, None)
    out = fused_linear_actor_loss(
        h, weight, responses.reshape(-1), scaled.reshape(-1), torch.where(mask, old, 0.0).reshape(-1),
        student_bias=bias, teacher_hidden=None if t_h is None else t_h.detach(),
        teacher_weight=None if t_w is None else t_w.detach(), teacher_bias=None if t_b is None else t_b.detach(),
        mask=mask.reshape(-1), clip_eps=low, clip_eps_high=high, dual_clip=clip_ratio_c, entropy_coef=entropy_coeff,
        teacher_kl_coef=teacher_kl_coef if t_h is not None else None, temperature=temperature, vocab_size=vocab_size,
        normalizer=1.0 / w0, kl_normalizer=1.0 / w0)
    log_prob = out.logprobs.view(B, R)
    if bool((mask & (adv > 0) & (log_prob - old < -20.0)).any()):
        return None
    log_ratio, unclipped, clipped, pg_clip, pg_losses = _surrogate(log_prob, old, adv, low, high, clip_ratio_c)
    metrics = _surrogate_metrics(log_ratio, adv, mask, clipped, unclipped, pg_clip, clip_ratio_c)
    with torch.no_grad():
        metrics.update(pg_loss=agg_loss(pg_losses, mask, mode, **info),
                       entropy=agg_loss(out.entropy.view(B, R), mask, mode, **info))
        if teacher is not None:
            metrics["kl"] = agg_loss(out.kl.view(B, R), mask, mode, **info)
    return out.loss, metrics


def padded_to_packed(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, responses: Tensor,
                     response_mask: Optional[Tensor] = None):
    """A verl padded batch as a memopd `PackedBatch`: the real tokens of each row form one
    segment (at the row's own position ids) of a single packed row, and the actions are
    the response tokens where `response_mask` is set, each predicted from the token before
    it. Also returns the `[B, R]` bool mask of those actions (row-major order)."""
    from memopd.layout import AttentionMeta, PackedBatch, SegmentKind

    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be [B, L], got {tuple(input_ids.shape)} and "
                         f"{tuple(attention_mask.shape)}")
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids must be [B, L] = {tuple(input_ids.shape)}, got {tuple(position_ids.shape)} "
                         f"(multi-axis rope position ids, e.g. [B, 3, L], are not supported)")
    B, L = input_ids.shape
    R = responses.shape[1] if responses.dim() == 2 else -1
    if responses.dim() != 2 or responses.shape[0] != B or not 0 < R < L:
        raise ValueError(f"responses must be [B={B}, R] with 0 < R < L={L}, got {tuple(responses.shape)}")
    real = attention_mask.to(torch.bool)
    if not torch.equal(input_ids[:, L - R:][real[:, L - R:]], responses[real[:, L - R:]]):
        raise ValueError("responses differ from the last R columns of input_ids at real tokens")
    # packed index of every padded position (valid only where the token is real)
    packed_at = torch.cumsum(real.reshape(-1).long(), 0).view(B, L) - 1
    pred_pos = torch.arange(L - R - 1, L - 1, device=input_ids.device)
    acts = _response_mask(response_mask, responses) & real[:, L - R:] & real[:, pred_pos]
    lens = real.sum(1)
    cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).cpu()
    meta = AttentionMeta.from_segments(cu, [-1] * B, [SegmentKind.CALL] * B)
    T = int(cu[-1])
    rows, cols = acts.nonzero(as_tuple=True)
    pred_index = packed_at[:, pred_pos][rows, cols]
    action_index = packed_at[:, L - R:][rows, cols]
    A = int(rows.numel())
    dev = input_ids.device
    batch = PackedBatch(
        layout="padded_rows", input_ids=input_ids[real], position_ids=position_ids[real].long(), attn=meta.to(dev),
        cu_rows=torch.tensor([0, T], dtype=torch.int32, device=dev),
        action_mask=torch.zeros(T, dtype=torch.bool, device=dev).index_fill_(0, action_index, True),
        action_index=action_index, pred_index=pred_index, target_ids=responses[rows, cols],
        sample_logprobs=torch.full((A,), float("nan"), device=dev), teacher_mask=torch.ones(A, dtype=torch.bool, device=dev),
        traj_index=rows, call_index=torch.zeros_like(rows), token_index=cols,
        segment_traj=torch.arange(B, device=dev), segment_call=torch.zeros(B, dtype=torch.long, device=dev),
        num_trajectories=B)
    return batch, acts


def packed_log_prob(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    responses: Tensor,
    response_mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    vocab_size: Optional[int] = None,
    attention_backend: str = "auto",
):
    """`[B, R]` response log-probs (and entropy) of a Hugging Face causal LM on a verl
    padded batch, through memopd's packed forward and the fused op: no padded token is
    computed and no `[tokens x vocab]` logits are formed. 0 where no action (masked
    response tokens, padding)."""
    from memopd.hf import head_of, packed_forward
    from memopd.ops import fused_linear_logprob_entropy

    batch, acts = padded_to_packed(input_ids, attention_mask, position_ids, responses, response_mask)
    h = packed_forward(model, batch, output="hidden", attention_backend=attention_backend)
    head = head_of(model)
    out = fused_linear_logprob_entropy(h, head.weight, batch.target_ids, bias=head.bias,
                                       temperature=temperature / head.scale, vocab_size=vocab_size, ignore_index=None)
    log_probs = out.logprobs.new_zeros(acts.shape).masked_scatter(acts, out.logprobs)
    entropy = out.entropy.new_zeros(acts.shape).masked_scatter(acts, out.entropy) if calculate_entropy else None
    return log_probs, entropy
