"""Running arms as separate `memopd train` processes, for `memopd compare` (compare.py)
and the experiments' protocols (trainer/experiments/paper.py, infogap_protocol.py).

An arm is `ARM` or `ARM:naive` (the action-domain ablation); each (arm, seed) run is a
`memopd train` child writing OUT/<arm>/seed<S>/ (`arm_run_dir`). `run_all` runs them
`jobs` at a time; the children die with their parent (their own process group, a
parent-death signal), and a child's failure is raised with the child's own message and
exit code (`ChildRunError`, docs/design.md §11.3). With `resume`, finished runs with the
same config are reused (`finished_row`) and the others continue from their newest
checkpoint; `refuse_earlier_runs` keeps a new compare from mixing with an earlier one.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from memopd.errors import UserError
from memopd.packing import ACTION_DOMAINS

from .config import ARMS, ConfigError, TrainConfig

__all__ = ["parse_arm", "arm_run_dir", "ChildRunError", "child_error", "result_row", "finished_row", "run_arm",
           "run_all", "refuse_earlier_runs"]


def parse_arm(spec: str) -> tuple[str, str]:
    """(arm, action domain) of `ARM` or `ARM:naive`; a ConfigError for anything else."""
    arm, _, domain = spec.partition(":")
    domain = domain or "exact"
    if arm not in ARMS or domain not in ACTION_DOMAINS:
        raise ConfigError(f"arm {spec!r}: expected ARM or ARM:naive with ARM one of {', '.join(ARMS)}")
    return arm, domain


def arm_run_dir(out: str, spec: str, seed: int) -> str:
    """The run directory of (arm spec, seed) under `out`: OUT/<arm>/seed<S>/."""
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


def child_error(spec: str, seed: int, run_dir: str, rc: int) -> ChildRunError:
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
    arm, domain = parse_arm(spec)
    return [f"arm={arm}", f"action_domain={domain}", f"seed={seed}", f"run_dir={arm_run_dir(out, spec, seed)}",
            "progress=false"]


def result_row(spec: str, seed: int, run_dir: str) -> dict:
    with open(os.path.join(run_dir, "report.json")) as f:
        rep = json.load(f)
    return {"arm": spec, "seed": seed, "eval": rep["eval"], "cpu_s": rep["cpu_s"], "wall_s": rep["wall_s"],
            "run_dir": run_dir}


def finished_row(spec: str, seed: int, out: str, overrides: list[str]) -> dict | None:
    """The result row of a finished run that this compare would run the same way (its
    report.json is complete, its final model there, its config.yaml this config but for
    the keys a resume may change), else None."""
    import yaml

    from .config import comparable_config
    from .rundir import config_differences

    run_dir = arm_run_dir(out, spec, seed)
    try:
        row = result_row(spec, seed, run_dir)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            stored = yaml.safe_load(f)
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    if not isinstance(stored, dict) or not os.path.isfile(os.path.join(run_dir, "final", "config.json")):
        return None
    diffs = config_differences(comparable_config(stored), comparable_config(_child_config(spec, seed, out, overrides)),
                               comparable_config(TrainConfig().to_dict()))
    return None if [d for d in diffs if d[0] not in ("progress", "cpu_threads")] else row


def run_arm(spec: str, seed: int, out: str, overrides: list[str], overwrite: bool = False,
             resume: bool = False, children: _Children | None = None) -> dict:
    run_dir = arm_run_dir(out, spec, seed)
    mode = ["--overwrite"] if overwrite else ["--resume"] if resume else []
    cmd = [sys.executable, "-m", "memopd.cli", "train", *mode, *overrides, *_child_overrides(spec, seed, out)]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "train.log"), "a" if resume else "w") as log:
        rc = (children or _Children()).run(cmd, log)
    if rc != 0:
        raise child_error(spec, seed, run_dir, rc)
    return result_row(spec, seed, run_dir)


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
        futures = {k: ex.submit(run_arm, *k, out, overrides, overwrite, resume, children)
                   for k in todo if k not in rows}
        for k in todo:
            on_row(*k, rows[k] if k in rows else futures[k].result())
    except BaseException:
        children.stop_all()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def refuse_earlier_runs(args, seeds) -> None:
    """Before any SFT or training work: runs of an earlier compare under --out need
    --overwrite (replace them) or --resume (continue them)."""
    from memopd.errors import RunDirError

    from .rundir import previous_outputs

    used = [d for d in (arm_run_dir(args.out, a, s) for a in args.arms for s in seeds)
            if os.path.isdir(d) and previous_outputs(d)]
    if used and not (args.overwrite or args.resume):
        raise RunDirError(f"--out {args.out}: {len(used)} run(s) of an earlier compare are there (e.g. {used[0]}); "
                          "pass --resume to continue them, --overwrite to replace them, or choose another --out")
