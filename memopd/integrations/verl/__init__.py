"""memopd in verl 0.9: the recipe that records every call of a rewritten-context session,
scores each with the teacher in its restored state, and trains them packed.

- `hooks`: tensor-level functions in verl's `[B, R]` response layout (log-probs, entropy,
  verl's PPO loss and `agg_loss`, a packed forward of padded rows); verl need not be
  installed. Re-exported here.
- `rows`: memopd's exact record of a call in a verl row (`extra_fields["memopd"]`), and
  the sessions rebuilt from rows.
- `agent_loop`: the registered agent loop `memopd_compact_memory` (imports verl).
- `teacher`: teacher scores for every call (`TeacherScorer`, `LocalTeacherScorer`,
  `VerlTopKScorer`, `score_every_call`, the TransferQueue worker/manager).
- `training`: sessions packed per micro-batch and memopd's fused actor loss with verl's
  loss signature (`memopd_actor_loss`), per-call or per-session weighting, the engine.
- `audit`: the RCE audit hook, logged as metrics.

Where each piece runs and what stays verl's: docs/verl.md.
"""
from __future__ import annotations

from .hooks import LOSS_AGG_MODES, agg_loss, compute_log_prob, packed_log_prob, padded_to_packed, policy_loss

__all__ = ["LOSS_AGG_MODES", "agg_loss", "compute_log_prob", "policy_loss", "packed_log_prob", "padded_to_packed"]
