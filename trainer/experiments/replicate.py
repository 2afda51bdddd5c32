"""The paper's protocol as one command: `memopd compare --protocol paper [--quick]`, and the
info-gap protocol that can tell the arms apart: `memopd compare --protocol info-gap`.

RL on Q2 only in the replication world, greedy evaluation on held-out Q2/Q8/Q16 sets,
arms `ppo`, `persistent`, `memopd`, `memopd:naive` over several seeds from one SFT
student, every arm with the same hyperparameters, seeds, tasks and budget
(docs/design.md §7.1). On top of `memopd compare`'s runs it computes:

- EM and F1 per k as mean ± std over seeds, from per-set scores of each final model;
- paired bootstrap 95% intervals of memopd − ppo and memopd − persistent (eval sets
  resampled, the same draws for both arms and every seed; fixed bootstrap seed) and the
  relative F1 change in the paper's form (+x% F1 over PPO);
- per arm: the student's context per call, the teacher's longest scored sequence, and
  wall time per training step (from metrics.jsonl);
- learning curves (EM per k over steps, mean ± std over seeds) as one PNG;
- the RCE audit (memopd/rce.py) of the final memopd student on trajectories it samples
  itself on held-out Q2/Q8 sets: aligned, flatten, and the position-only break.

Outputs: OUT/replication_{full,quick}.json (per-seed, per-set scores), .md (the tables)
and .png (the curves); `--publish DIR` copies them to the results directory DIR.

The info-gap protocol (`run_infogap_protocol`, docs/research/replication.md) runs in the
`info-gap` world: first the manipulation check (trainer/experiments/manipulation.py) on the SFT
student's Q2 rollouts, whose gate stops the protocol when the teacher is indifferent to
the view (`--force-arms` runs the arms anyway); then the arms `INFOGAP_ARMS` (a negative
control among them) with opd_coef matched to the PPO gradient at step 0, the same for
every teacher arm; then the endpoints `ENDPOINTS`, stated before the run: bootstrap intervals paired by seed
and set (`bootstrap_seeds_sets`; an area is one number per seed, so its bootstrap
resamples seeds only) with the Student t interval beside the areas' (`t_interval`), the
minimal detectable effect for the seed count (`minimal_detectable_effect`), the
clipped-step fraction of every run.
Outputs: OUT/infogap_{full,quick}.{json,md,png}. The statistics are intervals.py's.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass

from .intervals import (
    BOOTSTRAP_DRAWS,
    BOOTSTRAP_LEVEL,
    BOOTSTRAP_SEED,
    MDE_ALPHA,
    MDE_POWER,
    bootstrap_seeds_sets,
    curve_area,
    minimal_detectable_effect,
    paired_bootstrap,
    relative_change,
    t_interval,
)

__all__ = ["Budget", "BUDGETS", "per_set_scores", "audit_student", "run_protocol", "InfoGapBudget", "INFOGAP_BUDGETS",
           "INFOGAP_ARMS", "NEGATIVE_CONTROL", "ENDPOINTS", "clipped_step_fraction", "run_infogap_protocol",
           "DEFAULT_RESULTS_DIR", "results_dir_of", "publish_results"]

# where a bare `--publish` copies results: the benchmarks/results/ folder of the source checkout run from
# its root (an installed package has none of its own: `--publish DIR` names the folder)
DEFAULT_RESULTS_DIR = os.path.join("benchmarks", "results")
AUDIT_VARIANTS = ("aligned", "flatten", "positions_broken")
# the paper's audit figures (flatten; the position-only break), shown next to ours
PAPER_AUDIT = {"flatten": {"p99_dlogp": 1.774, "top1_changes": 651, "ratio_out_frac": 0.1329},
               "positions_broken": {"top1_changes": 260, "ratio_out_frac": 0.0497}}
# an SFT stage shorter than this only checked and reused cached models
SFT_REUSED_S = 60.0


@dataclass(frozen=True)
class Budget:
    """What a protocol run spends; identical for every arm."""

    seeds: tuple[int, ...]
    steps: int
    eval_every: int
    eval_tasks: int  # held-out sets per k (100: one set is worth 1% of a score)
    audit_tasks: int  # held-out sets per k the audited student samples

    def overrides(self) -> list[str]:
        """The `memopd train` settings of the protocol (user overrides come after and win)."""
        return ["world=replication", "train_k=[2]", "eval_k=[2,8,16]", f"steps={self.steps}",
                f"eval_every={self.eval_every}", f"eval_tasks={self.eval_tasks}", "checkpoint_every=0"]


# full: sized to fit about 90 minutes on 2 cores with the SFT built (see the report in
# benchmarks/results/replication_full.md); quick: a smoke test of every stage
BUDGETS = {
    "full": Budget(seeds=(0, 1, 2, 3, 4), steps=80, eval_every=20, eval_tasks=100, audit_tasks=16),
    "quick": Budget(seeds=(0, 1), steps=4, eval_every=2, eval_tasks=8, audit_tasks=2),
}


# ----------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------
def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


# ----------------------------------------------------------------------------------
# evaluation with per-set scores, and the audit, on a saved agent
# ----------------------------------------------------------------------------------
def per_set_scores(results: dict, world, n: int, seed: int = 0) -> dict:
    """Per-set EM/F1 of one agent from an `memopd.env.qa.evaluate` report's `results` (the
    `sets` it records), laid out on the held-out sets
    `world.sample_tasks(k, n, split="eval", seed=seed)` of every k, so that two agents
    line up set by set. A set played several times (sampled evaluation, `samples` > 1)
    scores the mean of its episodes; a set the report lacks (stopped before its first
    call) scores 0.

    {"Q2": {"task_id": [...], "em": [...], "f1": [...], "em_mean": .., "f1_mean": ..,
    "peak_tokens": ..}, ...}"""
    out = {}
    for q, res in results.items():
        k = int(q[1:])
        ids = [t.task_id for t in world.sample_tasks(k, n, split="eval", seed=seed)]
        sets = res.get("sets") or {"task_id": [], "em": [], "f1": []}
        em, f1 = _mean_by_id(sets["task_id"], sets["em"]), _mean_by_id(sets["task_id"], sets["f1"])
        extra = set(em) - set(ids)
        if extra:
            raise ValueError(f"{q}: the report holds sets that are not the held-out sets asked for, e.g. "
                             f"{sorted(extra)[0]!r} (another world, seed or n?)")
        out[q] = {"task_id": ids, "em": [em.get(i, 0.0) for i in ids], "f1": [f1.get(i, 0.0) for i in ids],
                  "peak_tokens": res.get("peak_tokens", 0)}
        out[q]["em_mean"] = statistics.mean(out[q]["em"])
        out[q]["f1_mean"] = statistics.mean(out[q]["f1"])
    return out


def _mean_by_id(ids, xs) -> dict:
    acc: dict = {}
    for i, x in zip(ids, xs):
        acc.setdefault(i, []).append(float(x))
    return {i: statistics.mean(v) for i, v in acc.items()}


def audit_student(model_dir: str, ks=(2, 8), n: int = 16, *, temperature: float = 1.0, seed: int = 0) -> dict:
    """RCE audit (memopd.rce.audit) of a trained agent on its own samples: `n` held-out
    sets per k played once at `temperature`, audited per k and pooled."""
    from memopd.env.qa.evaluate import agent_engine, load_agent_env
    from memopd.env.rollout import rollout
    from memopd.rce import audit

    model, tok, env, world = load_agent_env(model_dir)
    engine = agent_engine(model, tok)
    trajs = {}
    for k in ks:
        tasks = world.sample_tasks(k, n, split="eval", seed=seed)
        trajs[f"Q{k}"] = rollout(env, engine, tasks, temperature=temperature, seed=seed + 1000 + k)
    trajs["all"] = [t for k in ks for t in trajs[f"Q{k}"]]
    out = {}
    for name, ts in trajs.items():
        longest = max(t.flattened_tokens for t in ts)
        res = audit(model.float(), ts, AUDIT_VARIANTS, max_tokens=max(8192, longest))
        out[name] = {"trajectories": len(ts), "results": {r.variant: r.to_dict() for r in res}}
    return out


# ----------------------------------------------------------------------------------
# reading the runs
# ----------------------------------------------------------------------------------
def _run_costs(run_dir: str) -> dict:
    """Per-step context and time figures of one run (metrics.jsonl)."""
    from ..plot import read_metrics

    steps = [m for m in read_metrics(run_dir) if "time/step_s" in m]

    def col(key):
        return [float(m[key]) for m in steps if m.get(key) is not None]

    out = {"steps": len(steps)}
    for key, name in (("rollout/peak_context", "student_peak_context"), ("rollout/call_tokens_mean", "call_tokens"),
                      ("train/teacher_context_peak", "teacher_context_peak"), ("time/step_s", "step_s")):
        xs = col(key)
        out[name] = {"mean": statistics.mean(xs), "max": max(xs)} if xs else None
    return out


def _run_curve(run_dir: str, ks, base: dict, metric: str = "em") -> dict:
    """{"Q2": [(step, EM), ...]} (or F1 with `metric="f1"`): step 0 is the SFT student
    (the same held-out sets)."""
    from ..plot import read_metrics

    rows = read_metrics(run_dir)
    curve = {}
    for k in ks:
        key = f"eval/{metric}_mean_q{k}"
        first = [(0, base[f"Q{k}"][f"{metric}_mean"])]
        curve[f"Q{k}"] = first + [(int(m["step"]), float(m[key])) for m in rows if key in m]
    return curve


def _band(curves: list[dict], ks) -> dict:
    """Mean and std over seeds at the steps every seed evaluated."""
    out = {}
    for k in ks:
        q = f"Q{k}"
        steps = sorted(set.intersection(*(set(s for s, _ in c[q]) for c in curves)))
        vals = [[dict(c[q])[s] for c in curves] for s in steps]
        out[q] = {"steps": steps, "mean": [statistics.mean(v) for v in vals],
                  "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]}
    return out


# ----------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------
def _pm(m: float, s: float, n: int) -> str:
    return f"{m:.3f} ± {s:.3f}" if n > 1 else f"{m:.3f}"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def format_report(rep: dict) -> str:
    from ..config import migrate_config

    ks = rep["ks"]
    cfg = migrate_config(rep["config"], strict=False)  # a report of either config form
    lines = [f"# Replication: {rep['protocol']} protocol ({rep['budget_name']})", "",
             f"World `{cfg['env']['world']}`, RL on Q{'/Q'.join(map(str, cfg['train_k']))} only, "
             f"{cfg['steps']} steps, seeds {rep['budget']['seeds']}, greedy evaluation on "
             f"{cfg['eval_tasks']} held-out sets per k. Wall time {rep['wall_s'] / 60:.1f} min "
             + (f"(SFT {rep['sft_wall_s'] / 60:.1f} min)." if rep["sft_wall_s"] >= SFT_REUSED_S else
                "(SFT models reused from the cache).") + f" Student: `{rep['student']}`.", "",
             "## EM and F1 (mean ± std over seeds)", "",
             "| arm | seeds | " + " | ".join(f"Q{k} EM | Q{k} F1" for k in ks) + " |",
             "|---|---|" + "---|---|" * len(ks)]
    for arm, s in rep["summary"].items():
        cells = [f"{_pm(*s[f'Q{k}'][m], s['seeds'])}" for k in ks for m in ("em", "f1")]
        lines.append(f"| {arm} | {s['seeds']} | " + " | ".join(cells) + " |")
    lines += ["", f"## Paired differences (bootstrap {int(100 * BOOTSTRAP_LEVEL)}% interval over eval sets, "
              f"{BOOTSTRAP_DRAWS} draws, seed {BOOTSTRAP_SEED})", "",
              "| comparison | k | ΔEM [95% CI] | ΔF1 [95% CI] | relative F1 |", "|---|---|---|---|---|"]
    for name, per_k in rep["differences"].items():
        for q, d in per_k.items():
            rel = d["f1_relative_pct"]
            lines.append(f"| {name} | {q} | {_signed(d['em']['diff'])} [{_signed(d['em']['lo'])}, "
                         f"{_signed(d['em']['hi'])}] | {_signed(d['f1']['diff'])} [{_signed(d['f1']['lo'])}, "
                         f"{_signed(d['f1']['hi'])}] | " + ("-" if rel is None else f"{rel:+.1f}% F1") + " |")
    lines += ["", "## Cost per arm (mean over seeds of the per-run figures)", "",
              "| arm | student context per call (mean) | student peak context (mean / max over steps) | "
              "teacher's longest scored sequence (max) | wall s per training step |", "|---|---|---|---|---|"]
    for arm, c in rep["costs"].items():
        def cell(key, stat, fmt="{:.0f}", c=c):
            return "-" if c.get(key) is None else fmt.format(c[key][stat])
        lines.append(f"| {arm} | {cell('call_tokens', 'mean', '{:.1f}')} | {cell('student_peak_context', 'mean')} / "
                     f"{cell('student_peak_context', 'max')} | {cell('teacher_context_peak', 'max')} | "
                     f"{cell('step_s', 'mean', '{:.2f}')} |")
    a = rep.get("audit")
    if a:
        lines += ["", f"## RCE audit of the trained student ({a['arm']} seed {a['seed']}, its own samples at "
                  f"temperature {a['temperature']} on held-out sets)", "",
                  "| sets | layout | actions | p99 \\|Δ log-prob\\| | top-1 changes | ratio outside [0.8, 1.2] | "
                  "spurious positions (naive domain) |", "|---|---|---|---|---|---|---|"]
        for name, block in a["by_set"].items():
            for v, r in block["results"].items():
                sp = "-" if r["spurious_positions"] is None else str(r["spurious_positions"])
                lines.append(f"| {name} ({block['trajectories']} episodes) | {v} | {r['actions']} | "
                             f"{r['p99_dlogp']:.3g} | {r['top1_changes']} | {100 * r['ratio_out_frac']:.2f}% | {sp} |")
        lines += ["", "Paper: flatten p99 1.774, 651 top-1 changes, 13.29% outside; position-only break 260 top-1 "
                  "changes, 4.97% outside. Reference: an independent forward of each call, which the recorded "
                  "sampling log-probs equal up to float noise (`rce/max_dlogp_vs_sampling`, docs/design.md §7.7)."]
    lines += ["", f"Curves: `replication_{rep['budget_name']}.png` (EM per k over steps, step 0 = the SFT student; "
              "band: ± std over seeds)."]
    return "\n".join(lines) + "\n"


def _summary(rows_by_arm: dict, ks, key: str = "per_set") -> dict:
    out = {}
    for arm, rows in rows_by_arm.items():
        s = {"seeds": len(rows)}
        for k in ks:
            q = f"Q{k}"
            s[q] = {m: _mean_std([r[key][q][f"{m}_mean"] for r in rows]) for m in ("em", "f1")}
        out[arm] = s
    return out


def _differences(rows_by_arm: dict, ks, pairs) -> dict:
    out = {}
    for new, base in pairs:
        if new not in rows_by_arm or base not in rows_by_arm:
            continue
        a = {r["seed"]: r for r in rows_by_arm[new]}
        b = {r["seed"]: r for r in rows_by_arm[base]}
        seeds = sorted(set(a) & set(b))
        per_k = {}
        for k in ks:
            q = f"Q{k}"
            d = {m: paired_bootstrap([a[s]["per_set"][q][m] for s in seeds], [b[s]["per_set"][q][m] for s in seeds],
                                     level=BOOTSTRAP_LEVEL) for m in ("em", "f1")}
            d["f1_relative_pct"] = relative_change(statistics.mean(a[s]["per_set"][q]["f1_mean"] for s in seeds),
                                                   statistics.mean(b[s]["per_set"][q]["f1_mean"] for s in seeds))
            per_k[q] = d
        out[f"{new} − {base}"] = per_k
    return out


def _costs(rows_by_arm: dict) -> dict:
    out = {}
    for arm, rows in rows_by_arm.items():
        if arm == "sft student":
            continue
        c = {}
        for key in ("call_tokens", "student_peak_context", "teacher_context_peak", "step_s"):
            xs = [r["costs"][key] for r in rows if r["costs"].get(key)]
            c[key] = {"mean": statistics.mean(x["mean"] for x in xs), "max": max(x["max"] for x in xs)} if xs else None
        out[arm] = c
    return out


def results_dir_of(publish: str | None) -> str | None:
    """The directory `--publish [DIR]` names (None: not publishing), checked before any run
    starts: it must exist. A bare `--publish` names `DEFAULT_RESULTS_DIR` (a source checkout)."""
    if not publish:
        return None
    from memopd.errors import UserError

    if not os.path.isdir(publish):
        raise UserError(f"--publish {publish}: not a directory; give the results directory to copy into "
                        "(`--publish DIR`; a bare --publish means benchmarks/results/ of the source checkout you run from)")
    return publish


def publish_results(paths, results_dir: str, log, tag: str) -> None:
    """Copy each result file into `results_dir`, each copy atomic (a failed copy leaves the
    published file as it was)."""
    from memopd.files import atomic_file

    for src in paths:
        dst = os.path.join(results_dir, os.path.basename(src))
        with atomic_file(dst) as tmp:
            shutil.copyfile(src, tmp)
        log(f"[{tag}] published {dst}")


def run_protocol(args, user_overrides: list[str], log=print) -> int:
    """`memopd compare --protocol paper`: see the module doc. `args`: compare's parsed
    arguments (arms, seeds, jobs, out, overwrite, resume, quick, publish); `--protocol
    info-gap` goes to `run_infogap_protocol`."""
    if getattr(args, "protocol", "paper") == "info-gap":
        return run_infogap_protocol(args, user_overrides, log)
    if args.arms is None:
        from ..compare import DEFAULT_ARMS

        args.arms = list(DEFAULT_ARMS)
    results_dir = results_dir_of(args.publish)
    from memopd.env.qa.evaluate import evaluate
    from memopd.files import atomic_write_text

    from ..arms import arm_run_dir, refuse_earlier_runs, run_all
    from ..config import TrainConfig
    from ..loop import prepare
    from ..plot import plot_protocol_curves

    name = "quick" if args.quick else "full"
    budget = BUDGETS[name]
    seeds = list(args.seeds) if args.seeds else list(budget.seeds)
    overrides = budget.overrides() + list(user_overrides)
    cfg = TrainConfig.load(None, overrides)
    refuse_earlier_runs(args, seeds)
    t0 = time.time()
    # the SFT is built once here, before the parallel runs that would race for its cache
    bundle = prepare(TrainConfig.from_dict({**cfg.to_dict(), "arm": "memopd"}), log)
    world, student_dir = bundle.tasks, bundle.student_dir
    sft_wall = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    ks = list(cfg.eval_k)
    log(f"[replication] SFT student {student_dir} ({sft_wall:.0f} s); evaluating it on {cfg.eval_tasks} sets per k")
    base = per_set_scores(evaluate(student_dir, ks=ks, n=cfg.eval_tasks)["results"], world, cfg.eval_tasks)
    rows_by_arm: dict[str, list] = {"sft student": [{"seed": None, "per_set": base}]}
    todo = [(a, s) for a in args.arms for s in seeds]
    log(f"[replication] {len(todo)} runs ({len(args.arms)} arms x seeds {seeds}), {args.jobs} at a time, "
        f"under {args.out}")
    curves: dict[str, list] = {}

    def on_row(a: str, s: int, r: dict) -> None:
        # the final model's greedy episodes as the run evaluated them (report.json)
        r["per_set"] = per_set_scores(r.pop("eval"), world, cfg.eval_tasks)
        r["costs"] = _run_costs(r["run_dir"])
        curves.setdefault(a, []).append(_run_curve(r["run_dir"], ks, base))
        rows_by_arm.setdefault(a, []).append(r)
        log(f"[replication] {a} seed {s}: " + ", ".join(f"{q} EM {v['em_mean']:.3f} F1 {v['f1_mean']:.3f}"
                                                       for q, v in r["per_set"].items()))

    run_all(todo, args.out, overrides, jobs=args.jobs, overwrite=args.overwrite, resume=args.resume, on_row=on_row)
    audit = None
    audit_arm = "memopd" if "memopd" in rows_by_arm else None
    if audit_arm:
        seed0 = min(seeds)
        final = os.path.join(arm_run_dir(args.out, audit_arm, seed0), "final")
        log(f"[replication] RCE audit of {final} on its own samples")
        audit = {"arm": audit_arm, "seed": seed0, "temperature": cfg.temperature, "model": final,
                 "by_set": audit_student(final, [k for k in ks if k in (2, 8)] or ks[:1], budget.audit_tasks,
                                         temperature=cfg.temperature)}
    bands = {arm: _band(cs, ks) for arm, cs in curves.items()}
    rep = {
        "protocol": "paper", "budget_name": name, "budget": {**budget.__dict__, "seeds": seeds},
        "overrides": overrides, "config": cfg.to_dict(), "ks": ks, "student": student_dir,
        "summary": _summary(rows_by_arm, ks),
        "differences": _differences(rows_by_arm, ks, [("memopd", "ppo"), ("memopd", "persistent")]),
        "costs": _costs(rows_by_arm), "curves": bands, "audit": audit,
        "runs": {arm: rows for arm, rows in rows_by_arm.items() if arm != "sft student"},
        "sft_student_per_set": base,
        "sft_wall_s": round(sft_wall, 1),
    }
    paths = {ext: os.path.join(args.out, f"replication_{name}.{ext}") for ext in ("json", "md", "png")}
    plot_protocol_curves(bands, ks, paths["png"], title=f"paper protocol ({name}): held-out EM over training steps")
    rep["wall_s"] = round(time.time() - t0, 1)
    atomic_write_text(paths["json"], json.dumps(rep, indent=1))
    table = format_report(rep)
    atomic_write_text(paths["md"], table)
    log(table)
    if results_dir:
        publish_results(paths.values(), results_dir, log, "replication")
    log(f"[replication] {rep['wall_s'] / 60:.1f} min wall; results in {os.path.abspath(args.out)}")
    return 0


# ----------------------------------------------------------------------------------
# the info-gap protocol: a replication that can tell the arms apart
# ----------------------------------------------------------------------------------
INFOGAP_ARMS = ("ppo", "persistent", "memopd", "broken_positions", "broken_visibility")
# the arm whose teacher state is broken enough to serve as the negative control: the check
# (check.controls) showed that row-global positions barely move a teacher trained on the
# flattened view too (its signal stays closer to memopd's than persistent's is)
NEGATIVE_CONTROL = "broken_visibility"
# stated before any run; written into every result (docs/research/replication.md). Second statement
# (2026-12-05): the first read greedy F1, which no arm moved, the controls included, in
# 40 steps; this one reads the sampled policy that training changes, over 80 steps.
ENDPOINTS = {
    "version": 2,
    "primary": "area under the held-out Q2 F1 curve over training, F1 read at the training temperature (1.0) as "
               "the mean of 8 sampled episodes on each of the 200 held-out sets (trapezoid over the evaluations "
               "every 10 steps, step 0 = the SFT student, divided by the steps: the mean F1 over training), "
               "memopd − persistent, paired by seed; 95% percentile bootstrap over seeds; the minimal detectable "
               "effect for the seed count",
    "secondary": ["final held-out Q2 F1 (the primary's reading) on information-gap sets and on plain sets, "
                  "memopd − persistent",
                  "final held-out Q2 F1, greedy, memopd − persistent (the first statement's reading)",
                  "final held-out Q8 F1, greedy (retention: the student's SFT data holds Q8), memopd − persistent",
                  "positive control: Q2 F1 area memopd − ppo",
                  "negative control: Q2 F1 area memopd − broken_visibility (a teacher scored on aligned calls with "
                  "one causal segment per row, so that a call sees the calls packed before it) must be positive",
                  "Q2 F1 area memopd − broken_positions (aligned calls with row-global positions; the negative control "
                  "of the first statement, kept as an arm: the check shows it barely moves this teacher's signal)"],
    "controls": "the endpoint is shown able to tell arms apart when both controls' 95% intervals (positive: memopd − "
                "ppo; negative: memopd − broken_visibility) lie above zero; otherwise the primary is reported and not "
                "read as evidence either way",
    "intervals": "95% percentile bootstrap, 10000 draws, seed 0, paired by seed (and by set where there are sets): "
                 "the areas are one number per seed, so their bootstrap resamples the per-seed differences only (with 5 "
                 "seeds narrower than it says: about 0.85 coverage at nominal 0.95); the final per-set scores resample "
                 "seeds and sets together. Beside each area interval: the Student t 95% interval over the per-seed "
                 "differences (`t_interval`), added after the run, which is the one to read with 5 seeds",
}


@dataclass(frozen=True)
class InfoGapBudget:
    """What an info-gap protocol run spends; identical for every arm. The curves read Q2 at
    `eval_temperature` with `eval_samples` episodes per set; each final model is also
    played greedily on Q2 and Q8 (`final_greedy_k`)."""

    seeds: tuple[int, ...]
    steps: int
    eval_every: int
    eval_tasks: int  # held-out sets per k at every evaluation
    check_tasks: int  # Q2 sets the manipulation check samples (x group_size rollouts)
    eval_temperature: float = 1.0
    eval_samples: int = 8
    final_greedy_k: tuple[int, ...] = (2, 8)

    def overrides(self) -> list[str]:
        return ["world=info-gap", "train_k=[2]", "eval_k=[2]", f"steps={self.steps}",
                f"eval_every={self.eval_every}", f"eval_tasks={self.eval_tasks}",
                f"eval_temperature={self.eval_temperature}", f"eval_samples={self.eval_samples}", "checkpoint_every=10"]


INFOGAP_BUDGETS = {
    "full": InfoGapBudget(seeds=(0, 1, 2, 3, 4), steps=80, eval_every=10, eval_tasks=200, check_tasks=32),
    "quick": InfoGapBudget(seeds=(0, 1), steps=4, eval_every=2, eval_tasks=8, check_tasks=4, eval_samples=2),
}


def clipped_step_fraction(run_dir: str, max_grad_norm: float) -> float | None:
    """Share of a run's training steps whose actor gradient norm (before clipping, the
    mean over the step's optimiser steps) exceeded the clip `max_grad_norm`."""
    from ..plot import read_metrics
    from ..stats import ACTOR_GRAD_NORM, train_metric

    xs = [float(m[train_metric(ACTOR_GRAD_NORM)]) for m in read_metrics(run_dir) if train_metric(ACTOR_GRAD_NORM) in m]
    if not xs or not max_grad_norm:
        return None
    return sum(x > max_grad_norm for x in xs) / len(xs)


def _infogap_stats(rows_by_arm: dict, linked: list[bool]) -> dict:
    """The pre-stated endpoints (`ENDPOINTS`) from the runs' curves and final per-set scores."""
    def by_seed(arm):
        return {r["seed"]: r for r in rows_by_arm.get(arm, [])}

    out: dict = {}

    def area_diff(new, base):
        a, b = by_seed(new), by_seed(base)
        seeds = sorted(set(a) & set(b))
        if not seeds:
            return None
        x = [a[s]["area_f1_q2"] for s in seeds]
        y = [b[s]["area_f1_q2"] for s in seeds]
        d = bootstrap_seeds_sets(x, y)
        d["t"] = t_interval(d["per_seed"]) if len(seeds) > 1 else None
        d["mde"] = minimal_detectable_effect(d["per_seed"])
        d["mde_by_seeds"] = {n: minimal_detectable_effect(d["per_seed"], seeds=n) for n in (5, 8, 12)}
        d["seed_ids"] = seeds
        return d

    def final_diff(new, base, q, mask=None, key="per_set"):
        a, b = by_seed(new), by_seed(base)
        seeds = sorted(set(a) & set(b))
        if not seeds or q not in a[seeds[0]].get(key, {}):
            return None
        cols = [j for j in range(len(a[seeds[0]][key][q]["f1"])) if mask is None or mask[j]]
        if not cols:
            return None
        x = [[a[s][key][q]["f1"][j] for j in cols] for s in seeds]
        y = [[b[s][key][q]["f1"][j] for j in cols] for s in seeds]
        return bootstrap_seeds_sets(x, y)

    out["primary"] = {"name": "Q2 F1 area, memopd − persistent", **(area_diff("memopd", "persistent") or {})}
    out["secondary"] = {
        "Q2 final F1 on information-gap sets, memopd − persistent": final_diff("memopd", "persistent", "Q2", linked),
        "Q2 final F1 on plain sets, memopd − persistent": final_diff("memopd", "persistent", "Q2",
                                                                     [not x for x in linked]),
        "Q2 final greedy F1, memopd − persistent": final_diff("memopd", "persistent", "Q2", key="per_set_greedy"),
        "Q8 final greedy F1 (retention), memopd − persistent": final_diff("memopd", "persistent", "Q8",
                                                                          key="per_set_greedy"),
        "positive control: Q2 F1 area, memopd − ppo": area_diff("memopd", "ppo"),
        f"negative control: Q2 F1 area, memopd − {NEGATIVE_CONTROL}": area_diff("memopd", NEGATIVE_CONTROL),
        **{f"Q2 F1 area, memopd − {arm}": area_diff("memopd", arm)
           for arm in ("broken_positions", "broken_visibility") if arm != NEGATIVE_CONTROL},
    }
    out["secondary"] = {k: v for k, v in out["secondary"].items() if v is not None}
    out["controls"] = controls_verdict(out["secondary"])
    return out


def controls_verdict(secondary: dict) -> dict:
    """Whether the endpoint told the controls apart (`ENDPOINTS["controls"]`): the positive
    control (memopd − ppo) and the negative control (memopd − `NEGATIVE_CONTROL`) need a
    95% interval above zero; None for a control whose arms did not run."""
    def above(name_start):
        ds = [d for n, d in secondary.items() if n.startswith(name_start)]
        return None if not ds else all(d["lo"] > 0 for d in ds)

    pos, neg = above("positive control"), above("negative control")
    return {"positive": pos, "negative": neg, "endpoint_detects_controls": bool(pos and neg)}


def _ci(d: dict) -> str:
    """The bootstrap interval, and the t-interval beside it where there is one (areas)."""
    t = d.get("t")
    return (f"{_signed(d['diff'])} [{_signed(d['lo'])}, {_signed(d['hi'])}]"
            + (f" (t: [{_signed(t['lo'])}, {_signed(t['hi'])}])" if t else ""))


def format_infogap_report(rep: dict) -> str:
    c = rep["check"]
    lines = [f"# Replication: info-gap protocol ({rep['budget_name']})", "",
             "## Endpoints (stated before the run)", "", f"- primary: {ENDPOINTS['primary']}"]
    lines += [f"- secondary: {s}" for s in ENDPOINTS["secondary"]] + [f"- controls: {ENDPOINTS['controls']}",
                                                                       f"- intervals: {ENDPOINTS['intervals']}", ""]
    from .manipulation import format_check

    lines += ["## Manipulation check", "", "```", format_check(c), "```", ""]
    if not rep.get("arms_run"):
        lines += ["**The arms were not run**: the teacher's preferences do not depend enough on the view it is "
                  "shown, so memopd and persistent would receive the same distillation signal and no result "
                  "could tell them apart (`--force-arms` runs them anyway).", ""]
        return "\n".join(lines) + "\n"
    ks = rep["ks"]
    if rep.get("forced"):
        lines += ["**Forced**: the gate failed and the arms were run anyway (`--force-arms`); the check above says "
                  "how little the two teacher arms' signals may differ, and every comparison below is read with it.", ""]
    cfg = rep["config"]
    reading = (f"at temperature {cfg.get('eval_temperature', 0):g}, {cfg.get('eval_samples', 1)} episodes per set"
               if cfg.get("eval_temperature") else "greedy")
    greedy_ks = rep.get("greedy_ks") or []
    lines += [f"opd_coef {rep['opd_coef']:.4g} ({rep['opd_coef_source']}), the same for every teacher arm; "
              f"max_grad_norm {cfg['max_grad_norm']}; {cfg['steps']} steps; curves read {reading}.", "",
              "## Final EM and F1 (mean ± std over seeds), Q2 F1 area, clipped steps", "",
              f"Q{'/Q'.join(map(str, ks))} read {reading}" + (f"; greedy Q{'/Q'.join(map(str, greedy_ks))} of the "
                                                               "final models" if greedy_ks else "") + ".", "",
              "| arm | seeds | " + " | ".join(f"Q{k} EM | Q{k} F1" for k in ks)
              + "".join(f" | Q{k} F1 greedy" for k in greedy_ks) + " | Q2 F1 area | clipped steps |",
              "|---|---|" + "---|---|" * len(ks) + "---|" * len(greedy_ks) + "---|---|"]
    for arm, s in rep["summary"].items():
        cells = [f"{_pm(*s[f'Q{k}'][m], s['seeds'])}" for k in ks for m in ("em", "f1")]
        g = rep.get("summary_greedy", {}).get(arm)
        cells += [f"{_pm(*g[f'Q{k}']['f1'], g['seeds'])}" if g else "-" for k in greedy_ks]
        runs = rep["runs"].get(arm, [])
        area = _pm(*_mean_std([r["area_f1_q2"] for r in runs]), len(runs)) if runs else "-"
        clip = [r["clipped_step_fraction"] for r in runs if r.get("clipped_step_fraction") is not None]
        lines.append(f"| {arm} | {s['seeds']} | " + " | ".join(cells) + f" | {area} | "
                     + (f"{100 * statistics.mean(clip):.0f}%" if clip else "-") + " |")
    p = rep["stats"]["primary"]
    lines += ["", "## Primary endpoint", ""]
    if "diff" in p:
        mde = "-" if p["mde"] is None else f"{p['mde']:.3f}"
        lines += [f"{p['name']}: {_ci(p)} over {p['seeds']} seeds ({p['positive_seeds']} of {p['seeds']} positive); "
                  f"minimal detectable effect (α {MDE_ALPHA}, power {MDE_POWER}) for {p['seeds']} seeds: {mde}"
                  + "; for " + ", ".join(f"{n} seeds {'-' if v is None else f'{v:.3f}'}"
                                         for n, v in p["mde_by_seeds"].items()) + "."]
    lines += ["", "## Secondary endpoints and controls", "", "| comparison | Δ [95% CI] | seeds | sets |", "|---|---|---|---|"]
    for name, d in rep["stats"]["secondary"].items():
        lines.append(f"| {name} | {_ci(d)} | {d['seeds']} | {d['sets']} |")
    v = rep["stats"].get("controls")
    if v is not None:
        def said(x):
            return "not run" if x is None else ("above zero" if x else "not above zero")

        lines += ["", f"Controls: positive {said(v['positive'])}, negative {said(v['negative'])}: "
                  + ("the endpoint tells the controls apart." if v["endpoint_detects_controls"] else
                     "the endpoint is not shown able to tell arms apart, so the primary is not read as evidence "
                     "either way.")]
    lines += ["", f"Curves: `infogap_{rep['budget_name']}.png` (held-out F1 per k over steps, step 0 = the SFT "
              "student; band: ± std over seeds)."]
    return "\n".join(lines) + "\n"


def run_infogap_protocol(args, user_overrides: list[str], log=print) -> int:
    """`memopd compare --protocol info-gap`: the manipulation check, then (if its gate
    passes, or `--force-arms`) the arms with a gradient-matched opd_coef, and the
    pre-stated endpoints. Outputs OUT/infogap_{full,quick}.{json,md,png}."""
    if args.arms is None:
        args.arms = list(INFOGAP_ARMS)
    results_dir = results_dir_of(args.publish)
    from memopd.env.qa.evaluate import evaluate
    from memopd.files import atomic_write_text

    from ..arms import refuse_earlier_runs, run_all
    from ..config import TrainConfig, migrate_config
    from ..loop import prepare
    from ..plot import plot_protocol_curves
    from .manipulation import format_check, manipulation_check

    name = "quick" if args.quick else "full"
    budget = INFOGAP_BUDGETS[name]
    seeds = list(args.seeds) if args.seeds else list(budget.seeds)
    cfg = TrainConfig.load(None, budget.overrides() + list(user_overrides))
    refuse_earlier_runs(args, seeds)
    t0 = time.time()
    log("[info-gap] endpoints, stated before the run:\n  primary: " + ENDPOINTS["primary"]
        + "".join(f"\n  secondary: {s}" for s in ENDPOINTS["secondary"]) + "\n  controls: " + ENDPOINTS["controls"])
    bundle = prepare(TrainConfig.from_dict({**cfg.to_dict(), "arm": "memopd"}), log)
    world, student_dir = bundle.tasks, bundle.student_dir
    sft_wall = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    check = manipulation_check(cfg, bundle, k=2, tasks=budget.check_tasks, seed=0)
    log("[info-gap] " + format_check(check))
    del bundle
    paths = {ext: os.path.join(args.out, f"infogap_{name}.{ext}") for ext in ("json", "md", "png")}
    # the check on its own as soon as it is made: a run stopped during the arms keeps it
    paths["check.json"] = os.path.join(args.out, f"infogap_{name}.check.json")
    atomic_write_text(paths["check.json"], json.dumps({"check": check, "endpoints": ENDPOINTS}, indent=1))
    rep: dict = {"protocol": "info-gap", "budget_name": name, "budget": {**budget.__dict__, "seeds": seeds},
                 "endpoints": ENDPOINTS, "check": check, "student": student_dir, "sft_wall_s": round(sft_wall, 1),
                 "arms": list(args.arms),
                 # forced: the arms ran although the gate failed (--force-arms on a passed gate forces nothing)
                 "forced": bool(args.force_arms and not check["gate"]["passed"])}
    run_arms = check["gate"]["passed"] or args.force_arms
    rep["arms_run"] = bool(run_arms)
    if not run_arms:
        log("[info-gap] the gate failed: the arms cannot be told apart in this world, so they are not run "
            "(--force-arms runs them anyway)")
    else:
        if not check["gate"]["passed"]:
            log("[info-gap] the gate failed; --force-arms: running the arms anyway")
        user_coef = any(migrate_config({o.split("=", 1)[0].strip(): None}, strict=False).get("ppo", {}).keys()
                        == {"teacher_kl_coef"} for o in user_overrides)
        lam = check["opd_coef_matched"]
        if user_coef or lam is None:
            rep["opd_coef"], rep["opd_coef_source"] = cfg.ppo.teacher_kl_coef, "given" if user_coef else "default (no PPO gradient)"
            overrides = budget.overrides() + list(user_overrides)
        else:
            rep["opd_coef"], rep["opd_coef_source"] = float(f"{lam:.4g}"), "gradient-norm matched at step 0"
            overrides = budget.overrides() + [f"ppo.teacher_kl_coef={lam:.4g}"] + list(user_overrides)
        cfg = TrainConfig.load(None, overrides)
        ks = list(cfg.eval_k)
        greedy_ks = list(budget.final_greedy_k)

        def scores(model_dir, greedy=False):
            # on the runs' thread count: the student's step-0 curve point is this evaluation
            import torch

            old = torch.get_num_threads()
            torch.set_num_threads(max(1, cfg.cpu_threads))
            try:
                if greedy:
                    res = evaluate(model_dir, ks=greedy_ks, n=cfg.eval_tasks)
                else:
                    res = evaluate(model_dir, ks=ks, n=cfg.eval_tasks, temperature=cfg.eval_temperature,
                                   samples=cfg.eval_samples)
            finally:
                torch.set_num_threads(old)
            return per_set_scores(res["results"], world, cfg.eval_tasks)

        base = scores(student_dir)
        base_greedy = scores(student_dir, greedy=True)
        linked = [bool(t.meta.get("linked", False)) for t in world.sample_tasks(2, cfg.eval_tasks, split="eval", seed=0)]
        rows_by_arm: dict[str, list] = {"sft student": [{"seed": None, "per_set": base, "per_set_greedy": base_greedy}]}
        curves: dict[str, list] = {}

        def on_row(a: str, s: int, r: dict) -> None:
            r["per_set"] = per_set_scores(r.pop("eval"), world, cfg.eval_tasks)
            r["per_set_greedy"] = scores(os.path.join(r["run_dir"], "final"), greedy=True)
            r["costs"] = _run_costs(r["run_dir"])
            f1 = _run_curve(r["run_dir"], ks, base, metric="f1")
            r["curve_f1"] = f1
            r["area_f1_q2"] = curve_area(f1["Q2"])
            r["clipped_step_fraction"] = clipped_step_fraction(r["run_dir"], cfg.max_grad_norm)
            curves.setdefault(a, []).append(f1)
            rows_by_arm.setdefault(a, []).append(r)
            log(f"[info-gap] {a} seed {s}: Q2 F1 area {r['area_f1_q2']:.3f}, " + ", ".join(
                f"{q} F1 {v['f1_mean']:.3f}" for q, v in r["per_set"].items()))

        # seed by seed, every arm of a seed before the next seed: a run stopped early leaves
        # paired arms behind (`--resume --seeds ...` reports on the seeds it has)
        todo = [(a, s) for s in seeds for a in args.arms]
        log(f"[info-gap] {len(todo)} runs, {args.jobs} at a time, under {args.out}")
        run_all(todo, args.out, overrides, jobs=args.jobs, overwrite=args.overwrite, resume=args.resume, on_row=on_row)
        bands = {arm: _band(cs, ks) for arm, cs in curves.items()}
        rep.update({"overrides": overrides, "config": cfg.to_dict(), "ks": ks, "greedy_ks": greedy_ks,
                    "summary": _summary(rows_by_arm, ks), "summary_greedy": _summary(rows_by_arm, greedy_ks, "per_set_greedy"),
                    "stats": _infogap_stats(rows_by_arm, linked), "curves_f1": bands, "linked_sets": linked,
                    "runs": {arm: rows for arm, rows in rows_by_arm.items() if arm != "sft student"},
                    "sft_student_per_set": base, "sft_student_per_set_greedy": base_greedy})
        reading = (f"temperature {cfg.eval_temperature:g}, {cfg.eval_samples} per set" if cfg.eval_temperature
                   else "greedy")
        plot_protocol_curves(bands, ks, paths["png"], title=f"info-gap protocol ({name}): held-out F1 over steps",
                             ylabel=f"F1 (held-out, {reading})")
    rep["wall_s"] = round(time.time() - t0, 1)
    atomic_write_text(paths["json"], json.dumps(rep, indent=1))
    table = format_infogap_report(rep)
    atomic_write_text(paths["md"], table)
    log(table)
    if results_dir:
        publish_results([p for p in paths.values() if os.path.exists(p)], results_dir, log, "info-gap")
    log(f"[info-gap] {rep['wall_s'] / 60:.1f} min wall; results in {os.path.abspath(args.out)}")
    return 0
