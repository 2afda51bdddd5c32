"""Where and in what precision the trainer's models live: TrainConfig's `device` and
`dtype` turned into a torch device and dtype, and the models moved there.

`device`: "auto" is `cuda:LOCAL_RANK` when torch sees a CUDA device, else the CPU; "cuda"
is the same GPU but refused (one line, `ConfigError`) where there is none; "cpu" is the
CPU. The plain backend trains where this says; DeepSpeed places the models on its own
accelerator, so `device=cpu` beside a DeepSpeed config on a CUDA host is refused.
With the models on CUDA, every op's `backend="auto"` (packed attention, the fused lm-head
ops; memopd/ops/dispatch.py) picks the Triton kernels.

`dtype`: "fp32", or "bf16": bf16 weights and activations with fp32 master weights in the
optimiser (the plain backend keeps fp32 copies of the bf16 parameters; DeepSpeed's bf16
mode does the same under ZeRO). Every matmul, the packed attention and the fused lm-head
ops then run their bf16 kernels, and AdamW updates the fp32 copies, so a step smaller
than half a bf16 ulp of its weight is not rounded away (the ulp of a norm gain of 1.0 is
7.8e-3, forty times a 2e-4 learning rate: pure bf16 weights would never train it).
Autocast over fp32 weights was not chosen: the residual stream and the final hidden state
stay fp32 under autocast, so the lm head, the largest matmul of a model with a
150k-token vocabulary, would run the fp32 fused kernels, and q/k/v reach the attention in
mixed dtypes. Buffers (rotary frequencies) keep their dtype; the critic's one-row value
head stays fp32 (it casts its input).
"""
from __future__ import annotations

import torch

from memopd.errors import ConfigError

__all__ = ["DEVICES", "DTYPES", "resolve_device", "resolve_dtype", "place_model"]

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str, *, local_rank: int = 0, deepspeed: bool = False) -> torch.device:
    """The torch device of config value `name` (one of DEVICES), or `ConfigError`."""
    if name not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        built = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"device=cuda but torch {torch.__version__} ({built}) sees no CUDA device; "
                          "use device=cpu or device=auto")
    if name == "cpu" and cuda and deepspeed:
        raise ConfigError("device=cpu with deepspeed=: DeepSpeed places the models on its accelerator (CUDA here); "
                          "leave device=auto, or train without deepspeed=")
    if name == "cpu" or not cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def place_model(model: torch.nn.Module | None, device: torch.device | None, dtype: torch.dtype):
    """`model` moved to `device` (None: where it is) with its floating-point parameters in
    `dtype`; buffers keep their dtype. In place; returns `model` (None stays None)."""
    if model is None:
        return None
    if device is not None:
        model.to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model
