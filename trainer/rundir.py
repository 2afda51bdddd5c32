"""Run-directory integrity for `memopd train`: runs never lose or mix data.

An exclusive lock per run directory (`RunDirLock`), the choice of the checkpoint
`--resume` continues from and the config keys it may change, checkpoints written whole,
metrics cut back to a resumed step, writability checks before anything is loaded or
trained, and `rank0_decides` so all ranks act on rank 0's decision. The generic pieces
underneath (atomic writes, manifests that mark a checkpoint or SFT cache entry complete,
directory locks) are `memopd.files`, shared with the SFT stage: import them from there.
The rules, as a user sees them, are in the README ("Run directories").
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any, Callable

from memopd.errors import OutputError, RunDirError, UserError, os_failure, output_error
from memopd.files import (
    LOCK_FILE,
    MANIFEST,
    DirectoryLock,
    atomic_write_text,
    check_writable_dir,
    read_manifest,
    verify_manifest,
    weights_fingerprint,
)

__all__ = [
    "RUN_OUTPUTS",
    "SAFE_RESUME_KEYS",
    "checkpoint_write",
    "checkpoint_dirs",
    "clear_checkpoint_dir",
    "newest_complete_checkpoint",
    "config_differences",
    "check_resume_config",
    "model_fingerprints",
    "check_model_fingerprints",
    "check_served_teacher",
    "previous_outputs",
    "clear_outputs",
    "sweep_temp_files",
    "truncate_metrics",
    "last_train_record",
    "RunDirLock",
    "RunDir",
    "rank0_decides",
]

# what `memopd train` (and `memopd plot`) write into a run directory: a directory holding
# any of these is a used run directory, and --overwrite deletes exactly these (other files,
# e.g. a log the caller writes next to them, are left alone)
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "report.json", "checkpoints", "final", "eval_model", "tb",
               "curves.png")
# the files among them that memopd writes, appends to or truncates in place: never a link
_RUN_FILES = ("config.yaml", "metrics.jsonl", "report.json", "curves.png")
# Config keys a resumed run may change and still be the exact continuation of the stored
# run: how long it runs (`steps`: the LR schedule is constant after warm-up, so the total
# it is given changes nothing; not safe with a decaying schedule, see `_safe_keys`), when
# it checkpoints and evaluates (evaluation draws from no training stream), and how it
# reports or threads (`cpu_threads` may change float rounding, never the recipe).
# Where a served teacher answers and how it is reached (teacher_url, its secret, timeout and
# retries) may change too: the checkpoint's weight fingerprint decides whether it is the same teacher.
# `run_dir` is the directory itself and never compared.
SAFE_RESUME_KEYS = frozenset({"steps", "checkpoint_every", "eval_every", "progress", "tensorboard", "cpu_threads",
                              "teacher_url", "teacher_secret_file", "teacher_timeout", "teacher_retries"})
# Config keys a resumed run may also change, though it is then not bit for bit the stored
# run's continuation: where it trains (`device`: a CPU run resumed on a GPU, or back). The
# checkpoint's weights and optimiser state load onto the new device; the steps after it are
# computed there (its kernels, its float rounding). The log says so. (`dtype` is refused:
# the weights, their fp32 master copies and the optimiser state are of the stored one.)
DEVICE_RESUME_KEYS = frozenset({"device"})
_IGNORED_KEYS = frozenset({"run_dir"})
_STEP_DIR = re.compile(r"^step_(\d+)$")


# --------------------------------------------------------------------------- checkpoints


def checkpoint_dirs(ckpt_root: str | os.PathLike) -> list[tuple[int, str]]:
    """(step, path) of every checkpoints/step_N directory, newest first."""
    ckpt_root = os.fspath(ckpt_root)
    try:
        names = os.listdir(ckpt_root)
    except OSError:
        return []
    found = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(ckpt_root, name)):
            found.append((int(m.group(1)), os.path.join(ckpt_root, name)))
    return sorted(found, reverse=True)


def newest_complete_checkpoint(ckpt_root: str | os.PathLike) -> tuple[tuple[int, str] | None, list[tuple[str, str]]]:
    """The newest checkpoint whose manifest verifies, and the newer ones skipped (with why)."""
    skipped = []
    for step, path in checkpoint_dirs(ckpt_root):
        if not _inside(path, ckpt_root):
            skipped.append((os.path.basename(path), f"a symbolic link to {os.path.realpath(path)!r}, outside the run "
                                                    "directory (never loaded nor deleted through)"))
            continue
        problems = verify_manifest(path)
        if not problems:
            m = read_manifest(path) or {}
            if m.get("step", step) != step:
                problems = [f"its manifest is of step {m.get('step')}"]
            else:
                return (step, path), skipped
        skipped.append((os.path.basename(path), "; ".join(problems)))
    return None, skipped


def _inside(path: str, root: str | os.PathLike) -> bool:
    """`path`, links resolved, lies under `root` (links resolved too)."""
    real, top = os.path.realpath(path), os.path.realpath(os.fspath(root))
    return os.path.commonpath([real, top]) == top


def clear_checkpoint_dir(path: str) -> None:
    """Remove a checkpoint directory, manifest first (so no partial state ever verifies);
    a symbolic link is removed itself, never what it points to."""
    if os.path.islink(path):
        os.remove(path)
        return
    try:
        os.remove(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        pass
    if os.path.isdir(path):
        shutil.rmtree(path)


@contextlib.contextmanager
def checkpoint_write(ckpt_root: str | os.PathLike, step: int):
    """The writes of checkpoint step_`step` (its files, manifest and the `latest` pointer):
    an OS failure among them becomes one `OutputError` saying which checkpoint is complete.
    A step_N whose manifest was not written is removed (best effort: on a read-only
    filesystem it stays, and never verifies); one whose manifest verifies is kept, and
    only `latest`, which --resume does not need, is then behind."""
    ckpt_root = os.fspath(ckpt_root)
    path = os.path.join(ckpt_root, f"step_{step}")
    try:
        yield path
    except Exception as e:
        code = e.code if isinstance(e, OutputError) else os_failure(e, path)
        if code is None:
            raise
        if not verify_manifest(path):
            raise output_error(code, os.path.join(ckpt_root, "latest"), ckpt_root,
                               f"checkpoint step_{step} is complete (the pointer is only a hint)",
                               "run with --resume") from e
        with contextlib.suppress(OSError):
            clear_checkpoint_dir(path)
        found, _ = newest_complete_checkpoint(ckpt_root)
        survived = (f"{os.path.basename(found[1])} is complete" if found
                    else "no earlier checkpoint is complete (--resume starts from step 0)")
        raise output_error(code, f"checkpoint step_{step}", path, survived, "run with --resume") from e


# --------------------------------------------------------------------------- metrics


def _is_train_line(rec: dict) -> bool:
    """A step's training record (the final evaluation line holds only step + eval/ keys)."""
    return any(k != "step" and not k.startswith("eval/") for k in rec)


def truncate_metrics(path: str, step: int, log: Callable[[str], None] = print) -> None:
    """Cut metrics.jsonl back to the records of steps 1..`step` (atomic rewrite).

    Drops lines after the checkpoint, a final-evaluation line of `step` itself (the run
    continues or re-evaluates), and lines that are not complete JSON (a partial last line
    left by a kill). Warns when the kept lines do not cover steps 1..`step`."""
    if not os.path.exists(path):
        if step > 0:
            log(f"warning: {path} is missing: the metrics of steps 1..{step} are lost (the weights are not)")
        return
    with open(path, "rb") as f:
        raw = f.read().decode("utf-8", errors="replace").split("\n")
    kept, bad = [], []
    raw = [x for x in raw if x.strip()]
    for i, line in enumerate(raw, 1):
        try:
            rec = json.loads(line)
            s = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            bad.append(i)
            continue
        if s < step or (s == step and _is_train_line(rec)):
            kept.append(line.rstrip("\r") + "\n")
    if bad:
        what = "a partial last line" if bad == [len(raw)] else f"unreadable line(s) {bad}"
        log(f"{path}: dropped {what}")
    have = [r["step"] for r in map(json.loads, kept) if _is_train_line(r)]
    if have != list(range(1, step + 1)):
        log(f"warning: {path} does not hold exactly one record per step 1..{step} (has {len(have)}); "
            "the checkpoint is used as it is")
    atomic_write_text(path, "".join(kept))


def last_train_record(path: str) -> dict | None:
    """The last step's training record in metrics.jsonl (None if none is readable): a run
    resumed from its final checkpoint trains no step, and reports this one."""
    last = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and _is_train_line(rec):
                    last = rec
    except OSError:
        return None
    return last


# --------------------------------------------------------------------------- configs


def _safe_keys(old: dict, new: dict) -> frozenset:
    keys = SAFE_RESUME_KEYS
    for cfg in (old, new):  # a decaying LR schedule is a function of the total steps
        for name in ("schedule", "lr_schedule"):
            if cfg.get(name, "constant") not in ("constant", None, ""):
                keys = keys - {"steps"}
    return keys


def config_differences(old: dict, new: dict, defaults: dict | None = None) -> list[tuple[str, Any, Any]]:
    """(key, stored, new) for every key whose value differs (run_dir is never compared).
    A key absent from one side counts as its value in `defaults` (a config stored before
    the key existed ran with the default)."""
    missing = object()
    defaults = defaults or {}
    out = []
    for k in list(old) + [k for k in new if k not in old]:
        if k in _IGNORED_KEYS:
            continue
        a, b = old.get(k, defaults.get(k, missing)), new.get(k, defaults.get(k, missing))
        if a != b:
            out.append((k, None if a is missing else a, None if b is missing else b))
    return out


def check_resume_config(stored: dict, new: dict, *, source: str, defaults: dict | None = None) -> list[str]:
    """Refuse (RunDirError) a resume whose config differs from `stored` outside the safe
    keys; returns the allowed changes as "key: old -> new" strings."""
    diffs = config_differences(stored, new, defaults)
    safe = _safe_keys(stored, new) | DEVICE_RESUME_KEYS
    bad = [d for d in diffs if d[0] not in safe]
    dtype = next((d for d in bad if d[0] == "dtype"), None)
    if dtype is not None:
        others = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in bad if k != "dtype")
        raise RunDirError(
            f"--resume with dtype={dtype[2]}, but the run in {source} trained in dtype={dtype[1]}: its weights, "
            "their fp32 master copies and the optimiser state are of that dtype, so a resumed run cannot change "
            f"it; resume with dtype={dtype[1]} (device= may change), or start a new run_dir"
            + (f" (also changed: {others})" if others else ""))
    if bad:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in bad)
        raise RunDirError(
            f"--resume with a different config than {source}: {listed}. A resumed run must be the exact "
            f"continuation of the stored one; only {', '.join(sorted(safe))} may change. Resume with the "
            "stored values, start a new run_dir, or pass --overwrite (instead of --resume) to discard the run")
    return [f"{k}: {a!r} -> {b!r}" + (" (the steps from here on run on the new device: not bit for bit the stored "
                                      "run's continuation)" if k in DEVICE_RESUME_KEYS else "")
            for k, a, b in diffs]


# --------------------------------------------------------------------------- models

_ROLE_NAMES = {"student": "student", "teacher": "teacher", "reference": "reference model (the starting student)"}


def model_fingerprints(model_dirs: dict[str, str | None], known: dict | None = None) -> dict[str, dict | None]:
    """{role: weights_fingerprint(dir)} of the models a run trains from (student, teacher,
    reference; None for a role the run does not use). `known`: the fingerprints a
    checkpoint recorded, whose per-file hashes are reused for unchanged files."""
    known = known if isinstance(known, dict) else {}
    return {role: (weights_fingerprint(d, known.get(role)) if d else None) for role, d in model_dirs.items()}


def check_model_fingerprints(stored: dict | None, model_dirs: dict[str, str | None], checkpoint: str) -> dict | None:
    """Refuse (RunDirError) to resume `checkpoint`, whose manifest recorded `stored`, with
    models whose weights differ: the run would continue with another teacher, student or
    reference than the one its first steps used. Returns the current fingerprints (None
    when the checkpoint predates fingerprints: nothing to compare)."""
    if not isinstance(stored, dict):
        return None
    current = model_fingerprints(model_dirs, stored)
    for role, now in current.items():
        then = stored.get(role)
        if not (isinstance(then, dict) and now) or then.get("sha256") == now["sha256"]:
            continue
        changed = sorted(set(then.get("files", {})) ^ set(now["files"])) or sorted(
            n for n in now["files"] if then["files"].get(n, {}).get("sha256") != now["files"][n]["sha256"])
        raise RunDirError(
            f"--resume: the {_ROLE_NAMES.get(role, role)}'s weights in {now['path']} are not the ones "
            f"{os.path.basename(checkpoint)} was trained with: fingerprint {then['sha256'][:16]} then, "
            f"{now['sha256'][:16]} now ({', '.join(changed[:3])} changed); resuming would mix two {role} models. "
            "Restore those weights, or start a new run_dir (--overwrite discards this run)")
    return current


def check_served_teacher(stored: dict | None, served: dict, checkpoint: str) -> None:
    """Refuse (RunDirError) to resume `checkpoint` with a served teacher (`teacher_url=`) whose
    weight fingerprint `served` is not the teacher's the checkpoint recorded (served or local:
    the same files give the same fingerprint)."""
    then = stored.get("teacher") if isinstance(stored, dict) else None
    if not isinstance(then, dict) or then.get("sha256") == served["sha256"]:
        return
    was = then.get("url") or then.get("path")
    raise RunDirError(
        f"--resume: the teacher served at {served['url']} has weights {served['sha256'][:16]} ({served.get('path')}), but "
        f"{os.path.basename(checkpoint)} was trained with teacher weights {then['sha256'][:16]} ({was}); resuming would "
        "mix two teachers. Serve that teacher again, or start a new run_dir (--overwrite discards this run)")


# --------------------------------------------------------------------------- places


def _has_content(path: str) -> bool:
    if not os.path.isdir(path) or os.path.islink(path):
        return os.path.lexists(path)
    return any(_has_content(os.path.join(path, n)) for n in os.listdir(path))


def _output_entries(run_dir: str) -> list[str]:
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    leftovers = tuple(o + "." for o in RUN_OUTPUTS)
    return sorted(n for n in names if n in RUN_OUTPUTS or (n.startswith(leftovers) and n.endswith(".tmp")))


def _refuse_linked_files(run_dir: str) -> None:
    """A run's own files are written and truncated where they are: one that is a symbolic
    link would carry those writes into another file (--overwrite removes such links)."""
    for name in _RUN_FILES:
        p = os.path.join(run_dir, name)
        if os.path.islink(p):
            raise UserError(f"{p} is a symbolic link (to {os.readlink(p)!r}); memopd writes a run directory's files "
                            "itself and never through a link: remove the link, or pass --overwrite to discard it")


def previous_outputs(run_dir: str) -> list[str]:
    """The outputs of an earlier run in `run_dir` (empty directories do not count)."""
    return [n for n in _output_entries(run_dir) if _has_content(os.path.join(run_dir, n))]


def sweep_temp_files(run_dir: str) -> list[str]:
    """Remove what interrupted atomic writes left in `run_dir` (a killed `eval_model/` or
    `final/` save leaves a whole model copy as `final.*.tmp`) and in its checkpoints/
    (`latest.*.tmp`); only under the run directory's lock. Returns the names removed."""
    removed = []
    for root in (run_dir, os.path.join(run_dir, "checkpoints")):
        try:
            names = sorted(os.listdir(root))
        except OSError:
            continue
        for n in names:
            if not (n.endswith(".tmp") and "." in n[:-4]) or not (root != run_dir or n in _output_entries(run_dir)):
                continue
            p = os.path.join(root, n)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(p)
            removed.append(os.path.relpath(p, run_dir))
    return removed


def clear_outputs(run_dir: str) -> list[str]:
    """Delete what an earlier run wrote (RUN_OUTPUTS and their temp files); returns the names."""
    removed = []
    for n in _output_entries(run_dir):
        p = os.path.join(run_dir, n)
        if os.path.isdir(p) and not os.path.islink(p):
            if n == "checkpoints":  # manifests first: a half-deleted checkpoint never verifies
                for _, d in checkpoint_dirs(p):
                    clear_checkpoint_dir(d)
            shutil.rmtree(p)
        else:
            os.remove(p)
        removed.append(n)
    return removed


# --------------------------------------------------------------------------- the lock


class RunDirLock(DirectoryLock):
    """Exclusive ownership of a run directory: flock on RUN_DIR/.lock for the run's life."""

    def __init__(self, run_dir: str, name: str = LOCK_FILE, what: str = "run directory"):
        super().__init__(run_dir, name, what)

    @property
    def run_dir(self) -> str:
        return self.directory


# --------------------------------------------------------------------------- ranks


def rank0_decides(fn: Callable[[], Any], rank: int, world_size: int) -> Any:
    """Run `fn` on rank 0 and give every rank its result; an exception on rank 0 is
    raised on every rank (UserError types kept), so no rank waits for a dead partner."""
    if world_size <= 1:
        return fn()
    import torch
    import torch.distributed as dist

    box: list[Any] = [None]
    err: BaseException | None = None
    if rank == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
            err = e
            box = [("err", type(e).__name__, str(e))]
    from .collectives import group_for

    # the group that serves CPU tensors: a gloo side group when the default one is NCCL
    dist.broadcast_object_list(box, src=0, group=group_for(torch.empty(0)))
    if err is not None:
        raise err
    if box[0][0] == "ok":
        return box[0][1]
    _, kind, msg = box[0]
    cls = {"RunDirError": RunDirError, "UserError": UserError}.get(kind, RuntimeError)
    raise cls(f"rank 0: {msg}")


# --------------------------------------------------------------------------- the run dir


class RunDir:
    """An opened run directory: locked, checked and holding this run's config.yaml.

    `RunDir.open(...)` (every rank; rank 0 does the work) checks that the run directory,
    its checkpoints/ and any `extra_dirs` (the SFT cache) are writable directories,
    takes the lock, then either refuses a used directory (no --resume / --overwrite),
    deletes its earlier outputs (--overwrite), or compares the stored config (config.yaml
    and the newest checkpoint's manifest) with this run's (--resume), then writes this
    run's config.yaml. `comparable` puts a config mapping (the stored ones, this run's,
    the defaults) in the shape they are compared in: a stored config of an older form
    and the same config in today's form compare equal (trainer/config.py
    `comparable_config`). `close()` releases the lock."""

    def __init__(self, run_dir: str, rank: int, world_size: int, log: Callable[[str], None]):
        self.run_dir = run_dir
        self.rank, self.world_size, self.log = rank, world_size, log
        self.lock = RunDirLock(run_dir)

    @property
    def config_path(self) -> str:
        return os.path.join(self.run_dir, "config.yaml")

    @classmethod
    def open(cls, config: dict, *, resume: bool = False, overwrite: bool = False, rank: int = 0,
             world_size: int = 1, extra_dirs: tuple[tuple[str, str], ...] = (), defaults: dict | None = None,
             command: str | None = None, log: Callable[[str], None] = print,
             comparable: Callable[[dict], dict] | None = None) -> "RunDir":
        if resume and overwrite:
            raise UserError("--resume and --overwrite exclude each other: continue the run, or discard it")
        rd = cls(config["run_dir"], rank, world_size, log)
        rd.comparable = comparable or (lambda d: d)
        rank0_decides(lambda: rd._open(config, resume, overwrite, extra_dirs, defaults, command), rank, world_size)
        return rd

    def _open(self, config: dict, resume: bool, overwrite: bool, extra_dirs, defaults, command) -> None:
        import yaml

        check_writable_dir(self.run_dir, "run directory")
        self.lock.acquire(command)
        try:
            if overwrite:
                removed = clear_outputs(self.run_dir)
                if removed:
                    self.log(f"--overwrite: deleted the previous run's {', '.join(removed)} in {self.run_dir}")
            _refuse_linked_files(self.run_dir)
            check_writable_dir(os.path.join(self.run_dir, "checkpoints"), "checkpoint directory")
            for path, what in extra_dirs:
                check_writable_dir(path, what)
            used = previous_outputs(self.run_dir)
            if used and not resume:
                raise RunDirError(
                    f"run directory {self.run_dir!r} holds a previous run ({', '.join(used)}): pass --resume to "
                    "continue it, --overwrite to delete it and start over, or choose another run_dir")
            if resume:
                self._check_resume_config(config, defaults, used)
                swept = sweep_temp_files(self.run_dir)
                if swept:
                    self.log(f"resume: removed the temp files of an interrupted write: {', '.join(swept)}")
            atomic_write_text(self.config_path, yaml.safe_dump(config, sort_keys=False))
        except BaseException:
            self.lock.release()
            raise

    def _check_resume_config(self, config: dict, defaults: dict | None, used: list[str]) -> None:
        """The new config against config.yaml and against the config recorded in the manifest
        of the checkpoint --resume loads (which also covers a lost or hand-edited config.yaml)."""
        import yaml

        stored = []
        if os.path.exists(self.config_path):
            try:
                with open(self.config_path) as f:
                    cfg = yaml.safe_load(f)
                if not isinstance(cfg, dict):
                    raise ValueError("not a mapping")
                stored.append((self.config_path, cfg))
            except (OSError, ValueError, yaml.YAMLError) as e:
                self.log(f"warning: {self.config_path} is unreadable ({e}); checking the checkpoints' config")
        elif used:
            self.log(f"warning: {self.config_path} is missing; checking the checkpoints' config")
        # the checkpoint --resume will load (the newest whose manifest verifies), not merely
        # the newest: a damaged newest one would vouch for an older one copied from elsewhere
        found, _ = newest_complete_checkpoint(os.path.join(self.run_dir, "checkpoints"))
        m = read_manifest(found[1]) if found else None
        if m is not None and isinstance(m.get("config"), dict):
            stored.append((os.path.join(found[1], MANIFEST), m["config"]))
        changed: list[str] = []
        config, defaults = self.comparable(config), self.comparable(defaults or {})
        for source, cfg in stored:
            changed = check_resume_config(self.comparable(cfg), config, source=source, defaults=defaults) or changed
        if changed:
            self.log(f"resume: allowed config changes: {'; '.join(changed)}")

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
