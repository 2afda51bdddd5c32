"""A `memopd train` that cannot start leaves its run directory unused.

Every requirement (the packages `tensorboard=true` and `deepspeed=` need, a DeepSpeed
config the backend accepts, the user-data files) is checked before the run directory is
written; a fresh run that fails later but before its first metrics line (a model that
does not load, an interrupted SFT stage) removes the config.yaml it wrote. Either way the
same command is accepted again once the problem is fixed. Nothing here trains: seconds."""
import json
import sys

import pytest

from memopd.cli import main
from memopd.errors import UserError

pytest.importorskip("yaml")


def _hide_module(monkeypatch, name: str) -> None:
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, name, None)  # find_spec -> None, import -> ModuleNotFoundError


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memopd train: error: "), err
    return err[0]


def test_missing_tensorboard_is_found_before_anything_is_written(capsys, tmp_path, monkeypatch):
    _hide_module(monkeypatch, "tensorboard")
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    rc = main(["train", "tensorboard=true", "steps=1", f"run_dir={run_dir}", f"cache_dir={cache}"])
    assert rc == 2
    line = _one_error(capsys)
    assert "tensorboard=true needs tensorboard" in line and "pip install 'memopd[plot]'" in line
    assert not run_dir.exists() and not cache.exists()  # no config.yaml, no checkpoints/, no SFT cache


def test_unusable_deepspeed_config_is_found_before_anything_is_written(capsys, tmp_path):
    pytest.importorskip("deepspeed")
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))  # no zero_optimization
    run_dir = tmp_path / "run"
    assert main(["train", f"deepspeed={bad}", f"run_dir={run_dir}", f"cache_dir={tmp_path / 'c'}"]) == 2
    assert "no zero_optimization section" in _one_error(capsys)
    (tmp_path / "broken.json").write_text("{")
    assert main(["train", f"deepspeed={tmp_path / 'broken.json'}", f"run_dir={run_dir}"]) == 2
    assert "not valid JSON" in _one_error(capsys)
    assert not run_dir.exists()


def test_missing_user_data_file_is_found_before_anything_is_written(capsys, tmp_path):
    run_dir = tmp_path / "run"
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rc = main(["train", "arm=ppo", f"student={model}", f"corpus={tmp_path / 'nope.jsonl'}",
               f"tasks={tmp_path / 'nope2.jsonl'}", f"run_dir={run_dir}"])
    assert rc == 2
    line = _one_error(capsys)
    assert f"corpus='{tmp_path / 'nope.jsonl'}': no such file" in line
    assert not run_dir.exists()


@pytest.mark.parametrize("failure", [UserError("the student does not load"), KeyboardInterrupt()])
def test_a_start_that_fails_before_step_one_leaves_the_directory_unused(tmp_path, monkeypatch, failure):
    from memopd.trainer import loop
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.rundir import RunDir, previous_outputs

    def fail(cfg, log):
        assert (tmp_path / "run" / "config.yaml").is_file()  # the run directory was opened
        raise failure

    monkeypatch.setattr(loop, "prepare", fail)
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), steps=1).validate()
    with pytest.raises(type(failure)):
        loop.train(cfg, log=lambda *_: None)
    assert previous_outputs(cfg.run_dir) == []
    RunDir.open(cfg.to_dict(), log=lambda *_: None).close()  # the rerun is accepted (no --overwrite)


def test_a_run_that_wrote_metrics_keeps_its_outputs_for_resume(tmp_path, monkeypatch):
    from memopd.trainer import loop
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.rundir import previous_outputs

    def fail_after_a_step(cfg, log):
        (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "prepare", fail_after_a_step)
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), steps=1).validate()
    with pytest.raises(KeyboardInterrupt):
        loop.train(cfg, log=lambda *_: None)
    assert previous_outputs(cfg.run_dir) == ["config.yaml", "metrics.jsonl"]
