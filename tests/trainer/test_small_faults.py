"""The smaller silent failures: a YAML alias bomb in a config (hung, then printed the
expanded value), trajectories saved on a failing disk (named no path, left
`*.tmp<pid>`), temp files of interrupted writes that survived every --resume (a whole
model copy each), and `memopd audit` raising --max-tokens without a word."""
import errno
import os
import time

import pytest
import yaml

from memopd.errors import OutputError
from memopd.trainer.config import ConfigError, TrainConfig
from memopd.trainer.rundir import RunDir


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["policy_kwargs:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"  {name}: &{name} [{','.join(['*' + prev] * 9)}]")
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\n")
    t0 = time.process_time()
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(str(f), [])
    assert time.process_time() - t0 < 5
    msg = str(e.value)
    assert "YAML aliases (*a) are not accepted" in msg and len(msg) < 400 and "lol" not in msg
    with pytest.raises(ConfigError):  # an override is a YAML value too: kept as text, then type-checked
        TrainConfig.load(None, ["policy_kwargs={a: &a [1], b: [*a, *a]}"])


def test_save_trajectories_failure_is_74_naming_the_path_and_leaves_no_temp(tmp_path, monkeypatch):
    from memopd.memory import random_trajectories
    from memopd.records import load_trajectories, save_trajectories

    trajs = random_trajectories("full", 2, vocab_size=64, seed=0, group_size=1, calls=(2, 3), obs_len=(2, 4),
                                action_len=(2, 4))
    out = tmp_path / "played.jsonl"
    save_trajectories(out, trajs[:1])
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError) as e:
        save_trajectories(out, trajs)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert e.value.exit_code == 74 and str(out) in str(e.value) and "no space left" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["played.jsonl"]  # no temp file beside it
    assert len(load_trajectories(out)) == 1  # the previous content is intact


def test_resume_sweeps_the_temp_files_of_interrupted_writes(tmp_path):
    run = tmp_path / "run"
    cfg = {"run_dir": str(run), "arm": "memopd", "steps": 4}
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "final.k3j2.tmp").mkdir()
    (run / "final.k3j2.tmp" / "model.safetensors").write_bytes(b"x" * 1000)
    (run / "eval_model.ab12.old.tmp").mkdir()
    (run / "metrics.jsonl.x9.tmp").write_text("{}")
    (run / "checkpoints" / "latest.q1.tmp").write_text("step_2")
    (run / "notes.tmp").write_text("the user's own file")  # not memopd's: kept
    logs = []
    RunDir.open(cfg, resume=True, log=logs.append).close()
    assert sorted(os.listdir(run)) == [".lock", "checkpoints", "config.yaml", "notes.tmp"]
    assert os.listdir(run / "checkpoints") == []
    assert any("removed the temp files" in x and "final.k3j2.tmp" in x for x in logs), logs


def test_audit_says_when_it_raises_max_tokens(tmp_path, capsys):
    from memopd.cli import main
    from memopd.memory import random_trajectories
    from memopd.records import save_trajectories

    trajs = random_trajectories("full", 2, vocab_size=256, seed=0, group_size=1, calls=(2, 3), obs_len=(2, 4),
                                action_len=(2, 4))
    f = tmp_path / "t.jsonl"
    save_trajectories(f, trajs, vocab_size=256)
    longest = max(t.flattened_tokens for t in trajs)
    assert main(["audit", "--trajectories", str(f), "--max-tokens", "4"]) in (0, 1)
    err = capsys.readouterr().err
    assert f"--max-tokens raised from 4 to {longest}" in err
    assert "auditing 2 trajectories" in err
