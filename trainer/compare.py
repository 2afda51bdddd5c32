"""`memopd compare`: train several arms from the same SFT student over several seeds and
tabulate held-out EM/F1 per Qk (mean ± std over seeds) with CPU time.

    memopd compare                                   # ppo, persistent, memopd, memopd:naive; seeds 0 1 2
    memopd compare --arms ppo memopd --seeds 0 1 --jobs 2 steps=40 train_k=[2,8]

    memopd compare --protocol paper [--quick] [--publish]   # the paper's protocol (trainer/replicate.py)
    memopd compare --resume ...                      # after an interruption: reuse finished runs, resume the rest

An arm is `ARM` or `ARM:naive` (the action-domain ablation). Every run is a separate
`memopd train` process (so `--jobs` runs use separate cores) writing
OUT/<arm>/seed<S>/; the SFT student itself is evaluated once on the same held-out sets as
the baseline row. Results: OUT/compare.json and a Markdown table OUT/compare.md.
The children die with compare (their own process group, a parent-death signal), and a
child's failure is compare's, with the child's message and exit code (docs/design.md §11.3).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from memopd.errors import UserError
from memopd.packing import ACTION_DOMAINS

from .config import ARMS, ConfigError, TrainConfig

__all__ = ["compare_main", "format_compare", "run_all", "finished_row", "refuse_earlier_runs", "ChildRunError"]

DEFAULT_ARMS = ("ppo", "persistent", "memopd", "memopd:naive")


def _parse_arm(spec: str) -> tuple[str, str]:
    arm, _, domain = spec.partition(":")
    domain = domain or "exact"
    if arm not in ARMS or domain not in ACTION_DOMAINS:
        raise ConfigError(f"arm {spec!r}: expected ARM or ARM:naive with ARM one of {', '.join(ARMS)}")
    return arm, domain


def _run_dir(out: str, spec: str, seed: int) -> str:
    return os.path.join(out, spec.replace(":", "-"), f"seed{seed}")


class ChildRunError(UserError):
    """A `memopd train` child of compare failed: its own message and exit code (2 bad
    input, 3 run-directory conflict, 74 a failed write, 70 a bug: see its train.log)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Children:
    """The running `memopd train` children, so a failure or an interrupt stops them all
    (each in its own process group, with everything it started)."""

    def __init__(self):
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False

    def run(self, cmd: list[str], log) -> int:
        from memopd.cli import DIE_WITH_PARENT

        # own session: stop_all ends the child's whole process group; the variable makes the
        # child ask the kernel to kill it when this process dies (memopd.cli.die_with_parent)
        env = {**os.environ, DIE_WITH_PARENT: str(os.getpid())}
        with self._lock:
            if self.stopping:
                return -1
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self._procs.add(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)

    def stop_all(self) -> None:
        import signal

        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)


def _child_error(spec: str, seed: int, run_dir: str, rc: int) -> ChildRunError:
    """The child's own one-line error (the last `memopd train: error:` line of its log)."""
    log = os.path.join(run_dir, "train.log")
    said = ""
    with contextlib.suppress(OSError):
        with open(log, errors="replace") as f:
            lines = [x.strip() for x in f if x.startswith("memopd train: ")]
        said = lines[-1].removeprefix("memopd train: ") if lines else ""
    if rc < 0:
        return ChildRunError(f"{spec} seed {seed}: `memopd train` was killed by signal {-rc}; see {log}", 128 - rc)
    return ChildRunError(f"{spec} seed {seed}: {said or 'failed'} (exit {rc}; see {log})", rc)


def _child_config(spec: str, seed: int, out: str, overrides: list[str]) -> dict:
    return TrainConfig.load(None, [*overrides, *_child_overrides(spec, seed, out)]).to_dict()


def _child_overrides(spec: str, seed: int, out: str) -> list[str]:
    arm, domain = _parse_arm(spec)
    return [f"arm={arm}", f"action_domain={domain}", f"seed={seed}", f"run_dir={_run_dir(out, spec, seed)}",
            "progress=false"]


def _row(spec: str, seed: int, run_dir: str) -> dict:
    with open(os.path.join(run_dir, "report.json")) as f:
        rep = json.load(f)
    return {"arm": spec, "seed": seed, "eval": rep["eval"], "cpu_s": rep["cpu_s"], "wall_s": rep["wall_s"],
            "run_dir": run_dir}


def finished_row(spec: str, seed: int, out: str, overrides: list[str]) -> dict | None:
    """The result row of a finished run that this compare would run the same way (its
    report.json is complete, its final model there, its config.yaml this config but for
    the keys a resume may change), else None."""
    import yaml

    from .rundir import config_differences

    run_dir = _run_dir(out, spec, seed)
    try:
        row = _row(spec, seed, run_dir)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            stored = yaml.safe_load(f)
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    if not isinstance(stored, dict) or not os.path.isfile(os.path.join(run_dir, "final", "config.json")):
        return None
    diffs = config_differences(stored, _child_config(spec, seed, out, overrides), TrainConfig().to_dict())
    return None if [d for d in diffs if d[0] not in ("progress", "cpu_threads")] else row


def _run_one(spec: str, seed: int, out: str, overrides: list[str], overwrite: bool = False,
             resume: bool = False, children: _Children | None = None) -> dict:
    run_dir = _run_dir(out, spec, seed)
    mode = ["--overwrite"] if overwrite else ["--resume"] if resume else []
    cmd = [sys.executable, "-m", "memopd.cli", "train", *mode, *overrides, *_child_overrides(spec, seed, out)]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "train.log"), "a" if resume else "w") as log:
        rc = (children or _Children()).run(cmd, log)
    if rc != 0:
        raise _child_error(spec, seed, run_dir, rc)
    return _row(spec, seed, run_dir)


def run_all(todo: list[tuple[str, int]], out: str, overrides: list[str], *, jobs: int, overwrite: bool,
            resume: bool, on_row) -> None:
    """Run the (arm, seed) children, `jobs` at a time, calling `on_row(arm, seed, row)` in
    order; with `resume`, a finished run is reused as it is (`on_row` gets its row) and an
    unfinished one continues from its newest checkpoint. The first failure stops the
    other children and is raised with the child's own message and exit code."""
    children = _Children()
    rows = {}
    if resume:
        for a, s in todo:
            row = finished_row(a, s, out, overrides)
            if row is not None:
                rows[(a, s)] = row
                print(f"[memopd compare] {a} seed {s}: finished earlier, reused ({row['run_dir']})", flush=True)
    ex = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = {k: ex.submit(_run_one, *k, out, overrides, overwrite, resume, children)
                   for k in todo if k not in rows}
        for k in todo:
            on_row(*k, rows[k] if k in rows else futures[k].result())
    except BaseException:
        children.stop_all()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


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


def refuse_earlier_runs(args, seeds) -> None:
    """Before any SFT or training work: runs of an earlier compare under --out need
    --overwrite (replace them) or --resume (continue them)."""
    from memopd.errors import RunDirError

    from .rundir import previous_outputs

    used = [d for d in (_run_dir(args.out, a, s) for a in args.arms for s in seeds)
            if os.path.isdir(d) and previous_outputs(d)]
    if used and not (args.overwrite or args.resume):
        raise RunDirError(f"--out {args.out}: {len(used)} run(s) of an earlier compare are there (e.g. {used[0]}); "
                          "pass --resume to continue them, --overwrite to replace them, or choose another --out")


def compare_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memopd compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help="ARM or ARM:naive (default: %(default)s)")
    p.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 2 (the protocol: its budget's seeds)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at the same time")
    p.add_argument("--out", default="runs/compare")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true",
                      help="replace the runs an earlier compare left under --out (default: refuse)")
    mode.add_argument("--resume", action="store_true",
                      help="continue an earlier compare under --out: reuse its finished runs (same config), "
                           "resume the others from their newest checkpoint")
    p.add_argument("--protocol", choices=["paper"],
                   help="paper: Q2-only RL in the replication world, held-out Q2/Q8/Q16, bootstrap intervals, "
                        "costs, curves and the trained-student audit (docs/design.md §7.1)")
    p.add_argument("--quick", action="store_true", help="with --protocol: the smoke-test budget (minutes)")
    p.add_argument("--publish", action="store_true",
                   help="with --protocol: copy the results to benchmarks/results/replication_{quick,full}.*")
    p.add_argument("overrides", nargs="*", help="key=value overrides passed to every `memopd train`")
    args = p.parse_args(argv)
    if (args.quick or args.publish) and not args.protocol:
        p.error("--quick and --publish belong to --protocol paper")
    try:
        for spec in args.arms:
            _parse_arm(spec)
        bad = [o for o in args.overrides if o.split("=", 1)[0].strip() in ("arm", "seed", "run_dir", "action_domain")]
        if bad:
            raise ConfigError(f"{bad}: set by `memopd compare` itself (use --arms / --seeds / --out)")
        cfg = TrainConfig.load(None, args.overrides)
    except ConfigError as e:
        p.error(str(e))
    if args.protocol:
        from .replicate import run_protocol

        return run_protocol(args, args.overrides)
    args.seeds = args.seeds or [0, 1, 2]
    from memopd.env.evaluate import evaluate as evaluate_dir

    from .loop import prepare
    from .rundir import atomic_write_json, atomic_write_text

    refuse_earlier_runs(args, args.seeds)

    t0 = time.time()
    # build (or check) the SFT cache once, before parallel runs would race for it
    _, _, _, _, _, student_dir, _ = prepare(TrainConfig(**{**cfg.to_dict(), "arm": "memopd"}).validate())
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
