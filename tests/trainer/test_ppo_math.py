"""PPO math against hand-computed small cases."""
import math

import pytest
import torch

from memopd.trainer.ppo import gae, policy_loss, token_rewards, value_loss, whiten


def test_token_rewards_final_token_and_kl_penalty():
    ti = torch.tensor([0, 0, 0, 1, 1])
    old = torch.tensor([-1.0, -2.0, -0.5, -1.0, -1.0])
    ref = torch.tensor([-1.5, -1.0, -0.5, -2.0, -0.2])
    r, pen = token_rewards(torch.tensor([1.0, -0.5]), ti, old, ref, ref_kl_coef=0.1)
    # penalties: [0.05, 0 (negative clipped), 0, 0.1, 0]
    torch.testing.assert_close(pen, torch.tensor([0.05, 0.0, 0.0, 0.1, 0.0]))
    torch.testing.assert_close(r, torch.tensor([-0.05, 0.0, 1.0, -0.1, -0.5]))


def test_gae_hand_computed():
    # one trajectory of 3 tokens, gamma=0.9, lam=0.5
    r = torch.tensor([0.0, 0.0, 1.0])
    v = torch.tensor([0.5, 0.6, 0.7])
    adv, ret = gae(r, v, torch.zeros(3, dtype=torch.long), gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    torch.testing.assert_close(adv, torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(ret, adv + v)


def test_gae_does_not_leak_across_trajectories():
    r = torch.tensor([0.0, 1.0, 0.0, 5.0])
    v = torch.tensor([0.0, 0.0, 0.0, 0.0])
    adv, _ = gae(r, v, torch.tensor([0, 0, 1, 1]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, 5.0, 5.0]))


def test_policy_loss_clipping():
    logp_old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.9]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, st = policy_loss(logp, logp_old, adv, clip_eps=0.2)
    # r=1.5,A=1: max(-1.5, -1.2) = -1.2 (clipped); r=0.5,A=1: max(-0.5,-0.8) = -0.5
    # r=1.1,A=-1: max(1.1, 1.1)=1.1; r=0.9,A=-1: max(0.9, 0.9)=0.9
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.1, 0.9]))
    assert math.isclose(float(st.clip_frac), 0.25)
    ratio = torch.exp(logp)
    assert math.isclose(float(st.approx_kl), float(((ratio - 1) - logp).mean()), rel_tol=1e-6)


def test_policy_loss_gradient_zero_when_clipped():
    logp = torch.log(torch.tensor([1.5])).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(1), torch.tensor([1.0]))
    loss.sum().backward()
    assert float(logp.grad) == 0.0


def test_value_loss_clipped():
    v = torch.tensor([1.0, 0.0])
    old = torch.tensor([0.5, 0.5])
    ret = torch.tensor([0.0, 1.0])
    # token 0: unclipped (1-0)^2=1, clipped v=0.7 -> 0.49: max 1 -> 0.5
    # token 1: unclipped 1, clipped v=0.3 -> 0.49: max 1 -> 0.5
    torch.testing.assert_close(value_loss(v, old, ret, clip=0.2), torch.tensor([0.5, 0.5]))
    v2 = torch.tensor([0.6])
    # unclipped (0.6-1)^2=0.16 ; clipped 0.6 (within 0.2) -> same
    torch.testing.assert_close(value_loss(v2, torch.tensor([0.5]), torch.tensor([1.0])), torch.tensor([0.08]))
    # clipping binds: v=1.5 from old 0.5 (clip to 0.7), R=1: max(0.25, 0.09) = 0.25
    torch.testing.assert_close(value_loss(torch.tensor([1.5]), torch.tensor([0.5]), torch.tensor([1.0])), torch.tensor([0.125]))


def test_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w = whiten(x)
    assert abs(float(w.mean())) < 1e-6 and abs(float(w.std()) - 1) < 1e-4


def test_shape_errors():
    with pytest.raises(ValueError, match="logp_old has shape"):
        policy_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3))
