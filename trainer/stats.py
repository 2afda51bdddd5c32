"""The names of the statistics one PPO + OPD update returns (trainer/update.py), which the
training loop logs as `train/<name>` (metrics.jsonl, TensorBoard) and `memopd plot` draws.

Torch-free, so that plotting a run does not import torch.
"""
from __future__ import annotations

__all__ = [
    "PG_LOSS", "VF_LOSS", "ENTROPY", "KL_TEACHER", "CLIP_FRAC", "APPROX_KL", "ACTOR_GRAD_NORM", "CRITIC_GRAD_NORM",
    "OPTIMIZER_STEPS", "FIRST_RATIO_MAXDEV", "LOSS_STATS", "STEP_STATS", "train_metric",
]

PG_LOSS = "pg_loss"  # clipped PPO surrogate, mean over action tokens
VF_LOSS = "vf_loss"  # clipped value loss
ENTROPY = "entropy"  # of the student's sampling distribution
KL_TEACHER = "kl_teacher"  # KL(student || teacher), mean over the teacher-masked tokens
CLIP_FRAC = "clip_frac"  # fraction of action tokens whose clipped branch was taken
APPROX_KL = "approx_kl"  # (ratio - 1) - log ratio, mean over action tokens: KL(old || new)
ACTOR_GRAD_NORM = "actor_grad_norm"
CRITIC_GRAD_NORM = "critic_grad_norm"
OPTIMIZER_STEPS = "optimizer_steps"
FIRST_RATIO_MAXDEV = "first_ratio_maxdev"  # max |ratio - 1| before the update's first optimiser step

# token-weighted means over the micro-batches of an optimiser step, averaged over its steps
LOSS_STATS = (PG_LOSS, VF_LOSS, ENTROPY, KL_TEACHER, CLIP_FRAC, APPROX_KL)
# one value per optimiser step, averaged over the update's steps
STEP_STATS = (ACTOR_GRAD_NORM, CRITIC_GRAD_NORM)


def train_metric(name: str) -> str:
    """The metrics.jsonl key under which the loop logs update statistic `name`."""
    return f"train/{name}"
