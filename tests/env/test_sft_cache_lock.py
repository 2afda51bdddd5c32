"""Two `memopd sft` builders of one cache directory: one builds, the other waits (saying
whose lock it waits for) and then reuses that build; a reader polling the cache never
sees a half-written model; a builder killed mid-build frees the lock.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _builder(out: Path, log: Path) -> subprocess.Popen:
    # enough steps that the first build is still running when the second starts
    cmd = [sys.executable, "-m", "memopd.cli", "sft", "--out", str(out), "--roles", "student", "--ks", "1",
           "--calls-per-k", "4", "--student-steps", "150", "--copy-warmup-steps", "0", "--threads", "1",
           "--no-progress"]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_second_builder_waits_then_reuses_and_readers_never_see_a_part(tmp_path):
    from memopd.files import verify_manifest

    out = tmp_path / "cache"
    a = _builder(out, tmp_path / "a.log")
    # the second starts once the first holds the lock (it has begun building)
    t0 = time.time()
    while "expert data" not in (tmp_path / "a.log").read_text():
        assert a.poll() is None, (tmp_path / "a.log").read_text()
        assert time.time() - t0 < 300
        time.sleep(0.05)
    b = _builder(out, tmp_path / "b.log")
    seen_partial = []
    while a.poll() is None or b.poll() is None:
        d = out / "student"
        if d.exists():
            problems = verify_manifest(d)
            if problems and d.exists():  # not the instant of the rename
                seen_partial.append(problems)
        time.sleep(0.01)
    la, lb = (tmp_path / "a.log").read_text(), (tmp_path / "b.log").read_text()
    assert a.returncode == 0 and b.returncode == 0, la[-2000:] + lb[-2000:]
    assert seen_partial == []
    trained = [name for name, text in (("a", la), ("b", lb)) if "student: saved to" in text]
    assert trained == ["a"], (la[-1500:], lb[-1500:])
    assert "SFT cache" in lb and "is in use by pid" in lb and "waiting for it" in lb, lb
    assert "student: checkpoint exists" in lb and "skipping" in lb, lb
    assert verify_manifest(out / "student") == []


def test_a_killed_builder_frees_the_lock(tmp_path):
    from memopd.env.qa.sft import SFT_LOCK_FILE
    from memopd.errors import RunDirError
    from memopd.trainer.rundir import RunDirLock

    out = tmp_path / "cache"
    a = _builder(out, tmp_path / "a.log")
    t0 = time.time()
    while "expert data" not in (tmp_path / "a.log").read_text():
        assert a.poll() is None and time.time() - t0 < 300
        time.sleep(0.05)
    lock = RunDirLock(str(out), name=SFT_LOCK_FILE, what="SFT cache")
    try:
        lock.acquire()
    except RunDirError as e:  # held: the holder is named
        assert f"pid {a.pid}" in str(e), e
    else:
        raise AssertionError("the lock was free while a builder ran")
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=30)
    lock.acquire()  # freed by the kernel with its holder
    assert json.loads((out / SFT_LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / "student").exists()  # the half-built model is only in a temp sibling


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(c) for c in f.read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_ctrl_c_to_the_parent_stops_both_roles_at_once(tmp_path):
    """SIGINT to the parent alone (as `kill -INT`, or a supervisor's stop) while two roles
    train in parallel: the parent exits 130 within seconds instead of waiting for the other
    role's whole training, its workers are gone, and no half-written model is left."""
    if not os.path.exists("/proc/self/task"):
        import pytest

        pytest.skip("needs /proc to find the workers")
    out = tmp_path / "cache"
    log = tmp_path / "sft.log"
    # far more steps than the test waits for: only an interrupt ends this build early
    cmd = [sys.executable, "-m", "memopd.cli", "sft", "--out", str(out), "--ks", "1", "--calls-per-k", "4",
           "--teacher-steps", "100000", "--student-steps", "100000", "--copy-warmup-steps", "0", "--threads", "1",
           "--jobs", "2", "--no-progress"]
    with open(log, "w") as f:
        # SIGINT at its default in the child: a suite started as a background job inherits
        # it ignored (so does Python then), and the signal this test sends would never arrive
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    workers: set[int] = set()
    while len(workers) < 2 or "expert data" not in log.read_text():
        assert p.poll() is None, log.read_text()[-2000:]
        assert time.time() - t0 < 300, log.read_text()[-2000:]
        # the spawn context's children: the two role workers (and a resource tracker)
        workers = {c for c in _children(p.pid) if "_train_role" in open(f"/proc/{c}/cmdline").read()
                   or "spawn_main" in open(f"/proc/{c}/cmdline").read()}
        time.sleep(0.1)
    time.sleep(3)  # both roles are training now
    all_children = _children(p.pid)
    os.kill(p.pid, signal.SIGINT)
    t_int = time.time()
    try:
        code = p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    waited = time.time() - t_int
    text = log.read_text()
    assert code == 130, text[-2000:]
    assert waited < 30, f"the parent took {waited:.0f} s to stop after Ctrl-C"
    deadline = time.time() + 15
    while any(_alive(c) for c in all_children) and time.time() < deadline:
        time.sleep(0.2)
    left = [c for c in all_children if _alive(c)]
    for c in left:
        os.kill(c, signal.SIGKILL)
    assert left == [], f"workers still running after the parent stopped: {left}"
    for role in ("teacher", "student"):
        assert not (out / role).exists(), f"a {role} model appeared from an interrupted build"
