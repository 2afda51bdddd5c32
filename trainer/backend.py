"""Optimisation backend of the trainer: plain PyTorch (1..N processes) or DeepSpeed ZeRO 1/2/3.

The training loop only talks to a `TrainBackend` made by `make_backend(model, ...)`: forward
through `backend.module`, `backward(loss, last_micro_batch=...)` once per micro-batch (the
same count on every rank), then `step()`. Both backends average gradients over ranks and
never divide by the number of micro-batches, so each micro-batch's loss is its token-loss
sum / the global token count of the step * world_size. Both checkpoint collectively
(`save_checkpoint` / `load_checkpoint`) and read checkpoint files without running code.

Around it: process groups and collectives in collectives.py, AdamW and the LR schedule in
memopd/optim.py, the DeepSpeed config checks in deepspeed_config.py, the safe checkpoint
reader in safe_load.py. The user guide (launching, the loss-scaling and micro-batch
contract, DeepSpeed config rules, ZeRO-3, DeepSpeed on CPU, checkpoints) is docs/deepspeed.md.
"""
from __future__ import annotations

import contextlib
import json
import math
import os

import torch
import torch.distributed as dist

from memopd.optim import build_lr_lambda, build_optimizer

from .collectives import DistInfo, all_reduce, barrier, broadcast, ensure_process_group, init_distributed, world_size_hint
from .deepspeed_config import resolve_deepspeed_config
from .safe_load import load_tensor_file

__all__ = ["TrainBackend", "PlainBackend", "DeepSpeedBackend", "make_backend", "master_weights"]

# Plain-backend gradient all-reduce bucket size (elements): few collectives, bounded extra memory.
_BUCKET_NUMEL = 8 * 1024 * 1024


def _sync_lr_from_scheduler(optimizer: torch.optim.Optimizer, scheduler) -> None:
    # LRScheduler.load_state_dict restores last_epoch/_last_lr but not the param groups'
    # "lr", which a fresh scheduler set to lambda(0); the next step must use lambda(last_epoch).
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


# --------------------------------------------------------------------------- base


class TrainBackend:
    """Interface the training loop uses; the contract is in docs/deepspeed.md §1."""

    module: torch.nn.Module
    unwrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    rank: int = 0
    world_size: int = 1
    max_grad_norm: float | None = None

    def __init__(self) -> None:
        self._n_micro = 0  # backward calls since the last step()
        self._boundary = False  # last backward was marked last_micro_batch

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        for p in self.unwrapped.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def synced_gpus(self) -> bool:
        """Whether HF generate must run in lockstep across ranks (ZeRO-3, world_size > 1)."""
        return False

    @property
    def global_step(self) -> int:
        """Optimiser steps taken (restored by load_checkpoint)."""
        return int(self.scheduler.last_epoch)

    # micro-batch bookkeeping shared by both backends, so a loop bug shows on CPU too
    def _before_backward(self, last_micro_batch: bool) -> None:
        if self._boundary:
            raise RuntimeError("backward() after a last_micro_batch=True backward; call step() first")
        self._n_micro += 1
        self._boundary = bool(last_micro_batch)

    def _before_step(self) -> None:
        if not self._boundary:
            raise RuntimeError(
                "step() needs a preceding backward(..., last_micro_batch=True) "
                f"({self._n_micro} backward call(s) since the last step, none marked last)"
            )

    def _after_step(self) -> None:
        self._n_micro = 0
        self._boundary = False

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        raise NotImplementedError

    def step(self) -> float:
        raise NotImplementedError

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a new tensor; the input is not modified); identity for one rank."""
        if self.world_size == 1:
            return t
        return all_reduce(t.detach().clone())

    def all_reduce_max(self, x: float | int) -> float | int:
        """Max of a Python number over ranks (NaN counts as missing; all NaN gives NaN)."""
        if self.world_size == 1:
            return x
        v = float(x)
        t = torch.tensor([-math.inf if math.isnan(v) else v], dtype=torch.float64)
        r = float(all_reduce(t, op=dist.ReduceOp.MAX))
        if isinstance(x, int):
            return int(r)
        return math.nan if r == -math.inf else r

    def barrier(self) -> None:
        if self.world_size > 1:
            barrier()

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, sd: dict) -> None:
        raise NotImplementedError

    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        raise NotImplementedError

    def load_checkpoint(self, path: str) -> dict | None:
        raise NotImplementedError

    def save_pretrained(self, path: str) -> None:
        raise NotImplementedError

    def copy_weights_to(self, target: torch.nn.Module) -> None:
        """Collective: copy the full current weights into `target`, a plain module of the
        same architecture (names match `unwrapped`). Rollouts and no-grad scoring run on
        such a copy under ZeRO-3, where ranks make different numbers of forward calls and
        the engine's per-forward gathers would deadlock."""
        src = dict(self.unwrapped.named_parameters())
        with torch.no_grad():
            for name, p in target.named_parameters():
                with self._full_parameter(src[name]):
                    p.copy_(src[name].detach().to(p.device))
            bufs = dict(self.unwrapped.named_buffers())
            for name, b in target.named_buffers():
                if name in bufs:
                    b.copy_(bufs[name].to(b.device))

    def _full_parameter(self, param: torch.nn.Parameter):
        """Context in which `param` holds its full value (a no-op unless partitioned)."""
        return contextlib.nullcontext()

    # per-rank client state, same layout for both backends: JSON, so loading runs no code
    def _save_client_state(self, path: str, client_state: dict | None) -> None:
        from memopd.files import atomic_write_text

        os.makedirs(path, exist_ok=True)
        # strict: a value JSON cannot hold is a bug here, not something to stringify
        text = json.dumps(client_state if client_state is not None else {}, allow_nan=False)
        atomic_write_text(os.path.join(path, f"client_state_rank{self.rank}.json"), text + "\n")

    def _load_client_state(self, path: str) -> dict | None:
        from memopd.errors import UnsafeFileError

        f = os.path.join(path, f"client_state_rank{self.rank}.json")
        legacy = os.path.join(path, f"client_state_rank{self.rank}.pt")
        if not os.path.exists(f):
            if os.path.exists(legacy):
                raise UnsafeFileError(
                    f"{legacy}: a checkpoint of an older memopd, whose client state is a pickle; memopd no "
                    "longer unpickles checkpoint files (a crafted one runs code when loaded). Start the run "
                    "over with --overwrite (or finish it with the memopd version that wrote it)")
            return None
        try:
            with open(f) as fh:
                state = json.load(fh)
        except ValueError as e:
            raise UnsafeFileError(f"{f}: not a JSON client state ({e}); the checkpoint is damaged") from None
        if not isinstance(state, dict):
            raise UnsafeFileError(f"{f}: the client state is a {type(state).__name__}, not a JSON object")
        return state


# --------------------------------------------------------------------------- plain


class PlainBackend(TrainBackend):
    """torch AdamW + LambdaLR; with a process group of N > 1, gradients are averaged in step().

    Instead of DDP (whose no_sync() must wrap the *forward*, while the loop only says
    which micro-batch is last at backward time), gradients accumulate locally and are
    all-reduced once per optimiser step in flat buckets, the same arithmetic as DDP
    with no_sync on all but the last micro-batch (without comm/compute overlap).
    Parameters are broadcast from rank 0 at construction, as DDP does.

    `masters` (from `master_weights`): fp32 copies of the model's bf16/fp16 parameters,
    which the optimiser then holds instead of them. step() moves each gradient into its
    copy (fp32), averages, clips and updates there, and rounds the result back into the
    model; checkpoints keep the copies, so a resumed run continues from the same fp32 values.
    """

    def __init__(self, model, optimizer, scheduler, *, max_grad_norm: float | None, info: DistInfo,
                 masters: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] | None = None):
        super().__init__()
        self.module = self.unwrapped = model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.rank, self.world_size = info.rank, info.world_size
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._masters = masters or []
        if self.world_size > 1:
            with torch.no_grad():
                for p in model.parameters():
                    broadcast(p.data, src=0)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        self._before_backward(last_micro_batch)
        loss.backward()

    def _average_grads(self) -> None:
        grads = []
        for p in self._params:
            if p.grad is None:  # every rank must flatten the same layout
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket: list[torch.Tensor] = []
        numel = 0
        for g in grads + [None]:
            flush = g is None or (bucket and (numel + g.numel() > _BUCKET_NUMEL
                                              or g.dtype != bucket[0].dtype or g.device != bucket[0].device))
            if flush and bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                all_reduce(flat)
                flat.div_(self.world_size)
                for b, f in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(f.view_as(b))
                bucket, numel = [], 0
            if g is not None:
                bucket.append(g)
                numel += g.numel()

    def step(self) -> float:
        self._before_step()
        for p, m in self._masters:  # low-precision gradients into their fp32 copies
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if self.world_size > 1:
            self._average_grads()
        clip = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._params, clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._copy_masters_to_model()
        self._after_step()
        return float(norm)

    def _copy_masters_to_model(self) -> None:
        with torch.no_grad():
            for p, m in self._masters:
                p.copy_(m)

    def state_dict(self) -> dict:
        """Optimiser + scheduler state (moments, step counters), not the weights."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.world_size,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        _sync_lr_from_scheduler(self.optimizer, self.scheduler)
        self._after_step()

    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        """Collective: weights + optimiser + scheduler (main rank) and per-rank client_state."""
        self._save_client_state(path, client_state)
        if self.is_main:
            state = self.state_dict()
            state["model"] = self.unwrapped.state_dict()
            if self._masters:
                state["masters"] = [m.detach() for _, m in self._masters]
            from memopd.files import atomic_file

            with atomic_file(os.path.join(path, "backend.pt")) as tmp:  # never a half-written file
                torch.save(state, tmp)
        self.barrier()

    def load_checkpoint(self, path: str) -> dict | None:
        f = os.path.join(path, "backend.pt")
        if not os.path.exists(f):
            raise FileNotFoundError(f"no plain-backend checkpoint at {f}")
        # replicated state: loading under another world size is fine (client_state is per rank)
        state = load_tensor_file(f)
        with torch.no_grad():
            self.unwrapped.load_state_dict(state["model"])
            saved = state.get("masters")
            if saved is not None and len(saved) != len(self._masters):
                raise ValueError(f"{f}: holds {len(saved)} fp32 master weights, this model has {len(self._masters)} "
                                 "low-precision parameters (was it saved with another dtype?)")
            for i, (p, m) in enumerate(self._masters):  # without saved copies: from the loaded weights
                m.copy_(saved[i] if saved is not None else p)
        # tensors of the optimiser state are moved to the params' device by Optimizer.load_state_dict
        self.load_state_dict(state)
        return self._load_client_state(path)

    def save_pretrained(self, path: str) -> None:
        """Collective when world_size > 1 (barrier); the main rank writes the HF checkpoint."""
        if self.is_main:
            self.unwrapped.save_pretrained(path)
        self.barrier()


# --------------------------------------------------------------------------- DeepSpeed


def _import_deepspeed():
    if not torch.cuda.is_available():
        # must precede DeepSpeed's accelerator detection (first get_accelerator() call)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("deepspeed_config given but deepspeed is not installed "
                          "(pip install 'memopd[deepspeed]')") from e
    return deepspeed


def _deepspeed_checkpoint_types() -> tuple:
    """The classes DeepSpeed pickles into its ZeRO optimiser-state files (measured on
    ZeRO 1/2/3 checkpoints of DeepSpeed 0.19: the loss scaler, the fragment addresses of
    ZeRO 1/2 and the stage enum); plain data holders whose construction runs no user code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)


def _attach_deepspeed_comm(deepspeed, backend: str) -> None:
    """Start DeepSpeed's comm layer on our existing process group."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu" and os.environ.get("MEMOPD_DS_SHM_COMM", "0") != "1":
        # Skip the JIT build of the shm all-reduce op (inference-only, ~2 min): DeepSpeed
        # builds it only when its probe dict says compatible, and documents that edits to
        # that dict persist for the process.
        try:
            compat = deepspeed.ops.__compatible_ops__
            if isinstance(compat, dict):
                compat["deepspeed_shm_comm"] = False
        except Exception:  # noqa: BLE001 older/newer layouts: worst case the op gets built once and cached
            pass
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedBackend(TrainBackend):
    """DeepSpeed engine with ZeRO 1/2/3 around a torch AdamW + LambdaLR built by make_backend."""

    def __init__(self, model, optimizer, scheduler, *, config: dict, max_grad_norm: float | None):
        super().__init__()
        deepspeed = _import_deepspeed()
        info = ensure_process_group()
        _attach_deepspeed_comm(deepspeed, info.backend)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.engine = engine
        self.module = engine  # forward through the engine: it registers ZeRO's backward hooks
        self.unwrapped = engine.module
        self.optimizer, self.scheduler = optimizer, scheduler  # the torch objects ZeRO wraps
        self.config = config
        self.zero_stage = int(config["zero_optimization"]["stage"])
        self.max_grad_norm = max_grad_norm
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    @property
    def synced_gpus(self) -> bool:
        return self.zero_stage == 3 and self.world_size > 1

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        self._before_backward(last_micro_batch)
        # set before backward: the ZeRO backward prologue reads it to decide reduce/accumulate
        self.engine.set_gradient_accumulation_boundary(bool(last_micro_batch))
        # gradient_accumulation_steps is 1, so scale_wrt_gas would be a no-op; be explicit
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self._before_step()
        self.engine.step()  # boundary: reduce/clip/AdamW/LambdaLR/zero grads
        self._after_step()
        norm = self.engine.get_global_grad_norm()  # computed before clipping
        return float("nan") if norm is None else float(norm)

    def state_dict(self) -> dict:
        raise NotImplementedError("ZeRO optimiser state is partitioned across ranks; "
                                  "use save_checkpoint(dir) / load_checkpoint(dir)")

    def load_state_dict(self, sd: dict) -> None:
        raise NotImplementedError("use load_checkpoint(dir) with the DeepSpeed backend")

    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        """Collective: DeepSpeed checkpoint (tag 'backend') + per-rank client_state."""
        self._save_client_state(path, client_state)
        self.engine.save_checkpoint(path, tag="backend", client_state={})
        self.barrier()

    def load_checkpoint(self, path: str) -> dict | None:
        # DeepSpeed's own reader unpickles with weights_only=False: read its files with the
        # weights-only unpickler instead, admitting only the DeepSpeed classes it writes
        safe = _deepspeed_checkpoint_types()
        self.engine.checkpoint_engine.load = lambda f, map_location=None: load_tensor_file(f, safe)
        load_path, _ = self.engine.load_checkpoint(path, tag="backend")
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint (tag 'backend') under {path}")
        _sync_lr_from_scheduler(self.optimizer, self.scheduler)
        self._after_step()
        return self._load_client_state(path)

    def _full_parameter(self, param: torch.nn.Parameter):
        if self.zero_stage != 3:
            return super()._full_parameter(param)
        # one tensor at a time: peak memory stays at one gathered parameter
        return _import_deepspeed().zero.GatheredParameters([param], modifier_rank=None)

    def save_pretrained(self, path: str) -> None:
        """Collective (ZeRO-3 gathers layer by layer to rank 0); the main rank writes."""
        state_dict = None
        if self.zero_stage == 3:
            # weights in the training dtype (fp32 master copies stay in the optimiser)
            state_dict = self.engine._zero3_consolidated_16bit_state_dict()
        if self.is_main:
            self.unwrapped.save_pretrained(path, state_dict=state_dict)
        self.barrier()


# --------------------------------------------------------------------------- factory


def master_weights(model: torch.nn.Module):
    """(pairs, held): an fp32 copy of each trainable bf16/fp16 parameter of `model`, paired
    with it, and a module of the parameters the optimiser should hold (those copies, and
    the fp32 parameters themselves), in `model.named_parameters()` order. Without
    low-precision parameters: ([], model)."""
    pairs, held = [], []
    for _, p in model.named_parameters():  # de-duplicates tied weights
        if not p.requires_grad:
            continue
        if p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16):
            m = torch.nn.Parameter(p.detach().float().clone())
            pairs.append((p, m))
            held.append(m)
        else:
            held.append(p)
    return (pairs, torch.nn.ParameterList(held)) if pairs else ([], model)


def make_backend(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    warmup_steps: int = 0,
    total_steps: int,
    max_grad_norm: float | None = 1.0,
    deepspeed_config: dict | str | os.PathLike | None = None,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> TrainBackend:
    """Plain backend when deepspeed_config is None, else DeepSpeed ZeRO (stage from the config).

    Calls init_distributed() (no-op for one process). Place the model on its device
    (``cuda:LOCAL_RANK``) before calling for the plain backend; DeepSpeed moves it itself.
    A bf16/fp16 model trains with fp32 master weights (`master_weights`) in the plain
    backend, as in DeepSpeed's bf16 mode.
    The train/eval mode of the model is left as it is (use backend.train()).
    Extra over the base interface: `schedule` ("constant" | "cosine" | "linear") and
    `min_lr_ratio` (floor of the decaying schedules).
    """
    lr_lambda = build_lr_lambda(warmup_steps, total_steps, schedule, min_lr_ratio)
    cfg = None
    if deepspeed_config is not None:
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        # validate before touching any process group, so config errors are cheap and clear
        cfg = resolve_deepspeed_config(
            deepspeed_config,
            max_grad_norm=max_grad_norm,
            world_size=world_size_hint(),
            on_cpu=not torch.cuda.is_available(),
            model_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
        )
    masters, held = ([], model) if cfg is not None else master_weights(model)
    optimizer = build_optimizer(held, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if cfg is None:
        info = init_distributed()
        return PlainBackend(model, optimizer, scheduler, max_grad_norm=max_grad_norm, info=info, masters=masters)
    return DeepSpeedBackend(model, optimizer, scheduler, config=cfg, max_grad_norm=max_grad_norm)
