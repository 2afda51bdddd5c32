"""Trainer update pieces on a packed batch: the fused actor loss equals the naive one."""
import pytest
import torch

from memopd import pack, random_trajectories
from memopd.hf import head_of
from memopd.models import tiny_causal_lm
from memopd.ops import reference_linear_reverse_kl
from memopd.trainer.modules import Actor, Critic, PPOInputs
from memopd.trainer.ppo import policy_loss
from memopd.trainer.settings import ActorLossCoefs, PPOSettings
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
    ppo = PPOInputs(logp_old, adv, tmask, ActorLossCoefs(clip_eps=eps, entropy_coef=alpha, teacher_kl_coef=lam),
                    normalizer=n_act, kl_normalizer=n_t)

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


def _op_on_ratios(seed, N=64, V=40, H=16, **kw):
    """The fused actor loss on random heads, with old log-probs moved so that many ratios
    fall outside [0.8, 1.2] on both sides."""
    from memopd.ops import fused_linear_actor_loss

    g = torch.Generator().manual_seed(seed + 11)
    hs, ws = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    y = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(hs @ ws.T, -1).gather(1, y[:, None])[:, 0]
    old = lp + torch.randn(N, generator=g) * 0.5  # log ratio ~ N(0, 0.25)
    out = fused_linear_actor_loss(hs, ws, y, adv, old, **kw)
    return out, old, adv


def test_clip_stats_from_the_op_equal_policy_loss_on_the_symmetric_clip(seed):
    """The trainer logs clip_frac / approx_kl from the op's own ratio and clipped outputs;
    with the default symmetric clip they are what policy_loss gave before, to the bit."""
    from memopd.trainer.ppo import ratio_stats

    out, old, adv = _op_on_ratios(seed, clip_eps=0.2)
    _, before = policy_loss(out.logprobs, old, adv, 0.2)
    now = ratio_stats(out.ratio, out.logprobs - old, out.clipped)
    assert 0.1 < float(now.clip_frac) < 0.9  # both branches occur
    assert float(now.clip_frac) == float(before.clip_frac)
    assert float(now.approx_kl) == float(before.approx_kl)
    torch.testing.assert_close(out.ratio, torch.exp(out.logprobs - old), atol=0, rtol=0)


def test_clip_stats_follow_the_ops_dual_clip(seed):
    """With dual clip the op also stops the gradient of capped negative-advantage tokens:
    its clip fraction counts them, which policy_loss (symmetric clip only) cannot."""
    from memopd.trainer.ppo import ratio_stats

    c = 1.5
    out, old, adv = _op_on_ratios(seed, clip_eps=0.2, dual_clip=c)
    _, symmetric = policy_loss(out.logprobs, old, adv, 0.2)
    now = ratio_stats(out.ratio, out.logprobs - old, out.clipped)
    r = torch.exp(out.logprobs - old)
    l1, l2 = -adv * r, -adv * r.clamp(0.8, 1.2)
    pg = torch.maximum(l1, l2)
    expected = ((l2 > l1) | ((adv < 0) & (pg > -c * adv))).float().mean()
    assert float(now.clip_frac) == pytest.approx(float(expected), abs=0)
    assert float(now.clip_frac) > float(symmetric.clip_frac)  # the capped tokens
    assert float(now.approx_kl) == pytest.approx(float(((r - 1) - (out.logprobs - old)).mean()), rel=1e-6)


def test_no_teacher_means_teacher_weight_zero_in_one_place():
    settings = PPOSettings(clip_eps=0.2, entropy_coef=0.01, teacher_kl_coef=0.7)
    assert settings.loss_coefs(has_teacher=True) == ActorLossCoefs(0.2, 0.01, 0.7)
    assert settings.loss_coefs(has_teacher=False) == ActorLossCoefs(0.2, 0.01, 0.0)


def test_update_returns_the_named_statistics(seed):
    """update() on tiny models: its keys are the stats module's names, in its order, and
    the teacher-less update logs KL 0."""
    from memopd.trainer import stats as S
    from memopd.trainer.backend import make_backend
    from memopd.trainer.update import UpdateSettings, score, update

    student, teacher, trajs = _setup(seed)
    actor, critic = Actor(student), Critic(tiny_causal_lm("qwen2", vocab_size=96, hidden_size=32, seed=3))
    ab = make_backend(actor, lr=1e-3, total_steps=4)
    cb = make_backend(critic, lr=1e-3, total_steps=4)
    settings = UpdateSettings(PPOSettings(clip_eps=0.2, value_clip=0.2, entropy_coef=0.01, teacher_kl_coef=1.0),
                              ppo_epochs=1, minibatches=2, max_tokens=4096, action_domain="exact")
    for teacher_lm in (teacher, None):
        scored = score(actor, critic, None, teacher_lm, trajs, teacher_layout="flatten" if teacher_lm else None,
                       max_tokens=4096, ppo=PPOSettings(ref_kl_coef=0.0, gamma=1.0, lam=0.95))
        got = update(ab, cb, trajs, scored, settings, teacher_head=head_of(teacher) if teacher_lm else None,
                     generator=torch.Generator().manual_seed(seed))
        assert list(got) == [*S.LOSS_STATS, *S.STEP_STATS, S.OPTIMIZER_STEPS, S.FIRST_RATIO_MAXDEV]
        assert got[S.OPTIMIZER_STEPS] == 2 and 0.0 <= got[S.CLIP_FRAC] <= 1.0
        assert (got[S.KL_TEACHER] > 0) == (teacher_lm is not None)
