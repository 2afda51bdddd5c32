"""The runs of `memopd compare` for the protocols (paper.py, infogap_protocol.py): the
setup both make before their own stages (`protocol_setup`: arms, budget, seeds, config,
the refusal of earlier runs, the SFT built once), and the reading of the runs: per-set
scores of a final model, a run's costs and learning curve, their mean ± std over seeds,
the clipped-step fraction, the text helpers of the reports, and where `--publish` copies
the results (`results_dir_of`, `publish_results`).
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_RESULTS_DIR", "ProtocolStart", "protocol_setup",
           "mean_std", "per_set_scores", "run_costs", "run_curve", "band", "summary_by_arm",
           "clipped_step_fraction", "pm", "signed", "results_dir_of", "publish_results"]


# where a bare `--publish` copies results: the benchmarks/results/ folder of the source checkout run from
# its root (an installed package has none of its own: `--publish DIR` names the folder)
DEFAULT_RESULTS_DIR = os.path.join("benchmarks", "results")


# ----------------------------------------------------------------------------------
# the setup of a protocol run
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProtocolStart:
    """What `protocol_setup` settled for a protocol run."""

    name: str  # the budget's name: "quick" (`--quick`) or "full"
    budget: Any  # the protocol's budget of that name
    seeds: list[int]  # `--seeds`, else the budget's
    overrides: list[str]  # the budget's `memopd train` settings, then the user's (which win)
    cfg: Any  # the `TrainConfig` they give
    results_dir: str | None  # where `--publish` copies the results (`results_dir_of`)
    t0: float  # wall clock once the earlier runs were checked
    sft_wall: float  # wall seconds of the SFT stage


def protocol_setup(args, budgets: dict, user_overrides: list[str], default_arms, log,
                   *, before_sft: str | None = None) -> tuple[ProtocolStart, Any]:
    """The start both protocols share: `args.arms` defaults to `default_arms`; the budget
    `budgets["quick" or "full"]`, its seeds unless `args.seeds`, the config of its
    overrides and `user_overrides`; earlier runs under `args.out` refused unless asked
    (`arms.refuse_earlier_runs`); `before_sft` logged; then the SFT models built once,
    before the parallel runs that would race for its cache (`loop.prepare` of the memopd
    arm), and `args.out` made. Returns (the settings, prepare's bundle)."""
    if args.arms is None:
        args.arms = list(default_arms)
    results_dir = results_dir_of(args.publish)
    from ..arms import refuse_earlier_runs
    from ..config import TrainConfig
    from ..loop import prepare

    name = "quick" if args.quick else "full"
    budget = budgets[name]
    seeds = list(args.seeds) if args.seeds else list(budget.seeds)
    overrides = budget.overrides() + list(user_overrides)
    cfg = TrainConfig.load(None, overrides)
    refuse_earlier_runs(args, seeds)
    t0 = time.time()
    if before_sft:
        log(before_sft)
    bundle = prepare(TrainConfig.from_dict({**cfg.to_dict(), "arm": "memopd"}), log)
    sft_wall = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    return ProtocolStart(name, budget, seeds, overrides, cfg, results_dir, t0, sft_wall), bundle


# ----------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------
def mean_std(xs: list[float]) -> tuple[float, float]:
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


# ----------------------------------------------------------------------------------
# reading the runs
# ----------------------------------------------------------------------------------
def run_costs(run_dir: str) -> dict:
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


def run_curve(run_dir: str, ks, base: dict, metric: str = "em") -> dict:
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


def band(curves: list[dict], ks) -> dict:
    """Mean and std over seeds at the steps every seed evaluated."""
    out = {}
    for k in ks:
        q = f"Q{k}"
        steps = sorted(set.intersection(*(set(s for s, _ in c[q]) for c in curves)))
        vals = [[dict(c[q])[s] for c in curves] for s in steps]
        out[q] = {"steps": steps, "mean": [statistics.mean(v) for v in vals],
                  "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]}
    return out


def summary_by_arm(rows_by_arm: dict, ks, key: str = "per_set") -> dict:
    out = {}
    for arm, rows in rows_by_arm.items():
        s = {"seeds": len(rows)}
        for k in ks:
            q = f"Q{k}"
            s[q] = {m: mean_std([r[key][q][f"{m}_mean"] for r in rows]) for m in ("em", "f1")}
        out[arm] = s
    return out


def clipped_step_fraction(run_dir: str, max_grad_norm: float) -> float | None:
    """Share of a run's training steps whose actor gradient norm (before clipping, the
    mean over the step's optimiser steps) exceeded the clip `max_grad_norm`."""
    from ..plot import read_metrics
    from ..stats import ACTOR_GRAD_NORM, train_metric

    xs = [float(m[train_metric(ACTOR_GRAD_NORM)]) for m in read_metrics(run_dir) if train_metric(ACTOR_GRAD_NORM) in m]
    if not xs or not max_grad_norm:
        return None
    return sum(x > max_grad_norm for x in xs) / len(xs)


# ----------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------
def pm(m: float, s: float, n: int) -> str:
    return f"{m:.3f} ± {s:.3f}" if n > 1 else f"{m:.3f}"


def signed(x: float) -> str:
    return f"{x:+.3f}"


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
