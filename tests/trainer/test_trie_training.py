"""The trainer on trie batches whose identical early calls share their action tokens: the
actor loss, the OPD (reverse-KL teacher) term, the logged statistics and every student
gradient equal those of the independent layout (one row per call) in float64, with
per-entry advantages, old log-probs and teacher masks that differ between the calls that
share a token (each entry weighted as its own call's, not once per packed token)."""
import pytest
import torch

from memopd import pack, random_trajectories
from memopd.hf import head_of
from memopd.models import tiny_causal_lm
from memopd.trainer.modules import Actor, Critic, PPOInputs
from memopd.trainer.settings import ActorLossCoefs, PPOSettings

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-11)


def _rms_norm_f64(self, x):
    """transformers' RMSNorm, without its cast to float32 (the same formula in float64)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _f64(model):
    """A float64 model that computes in float64 throughout. transformers' RMSNorm casts its
    input to float32, so a float64 model's gradient is rounded to float32 at every norm;
    where the trie shares a token, that token's gradient is a sum whose order differs from
    the independent layout's, and the rounding turns a 1e-16 difference into ~1e-8."""
    import types

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm_f64, m)
    return model


def _lm(arch, seed, **shape):
    return _f64(tiny_causal_lm(arch, vocab_size=96, initializer_range=0.2, seed=seed, dtype=F64, **shape))


def _models(seed):
    return _lm("qwen2", seed, hidden_size=32), _lm("llama", seed + 1, hidden_size=48, num_heads=4, num_kv_heads=4)


def _trajs(seed):
    # groups of 4 rollouts that share their task prefix, call-0 context and first 2 steps:
    # their first calls are identical, so the trie lays their action tokens out once
    return random_trajectories("summary", 8, seed=seed, group_size=4, vocab_size=96, calls=(3, 5),
                               group_context=True, group_steps=2)


def test_the_case_has_shared_action_tokens():
    trie = pack(_trajs(0), layout="trie")
    ind = pack(_trajs(0), layout="independent")
    assert trie.num_actions == ind.num_actions
    shared = trie.num_actions - len(set(trie.pred_index.tolist()))
    assert shared >= trie.num_actions // 4, shared  # many entries read a position another entry reads
    assert trie.num_tokens < pack(_trajs(0), layout="aligned", share_prefix="group").num_tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_actor_loss_and_opd_term_per_entry_on_shared_tokens(seed):
    """The fused actor loss (PPO surrogate + entropy + teacher reverse KL) on the trie batch
    against the independent one, entry by entry and in every gradient."""
    trajs = _trajs(seed)
    student, teacher = _models(seed)
    g = torch.Generator().manual_seed(seed)
    out, grads = {}, {}
    ppo = None
    for layout in ("independent", "trie"):
        batch = pack(trajs, layout=layout, share_prefix="group")
        with torch.no_grad():
            th = Actor(teacher).hidden(batch)  # the teacher under the same layout
        if ppo is None:  # per entry, different for the calls that share a token
            A = batch.num_actions
            ppo = PPOInputs(-torch.rand(A, generator=g, dtype=F64) * 3, torch.randn(A, generator=g, dtype=F64),
                            torch.rand(A, generator=g) > 0.3, ActorLossCoefs(clip_eps=0.2, entropy_coef=0.01,
                                                                             teacher_kl_coef=0.7),
                            normalizer=A + 3.0, kl_normalizer=A - 5.0)
        student.zero_grad()
        out[layout] = Actor(student)(batch, th, head_of(teacher), ppo=ppo)
        out[layout].loss.backward()
        grads[layout] = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
        if layout == "trie":
            ind = pack(trajs, layout="independent")
            for f in ("traj_index", "call_index", "token_index", "target_ids"):
                assert torch.equal(getattr(batch, f), getattr(ind, f)), f  # the same entries in the same order
            # the hard case: entries that share a token carry different advantages
            _, inv = torch.unique(batch.pred_index, return_inverse=True)
            spread = torch.zeros(int(inv.max()) + 1, dtype=F64).scatter_reduce(0, inv, ppo.advantages, "amax") - \
                torch.zeros(int(inv.max()) + 1, dtype=F64).scatter_reduce(0, inv, ppo.advantages, "amin")
            assert float(spread.max()) > 0.5
    a, b = out["independent"], out["trie"]
    assert a.loss.dtype == F64
    torch.testing.assert_close(b.loss, a.loss, **TOL)
    for f in ("logprobs", "entropy", "kl", "ratio"):
        torch.testing.assert_close(getattr(b, f), getattr(a, f), **TOL, msg=f)
    assert torch.equal(b.clipped, a.clipped)
    assert set(grads["trie"]) == set(grads["independent"]) and len(grads["trie"]) > 10
    for n, ga in grads["independent"].items():
        torch.testing.assert_close(grads["trie"][n], ga, **TOL, msg=n)


def _score_and_update(layout, seed, trajs, domain):
    from memopd.trainer.backend import make_backend
    from memopd.trainer.update import UpdateSettings, score, update

    student, teacher = _models(seed)
    critic_lm = _lm("qwen2", seed + 7, hidden_size=32)
    actor, critic = Actor(student), Critic(critic_lm).to(F64)
    ab = make_backend(actor, lr=1e-3, total_steps=8, max_grad_norm=None)
    cb = make_backend(critic, lr=1e-3, total_steps=8, max_grad_norm=None)
    steps = []  # every optimiser step's student gradients
    ab.optimizer.register_step_pre_hook(
        lambda opt, *_: steps.append([p.grad.clone() for grp in opt.param_groups for p in grp["params"]
                                      if p.grad is not None]))
    actor.eval()
    critic.eval()
    ppo = PPOSettings(clip_eps=0.2, value_clip=0.2, entropy_coef=0.01, teacher_kl_coef=0.7, ref_kl_coef=0.05,
                      gamma=1.0, lam=0.95)
    ref = _lm("qwen2", seed, hidden_size=32)
    scored = score(actor, critic, ref, teacher, trajs, teacher_layout=layout, max_tokens=4096, ppo=ppo, layout=layout,
                   action_domain=domain)
    actor.train()
    critic.train()
    settings = UpdateSettings(ppo, ppo_epochs=2, minibatches=2, max_tokens=4096, action_domain=domain,
                              pack_layout=layout)
    stats = update(ab, cb, trajs, scored, settings, teacher_head=head_of(teacher),
                   generator=torch.Generator().manual_seed(seed))
    return scored, stats, steps, [p.detach().clone() for p in student.parameters()]


@pytest.mark.parametrize("seed, domain", [(0, "exact"), (1, "naive")])
def test_score_and_update_on_trie_equal_independent_in_float64(seed, domain):
    """score() + update() (two epochs of two minibatches, the real optimiser) with the trie
    layout against the independent one: scored entries, logged statistics (clip fraction,
    entropy, teacher KL, approx KL, losses, gradient norms), every optimiser step's
    student gradients and the final weights; also with the naive action domain (re-encoded
    copies as entries too)."""
    trajs = _trajs(seed)
    ind = _score_and_update("independent", seed, trajs, domain)
    trie = _score_and_update("trie", seed, trajs, domain)
    for f in ("logp_old", "logp_ref", "values", "rewards", "advantages", "returns", "teacher_hidden"):
        torch.testing.assert_close(getattr(trie[0], f), getattr(ind[0], f), **TOL, msg=f)
    assert torch.equal(trie[0].offsets, ind[0].offsets)
    assert ind[1]["kl_teacher"] > 0 and ind[1]["optimizer_steps"] == 4 and 0 < ind[1]["clip_frac"] < 1
    assert set(trie[1]) == set(ind[1])
    for k, v in ind[1].items():
        assert trie[1][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert len(trie[2]) == len(ind[2]) == 4
    for step_t, step_i in zip(trie[2], ind[2]):
        assert len(step_t) == len(step_i) > 10
        for gt, gi in zip(step_t, step_i):
            torch.testing.assert_close(gt, gi, **TOL)
    for pt, pi in zip(trie[3], ind[3]):
        torch.testing.assert_close(pt, pi, **TOL)
