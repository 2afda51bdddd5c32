"""Training a session's calls packed, with memopd's fused actor loss as verl's loss.

A micro-batch holds whole sessions (`session_micro_batches`: never a session split
across micro-batches). Its sessions are packed in memopd's aligned layout (one shared
prefix per session, each call at its restored positions and visibility:
`memopd.layout.AttentionMeta`) and run once; the loss is memopd's fused actor loss
(`memopd.ops.fused_linear_actor_loss`: PPO surrogate + entropy bonus + full-vocabulary
reverse KL to the teacher, gradients taken in the forward) on the hidden states of the
action-predicting positions.

`memopd_actor_loss(config, model_output, data=None, dp_group=None)` has the signature of
verl's loss functions (`verl.workers.utils.losses.ppo_loss`, set with
`ActorRolloutRefWorker.set_loss_fn(partial(memopd_actor_loss, config=actor_config))`).
It equals verl's `ppo_loss` on the same rows (the vanilla policy loss of
`core_algos.compute_policy_loss_vanilla` minus `entropy_coeff` x the aggregated entropy,
every `loss_agg_mode`, verl's `global_batch_info`) plus `teacher_kl_coef` x the
aggregated KL, with one difference verl's rows cannot express, the weighting
(`config.memopd_weighting` or `model_output["weighting"]`):

- "per_call" (default): each call is one of verl's rows; `loss_agg_mode` counts calls,
  so in the seq-mean modes a session of 3 calls weighs 3x a session of 1.
- "per_session": each session is one row (its calls' response tokens concatenated);
  the seq-mean modes count sessions, so every session weighs the same; the token modes
  are unchanged (token-sum and token-mean do not see rows), except that
  `seq-mean-token-sum-norm`'s default width is the longest session's token count.

A loss mode gives each row r a weight w_r per token (token-mean: dp/N, token-sum: dp,
seq-mean-token-sum: dp/G, seq-mean-token-mean: dp/(G n_r), seq-mean-token-sum-norm:
dp/(G S), with N the token count, G the row count, n_r the row's tokens, S the width);
the fused op is called once per distinct weight with normalizer 1/w.

`install_packed_loss_forward(model)` makes `model(memopd_batch=..., memopd_loss=fn)` run
the packed forward and `fn(hidden, head)` inside the model's own forward, where FSDP /
ZeRO-3 have gathered the lm_head (the fused op reads the whole weight in forward and
backward). `MemopdFSDPEngine` (registered with verl's `EngineRegistry` by
`register_engine()`, CUDA only) calls it from `forward_step`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from memopd.hf import LMHead, head_of, packed_forward
from memopd.layout import PackedBatch
from memopd.ops import fused_linear_actor_loss
from memopd.packing import pack
from memopd.records import Trajectory

from .hooks import LOSS_AGG_MODES
from .teacher import session_groups

__all__ = ["WEIGHTINGS", "SessionInputs", "session_micro_batches", "session_inputs", "token_weights",
           "memopd_actor_loss", "make_loss_fn", "install_packed_loss_forward", "register_engine"]

WEIGHTINGS = ("per_call", "per_session")


def session_micro_batches(sessions: Sequence[Trajectory], max_tokens: int) -> list[list[int]]:
    """Session indices per micro-batch, in order, under `max_tokens` packed tokens each;
    a session is never split."""
    return session_groups(sessions, max_tokens)


@dataclass
class SessionInputs:
    """One micro-batch of sessions, packed, with its per-action inputs in the batch's
    (session, call, k) order."""

    sessions: list[Trajectory]
    batch: PackedBatch
    old_log_probs: torch.Tensor  # [A]
    advantages: torch.Tensor  # [A]
    teacher_hidden: torch.Tensor | None = None  # [A, Ht]


def session_inputs(sessions: Sequence[Trajectory], old_log_probs: Sequence[Sequence[torch.Tensor]],
                   advantages: Sequence[Sequence[torch.Tensor]], teacher_hidden=None, *, max_tokens: int = 8192
                   ) -> SessionInputs:
    """Pack `sessions` (aligned: restored positions and visibility) and lay the per-call
    tensors (`x[s][t]`: [A_t] for call t of session s, as verl's rows hold them; teacher
    hidden states [A_t, H]) out in the batch's action order."""
    sessions = list(sessions)
    batch = pack(sessions, "aligned", max_tokens)
    for name, x in (("old_log_probs", old_log_probs), ("advantages", advantages), ("teacher_hidden", teacher_hidden)):
        if x is None:
            continue
        for s, tr in enumerate(sessions):
            if len(x[s]) != len(tr.invocations):
                raise ValueError(f"{name}: session {s} has {len(tr.invocations)} calls, got {len(x[s])} tensors")
            for t, inv in enumerate(tr.invocations):
                if x[s][t].shape[0] != len(inv.action_ids):
                    raise ValueError(f"{name}: session {s} call {t} has {len(inv.action_ids)} action tokens, got "
                                     f"{tuple(x[s][t].shape)}")

    def flat(x):  # pack() orders entries (session, call, k): the concatenation in that order
        return None if x is None else torch.cat([c for per in x for c in per])

    return SessionInputs(sessions, batch, flat(old_log_probs), flat(advantages), flat(teacher_hidden))


def _cfg(config, key, default=None):
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    v = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if v is None else v


def token_weights(batch: PackedBatch, sessions: Sequence[Trajectory], loss_agg_mode: str, weighting: str = "per_call",
                  global_batch_info: dict | None = None) -> torch.Tensor:
    """[A] weight of each action token's loss: the loss is sum_i w_i l_i (module doc)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; expected one of {WEIGHTINGS}")
    info = dict(global_batch_info or {})
    dp = info.get("dp_size", 1) or 1
    A = int(batch.target_ids.shape[0])
    traj, call = batch.traj_index.cpu(), batch.call_index.cpu()
    if weighting == "per_call":
        offsets = torch.tensor([0] + [len(tr.invocations) for tr in sessions]).cumsum(0)
        row = offsets[traj] + call
    else:
        row = traj
    n_rows = int(row.max()) + 1 if A else 0
    counts = torch.bincount(row, minlength=n_rows).double()
    if loss_agg_mode == "token-sum":
        w = torch.full((A,), float(dp), dtype=torch.float64)
    elif loss_agg_mode == "token-mean":
        n = info.get("batch_num_tokens")
        if n is None and dp > 1:
            raise ValueError("loss_agg_mode='token-mean' with dp_size > 1 needs batch_num_tokens (global count)")
        w = torch.full((A,), dp / float(n if n is not None else max(A, 1)), dtype=torch.float64)
    else:
        g = info.get("global_batch_size")
        if g is None and dp > 1:
            raise ValueError(f"loss_agg_mode={loss_agg_mode!r} with dp_size > 1 needs global_batch_size")
        g = float(g if g is not None else max(int((counts > 0).sum()), 1))
        if loss_agg_mode == "seq-mean-token-sum":
            w = torch.full((A,), dp / g, dtype=torch.float64)
        elif loss_agg_mode == "seq-mean-token-mean":
            w = dp / (g * counts[row])
        else:  # seq-mean-token-sum-norm: verl divides by loss_scale_factor or the padded width
            width = info.get("loss_scale_factor")
            width = float(width if width is not None else counts.max())
            w = torch.full((A,), dp / (g * width), dtype=torch.float64)
    return w


def memopd_actor_loss(config, model_output: dict, data: Any = None, dp_group=None):
    """verl's loss-function signature; `(loss, metrics)`.

    model_output: "hidden" [A, H] (the student's last hidden states at the
    action-predicting positions of `inputs.batch`), "head" (`memopd.hf.LMHead`),
    "inputs" (`SessionInputs`), optional "teacher_head" (`LMHead`), "weighting".
    config: verl's actor config (`clip_ratio`, `clip_ratio_low`, `clip_ratio_high`,
    `clip_ratio_c`, `entropy_coeff`, `loss_agg_mode`, `global_batch_info`) plus
    `teacher_kl_coef` (default 0), `temperature` (default 1) and `memopd_weighting`.
    `data` and `dp_group` are verl's and unused: the per-action inputs come packed."""
    from memopd.trainer.modules import Actor

    inputs: SessionInputs = model_output["inputs"]
    h, head = model_output["hidden"], model_output["head"]
    clip = _cfg(config, "clip_ratio", 0.2)
    low, high = _cfg(config, "clip_ratio_low", clip), _cfg(config, "clip_ratio_high", clip)
    dual = _cfg(config, "clip_ratio_c", 3.0)
    ent_coef = float(_cfg(config, "entropy_coeff", 0.0))
    kl_coef = float(_cfg(config, "teacher_kl_coef", 0.0))
    mode = _cfg(config, "loss_agg_mode", "token-mean")
    weighting = model_output.get("weighting") or _cfg(config, "memopd_weighting", "per_call")
    info = _cfg(config, "global_batch_info", None)
    info = dict(info) if info is not None else {}
    temperature = float(_cfg(config, "temperature", 1.0)) / head.scale
    w = token_weights(inputs.batch, inputs.sessions, mode, weighting, info)
    th = tw = tb = None
    teacher_head: LMHead | None = model_output.get("teacher_head")
    if inputs.teacher_hidden is not None:
        th, tw, tb = Actor._teacher_operands(head, inputs.teacher_hidden.to(h.device), teacher_head, h.dtype)
    targets = inputs.batch.target_ids.to(h.device)
    adv = inputs.advantages.to(h.device, h.dtype)
    old = inputs.old_log_probs.to(h.device, h.dtype)
    loss = h.new_zeros(())
    per_token = {k: h.new_zeros(h.shape[0]) for k in ("logprobs", "entropy", "kl", "clipped")}
    for value in torch.unique(w).tolist():
        sel = (w == value).nonzero().flatten().to(h.device)
        out = fused_linear_actor_loss(
            h.index_select(0, sel), head.weight, targets.index_select(0, sel), adv.index_select(0, sel),
            old.index_select(0, sel), teacher_hidden=None if th is None else th.index_select(0, sel),
            teacher_weight=tw, student_bias=head.bias, teacher_bias=tb, clip_eps=low, clip_eps_high=high,
            dual_clip=dual, entropy_coef=ent_coef, teacher_kl_coef=kl_coef if th is not None else None,
            temperature=temperature, normalizer=1.0 / value, kl_normalizer=1.0 / value)
        loss = loss + out.loss
        for k in per_token:
            per_token[k].index_copy_(0, sel, getattr(out, k).to(h.dtype))
    with torch.no_grad():
        wd = w.to(h.device, h.dtype)
        metrics = {
            "actor/entropy": float((per_token["entropy"] * wd).sum()),
            "actor/pg_clipfrac": float(per_token["clipped"].mean()) if h.shape[0] else 0.0,
            "actor/ppo_kl": float((old - per_token["logprobs"]).mean()) if h.shape[0] else 0.0,
            "memopd/sessions": len(inputs.sessions),
            "memopd/calls": sum(len(tr.invocations) for tr in inputs.sessions),
        }
        if th is not None:
            metrics["memopd/teacher_kl"] = float((per_token["kl"] * wd).sum())
    return loss, metrics


def make_loss_fn(actor_config, settings: dict, temperature: float = 1.0):
    """`memopd_actor_loss` bound to verl's actor config with the `memopd.loss` settings
    (`teacher_kl_coef`, `weighting`) and the rollout temperature: what
    `ActorRolloutRefWorker.set_loss_fn` takes in place of verl's `ppo_loss`."""
    from functools import partial

    from omegaconf import OmegaConf

    loss = dict(settings.get("loss") or {})
    weighting = loss.get("weighting", "per_call")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"memopd.loss.weighting={weighting!r}; choose one of {WEIGHTINGS}")
    base = OmegaConf.create(OmegaConf.to_container(actor_config, resolve=True)) if not isinstance(actor_config, dict) \
        else OmegaConf.create(actor_config)
    merged = OmegaConf.merge(base, {"teacher_kl_coef": float(loss.get("teacher_kl_coef", 0.0)),
                                    "memopd_weighting": weighting, "temperature": float(temperature)})
    return partial(memopd_actor_loss, config=merged)


class _PackedLossForward:
    """The model's forward, extended: `memopd_batch=` runs the packed forward and
    `memopd_loss(hidden, head)` inside it (module doc)."""

    def __init__(self, model, forward, head: LMHead, attention_backend: str):
        self.model, self.forward, self.attention_backend = model, forward, attention_backend
        self.scale = head.scale

    def __call__(self, *args, memopd_batch: PackedBatch | None = None, memopd_loss=None, **kwargs):
        if memopd_batch is None:
            return self.forward(*args, **kwargs)
        h = packed_forward(self.model, memopd_batch, output="hidden", attention_backend=self.attention_backend)
        lm_head = self.model.get_output_embeddings()
        head = LMHead(lm_head.weight, getattr(lm_head, "bias", None), self.scale)
        return memopd_loss(h, head) if memopd_loss is not None else h


def install_packed_loss_forward(model, attention_backend: str = "auto"):
    """Extend `model.forward` in place (module doc); the head's logit scale is measured now,
    before any sharding. Returns the model."""
    if not isinstance(model.forward, _PackedLossForward):
        model.forward = _PackedLossForward(model, model.forward, head_of(model), attention_backend)
    return model


def register_engine(backend: str = "memopd_fsdp2"):
    """Register `MemopdFSDPEngine` with verl's `EngineRegistry` under `backend`
    (model_type "language_model", devices cuda and npu, as verl's FSDP engines) and return
    the class. Needs CUDA to run: verl's FSDP engine initialises its device mesh and model
    on the accelerator."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from .rows import row_record, sessions_from_rows
    from .teacher import TEACHER_KEY

    registered = EngineRegistry._engines.get("language_model", {}).get(backend) if hasattr(EngineRegistry, "_engines") else None
    if registered is not None:
        return next(iter(registered.values())) if isinstance(registered, dict) else registered

    class MemopdFSDPEngine(FSDPEngineWithLMHead):
        """verl's FSDP engine whose micro-batch is whole memopd sessions, run packed with
        the fused loss inside the model's forward."""

        def forward_step(self, micro_batch, loss_function, forward_only):
            extra = micro_batch["extra_fields"]
            rows = [{"extra_fields": e} for e in (extra.tolist() if hasattr(extra, "tolist") else extra)]
            sessions, ids = sessions_from_rows(rows)
            where = {(row_record(r)["session_id"], row_record(r)["call"]): i for i, r in enumerate(rows)}
            old = micro_batch["old_log_probs"]
            adv = micro_batch["advantages"]
            per = [[where[(sid, t)] for t in range(len(tr.invocations))] for sid, tr in zip(ids, sessions)]
            teacher = None
            if all(TEACHER_KEY in rows[i]["extra_fields"] for calls in per for i in calls):
                teacher = [[rows[i]["extra_fields"][TEACHER_KEY].hidden for i in calls] for calls in per]
            inputs = session_inputs(sessions, [[old[i] for i in calls] for calls in per],
                                    [[adv[i] for i in calls] for calls in per], teacher)
            model = install_packed_loss_forward(self.module)

            def loss_in_forward(h, head):
                return loss_function(model_output={"hidden": h, "head": head, "inputs": inputs,
                                                   "teacher_head": getattr(self, "memopd_teacher_head", None)},
                                     data=micro_batch, dp_group=self.get_data_parallel_group())

            loss, metrics = model(memopd_batch=inputs.batch.to(next(model.parameters()).device),
                                  memopd_loss=loss_in_forward)
            return loss, {"model_output": {}, "loss": loss.detach().item(), "metrics": metrics}

    EngineRegistry.register(model_type="language_model", backend=[backend], device=["cuda", "npu"])(MemopdFSDPEngine)
    return MemopdFSDPEngine

