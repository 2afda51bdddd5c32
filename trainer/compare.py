"""`memopd compare`: train several arms from the same SFT student over several seeds and
tabulate held-out EM/F1 per Qk (mean ± std over seeds) with CPU time.

    memopd compare                                   # ppo, persistent, memopd, memopd:naive; seeds 0 1 2
    memopd compare --arms ppo memopd --seeds 0 1 --jobs 2 steps=40 train_k=[2,8]

    memopd compare --protocol paper [--quick] [--publish DIR]  # the paper's protocol (trainer/experiments/paper.py)
    memopd compare --protocol info-gap [--quick] [--force-arms]  # check first, then arms that can differ
    memopd compare --resume ...                      # after an interruption: reuse finished runs, resume the rest

An arm is `ARM` or `ARM:naive` (the action-domain ablation). Every run is a separate
`memopd train` process (so `--jobs` runs use separate cores) writing
OUT/<arm>/seed<S>/; the SFT student itself is evaluated once on the same held-out sets as
the baseline row. Results: OUT/compare.json and a Markdown table OUT/compare.md.
The runs themselves (children that die with compare, a child's failure as compare's
with the child's message and exit code: docs/design.md §11.3) are arms.py's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from .arms import parse_arm, refuse_earlier_runs, run_all
from .config import ConfigError, TrainConfig

__all__ = ["compare_main", "format_compare"]

DEFAULT_ARMS = ("ppo", "persistent", "memopd", "memopd:naive")
# `--protocol NAME`: the experiment module whose `run_protocol(args, overrides)` runs it (the
# experiments sit on top of the trainer, which imports none of them)
PROTOCOLS = {"paper": "memopd.trainer.experiments.paper", "info-gap": "memopd.trainer.experiments.infogap_protocol"}


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def format_compare(rows: list[dict], ks: list[int], metric: str = "em_mean") -> str:
    """Markdown table: one line per arm, mean ± std over seeds of `metric` per Qk."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    head = "| arm | seeds | " + " | ".join(f"Q{k} {metric}" for k in ks) + " | CPU s / run |"
    lines = [head, "|" + "---|" * (len(ks) + 3)]
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        cells = [_mean_std([r["eval"][f"Q{k}"][metric] for r in rs]) for k in ks]
        cpu = [r["cpu_s"] for r in rs if r.get("cpu_s") is not None]
        lines.append(f"| {arm} | {len(rs)} | " + " | ".join(cells) + f" | {statistics.mean(cpu):.0f} |"
                     if cpu else f"| {arm} | {len(rs)} | " + " | ".join(cells) + " | - |")
    return "\n".join(lines)


def compare_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memopd compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=None,
                   help=f"ARM or ARM:naive (default: {' '.join(DEFAULT_ARMS)}; --protocol info-gap: its "
                        "five arms, the two negative controls included)")
    p.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 2 (the protocol: its budget's seeds)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at the same time")
    p.add_argument("--out", default="runs/compare")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true",
                      help="replace the runs an earlier compare left under --out (default: refuse)")
    mode.add_argument("--resume", action="store_true",
                      help="continue an earlier compare under --out: reuse its finished runs (same config), "
                           "resume the others from their newest checkpoint")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS),
                   help="paper: Q2-only RL in the replication world, held-out Q2/Q8/Q16, bootstrap intervals, "
                        "costs, curves and the trained-student audit (docs/design.md §7.1); info-gap: the "
                        "manipulation check, then the arms in the info-gap world with pre-stated endpoints "
                        "(docs/research/replication.md)")
    p.add_argument("--force-arms", action="store_true",
                   help="with --protocol info-gap: run the arms even when the manipulation check's gate fails")
    p.add_argument("--quick", action="store_true", help="with --protocol: the smoke-test budget (minutes)")
    p.add_argument("--publish", nargs="?", const=os.path.join("benchmarks", "results"), default=None, metavar="DIR",
                   help="with --protocol: copy the results (replication_{quick,full}.*) into the results directory DIR "
                        "(bare: benchmarks/results/ of the source checkout you run from)")
    p.add_argument("overrides", nargs="*", help="key=value overrides passed to every `memopd train`")
    args = p.parse_args(argv)
    if args.publish is not None and "=" in args.publish:  # `--publish key=value ...`: a bare --publish, then overrides
        args.overrides.insert(0, args.publish)
        args.publish = os.path.join("benchmarks", "results")
    if (args.quick or args.publish) and not args.protocol:
        p.error("--quick and --publish belong to --protocol paper|info-gap")
    if args.force_arms and args.protocol != "info-gap":
        p.error("--force-arms belongs to --protocol info-gap")
    if args.arms is None and not args.protocol:  # a protocol's own arms are its module's
        args.arms = list(DEFAULT_ARMS)
    try:
        for spec in args.arms or ():
            parse_arm(spec)
        bad = [o for o in args.overrides if o.split("=", 1)[0].strip() in ("arm", "seed", "run_dir", "action_domain")]
        if bad:
            raise ConfigError(f"{bad}: set by `memopd compare` itself (use --arms / --seeds / --out)")
        cfg = TrainConfig.load(None, args.overrides)
    except ConfigError as e:
        p.error(str(e))
    if args.protocol:
        import importlib

        return importlib.import_module(PROTOCOLS[args.protocol]).run_protocol(args, args.overrides)
    args.seeds = args.seeds or [0, 1, 2]
    from memopd.env.qa.evaluate import evaluate as evaluate_dir
    from memopd.files import atomic_write_json, atomic_write_text

    from .loop import prepare

    refuse_earlier_runs(args, args.seeds)

    t0 = time.time()
    # build (or check) the SFT cache once, before parallel runs would race for it
    student_dir = prepare(TrainConfig.from_dict({**cfg.to_dict(), "arm": "memopd"})).student_dir
    os.makedirs(args.out, exist_ok=True)
    print(f"[memopd compare] baseline: SFT student {student_dir}", flush=True)
    base = evaluate_dir(student_dir, ks=cfg.eval_k, n=cfg.eval_tasks)
    rows = [{"arm": "sft student", "seed": None, "eval": base["results"], "cpu_s": None, "wall_s": None}]
    todo = [(a, s) for a in args.arms for s in args.seeds]
    print(f"[memopd compare] {len(todo)} runs, {args.jobs} at a time, under {args.out}", flush=True)

    def on_row(a: str, s: int, r: dict) -> None:
        q = ", ".join(f"Q{k} {r['eval'][f'Q{k}']['em_mean']:.3f}" for k in cfg.eval_k)
        print(f"[memopd compare] {a} seed {s}: EM {q} ({r['cpu_s']:.0f} s CPU)", flush=True)
        rows.append(r)

    run_all(todo, args.out, args.overrides, jobs=args.jobs, overwrite=args.overwrite, resume=args.resume,
            on_row=on_row)
    table = "\n\n".join(format_compare(rows, cfg.eval_k, m) for m in ("em_mean", "f1_mean"))
    atomic_write_json(os.path.join(args.out, "compare.json"),
                      {"overrides": args.overrides, "config": cfg.to_dict(), "rows": rows,
                       "wall_s": round(time.time() - t0, 1)})
    atomic_write_text(os.path.join(args.out, "compare.md"), table + "\n")
    print(table)
    print(f"[memopd compare] {time.time() - t0:.0f} s wall; results in {os.path.abspath(args.out)}")
    return 0
