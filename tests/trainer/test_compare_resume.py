"""`memopd compare` survives its own death: children die with it, a child's failure
keeps its own cause and exit code, and `compare --resume` reuses the finished (arm, seed)
runs and resumes the unfinished ones.

The runs are the tiny SFT'd agents of tests/conftest.py (`sft_dirs`), a few steps each.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tiny(sft_dirs, steps):
    return [f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}", f"steps={steps}", "checkpoint_every=1",
            "train_k=[1]", "eval_k=[1]", "eval_tasks=1", "tasks_per_step=2", "group_size=2", "ppo_epochs=1",
            "minibatches=1", "cpu_threads=1"]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(cond, timeout, what, proc=None):
    t0 = time.time()
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the compare process ended first (rc={proc.returncode})")
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_kill_9_of_compare_kills_its_children_and_resume_reuses_finished_runs(sft_dirs, tmp_path):
    from memopd.trainer.rundir import newest_complete_checkpoint

    out = tmp_path / "cmp"
    args = ["--arms", "ppo", "--seeds", "0", "1", "--jobs", "1", "--out", str(out), *_tiny(sft_dirs, 5)]
    cmd = [sys.executable, "-m", "memopd.cli", "compare", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "compare1.log", "w") as log:
        parent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    seed0, seed1 = out / "ppo" / "seed0", out / "ppo" / "seed1"
    try:
        # seed 0 finished, seed 1 past its first checkpoint: kill the parent, nothing else
        _wait_for(lambda: (seed0 / "report.json").exists() and newest_complete_checkpoint(seed1 / "checkpoints")[0],
                  600, "seed 1's first checkpoint", parent)
        child = json.loads((seed1 / ".lock").read_text())["pid"]
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        _wait_for(lambda: not _alive(child), 15, f"the child {child} to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not (seed1 / "report.json").exists()  # it was unfinished
    done0 = (seed0 / "report.json").stat().st_mtime_ns, (seed0 / "train.log").read_text()

    res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ppo seed 0: finished earlier, reused" in res.stdout
    assert ((seed0 / "report.json").stat().st_mtime_ns, (seed0 / "train.log").read_text()) == done0
    log1 = (seed1 / "train.log").read_text()
    assert "resumed from" in log1 and (seed1 / "report.json").exists(), log1[-2000:]
    lines = [json.loads(x) for x in (seed1 / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "rollout/reward_mean" in m] == list(range(1, 6))  # each step once
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [(r["arm"], r["seed"]) for r in rows] == [("sft student", None), ("ppo", 0), ("ppo", 1)]


def test_a_child_conflict_keeps_exit_3_and_its_message(sft_dirs, tmp_path, capsys):
    from memopd.cli import main
    from memopd.trainer.rundir import RunDirLock

    out = tmp_path / "cmp"
    held = out / "ppo" / "seed0"
    held.mkdir(parents=True)
    lock = RunDirLock(str(held))
    lock.acquire("a test holding the run directory")
    try:
        code = main(["compare", "--arms", "ppo", "--seeds", "0", "--jobs", "1", "--out", str(out),
                     *_tiny(sft_dirs, 1)])
    finally:
        lock.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    assert len(err) == 1 and "ppo seed 0: error: run directory" in err[0] and "is in use by" in err[0], err
    assert "train.log" in err[0]


@pytest.mark.parametrize("rc", [2, 74, 70])
def test_a_child_failure_is_its_own_line_and_exit_code(tmp_path, rc):
    """The child's `memopd train: error:` line and exit code, not a wrapper's."""
    from memopd.trainer.arms import child_error

    (tmp_path / "train.log").write_text("[memopd train] loading\nmemopd train: error: student='x': no config.json\n")
    e = child_error("ppo", 3, str(tmp_path), rc)
    assert e.exit_code == rc
    assert str(e).startswith("ppo seed 3: error: student='x': no config.json") and "train.log" in str(e)
    killed = child_error("ppo", 3, str(tmp_path), -9)
    assert killed.exit_code == 137 and "killed by signal 9" in str(killed)


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    from memopd.trainer.compare import compare_main

    with pytest.raises(SystemExit) as e:
        compare_main(["--resume", "--overwrite", "--out", str(tmp_path)])
    assert e.value.code == 2
