"""Public tensor ops: packed attention, the fused linear distillation losses and their
teacher-less log-prob + entropy mode, references.

Plain tensors in, plain tensors out. Each op picks its back end by one rule
(`memopd.ops.dispatch`: Triton kernels on CUDA, PyTorch otherwise, `backend=` or
MEMOPD_BACKEND to choose). Names are resolved lazily so that importing `memopd.ops`
never imports Triton.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "reference_packed_attention": "memopd.ops.reference_attention",
    "dense_visibility_mask": "memopd.ops.reference_attention",
    "packed_attention": "memopd.ops.attention",
    "fused_linear_reverse_kl": "memopd.ops.fused_distill",
    "fused_linear_distill": "memopd.ops.fused_distill",
    "reference_linear_reverse_kl": "memopd.ops.reference_distill",
    "reference_linear_distill": "memopd.ops.reference_distill",
    "DistillOutput": "memopd.ops.results",
    "fused_linear_logprob_entropy": "memopd.ops.fused_distill",
    "fused_linear_logprob_entropy_loss": "memopd.ops.fused_distill",
    "reference_linear_logprob_entropy": "memopd.ops.reference_distill",
    "fused_linear_actor_loss": "memopd.ops.actor_loss",
    "fused_linear_topk_reverse_kl": "memopd.ops.topk_kl",
    "reference_actor_loss": "memopd.ops.reference_actor",
    "ActorLossOutput": "memopd.ops.results",
    "LogProbEntropy": "memopd.ops.results",
    "LogProbEntropyLoss": "memopd.ops.results",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'memopd.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
