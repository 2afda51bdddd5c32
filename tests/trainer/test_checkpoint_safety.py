"""Loading a file a user hands memopd never runs code from it.

Every kind of file memopd loads gets a planted payload: a pickle whose reduce creates a
marker file (checked to be live: the plain unpickler does run it). Loading the planted
file must leave no marker and fail with one line naming the file: the trainer's
checkpoint files (client state, `backend.pt`, DeepSpeed's ZeRO files), a client state of
an older memopd, Hugging Face model and tokenizer directories (pickled weights, remote
code), config YAML with Python tags, JSON inputs that are pickles.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memopd.errors import EXIT_BAD_INPUT, UnsafeFileError, UserError

REPO = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this calls exec: it writes the marker file (harmless, but code)."""

    def __init__(self, marker: Path):
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self):
        return (exec, (self.code,))


def _plant(path: Path, marker: Path, legit=None) -> None:
    """`path` becomes a torch file holding the payload (next to legit-looking state)."""
    torch.save({"state": legit if legit is not None else {"step": 1}, "payload": _Payload(marker)}, path)


def test_the_payload_is_live(tmp_path):
    """The control: the plain unpickler runs the payload (so its absence below means something)."""
    marker = tmp_path / "ran"
    _plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


def _plain_checkpoint(tmp_path):
    from memopd.models import tiny_causal_lm
    from memopd.trainer.backend import make_backend

    model = tiny_causal_lm("qwen2", vocab_size=32, seed=0)
    backend = make_backend(model, lr=1e-3, total_steps=4)
    ck = tmp_path / "ck"
    backend.save_checkpoint(str(ck), client_state={"step": 2, "config": {"seed": 0}})
    return backend, ck


def test_checkpoint_files_are_json_and_weights_only(tmp_path):
    backend, ck = _plain_checkpoint(tmp_path)
    assert sorted(os.listdir(ck)) == ["backend.pt", "client_state_rank0.json"]
    assert json.loads((ck / "client_state_rank0.json").read_text()) == {"step": 2, "config": {"seed": 0}}
    assert torch.serialization.get_unsafe_globals_in_checkpoint(ck / "backend.pt") == []
    assert backend.load_checkpoint(str(ck)) == {"step": 2, "config": {"seed": 0}}


@pytest.mark.parametrize("planted", ["backend.pt", "legacy client state", "client state json"])
def test_planted_checkpoint_file_runs_nothing(tmp_path, planted):
    backend, ck = _plain_checkpoint(tmp_path)
    marker = tmp_path / "ran"
    if planted == "backend.pt":
        state = torch.load(ck / "backend.pt", weights_only=True)
        _plant(ck / "backend.pt", marker, legit=state)
        match = r"backend\.pt: refused to load: it needs more than tensors and plain values"
    elif planted == "legacy client state":  # what an older memopd wrote, now carrying a payload
        (ck / "client_state_rank0.json").unlink()
        _plant(ck / "client_state_rank0.pt", marker)
        match = r"client_state_rank0\.pt: a checkpoint of an older memopd.*--overwrite"
    else:  # a pickle under the JSON name
        _plant(ck / "client_state_rank0.json", marker)
        match = r"client_state_rank0\.json: not a JSON client state"
    with pytest.raises(UnsafeFileError, match=match) as e:
        backend.load_checkpoint(str(ck))
    assert not marker.exists()
    assert "\n" not in str(e.value)


def test_legacy_pickled_client_state_is_refused_even_when_harmless(tmp_path):
    backend, ck = _plain_checkpoint(tmp_path)
    (ck / "client_state_rank0.json").unlink()
    torch.save({"step": 2, "config": {}}, ck / "client_state_rank0.pt")
    with pytest.raises(UnsafeFileError, match="no longer unpickles checkpoint files.*Start the run over"):
        backend.load_checkpoint(str(ck))


def test_only_plain_values_come_out_of_a_checkpoint_file(tmp_path):
    """The weights-only unpickler admits a few torch types (dtype, device); memopd's own
    state holds none, so they are refused too."""
    from memopd.trainer.safe_load import load_tensor_file

    torch.save({"w": torch.zeros(2), "dtype": torch.float32}, tmp_path / "f.pt")
    with pytest.raises(UnsafeFileError, match="holds a torch.dtype"):
        load_tensor_file(str(tmp_path / "f.pt"))
    (tmp_path / "g.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UnsafeFileError, match="not a readable torch checkpoint file"):
        load_tensor_file(str(tmp_path / "g.pt"))


def test_resume_of_a_planted_run_directory_is_one_line_exit_2(sft_dirs, tmp_path, capsys):
    """End to end, as the attack was done: payload in checkpoints/step_N/actor's client
    state, the manifest's sha256 recomputed; `memopd train --resume` runs nothing."""
    from memopd.cli import main
    from memopd.files import write_manifest
    from memopd.trainer.rundir import newest_complete_checkpoint

    run = tmp_path / "run"
    args = [f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}", f"run_dir={run}", "steps=1", "checkpoint_every=1",
            "tasks_per_step=2", "group_size=2", "train_k=[1]", "eval_k=[1]", "eval_tasks=1", "ppo_epochs=1",
            "minibatches=1", "progress=false", f"cache_dir={tmp_path / 'cache'}"]
    assert main(["train", *args]) == 0
    (step, path), _ = newest_complete_checkpoint(run / "checkpoints")
    manifest = json.loads((Path(path) / "memopd_manifest.json").read_text())
    marker = tmp_path / "ran"
    (Path(path) / "actor" / "client_state_rank0.json").unlink()
    _plant(Path(path) / "actor" / "client_state_rank0.pt", marker)
    write_manifest(path, step=manifest["step"], config=manifest["config"])
    capsys.readouterr()
    assert main(["train", "--resume", *args]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert not marker.exists()
    assert len(err.splitlines()) == 1 and "client_state_rank0.pt: a checkpoint of an older memopd" in err, err


_DS_WORKER = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from _dist_worker_backend import HPARAMS, SCENARIOS, make_model
    from memopd.trainer.backend import make_backend
    from memopd.errors import UnsafeFileError
    ck, marker = sys.argv[1], sys.argv[2]
    b = make_backend(make_model(0), deepspeed_config=SCENARIOS["zero2"], **HPARAMS)
    b.save_checkpoint(ck, client_state={{"step": 1}})
    assert b.load_checkpoint(ck) == {{"step": 1}}  # DeepSpeed's own files load through the safe reader
    files = sorted(f for f in os.listdir(os.path.join(ck, "backend")) if f.endswith(".pt"))
    for name in files:
        path = os.path.join(ck, "backend", name)
        good = open(path, "rb").read()

        class Payload:
            def __reduce__(self):
                return (exec, ("open(%r, 'w').write('ran')" % marker,))
        legit = torch.load(path, weights_only=False)  # our own file, to plant next to
        torch.save({{**legit, "payload": Payload()}}, path)
        try:
            b.load_checkpoint(ck)
        except UnsafeFileError as e:
            print("REFUSED", name, str(e).splitlines()[0][:200], flush=True)
        else:
            print("LOADED", name, flush=True)
        open(path, "wb").write(good)
""")


def test_planted_deepspeed_checkpoint_files_run_nothing(tmp_path):
    pytest.importorskip("deepspeed")
    marker = tmp_path / "ran"
    script = tmp_path / "ds_worker.py"
    script.write_text(_DS_WORKER.format(tests=str(REPO / "tests")))
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), str(marker)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    said = [x for x in res.stdout.splitlines() if x.startswith(("REFUSED", "LOADED"))]
    # ZeRO-2 on one rank: the model states and the optimiser states
    assert len(said) == 2 and all(x.startswith("REFUSED") for x in said), said
    assert all("refused to load" in x for x in said), said
    assert not marker.exists()


def _hf_dir(tmp_path):
    from memopd.models import tiny_causal_lm

    d = tmp_path / "model"
    tiny_causal_lm("qwen2", vocab_size=32, seed=0).save_pretrained(d)
    return d


def test_planted_hf_weights_and_remote_code_run_nothing(tmp_path):
    from memopd.models import load_local_model

    marker = tmp_path / "ran"
    d = _hf_dir(tmp_path)
    # pickled weights instead of safetensors
    sd = dict(load_local_model(d).state_dict())
    (d / "model.safetensors").unlink()
    _plant(d / "pytorch_model.bin", marker, legit=sd)
    with pytest.raises(UnsafeFileError, match="student: refused to load the weights in .*use safetensors"):
        load_local_model(d, what="student")
    assert not marker.exists()

    # remote code named by the config: never imported (trust_remote_code stays off)
    d2 = _hf_dir(tmp_path / "b")
    (d2 / "evil_model.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil_model.Evil", "AutoConfig": "evil_model.EvilConfig"}
    (d2 / "config.json").write_text(json.dumps(cfg))
    try:
        load_local_model(d2, what="student")
    except UserError:
        pass
    assert not marker.exists()


def test_planted_tokenizer_remote_code_runs_nothing(tmp_path, sft_dirs):
    import shutil

    from memopd.env.qa.tokenizer import TokenizerError, load_tokenizer

    marker = tmp_path / "ran"
    d = tmp_path / "tok"
    shutil.copytree(sft_dirs[0], d)
    (d / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": ["evil_tok.Evil", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    try:
        load_tokenizer(d)
    except (TokenizerError, UserError, ValueError):
        pass
    assert not marker.exists()


def test_config_yaml_with_python_tags_runs_nothing(tmp_path):
    from memopd.trainer.config import ConfigError, TrainConfig

    marker = tmp_path / "ran"
    y = tmp_path / "evil.yaml"
    y.write_text(f"steps: 2\nseed: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError):
        TrainConfig.load(str(y), [])
    with pytest.raises(ConfigError):
        TrainConfig.load(None, [f"seed=!!python/object/apply:os.system ['touch {marker}']"])
    assert not marker.exists()


def test_json_inputs_that_are_pickles_run_nothing(tmp_path, capsys):
    """Trajectory files, run metrics (plot) and an SFT checkpoint's environment metadata
    are read as JSON only: a pickle there is bad input."""
    from memopd.cli import main

    marker = tmp_path / "ran"
    _plant(tmp_path / "trajs.jsonl", marker)
    assert main(["pack", "--trajectories", str(tmp_path / "trajs.jsonl")]) == EXIT_BAD_INPUT
    run = tmp_path / "run"
    run.mkdir()
    _plant(run / "metrics.jsonl", marker)
    pytest.importorskip("matplotlib")
    assert main(["plot", str(run)]) == EXIT_BAD_INPUT
    assert not marker.exists()
    for line in capsys.readouterr().err.strip().splitlines():
        assert line.startswith(("memopd pack: error:", "memopd plot: error:")), line
