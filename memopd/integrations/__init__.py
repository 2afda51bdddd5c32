"""Drop-in integrations of memopd's fused ops with other on-policy-distillation codebases.

- `memopd.integrations.trl`: `MemopdGKDTrainer`, TRL's GKD trainer with the loss computed
  by the fused JSD op on last hidden states (never `[tokens x vocab]` logits).
- `memopd.integrations.liger`: `LigerFusedLinearJSDLoss`, Liger's chunked JSD loss module
  with Liger's constructor, argument order and return type.
- `memopd.integrations.verl`: memopd in verl 0.9 (the `memopd_compact_memory` agent
  loop, teacher scoring of every call, packed session training with the fused loss as
  verl's loss, the RCE audit hook; docs/verl.md), and tensor-level hooks in verl's
  `[B, R]` response conventions.

Submodules are imported on demand; only `trl` needs its framework installed
(`pip install 'memopd[integrations]'`). Option meanings side by side: docs/integrations.md.
"""
from __future__ import annotations

import importlib

__all__ = ["require"]


def require(module: str, what: str):
    """Import an optional framework, or raise ImportError naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs the {module.split('.')[0]!r} package: pip install 'memopd[integrations]' "
                          f"(or pip install {module.split('.')[0]})") from exc
