"""memopd.integrations.verl against verl's conventions written out naively in float64:
logits[:, -R-1:-1] / T -> log-softmax / entropy, the vanilla PPO surrogate and agg_loss,
and the packed forward of a padded multi-turn batch against a plain padded HF forward.
verl itself is not installed: the references below restate its formulas."""
import pytest
import torch

from memopd.integrations.verl import LOSS_AGG_MODES, agg_loss, compute_log_prob, packed_log_prob, policy_loss
from memopd.models import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(seed, B=3, L=11, R=5, H=8, V=37, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.7).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    responses = torch.randint(0, V, (B, R), generator=g)
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[0, 3:] = False          # ragged: right-padded responses
    mask[1, 1:] = False
    mask[2, 2] = False           # a multi-turn hole (a tool token inside the response)
    return hidden, weight, bias, responses, mask


def _reference_logits(hidden, weight, bias, R, T):
    return (hidden[:, -R - 1:-1] @ weight.T + bias) / T


def _reference_policy_loss(logp, old, adv, mask, mode, low=0.2, high=0.28, c=3.0, ent=None, ent_coef=0.0):
    ratio = torch.exp(torch.clamp(logp - old, -20, 20))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    pg = torch.where(adv < 0, torch.minimum(-adv * c, clip1), clip1)
    m = mask.double()
    if mode == "token-mean":
        agg = lambda x: (x * m).sum() / (m.sum() + 1e-8)  # noqa: E731
    elif mode == "seq-mean-token-sum":
        agg = lambda x: (x * m).sum(-1).mean()  # noqa: E731
    elif mode == "seq-mean-token-mean":
        agg = lambda x: ((x * m).sum(-1) / m.sum(-1)).mean()  # noqa: E731
    else:
        agg = lambda x: (x * m).sum() / m.shape[-1]  # noqa: E731
    return agg(pg) - ent_coef * agg(ent)


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_compute_log_prob_matches_verl_slicing(seed, T):
    hidden, weight, bias, responses, mask = _batch(seed)
    R = responses.shape[1]
    lp, ent = compute_log_prob(hidden, weight, responses, mask, bias=bias, temperature=T, calculate_entropy=True)
    logits = _reference_logits(hidden, weight, bias, R, T)
    ls = torch.log_softmax(logits, -1)
    ref_lp = ls.gather(-1, responses[..., None])[..., 0]
    ref_ent = -(ls.exp() * ls).sum(-1)
    assert lp.shape == ent.shape == (3, R)
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(ent[mask], ref_ent[mask], rtol=0, atol=1e-12)
    assert bool((lp[~mask] == 0).all()) and bool((ent[~mask] == 0).all())
    (lp.sum() + ent.sum()).backward()
    g = [hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()]
    for t in (hidden, weight, bias):
        t.grad = None
    ((ref_lp * mask).sum() + (ref_ent * mask).sum()).backward()
    for got, t in zip(g, (hidden, weight, bias)):
        torch.testing.assert_close(got, t.grad, rtol=0, atol=1e-11)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_verl_surrogate(seed, mode):
    hidden, weight, bias, responses, mask = _batch(seed + 1)
    g = torch.Generator().manual_seed(seed)
    R = responses.shape[1]
    ls = torch.log_softmax(_reference_logits(hidden, weight, bias, R, 0.9), -1)
    ref_lp = ls.gather(-1, responses[..., None])[..., 0]
    # old log-probs around the new ones so that both clip branches and the dual clip are taken
    old = (ref_lp.detach() + torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 0.5)
    adv = torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 2
    ent_ref = -(ls.exp() * ls).sum(-1)
    loss, metrics = policy_loss(hidden, weight, responses, mask, old, adv, bias=bias, clip_ratio_low=0.2,
                                clip_ratio_high=0.28, entropy_coeff=0.01, loss_agg_mode=mode, temperature=0.9)
    ref = _reference_policy_loss(ref_lp, old, adv, mask, mode, ent=ent_ref, ent_coef=0.01)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-13)
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0
    loss.backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    ref.backward()
    for a, t in zip(got, (hidden, weight, bias)):
        torch.testing.assert_close(a, t.grad, rtol=1e-10, atol=1e-12)


def test_policy_loss_teacher_kl_term(seed):
    hidden, weight, bias, responses, mask = _batch(seed + 2)
    g = torch.Generator().manual_seed(seed)
    t_hidden = torch.randn(3, 11, 6, generator=g, dtype=torch.float64)
    t_weight = torch.randn(37, 6, generator=g, dtype=torch.float64)
    old = torch.full(responses.shape, -3.0, dtype=torch.float64)
    adv = torch.zeros(responses.shape, dtype=torch.float64)
    loss, metrics = policy_loss(hidden, weight, responses, mask, old, adv, bias=bias, teacher_hidden_states=t_hidden,
                                teacher_weight=t_weight, kl_coef=0.5, loss_agg_mode="seq-mean-token-mean")
    ls = torch.log_softmax(_reference_logits(hidden, weight, bias, 5, 1.0), -1)
    lt = torch.log_softmax(t_hidden[:, -6:-1] @ t_weight.T, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    ref = 0.5 * agg_loss(kl, mask, "seq-mean-token-mean")
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["kl"], ref.detach() / 0.5, rtol=1e-12, atol=1e-14)


def test_bad_inputs_are_refused():
    hidden, weight, bias, responses, mask = _batch(0)
    with pytest.raises(ValueError, match="0 < R < L"):
        compute_log_prob(hidden[:, :5], weight, responses)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(hidden, weight, responses, mask, torch.zeros(3, 5), torch.zeros(3, 5), loss_agg_mode="mean")
    with pytest.raises(ValueError, match="together"):
        policy_loss(hidden, weight, responses, mask, torch.zeros(3, 5), torch.zeros(3, 5), teacher_weight=weight)


def _multiturn_batch(seed, V):
    """verl layout: prompt left-padded to P, response (assistant + tool turns) right-padded
    to R; response_mask is 0 on tool tokens and padding; position ids count real tokens."""
    g = torch.Generator().manual_seed(seed)
    P, R = 6, 9
    prompt_lens, resp_lens = [6, 3, 4, 1], [9, 4, 7, 2]
    B = len(prompt_lens)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    att = torch.zeros(B, P + R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        ids[b, P - p:P] = torch.randint(3, V, (p,), generator=g)
        ids[b, P:P + r] = torch.randint(3, V, (r,), generator=g)
        att[b, P - p:P + r] = 1
        rmask[b, :r] = 1
    rmask[0, 3:5] = 0  # a tool observation inside the first response
    rmask[2, 1] = 0
    pos = (torch.cumsum(att, 1) - 1).clamp_min(0)
    return ids, att, pos, ids[:, P:].clone(), rmask


def test_packed_log_prob_matches_padded_forward(seed):
    V = 61
    model = tiny_causal_lm("qwen2", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           seed=seed, initializer_range=0.2)
    ids, att, pos, responses, rmask = _multiturn_batch(seed, V)
    R = responses.shape[1]
    T = 0.8
    with torch.no_grad():
        lp, ent = packed_log_prob(model, ids, att, pos, responses, rmask, temperature=T, calculate_entropy=True)
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -R - 1:-1].double() / T
    ls = torch.log_softmax(logits, -1)
    ref_lp = ls.gather(-1, responses[..., None])[..., 0]
    ref_ent = -(ls.exp() * ls).sum(-1)
    m = rmask.bool()
    assert lp.shape == (4, R) and int(m.sum()) == 19
    torch.testing.assert_close(lp[m].double(), ref_lp[m], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent[m].double(), ref_ent[m], rtol=0, atol=2e-5)
    assert bool((lp[~m] == 0).all())
    # the gradient flows into the model through the packed forward
    lp2, _ = packed_log_prob(model, ids, att, pos, responses, rmask)
    lp2.sum().backward()
    assert model.lm_head.weight.grad is not None and float(model.model.embed_tokens.weight.grad.abs().sum()) > 0


def test_packed_refuses_inconsistent_batches():
    ids, att, pos, responses, rmask = _multiturn_batch(0, 61)
    model = tiny_causal_lm("qwen2", vocab_size=61, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="differ from the last R columns"):
        packed_log_prob(model, ids, att, pos, (responses + 1) % 61, rmask)
    with pytest.raises(ValueError, match="multi-axis"):
        packed_log_prob(model, ids, att, pos[:, None].expand(-1, 3, -1), responses, rmask)
