"""memopd: Memory-Aligned On-Policy Distillation for compact-memory LLM agents.

Records (`Invocation`, `Trajectory`), memory policies, the pack compiler (`pack`,
`PackedBatch`), the ops (`memopd.ops`), the HF packed forward, the RCE audit and the
trainer are all reachable from here. Heavy submodules load on first use.
"""
from __future__ import annotations

import importlib

from .records import (
    Invocation,
    RecordError,
    Source,
    Trajectory,
    load_trajectories,
    save_trajectories,
    validate_trajectories,
)
from .memory import (
    POLICIES,
    ContextUpdate,
    FullRetention,
    MemoryPolicy,
    RetrievalRefresh,
    SlidingWindow,
    SuffixRetention,
    SummaryReplacement,
    drive,
    make_policy,
    random_trajectories,
)

__version__ = "0.1.0"

__all__ = [
    "Invocation", "RecordError", "Source", "Trajectory", "load_trajectories", "save_trajectories",
    "validate_trajectories", "POLICIES", "ContextUpdate", "FullRetention", "MemoryPolicy", "RetrievalRefresh",
    "SlidingWindow", "SuffixRetention", "SummaryReplacement", "drive", "make_policy", "random_trajectories",
    "pack", "LAYOUTS", "PackedBatch", "AttentionMeta", "PackError", "__version__",
]

_LAZY = {
    "pack": "memopd.packing",
    "LAYOUTS": "memopd.packing",
    "PackedBatch": "memopd.layout",
    "AttentionMeta": "memopd.layout",
    "PackError": "memopd.packing",
}
_SUBMODULES = ("ops", "kernels", "trainer", "hf", "rce", "env", "packing", "layout", "planner")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"memopd.{name}")
    raise AttributeError(f"module 'memopd' has no attribute {name!r}")
