"""PPO math on action tokens: token rewards, GAE, clipped policy and value losses.

Every tensor here is indexed by action token in (trajectory, call, k) order, as
`memopd.pack` lays them out, so one trajectory's tokens are contiguous and in time
order. Only action tokens (m_act) enter: context tokens are never decisions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "token_rewards",
    "gae",
    "whiten",
    "policy_loss",
    "ratio_stats",
    "value_loss",
    "PolicyLossStats",
    "ROLLOUT_IS_MODES",
    "rollout_is_weights",
]


def _check_same(*named):
    n = named[0][1].shape
    for name, t in named:
        if t.shape != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(n)}")


def token_rewards(
    final_reward: torch.Tensor,
    traj_index: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor | None,
    ref_kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: `-ref_kl_coef * [logp_old - logp_ref]_+` on every action token, plus
    the trajectory's reward on its final action token.

    Returns (rewards [A], kl_penalty [A]). `final_reward` is [B], `traj_index` [A].
    """
    if traj_index.numel() == 0:
        z = torch.zeros(0, dtype=torch.float32, device=traj_index.device)
        return z, z
    if logp_ref is None or ref_kl_coef == 0:
        pen = torch.zeros_like(logp_old, dtype=torch.float32)
    else:
        _check_same(("logp_old", logp_old), ("logp_ref", logp_ref))
        pen = ref_kl_coef * (logp_old.float() - logp_ref.float()).clamp(min=0)
    r = -pen
    last = torch.ones_like(traj_index, dtype=torch.bool)
    last[:-1] = traj_index[1:] != traj_index[:-1]
    r = r + torch.where(last, final_reward.float()[traj_index], torch.zeros_like(r))
    return r, pen


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    traj_index: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each trajectory's action tokens.

    The value after a trajectory's last action token is 0 (the episode ends). Returns
    (advantages, returns) with returns = advantages + values.
    """
    _check_same(("rewards", rewards), ("values", values), ("traj_index", traj_index))
    A = rewards.shape[0]
    r = rewards.float().cpu()
    v = values.float().cpu()
    ti = traj_index.cpu()
    out = torch.zeros(A, dtype=torch.float32)
    running = 0.0
    for i in range(A - 1, -1, -1):
        last = i == A - 1 or ti[i + 1] != ti[i]
        next_v = 0.0 if last else float(v[i + 1])
        if last:
            running = 0.0
        delta = float(r[i]) + gamma * next_v - float(v[i])
        running = delta + gamma * lam * running
        out[i] = running
    adv = out.to(rewards.device)
    return adv, adv + values.float()


def whiten(x: torch.Tensor, eps: float = 1e-8, reduce_sum=None) -> torch.Tensor:
    """Zero-mean, unit-variance (the usual PPO advantage normalisation).

    `reduce_sum(t) -> t summed over ranks` makes the statistics global, so that a
    data-parallel run normalises exactly as one process holding the whole batch.
    """
    st = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64),
                      x.detach().double().sum().cpu(), x.detach().double().pow(2).sum().cpu()])
    if reduce_sum is not None:
        st = reduce_sum(st.to(x.device)).cpu()
    n, s, ss = (float(v) for v in st)
    if n == 0:
        return x
    mean = s / n
    if n < 2:
        return x - mean
    var = max(ss - n * mean * mean, 0.0) / (n - 1)
    return (x - mean) / (var ** 0.5 + eps)


@dataclass
class PolicyLossStats:
    clip_frac: torch.Tensor
    approx_kl: torch.Tensor


def ratio_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor) -> PolicyLossStats:
    """Over the tokens given: the fraction whose clipped branch was taken, and the
    low-variance estimator k3 of KL(old || new), the mean of (ratio - 1) - log ratio.
    Both 0 for no tokens. `clipped` comes from whichever loss clipped (this module's
    `policy_loss`, or the fused op's own output with its clip range and dual clip)."""
    _check_same(("ratio", ratio), ("log_ratio", log_ratio), ("clipped", clipped))
    with torch.no_grad():
        if ratio.numel() == 0:
            zero = ratio.new_zeros(())
            return PolicyLossStats(zero, zero)
        return PolicyLossStats(clipped.float().mean(), ((ratio - 1) - log_ratio).mean())


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped surrogate per token: max(-A r, -A clip(r, 1-eps, 1+eps)). Returns the
    per-token loss [A] (the caller reduces) and statistics. The surrogate is the fused
    actor loss's own (`memopd.ops.actor_loss_torch.policy_terms`), with a symmetric range
    and no dual clip."""
    from memopd.ops.actor_loss_torch import policy_terms

    _check_same(("logp", logp), ("logp_old", logp_old), ("advantages", advantages))
    loss, ratio, clipped, _ = policy_terms(logp, logp_old, advantages, clip_eps, clip_eps, None)
    return loss, ratio_stats(ratio, logp - logp_old, clipped)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip: float | None = 0.2,
) -> torch.Tensor:
    """Clipped value loss per token: 0.5 * max((v - R)^2, (clip(v) - R)^2)."""
    _check_same(("values", values), ("old_values", old_values), ("returns", returns))
    l1 = (values - returns) ** 2
    if clip is None:
        return 0.5 * l1
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    l2 = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(l1, l2)


ROLLOUT_IS_MODES = ("none", "tis", "mask")


def rollout_is_weights(logp_old: torch.Tensor, logp_sampler: torch.Tensor, mode: str, cap: float) -> tuple[torch.Tensor, dict]:
    """Per-token weights correcting for the sampler's distribution differing from the
    trainer's (the rollout-vs-training mismatch), from rho = exp(logp_old - logp_sampler):

    - "none": 1 everywhere;
    - "tis": truncated importance sampling, min(rho, cap);
    - "mask": 1 where 1/cap <= rho <= cap, else 0 (the token leaves the surrogate).

    Tokens without a recorded sampler log-prob (NaN) get weight 1. The weights are
    constants of the update (old policy and sampler only), so weighting token i's clipped
    surrogate, w_i * max(-A_i r_i, -A_i clip(r_i)), equals the surrogate of the advantage
    w_i A_i (w_i >= 0; with a dual clip too): the fused actor loss takes them through its
    advantages and never forms [N, V]. Entropy bonus and teacher KL are not weighted.
    Returns (weights [A] float32, {"weight_mean", "weight_max", "share_corrected"}) with
    share_corrected the fraction of tokens whose weight the cap or the mask changed."""
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is must be one of {', '.join(ROLLOUT_IS_MODES)}, got {mode!r}")
    if not cap > 1.0:
        raise ValueError(f"the rollout_is cap must be > 1, got {cap}")
    _check_same(("logp_old", logp_old), ("logp_sampler", logp_sampler))
    rho = torch.exp(logp_old.double() - logp_sampler.double())
    known = ~torch.isnan(rho)
    if mode == "none":
        w = torch.ones_like(rho)
        changed = torch.zeros_like(known)
    elif mode == "tis":
        w = torch.where(known, rho.clamp(max=cap), torch.ones_like(rho))
        changed = known & (rho > cap)
    else:
        inside = (rho >= 1.0 / cap) & (rho <= cap)
        w = torch.where(known & ~inside, torch.zeros_like(rho), torch.ones_like(rho))
        changed = known & ~inside
    n = max(int(w.numel()), 1)
    stats = {"weight_mean": float(w.sum()) / n, "weight_max": float(w.max()) if w.numel() else 0.0,
             "share_corrected": float(changed.sum()) / n}
    return w.float(), stats

