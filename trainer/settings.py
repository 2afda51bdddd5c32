"""The PPO + OPD loss hyperparameters: one frozen section of the run config, and the
actor-loss coefficients derived from it once per update.

`PPOSettings` is `TrainConfig.ppo` (`ppo:` in a config file, `ppo.clip_eps=` on the command
line): the clip ranges, the advantage estimator's gamma and lambda, the reference-KL reward
penalty `ref_kl_coef`, and the actor loss's entropy bonus and teacher-KL weight
`teacher_kl_coef` (OPD's lambda). `PPOSettings.loss_coefs(has_teacher)` gives the
`ActorLossCoefs` every micro-batch of an update shares: the only place where an update
without a teacher (the ppo arm) gets teacher weight 0.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActorLossCoefs", "PPOSettings"]


@dataclass(frozen=True)
class ActorLossCoefs:
    """The coefficients of the actor loss, fixed for one update and shared by all its
    micro-batches: the PPO clip range, the entropy bonus and the weight of the KL to the
    teacher (`PPOSettings.teacher_kl_coef`, or 0 without a teacher)."""

    clip_eps: float
    entropy_coef: float
    teacher_kl_coef: float


@dataclass(frozen=True)
class PPOSettings:
    clip_eps: float = 0.2  # the ratio clip range of the surrogate
    value_clip: float = 0.2  # the critic's value clip range
    gamma: float = 1.0
    lam: float = 0.95  # GAE's lambda
    ref_kl_coef: float = 0.02  # the reference-KL penalty folded into the rewards (not the teacher weight)
    entropy_coef: float = 0.001  # alpha: the entropy bonus of the actor loss
    teacher_kl_coef: float = 1.0  # OPD's lambda: the weight of KL(student || teacher) (0 in the ppo arm)

    def loss_coefs(self, *, has_teacher: bool) -> ActorLossCoefs:
        """The actor-loss coefficients of an update; teacher weight 0 without a teacher."""
        return ActorLossCoefs(float(self.clip_eps), float(self.entropy_coef),
                              float(self.teacher_kl_coef) if has_teacher else 0.0)
