"""The rule-teacher replication: does a teacher that reads the flattened history harm a
compact-memory student, and how does the harm grow with the leak's strength?

The teacher is the world's rule (`memopd.trainer.experiments.ruleteacher.RuleTeacher`): an exact reader
of whatever state it is shown, silent where the rule is, with a stated p(target). The
protocol (`PROTOCOL`), its gates (`GATES`) and the plan (`PLAN`) are stated here before
any arm runs (docs/research/replication.md, "The rule teacher"). Stages, each a subcommand of
`python -m memopd.trainer.experiments.rulegap`, writing JSON under OUT as it goes:

- `gates`: the opd_coef λ(p) matched at step 0 at linked_frac=0 (`manipulation_check`'s
  `opd_coef_matched`) for each p of G0, then G1/G2 (and the excess KL) from the
  manipulation check on the SFT student's Q2 rollouts at linked_frac=1, and G3 from
  `adoption_loss` (no model);
- `run`: the jobs of a stage (`g0`, `arms`, `dose`), two processes at a time, one torch
  thread each, each job one arm × seed × linked_frac × p, skipped when its JSON is done;
- `report`: the statistics (`interval_t`, the bootstrap of `intervals.bootstrap_seeds_sets`,
  `intervals.minimal_detectable_effect`), the dose-response table and the curves, as
  JSON / Markdown / PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from .runs import DEFAULT_RESULTS_DIR

__all__ = ["PROTOCOL", "GATES", "PLAN", "adoption_loss", "interval_t", "g0_choice", "run_job", "main"]

# ----------------------------------------------------------------------------------
# the protocol, stated before any arm's run
# ----------------------------------------------------------------------------------
# Version 2, stated before any arm's run: version 1 (80 steps, 200 sets x 4 plays, every arm 5 seeds, the dose
# grid 3 seeds) measured 41.5 s CPU for its first 20 ppo steps and one evaluation, at 24% of a core per process on
# the shared machine: about 10 min wall per run, 37 runs, far past the deadline. Its G0 runs were stopped at step 20
# (only ppo's step-20 F1 was read) and are not used. Version 2 halves the steps and the plays, runs ppo on 3 seeds
# (a secondary comparison) and the dose grid on 2 seeds, and interleaves the stages (`MAIN_ORDER`).
PLAN = {
    "version": 2,
    "steps": 40, "eval_every": 20, "eval_sets": 200, "eval_plays": 2, "eval_temperature": 1.0, "eval_seed": 1234,
    "g0": {"linked_frac": 0.0, "p": [0.5, 0.6, 0.9, 0.99, 0.999], "arms": ["ppo", "memopd"], "seeds": [0]},
    "arms": {"linked_frac": 1.0, "arms": ["ppo", "persistent", "memopd"], "seeds": [0, 1, 2, 3, 4], "ppo_seeds": [0, 1, 2]},
    "dose": {"linked_frac": [0.25, 1.0], "p": [0.99, 0.999], "arms": ["persistent", "memopd"], "seeds": [0, 1]},
}
# G0 amendment (stated before any arm's run): with p in {0.5, 0.6, 0.9} G0 failed at every p (final plain Q2 F1
# 0.001 / 0.003 / 0.298 against SFT 0.470 and ppo 0.473) while the KL to the teacher fell: KL(student || teacher)
# is smallest at the teacher itself, and softmax(beta*onehot) spreads 1 - p over the 881 other ids, so the student
# learns to emit a random id with probability ~1 - p per token. The grid gains p in {0.99, 0.999}; the dose grid's
# p values (0.6, 0.9: teachers G0 shows insane) become these two.
# the order of the `main` stage: primary seeds 0-1, the dose grid's seed 0, primary seeds 2-4, the dose grid's seed 1
MAIN_ORDER = (("arms", (0, 1)), ("dose", (0,)), ("arms", (2, 3, 4)), ("dose", (1,)))
PROTOCOL = {
    "version": 1,
    "teacher": "the world's rational rule (trainer/experiments/ruleteacher.py) read on the visible ids of each packed row: "
               "the rule's next token after the action prefix (rule completion), softmax(β·onehot) with p(target)=p, "
               "silent (masked out of the OPD term) where the rule is",
    "student": "the info-gap world's SFT student (1,000 SFT steps of the scripted expert), one for every run",
    "training": "RL on Q2 sets of the info-gap world with linked_frac set per stage, 80 steps, 4 sets x 4 rollouts "
                "per step, temperature 1, every other setting the trainer's default; opd_coef λ(p) matched at step 0 "
                "(steps: PLAN)",
    "endpoint": "held-out linked Q2 F1: the eval split of the info-gap world with linked_frac=1 (every set holds a "
                "linked pair), 200 sets x 2 episodes at temperature 1 (the same sets and sampling seed for every run "
                "and step), read at step 0 (the SFT student) and every 20 steps to the last (PLAN)",
    "primary": "memopd − persistent on the area under that F1 curve (trapezoid / steps: the mean F1 over "
               "training), at linked_frac=1 and the p G0 picks, paired by seed over 5 seeds",
    "secondary": ["memopd − persistent on the final F1, same reading",
                  "memopd − ppo and persistent − ppo on the area (the teacher's own effect, each view)",
                  "dose-response: memopd − persistent (area and final) at linked_frac ∈ {0.25, 1.0} × p ∈ {0.6, 0.9}, "
                  "seeds 0-1 (the primary cell's are the primary's runs)"],
    "intervals": "two, side by side: the Student t 95% interval over the per-seed differences (mean ± t_{0.975,n-1} · "
                 "sd / √n), and the 95% percentile bootstrap that resamples the per-seed differences only (the area is "
                 "one number per seed; for the final F1 it resamples seeds and sets together, paired). With 5 seeds a "
                 "percentile bootstrap over 5 values is narrower than it says (about 0.85 coverage at nominal 0.95): "
                 "the t-interval is the one the decision rule reads",
    "mde": "the minimal detectable effect of a two-sided paired t-test at α=0.05 with power 0.8 over the seeds run, "
           "the per-seed spread of the primary taken as the truth",
    "decision": "the leak harms the compact student when the primary's t-interval lies above 0 (memopd − persistent > 0); "
                "no harm larger than the MDE is shown when the t-interval contains 0 and its upper end is below the "
                "MDE; anything else is reported as inconclusive. Read only when G0-G3 pass; a failed gate is reported "
                "with the arms and the primary is then not read as evidence either way",
    "not_shown": "a rule teacher reads every visible fact, always: the result bounds what a leak of that strength does, "
                 "not how often a trained LLM teacher reads the history at such points",
}
GATES = {
    "G0": "the teacher is sane: at linked_frac=0, where the two views agree, the memopd arm's final held-out Q2 F1 "
          "(plain sets, same reading) is >= the SFT student's and > the ppo arm's, for the p chosen; among the p in "
          "{0.5, 0.6, 0.9} (amended after all three failed, before any arm: {0.99, 0.999} added) that pass, the one "
          "with the highest memopd final F1 is chosen (ties: the smaller p); "
          "λ(p) is matched at step 0 at linked_frac=0 (‖λ∇OPD‖ = ‖∇PPO‖), before any linked run",
    "G1": "dose: information-gap calls are >= 15% of the SFT student's Q2 calls at linked_frac=1",
    "G2": "the teacher reads the view: on those rollouts its top-1 (silence counted as a value) differs between the "
          "aligned and the flattened view on >= 15% of the action tokens of information-gap calls and at >= 90% of "
          "those calls, and on <= 1% of the other calls' tokens",
    "G3": "consequence: the held-out linked Q2 F1 lost when a student at its compact state fully adopts the flattened "
          "teacher's step at the information-gap calls (`adoption_loss`: the flattened rule's action with the values "
          "its compact state does not show guessed) instead of the aligned teacher's step is >= 0.20",
    "dropped": "the cosine criterion of the earlier gate (OPD gradients' cosine at information-gap calls < 0.8) is "
               "dropped: a perfect reader fails it (0.92 in the review), because the views agree at every token of a "
               "gap call but the one where they part and the gradient sums over all of them; disagreement (G2) and "
               "its consequence (G3) say what the cosine was meant to",
    "thresholds": {"G1_gap_call_share": 0.15, "G2_gap_tokens": 0.15, "G2_gap_calls": 0.90, "G2_other_tokens": 0.01,
                   "G3_f1_loss": 0.20},
}


# ----------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------
def interval_t(per_seed, level: float = 0.95) -> dict:
    """The Student t interval over per-seed differences (`intervals.t_interval`)."""
    from .intervals import t_interval

    return t_interval(per_seed, level)


def g0_choice(g0: dict, thresholds=None) -> dict:
    """G0's verdict per p and the p it picks (`GATES["G0"]`). `g0`: {"sft": F1, "ppo": F1,
    "memopd": {p: F1}} (final held-out Q2 F1 at linked_frac=0)."""
    per_p = {}
    for p, f in sorted(g0["memopd"].items(), key=lambda kv: float(kv[0])):
        per_p[str(p)] = {"memopd_f1": f, "passed": f >= g0["sft"] and f > g0["ppo"]}
    passing = [(v["memopd_f1"], -float(p), p) for p, v in per_p.items() if v["passed"]]
    chosen = max(passing)[2] if passing else None
    return {"per_p": per_p, "sft_f1": g0["sft"], "ppo_f1": g0["ppo"], "passed": chosen is not None, "p": chosen}


# ----------------------------------------------------------------------------------
# G3: what full adoption of the flattened teacher's step costs (no model)
# ----------------------------------------------------------------------------------
class _Adopter:
    """An `Engine` for one episode: the scripted expert (what the SFT student imitates),
    except at information-gap calls (the rule's action on the call differs from its action
    on the observations seen so far), where it takes the aligned teacher's step (the
    rule on the call) or, with `view="flatten"`, the flattened teacher's step with every
    value its call does not show replaced by a guess (a random value of that attribute, or
    a random entity for a middle step): what a student that cannot see the fact can do."""

    def __init__(self, tokenizer, world, view: str, rng: random.Random):
        from memopd.env.qa.expert import ScriptedExpert, expert_options, make_expert

        self.tok, self.world, self.view, self.rng = tokenizer, world, view, rng
        self.scripted = ScriptedExpert(tokenizer, **expert_options(world.config))
        self.rule = make_expert("rational", tokenizer, world.config)
        self.seen: list[str] = []
        self.gaps = 0

    def _guessed(self, text: str, questions, compact_text: str, compact_infos) -> str:
        import re

        from memopd.env.qa.notes import facts_in, is_value, parse_entries, parse_question
        from memopd.env.qa.protocol import answer_label

        m = re.search(r"<mem>(.*?)</mem>", text)
        mc = re.search(r"<mem>(.*?)</mem>", compact_text)
        shown = set(facts_in(" | ".join(compact_infos)).values()) | {" ".join(v) for _, v in parse_entries(mc.group(1) if mc else "")}
        entries = parse_entries(m.group(1) if m else "")
        changed = {}
        for e in entries:
            i, vals = e
            joined = " ".join(vals)
            if not vals or joined in shown:
                continue
            q = parse_question(questions[i - 1])
            pool = self.world.entities if (len(vals) == 1 and not is_value(vals[0])) else self.world.values[q[0]]
            e[1] = self.rng.choice(list(pool)).split()
            changed[i] = " ".join(e[1])
        mem = " ".join(" ".join([answer_label(i)] + v) for i, v in entries)
        out = text[:m.start()] + (f"<mem> {mem}</mem>" if mem else "<mem></mem>") + text[m.end():] if m else text
        a = re.search(r"<answer>(.*?)</answer>", out)
        if a and changed:  # the answer states the same guessed entries
            parts = []
            for part in a.group(1).split(" ; "):
                w = part.split()
                from memopd.env.qa.protocol import letters_index

                i = letters_index(w[0][1:]) if w else None
                parts.append(f"{w[0]} {changed[i]}" if i in changed else part.strip())
            out = out[:a.start()] + "<answer> " + " ; ".join(parts) + "</answer>" + out[a.end():]
        return out

    def act(self, prompt) -> list[int]:
        from .infogap_expert import rational_action_text

        ex = self.rule
        questions, mem, infos = ex.state(prompt)
        if infos:
            self.seen.append(infos[-1])
        compact = rational_action_text(questions, mem, infos, values=ex.values, descending=ex.descending)
        flat = rational_action_text(questions, mem, self.seen, values=ex.values, descending=ex.descending)
        if compact == flat:
            return self.scripted.act(prompt)
        self.gaps += 1
        text = compact if self.view == "aligned" else self._guessed(flat, questions, compact, infos)
        return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=(), seed=None):
        from memopd.env.rollout import Sample

        out = []
        for p in prompts:
            ids = self.act([int(i) for i in p])[: int(max_new_tokens if not isinstance(max_new_tokens, (list, tuple))
                                                     else max_new_tokens[0])]
            out.append(Sample(ids=ids, logprobs=None, finish="stop" if ids and ids[-1] in stop_ids else "length"))
        return out


def adoption_loss(env, world, tasks, *, seed: int = 0) -> dict:
    """G3: mean F1 on `tasks` (one episode each) when the information-gap calls take the
    aligned teacher's step, when they take the flattened teacher's with guessed values, and
    the scripted expert's own F1; the loss is aligned − flattened."""
    from memopd.env.qa.expert import expert_options
    from memopd.env.rollout import rollout

    out = {}
    for view in ("aligned", "flatten"):
        rng = random.Random(seed)
        f1, gaps = [], 0
        for t in tasks:
            eng = _Adopter(env.tokenizer, world, view, rng)
            tr = rollout(env, eng, [t], temperature=1.0)[0]
            f1.append(float(tr.rewards["f1_mean"]))
            gaps += eng.gaps
        out[view] = {"f1": statistics.mean(f1), "gap_calls": gaps}
    from memopd.env.qa.expert import expert_trajectories

    scripted = expert_trajectories(env, tasks, **expert_options(world.config))
    out["scripted_f1"] = statistics.mean(float(tr.rewards["f1_mean"]) for tr in scripted)
    out["loss"] = out["aligned"]["f1"] - out["flatten"]["f1"]
    out["sets"] = len(tasks)
    return out


# ----------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------
def _cfg(arm: str, seed: int, student: str, steps: int, opd_coef: float):
    from ..config import TrainConfig

    return TrainConfig.load(None, ["world=info-gap", "train_k=[2]", "eval_k=[2]", f"arm={arm}", f"seed={seed}",
                                   f"steps={steps}", f"ppo.teacher_kl_coef={opd_coef}", f"student={student}", "cpu_threads=1",
                                   "checkpoint_every=0", "progress=false"])


def _bundle(student: str):
    from ..loop import prepare

    return prepare(_cfg("ppo", 0, student, 1, 0.0), log=lambda *_: None)


def _world(bundle, linked_frac: float):
    from memopd.env.qa.world import World

    return World.generate(replace(bundle.tasks.config, linked_frac=linked_frac))


def eval_f1(lm, env, tasks, *, plays: int, seed: int, vocab_size: int) -> dict:
    """Per set: the mean F1 of `plays` episodes at temperature 1 (fixed sampling seed)."""
    import torch

    from memopd.env.rollout import HFEngine, rollout

    lm.eval()
    engine = HFEngine(lm, pad_id=env.tokens.pad, vocab_size=vocab_size)
    with torch.no_grad():
        trajs = rollout(env, engine, tasks, group_size=plays, temperature=1.0, seed=seed, group_prefix="eval-")
    acc: dict = {}
    for tr in trajs:
        acc.setdefault(tr.task_id, []).append(float(tr.rewards["f1_mean"]))
    f1 = [statistics.mean(acc[t.task_id]) for t in tasks]
    return {"f1": f1, "f1_mean": statistics.mean(f1)}


def eval_tasks(bundle, linked_frac_eval: float, n: int):
    return _world(bundle, linked_frac_eval).sample_tasks(2, n, split="eval", seed=0)


def run_job(job: dict, out: str, student: str, plan: dict = PLAN) -> dict:
    """One arm × seed × linked_frac × p: train `plan["steps"]` steps from the SFT student,
    evaluating every `eval_every` steps; the JSON at `out` is rewritten after every evaluation."""
    import torch

    from memopd.trainer.experiments.ruleteacher import RuleTeacher

    from ..loop import Trainer, resolve_vocab_size, set_seed

    torch.set_num_threads(1)
    t0, c0 = time.time(), time.process_time()
    cfg = _cfg(job["arm"], job["seed"], student, plan["steps"], job.get("opd_coef", 0.0))
    set_seed(cfg.seed)
    bundle = _bundle(student)
    world = _world(bundle, job["linked_frac"])
    V = resolve_vocab_size(cfg, bundle.env, bundle.student)
    teacher = (RuleTeacher(bundle.tokenizer, world.config, vocab_size=V, p_target=job["p"], temperature=cfg.temperature)
               if cfg.arm_spec.uses_teacher else None)
    trainer = Trainer(cfg, student_lm=bundle.student, teacher_lm=teacher, env=bundle.env, tasks=world,
                      log=lambda *_: None)
    tasks = eval_tasks(bundle, job["eval_linked_frac"], plan["eval_sets"])
    rec = {"job": job, "plan": {k: plan[k] for k in ("steps", "eval_every", "eval_sets", "eval_plays")},
           "curve": [], "steps": [], "done": False}

    def save():
        rec["wall_s"], rec["cpu_s"] = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, out)

    for step in range(plan["steps"]):
        m = trainer.train_step(step)
        rec["steps"].append({k: m[k] for k in ("step", "rollout/f1_mean", "train/kl_teacher", "train/actor_grad_norm")
                             if k in m})
        if (step + 1) % plan["eval_every"] == 0:
            actor, _ = trainer.inference_modules()
            e = eval_f1(actor.lm, bundle.env, tasks, plays=plan["eval_plays"], seed=plan["eval_seed"], vocab_size=V)
            rec["curve"].append([step + 1, e["f1_mean"]])
            rec["final_per_set"] = e["f1"]
            save()
    rec["done"] = True
    save()
    return rec


# ----------------------------------------------------------------------------------
# stages
# ----------------------------------------------------------------------------------
def job_name(j: dict) -> str:
    return f"{j['stage']}_lf{j['linked_frac']}_p{j.get('p', '-')}_{j['arm']}_s{j['seed']}"


def stage_jobs(stage: str, gates: dict, plan: dict = PLAN, seeds=None) -> list[dict]:
    """The jobs of a stage in the order they run; `main`: `MAIN_ORDER`."""
    if stage == "main":
        return [j for st, ss in MAIN_ORDER for j in stage_jobs(st, gates, plan, seeds=ss)]
    lam = gates["lambda"]
    if stage == "g0":
        g = plan["g0"]
        jobs = [{"arm": "ppo", "seed": s, "linked_frac": g["linked_frac"], "p": None} for s in g["seeds"]]
        jobs += [{"arm": "memopd", "seed": s, "linked_frac": g["linked_frac"], "p": p} for p in g["p"] for s in g["seeds"]]
        for j in jobs:
            j["eval_linked_frac"] = 0.0
    elif stage in ("arms", "dose"):
        p_star = gates.get("g0", {}).get("p")
        if p_star is None:
            raise SystemExit("G0 has not picked a p yet (run the g0 stage, then `gates --g0`)")
        p_star = float(p_star)  # G0's verdict names it as a key
        if stage == "arms":
            g = plan["arms"]
            jobs = [{"arm": a, "seed": s, "linked_frac": g["linked_frac"], "p": None if a == "ppo" else p_star}
                    for s in (seeds if seeds is not None else g["seeds"]) for a in g["arms"]
                    if a != "ppo" or s in g.get("ppo_seeds", g["seeds"])]
        else:
            g = plan["dose"]
            # seed-major: every cell gets its seed s before any cell gets s + 1 (a run cut by the clock
            # leaves cells with equal seed counts)
            jobs = [{"arm": a, "seed": s, "linked_frac": lf, "p": p} for s in (seeds if seeds is not None else g["seeds"])
                    for lf in g["linked_frac"]
                    for p in g["p"] for a in g["arms"]
                    if not (lf == plan["arms"]["linked_frac"] and float(p) == float(p_star))]  # the primary's runs
        for j in jobs:
            j["eval_linked_frac"] = 1.0
    else:
        raise SystemExit(f"unknown stage {stage!r}")
    for j in jobs:
        j["stage"] = stage
        j["opd_coef"] = lam[str(j["p"])] if j["p"] is not None else 0.0
    return jobs


def _run_stage(args) -> int:
    with open(os.path.join(args.out, "gates.json")) as f:
        gates = json.load(f)
    jobs = stage_jobs(args.stage, gates)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    todo = []
    for j in jobs:
        path = os.path.join(args.out, "runs", job_name(j) + ".json")
        if os.path.exists(path):
            with open(path) as f:
                if json.load(f).get("done"):
                    continue
        todo.append((j, path))
    print(f"[rulegap] stage {args.stage}: {len(jobs)} jobs, {len(todo)} to run, {args.jobs} at a time", flush=True)
    running: list = []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    while todo or running:
        while todo and len(running) < args.jobs:
            j, path = todo.pop(0)
            log = open(path.replace(".json", ".log"), "w")
            p = subprocess.Popen([sys.executable, "-m", "memopd.trainer.experiments.rulegap", "job", "--student", args.student,
                                  "--out", path, "--job", json.dumps(j)], stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((p, j, path, log, time.time()))
        time.sleep(2)
        for r in list(running):
            if r[0].poll() is not None:
                running.remove(r)
                r[3].close()
                print(f"[rulegap] {job_name(r[1])}: exit {r[0].returncode} after {time.time() - r[4]:.0f} s", flush=True)
    return 0


def _gates(args) -> int:
    """λ(p) at linked_frac=0, then G1/G2 on the SFT student's rollouts at linked_frac=1, G3."""
    import torch

    from memopd.trainer.experiments.ruleteacher import RuleTeacher

    from ..loop import resolve_vocab_size
    from .manipulation import manipulation_check

    torch.set_num_threads(1)
    path = os.path.join(args.out, "gates.json")
    gates = json.load(open(path)) if os.path.exists(path) else {"gates": GATES, "protocol": PROTOCOL, "plan": PLAN}
    bundle = _bundle(args.student)
    cfg = _cfg("memopd", 0, args.student, 1, 1.0)
    V = resolve_vocab_size(cfg, bundle.env, bundle.student)
    t0, c0 = time.time(), time.process_time()

    def check(lf, p):
        w = _world(bundle, lf)
        b = replace(bundle, teacher=RuleTeacher(bundle.tokenizer, w.config, vocab_size=V, p_target=p), tasks=w)
        return manipulation_check(cfg, b, k=2, tasks=args.check_tasks, seed=0)

    gates.setdefault("lambda", {})
    gates.setdefault("lambda_checks", {})
    gates.setdefault("checks", {})
    for p in PLAN["g0"]["p"]:
        if str(p) not in gates["lambda"]:
            c = check(0.0, p)
            gates["lambda"][str(p)] = c["opd_coef_matched"]
            gates["lambda_checks"][str(p)] = {k: c[k] for k in ("grad", "kl", "gap_call_share", "top1", "student_em")}
            print(f"[rulegap] p={p}: matched opd_coef {c['opd_coef_matched']:.4g}", flush=True)
    th = GATES["thresholds"]
    for p in PLAN["g0"]["p"]:
        if str(p) not in gates["checks"]:
            c = check(1.0, p)
            t = c["top1"]
            gates["checks"][str(p)] = {
                "calls": c["calls"], "gap_calls": c["gap_calls"], "gap_call_share": c["gap_call_share"],
                "top1": t, "kl": c["kl"], "student_em": c["student_em"], "ceiling": c["ceiling"],
                "G1": c["gap_call_share"] >= th["G1_gap_call_share"],
                "G2": (t["gap_calls"] is not None and t["gap_calls"] >= th["G2_gap_tokens"]
                       and (t["gap_calls_any_token"] or 0) >= th["G2_gap_calls"]
                       and (t["other_calls"] or 0) <= th["G2_other_tokens"]),
            }
            print(f"[rulegap] p={p} at linked_frac=1: gap calls {100 * c['gap_call_share']:.1f}%, top-1 differs "
                  f"{100 * (t['gap_calls'] or 0):.1f}% of gap-call tokens, {100 * (t['gap_calls_any_token'] or 0):.1f}% "
                  f"of gap calls, {100 * (t['other_calls'] or 0):.2f}% elsewhere; excess KL "
                  f"{c['kl']['flatten_minus_aligned']:+.3f}", flush=True)
    if "G3" not in gates:
        g3 = {}
        for lf in (1.0, 0.25):
            w = _world(bundle, lf)
            g3[str(lf)] = adoption_loss(bundle.env, w, w.sample_tasks(2, PLAN["eval_sets"], split="eval", seed=0))
        g3["passed"] = g3["1.0"]["loss"] >= GATES["thresholds"]["G3_f1_loss"]
        gates["G3"] = g3
        print(f"[rulegap] G3: F1 aligned step {g3['1.0']['aligned']['f1']:.3f}, flattened step "
              f"{g3['1.0']['flatten']['f1']:.3f}: loss {g3['1.0']['loss']:.3f}", flush=True)
    if args.g0:
        gates["g0"] = _g0_verdict(args.out)
        print(f"[rulegap] G0: {json.dumps(gates['g0'])}", flush=True)
    # summed over the passes (the first pass's figure was overwritten by a later one before this)
    gates["gates_wall_s"] = round(gates.get("gates_wall_s", 0.0) + time.time() - t0, 1)
    gates["gates_cpu_s"] = round(gates.get("gates_cpu_s", 0.0) + time.process_time() - c0, 1)
    with open(path + ".tmp", "w") as f:
        json.dump(gates, f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


def _load_runs(out: str) -> list[dict]:
    d = os.path.join(out, "runs")
    rows = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                r = json.load(f)
            if r.get("done"):
                rows.append(r)
    return rows


def sft_baseline(out: str, student: str, linked_frac_eval: float) -> dict:
    """The SFT student's reading on the endpoint's sets (cached in OUT)."""
    path = os.path.join(out, f"sft_lf{linked_frac_eval}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import torch

    from ..loop import resolve_vocab_size

    torch.set_num_threads(1)
    bundle = _bundle(student)
    V = resolve_vocab_size(_cfg("ppo", 0, student, 1, 0.0), bundle.env, bundle.student)
    e = eval_f1(bundle.student, bundle.env, eval_tasks(bundle, linked_frac_eval, PLAN["eval_sets"]),
                plays=PLAN["eval_plays"], seed=PLAN["eval_seed"], vocab_size=V)
    with open(path, "w") as f:
        json.dump(e, f)
    return e


def _g0_verdict(out: str) -> dict:
    rows = [r for r in _load_runs(out) if r["job"]["stage"] == "g0"]
    sft = sft_baseline(out, _student_of(out), 0.0)["f1_mean"]
    ppo = [r["curve"][-1][1] for r in rows if r["job"]["arm"] == "ppo"]
    mem: dict = {}
    for r in rows:
        if r["job"]["arm"] == "memopd":
            mem.setdefault(str(r["job"]["p"]), []).append(r["curve"][-1][1])
    if not ppo or not mem:
        raise SystemExit("G0's runs are not done")
    return g0_choice({"sft": sft, "ppo": statistics.mean(ppo), "memopd": {p: statistics.mean(v) for p, v in mem.items()}})


def _student_of(out: str) -> str:
    with open(os.path.join(out, "student.txt")) as f:
        return f.read().strip()


# ----------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------
def _area(r: dict, sft: float) -> float:
    from .intervals import curve_area

    return curve_area([(0, sft)] + [tuple(x) for x in r["curve"]])


def _paired(rows_a: list[dict], rows_b: list[dict], sft: float) -> dict | None:
    """memopd-style difference a − b paired by seed: area and final, with both intervals."""
    from .intervals import bootstrap_seeds_sets, minimal_detectable_effect

    a = {r["job"]["seed"]: r for r in rows_a}
    b = {r["job"]["seed"]: r for r in rows_b}
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    out = {"seeds": seeds}
    for key in ("area", "final"):
        if key == "area":
            x, y = [_area(a[s], sft) for s in seeds], [_area(b[s], sft) for s in seeds]
            boot = bootstrap_seeds_sets(x, y) if len(seeds) > 1 else None
        else:
            x, y = [a[s]["curve"][-1][1] for s in seeds], [b[s]["curve"][-1][1] for s in seeds]
            boot = (bootstrap_seeds_sets([a[s]["final_per_set"] for s in seeds], [b[s]["final_per_set"] for s in seeds])
                    if len(seeds) > 1 else None)
        d = [u - v for u, v in zip(x, y)]
        out[key] = {"a": x, "b": y, "per_seed": d, "mean": statistics.mean(d),
                    "t": interval_t(d) if len(d) > 1 else None,
                    "bootstrap": None if boot is None else {"lo": boot["lo"], "hi": boot["hi"],
                                                            "resamples": "seeds" if key == "area" else "seeds and sets"},
                    "mde": minimal_detectable_effect(d) if len(d) > 1 else None}
    return out


def _verdict(primary: dict | None, gates_ok: bool) -> str:
    if primary is None or primary["area"]["t"] is None:
        return "not enough seeds"
    t, mde = primary["area"]["t"], primary["area"]["mde"]
    if t["lo"] > 0:
        v = "harm shown: the t-interval of memopd − persistent lies above 0"
    elif t["lo"] <= 0 <= t["hi"] and mde is not None and t["hi"] < mde:
        v = "no harm larger than the MDE"
    else:
        v = "inconclusive"
    return v if gates_ok else v + " (a gate failed: not read as evidence)"


def build_report(out: str) -> dict:
    with open(os.path.join(out, "gates.json")) as f:
        gates = json.load(f)
    student = _student_of(out)
    sft1 = sft_baseline(out, student, 1.0)["f1_mean"]
    rows = _load_runs(out)
    p_star = None if gates["g0"]["p"] is None else float(gates["g0"]["p"])
    lf_main = PLAN["arms"]["linked_frac"]

    def pick(arm, lf, p):
        return [r for r in rows if r["job"]["arm"] == arm and r["job"]["linked_frac"] == lf and r["job"]["stage"] != "g0"
                and (p is None or r["job"]["p"] is None or float(r["job"]["p"]) == float(p))]

    arms = {a: [r for r in pick(a, lf_main, p_star) if r["job"]["stage"] == "arms"] for a in PLAN["arms"]["arms"]}
    primary = _paired(arms["memopd"], arms["persistent"], sft1)
    secondary = {"memopd − ppo": _paired(arms["memopd"], arms["ppo"], sft1),
                 "persistent − ppo": _paired(arms["persistent"], arms["ppo"], sft1)}
    dose = []
    for lf in PLAN["dose"]["linked_frac"]:
        for p in PLAN["dose"]["p"]:
            seeds = set(PLAN["dose"]["seeds"])
            m = [r for r in pick("memopd", lf, p) if r["job"]["seed"] in seeds]
            q = [r for r in pick("persistent", lf, p) if r["job"]["seed"] in seeds]
            d = _paired(m, q, sft1)
            dose.append({"linked_frac": lf, "p": p, "diff": d,
                         "memopd_area": statistics.mean(_area(r, sft1) for r in m) if m else None,
                         "persistent_area": statistics.mean(_area(r, sft1) for r in q) if q else None,
                         "memopd_final": statistics.mean(r["curve"][-1][1] for r in m) if m else None,
                         "persistent_final": statistics.mean(r["curve"][-1][1] for r in q) if q else None})
    checks = gates["checks"]
    c = checks[str(p_star)] if p_star is not None else None
    gates_ok = bool(gates["g0"]["passed"] and c and c["G1"] and c["G2"] and gates["G3"]["passed"])
    costs = [r["cpu_s"] for r in rows]
    summary = {a: {"seeds": [r["job"]["seed"] for r in rs],
                   "area": [_area(r, sft1) for r in rs], "final": [r["curve"][-1][1] for r in rs]} for a, rs in arms.items()}
    return {"protocol": PROTOCOL, "gates_statement": GATES, "plan": PLAN, "student": student, "sft_linked_f1": sft1,
            "sft_plain_f1": sft_baseline(out, student, 0.0)["f1_mean"], "gates": gates, "p": p_star,
            "lambda": gates["lambda"].get(str(p_star)), "gates_passed": gates_ok, "arms": summary,
            "curves": {a: [{"seed": r["job"]["seed"], "curve": [[0, sft1]] + r["curve"]} for r in rs] for a, rs in arms.items()},
            "primary": primary, "secondary": secondary, "verdict": _verdict(primary, gates_ok), "dose": dose,
            "g0_runs": [{"arm": r["job"]["arm"], "p": r["job"]["p"], "seed": r["job"]["seed"], "curve": r["curve"]}
                        for r in rows if r["job"]["stage"] == "g0"],
            "runs": len(rows), "cpu_s_per_run": {"mean": statistics.mean(costs), "max": max(costs)} if costs else None}


def _iv(d: dict | None, key: str) -> str:
    if d is None:
        return "-"
    x = d[key]
    t = "" if x["t"] is None else f" t [{x['t']['lo']:+.3f}, {x['t']['hi']:+.3f}]"
    b = "" if x["bootstrap"] is None else f" boot [{x['bootstrap']['lo']:+.3f}, {x['bootstrap']['hi']:+.3f}]"
    return f"{x['mean']:+.3f}{t}{b}"


def format_report(rep: dict) -> str:
    g = rep["gates"]
    p = rep["p"]
    lines = ["# The rule-teacher replication", "",
             f"Teacher: the world's rule read on each packed row (`trainer/experiments/ruleteacher.py`), p(target) = {p}, "
             f"opd_coef λ = {rep['lambda']:.4g} (matched at step 0). Student: the info-gap SFT student "
             f"(held-out linked Q2 F1 {rep['sft_linked_f1']:.3f}, plain {rep['sft_plain_f1']:.3f}; {PLAN['eval_sets']} sets x "
             f"{PLAN['eval_plays']} episodes at temperature 1). {PLAN['steps']} steps, plan version {PLAN['version']}. "
             "Protocol and gates: `trainer/experiments/rulegap.py` (`PROTOCOL`, `GATES`), "
             "docs/research/replication.md.", "", "## Gates", "",
             "| p | λ(p) | G1 gap calls | G2 top-1 differs: gap-call tokens / gap calls / other tokens | excess KL "
             "(flat − aligned, nats/token) | G1 | G2 |", "|---|---|---|---|---|---|---|"]
    for q, c in g["checks"].items():
        t = c["top1"]
        lines.append(f"| {q} | {g['lambda'][q]:.4g} | {100 * c['gap_call_share']:.1f}% ({c['gap_calls']}/{c['calls']}) | "
                     f"{100 * (t['gap_calls'] or 0):.1f}% / {100 * (t['gap_calls_any_token'] or 0):.1f}% / "
                     f"{100 * (t['other_calls'] or 0):.2f}% | {c['kl']['flatten_minus_aligned']:+.3f} | "
                     f"{'pass' if c['G1'] else 'FAIL'} | {'pass' if c['G2'] else 'FAIL'} |")
    g3 = g["G3"]
    lines += ["", "G3 (F1 on 200 held-out linked Q2 sets, one episode each, the scripted expert elsewhere): "
              + "; ".join(f"linked_frac={lf}: aligned step {g3[lf]['aligned']['f1']:.3f}, flattened step "
                          f"{g3[lf]['flatten']['f1']:.3f} ({g3[lf]['flatten']['gap_calls']} gap calls), loss "
                          f"{g3[lf]['loss']:.3f}" for lf in ("1.0", "0.25"))
              + f" -> {'pass' if g3['passed'] else 'FAIL'} (needs >= {GATES['thresholds']['G3_f1_loss']})."]
    g0 = g["g0"]
    lines += ["", f"G0 (linked_frac=0, final plain Q2 F1, 1 seed): SFT {g0['sft_f1']:.3f}, ppo {g0['ppo_f1']:.3f}; "
              + ", ".join(f"memopd p={q} {v['memopd_f1']:.3f} ({'pass' if v['passed'] else 'fail'})"
                          for q, v in g0["per_p"].items())
              + f" -> p = {g0['p']}.", "", f"All gates: {'passed' if rep['gates_passed'] else 'NOT passed'}.", "",
              "## Arms at linked_frac=1 (held-out linked Q2 F1)", "",
              "| arm | seeds | F1 area (mean ± sd) | final F1 (mean ± sd) |", "|---|---|---|---|"]
    def sd(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    for a, s in rep["arms"].items():
        if s["area"]:
            lines.append(f"| {a} | {len(s['area'])} | {statistics.mean(s['area']):.3f} ± {sd(s['area']):.3f} | "
                         f"{statistics.mean(s['final']):.3f} ± {sd(s['final']):.3f} |")
    pr = rep["primary"]
    lines += ["", "## Primary and secondary (paired by seed; t: Student t 95%; boot: percentile bootstrap 95%, over "
              "the per-seed differences for the area, over seeds and sets for the final F1)", "",
              "| comparison | area | final F1 | MDE (area) |", "|---|---|---|---|"]
    rowsd = [("memopd − persistent (primary)", pr)] + list(rep["secondary"].items())
    for name, d in rowsd:
        mde = "-" if d is None or d["area"]["mde"] is None else f"{d['area']['mde']:.3f}"
        lines.append(f"| {name} | {_iv(d, 'area')} | {_iv(d, 'final')} | {mde} |")
    if pr:
        lines += ["", "Per-seed memopd − persistent area: " + ", ".join(f"{x:+.3f}" for x in pr["area"]["per_seed"])
                  + f" (seeds {pr['seeds']})."]
    lines += ["", f"Decision: {rep['verdict']}.", "",
              f"## Dose-response (memopd − persistent, seeds {PLAN['dose']['seeds']} where run)", "",
              "Leak strength: the share of training sets with a linked pair (linked_frac) and the teacher's sharpness p "
              "(its excess KL, flattened − aligned, on the SFT student's rollouts at linked_frac=1, nats/token); G3's "
              "F1 loss at full adoption is 0.375 at linked_frac=1 and 0.108 at 0.25.", "",
              "| linked_frac | p | excess KL | seeds | memopd area / final | persistent area / final | Δ area | Δ final |",
              "|---|---|---|---|---|---|---|---|"]
    for c in rep["dose"]:
        d = c["diff"]
        n = len(d["seeds"]) if d else 0
        fm = "-" if c["memopd_area"] is None else f"{c['memopd_area']:.3f} / {c['memopd_final']:.3f}"
        fp = "-" if c["persistent_area"] is None else f"{c['persistent_area']:.3f} / {c['persistent_final']:.3f}"
        kl = g["checks"].get(str(c["p"]), {}).get("kl", {}).get("flatten_minus_aligned")
        kl = "-" if kl is None else f"{kl:+.3f}"
        lines.append(f"| {c['linked_frac']} | {c['p']} | {kl} | {n} | {fm} | {fp} | {_iv(d, 'area')} | {_iv(d, 'final')} |")
    cr = rep["cpu_s_per_run"]
    if cr:
        lines += ["", f"{rep['runs']} runs; process CPU time per run (one thread, shared 2-core machine) mean "
                  f"{cr['mean']:.0f} s, max {cr['max']:.0f} s."]
    lines += ["", "Curves: `rulegap.png` (mean ± sd over seeds; step 0 = the SFT student). A rule teacher reads every "
              "visible fact, always: this bounds what a leak of that strength does, not how often a trained LLM teacher "
              "reads the history at such points."]
    return "\n".join(lines) + "\n"


def plot_report(rep: dict, path: str) -> str:
    from ..plot import matplotlib_module, save_png

    matplotlib = matplotlib_module()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, runs in rep["curves"].items():
        if not runs:
            continue
        steps = [s for s, _ in runs[0]["curve"]]
        ys = [[dict(map(tuple, r["curve"]))[s] for r in runs] for s in steps]
        m = [statistics.mean(v) for v in ys]
        sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in ys]
        (line,) = ax.plot(steps, m, marker="o", ms=3, label=f"{arm} ({len(runs)} seeds)")
        ax.fill_between(steps, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)], color=line.get_color(),
                        alpha=0.15)
    ax.set_title(f"linked_frac=1, p={rep['p']}")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out linked Q2 F1 (T=1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for p in PLAN["dose"]["p"]:
        cells = [c for c in rep["dose"] if float(c["p"]) == float(p) and c["diff"]]
        xs = [c["linked_frac"] for c in cells]
        ys = [c["diff"]["area"]["mean"] for c in cells]
        err = [[y - (c["diff"]["area"]["t"] or {"lo": y})["lo"] for y, c in zip(ys, cells)],
               [(c["diff"]["area"]["t"] or {"hi": y})["hi"] - y for y, c in zip(ys, cells)]]
        bx.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"p={p}")
    bx.axhline(0, color="grey", lw=0.8)
    bx.set_title("dose-response: memopd − persistent (F1 area, t 95%)")
    bx.set_xlabel("linked_frac (share of training sets with a linked pair)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return path


def _report(args) -> int:
    from .runs import publish_results, results_dir_of

    results_dir = results_dir_of(args.publish)
    rep = build_report(args.out)
    paths = {ext: os.path.join(args.out, f"rulegap.{ext}") for ext in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump(rep, f, indent=1)
    text = format_report(rep)
    with open(paths["md"], "w") as f:
        f.write(text)
    plot_report(rep, paths["png"])
    print(text)
    if results_dir:
        publish_results(paths.values(), results_dir, print, "rulegap")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m memopd.trainer.experiments.rulegap", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gates")
    g.add_argument("--out", required=True)
    g.add_argument("--student", required=True)
    g.add_argument("--check-tasks", type=int, default=16)
    g.add_argument("--g0", action="store_true", help="also read G0 from the g0 stage's runs")
    r = sub.add_parser("run")
    r.add_argument("stage", choices=["g0", "arms", "dose", "main"])
    r.add_argument("--out", required=True)
    r.add_argument("--student", required=True)
    r.add_argument("--jobs", type=int, default=2)
    j = sub.add_parser("job")
    j.add_argument("--out", required=True)
    j.add_argument("--student", required=True)
    j.add_argument("--job", required=True)
    s = sub.add_parser("sft")
    s.add_argument("--out", required=True)
    s.add_argument("--student", required=True)
    rp = sub.add_parser("report")
    rp.add_argument("--out", required=True)
    rp.add_argument("--publish", nargs="?", const=DEFAULT_RESULTS_DIR, default=None, metavar="DIR",
                    help="copy rulegap.{json,md,png} into the results directory DIR (bare: benchmarks/results/ of the checkout)")
    args = p.parse_args(argv)
    if args.cmd == "report":
        return _report(args)
    if args.cmd in ("gates", "run", "sft"):
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "student.txt"), "w") as f:
            f.write(os.path.abspath(args.student))
    if args.cmd == "gates":
        return _gates(args)
    if args.cmd == "run":
        return _run_stage(args)
    if args.cmd == "sft":
        for lf in (0.0, 1.0):
            print(lf, sft_baseline(args.out, args.student, lf)["f1_mean"], flush=True)
        return 0
    run_job(json.loads(args.job), args.out, args.student)
    return 0


if __name__ == "__main__":
    sys.exit(main())
