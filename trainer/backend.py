"""Optimisation backend of the trainer: plain PyTorch (1..N processes) or DeepSpeed ZeRO 1/2/3.

The training loop only talks to a `TrainBackend` made by `make_backend(model, ...)`: forward
through `backend.module`, `backward(loss, last_micro_batch=...)` once per micro-batch (the
same count on every rank), then `step()`. Both backends average gradients over ranks and
never divide by the number of micro-batches, so each micro-batch's loss is its token-loss
sum / the global token count of the step * world_size. Also here: `init_distributed()`,
the collectives every part of the trainer uses (`all_reduce`, `broadcast`, `barrier`; CPU
tensors go through a gloo side group when the default group is NCCL), checkpointing
(`save_checkpoint` / `load_checkpoint`, collective), AdamW + LambdaLR, and the DeepSpeed
config checks (`resolve_deepspeed_config`).

The user guide (launching, the loss-scaling and micro-batch contract, DeepSpeed config
rules, ZeRO-3, DeepSpeed on CPU, checkpoints) is docs/deepspeed.md.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from memopd.optim import SCHEDULES, build_lr_lambda, build_optimizer

__all__ = [
    "TrainBackend",
    "PlainBackend",
    "DeepSpeedBackend",
    "DistInfo",
    "make_backend",
    "init_distributed",
    "shutdown_distributed",
    "all_reduce",
    "broadcast",
    "barrier",
    "group_for",
    "resolve_deepspeed_config",
    "build_optimizer",
    "build_lr_lambda",
    "SCHEDULES",
    "SUPPORTED_ZERO_STAGES",
]

SUPPORTED_ZERO_STAGES = (1, 2, 3)
# Plain-backend gradient all-reduce bucket size (elements): few collectives, bounded extra memory.
_BUCKET_NUMEL = 8 * 1024 * 1024


# --------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # None when single process without a process group


def _env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _current_info() -> DistInfo:
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=_env_int("LOCAL_RANK", 0) or 0,
        backend=str(dist.get_backend()),
    )


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise torch.distributed from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT.

    No-op (returns rank 0 of 1) when WORLD_SIZE is unset or 1; idempotent when a process
    group already exists. Backend: nccl when CUDA is available, else gloo (override
    with `backend`). On CUDA the current device is set to LOCAL_RANK.
    """
    if dist.is_available() and dist.is_initialized():
        if _CPU_GROUP is None and not _serves(dist.distributed_c10d._get_default_group(), "cpu"):
            _init_cpu_group()  # a group the caller built (e.g. a launcher's): same rule
        return _current_info()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size is None or world_size <= 1:
        return DistInfo(0, 1, _env_int("LOCAL_RANK", 0) or 0, None)
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; launch with torchrun "
            "or the deepspeed launcher, which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"
        )
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", 0) or 0
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    from datetime import timedelta

    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    _init_cpu_group()
    return DistInfo(rank, world_size, local_rank, backend)


def shutdown_distributed(*, orderly: bool = True) -> None:
    """Destroy every process group this process holds (no-op without one).

    A gloo group left for the interpreter's exit to tear down can abort a rank with
    "terminate called without an active exception" after all work is done, failing a
    finished run. `orderly` first waits for all ranks (skip it on an error path, where
    the other ranks may never arrive).
    """
    global _CPU_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return
    if orderly:
        barrier()
    dist.destroy_process_group()  # all groups, the CPU side group included
    _CPU_GROUP = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_process_group() -> DistInfo:
    """A process group for DeepSpeed: the launcher's, or a one-rank group on a free port."""
    info = init_distributed()
    if info.backend is not None:
        return info
    # DeepSpeed needs torch.distributed even for one process; without the env vars its own
    # init would try MPI discovery. Export them so DeepSpeed sees a consistent world of 1.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ["WORLD_SIZE"] = "1"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend=backend, init_method="env://", rank=0, world_size=1)
    _init_cpu_group()
    return DistInfo(0, 1, info.local_rank, backend)


def _world_size_hint() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return max(1, _env_int("WORLD_SIZE", 1) or 1)


# ------------------------------------------------------------------------- collectives
#
# Every collective of the trainer goes through `all_reduce`, `broadcast` and `barrier`
# below. NCCL serves only CUDA tensors, but the loop reduces small host-side statistics
# (token counts, metric sums) on the CPU. Rather than copying those to the GPU and back
# (a sync per statistic), a CPU tensor goes through a gloo group built next to the
# default group whenever the default group does not serve CPU tensors; a tensor whose
# device the default group serves uses it. One rule for every call site, and a CPU test
# can check it by binding the default group to "cuda" only (see tests).

_CPU_GROUP = None  # gloo group for CPU tensors when the default group has no CPU backend


def _serves(group, device_type: str) -> bool:
    types = getattr(group, "_device_types", None)
    if types is None:  # older torch: the backend name is all we know
        return device_type == "cpu" if dist.get_backend(group) == "gloo" else device_type != "cpu"
    return any(d.type == device_type for d in types)


def _init_cpu_group() -> None:
    """Collective (every rank, right after init_process_group): the CPU side group."""
    global _CPU_GROUP
    default = dist.distributed_c10d._get_default_group()
    _CPU_GROUP = None if _serves(default, "cpu") else dist.new_group(backend="gloo")


def group_for(tensor: torch.Tensor):
    """The process group that serves `tensor`'s device (None: the default group)."""
    if tensor.device.type == "cpu" and _CPU_GROUP is not None:
        return _CPU_GROUP
    return None


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of `t` over all ranks, on the group that serves its device (a
    device tensor that no group serves, e.g. CUDA under a gloo-only group, goes through a
    CPU copy)."""
    if _world() > 1:
        if t.device.type != "cpu" and not _serves(dist.distributed_c10d._get_default_group(), t.device.type):
            t.copy_(all_reduce(t.cpu(), op))
        else:
            dist.all_reduce(t, op=op, group=group_for(t))
    return t


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast of `t` from rank `src`, on the group that serves its device."""
    if _world() > 1:
        dist.broadcast(t, src=src, group=group_for(t))
    return t


def barrier() -> None:
    """All ranks meet (through the CPU group where the default one serves only CUDA)."""
    if _world() > 1:
        dist.barrier(group=_CPU_GROUP)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier(world_size: int) -> None:
    if world_size > 1:
        barrier()


# --------------------------------------------------------------------------- optimiser


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
        _barrier(self.world_size)

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
        from .rundir import atomic_write_text

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


# the values a checkpoint file may hold besides tensors (torch.load(weights_only=True)
# admits a few more torch types, e.g. dtypes and sizes, which no memopd state holds)
_PLAIN = (dict, list, tuple, str, int, float, bool, type(None), torch.Tensor)


def _check_plain(obj: Any, where: str) -> None:
    from memopd.errors import UnsafeFileError

    stack = [obj]
    while stack:
        x = stack.pop()
        if not isinstance(x, _PLAIN):
            raise UnsafeFileError(f"{where}: holds a {type(x).__module__}.{type(x).__qualname__}, not only "
                                  "tensors and plain values; refusing it")
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def load_tensor_file(path: str, safe_types: tuple = ()) -> Any:
    """torch.load of a checkpoint file that runs no code: the weights-only unpickler (it
    builds tensors and plain containers and refuses any other global, `safe_types` aside:
    classes the caller names), then a check that only tensors, plain values and
    `safe_types` came out. Anything else is an UnsafeFileError naming the file."""
    import pickle

    from memopd.errors import UnsafeFileError

    try:
        with torch.serialization.safe_globals(list(safe_types)):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found is None:  # not a pickle the weights-only reader can parse at all
            raise UnsafeFileError(f"{path}: not a readable torch checkpoint file; it is damaged") from None
        raise UnsafeFileError(f"{path}: refused to load: it needs more than tensors and plain values (it names "
                              f"{found.group(1)}), and unpickling it could run code. Only load checkpoints memopd "
                              "wrote") from None
    except (RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UnsafeFileError(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: "
                              f"{first}); it is damaged") from None
    if not safe_types:
        _check_plain(state, path)
    return state


# --------------------------------------------------------------------------- plain


class PlainBackend(TrainBackend):
    """torch AdamW + LambdaLR; with a process group of N > 1, gradients are averaged in step().

    Instead of DDP (whose no_sync() must wrap the *forward*, while the loop only says
    which micro-batch is last at backward time), gradients accumulate locally and are
    all-reduced once per optimiser step in flat buckets, the same arithmetic as DDP
    with no_sync on all but the last micro-batch (without comm/compute overlap).
    Parameters are broadcast from rank 0 at construction, as DDP does.
    """

    def __init__(self, model, optimizer, scheduler, *, max_grad_norm: float | None, info: DistInfo):
        super().__init__()
        self.module = self.unwrapped = model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.rank, self.world_size = info.rank, info.world_size
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
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
        if self.world_size > 1:
            self._average_grads()
        clip = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._params, clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._after_step()
        return float(norm)

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
            from .rundir import atomic_file

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
        # tensors of the optimiser state are moved to the params' device by Optimizer.load_state_dict
        self.load_state_dict(state)
        return self._load_client_state(path)

    def save_pretrained(self, path: str) -> None:
        """Collective when world_size > 1 (barrier); the main rank writes the HF checkpoint."""
        if self.is_main:
            self.unwrapped.save_pretrained(path)
        self.barrier()


# --------------------------------------------------------------------------- DeepSpeed


def _load_config(config: dict | str | os.PathLike) -> dict:
    """A deep copy of the config dict, or the parsed JSON file. A path that does not exist
    but names a bundled example, `ds_zero2.json` or `trainer/configs/ds_zero2.json` (likewise
    ds_zero3), is that example: it ships as package data next to this module, so the README's
    command works from any directory and from an installed package."""
    if isinstance(config, (str, os.PathLike)):
        path = os.path.normpath(os.fspath(config))
        base = os.path.basename(path)
        example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", base)
        if path in (base, os.path.join("trainer", "configs", base)) and not os.path.exists(path) and os.path.isfile(example):
            path = example
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"deepspeed_config must be a dict or a JSON path, got {type(config).__name__}")
    return json.loads(json.dumps(config))  # deep copy; the caller's dict is never modified


def resolve_deepspeed_config(
    config: dict | str | os.PathLike,
    *,
    max_grad_norm: float | None,
    world_size: int,
    on_cpu: bool,
    model_dtype: torch.dtype | None = None,
) -> dict:
    """Validate a DeepSpeed config and fill the defaults the user omitted (never overriding).

    Raises ValueError for settings that conflict with this backend (docs/deepspeed.md §3.1).
    """
    cfg = _load_config(config)

    zero = cfg.get("zero_optimization")
    if zero is None:
        raise ValueError(
            "DeepSpeed config has no zero_optimization section; set zero_optimization.stage to "
            f"one of {SUPPORTED_ZERO_STAGES} (or pass deepspeed_config=None for the plain backend)"
        )
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization must be a JSON object, got {zero!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in SUPPORTED_ZERO_STAGES:
        extra = " (stage 0 is plain data parallelism: pass deepspeed_config=None)" if stage == 0 else ""
        raise ValueError(f"unknown/unsupported ZeRO stage {stage!r}; choose one of {SUPPORTED_ZERO_STAGES}{extra}")

    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ValueError(
                f"DeepSpeed config has an {key!r} section, but this backend builds AdamW and the LR "
                "schedule from make_backend(lr=..., weight_decay=..., betas=..., eps=..., warmup_steps=..., "
                f"total_steps=...); remove {key!r} from the config"
            )

    fp16 = bool((cfg.get("fp16") or {}).get("enabled", False))
    bf16 = bool((cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled", False))
    if fp16 and on_cpu:
        raise ValueError("fp16 is enabled in the DeepSpeed config but there is no CUDA device; "
                         "on CPU use fp32 (no fp16/bf16 section) or bf16")
    if model_dtype is torch.bfloat16 and not bf16:
        raise ValueError("the model is bfloat16 but the DeepSpeed config does not enable bf16 "
                         "(add \"bf16\": {\"enabled\": true} or pass a float32 model)")
    if model_dtype is torch.float16 and not fp16:
        raise ValueError("the model is float16 but the DeepSpeed config does not enable fp16")

    if cfg.get("managed_gradient_accumulation", True) is False:
        raise ValueError("managed_gradient_accumulation=false conflicts with this backend, which marks the "
                         "accumulation boundary itself (set_gradient_accumulation_boundary); remove it")

    if (cfg.get("checkpoint") or {}).get("load_universal"):
        raise ValueError("checkpoint.load_universal is not supported: DeepSpeed reads universal checkpoints by "
                         "unpickling them (weights_only=False), which can run code; remove it")

    gas = cfg.get("gradient_accumulation_steps")
    if gas is not None and gas != 1:
        raise ValueError(
            f"gradient_accumulation_steps={gas} in the DeepSpeed config: the training loop owns micro-batch "
            "accumulation (backward(..., last_micro_batch=...)), so it must be 1 or absent"
        )
    cfg["gradient_accumulation_steps"] = 1
    tbs = cfg.get("train_batch_size")
    mbs = cfg.get("train_micro_batch_size_per_gpu")
    if tbs is not None:
        if mbs is None:
            if tbs % world_size:
                raise ValueError(f"train_batch_size={tbs} is not divisible by world_size={world_size}")
            mbs = tbs // world_size
        elif tbs != mbs * world_size:
            raise ValueError(
                f"train_batch_size={tbs} != train_micro_batch_size_per_gpu={mbs} x world_size={world_size} "
                "(gradient_accumulation_steps is 1 here); fix or drop train_batch_size"
            )
    cfg["train_micro_batch_size_per_gpu"] = 1 if mbs is None else mbs

    clip = float(max_grad_norm) if max_grad_norm and max_grad_norm > 0 else 0.0
    if "gradient_clipping" in cfg:
        if float(cfg["gradient_clipping"]) != clip:
            raise ValueError(
                f"gradient_clipping={cfg['gradient_clipping']} in the DeepSpeed config conflicts with "
                f"max_grad_norm={max_grad_norm}; set one of them, or make them equal"
            )
    cfg["gradient_clipping"] = clip
    return cfg


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
        except Exception:  # older/newer layouts: worst case the op gets built once and cached
            pass
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedBackend(TrainBackend):
    """DeepSpeed engine with ZeRO 1/2/3 around a torch AdamW + LambdaLR built by make_backend."""

    def __init__(self, model, optimizer, scheduler, *, config: dict, max_grad_norm: float | None):
        super().__init__()
        deepspeed = _import_deepspeed()
        info = _ensure_process_group()
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
            world_size=_world_size_hint(),
            on_cpu=not torch.cuda.is_available(),
            model_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
        )
    optimizer = build_optimizer(model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if cfg is None:
        info = init_distributed()
        return PlainBackend(model, optimizer, scheduler, max_grad_norm=max_grad_norm, info=info)
    return DeepSpeedBackend(model, optimizer, scheduler, config=cfg, max_grad_norm=max_grad_norm)
