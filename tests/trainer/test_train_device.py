"""Where and in what precision the trainer trains (TrainConfig `device`, `dtype`; trainer/device.py).

- The placement logic puts the student, its reference copy, the critic (value head
  included), the teacher and the optimiser's fp32 master weights on the resolved device:
  checked with a real `Trainer` whose device resolves to `meta` (no memory, no GPU).
- bf16 trains with fp32 master weights: an AdamW step below half a bf16 ulp moves the
  master copy (and, summed, the weight), where pure bf16 weights never move; the copies
  survive a checkpoint round trip exactly.
- `device=cuda` where torch sees no CUDA device is one line and exit code 2, before the
  run directory is written; `memopd train device=cpu dtype=bf16 steps=2` runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from memopd.cli import main
from memopd.models import tiny_causal_lm
from memopd.trainer.backend import make_backend
from memopd.trainer.config import ConfigError, TrainConfig
from memopd.trainer.settings import PPOSettings

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")


def _trainer(monkeypatch, device: str, dtype: str, **kw):
    from memopd.trainer import loop

    if device == "meta":  # the resolved device only: every placement after it is the trainer's own
        monkeypatch.setattr(loop, "resolve_device", lambda *a, **k: torch.device("meta"))
    cfg = TrainConfig(steps=1, dtype=dtype, device="cpu", arm="memopd", ppo=PPOSettings(ref_kl_coef=0.05),
                      progress=False, **kw).validate()
    student = tiny_causal_lm(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1)
    teacher = tiny_causal_lm(vocab_size=64, hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=1, seed=2)
    return loop.Trainer(cfg, student_lm=student, teacher_lm=teacher, env=None, tasks=None, log=lambda *_: None)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_model_and_master_weight_is_placed_on_the_device(monkeypatch, dtype):
    tr = _trainer(monkeypatch, "meta", dtype)
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    models = {"actor": tr.actor.unwrapped, "critic": tr.critic.unwrapped, "reference": tr.ref_lm,
              "teacher": tr.teacher_lm}
    for name, m in models.items():
        assert m is not None, name
        for pname, t in [*m.named_parameters(), *m.named_buffers()]:
            assert t.device.type == "meta", f"{name}.{pname} on {t.device}"
        for pname, p in m.named_parameters():
            # the critic's one-row value head stays fp32 (it casts its input)
            expected = torch.float32 if pname.startswith("value_head.") else want
            assert p.dtype == expected, f"{name}.{pname} is {p.dtype}"
    assert tr.actor.device.type == "meta" and tr.device.type == "meta"
    for backend in (tr.actor, tr.critic):
        held = [p for g in backend.optimizer.param_groups for p in g["params"]]
        assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in held)
        low = [p for p in backend.unwrapped.parameters() if p.dtype == torch.bfloat16]
        assert len(backend._masters) == len(low) and (len(low) > 0) == (dtype == "bf16")
        assert len(held) == sum(1 for p in backend.unwrapped.parameters() if p.requires_grad)


def test_cpu_placement_is_real_and_buffers_keep_their_dtype(monkeypatch):
    tr = _trainer(monkeypatch, "cpu", "bf16")
    lm = tr.actor.unwrapped.lm
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in lm.parameters())
    floating = [b for _, b in lm.named_buffers() if b.is_floating_point()]
    assert floating and all(b.dtype == torch.float32 for b in floating)  # the rotary frequencies stay fp32
    # every master starts as the exact fp32 value of its bf16 weight
    assert all(torch.equal(m.to(torch.bfloat16), p) for p, m in tr.actor._masters)


def test_bf16_updates_below_half_an_ulp_are_kept_by_the_master_weights():
    def run(masters: bool):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.fill_(1.0)  # bf16 ulp at 1.0: 2**-7 = 7.8e-3
        if masters:
            b = make_backend(lin, lr=1e-4, total_steps=100, max_grad_norm=None)
        else:  # pure bf16 weights: AdamW updates the bf16 parameters themselves
            from memopd.optim import build_optimizer

            b = build_optimizer(lin, lr=1e-4)
        x = torch.ones(2, 4, dtype=torch.bfloat16)
        for _ in range(60):
            loss = lin(x).float().sum()  # a constant gradient sign: Adam steps ~lr each time
            if masters:
                b.backward(loss, last_micro_batch=True)
                b.step()
            else:
                loss.backward()
                b.step()
                b.zero_grad()
        return lin, b

    pure, _ = run(False)
    assert torch.all(pure.weight == 1.0)  # every 1e-4 step rounded away: bf16 weights never move
    lin, b = run(True)
    (p, m), = b._masters
    assert torch.allclose(m, torch.full_like(m, 1.0 - 60e-4), atol=2e-4)  # 60 steps of ~lr kept in fp32
    assert torch.equal(p, m.to(torch.bfloat16)) and torch.all(p < 1.0)  # the weight is the rounded master


def test_master_weights_survive_a_checkpoint_exactly(tmp_path):
    def backend():
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 3).to(torch.bfloat16)
        return lin, make_backend(lin, lr=1e-3, total_steps=10)

    lin, b = backend()
    for _ in range(3):
        b.backward(lin(torch.randn(5, 8, dtype=torch.bfloat16)).float().pow(2).sum(), last_micro_batch=True)
        b.step()
    b.save_checkpoint(str(tmp_path / "ck"))
    lin2, b2 = backend()
    b2.load_checkpoint(str(tmp_path / "ck"))
    assert len(b2._masters) == 2
    for (_, m), (p2, m2) in zip(b._masters, b2._masters):
        assert torch.equal(m, m2) and torch.equal(p2, m2.to(torch.bfloat16))
        assert not torch.equal(m2, m2.to(torch.bfloat16).float())  # the fp32 digits the bf16 weight lacks


@pytest.mark.parametrize("override, msg", [
    ("device=gpu", "device must be one of auto, cpu, cuda, got 'gpu'"),
    ("dtype=fp16", "dtype must be one of fp32, bf16, got 'fp16'"),
])
def test_bad_device_or_dtype_is_one_line(capsys, override, msg):
    assert main(["train", override]) == 2
    assert msg in capsys.readouterr().err


@no_cuda
def test_device_cuda_without_cuda_is_refused_before_anything_is_written(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "MEMOPD_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "memopd.cli", "train", "device=cuda", "steps=1", f"run_dir={run_dir}",
                        f"cache_dir={cache}"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("memopd train: error: device=cuda but torch ") and "sees no CUDA device" in line, line
    assert not run_dir.exists() and not cache.exists()


@no_cuda
def test_trainer_refuses_device_cuda_without_cuda(monkeypatch):
    with pytest.raises(ConfigError, match="device=cuda but torch"):
        from memopd.trainer import loop

        cfg = TrainConfig(steps=1, device="cuda", arm="ppo", progress=False).validate()
        lm = tiny_causal_lm(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
        loop.Trainer(cfg, student_lm=lm, teacher_lm=None, env=None, tasks=None, log=lambda *_: None)


def test_memopd_train_bf16_on_cpu_runs_two_steps(sft_dirs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "device=cpu", "dtype=bf16", "steps=2", f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}",
               f"run_dir={run_dir}", "tasks_per_step=2", "group_size=2", "train_k=1", "eval_k=1", "eval_tasks=2",
               "ppo_epochs=1", "minibatches=2", "checkpoint_every=2", "progress=false"])
    assert rc == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    train_lines = [x for x in lines if "train/pg_loss" in x]
    assert [x["step"] for x in train_lines] == [1, 2]
    from memopd.rce import default_tolerance

    for x in train_lines:
        assert all(v == v for v in (x["train/pg_loss"], x["train/vf_loss"], x["train/entropy"]))  # no NaN
        assert x["train/kl_teacher"] > 0.0
        # sampling (HF forward with a KV cache) and the packed scoring forward agree to bf16's tolerance
        assert x["rce/max_dlogp_vs_sampling"] < default_tolerance(torch.bfloat16)
    from safetensors.torch import load_file

    final = load_file(str(next((run_dir / "final").glob("*.safetensors"))))
    assert {t.dtype for t in final.values() if t.is_floating_point()} == {torch.bfloat16}
    # the checkpoint holds the fp32 master weights next to the bf16 model
    from memopd.trainer.safe_load import load_tensor_file

    state = load_tensor_file(str(run_dir / "checkpoints" / "step_2" / "actor" / "backend.pt"))
    assert state["masters"] and all(m.dtype == torch.float32 for m in state["masters"])


@no_cuda
def test_audit_device_cuda_without_cuda_is_one_line(capsys):
    assert main(["audit", "--random", "--device", "cuda"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "device=cuda but torch " in line and "sees no CUDA device" in line, line


def test_audit_device_auto_runs_where_it_resolves(capsys):
    # auto on a host without a GPU is the CPU: the same audit as the default
    assert main(["audit", "--random", "--device", "auto", "--policy", "summary", "--num-trajectories", "2"]) == 0
    assert "aligned layouts PASS" in capsys.readouterr().out


def test_on_cuda_the_trainers_ops_pick_their_triton_kernels(monkeypatch):
    # what device=cuda buys: the trainer's modules ask for backend "auto", which is Triton for
    # CUDA tensors of the dtypes the kernels take (the rule is device-type only: no GPU needed)
    pytest.importorskip("triton")
    from memopd.ops._validate import choose_op_backend
    from memopd.ops.attention import _triton_refusal
    from memopd.ops.dispatch import choose_backend

    monkeypatch.delenv("MEMOPD_BACKEND", raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.empty(8, 2, 32, dtype=dtype)  # the SFT'd defaults' head dim
        assert choose_backend("packed_attention", "auto", cuda, triton_refusal=_triton_refusal(q)) == "triton"
        assert choose_backend("packed_attention", "auto", cpu, triton_refusal=_triton_refusal(q)) == "torch"
        for op in ("fused_linear_actor_loss", "fused_linear_distill", "fused_linear_logprob_entropy"):
            assert choose_op_backend(op, "auto", cuda, dtype) == "triton"
            assert choose_op_backend(op, "auto", cpu, dtype) == "torch"
