"""The manipulation check run before any arm: does the teacher care which view it is shown?

If the teacher prefers the same actions under the aligned calls (`memopd`) and the
flattened history (`persistent`), the two arms get the same distillation target and no
result of theirs can tell the views apart. `manipulation_check(cfg, bundle)` measures it
on the SFT student's own rollouts of the training stream (Q2 by default), sampled as in
training, through the trainer's own code paths: `update.score` gives the teacher's
states under each layout (and the step-0 advantages), `Actor` (the fused ops) gives
KL(student ‖ teacher) per token and the actor loss whose gradients are compared; there
is no second KL here. It reports

- `top1`: the share of action tokens whose teacher top-1 differs between the two views,
  overall, at information-gap calls (`memopd.trainer.experiments.infogap.information_gap_calls`) and
  elsewhere, and by token role (memory / search / answer); and the share of
  information-gap calls where it differs at one token or more (`gap_calls_any_token`);
- `kl`: mean KL(s ‖ T_flat), mean KL(s ‖ T_aligned) and their difference;
- `grad`: the norms of the step-0 gradients of the PPO part of the actor loss and of the
  OPD term under each view, and the cosine of the two OPD gradients;
- `opd_coef_matched`: λ such that ‖λ ∇OPD‖ = ‖∇PPO‖ at step 0 (∇OPD: the mean of the two
  views' norms, so both teacher arms get the same λ);
- `grad_gap_calls`: the same two OPD gradients over the information-gap calls' tokens
  alone, and their cosine;
- `ceiling`: the disagreement a perfect imitator of the rational rule would show on the
  same action tokens (`memopd.trainer.experiments.infogap.view_disagreement_ceiling`, bounds of it);
- `controls`: for the negative-control arms' teacher states (aligned calls with row-global
  positions, or with one causal segment per row), the same figures against the aligned
  state over all action tokens: top-1 disagreement, KL(s ‖ T_broken) and the cosine of
  the OPD gradients. How far a broken state moves the teacher's signal tells what the
  negative control can show at best;
- `gate`: passed when, at the information-gap calls, the disagreement is at least
  `GATE_MIN_TOP1` of their action tokens and the cosine of the two views' OPD gradients
  over their tokens is below `GATE_MAX_COSINE`; else the arms cannot be told apart.

Why the gate is stated on the information-gap calls (`GATE_STATEMENT`): the rule's two
views act alike at every other call, so over all action tokens a perfect imitator of the
rule disagrees on at most the information-gap calls' share of them. On the plain
expert's held-out Q2 episodes of the `info-gap` world (200 sets, seed 0) that share is
12.0% of the action tokens, and from the point where the two views' actions part only
7.1% (1.0% where both views are defined), and on the SFT student's own Q2 samples
10.5% (1.2%): a gate of 10% over all tokens could be passed at best by a teacher that
disagrees nearly everywhere the upper bound counts, and the other calls' identical targets
hold the overall gradient cosine near 1 whatever the teacher does at the gap calls. At
the information-gap calls the same imitator disagrees on 8.4-59% of their tokens, so
the thresholds keep their values and are applied there. The overall figures are still
reported, with their ceiling.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

__all__ = ["manipulation_check", "check_rollouts", "gate", "format_check", "GATE_MIN_TOP1", "GATE_MAX_COSINE", "GATE_STATEMENT"]

GATE_MIN_TOP1 = 0.10
GATE_MAX_COSINE = 0.8
GATE_STATEMENT = ("at the information-gap calls: the teacher's top-1 differs between the aligned and the flattened "
                  f"views on at least {100 * GATE_MIN_TOP1:.0f}% of their action tokens, and the two views' OPD "
                  f"gradients over their tokens have cosine below {GATE_MAX_COSINE} (stated on these calls because "
                  "over all action tokens the rule's own views differ on less than the threshold; see the ceiling)")
VIEWS = (("aligned", "aligned"), ("flatten", "flatten"))  # (name, teacher layout)
# the negative-control arms' teacher states (memopd.rce), measured against the aligned one
CONTROL_VIEWS = (("positions_broken", "positions_broken"), ("visibility_broken", "visibility_broken"))
SCORED_VIEWS = VIEWS + CONTROL_VIEWS


def gate(top1_gap: float | None, cosine_gap: float | None) -> dict:
    """The gate's verdict on a check's disagreement at the information-gap calls and the
    cosine of the two views' OPD gradients over their tokens (None: the check's rollouts
    hold no information-gap call, or a gradient is zero)."""
    reasons = []
    if top1_gap is None:
        reasons.append("the check's rollouts hold no information-gap call")
    elif not top1_gap >= GATE_MIN_TOP1:
        reasons.append(f"at the information-gap calls the teacher's top-1 differs between the views at "
                       f"{100 * top1_gap:.1f}% of action tokens (needs >= {100 * GATE_MIN_TOP1:.0f}%)")
    if cosine_gap is None or math.isnan(cosine_gap):
        reasons.append("no cosine of the two views' OPD gradients at the information-gap calls")
    elif not cosine_gap < GATE_MAX_COSINE:
        reasons.append(f"at the information-gap calls the two views' OPD gradients have cosine {cosine_gap:.3f} "
                       f"(needs < {GATE_MAX_COSINE})")
    return {"statement": GATE_STATEMENT, "min_top1": GATE_MIN_TOP1, "max_cosine": GATE_MAX_COSINE,
            "passed": not reasons, "reasons": reasons}


def _share(x: torch.Tensor, mask: torch.Tensor) -> float | None:
    n = int(mask.sum())
    return float(x[mask].float().mean()) if n else None


def _grad_vector(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def check_rollouts(env, engine, world, *, k: int = 2, tasks: int = 16, group_size: int = 4,
                   temperature: float = 1.0, seed: int = 0):
    """The episodes the check scores: `engine` plays the first `tasks` sets of k questions
    of `world`'s training stream, `group_size` times each at `temperature`."""
    from memopd.env.rollout import rollout

    sets = world.sample_tasks(k, tasks, split="train", seed=seed)
    with torch.no_grad():
        return rollout(env, engine, sets, group_size=group_size, temperature=temperature, seed=seed,
                       group_prefix="check-")


def manipulation_check(cfg, bundle, *, k: int = 2, tasks: int = 16, seed: int = 0) -> dict[str, Any]:
    """The check on `bundle`'s student and teacher (`memopd.env.build.EnvironmentBundle`)
    with `cfg`'s sampling and loss settings (`TrainConfig`): `tasks` sets of k questions
    from the training stream, `cfg.group_size` rollouts each. See the module doc."""
    from memopd.env.qa.expert import make_expert
    from memopd.env.qa.world import WorldConfig
    from memopd.env.rollout import HFEngine
    from memopd.hf import head_of

    from ..loop import resolve_vocab_size
    from ..modules import Actor, Critic, PPOInputs, Scoring
    from ..ppo import whiten
    from ..settings import ActorLossCoefs
    from ..update import pack_layout, score, teacher_mask_of
    from .infogap import ROLES, action_token_roles, information_gap_calls, view_disagreement_ceiling

    student, teacher, env, world = bundle.student, bundle.teacher, bundle.env, bundle.tasks
    if teacher is None:
        raise ValueError("the manipulation check needs the teacher loaded")
    if not isinstance(getattr(world, "config", None), WorldConfig):
        raise ValueError("the manipulation check runs on the generated world (its information-gap calls)")
    teacher = teacher.eval().requires_grad_(False)
    head_of(teacher)
    head_of(student)
    scoring = Scoring(cfg.temperature, resolve_vocab_size(cfg, env, student, teacher))
    student.eval()
    engine = HFEngine(student, pad_id=env.tokens.pad, vocab_size=scoring.vocab_size)
    trajs = check_rollouts(env, engine, world, k=k, tasks=tasks, group_size=cfg.group_size,
                           temperature=cfg.temperature, seed=seed)
    actor = Actor(student, scoring=scoring)
    critic = Critic(copy.deepcopy(student))
    ref = copy.deepcopy(student).eval().requires_grad_(False) if cfg.ppo.ref_kl_coef > 0 else None
    scored = {name: score(actor, critic, ref, teacher, trajs, teacher_layout=layout, max_tokens=cfg.max_tokens,
                          ppo=cfg.ppo, action_domain=cfg.action_domain)
              for name, layout in SCORED_VIEWS}
    batch = pack_layout(trajs, cfg.max_tokens, cfg.action_domain)
    tb, tt, tk = batch.traj_index, batch.call_index, batch.token_index
    # per entry: information-gap call, token role
    expert = make_expert("rational", env.tokenizer, world.config)
    gaps = information_gap_calls(trajs, expert)
    roles = [[action_token_roles(inv.action_ids, env.tokens) for inv in tr.invocations] for tr in trajs]
    gap = torch.tensor([gaps[b][t] for b, t in zip(tb.tolist(), tt.tolist())], dtype=torch.bool)
    role = [roles[b][t][j] if j < len(roles[b][t]) else "other" for b, t, j in zip(tb.tolist(), tt.tolist(), tk.tolist())]
    sampled = batch.is_sampled.bool()
    # the teacher's top-1 under each view, from its head over the scored rows
    thead = head_of(teacher)
    V = scoring.vocab_size or int(thead.weight.shape[0])
    top = {}
    for name, _ in SCORED_VIEWS:
        h = scored[name].teacher_hidden
        w = thead.weight[:V].to(h.dtype)
        parts = []
        for s in range(0, h.shape[0], 1024):
            z = h[s:s + 1024] @ w.T
            if thead.bias is not None:
                z = z + thead.bias[:V].to(z.dtype)
            parts.append(z.argmax(-1))
        top[name] = torch.cat(parts).cpu()
        if scored[name].teacher_speaks is not None:  # a reader teacher's silent positions: no top-1 (-1)
            top[name] = torch.where(scored[name].teacher_speaks.cpu(), top[name], torch.full_like(top[name], -1))
    differ = top["aligned"] != top["flatten"]
    by_role = {r: _share(differ, sampled & torch.tensor([x == r for x in role], dtype=torch.bool)) for r in ROLES}
    # per information-gap call: does the teacher's top-1 differ at any of its action tokens
    hit: dict[tuple[int, int], bool] = {}
    for b, t, d, on in zip(tb.tolist(), tt.tolist(), differ.tolist(), (sampled & gap).tolist()):
        if on:
            hit[(b, t)] = hit.get((b, t), False) or bool(d)
    top1 = {"all": _share(differ, sampled), "gap_calls": _share(differ, sampled & gap),
            "other_calls": _share(differ, sampled & ~gap), "by_role": {r: v for r, v in by_role.items() if v is not None},
            "gap_calls_any_token": sum(hit.values()) / len(hit) if hit else None}
    # KL(student || teacher) per token under each view, and the gradients, by micro-batch
    # as the update runs them (one minibatch: the whole rollout batch)
    thead_op = head_of(teacher)
    mbs = batch.micro_batches(cfg.max_tokens)
    n_act = float(batch.num_actions)
    n_t = float(batch.teacher_mask.sum())
    offsets = scored["aligned"].offsets
    adv = whiten(scored["aligned"].advantages)
    params = [p for p in student.parameters()]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    kl_sum = {name: 0.0 for name, _ in SCORED_VIEWS}
    # per view: the tokens its OPD term averages over (a reader teacher's silent positions left out)
    n_view = {name: sum(float(teacher_mask_of(scored[name], mb, offsets[mb.traj_index, mb.call_index] + mb.token_index).sum())
                        for mb in mbs) for name, _ in SCORED_VIEWS}
    grads = {}
    student.train()
    try:
        passes = (["ppo", "aligned", "flatten"] + (["aligned_gap", "flatten_gap"] if bool((sampled & gap).any()) else [])
                  + [name for name, _ in CONTROL_VIEWS])
        for which in passes:
            for p in params:
                p.grad = None
            for mb in mbs:
                gid = offsets[mb.traj_index, mb.call_index] + mb.token_index
                tm = mb.teacher_mask.to(gid.device)
                if which.endswith("_gap"):  # the OPD term over the information-gap calls' tokens alone
                    on_gap = torch.tensor([gaps[b][t] for b, t in zip(mb.traj_index.tolist(), mb.call_index.tolist())],
                                          dtype=torch.bool, device=tm.device)
                    tm = tm & on_gap
                if which != "ppo":
                    tm = tm & teacher_mask_of(scored[which.removesuffix("_gap")], mb, gid)
                logp_old = scored["aligned"].logp_old[gid]
                if which == "ppo":
                    coefs = ActorLossCoefs(cfg.ppo.clip_eps, cfg.ppo.entropy_coef, 0.0)
                    ppo = PPOInputs(logp_old, adv[gid], tm, coefs, normalizer=max(n_act, 1.0), kl_normalizer=max(n_t, 1.0))
                    out = actor(mb, None, None, ppo=ppo)
                else:
                    coefs = ActorLossCoefs(cfg.ppo.clip_eps, 0.0, 1.0)
                    view = which.removesuffix("_gap")
                    ppo = PPOInputs(logp_old, torch.zeros_like(logp_old), tm, coefs, normalizer=max(n_act, 1.0),
                                    kl_normalizer=max(n_view[view], 1.0))
                    out = actor(mb, scored[view].teacher_hidden.index_select(0, gid), thead_op, ppo=ppo)
                    if view == which:
                        kl_sum[which] += float((out.kl.detach() * tm.float()).sum())
                out.loss.backward()
            grads[which] = _grad_vector(params)
    finally:
        for p, r in zip(params, was):
            p.grad = None
            p.requires_grad_(r)
        student.eval()
    norms = {w: float(g.norm()) for w, g in grads.items()}

    def cosine(ga, gf):
        return float((ga @ gf) / (ga.norm() * gf.norm())) if float(ga.norm()) > 0 and float(gf.norm()) > 0 else math.nan

    cos = cosine(grads["aligned"], grads["flatten"])
    cos_gap = cosine(grads["aligned_gap"], grads["flatten_gap"]) if "aligned_gap" in grads else None
    kl = {name: kl_sum[name] / max(n_view[name], 1.0) for name, _ in VIEWS}
    kl["flatten_minus_aligned"] = kl["flatten"] - kl["aligned"]
    controls = {name: {"top1_vs_aligned": _share(top[name] != top["aligned"], sampled),
                       "kl": kl_sum[name] / max(n_view[name], 1.0),
                       "cosine_vs_aligned": cosine(grads["aligned"], grads[name])}
                for name, _ in CONTROL_VIEWS}
    opd = 0.5 * (norms["aligned"] + norms["flatten"])
    calls = sum(len(tr.invocations) for tr in trajs)
    n_gap = sum(sum(r) for r in gaps)
    return {
        "k": k, "sets": tasks, "episodes": len(trajs), "calls": calls, "action_tokens": int(sampled.sum()),
        "gap_calls": n_gap, "gap_call_share": n_gap / max(calls, 1),
        "student_em": sum(float(tr.rewards["em_mean"]) for tr in trajs) / max(len(trajs), 1),
        "top1": top1, "kl": kl,
        "grad": {"ppo_norm": norms["ppo"], "opd_aligned_norm": norms["aligned"], "opd_flatten_norm": norms["flatten"],
                 "cosine": cos},
        "grad_gap_calls": {"opd_aligned_norm": norms.get("aligned_gap"), "opd_flatten_norm": norms.get("flatten_gap"),
                           "cosine": cos_gap},
        "ceiling": view_disagreement_ceiling(trajs, expert),
        "controls": controls,
        "opd_coef_matched": norms["ppo"] / opd if opd > 0 else None,
        "gate": gate(top1["gap_calls"], cos_gap),
    }


def format_check(c: dict) -> str:
    """The check as a few printable lines."""
    t = c["top1"]

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    roles = ", ".join(f"{r} {pct(v)}" for r, v in t["by_role"].items())
    g = c["grad"]
    lam = c["opd_coef_matched"]
    lines = [
        f"manipulation check on the SFT student's Q{c['k']} rollouts: {c['episodes']} episodes, {c['calls']} calls, "
        f"{c['action_tokens']} action tokens, {c['gap_calls']} information-gap calls ({pct(c['gap_call_share'])}); "
        f"student EM {c['student_em']:.3f}",
        f"  teacher top-1 aligned vs flattened differs at {pct(t['all'])} of action tokens "
        f"(information-gap calls {pct(t['gap_calls'])}, other calls {pct(t['other_calls'])}; {roles}); "
        f"at {pct(t.get('gap_calls_any_token'))} of the information-gap calls at some token",
        f"  KL(s||T_flat) - KL(s||T_aligned) = {c['kl']['flatten']:.4f} - {c['kl']['aligned']:.4f} = "
        f"{c['kl']['flatten_minus_aligned']:+.4f}",
        f"  OPD gradients: cosine {g['cosine']:.3f}, norms aligned {g['opd_aligned_norm']:.4g} / flattened "
        f"{g['opd_flatten_norm']:.4g}; PPO gradient norm {g['ppo_norm']:.4g} -> matched opd_coef "
        + ("-" if lam is None else f"{lam:.4g}"),
    ]
    gg = c.get("grad_gap_calls")
    if gg is not None:
        lines.append("  OPD gradients over the information-gap calls' tokens: cosine "
                     + ("-" if gg["cosine"] is None else f"{gg['cosine']:.3f}"))
    ce = c.get("ceiling")
    if ce is not None:
        lines.append(f"  ceiling (a perfect imitator of the rule, same action tokens): all tokens {pct(ce['all']['lower'])}"
                     f"-{pct(ce['all']['upper'])} (information-gap calls' share of the tokens "
                     f"{pct(ce['all']['gap_tokens'])}); at information-gap calls {pct(ce['gap_calls']['lower'])}"
                     f"-{pct(ce['gap_calls']['upper'])}, one token per call {pct(ce['gap_calls'].get('one_per_call'))}")
    for name, x in (c.get("controls") or {}).items():
        lines.append(f"  negative-control state {name}: top-1 differs from the aligned state at {pct(x['top1_vs_aligned'])} "
                     f"of action tokens; KL(s||T) {x['kl']:.4f}; OPD gradient cosine with the aligned one "
                     f"{x['cosine_vs_aligned']:.3f}")
    lines.append("  gate (" + c["gate"].get("statement", "overall") + "): "
                 + ("passed" if c["gate"]["passed"] else "FAILED: " + "; ".join(c["gate"]["reasons"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m memopd.trainer.experiments.manipulation [--tasks N] [--json FILE] KEY=VALUE ...`: the
    check alone, on the models and world a `memopd train` config names (the same keys:
    student=, teacher=, world=, group_size=, ...)."""
    import argparse
    import json

    from ..config import TrainConfig
    from ..loop import prepare

    p = argparse.ArgumentParser(prog="python -m memopd.trainer.experiments.manipulation", description=main.__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=16, help="Q2 sets of the training stream (x group_size rollouts)")
    p.add_argument("--k", type=int, default=2, help="questions per set (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the check as JSON here")
    p.add_argument("overrides", nargs="*", help="memopd train settings (key=value)")
    args = p.parse_args(argv)
    cfg = TrainConfig.load(None, [*args.overrides, "arm=memopd"])
    torch.set_num_threads(max(1, cfg.cpu_threads))
    c = manipulation_check(cfg, prepare(cfg, log=lambda *_: None), k=args.k, tasks=args.tasks, seed=args.seed)
    print(format_check(c))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(c, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
