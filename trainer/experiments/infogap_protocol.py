"""The info-gap protocol, which can tell the arms apart: `memopd compare --protocol info-gap`.

It runs in the `info-gap` world (docs/research/replication.md): first the manipulation
check (trainer/experiments/manipulation.py) on the SFT student's Q2 rollouts, whose gate
stops the protocol when the teacher is indifferent to the view (`--force-arms` runs the
arms anyway); then the arms `INFOGAP_ARMS` (a negative control among them) with opd_coef
matched to the PPO gradient at step 0, the same for every teacher arm; then the endpoints
`ENDPOINTS`, stated before the run: bootstrap intervals paired by seed and set
(`bootstrap_seeds_sets`; an area is one number per seed, so its bootstrap resamples seeds
only) with the Student t interval beside the areas' (`t_interval`), the minimal detectable
effect for the seed count (`minimal_detectable_effect`), the clipped-step fraction of
every run. The runs are read by runs.py, the statistics are intervals.py's.
Outputs: OUT/infogap_{full,quick}.{json,md,png}; `--publish DIR` copies them to DIR.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

from .intervals import (
    MDE_ALPHA,
    MDE_POWER,
    bootstrap_seeds_sets,
    curve_area,
    minimal_detectable_effect,
    t_interval,
)
from .runs import (
    band,
    clipped_step_fraction,
    mean_std,
    per_set_scores,
    pm,
    protocol_setup,
    publish_results,
    run_costs,
    run_curve,
    signed,
    summary_by_arm,
)

__all__ = ["INFOGAP_ARMS", "NEGATIVE_CONTROL", "ENDPOINTS", "InfoGapBudget", "INFOGAP_BUDGETS", "controls_verdict",
           "format_infogap_report", "run_protocol"]


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
    return (f"{signed(d['diff'])} [{signed(d['lo'])}, {signed(d['hi'])}]"
            + (f" (t: [{signed(t['lo'])}, {signed(t['hi'])}])" if t else ""))


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
        cells = [f"{pm(*s[f'Q{k}'][m], s['seeds'])}" for k in ks for m in ("em", "f1")]
        g = rep.get("summary_greedy", {}).get(arm)
        cells += [f"{pm(*g[f'Q{k}']['f1'], g['seeds'])}" if g else "-" for k in greedy_ks]
        runs = rep["runs"].get(arm, [])
        area = pm(*mean_std([r["area_f1_q2"] for r in runs]), len(runs)) if runs else "-"
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


def run_protocol(args, user_overrides: list[str], log=print) -> int:
    """`memopd compare --protocol info-gap`: the manipulation check, then (if its gate
    passes, or `--force-arms`) the arms with a gradient-matched opd_coef, and the
    pre-stated endpoints. Outputs OUT/infogap_{full,quick}.{json,md,png}."""
    from memopd.files import atomic_write_text

    from .manipulation import format_check, manipulation_check

    endpoints = ("[info-gap] endpoints, stated before the run:\n  primary: " + ENDPOINTS["primary"]
                 + "".join(f"\n  secondary: {s}" for s in ENDPOINTS["secondary"]) + "\n  controls: "
                 + ENDPOINTS["controls"])
    start, bundle = protocol_setup(args, INFOGAP_BUDGETS, user_overrides, INFOGAP_ARMS, log, before_sft=endpoints)
    name, budget, seeds, cfg = start.name, start.budget, start.seeds, start.cfg
    results_dir, t0, sft_wall = start.results_dir, start.t0, start.sft_wall
    bundle_world, student_dir = bundle.tasks, bundle.student_dir
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
        _run_arms(args, cfg, budget, check, user_overrides, seeds, bundle_world, student_dir, rep, paths["png"], log)
    rep["wall_s"] = round(time.time() - t0, 1)
    atomic_write_text(paths["json"], json.dumps(rep, indent=1))
    table = format_infogap_report(rep)
    atomic_write_text(paths["md"], table)
    log(table)
    if results_dir:
        publish_results([p for p in paths.values() if os.path.exists(p)], results_dir, log, "info-gap")
    log(f"[info-gap] {rep['wall_s'] / 60:.1f} min wall; results in {os.path.abspath(args.out)}")
    return 0


def _run_arms(args, cfg, budget, check, user_overrides: list[str], seeds: list[int], world, student_dir: str,
              rep: dict, png: str, log) -> None:
    """The arms of `run_protocol` once the gate let them run: opd_coef matched to the PPO
    gradient at step 0 (unless given), the SFT student's scores as step 0, every (arm,
    seed) run read as it ends, and the summaries, endpoint statistics and curves added to
    `rep` (the curves drawn to `png`)."""
    from memopd.env.qa.evaluate import evaluate

    from ..arms import run_all
    from ..config import TrainConfig, migrate_config
    from ..plot import plot_protocol_curves

    budget_name = rep["budget_name"]
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
        r["costs"] = run_costs(r["run_dir"])
        f1 = run_curve(r["run_dir"], ks, base, metric="f1")
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
    bands = {arm: band(cs, ks) for arm, cs in curves.items()}
    rep.update({"overrides": overrides, "config": cfg.to_dict(), "ks": ks, "greedy_ks": greedy_ks,
                "summary": summary_by_arm(rows_by_arm, ks), "summary_greedy": summary_by_arm(rows_by_arm, greedy_ks, "per_set_greedy"),
                "stats": _infogap_stats(rows_by_arm, linked), "curves_f1": bands, "linked_sets": linked,
                "runs": {arm: rows for arm, rows in rows_by_arm.items() if arm != "sft student"},
                "sft_student_per_set": base, "sft_student_per_set_greedy": base_greedy})
    reading = (f"temperature {cfg.eval_temperature:g}, {cfg.eval_samples} per set" if cfg.eval_temperature
               else "greedy")
    plot_protocol_curves(bands, ks, png, title=f"info-gap protocol ({budget_name}): held-out F1 over steps",
                         ylabel=f"F1 (held-out, {reading})")
