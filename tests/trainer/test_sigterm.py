"""SIGTERM (what SLURM, Kubernetes and systemd send to stop a job) is handled as Ctrl-C:
one line, exit code 143, what was complete kept (checkpoints verify, no temp files, the
lock released) and the run resumable; before, `memopd train` died at once without a word.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memopd.errors import EXIT_TERMINATED
from memopd.files import DirectoryLock

REPO = Path(__file__).resolve().parents[2]


def test_main_turns_sigterm_into_exit_143_for_every_command(monkeypatch, capsys):
    """In-process: whatever command runs, a SIGTERM during it ends main() with 143 and one
    line, and the previous SIGTERM handler is back afterwards."""
    import memopd.cli as cli

    def slow(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "_dispatch", slow)
    assert cli.main(["eval"]) == EXIT_TERMINATED == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["memopd eval: terminated (SIGTERM): stopped; what was complete is kept (a run continues with --resume)"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_stops_train_with_143_and_keeps_the_run_resumable(sft_dirs, tmp_path):
    from memopd.trainer.rundir import newest_complete_checkpoint

    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "memopd.cli", "train", f"run_dir={run}", f"student={sft_dirs[0]}",
           f"teacher={sft_dirs[1]}", "steps=200", "checkpoint_every=1", "tasks_per_step=2", "group_size=2",
           "train_k=[1]", "eval_k=[1]", "eval_tasks=2", "ppo_epochs=1", "minibatches=2", "progress=false"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    try:
        while True:  # past step 1's checkpoint, somewhere inside a later step
            if newest_complete_checkpoint(run / "checkpoints")[0] is not None:
                break
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == ("memopd train: terminated (SIGTERM): stopped; what was complete is kept "
                                            "(a run continues with --resume)")
    found, skipped = newest_complete_checkpoint(run / "checkpoints")
    assert found is not None
    assert not [n for n in os.listdir(run) if n.endswith(".tmp")]
    lock = DirectoryLock(str(run))
    lock.acquire()  # released with the process
    lock.release()
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 0 and steps[1:] == list(range(1, len(steps)))  # whole lines only


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_compare_children_get_sigterm_and_exit_143(sig, tmp_path):
    """`memopd compare` stops its children with SIGTERM (trainer/arms.py): a child now
    reports it as 143 with its own line instead of dying silently."""
    code = ("import os, signal, sys, time\n"
            "from memopd.cli import main\n"
            "import memopd.cli as cli\n"
            "cli._dispatch = lambda argv: (time.sleep(60), 0)[1]\n"
            "sys.exit(main(['train']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    time.sleep(3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "memopd train: terminated (SIGTERM)" in err
