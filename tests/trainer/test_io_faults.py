"""Operating-system failures of a write (ENOSPC, EDQUOT, EROFS, EACCES, EIO) are one line
naming the path, the cause and what is still complete, exit code 74, and leave no partial
or temp file behind; afterwards `--resume` continues from the last complete checkpoint.

Where the machine allows it (root, tmpfs mounts), a real small tmpfs is filled during a
run and a run directory is remounted read-only during a run; everywhere, each write of a
checkpoint (and of SFT, audit --json, plot, the atomic writes) gets an injected OSError,
and torch.save's errno-less RuntimeError of a full disk is injected too.
"""
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

# the tiny models and trainers of the run-directory tests (`parts`: one `prepare` per module)
from test_run_integrity import _cfg, _trainer, parts  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXIT_IO = 74
CAUSES = {errno.ENOSPC: "no space left", errno.EDQUOT: "quota exceeded", errno.EROFS: "read-only filesystem",
          errno.EACCES: "permission denied", errno.EIO: "I/O error"}
# what torch.save raised when a tmpfs filled (no errno in it; test_real_full_tmpfs_... sees the real one)
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
TORCH_WRITE_FAILED = ("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                      "data/0: file write failed")


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".tmp"))


def _one_line_74(err, *needles):
    """The error is an exit-74 error of one line holding every needle."""
    assert getattr(err, "exit_code", None) == EXIT_IO, f"{type(err).__name__}: {err}"
    text = str(err)
    assert "\n" not in text
    for n in needles:
        assert n in text, (n, text)
    return text


# ----------------------------------------------------------------- recognising the cause


@pytest.mark.parametrize("code", sorted(CAUSES))
def test_os_failure_names_each_cause(code):
    from memopd.errors import os_failure, output_error

    assert os_failure(OSError(code, os.strerror(code), "/x/f")) == code
    assert os_failure(ValueError("no")) is None
    wrapped = RuntimeError("library wrapper")
    wrapped.__cause__ = OSError(code, os.strerror(code))
    assert os_failure(wrapped) == code
    msg = str(output_error(code, "checkpoint step_2", "/x/step_2", "step_1 is complete", "run with --resume"))
    assert msg.startswith("checkpoint step_2 not written: ") and CAUSES[code] in msg.split(";")[0]
    assert "(/x/step_2)" in msg
    assert msg.endswith("and run with --resume") and "step_1 is complete" in msg


def test_torch_save_full_disk_runtime_error_is_enospc(tmp_path, monkeypatch):
    from memopd.errors import os_failure

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    assert os_failure(RuntimeError(TORCH_FULL_DISK), tmp_path / "backend.pt") == errno.ENOSPC
    monkeypatch.setattr(os, "statvfs", lambda p: type("Roomy", (), {"f_bavail": 1 << 30, "f_frsize": 4096})())
    assert os_failure(RuntimeError(TORCH_WRITE_FAILED), tmp_path / "backend.pt") == errno.EIO
    assert os_failure(RuntimeError(TORCH_FULL_DISK), tmp_path / "backend.pt") is None  # room left: not I/O
    assert os_failure(RuntimeError("shape mismatch"), tmp_path) is None


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real tmpfs of 48 MiB (skipped where mounting is not allowed)."""
    d = tmp_path / "fs"
    if not _mount_tmpfs(d, "48m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill(fs: Path) -> Path:
    """Fill the filesystem to its last byte; returns the filler file."""
    filler = fs / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    for n in (4096, 1):
        try:
            with open(filler, "ab") as f:
                while True:
                    f.write(b"\0" * n)
                    f.flush()
        except OSError:
            pass
    return filler


def test_real_full_tmpfs_torch_save_is_recognised(small_tmpfs):
    from memopd.errors import os_failure

    filler = _fill(small_tmpfs)
    target = small_tmpfs / "t.pt"
    with pytest.raises(Exception) as e:
        torch.save(torch.zeros(1 << 20), target)
    assert os_failure(e.value, target) == errno.ENOSPC, repr(e.value)
    filler.unlink()


# ----------------------------------------------------------------- checkpoint writes


# the writes of one checkpoint, in order: (kind, index among that kind)
SAVE_POINTS = [("replace", 1), ("torch.save", 1), ("replace", 2), ("replace", 3), ("torch.save", 2),
               ("replace", 4), ("replace", 5), ("replace", 6)]


@pytest.fixture(scope="module")
def trainer(parts, sft_dirs, tmp_path_factory):  # noqa: F811 - the imported fixture
    run = tmp_path_factory.mktemp("ck") / "run"
    os.makedirs(run / "checkpoints")
    return _trainer(parts, _cfg(sft_dirs, run, steps=2, checkpoint_every=1))


@pytest.mark.parametrize("code", sorted(CAUSES))
@pytest.mark.parametrize("point", range(len(SAVE_POINTS)))
def test_each_checkpoint_write_failure_is_one_line_74_and_leaves_nothing(trainer, monkeypatch, code, point):
    """step_1 is saved; saving step_2 fails at one write (os.replace of a temp file:
    client states, backend.pt, manifest, latest; or inside torch.save, half a file
    written). The error names the checkpoint, the cause and step_1; no temp file and no
    partial step_2 remain; the last write (`latest`) failing leaves step_2 complete."""
    from memopd.trainer.rundir import newest_complete_checkpoint

    root = Path(trainer.ckpt_root)
    for d in root.glob("step_*"):
        shutil.rmtree(d)
    trainer.save(1)
    kind, nth = SAVE_POINTS[point]
    seen = {"replace": 0, "torch.save": 0}
    real_replace, real_save = os.replace, torch.save

    def replace(src, dst, *a, **kw):
        seen["replace"] += 1
        if kind == "replace" and seen["replace"] == nth:
            raise OSError(code, os.strerror(code), str(dst))
        return real_replace(src, dst, *a, **kw)

    def save(obj, f, *a, **kw):
        seen["torch.save"] += 1
        if kind == "torch.save" and seen["torch.save"] == nth:
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04 half a zip")
            if code == errno.ENOSPC:  # what torch really raises: no errno, only the zip writer's text
                raise RuntimeError(TORCH_FULL_DISK)
            raise OSError(code, os.strerror(code), str(f))
        return real_save(obj, f, *a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(os, "replace", replace)
        mp.setattr(torch, "save", save)
        if code == errno.ENOSPC:
            mp.setattr(os, "statvfs", lambda p: type("Full", (), {"f_bavail": 0, "f_frsize": 4096})())
        with pytest.raises(Exception) as e:
            trainer.save(2)
    last = point == len(SAVE_POINTS) - 1
    if last:
        _one_line_74(e.value, "latest not written", CAUSES[code], "checkpoint step_2 is complete", "--resume")
    else:
        _one_line_74(e.value, "checkpoint step_2 not written", CAUSES[code], "step_1 is complete",
                     "and run with --resume")
        assert not (root / "step_2").exists()
    assert _leftovers(root) == []
    found, _ = newest_complete_checkpoint(root)
    assert found is not None and os.path.basename(found[1]) == ("step_2" if last else "step_1")


def _train_args(sft_dirs, run, steps=2):
    return [f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}", f"run_dir={run}", f"steps={steps}",
            "checkpoint_every=1", "tasks_per_step=2", "group_size=2", "train_k=[1]", "eval_k=[1]", "eval_tasks=1",
            "ppo_epochs=1", "minibatches=1", "progress=false", f"cache_dir={run}/../cache"]


def _after_first_checkpoint(monkeypatch, action):
    """Run `action()` right after checkpoint step_1 is complete."""
    from memopd.trainer.loop import Trainer

    real = Trainer.save

    def save(self, step):
        path = real(self, step)
        if step == 1:
            action()
        return path

    monkeypatch.setattr(Trainer, "save", save)


def test_disk_full_mid_run_is_74_then_resume_continues(sft_dirs, small_tmpfs, monkeypatch, capsys):
    from memopd.cli import main

    run = small_tmpfs / "run"
    box = {}
    with monkeypatch.context() as mp:
        _after_first_checkpoint(mp, lambda: box.setdefault("filler", _fill(small_tmpfs)))
        assert main(["train", *_train_args(sft_dirs, run)]) == EXIT_IO
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not written: no space left on the device" in err[0], err
    if "checkpoint step_2" in err[0]:
        assert "step_1 is complete" in err[0] and "free space and run with --resume" in err[0]
    assert _leftovers(run) == []
    box["filler"].unlink()
    assert main(["train", "--resume", *_train_args(sft_dirs, run)]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "rollout/reward_mean" in m] == [1, 2]


def test_read_only_remount_mid_run_is_74_then_resume_continues(sft_dirs, tmp_path, monkeypatch, capsys):
    """checkpoints/ is its own tmpfs, remounted read-only after step_1 (the run directory
    itself holds its open lock file, which keeps a remount of its filesystem busy)."""
    from memopd.cli import main

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    if not _mount_tmpfs(ckpts, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")

    def remount(mode):
        r = subprocess.run(["mount", "-o", f"remount,{mode}", str(ckpts)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs {mode}: {r.stderr.strip()}")

    try:
        with monkeypatch.context() as mp:
            _after_first_checkpoint(mp, lambda: remount("ro"))
            code = main(["train", *_train_args(sft_dirs, run)])
        remount("rw")
        err = capsys.readouterr().err.strip().splitlines()
        assert code == EXIT_IO and len(err) == 1, (code, err)
        assert "checkpoint step_2 not written: read-only filesystem" in err[0], err
        assert "step_1 is complete" in err[0] and "make the filesystem writable and run with --resume" in err[0]
        assert _leftovers(run) == []
        assert main(["train", "--resume", *_train_args(sft_dirs, run)]) == 0
        assert "resumed from" in capsys.readouterr().out
    finally:
        subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)


# ----------------------------------------------------------------- other writes


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_atomic_write_keeps_the_previous_content(tmp_path, monkeypatch, code):
    from memopd.files import atomic_write_text

    p = tmp_path / "report.json"
    p.write_text("old\n")
    real = os.fsync

    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(Exception) as e:
        atomic_write_text(p, "new\n")
    monkeypatch.setattr(os, "fsync", real)
    _one_line_74(e.value, f"{p} not written", CAUSES[code], "its previous content is unchanged")
    assert p.read_text() == "old\n" and _leftovers(tmp_path) == []


def test_sft_save_failure_is_74_and_keeps_the_previous_model(tmp_path, monkeypatch):
    from memopd import files
    from memopd.env import sft

    tiny = {"student": sft.SFTConfig(steps=1, ks=(1,), calls_per_k=2)}
    out = tmp_path / "cache"
    sft.run_sft(out, roles=("student",), sft_configs=tiny, progress=False, log=lambda *_: None)
    before = {p.name: p.read_bytes() for p in (out / "student").iterdir()}

    def full(root, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(root, "memopd_manifest.json"))

    monkeypatch.setattr(files, "write_manifest", full)
    with pytest.raises(Exception) as e:
        sft.run_sft(out, roles=("student",), sft_configs=tiny, force=True, progress=False, log=lambda *_: None)
    _one_line_74(e.value, f"SFT checkpoint {out / 'student'} not written", "no space left",
                 "its previous content is unchanged")
    assert {p.name: p.read_bytes() for p in (out / "student").iterdir()} == before
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []


def test_audit_json_on_a_read_only_place_is_74(tmp_path, monkeypatch, capsys):
    import tempfile

    from memopd.cli import main

    def ro(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), k.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", ro)
    target = tmp_path / "audit.json"
    code = main(["audit", "--json", str(target), "--policy", "summary", "--num-trajectories", "2",
                 "--group-size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_IO and len(err) == 1, (code, err)
    assert f"{target} not written: read-only filesystem" in err[0]
    assert not target.exists()


def test_eval_report_json_on_a_full_disk_is_74_and_keeps_the_previous_report(tmp_path, monkeypatch):
    """`memopd eval --json` (and `memopd sft --json`, the same writer) replaces its file
    whole or not at all: a write that fails half-way leaves the previous report as it was."""
    from memopd.env.qa.evaluate import write_json

    target = tmp_path / "reports" / "eval.json"
    write_json({"results": {"Q2": {"em_mean": 0.25}}}, target)
    before = target.read_bytes()
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(Exception) as e:
        write_json({"results": {"Q2": {"em_mean": 0.75}}}, target)
    monkeypatch.setattr(os, "fsync", real_fsync)
    _one_line_74(e.value, str(target), "no space left", "its previous content is unchanged")
    assert target.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_plot_on_a_full_disk_is_74_and_leaves_no_partial_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from memopd.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": s / 4}) + "\n"
                                               for s in (1, 2, 3)))

    def full(self, fname, *a, **k):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fname))

    monkeypatch.setattr(Figure, "savefig", full)
    assert main(["plot", str(run)]) == EXIT_IO
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"plot {run / 'curves.png'} not written: no space left" in err[0], err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_an_unwrapped_os_failure_is_still_74_and_one_line(monkeypatch, capsys):
    """A write no guard wraps (anywhere) is classified by the command line itself; an
    unreadable input (EACCES on open) stays bad input."""
    from memopd import cli

    for exc, want in ((OSError(errno.EIO, os.strerror(errno.EIO), "/data/out.bin"), EXIT_IO),
                      (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/data/out.bin"), EXIT_IO),
                      (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/in.jsonl"), 2)):
        def boom(argv, exc=exc):
            raise exc

        monkeypatch.setattr(cli, "_dispatch", boom)
        assert cli.main(["pack"]) == want
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("memopd pack: error:") and "/data/" in err[0], err
