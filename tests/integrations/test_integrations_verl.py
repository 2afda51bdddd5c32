"""memopd.integrations.verl against verl's own functions (verl 0.9.1, loaded by
tests/_verl_reference.py without verl's heavy package imports): the response log-probs
and entropy against `torch_functional.logprobs_from_logits` / `entropy_from_logits` on
verl's slicing `logits[:, -R-1:-1] / T`, the actor loss against
`core_algos.compute_policy_loss_vanilla` + `agg_loss` (every `loss_agg_mode`, with and
without verl's global batch info), values, metrics and gradients in float64; and the
packed forward of a padded multi-turn batch against a plain padded HF forward. The
comparisons with verl skip, naming why, when verl is not installed
(`pip install --no-deps "verl==0.9.1" omegaconf`)."""
import pytest
import torch
from _verl_reference import load_verl_core

from memopd.integrations.verl import LOSS_AGG_MODES, agg_loss, compute_log_prob, packed_log_prob, policy_loss
from memopd.models import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def verl():
    try:
        return load_verl_core()
    except ImportError as e:
        pytest.skip(f"verl's own functions are not importable: {e}")


def _batch(seed, B=3, L=11, R=5, H=8, V=37, dtype=torch.float64, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.7).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    responses = torch.randint(0, V, (B, R), generator=g)
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[0, 3:] = False          # ragged: right-padded responses
    mask[1, 1:] = False
    mask[2, 2] = False           # a multi-turn hole (a tool token inside the response)
    if empty_row:
        mask[1] = False          # a response with no kept token: verl's seq-mean modes skip it
    return hidden, weight, bias, responses, mask


def _verl_logits(hidden, weight, bias, R, T):
    """What a verl actor feeds its loss: the positions that predict the response, / T."""
    return (hidden[:, -R - 1:-1] @ weight.T + bias) / T


def _grads(loss, tensors):
    out = torch.autograd.grad(loss, tensors)
    return [g.clone() for g in out]


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_compute_log_prob_matches_verl(verl, seed, T):
    _, tf = verl
    hidden, weight, bias, responses, mask = _batch(seed)
    R = responses.shape[1]
    lp, ent = compute_log_prob(hidden, weight, responses, mask, bias=bias, temperature=T, calculate_entropy=True)
    logits = _verl_logits(hidden, weight, bias, R, T)
    ref_lp = tf.logprobs_from_logits(logits, responses)
    ref_ent = tf.entropy_from_logits(logits)
    assert lp.shape == ent.shape == (3, R)
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(ent[mask], ref_ent[mask], rtol=0, atol=1e-12)
    assert bool((lp[~mask] == 0).all()) and bool((ent[~mask] == 0).all())
    params = [hidden, weight, bias]
    got = _grads(lp.sum() + ent.sum(), params)
    want = _grads((ref_lp * mask).sum() + (ref_ent * mask).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


GLOBAL_INFO = {"local": {}, "dp2": {"dp_size": 2, "batch_num_tokens": 17, "global_batch_size": 5,
                                    "loss_scale_factor": 8}}


@pytest.mark.parametrize("info", list(GLOBAL_INFO))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_verl(verl, seed, mode, info):
    core, _ = verl
    g = torch.Generator().manual_seed(seed)
    for empty_row in (False, True):
        *_, mask = _batch(seed, empty_row=empty_row)
        loss_mat = torch.randn(mask.shape, generator=g, dtype=torch.float64)
        loss_mat[~mask] = 1e3  # what sits under the mask must not matter
        got = agg_loss(loss_mat, mask, mode, **GLOBAL_INFO[info])
        want = core.agg_loss(loss_mat, mask, mode, **GLOBAL_INFO[info])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _count_fused(monkeypatch):
    """Counts the calls of `fused_linear_actor_loss` (the path with gradients in the forward)."""
    import memopd.ops

    calls = []
    real = memopd.ops.fused_linear_actor_loss
    monkeypatch.setattr(memopd.ops, "fused_linear_actor_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("entropy_coeff", [0.01, 0.0])
@pytest.mark.parametrize("info", list(GLOBAL_INFO))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_verl(verl, seed, mode, info, entropy_coeff, monkeypatch):
    """Both paths: the fused actor loss (always, except seq-mean-token-mean with an entropy
    bonus; its per-sequence weights are folded into the advantages when there is none) and
    the recomputing one (seq-mean-token-mean with an entropy bonus)."""
    from omegaconf import OmegaConf

    core, tf = verl
    hidden, weight, bias, responses, mask = _batch(seed + 1)
    g = torch.Generator().manual_seed(seed)
    R = responses.shape[1]
    logits = _verl_logits(hidden, weight, bias, R, 0.9)
    ref_lp = tf.logprobs_from_logits(logits, responses)
    # old log-probs around the new ones so that both clip branches and the dual clip are taken
    old = ref_lp.detach() + torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 2
    old[0, 0], adv[0, 0] = ref_lp[0, 0].detach() - 2.0, -1.5  # ratio e^2 > clip_ratio_c with A < 0: the dual clip
    gbi = GLOBAL_INFO[info]
    fused = _count_fused(monkeypatch)
    loss, metrics = policy_loss(hidden, weight, responses, mask, old, adv, bias=bias, clip_ratio_low=0.2,
                                clip_ratio_high=0.28, entropy_coeff=entropy_coeff, loss_agg_mode=mode, temperature=0.9,
                                global_batch_info=gbi)
    # every mode but seq-mean-token-mean weights all kept tokens alike
    assert len(fused) == (1 if mode != "seq-mean-token-mean" or entropy_coeff == 0.0 else 0)
    # verl's ppo_loss: the vanilla policy loss minus entropy_coeff x the aggregated entropy
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                               "clip_ratio_c": 3.0, "global_batch_info": gbi})
    pg_loss, pg_metrics = core.compute_policy_loss_vanilla(old, ref_lp, adv, mask, loss_agg_mode=mode, config=config)
    ent = core.agg_loss(tf.entropy_from_logits(logits), mask, mode, **gbi)
    ref = pg_loss - entropy_coeff * ent
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(metrics["pg_loss"], pg_loss.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(metrics["entropy"], ent.detach(), rtol=1e-12, atol=1e-13)
    for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert float(metrics[name]) == pytest.approx(pg_metrics[f"actor/{name}"], rel=1e-12, abs=1e-14), name
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0 and float(metrics["pg_clipfrac_lower"]) > 0.0
    params = [hidden, weight, bias]
    for a, b in zip(_grads(loss, params), _grads(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_policy_loss_bf16_head_keeps_fp32_advantages_and_old_log_probs(verl, seed, monkeypatch):
    """A bf16 model (hidden states and lm_head in bf16) with verl's fp32 old log-probs and
    advantages, through the fused path: the loss and metrics equal verl's on the same bf16
    values in float64 to fp32 rounding; the advantages and old log-probs are not rounded
    to bf16 on the way (that alone moves the loss by ~1e-3 relative)."""
    from omegaconf import OmegaConf

    core, tf = verl
    hidden, weight, bias, responses, mask = _batch(seed + 4, H=32)
    h16, w16 = hidden.detach().bfloat16(), weight.detach().bfloat16()
    logits = _verl_logits(h16.double(), w16.double(), torch.zeros(37, dtype=torch.float64), 5, 1.0)
    ref_lp = tf.logprobs_from_logits(logits, responses)
    g = torch.Generator().manual_seed(seed)
    old = (ref_lp + torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 0.3).clamp_max(0.0).float()
    adv = (torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 2).float()
    fused = _count_fused(monkeypatch)
    loss, metrics = policy_loss(h16.requires_grad_(), w16.requires_grad_(), responses, mask, old, adv,
                                clip_ratio_low=0.9, clip_ratio_high=10.0, clip_ratio_c=100.0)  # every ratio enters
    assert fused == [1]
    config = OmegaConf.create({"clip_ratio": 0.9, "clip_ratio_low": 0.9, "clip_ratio_high": 10.0,
                               "clip_ratio_c": 100.0, "global_batch_info": {}})
    pg_loss, _ = core.compute_policy_loss_vanilla(old.double(), ref_lp, adv.double(), mask, loss_agg_mode="token-mean",
                                                  config=config)
    assert loss.dtype == torch.float32 and float(metrics["pg_clipfrac"]) == 0.0
    torch.testing.assert_close(loss.double(), pg_loss, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(metrics["pg_loss"].double(), pg_loss, rtol=2e-5, atol=1e-6)


def test_policy_loss_old_log_probs_below_minus_20_take_verls_clamp(verl, seed, monkeypatch):
    """Old log-probs below -20 (where verl clamps the log-ratio at +20): the recomputing
    path, equal to verl, finite where the ratio would overflow."""
    from omegaconf import OmegaConf

    core, tf = verl
    hidden, weight, bias, responses, mask = _batch(seed + 3)
    logits = _verl_logits(hidden, weight, bias, responses.shape[1], 1.0)
    ref_lp = tf.logprobs_from_logits(logits, responses)
    old = ref_lp.detach().clone()
    old[0, 0] = -900.0  # e^900 overflows even float64
    adv = torch.zeros_like(old)
    adv[2, 0] = 1.5
    fused = _count_fused(monkeypatch)
    loss, _ = policy_loss(hidden, weight, responses, mask, old, adv, bias=bias)
    assert fused == [] and torch.isfinite(loss)
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                               "global_batch_info": {}})
    pg_loss, _ = core.compute_policy_loss_vanilla(old, ref_lp, adv, mask, loss_agg_mode="token-mean", config=config)
    torch.testing.assert_close(loss, pg_loss, rtol=1e-12, atol=1e-14)


def test_policy_loss_log_ratio_below_minus_20_takes_verls_clamp(verl, seed, monkeypatch):
    """A kept token whose new log-prob is more than 20 below its old one, with A > 0: verl
    clamps the log-ratio at -20 (a constant there, no gradient); the fused op, which does
    not clamp, is tried and the loss is taken from the recomputing path, equal to verl."""
    from omegaconf import OmegaConf

    core, tf = verl
    hidden, weight, bias, responses, mask = _batch(seed + 4)
    with torch.no_grad():
        weight.mul_(12.0)  # wide logits: some response tokens get log-probs far below -20
    logits = _verl_logits(hidden, weight, bias, responses.shape[1], 1.0)
    ref_lp = tf.logprobs_from_logits(logits, responses)
    low_lp = torch.where(mask, ref_lp.detach(), 0.0)
    idx = divmod(int(low_lp.argmin()), responses.shape[1])
    assert float(low_lp[idx]) < -21.0
    g = torch.Generator().manual_seed(seed)
    old = ref_lp.detach() + torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) * 0.3
    old = torch.maximum(old, torch.full_like(old, -19.0))  # every old log-prob >= -20
    old[idx] = -0.5
    adv = torch.randn(ref_lp.shape, generator=g, dtype=torch.float64)
    adv[idx] = 1.5
    fused = _count_fused(monkeypatch)
    loss, metrics = policy_loss(hidden, weight, responses, mask, old, adv, bias=bias, clip_ratio_low=0.2,
                                clip_ratio_high=0.28)
    assert fused == [1]  # tried, then left for the recomputing path
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                               "clip_ratio_c": 3.0, "global_batch_info": {}})
    pg_loss, pg_metrics = core.compute_policy_loss_vanilla(old, ref_lp, adv, mask, loss_agg_mode="token-mean",
                                                           config=config)
    torch.testing.assert_close(loss, pg_loss, rtol=1e-12, atol=1e-14)
    assert float(metrics["ppo_kl"]) == pytest.approx(pg_metrics["actor/ppo_kl"], rel=1e-12)
    params = [hidden, weight, bias]
    for a, b in zip(_grads(loss, params), _grads(pg_loss, params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_policy_loss_teacher_kl_term(verl, seed, mode, monkeypatch):
    """The teacher term alone (zero advantages), through the recomputing path (seq-mean)
    and the fused one (token-mean), values and gradients against a float64 reference."""
    core, tf = verl
    hidden, weight, bias, responses, mask = _batch(seed + 2)
    g = torch.Generator().manual_seed(seed)
    t_hidden = torch.randn(3, 11, 6, generator=g, dtype=torch.float64)
    t_weight = torch.randn(37, 6, generator=g, dtype=torch.float64)
    old = torch.full(responses.shape, -3.0, dtype=torch.float64)
    adv = torch.zeros(responses.shape, dtype=torch.float64)
    fused = _count_fused(monkeypatch)
    loss, metrics = policy_loss(hidden, weight, responses, mask, old, adv, bias=bias, teacher_hidden_states=t_hidden,
                                teacher_weight=t_weight, teacher_kl_coef=0.5, loss_agg_mode=mode)
    assert len(fused) == (mode == "token-mean")
    ls = torch.log_softmax(_verl_logits(hidden, weight, bias, 5, 1.0), -1)
    lt = torch.log_softmax(t_hidden[:, -6:-1] @ t_weight.T, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)  # full-vocabulary reverse KL: memopd's term, verl has no such loss
    ref = 0.5 * core.agg_loss(kl, mask, mode)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["kl"], ref.detach() / 0.5, rtol=1e-12, atol=1e-14)
    params = [hidden, weight, bias]
    for a, b in zip(_grads(loss, params), _grads(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_agg_loss_without_verl_counts_what_verl_counts():
    """Two cases checkable by hand, so a machine without verl still covers the rules."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert float(agg_loss(loss_mat, mask, "token-mean")) == pytest.approx(7 / 3)
    assert float(agg_loss(loss_mat, mask, "token-sum")) == 7
    assert float(agg_loss(loss_mat, mask, "seq-mean-token-sum")) == pytest.approx((3 + 4) / 2)  # empty row skipped
    assert float(agg_loss(loss_mat, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2, rel=1e-7)
    assert float(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")) == pytest.approx(3.5 / 3)
    assert float(agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=7)) == pytest.approx(2.0)
    assert float(agg_loss(loss_mat, torch.zeros_like(mask), "token-mean")) == 0.0
    with_nan = loss_mat.masked_fill(~mask.bool(), float("nan"))  # e.g. a log-prob of padding
    assert float(agg_loss(with_nan, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2, rel=1e-7)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(loss_mat, mask, "token-mean", dp_size=2)


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
