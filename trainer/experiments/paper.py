"""The paper's protocol as one command: `memopd compare --protocol paper [--quick]`.

RL on Q2 only in the replication world, greedy evaluation on held-out Q2/Q8/Q16 sets,
arms `ppo`, `persistent`, `memopd`, `memopd:naive` over several seeds from one SFT
student, every arm with the same hyperparameters, seeds, tasks and budget
(docs/design.md §7.1). On top of `memopd compare`'s runs (read by runs.py) it computes:

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
and .png (the curves); `--publish DIR` copies them to the results directory DIR. The
statistics are intervals.py's.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

from .intervals import (
    BOOTSTRAP_DRAWS,
    BOOTSTRAP_LEVEL,
    BOOTSTRAP_SEED,
    paired_bootstrap,
    relative_change,
)
from .runs import band, per_set_scores, pm, protocol_setup, publish_results, run_costs, run_curve, signed, summary_by_arm

__all__ = ["Budget", "BUDGETS", "AUDIT_VARIANTS", "PAPER_AUDIT", "audit_student", "format_report", "run_protocol"]


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
        cells = [f"{pm(*s[f'Q{k}'][m], s['seeds'])}" for k in ks for m in ("em", "f1")]
        lines.append(f"| {arm} | {s['seeds']} | " + " | ".join(cells) + " |")
    lines += ["", f"## Paired differences (bootstrap {int(100 * BOOTSTRAP_LEVEL)}% interval over eval sets, "
              f"{BOOTSTRAP_DRAWS} draws, seed {BOOTSTRAP_SEED})", "",
              "| comparison | k | ΔEM [95% CI] | ΔF1 [95% CI] | relative F1 |", "|---|---|---|---|---|"]
    for name, per_k in rep["differences"].items():
        for q, d in per_k.items():
            rel = d["f1_relative_pct"]
            lines.append(f"| {name} | {q} | {signed(d['em']['diff'])} [{signed(d['em']['lo'])}, "
                         f"{signed(d['em']['hi'])}] | {signed(d['f1']['diff'])} [{signed(d['f1']['lo'])}, "
                         f"{signed(d['f1']['hi'])}] | " + ("-" if rel is None else f"{rel:+.1f}% F1") + " |")
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


def run_protocol(args, user_overrides: list[str], log=print) -> int:
    """`memopd compare --protocol paper`: see the module doc. `args`: compare's parsed
    arguments (arms, seeds, jobs, out, overwrite, resume, quick, publish); `--protocol
    info-gap` is trainer/experiments/infogap_protocol.py's."""
    from memopd.env.qa.evaluate import evaluate
    from memopd.files import atomic_write_text

    from ..arms import arm_run_dir, run_all
    from ..compare import DEFAULT_ARMS
    from ..plot import plot_protocol_curves

    start, bundle = protocol_setup(args, BUDGETS, user_overrides, DEFAULT_ARMS, log)
    name, budget, seeds, overrides, cfg = start.name, start.budget, start.seeds, start.overrides, start.cfg
    results_dir, t0, sft_wall = start.results_dir, start.t0, start.sft_wall
    world, student_dir = bundle.tasks, bundle.student_dir
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
        r["costs"] = run_costs(r["run_dir"])
        curves.setdefault(a, []).append(run_curve(r["run_dir"], ks, base))
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
    bands = {arm: band(cs, ks) for arm, cs in curves.items()}
    rep = {
        "protocol": "paper", "budget_name": name, "budget": {**budget.__dict__, "seeds": seeds},
        "overrides": overrides, "config": cfg.to_dict(), "ks": ks, "student": student_dir,
        "summary": summary_by_arm(rows_by_arm, ks),
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
