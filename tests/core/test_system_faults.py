"""Failures of the machine, of a peer or of a damaged input are one line and a documented
exit code, never "internal error" (70): safetensors' own write error on a full disk (74),
a truncated model.safetensors (2), trajectory files with ids beyond int64, 1e300,
5,000-digit integers or 100k-level nesting, or a device such as /dev/zero (2, naming the
file and line), a metrics.jsonl line that is not a record (2), a peer rank of a gloo
run that dies (69, naming its address) and memory the allocator refuses (71)."""
import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memopd.cli import main
from memopd.errors import EXIT_OUT_OF_MEMORY, EXIT_PEER_FAILED, os_failure

REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    capsys.readouterr()
    rc = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return rc, err[0]


def test_safetensors_os_error_text_is_recognised():
    from safetensors import SafetensorError

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert os_failure(full) == errno.ENOSPC
    assert os_failure(SafetensorError("Error while serializing: IoError(Os { code: 30, kind: ReadOnlyFilesystem })")) \
        == errno.EROFS
    assert os_failure(SafetensorError("Error while deserializing header: incomplete metadata")) is None


def test_real_full_tmpfs_safetensors_save_is_74_naming_the_model(tmp_path):
    """save_pretrained of eval_model/ or final/ on a full disk: exit 74 naming the path, no temp left."""
    from memopd.errors import OutputError
    from memopd.files import atomic_directory
    from memopd.models import tiny_causal_lm

    fs = tmp_path / "fs"
    fs.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount") or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(fs)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        model = tiny_causal_lm("qwen2", vocab_size=512)
        with pytest.raises(OutputError) as e:
            with atomic_directory(fs / "final") as tmp:
                model.save_pretrained(tmp)
        assert e.value.exit_code == 74 and "no space left" in str(e.value) and str(fs / "final") in str(e.value)
        assert os.listdir(fs) == []
    finally:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def test_truncated_safetensors_is_bad_input(tmp_path, capsys):
    from memopd.models import tiny_causal_lm

    d = tmp_path / "model"
    tiny_causal_lm("qwen2", vocab_size=64).save_pretrained(d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    rc, line = _run(capsys, "audit", "--model", str(d))
    assert rc == 2 and str(d) in line and "truncated" in line, line


def _trajectory_file(path, body_line=None, vocab_size=None):
    from memopd.memory import random_trajectories
    from memopd.records import save_trajectories

    trajs = random_trajectories("full", 2, vocab_size=256, seed=0, group_size=1, calls=(2, 3), obs_len=(2, 4),
                                action_len=(2, 4))
    save_trajectories(path, trajs, vocab_size=vocab_size)
    lines = path.read_text().split("\n")[:-1]
    if body_line is not None:
        body = [body_line(lines[1])] + lines[2:-1]
        h = hashlib.sha256()
        for x in body:
            h.update((x + "\n").encode())
        foot = json.dumps({"footer": True, "count": len(body), "sha256": h.hexdigest()})
        path.write_text("\n".join([lines[0], *body, foot]) + "\n")
    return path


def _first_id(value):
    def edit(line):
        i = line.index('"prefix_ids":[') + len('"prefix_ids":[')
        j = line.index(",", i)
        return line[:i] + value + line[j:]
    return edit


@pytest.mark.parametrize("name, edit, said", [
    ("int beyond int64", _first_id(str(2**70)), "prefix_ids[0] = 1180591620717411303424 is not a token id (beyond int64)"),
    ("1e300", _first_id("1e300"), "prefix_ids[0] = 1e+300 is not an integer token id"),
    ("5000 digits", _first_id("9" * 5000), "not valid JSON (Exceeds the limit (4300 digits)"),
    ("deep nesting", lambda _line: "[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
])
def test_pack_and_audit_refuse_hostile_trajectory_values(tmp_path, capsys, name, edit, said):
    f = _trajectory_file(tmp_path / "t.jsonl", edit)
    for cmd in (["pack", "--trajectories", str(f)], ["audit", "--trajectories", str(f)]):
        rc, line = _run(capsys, *cmd)
        assert rc == 2 and f"{f}:2: trajectory 0" in line and said in line, line


def test_a_device_is_not_a_trajectories_file():
    """In a child with a 4 GiB address-space limit: reading /dev/zero (what main did) would
    otherwise take the machine's memory before failing."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    r = subprocess.run([sys.executable, "-m", "memopd.cli", "pack", "--trajectories", "/dev/zero"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), preexec_fn=limit,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "memopd pack: error: /dev/zero: a device, not a trajectories file"


@pytest.mark.parametrize("bad", ["[1, 2, 3]", '{"step": [1]}', '{"loss": 1.0}', "[" * 50_000])
def test_plot_refuses_a_metrics_line_that_is_not_a_record(tmp_path, capsys, bad):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/pg_loss": 0.5}\n' + bad + "\n")
    rc, line = _run(capsys, "plot", str(tmp_path))
    assert rc == 2 and f"{tmp_path / 'metrics.jsonl'}:2: not" in line, line


def test_memory_the_allocator_refuses_is_71(monkeypatch, capsys):
    import memopd.cli as cli

    monkeypatch.setattr(cli, "_dispatch", lambda argv: torch.empty(1 << 50, dtype=torch.uint8))  # 1 PiB
    rc, line = _run(capsys, "train")
    assert rc == EXIT_OUT_OF_MEMORY == 71 and "out of memory" in line and "--resume" in line, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_peer_rank_is_69_naming_its_address(tmp_path):
    """Two real gloo processes on loopback; rank 1 dies inside the collective loop."""
    script = tmp_path / "peer.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import torch, torch.distributed as dist
        import memopd.cli as cli
        import memopd.trainer.collectives  # as `memopd train`: the CLI then ends the process group itself
        rank = int(sys.argv[1])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=str(rank), WORLD_SIZE="2")

        def work(argv):
            dist.init_process_group("gloo")
            t = torch.ones(4)
            for i in range(2000):
                dist.all_reduce(t)
                if rank == 1 and i == 3:
                    os._exit(9)
                time.sleep(0.01)
            return 0

        cli._dispatch = work
        sys.exit(cli.main(["train"]))
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        _, err0 = procs[0].communicate(timeout=240)
        procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    last = err0.strip().splitlines()[-1]
    assert procs[0].returncode == EXIT_PEER_FAILED == 69, err0[-3000:]
    assert last.startswith("memopd train: error: a peer process of this distributed run at 127.0.0.1:"), last
    assert "Traceback" not in err0
