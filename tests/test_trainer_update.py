"""Trainer update pieces on a packed batch: the fused actor loss equals the naive one."""
import pytest
import torch

from memopd import pack, random_trajectories
from memopd.hf import head_of
from memopd.models import tiny_causal_lm
from memopd.ops import reference_linear_reverse_kl
from memopd.trainer.modules import Actor, Critic, PPOInputs
from memopd.trainer.ppo import policy_loss
from memopd.trainer.update import entry_offsets


def _setup(seed):
    student = tiny_causal_lm("qwen2", vocab_size=96, hidden_size=32, initializer_range=0.2, seed=seed % 1000)
    teacher = tiny_causal_lm("llama", vocab_size=96, hidden_size=48, num_heads=4, num_kv_heads=4,
                             initializer_range=0.2, seed=seed % 1000 + 1)
    trajs = random_trajectories("summary", 4, seed=seed, group_size=2, vocab_size=96, calls=(2, 4))
    return student, teacher, trajs


def test_actor_loss_fused_equals_reference(seed):
    """The trainer's actor loss (one fused op) equals the naive composition: float64
    reverse KL over materialised logits + PPO surrogate + entropy bonus."""
    student, teacher, trajs = _setup(seed)
    batch = pack(trajs, layout="aligned", share_prefix="group")
    tbatch = pack(trajs, layout="flatten")  # the persistent arm's teacher states
    with torch.no_grad():
        th = Actor(teacher).hidden(tbatch)
    tw = teacher.lm_head.weight.detach()
    g = torch.Generator().manual_seed(seed)
    A = batch.num_actions
    logp_old = -torch.rand(A, generator=g) * 3
    adv = torch.randn(A, generator=g)
    tmask = torch.rand(A, generator=g) > 0.3
    alpha, lam, eps, n_act, n_t = 0.01, 0.7, 0.2, A + 5.0, float(tmask.sum()) + 2.0
    ppo = PPOInputs(logp_old, adv, tmask, clip_eps=eps, entropy_coef=alpha, kl_coef=lam, normalizer=n_act,
                    kl_normalizer=n_t)

    actor = Actor(student)
    student.zero_grad()
    out = actor(batch, th, head_of(teacher), ppo=ppo)
    out.loss.backward()
    grads_f = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    student.zero_grad()
    h = actor.hidden(batch)
    ref = reference_linear_reverse_kl(h.double(), student.lm_head.weight.double(), th.double(), tw.double(),
                                      batch.target_ids, reduction="none")
    pg, st = policy_loss(ref.logprobs, logp_old.double(), adv.double(), eps)
    loss_r = (pg.sum() - alpha * ref.entropy.sum()) / n_act + lam * (ref.kl * tmask.double()).sum() / n_t
    loss_r.backward()
    torch.testing.assert_close(out.loss.double(), loss_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logprobs.double(), ref.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.kl.double(), ref.kl, atol=1e-5, rtol=1e-5)
    assert float(out.clipped.float().mean()) == pytest.approx(float(st.clip_frac))
    for n, p in student.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads_f[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_actor_without_teacher_has_zero_kl(seed):
    student, _, trajs = _setup(seed)
    batch = pack(trajs, layout="aligned")
    out = Actor(student)(batch)
    assert out.kl.abs().max() < 1e-5
    logits = torch.log_softmax(student.lm_head(Actor(student).hidden(batch)), -1)
    torch.testing.assert_close(out.logprobs, logits.gather(1, batch.target_ids[:, None])[:, 0], atol=1e-5, rtol=1e-5)


def test_critic_values_per_action(seed):
    student, _, trajs = _setup(seed)
    batch = pack(trajs, layout="aligned")
    critic = Critic(student)
    torch.nn.init.normal_(critic.value_head.weight)
    v = critic(batch)
    assert v.shape == (batch.num_actions,)
    offs = entry_offsets(batch, trajs)
    assert int(offs[0, 0]) == 0 and int(offs[1, 0]) == sum(len(i.action_ids) for i in trajs[0].invocations)
    # the naive domain counts the context copies too, and every (b, t, k) maps back
    naive = pack(trajs, layout="aligned", action_domain="naive")
    offs = entry_offsets(naive, trajs)
    gid = offs[naive.traj_index, naive.call_index] + naive.token_index
    assert torch.equal(gid, torch.arange(naive.num_actions))
