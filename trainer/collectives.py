"""Process groups and collectives of the trainer.

`init_distributed()` joins the process group a launcher (torchrun, deepspeed) describes
in RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, or does nothing for one process;
`shutdown_distributed()` ends it. Every collective of the trainer goes through
`all_reduce`, `broadcast` and `barrier` here: a CPU tensor goes through a gloo side group
when the default group (NCCL) does not serve CPU tensors (docs/deepspeed.md §2).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "init_distributed",
    "shutdown_distributed",
    "ensure_process_group",
    "world_size_hint",
    "all_reduce",
    "broadcast",
    "barrier",
    "group_for",
]


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


def ensure_process_group() -> DistInfo:
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


def world_size_hint() -> int:
    """The process group's world size, or before there is one the launcher's WORLD_SIZE."""
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
