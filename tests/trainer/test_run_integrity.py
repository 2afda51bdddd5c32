"""Run-directory integrity of `memopd train`: runs never lose or mix data.

Faults are injected at every write of a run (kills inside checkpoint saves and pointer
updates, damaged files of the newest checkpoint, partial metrics lines, leftover temp
files, a kill -9 before the first checkpoint), a second trainer races a running one, runs
are re-started into used directories with and without --resume / --overwrite / another
config, and output locations are unusable. Every case must end in either an exact
resume (metrics equal to an uninterrupted run's, step for step) or a clear refusal.

The reference is one uninterrupted 4-step run (checkpoints at 2 and 4) of the tiny
SFT'd models; `steps` may change on resume, so shorter runs compare with its first steps.
"""
import copy
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memopd.errors import RunDirError, UserError
from memopd.files import MANIFEST, verify_manifest
from memopd.trainer.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "_rundir_worker.py"
SKIP = ("time/",)


def _cfg(sft_dirs, run_dir, **kw):
    # pack_layout: the layout every run packed before the key existed (the flat-form run of test 13 is one)
    base = dict(steps=4, checkpoint_every=2, run_dir=str(run_dir), student=sft_dirs[0], teacher=sft_dirs[1],
                pack_layout="aligned",
                tasks_per_step=2, group_size=2, train_k=[1], eval_k=[1], eval_tasks=2, ppo_epochs=1, minibatches=2,
                progress=False)
    base.update(kw)
    return TrainConfig.from_dict(base)


@pytest.fixture(scope="module")
def parts(sft_dirs, tmp_path_factory):
    """Models and environment, loaded once; every trainer gets fresh copies of the models."""
    from memopd.trainer.loop import prepare

    student, teacher, env, world, *_ = prepare(_cfg(sft_dirs, tmp_path_factory.mktemp("prep")), log=lambda *_: None)
    return student, teacher, env, world


def _trainer(parts, cfg, log=None):
    from memopd.trainer.loop import Trainer

    student, teacher, env, world = parts
    return Trainer(cfg, student_lm=copy.deepcopy(student), teacher_lm=copy.deepcopy(teacher), env=env, tasks=world,
                   log=log or (lambda *_: None))


@pytest.fixture(scope="module")
def ref(parts, sft_dirs, tmp_path_factory):
    """An uninterrupted 4-step run (checkpoints at steps 2 and 4)."""
    d = tmp_path_factory.mktemp("ref") / "run"
    _trainer(parts, _cfg(sft_dirs, d)).fit()
    return d


def _lines(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(x) for x in f]


def _assert_matches(run_dir, ref, n=4):
    """metrics.jsonl holds exactly steps 1..n, each equal to the uninterrupted run's."""
    got, want = _lines(run_dir), _lines(ref)[:n]
    assert [m["step"] for m in got] == list(range(1, n + 1))
    for a, b in zip(want, got):
        strip = lambda m: {k: v for k, v in m.items() if not k.startswith(SKIP)}  # noqa: E731
        assert strip(b) == strip(a), f"step {a['step']}"


def _copy(ref, dst):
    shutil.copytree(ref, dst)
    return dst


def _resume(parts, cfg):
    logs = []
    hist = _trainer(parts, cfg, log=logs.append).fit(resume=True)
    return hist, "\n".join(map(str, logs))


# ----------------------------------------------------------------- 1: resume picks the newest complete checkpoint


def test_resume_after_kill_before_first_checkpoint_starts_clean(parts, sft_dirs, ref, tmp_path):
    d = tmp_path / "run"
    _trainer(parts, _cfg(sft_dirs, d)).fit(stop_after=1)  # metrics of step 1, no checkpoint
    hist, said = _resume(parts, _cfg(sft_dirs, d))
    assert "no complete checkpoint" in said and "starting from step 0" in said
    assert [m["step"] for m in hist] == [1, 2, 3, 4]
    _assert_matches(d, ref)  # not [1, 1, 2, 3, 4]


def test_dangling_latest_falls_back_to_an_older_checkpoint(parts, sft_dirs, ref, tmp_path):
    d = _copy(ref, tmp_path / "run")
    shutil.rmtree(d / "checkpoints" / "step_4")  # "latest" now names a missing directory
    hist, said = _resume(parts, _cfg(sft_dirs, d))
    assert "resumed from" in said and "step_2" in said
    assert [m["step"] for m in hist] == [3, 4]
    _assert_matches(d, ref)
    assert (d / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert verify_manifest(d / "checkpoints" / "step_4") == []


CKPT_FILES = ["actor/backend.pt", "actor/client_state_rank0.json", "critic/backend.pt", "critic/client_state_rank0.json",
              MANIFEST]


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:  # flip one byte in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
def test_each_damaged_checkpoint_file_falls_back_to_the_previous_checkpoint(parts, sft_dirs, ref, tmp_path, how):
    step4 = ref / "checkpoints" / "step_4"
    assert sorted(str(p.relative_to(step4)) for p in step4.rglob("*") if p.is_file()) == sorted(CKPT_FILES)
    for name in CKPT_FILES:
        d = _copy(ref, tmp_path / f"{how}-{name.replace('/', '-')}")
        _damage(d / "checkpoints" / "step_4" / name, how)
        hist, said = _resume(parts, _cfg(sft_dirs, d))
        assert "skipping checkpoint step_4" in said, (name, said)
        assert [m["step"] for m in hist] == [3, 4], name
        _assert_matches(d, ref)
        assert verify_manifest(d / "checkpoints" / "step_4") == []  # saved again, complete


def test_partial_metrics_line_and_leftover_temp_files(parts, sft_dirs, ref, tmp_path):
    """The state a kill inside step 4's metrics write leaves: a partial last line, an
    unfinished step_4 (temp file, no manifest) and a half-written pointer temp file."""
    d = _copy(ref, tmp_path / "run")
    ck = d / "checkpoints"
    shutil.rmtree(ck / "step_4")
    (ck / "step_4" / "actor").mkdir(parents=True)
    (ck / "step_4" / "actor" / "backend.pt.tmp").write_bytes(b"PK\x03\x04 half a zip")
    (ck / "latest.abc123.tmp").write_text("step_")
    (d / "config.yaml.xyz.tmp").write_text("arm: mem")
    full = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    (d / "metrics.jsonl").write_text("".join(full[:3]) + full[3][: len(full[3]) // 2])
    hist, said = _resume(parts, _cfg(sft_dirs, d))
    assert "partial last line" in said and "skipping checkpoint step_4" in said
    assert [m["step"] for m in hist] == [3, 4]
    _assert_matches(d, ref)


# ----------------------------------------------------------------- kills inside every write


class _Killed(BaseException):
    """Stands for SIGKILL: nothing above the write point catches it."""


def _kill_points(monkeypatch, k):
    """Count every atomic rename and every torch.save; at the k-th one, die (a torch.save
    leaves half of its file behind, a rename does not happen). Returns the counter."""
    count = [0]
    real_replace, real_save = os.replace, torch.save

    def replace(src, dst, *a, **kw):
        count[0] += 1
        if count[0] == k:
            raise _Killed(f"before renaming to {dst}")
        return real_replace(src, dst, *a, **kw)

    def save(obj, f, *a, **kw):
        count[0] += 1
        if count[0] == k and isinstance(f, (str, os.PathLike)):
            buf = io.BytesIO()
            real_save(obj, buf, *a, **kw)
            with open(f, "wb") as fh:
                fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            raise _Killed(f"inside torch.save({f})")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(torch, "save", save)
    return count


def test_kill_inside_every_write_resumes_exactly(parts, sft_dirs, ref, tmp_path, monkeypatch):
    """2 steps, a checkpoint after each: config.yaml, then per checkpoint 4 torch.saves
    (client states, backend.pt temp files) and 4 renames (backend.pt x2, manifest, latest)."""
    cfg = lambda d: _cfg(sft_dirs, d, steps=2, checkpoint_every=1)  # noqa: E731
    with monkeypatch.context() as mp:
        count = _kill_points(mp, k=0)
        _trainer(parts, cfg(tmp_path / "count")).fit()
    n_points = count[0]
    assert n_points == 17
    outcomes = set()
    for k in range(1, n_points + 1):
        d = tmp_path / f"kill{k}"
        with monkeypatch.context() as mp:
            _kill_points(mp, k)
            with pytest.raises(_Killed):
                _trainer(parts, cfg(d)).fit()
        hist, said = _resume(parts, cfg(d))
        start = hist[0]["step"] - 1 if hist else 2
        outcomes.add(start)
        _assert_matches(d, ref, n=2)
        for step in (1, 2):
            assert verify_manifest(d / "checkpoints" / f"step_{step}") == [], (k, step)
    assert outcomes == {0, 1, 2}  # restart, fall back, and resume from a checkpoint completed just before the kill


def test_kill_minus_9_before_the_first_checkpoint(parts, sft_dirs, ref, tmp_path):
    """A real SIGKILL while the run holds the lock and has written step 1 only: the lock
    does not outlive its holder, and the resume starts clean."""
    d = tmp_path / "run"
    proc, state = _start_paused(_cfg(sft_dirs, d), tmp_path, pause_at=1)
    try:
        holder = json.loads((d / ".lock").read_text())
        assert holder["pid"] == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    hist, said = _resume(parts, _cfg(sft_dirs, d))
    assert "no complete checkpoint" in said
    _assert_matches(d, ref)


# ----------------------------------------------------------------- 3: one owner per run directory


def _start_paused(cfg, tmp_path, pause_at):
    state = tmp_path / f"state-{time.monotonic_ns()}"
    state.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, str(WORKER), "pause", json.dumps(cfg.to_dict()), str(state),
                             str(pause_at)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 300
    while not (state / "paused").exists():
        if proc.poll() is not None:
            pytest.fail(f"worker exited early (rc={proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail("worker did not reach its pause point")
        time.sleep(0.05)
    return proc, state


def test_second_trainer_is_refused_while_the_first_runs(parts, sft_dirs, ref, tmp_path):
    from memopd.trainer.loop import train

    d = tmp_path / "run"
    proc, state = _start_paused(_cfg(sft_dirs, d), tmp_path, pause_at=1)
    try:
        for kw in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(RunDirError, match=rf"in use by pid {proc.pid} on host .*, started .*_rundir_worker"):
                _trainer(parts, _cfg(sft_dirs, d)).fit(**kw)
        with pytest.raises(RunDirError, match=f"pid {proc.pid}"):  # before any model is loaded
            train(_cfg(sft_dirs, d), resume=True, log=lambda *_: None)
        (state / "go").touch()
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    _assert_matches(d, ref)  # the first run is unaffected
    assert verify_manifest(d / "checkpoints" / "step_4") == []


# ----------------------------------------------------------------- 4: used directories


def test_rerun_needs_resume_or_overwrite(sft_dirs, tmp_path, monkeypatch):
    from memopd.trainer import loop

    d = tmp_path / "run"
    quiet = lambda *_: None  # noqa: E731
    loop.train(_cfg(sft_dirs, d, steps=2, checkpoint_every=1), log=quiet)
    (d / "train.log").write_text("a log the caller writes next to the outputs\n")
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".lock"}

    def no_work(*a, **k):
        raise AssertionError("prepare ran: the refusal must come before any work")

    with monkeypatch.context() as mp:
        mp.setattr(loop, "prepare", no_work)
        with pytest.raises(RunDirError, match="holds a previous run .*--resume.*--overwrite"):
            loop.train(_cfg(sft_dirs, d, steps=1, checkpoint_every=0), log=quiet)
        with pytest.raises(UserError, match="exclude each other"):
            loop.train(_cfg(sft_dirs, d), resume=True, overwrite=True, log=quiet)
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".lock"} == before

    said = []
    rep = loop.train(_cfg(sft_dirs, d, steps=1, checkpoint_every=0), overwrite=True, log=said.append)
    assert any("--overwrite: deleted" in str(s) for s in said)
    # the step-0 baseline evaluation, step 1 and its final evaluation: nothing of the old run
    assert [m["step"] for m in _lines(d)] == [0, 1, 1]
    assert not (d / "checkpoints" / "step_1").exists() and not (d / "checkpoints" / "step_2").exists()
    assert json.loads((d / "report.json").read_text())["steps"] == 1 == rep["steps"]
    assert (d / "train.log").exists()  # not an output of the trainer: left alone

    from memopd.trainer.cli import train_main

    with pytest.raises(SystemExit):
        train_main(["--resume", "--overwrite", f"run_dir={d}"])


# ----------------------------------------------------------------- 5: resume with another config


def test_resume_with_another_config_is_refused_unless_only_safe_keys_change(parts, sft_dirs, ref, tmp_path):
    d = _copy(ref, tmp_path / "run")
    shutil.rmtree(d / "checkpoints" / "step_4")
    stored = (d / "config.yaml").read_text()
    with pytest.raises(RunDirError, match=r"arm: 'memopd' -> 'ppo', seed: 0 -> 1\b") as e:
        _trainer(parts, _cfg(sft_dirs, d, arm="ppo", seed=1)).fit(resume=True)
    assert "steps" not in str(e.value).split("only")[0]
    assert (d / "config.yaml").read_text() == stored
    with pytest.raises(RunDirError, match="past steps=1"):
        _trainer(parts, _cfg(sft_dirs, d, steps=1)).fit(resume=True)
    # a lost config.yaml: the config recorded in the checkpoint's manifest still guards the run
    (d / "config.yaml").unlink()
    with pytest.raises(RunDirError, match=r"memopd_manifest.json: .*actor_lr: 0.0002 -> 0.001"):
        _trainer(parts, _cfg(sft_dirs, d, actor_lr=1e-3)).fit(resume=True)
    (d / "config.yaml").write_text(stored)
    # steps / checkpoint_every may change: an exact continuation (the LR is constant after warm-up)
    hist, said = _resume(parts, _cfg(sft_dirs, d, steps=3, checkpoint_every=1))
    assert "allowed config changes: steps: 4 -> 3; checkpoint_every: 2 -> 1" in said
    assert [m["step"] for m in hist] == [3]
    _assert_matches(d, ref, n=3)
    assert "steps: 3" in (d / "config.yaml").read_text()


def test_resume_may_change_the_device_but_not_the_dtype(parts, sft_dirs, ref, tmp_path):
    import yaml

    d = _copy(ref, tmp_path / "run")
    shutil.rmtree(d / "checkpoints" / "step_4")
    stored = (d / "config.yaml").read_text()
    # dtype: refused in one line naming both, before anything is written (also beside a device change)
    for kw in (dict(dtype="bf16"), dict(dtype="bf16", device="cpu")):
        with pytest.raises(RunDirError) as e:
            _trainer(parts, _cfg(sft_dirs, d, **kw)).fit(resume=True)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("--resume with dtype=bf16, but the run in "), msg
        assert "trained in dtype=fp32" in msg and "resume with dtype=fp32" in msg and "device" not in msg.split(";")[0]
        assert (d / "config.yaml").read_text() == stored
    # a GPU run resumed on the CPU: the stored config said device=cuda and its checkpoint was
    # written on cuda:0 (both set here by hand: this host has no GPU); device=cpu is allowed,
    # the log says what changed, and the steps continue exactly as the CPU reference ran them
    step2 = d / "checkpoints" / "step_2"
    manifest = json.loads((step2 / MANIFEST).read_text())
    assert manifest["device"] == "cpu"  # what the reference run recorded
    manifest["device"] = "cuda:0"
    manifest["config"]["device"] = "cuda"
    (step2 / MANIFEST).write_text(json.dumps(manifest))
    cfg = yaml.safe_load(stored)
    cfg["device"] = "cuda"
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert verify_manifest(step2) == []
    hist, said = _resume(parts, _cfg(sft_dirs, d, device="cpu"))
    assert "allowed config changes: device: 'cuda' -> 'cpu' (the steps from here on run on the new device" in said
    assert "checkpoint step_2 was trained on cuda:0, this run continues on cpu" in said
    assert [m["step"] for m in hist] == [3, 4]
    _assert_matches(d, ref)
    assert json.loads((d / "checkpoints" / "step_4" / MANIFEST).read_text())["device"] == "cpu"
    # the same physical device (step_2 as a CPU run wrote it): only the config change is said
    shutil.rmtree(d / "checkpoints" / "step_4")
    manifest["device"], manifest["config"]["device"] = "cpu", "cpu"
    (step2 / MANIFEST).write_text(json.dumps(manifest))
    hist, said = _resume(parts, _cfg(sft_dirs, d, device="auto"))
    assert "allowed config changes: device: 'cpu' -> 'auto'" in said and "was trained on" not in said
    _assert_matches(d, ref)


# ----------------------------------------------------------------- 12: unwritable output locations


def test_unwritable_output_locations_are_refused_at_start(sft_dirs, tmp_path, monkeypatch):
    from memopd.trainer import loop

    def no_work(*a, **k):
        raise AssertionError("prepare ran: the check must come before any work")

    monkeypatch.setattr(loop, "prepare", no_work)
    d = tmp_path / "run"
    d.mkdir()
    (d / "checkpoints").write_text("a file where the checkpoints go\n")
    with pytest.raises(UserError, match=r"checkpoint directory '.*run/checkpoints' is a file"):
        loop.train(_cfg(sft_dirs, d), log=lambda *_: None)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot create the run directory '.*blocker/run': '.*blocker' is a file"):
        loop.train(_cfg(sft_dirs, blocker / "run"), log=lambda *_: None)
    with pytest.raises(UserError, match="SFT cache directory '.*blocker/sft': '.*blocker' is a file"):
        loop.train(_cfg(sft_dirs, tmp_path / "run2", student="", cache_dir=str(blocker)), log=lambda *_: None)


# ----------------------------------------------------------------- 6: the SFT cache


def test_damaged_sft_cache_is_retrained_and_a_file_cache_dir_refused(tmp_path, monkeypatch):
    from memopd.env import sft

    tiny = {"student": sft.SFTConfig(steps=2, ks=(1,), calls_per_k=4)}
    out = tmp_path / "cache"
    said = []
    run = lambda: sft.run_sft(out, roles=("student",), sft_configs=tiny, progress=False, log=said.append)  # noqa: E731
    run()
    d = out / "student"
    assert verify_manifest(d) == []
    run()
    assert "skipping" in said[-1]  # intact: reused
    for name, how in (("model.safetensors", "truncate"), ("tokenizer.json", "flip"), ("config.json", "delete")):
        said.clear()
        _damage(d / name, how)
        run()
        text = "\n".join(said)
        assert f"{d} is damaged or incomplete ({name}" in text and "retraining" in text, text
        assert verify_manifest(d) == []
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(d, local_files_only=True)  # loads again

    # a cache_dir that is a file: refused before any SFT work starts
    f = tmp_path / "not_a_dir"
    f.write_text("")

    def no_training(*a, **k):
        raise AssertionError("SFT started")

    monkeypatch.setattr(sft, "_train_role", no_training)
    with pytest.raises(UserError, match="SFT output directory .*not_a_dir/sft"):
        sft.run_sft(f / "sft", roles=("student",), sft_configs=tiny, progress=False, log=said.append)
    from memopd.trainer.loop import train

    with pytest.raises(UserError, match="not_a_dir"):
        train(TrainConfig(run_dir=str(tmp_path / "r"), cache_dir=str(f), progress=False), log=lambda *_: None)


# ----------------------------------------------------------------- ranks agree


def test_two_ranks_refuse_together_and_resume_the_same_checkpoint(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from _launch import run_worker

    run_worker([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(WORKER), "dist", str(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert res["world_size"] == 2
        assert "holds a previous run" in res["refused"], r
        assert [m["step"] for m in res["resumed"]] == [2, 3], r  # both fell back to step_1
    full, resumed = ranks[0]["full"], ranks[0]["resumed"]
    for a, b in zip(full[1:], resumed):
        for k, v in a.items():
            if not k.startswith(SKIP):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), k
    assert [m["step"] for m in _lines(tmp_path / "b")] == [1, 2, 3]


def test_atomic_directory_swaps_whole_directories(tmp_path):
    """final/ and eval_model/ are written through `atomic_directory`: a finished write
    replaces the old content as a whole, a failed one leaves the old content untouched
    and no partial directory behind."""
    from memopd.files import atomic_directory

    target = tmp_path / "final"
    target.mkdir()
    (target / "old.bin").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (Path(tmp) / "model.safetensors").write_text("partial")
            raise RuntimeError("killed mid-save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (target / "old.bin").read_text() == "old"
    with atomic_directory(target) as tmp:
        (Path(tmp) / "model.safetensors").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)


# ----------------------------------------------------------------- 13: run directories of the older (flat) config form

FLAT_CONFIG = REPO / "tests" / "trainer" / "data" / "config_flat.yaml"  # written by `memopd train` of that version
# where the flat form's keys live in the nested config (written out here, not taken from the code under test)
ENV_KEYS = ("corpus", "tasks", "eval_tasks_file", "tokenizer", "world", "world_seed", "policy", "policy_kwargs")
PPO_KEYS = {"clip_eps": "clip_eps", "value_clip": "value_clip", "gamma": "gamma", "lam": "lam",
            "kl_coef": "ref_kl_coef", "entropy_coef": "entropy_coef", "opd_coef": "teacher_kl_coef"}


def _flat_form(nested: dict, keys: list) -> dict:
    """`nested` (a config's to_dict()) written in the flat form, with the flat form's keys in its order."""
    out = {}
    for k in keys:
        out[k] = nested["env"][k] if k in ENV_KEYS else nested["ppo"][PPO_KEYS[k]] if k in PPO_KEYS else nested[k]
    return out


def _stored_with_config(ref, d, config: dict) -> None:
    """A copy of the reference run at `d`, cut back to its step-2 checkpoint, whose
    config.yaml and manifest hold `config` (a config as an older version wrote it)."""
    import yaml

    _copy(ref, d)
    shutil.rmtree(d / "checkpoints" / "step_4")
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    step2 = d / "checkpoints" / "step_2"
    manifest = json.loads((step2 / MANIFEST).read_text())
    manifest["config"] = config
    (step2 / MANIFEST).write_text(json.dumps(manifest))
    assert verify_manifest(step2) == []


def test_a_run_stored_in_the_flat_config_form_resumes_exactly(parts, sft_dirs, ref, tmp_path):
    """A run directory whose config.yaml and checkpoint manifest hold the config in the flat
    form (as every run before the nested config wrote it) resumes: the stored flat config
    compares equal to the same config in today's form, the steps continue exactly as the
    uninterrupted run's, and a changed key is still refused, named in today's form."""
    import yaml

    keys = list(yaml.safe_load(FLAT_CONFIG.read_text()))
    assert "kl_coef" in keys and "policy" in keys and "env" not in keys and "ppo" not in keys  # the old form
    d = tmp_path / "run"
    cfg = _cfg(sft_dirs, d)
    _stored_with_config(ref, d, _flat_form(cfg.to_dict(), keys))
    stored = (d / "config.yaml").read_text()
    with pytest.raises(RunDirError, match=r"ppo.ref_kl_coef: 0.02 -> 0.05"):
        _trainer(parts, _cfg(sft_dirs, d, ppo=dataclasses.replace(cfg.ppo, ref_kl_coef=0.05))).fit(resume=True)
    assert (d / "config.yaml").read_text() == stored
    hist, said = _resume(parts, cfg)
    assert "allowed config changes" not in said  # the flat form and today's are the same config
    assert [m["step"] for m in hist] == [3, 4]
    _assert_matches(d, ref)
    assert yaml.safe_load((d / "config.yaml").read_text()) == cfg.to_dict()  # rewritten in today's form


def test_a_run_stored_before_pack_layout_existed_resumes_aligned(parts, sft_dirs, ref, tmp_path):
    """A run whose config.yaml and manifests have no pack_layout (written when the trainer
    always packed aligned) resumed by `train` with today's defaults (pack_layout=trie)
    continues aligned: it says so, records it, and its steps equal the uninterrupted
    aligned run's. A new run with the same config packs trie."""
    import yaml

    from memopd.trainer.config import comparable_config
    from memopd.trainer.loop import train

    d = tmp_path / "run"
    old = {k: v for k, v in _cfg(sft_dirs, d).to_dict().items() if k != "pack_layout"}
    _stored_with_config(ref, d, old)
    assert comparable_config(old)["pack_layout"] == "aligned" != TrainConfig.from_dict(old).pack_layout == "trie"
    said = []
    train(TrainConfig.from_dict(old), resume=True, log=said.append)
    assert any("written before pack_layout existed" in str(x) and "pack_layout=aligned" in str(x) for x in said), said
    assert yaml.safe_load((d / "config.yaml").read_text())["pack_layout"] == "aligned"
    train_lines = [m for m in _lines(d) if "train/pg_loss" in m]
    assert [m["step"] for m in train_lines] == [1, 2, 3, 4]
    for a, b in zip(_lines(ref), train_lines):
        strip = lambda m: {k: v for k, v in m.items() if not k.startswith(SKIP)}  # noqa: E731
        assert strip(b) == strip(a), f"step {a['step']}"


def test_asking_for_trie_when_resuming_a_run_stored_before_pack_layout_is_refused(sft_dirs, ref, tmp_path):
    """The same old run (no pack_layout stored), resumed with `pack_layout=trie` set by the
    user (`load_given` reports it as asked), is not silently continued aligned: the run
    directory refuses the changed key in one line and nothing is written. Overrides that do
    not name the key still continue aligned (the stored run's value)."""
    import yaml

    from memopd.trainer.config import as_stored
    from memopd.trainer.loop import train

    d = tmp_path / "run"
    old = {k: v for k, v in _cfg(sft_dirs, d).to_dict().items() if k != "pack_layout"}
    _stored_with_config(ref, d, old)
    stored = (d / "config.yaml").read_text()
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    cfg, asked = TrainConfig.load_given(str(path), ["pack_layout=trie"])
    assert cfg.pack_layout == "trie" and "pack_layout" in asked and "steps" in asked
    with pytest.raises(RunDirError, match=r"pack_layout: 'aligned' -> 'trie'"):
        train(cfg, resume=True, asked=asked, log=lambda _: None)
    assert (d / "config.yaml").read_text() == stored
    cfg, asked = TrainConfig.load_given(str(path), ["steps=4"])
    assert "pack_layout" not in asked and as_stored(cfg, old, asked)[0].pack_layout == "aligned"
    assert as_stored(TrainConfig.from_dict(old), old)[0].pack_layout == "aligned"  # built in code: default = unset
