"""The RCE audit hook of the verl recipe: every `every` training steps, `memopd.rce.audit`
on a few sessions of the step's real batch, returned as metrics for verl's logger.

The audit compares, for every action token of the sessions, the packed forward the
trainer uses (aligned: restored positions and visibility) with an independent forward of
that call alone; `memopd/rce_max_dlogp` is the largest |log-prob difference| and
`memopd/rce_passed` is 1 when the aligned layouts are within the dtype's tolerance
(`memopd.rce.default_tolerance`). The broken variants are left out by default (they are
there to fail): pass `variants=` to include them.
"""
from __future__ import annotations

from typing import Sequence

from memopd.rce import audit

from .rows import sessions_from_rows

__all__ = ["RCEAuditHook"]


class RCEAuditHook:
    """Call `hook(step, model, rows)` after each training step; returns {} on the steps it
    skips and the audit's metrics on every `every`-th step (`max_sessions` sessions)."""

    def __init__(self, every: int = 50, *, max_sessions: int = 2, variants: Sequence[str] = ("aligned",),
                 max_tokens: int = 8192, tolerance: float | None = None):
        if every < 1 or max_sessions < 1:
            raise ValueError(f"RCEAuditHook: every ({every}) and max_sessions ({max_sessions}) must be >= 1")
        self.every, self.max_sessions, self.variants = int(every), int(max_sessions), tuple(variants)
        self.max_tokens, self.tolerance = int(max_tokens), tolerance

    def __call__(self, step: int, model, rows) -> dict[str, float]:
        if step % self.every != 0:
            return {}
        sessions, _ = sessions_from_rows(rows)
        results = audit(model, sessions[: self.max_sessions], self.variants, max_tokens=self.max_tokens,
                        tolerance=self.tolerance)
        out: dict[str, float] = {}
        for r in results:
            tag = "" if r.variant == "aligned" else f"_{r.variant}"
            out[f"memopd/rce_max_dlogp{tag}"] = r.max_dlogp
            out[f"memopd/rce_max_logit_linf{tag}"] = r.max_logit_linf
            out[f"memopd/rce_actions{tag}"] = float(r.actions)
        out["memopd/rce_passed"] = float(all(r.passed for r in results if r.must_pass))
        return out
