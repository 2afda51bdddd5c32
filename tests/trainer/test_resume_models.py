"""A resumed run knows the models it trained with: every checkpoint manifest records the
fingerprints (sha256 of the weight files) of the student, teacher and reference, and
--resume refuses weights that changed since (one line naming the model and both
fingerprints) instead of continuing with a second teacher; unchanged weights resume,
also after a touch (only a stat-key change: rehashed, equal). Retraining a cached SFT
model that a run trained from names that run."""
import json
import os
import shutil

import pytest
import torch

from memopd.errors import RunDirError
from memopd.files import MANIFEST, weights_fingerprint
from memopd.trainer.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(student, teacher, run_dir, **kw):
    base = dict(steps=1, checkpoint_every=1, run_dir=str(run_dir), student=student, teacher=teacher, tasks_per_step=2,
                group_size=2, train_k=[1], eval_k=[1], eval_tasks=2, ppo_epochs=1, minibatches=2, progress=False)
    base.update(kw)
    return TrainConfig.from_dict(base)


def _perturb(model_dir):
    from safetensors.torch import load_file, save_file

    p = os.path.join(model_dir, "model.safetensors")
    w = load_file(p)
    name = next(k for k, v in w.items() if v.is_floating_point())
    w[name] = w[name] + 0.01
    save_file(w, p, metadata={"format": "pt"})


def test_resume_refuses_changed_weights_and_accepts_unchanged(sft_dirs, tmp_path):
    from memopd.trainer.loop import train

    student, teacher = (str(shutil.copytree(d, tmp_path / name)) for d, name in zip(sft_dirs, ("student", "teacher")))
    run = tmp_path / "run"
    train(_cfg(student, teacher, run), log=lambda *_: None)
    models = json.loads((run / "checkpoints" / "step_1" / MANIFEST).read_text())["models"]
    assert set(models) == {"student", "teacher", "reference"}
    assert models["teacher"]["sha256"] == weights_fingerprint(teacher)["sha256"]
    assert models["reference"]["sha256"] == models["student"]["sha256"]

    os.utime(os.path.join(teacher, "model.safetensors"))  # same bytes, new mtime: rehashed, still equal
    rep = train(_cfg(student, teacher, run, steps=2), resume=True, log=lambda *_: None)
    assert rep["last_step"]["step"] == 2
    # resumed from the final checkpoint (a kill after it): no step trains, the report still
    # names the last one (it said null)
    again = train(_cfg(student, teacher, run, steps=2), resume=True, log=lambda *_: None)
    assert again["last_step"] == rep["last_step"]

    before = (run / "metrics.jsonl").read_text()
    _perturb(teacher)  # `memopd sft --force` or other SFT settings retraining the cache in place
    with pytest.raises(RunDirError, match=r"teacher's weights in .*teacher are not the ones step_2 was trained with: "
                                          r"fingerprint [0-9a-f]{16} then, [0-9a-f]{16} now \(model.safetensors changed\)"):
        train(_cfg(student, teacher, run, steps=3), resume=True, log=lambda *_: None)
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained, nothing written


def test_retraining_a_cached_model_names_the_runs_that_used_it(tmp_path):
    from memopd.env.qa.sft import SFTConfig, record_run, run_sft

    cache = tmp_path / "sft"
    tiny = SFTConfig(steps=2, ks=(1,), calls_per_k=4)
    run_sft(cache, roles=("student",), sft_configs={"student": tiny}, jobs=1, progress=False, log=lambda *_: None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record_run(cache, str(run_dir), {"student": weights_fingerprint(cache / "student"), "teacher": None})
    logs = []
    # the same settings again with --force: deterministic, the same weights, nothing to say
    run_sft(cache, roles=("student",), sft_configs={"student": tiny}, force=True, jobs=1, progress=False,
            log=logs.append)
    assert not any("replaced weights" in x for x in logs)
    other = SFTConfig(steps=3, ks=(1,), calls_per_k=4)
    run_sft(cache, roles=("student",), sft_configs={"student": other}, jobs=1, progress=False, log=logs.append)
    said = [x for x in logs if "replaced weights" in x]
    assert len(said) == 1 and str(run_dir) in said[0] and "--resume will refuse" in said[0], logs


def test_fingerprint_reuses_known_hashes_only_for_an_unchanged_stat(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    torch.save({"w": torch.zeros(3)}, d / "model.pt")
    (d / "tokenizer.json").write_text("{}")  # not a weight file
    fp = weights_fingerprint(d)
    assert list(fp["files"]) == ["model.pt"]
    # a forged record with the current stat key is trusted (that is the cache) ...
    forged = {"files": {"model.pt": {**fp["files"]["model.pt"], "sha256": "0" * 64}}}
    assert weights_fingerprint(d, forged)["files"]["model.pt"]["sha256"] == "0" * 64
    # ... and ignored once the file changes
    torch.save({"w": torch.ones(3)}, d / "model.pt")
    again = weights_fingerprint(d, forged)
    assert again["files"]["model.pt"]["sha256"] not in ("0" * 64, fp["files"]["model.pt"]["sha256"])
    assert weights_fingerprint(tmp_path / "missing") is None
