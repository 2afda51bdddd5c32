"""DeepSpeed config files for the trainer's ZeRO backend: `load_deepspeed_config` reads a
config (a dict, a JSON path, or a bundled example by name) and `resolve_deepspeed_config`
checks it against what the backend owns (optimiser, schedule, gradient accumulation,
clipping) and fills the defaults the user left out (docs/deepspeed.md §3).
"""
from __future__ import annotations

import json
import os

import torch

__all__ = ["SUPPORTED_ZERO_STAGES", "load_deepspeed_config", "resolve_deepspeed_config"]

SUPPORTED_ZERO_STAGES = (1, 2, 3)


def load_deepspeed_config(config: dict | str | os.PathLike) -> dict:
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
    cfg = load_deepspeed_config(config)

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
