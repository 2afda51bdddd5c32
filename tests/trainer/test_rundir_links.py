"""What memopd deletes, truncates or writes in a run directory stays in it: a lock file
planted as a symbolic link is refused (O_NOFOLLOW) instead of truncating its target,
--overwrite removes a linked checkpoint's link and never the other run's files behind it,
a linked output file is refused before anything is written, and --resume checks the
config of the checkpoint it will load (not of a newer one that fails its manifest).
No model is trained: checkpoints are directories with a manifest, as `Trainer.save`
writes them."""
import os

import pytest
import yaml

from memopd.errors import RunDirError, UserError
from memopd.files import MANIFEST, DirectoryLock, write_manifest
from memopd.trainer.rundir import RunDir, newest_complete_checkpoint


def _checkpoint(root, step, config, payload=b"weights"):
    d = root / "checkpoints" / f"step_{step}"
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "model.pt").write_bytes(payload)
    write_manifest(d, step=step, config=config)
    return d


def _cfg(run_dir, **kw):
    return {"run_dir": str(run_dir), "arm": "memopd", "seed": 0, "steps": 4, "lr": 1e-5, **kw}


@pytest.mark.parametrize("lock", ["run_dir", "sft_cache"])
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path, lock):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    d = tmp_path / "dir"
    d.mkdir()
    name = ".lock" if lock == "run_dir" else ".memopd_sft.lock"
    os.symlink(victim, d / name)
    with pytest.raises(UserError, match=rf"{name}.* is a symbolic link .*victim.txt.*remove the link"):
        DirectoryLock(str(d), name=name).acquire()
    assert victim.read_text() == "precious\n"
    if lock == "run_dir":
        with pytest.raises(UserError, match="is a symbolic link"):
            RunDir.open(_cfg(d), log=lambda *_: None)
        assert victim.read_text() == "precious\n"


def test_overwrite_never_crosses_a_symlinked_checkpoint(tmp_path):
    """--overwrite followed checkpoints/step_N -> another run's step_N, deleted that run's
    manifest, then failed on rmtree of the link (exit 70)."""
    other = tmp_path / "other"
    foreign = _checkpoint(other, 3, _cfg(other))
    run = tmp_path / "run"
    _checkpoint(run, 2, _cfg(run))
    os.symlink(foreign, run / "checkpoints" / "step_3")
    (run / "config.yaml").write_text(yaml.safe_dump(_cfg(run)))
    logs = []
    RunDir.open(_cfg(run), overwrite=True, log=logs.append).close()
    assert (foreign / MANIFEST).exists() and (foreign / "actor" / "model.pt").read_bytes() == b"weights"
    assert not os.path.lexists(run / "checkpoints" / "step_3") and not (run / "checkpoints" / "step_2").exists()


def test_a_linked_checkpoint_outside_the_run_is_never_resumed(tmp_path):
    other = tmp_path / "other"
    foreign = _checkpoint(other, 6, _cfg(other))
    run = tmp_path / "run"
    _checkpoint(run, 2, _cfg(run))
    os.symlink(foreign, run / "checkpoints" / "step_6")
    found, skipped = newest_complete_checkpoint(run / "checkpoints")
    assert found is not None and found[0] == 2
    assert skipped and skipped[0][0] == "step_6" and "outside" in skipped[0][1]


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "report.json"])
def test_a_linked_output_file_is_refused_before_anything_is_written(tmp_path, name):
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / name)
    for kw in ({"resume": True}, {}):
        with pytest.raises(UserError, match=rf"{name}.* is a symbolic link"):
            RunDir.open(_cfg(run), log=lambda *_: None, **kw)
    assert victim.read_text() == "keep me\n"
    # --overwrite removes the link (an output of the run directory), never its target
    RunDir.open(_cfg(run), overwrite=True, log=lambda *_: None).close()
    assert victim.read_text() == "keep me\n"


def test_resume_checks_the_config_of_the_checkpoint_it_loads(tmp_path):
    """Newest checkpoint damaged, an older one copied from another run: the config was
    compared with the damaged newest one only, and the foreign weights loaded silently."""
    run = tmp_path / "run"
    mine = _cfg(run)
    _checkpoint(run, 2, {**_cfg(run), "lr": 3e-4, "seed": 7})  # copied in from another run
    newest = _checkpoint(run, 4, mine)
    (newest / "actor" / "model.pt").write_bytes(b"damaged")
    (run / "config.yaml").write_text(yaml.safe_dump(mine))
    with pytest.raises(RunDirError, match=r"step_2.*seed: 7 -> 0.*lr: 0.0003 -> 1e-05|step_2.*lr: 0.0003 -> 1e-05"):
        RunDir.open(mine, resume=True, log=lambda *_: None)
    # the same run with its own older checkpoint resumes
    (run / "checkpoints" / "step_2" / MANIFEST).unlink()
    write_manifest(run / "checkpoints" / "step_2", step=2, config=mine)
    RunDir.open(mine, resume=True, log=lambda *_: None).close()
