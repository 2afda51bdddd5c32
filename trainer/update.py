"""One PPO + OPD update on a batch of recorded trajectories.

`score(...)` runs the no-grad passes once per rollout batch (old and reference
log-probs, values, the teacher's hidden states under the arm's layout, token rewards,
GAE: docs/design.md §7.3); `update(...)` runs `ppo_epochs` passes over shuffled
minibatches, each packed and cut into micro-batches under the token budget, with the
fused actor loss and the clipped value loss (§7.4), normalised over the whole minibatch
on all ranks (§7.5).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from memopd.errors import UserError
from memopd.hf import LMHead, head_of, packed_forward
from memopd.packing import pack
from memopd.records import Trajectory

from .modules import Actor, Critic, PPOInputs, scored_rows, token_logprobs
from .ppo import gae, policy_loss, ratio_stats, rollout_is_weights, token_rewards, value_loss, whiten
from .settings import PPOSettings
from .stats import (
    ACTOR_GRAD_NORM,
    APPROX_KL,
    CLIP_FRAC,
    CRITIC_GRAD_NORM,
    ENTROPY,
    FIRST_RATIO_MAXDEV,
    KL_TEACHER,
    LOSS_STATS,
    OPTIMIZER_STEPS,
    PG_LOSS,
    STEP_STATS,
    VF_LOSS,
)

__all__ = ["Scored", "UpdateSettings", "score", "update", "teacher_mask_of", "entry_offsets", "check_token_ids", "check_sampling",
           "pack_layout"]


@dataclass
class Scored:
    """Per action-domain entry of the rollout batch, in (trajectory, call, k) order."""

    logp_old: torch.Tensor
    logp_ref: torch.Tensor | None
    values: torch.Tensor
    rewards: torch.Tensor
    kl_penalty: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    teacher_hidden: torch.Tensor | None
    offsets: torch.Tensor  # [B, max_calls]: global entry id of (b, t, k=0)
    sample_dlogp: float  # max |logp_old - recorded sampling log-prob| (RCE in training)
    is_sampled: torch.Tensor  # False on the context copies of a naive action domain
    # the sampler's recorded log-prob per entry (NaN where none): the mismatch metric and rollout_is
    sample_logprobs: torch.Tensor | None = None
    # the student's log-probs of the same entries packed in the flatten layout (mismatch_flatten)
    logp_flatten: torch.Tensor | None = None
    # where the teacher speaks: None (everywhere) for a model; a reader teacher
    # (memopd.trainer.experiments.ruleteacher.RuleTeacher) is silent where its rule is, masked out of the OPD term
    teacher_speaks: torch.Tensor | None = None
    # a served teacher's top-k answer instead of hidden states (teacher_topk=K): ([A, K] ids, [A, K] log-probs)
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None


def entry_offsets(batch, trajs: Sequence[Trajectory]) -> torch.Tensor:
    """[B, max_calls]: the entry id of (b, t, k=0) in `batch` (entries are in (b, t, k)
    order with k = 0, 1, ... inside each call), so that entry (b, t, k) of any batch
    packed from a subset of `trajs` with the same action domain is offsets[b, t] + k."""
    n_calls = max(len(tr.invocations) for tr in trajs)
    out = torch.full((len(trajs), n_calls), -1, dtype=torch.long)
    first = batch.token_index == 0
    out[batch.traj_index[first], batch.call_index[first]] = torch.nonzero(first).flatten()
    return out


def check_token_ids(trajs: Sequence[Trajectory], vocab_size: int, embedding_rows: int) -> None:
    """Every sampled id must be a row both heads score (< vocab_size) and every input id
    a row of every embedding; checked on the host before any kernel runs, on any device
    (an out-of-range id inside a CUDA kernel is a device assert or a silent wrong row)."""
    for b, tr in enumerate(trajs):
        for t, inv in enumerate(tr.invocations):
            bad = [x for x in inv.action_ids if not 0 <= x < vocab_size]
            if bad:
                raise UserError(
                    f"trajectory {b} (task {tr.task_id!r}), call {t}: sampled id(s) {bad[:5]} outside the scored "
                    f"vocabulary [0, {vocab_size}) (the tokenizer's ids; rows past it are lm_head padding that "
                    "the sampler never emits); were these trajectories sampled from another model or tokenizer?")
            ids = (*inv.prefix_ids, *inv.context_ids)
            if ids and not (0 <= min(ids) and max(ids) < embedding_rows):
                bad = [x for x in ids if not 0 <= x < embedding_rows]
                raise UserError(f"trajectory {b} (task {tr.task_id!r}), call {t}: input id(s) {bad[:5]} outside "
                                f"the models' embeddings [0, {embedding_rows})")


def check_sampling(trajs: Sequence[Trajectory], temperature: float) -> None:
    """Trajectories that record their sampling settings must have been drawn at the
    temperature the trainer scores at, untruncated (top_p = 1)."""
    for b, tr in enumerate(trajs):
        rec = tr.info.get("sampling")
        if not isinstance(rec, dict):
            continue
        t, p = rec.get("temperature"), rec.get("top_p", 1.0)
        if t is not None and not math.isclose(float(t), temperature, rel_tol=1e-9):
            raise UserError(f"trajectory {b} (task {tr.task_id!r}) was sampled at temperature {t}, but the trainer "
                            f"scores at temperature={temperature}: set temperature={t}")
        if p is not None and float(p) < 1.0:
            raise UserError(f"trajectory {b} (task {tr.task_id!r}) was sampled with top_p={p}: its recorded log-probs "
                            "are of a truncated distribution that PPO cannot train on; sample with top_p=1")


def pack_layout(trajs, max_tokens, action_domain="exact", layout="aligned"):
    """The packed batch of a layout; a `memopd.rce.BROKEN_VARIANTS` name is the aligned
    batch with that half of its state broken (the negative-control arms' teacher states)."""
    from memopd.rce import BROKEN_VARIANTS, broken_batch

    if layout in BROKEN_VARIANTS:
        return broken_batch(pack_layout(trajs, max_tokens, action_domain), layout)
    return pack(trajs, layout=layout, max_tokens=max_tokens, share_prefix="group", action_domain=action_domain)


@torch.no_grad()
def _per_action(fn, batch, max_tokens) -> torch.Tensor:
    """Apply `fn(micro_batch) -> [A_mb, ...]` over micro-batches, in action order."""
    parts = []
    ids = []
    for mb in batch.micro_batches(max_tokens):
        parts.append(fn(mb).float())
        ids.append(mb.action_id)
    out = torch.cat(parts)
    order = torch.cat(ids).argsort()
    return out[order.to(out.device)]


@torch.no_grad()
def score(
    actor: Actor,
    critic: Critic,
    ref_lm,
    teacher_lm,
    trajs: Sequence[Trajectory],
    *,
    teacher_layout: str | None,
    max_tokens: int,
    ppo: PPOSettings,
    action_domain: str = "exact",
    flatten_logp: bool = False,
    teacher_topk: int = 0,
    layout: str = "aligned",
) -> Scored:
    """No-grad passes over a rollout batch. Log-probs are under `actor.scoring` (the
    sampling temperature and vocabulary), for the student and the reference alike.
    `flatten_logp`: also the student's log-probs of the same entries in the flatten layout
    (one more forward; the mismatch metric's misaligned counterpart). `teacher_topk` > 0 (a
    served teacher only): its top-k log-probs at the scoring temperature instead of hidden states.
    `layout`: the trainer's packing layout (`TrainConfig.pack_layout`); a teacher of the same
    layout reads the trainer's batch, packed once."""
    # a served teacher (memopd.teacher_client.ServedTeacher) has a `submit` and reports its embedding rows
    served = getattr(teacher_lm, "submit", None) if teacher_layout else None
    models = [m for m in (actor.lm, ref_lm, teacher_lm if teacher_layout else None) if m is not None]
    check_token_ids(trajs, scored_rows(actor.scoring, head_of(actor.lm)),
                    min(int(m.embedding_rows if m is teacher_lm and served else m.get_input_embeddings().weight.shape[0])
                        for m in models))
    check_sampling(trajs, actor.scoring.temperature)
    pending = None
    same = teacher_layout == layout  # the teacher reads the trainer's own batch: packed once
    batch = pack_layout(trajs, max_tokens, action_domain, layout) if same or served is None else None
    if served is not None:  # cut and sent in the background (another layout packed there too) while the passes run
        topk = dict(output="topk", k=teacher_topk, temperature=actor.scoring.temperature,
                    vocab_size=scored_rows(actor.scoring, head_of(actor.lm))) if teacher_topk else {}
        pending = served(batch if same else lambda: pack_layout(trajs, max_tokens, action_domain, layout=teacher_layout),
                         max_tokens, **topk)
    if batch is None:
        batch = pack_layout(trajs, max_tokens, action_domain, layout)

    def logp_of(lm):
        def fn(mb):
            h = packed_forward(lm, mb, output="hidden", attention_backend=actor.attention_backend)
            return token_logprobs(lm, h, mb.target_ids, actor.scoring)
        return fn

    logp_old = _per_action(logp_of(actor.lm), batch, max_tokens)
    logp_ref = _per_action(logp_of(ref_lm), batch, max_tokens) if ref_lm is not None else None
    values = _per_action(critic, batch, max_tokens)
    teacher_hidden = teacher_speaks = topk_answer = None
    if pending is not None and teacher_topk:
        topk_answer = tuple(t.to(logp_old.device) for t in pending.result())
    elif pending is not None:  # zero outside the teacher mask, where the OPD term is masked out
        teacher_hidden = pending.result().to(logp_old.device)
    elif teacher_lm is not None and teacher_layout is not None:
        # same action domain: entry (b, t, k) is the same token under either layout
        tbatch = batch if same else pack_layout(trajs, max_tokens, action_domain, layout=teacher_layout)
        reader = getattr(teacher_lm, "read_packed", None)
        if reader is not None:  # a teacher that reads the visible ids: [A, H + 1], the last column where it speaks
            both = _per_action(reader, tbatch, max_tokens)
            teacher_hidden, teacher_speaks = both[:, :-1].contiguous(), both[:, -1] > 0
        else:
            teacher_hidden = _per_action(
                lambda mb: packed_forward(teacher_lm, mb, output="hidden", attention_backend=actor.attention_backend),
                tbatch, max_tokens,
            )
    ti = batch.traj_index.to(logp_old.device)
    final = torch.tensor([float(tr.reward) for tr in trajs], device=logp_old.device)
    rewards, pen = token_rewards(final, ti, logp_old, logp_ref, ppo.ref_kl_coef)
    adv, ret = gae(rewards, values, ti, ppo.gamma, ppo.lam)
    recorded = batch.sample_logprobs.to(logp_old.device)
    known = ~torch.isnan(recorded)
    sample_dlogp = float((logp_old[known] - recorded[known]).abs().max()) if bool(known.any()) else math.nan
    logp_flat = None
    if flatten_logp:  # same action domain: entry (b, t, k) is the same token in either layout
        logp_flat = _per_action(logp_of(actor.lm), pack_layout(trajs, max_tokens, action_domain, layout="flatten"), max_tokens)
    return Scored(logp_old, logp_ref, values, rewards, pen, adv, ret, teacher_hidden, entry_offsets(batch, trajs),
                  sample_dlogp, batch.is_sampled.clone(), recorded, logp_flat, teacher_speaks, topk_answer)


def teacher_mask_of(scored: Scored, mb, gid: torch.Tensor) -> torch.Tensor:
    """The OPD term's mask of micro-batch `mb` (entries `gid` of `scored`): its teacher
    mask, less the positions where a reader teacher is silent."""
    tm = mb.teacher_mask.to(gid.device)
    if scored.teacher_speaks is not None:
        tm = tm & scored.teacher_speaks.to(gid.device).index_select(0, gid)
    return tm


@dataclass(frozen=True)
class UpdateSettings:
    """How one PPO + OPD update runs (`TrainConfig` holds their meaning and defaults): the
    loss hyperparameters `ppo` as the config's section, the epochs, minibatches and packing."""

    ppo: PPOSettings
    ppo_epochs: int
    minibatches: int
    max_tokens: int
    action_domain: str
    pack_layout: str = "aligned"  # the trainer's packing layout (TrainConfig.pack_layout)
    whiten_advantages: bool = True
    rollout_is: str = "none"  # none | tis | mask: the sampler-mismatch correction (ppo.rollout_is_weights)
    rollout_is_cap: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> "UpdateSettings":
        names = {f.name for f in dataclasses.fields(cls)} - {"whiten_advantages"}
        return cls(**{n: getattr(cfg, n) for n in names})


def update(
    actor_backend,
    critic_backend,
    trajs: Sequence[Trajectory],
    scored: Scored,
    settings: UpdateSettings,
    *,
    teacher_head: LMHead | None,
    generator: torch.Generator,
) -> dict:
    """PPO epochs over minibatches; returns averaged statistics."""
    ppo_epochs, minibatches, max_tokens = settings.ppo_epochs, settings.minibatches, settings.max_tokens
    value_clip, whiten_advantages, action_domain = settings.ppo.value_clip, settings.whiten_advantages, settings.action_domain
    has_teacher = scored.teacher_hidden is not None or scored.teacher_topk is not None
    coefs = settings.ppo.loss_coefs(has_teacher=has_teacher)  # derived once, shared by every micro-batch
    # global statistics: data-parallel ranks normalise as one process with the whole batch
    adv_all = whiten(scored.advantages, reduce_sum=actor_backend.all_reduce_sum) if whiten_advantages else scored.advantages
    is_stats = {}
    if settings.rollout_is != "none":
        # constant per-token weights of the surrogate, taken through the advantages (w >= 0)
        recorded = scored.sample_logprobs if scored.sample_logprobs is not None else torch.full_like(scored.logp_old, math.nan)
        w, is_stats = rollout_is_weights(scored.logp_old, recorded.to(scored.logp_old.device), settings.rollout_is,
                                         settings.rollout_is_cap)
        adv_all = adv_all * w.to(adv_all.device)
    device = scored.logp_old.device
    stats = dict.fromkeys(LOSS_STATS + STEP_STATS, 0.0)
    # max |ratio - 1| on the first minibatch, before any optimiser step: 0 up to rounding
    # when training scores exactly the distribution the sampler drew from
    first_dev = 0.0
    n_updates = 0
    B = len(trajs)
    world = actor_backend.world_size
    for _ in range(ppo_epochs):
        perm = torch.randperm(B, generator=generator).tolist()
        chunks = [perm[i::minibatches] for i in range(minibatches)]
        for chunk in chunks:
            if not chunk:
                continue
            chunk = sorted(chunk)
            sub = [trajs[i] for i in chunk]
            batch = pack_layout(sub, max_tokens, action_domain, settings.pack_layout)
            gmap = torch.tensor(chunk, dtype=torch.long)
            mbs = batch.micro_batches(max_tokens)
            # ZeRO runs collectives inside every backward: all ranks make the same number
            # of backward calls; a rank with fewer micro-batches repeats its last one at
            # zero weight
            n_real = len(mbs)
            mbs = mbs + [mbs[-1]] * (actor_backend.all_reduce_max(n_real) - n_real)
            gid_all = (scored.offsets[gmap[batch.traj_index], batch.call_index] + batch.token_index).to(device)
            counts = torch.tensor([float(batch.num_actions), float(teacher_mask_of(scored, batch, gid_all).sum())])
            counts = actor_backend.all_reduce_sum(counts)
            n_act, n_t = float(counts[0]), float(counts[1])
            agg = dict.fromkeys(LOSS_STATS, 0.0)
            for j, mb in enumerate(mbs):
                last = j == len(mbs) - 1
                weight = 1.0 if j < n_real else 0.0
                gid = scored.offsets[gmap[mb.traj_index], mb.call_index] + mb.token_index
                gid = gid.to(device)
                th = scored.teacher_hidden.index_select(0, gid) if scored.teacher_hidden is not None else None
                topk = tuple(t.index_select(0, gid) for t in scored.teacher_topk) if scored.teacher_topk is not None else None
                tm = teacher_mask_of(scored, mb, gid)
                ppo = PPOInputs(scored.logp_old[gid], adv_all[gid], tm, coefs, normalizer=max(n_act, 1.0) / world,
                                kl_normalizer=max(n_t, 1.0) / world)
                # one fused op: PPO surrogate + entropy bonus + teacher KL, gradients in its forward
                out = actor_backend.module(mb, th, teacher_head, ppo=ppo, **({"teacher_topk": topk} if topk else {}))
                actor_backend.backward(out.loss * weight, last_micro_batch=last)
                with torch.no_grad():  # per-token statistics from the op's detached outputs
                    pg, _ = policy_loss(out.logprobs, ppo.logp_old, ppo.advantages, coefs.clip_eps)
                    # the clip decisions the loss itself took (its clip range, dual clip included)
                    st = ratio_stats(out.ratio, out.logprobs - ppo.logp_old, out.clipped)
                tm = tm.float()
                v = critic_backend.module(mb)
                vl = value_loss(v, scored.values[gid], scored.returns[gid], value_clip)
                critic_backend.backward(vl.sum() * (world / max(n_act, 1)) * weight, last_micro_batch=last)
                w = weight * mb.num_actions / max(n_act / world, 1)
                with torch.no_grad():
                    agg[PG_LOSS] += float(pg.mean()) * w if pg.numel() else 0.0
                    agg[VF_LOSS] += float(vl.mean()) * w if vl.numel() else 0.0
                    agg[ENTROPY] += float(out.entropy.mean()) * w if pg.numel() else 0.0
                    agg[KL_TEACHER] += float((out.kl * tm).sum() / max(float(tm.sum()), 1.0)) * w if has_teacher else 0.0
                agg[CLIP_FRAC] += float(st.clip_frac) * w
                agg[APPROX_KL] += float(st.approx_kl) * w
                if n_updates == 0 and weight and out.ratio.numel():
                    first_dev = max(first_dev, float((out.ratio - 1).abs().max()))
            stats[ACTOR_GRAD_NORM] += actor_backend.step()
            stats[CRITIC_GRAD_NORM] += critic_backend.step()
            # each rank's sums are token-weighted shares of the global mean: sum over ranks
            red = actor_backend.all_reduce_sum(torch.tensor(list(agg.values()), dtype=torch.float64)) / world
            for name, v in zip(agg, red.tolist()):
                stats[name] += v
            n_updates += 1
    return ({k: v / max(n_updates, 1) for k, v in stats.items()}
            | {OPTIMIZER_STEPS: n_updates, FIRST_RATIO_MAXDEV: actor_backend.all_reduce_max(first_dev)}
            | {f"rollout_is_{k}": v for k, v in is_stats.items()})
