"""Tests of trainer/backend.py: plain and DeepSpeed ZeRO backends on CPU.

The multi-process checks launch tests/_dist_worker_backend.py under torchrun (2 ranks,
gloo) and once as a single process (one-rank DeepSpeed group), and compare the saved
HF weights, gradient norms and learning rates with a single-process plain-backend
reference computed here on the full global batch.
"""
from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

import _dist_worker_backend as W
import pytest
import torch
import torch.distributed as dist
from _launch import run_worker

from memopd.optim import build_lr_lambda
from memopd.trainer.backend import make_backend
from memopd.trainer.collectives import DistInfo, init_distributed
from memopd.trainer.deepspeed_config import resolve_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(W.__file__).resolve()
# float reassociation across ranks/partitions only; Adam would amplify any real mismatch.
# ZeRO-3's partitioned reduction (DeepSpeed 0.19.8) left 1.4e-6 on one weight of 1,024 after
# two steps, so 2e-6: still 500x below the movement every trained tensor must show (1e-3)
RTOL, ATOL = 1e-5, 2e-6

def _has_deepspeed() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None
    except Exception:  # noqa: BLE001 a broken install counts as absent
        return False


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- reference


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    """Single-process plain backend on the full global batch: snapshots after steps 2 and 4."""
    assert not (dist.is_available() and dist.is_initialized())
    backend = make_backend(W.make_model(0), **W.HPARAMS)
    assert backend.world_size == 1
    init = _params(backend.unwrapped)
    snaps = {}
    rec = W.train_steps(backend, range(W.STEPS),
                        on_step=lambda s: snaps.__setitem__(f"s{s + 1}", _params(backend.unwrapped)))
    return {"init": init, "s2": snaps["s2"], "s4": snaps["s4"], **rec}


def _load_hf(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    assert files, f"no safetensors in {path}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


# The exact gradient of the key bias is 0 (softmax ignores a shift shared by all scores),
# so it holds only float noise, which Adam's m / (sqrt(v) + eps) turns into O(lr * noise / eps)
# updates that differ with summation order; those tensors get a looser bound.
NOISE_ONLY = ("k_proj.bias",)
NOISE_ATOL = 2e-5


def _compare(got: dict, ref: dict, init: dict, what: str) -> None:
    # every trained tensor is in the checkpoint, equal up to float noise, and it moved
    # by much more than the tolerance (so the comparison is not vacuous)
    missing = set(ref) - set(got)
    assert not missing, f"{what}: missing {sorted(missing)[:5]}"
    moved = 0.0
    for k, r in ref.items():
        atol = NOISE_ATOL if k.endswith(NOISE_ONLY) else ATOL
        torch.testing.assert_close(got[k].float(), r.float(), rtol=RTOL, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")
        moved = max(moved, (r.float() - init[k].float()).abs().max().item())
    assert moved > 1e-3, f"{what}: parameters barely moved ({moved})"


def _launch(args: list[str], out: Path, timeout: int = 300) -> dict:
    run_worker(args, timeout)
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """plain (all-reduce), ZeRO-1, ZeRO-2, ZeRO-3 with 2 gloo ranks, one torchrun launch."""
    if not _has_deepspeed():
        pytest.skip("deepspeed not installed")
    out = tmp_path_factory.mktemp("dist2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(out)]
    return out, _launch(cmd, out)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """ZeRO-2 and ZeRO-3 in a single process without a launcher (one-rank group)."""
    if not _has_deepspeed():
        pytest.skip("deepspeed not installed")
    out = tmp_path_factory.mktemp("dist1")
    return out, _launch([sys.executable, str(WORKER), str(out), "zero2", "zero3"], out)


def _check_run(out: Path, results: dict, reference, name: str, world_size: int) -> None:
    r = results[name]
    assert r["world_size"] == world_size
    assert r["synced_gpus"] == (name == "zero3" and world_size > 1)
    assert r["lr"] == pytest.approx(reference["lr"], rel=1e-12)
    assert r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert r["resumed"]["grad_norm"] == pytest.approx(reference["grad_norm"][2:], rel=1e-5)
    assert r["resumed"]["lr"] == pytest.approx(reference["lr"][2:], rel=1e-12)
    _compare(_load_hf(out / f"{name}_s2"), reference["s2"], reference["init"], f"{name} after 2 steps")
    _compare(_load_hf(out / f"{name}_s4"), reference["s4"], reference["init"], f"{name} after 4 steps")
    resumed, uninterrupted = _load_hf(out / f"{name}_resumed"), _load_hf(out / f"{name}_s4")
    _compare(resumed, reference["s4"], reference["init"], f"{name} 2 + resume + 2")
    # resuming from the backend's checkpoint is bit-exact within the same backend
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted), f"{name}: resume not exact"


@pytest.mark.parametrize("name", ["plain", "zero1", "zero2", "zero3"])
def test_two_ranks_match_one_process(two_rank_run, reference, name):
    out, results = two_rank_run
    _check_run(out, results, reference, name, world_size=2)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_single_process_matches_plain(one_rank_run, reference, name):
    out, results = one_rank_run
    _check_run(out, results, reference, name, world_size=1)


# --------------------------------------------------------------------------- plain backend


def _toy_step(backend, seed: int, n_micro: int = 2) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, W.VOCAB, (4, 8), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    n = mask[:, 1:].sum()
    parts = torch.arange(4).tensor_split(n_micro)
    for i, mb in enumerate(parts):
        out = backend.module(input_ids=ids[mb])
        backend.backward(W.token_loss_sum(out.logits, ids[mb], mask[mb]) / n, last_micro_batch=i == n_micro - 1)
    return backend.step()


def test_warmup_then_constant_lr():
    backend = make_backend(W.make_model(0), lr=0.1, warmup_steps=4, total_steps=10)
    seen = []
    for s in range(7):
        seen.append(backend.lr())
        _toy_step(backend, s, n_micro=1)
    assert seen == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1])
    assert backend.global_step == 7


def test_schedule_shapes():
    f = build_lr_lambda(2, 6, "cosine", min_lr_ratio=0.0)
    assert [f(s) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.8535534, 0.5, 0.1464466], abs=1e-6)
    f = build_lr_lambda(0, 4, "linear", min_lr_ratio=0.2)
    assert [f(s) for s in range(4)] == pytest.approx([1.0, 0.8, 0.6, 0.4])
    assert build_lr_lambda(0, 3)(0) == 1.0  # no warmup: full rate from the first step
    with pytest.raises(ValueError, match="unknown schedule"):
        build_lr_lambda(0, 3, "step")


def test_step_returns_pre_clip_norm_and_clips():
    backend = make_backend(W.make_model(0), lr=1e-3, total_steps=4, max_grad_norm=0.1)
    seen = []
    backend.optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.append(torch.cat([p.grad.reshape(-1) for g in opt.param_groups for p in g["params"]]).norm()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, W.VOCAB, (2, 8), generator=g)
    out = backend.module(input_ids=ids)
    backend.backward(W.token_loss_sum(out.logits, ids, torch.ones_like(ids, dtype=torch.bool)) / 14, last_micro_batch=True)
    expected = torch.cat([p.grad.reshape(-1) for p in backend.unwrapped.parameters()]).norm().item()
    norm = backend.step()
    assert expected > 0.1
    assert norm == pytest.approx(expected, rel=1e-6)
    assert seen[0].item() == pytest.approx(0.1, rel=1e-5)  # the optimiser saw clipped gradients
    assert all(p.grad is None for p in backend.unwrapped.parameters())  # zeroed
    # clipping off: the norm is still reported
    backend = make_backend(W.make_model(0), lr=1e-3, total_steps=4, max_grad_norm=None)
    assert _toy_step(backend, 0) > 0.1


def _weights(backend):
    return {k: v.clone() for k, v in backend.unwrapped.state_dict().items()}


def test_plain_resume_is_exact(tmp_path):
    kw = dict(lr=1e-2, weight_decay=0.1, warmup_steps=3, total_steps=6, schedule="cosine")
    full = make_backend(W.make_model(0), **kw)
    for s in range(4):
        _toy_step(full, s)

    first = make_backend(W.make_model(0), **kw)
    for s in range(2):
        _toy_step(first, s)
    first.save_checkpoint(str(tmp_path / "ck"), client_state={"data_pos": 2})
    sd, weights = first.state_dict(), _weights(first)

    # directory API: fresh backend on a model with other weights
    resumed = make_backend(W.make_model(7), **kw)
    assert resumed.load_checkpoint(str(tmp_path / "ck")) == {"data_pos": 2}
    assert resumed.global_step == 2 and resumed.lr() == first.lr()
    # in-memory API: weights restored by the caller
    mem = make_backend(W.make_model(7), **kw)
    mem.unwrapped.load_state_dict(weights)
    mem.load_state_dict(sd)
    for b in (resumed, mem):
        for s in (2, 3):
            _toy_step(b, s)
        for k, v in _weights(full).items():
            assert torch.equal(_weights(b)[k], v), k
        assert b.lr() == full.lr()


def test_micro_batch_order_is_enforced():
    backend = make_backend(W.make_model(0), lr=1e-3, total_steps=2)
    ids = torch.randint(0, W.VOCAB, (1, 6))
    with pytest.raises(RuntimeError, match="last_micro_batch=True"):
        backend.step()
    backend.backward(backend.module(input_ids=ids).logits.sum(), last_micro_batch=False)
    with pytest.raises(RuntimeError, match="none marked last"):
        backend.step()
    backend.backward(backend.module(input_ids=ids).logits.sum(), last_micro_batch=True)
    with pytest.raises(RuntimeError, match="call step"):
        backend.backward(backend.module(input_ids=ids).logits.sum(), last_micro_batch=True)
    backend.step()


def test_micro_batch_split_does_not_change_the_step():
    a = make_backend(W.make_model(0), lr=1e-2, total_steps=2)
    b = make_backend(W.make_model(0), lr=1e-2, total_steps=2)
    na, nb = _toy_step(a, 5, n_micro=1), _toy_step(b, 5, n_micro=4)
    assert na == pytest.approx(nb, rel=1e-5)
    wa, wb = _weights(a), _weights(b)
    for k, v in wa.items():
        atol = NOISE_ATOL if k.endswith(NOISE_ONLY) else ATOL
        torch.testing.assert_close(wb[k], v, rtol=RTOL, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def test_all_reduce_sum_identity_single_process():
    backend = make_backend(W.make_model(0), lr=1e-3, total_steps=1)
    t = torch.tensor(3.0)
    assert backend.all_reduce_sum(t).item() == 3.0 and backend.is_main and backend.rank == 0


# --------------------------------------------------------------------------- launching / config


def test_init_distributed_single_process_is_noop(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert init_distributed() == DistInfo(0, 1, 0, None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed() == DistInfo(0, 1, 0, None)
    assert not dist.is_initialized()


def test_init_distributed_needs_launcher_env(monkeypatch):
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="RANK, MASTER_ADDR, MASTER_PORT not set"):
        init_distributed()


def _resolve(cfg, **kw):
    return resolve_deepspeed_config(cfg, **{"max_grad_norm": 1.0, "world_size": 2, "on_cpu": True, **kw})


def test_deepspeed_config_defaults_are_filled_not_overridden(tmp_path):
    user = {"zero_optimization": {"stage": 2}}
    cfg = _resolve(user)
    assert user == {"zero_optimization": {"stage": 2}}  # caller's dict untouched
    assert cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["gradient_accumulation_steps"] == 1
    assert cfg["gradient_clipping"] == 1.0
    assert _resolve({"zero_optimization": {"stage": 3}}, max_grad_norm=None)["gradient_clipping"] == 0.0
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8,
                             "gradient_clipping": 1.0, "bf16": {"enabled": True}}))
    cfg = _resolve(str(p))
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["bf16"] == {"enabled": True}
    for name in ("ds_zero2.json", "ds_zero3.json"):
        _resolve(str(REPO / "trainer" / "configs" / name))


@pytest.mark.parametrize("cfg, match", [
    ({"zero_optimization": {"stage": 5}}, "unknown/unsupported ZeRO stage 5"),
    ({"zero_optimization": {"stage": "2"}}, "unknown/unsupported ZeRO stage '2'"),
    ({"zero_optimization": {"stage": 0}}, "stage 0 is plain data parallelism"),
    ({"zero_optimization": {}}, "unknown/unsupported ZeRO stage 0"),
    ({"train_batch_size": 2}, "no zero_optimization section"),
])
def test_unknown_zero_stage(cfg, match):
    with pytest.raises(ValueError, match=match):
        _resolve(cfg)


@pytest.mark.parametrize("extra, match", [
    ({"fp16": {"enabled": True}}, "fp16 is enabled .* no CUDA device"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
    ({"gradient_clipping": 2.0}, "gradient_clipping=2.0 .* conflicts with max_grad_norm=1.0"),
    ({"optimizer": {"type": "Adam"}}, "'optimizer' section"),
    ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}, "train_batch_size=6 != "),
    ({"train_batch_size": 3}, "not divisible by world_size=2"),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
])
def test_conflicting_deepspeed_config(extra, match):
    with pytest.raises(ValueError, match=match):
        _resolve({"zero_optimization": {"stage": 2}, **extra})


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is only a conflict on CPU")
def test_make_backend_validates_before_any_process_group():
    model = W.make_model(0)
    with pytest.raises(ValueError, match="fp16 is enabled"):
        make_backend(model, lr=1e-3, total_steps=1,
                     deepspeed_config={"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match="model is bfloat16"):
        make_backend(model.to(torch.bfloat16), lr=1e-3, total_steps=1,
                     deepspeed_config={"zero_optimization": {"stage": 3}})
    assert not (dist.is_available() and dist.is_initialized())


def test_worker_helper_is_not_collected(request):
    patterns = request.config.getini("python_files")
    assert not any(fnmatch.fnmatch(WORKER.name, p) for p in patterns)
