"""Small edges a new user meets first: the modes of the files a run writes, `pack` given
one Trajectory, `memopd pack`'s table, and non-finite hidden states under
MEMOPD_DEBUG_CHECKS=1. Seconds in all."""
import os
import stat

import pytest
import torch

from memopd import PackError, pack, random_trajectories
from memopd.cli import main
from memopd.ops import fused_linear_actor_loss, fused_linear_logprob_entropy, fused_linear_reverse_kl


@pytest.fixture
def umask():
    def set_to(mask: int) -> None:
        os.umask(mask)

    before = os.umask(0o022)
    os.umask(before)
    yield set_to
    os.umask(before)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_files_and_directories_written_atomically_follow_the_umask(tmp_path, umask, mask):
    from memopd.files import atomic_directory, atomic_write_json, atomic_write_text

    umask(mask)
    atomic_write_text(tmp_path / "config.yaml", "a: 1\n")
    atomic_write_json(tmp_path / "report.json", {"a": 1})
    with open(tmp_path / "metrics.jsonl", "a") as f:  # how the trainer appends its metrics
        f.write("{}\n")
    with atomic_directory(tmp_path / "final") as d:
        open(os.path.join(d, "w.bin"), "w").close()
    modes = {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in ("config.yaml", "report.json", "metrics.jsonl")}
    assert modes == dict.fromkeys(modes, 0o666 & ~mask), modes
    assert stat.S_IMODE(os.stat(tmp_path / "final").st_mode) == 0o777 & ~mask


def test_run_directory_config_is_readable_like_the_metrics(tmp_path, umask):
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.rundir import RunDir

    umask(0o022)
    cfg = TrainConfig(run_dir=str(tmp_path / "run")).validate()
    RunDir.open(cfg.to_dict(), log=lambda *_: None).close()
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "config.yaml").st_mode) == 0o644


def test_pack_of_one_trajectory_says_to_pass_a_list():
    trajs = random_trajectories("summary", 2, vocab_size=64)
    with pytest.raises(PackError, match=r"got one Trajectory: pass \[trajectory\]"):
        pack(trajs[0])
    with pytest.raises(PackError, match="got a int"):
        pack(3)
    assert pack([trajs[0]]).stats()["action_tokens"] > 0


def test_memopd_pack_table_has_no_none(capsys):
    assert main(["pack", "--num-trajectories", "4"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:5]}
    assert rows["flatten"][-1].isdigit() and rows["aligned"][-1] == "-"


def _nan_hidden(n=6, h=8, v=20):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g)
    hidden[3, 2] = float("nan")
    return hidden, torch.randn(v, h, generator=g), torch.randint(0, v, (n,), generator=g)


def test_nan_hidden_states_are_named_under_debug_checks(monkeypatch):
    hidden, weight, targets = _nan_hidden()
    # by default the op does not look (the check costs a pass and a host sync on GPU)
    assert torch.isnan(fused_linear_logprob_entropy(hidden, weight, targets).logprobs[3])
    monkeypatch.setenv("MEMOPD_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=r"^hidden holds 1 non-finite values \(NaN or inf\), first in row 3"):
        fused_linear_logprob_entropy(hidden, weight, targets)
    with pytest.raises(ValueError, match=r"^student_hidden holds 1 non-finite"):
        fused_linear_actor_loss(hidden, weight, targets, torch.zeros(6), torch.zeros(6))
    teacher = hidden.clone()
    hidden[3, 2] = 0.0
    weight_t = weight.clone()
    weight_t[5, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^teacher_weight holds 1 non-finite .* first in row 5"):
        fused_linear_reverse_kl(hidden, weight, teacher.nan_to_num(), weight_t, targets)
    out = fused_linear_reverse_kl(hidden, weight, teacher.nan_to_num(), weight, targets)
    assert torch.isfinite(out.loss)
