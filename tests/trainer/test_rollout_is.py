"""The sampler-mismatch correction (rollout_is = tis | mask) and the mismatch figures.

The fused actor loss takes the importance weights through its advantages (w_i >= 0 is a
constant of the update, so w_i * max(-A r, -A clip r) is the surrogate of w_i A). Checked
here against a float64 reference that forms the [N, V] logits and weights each token's
clipped surrogate explicitly: loss and gradients, with a teacher, entropy, dual clip and
tokens without a recorded sampler log-prob. Also the weights themselves on hand cases,
and the mismatch sums and figures against direct formulas.
"""
import math

import pytest
import torch

from memopd.ops import fused_linear_actor_loss
from memopd.rce import mismatch_figures, mismatch_sums
from memopd.trainer.ppo import ROLLOUT_IS_MODES, rollout_is_weights


def test_weights_on_hand_cases():
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -2.0])
    samp = torch.tensor([-1.0, -2.0, -0.5, math.nan, -1.0])  # rho = 1, e, e^-0.5, -, e^-1
    w, st = rollout_is_weights(old, samp, "none", 2.0)
    assert torch.equal(w, torch.ones(5)) and st["share_corrected"] == 0
    w, st = rollout_is_weights(old, samp, "tis", 2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-0.5), 1.0, math.exp(-1.0)]))
    assert st["share_corrected"] == pytest.approx(1 / 5)
    w, st = rollout_is_weights(old, samp, "mask", 2.0)  # kept: rho in [0.5, 2]
    assert torch.equal(w, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]))
    assert st["share_corrected"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        rollout_is_weights(old, samp, "clip", 2.0)
    with pytest.raises(ValueError, match="cap must be > 1"):
        rollout_is_weights(old, samp, "tis", 1.0)


def _reference(h, W, b, y, adv, old, w, th, tW, clip, dual, ent_coef, kl_coef, T):
    """float64, materialising: sum_i w_i pg_i / N - ent_coef * mean H + kl_coef * mean KL."""
    s = (h @ W.T + b) / T
    logp = torch.log_softmax(s, -1)
    q = torch.log_softmax((th @ tW.T) / T, -1)
    lp = logp.gather(1, y[:, None])[:, 0]
    r = torch.exp(lp - old)
    pg = torch.maximum(-adv * r, -adv * r.clamp(1 - clip, 1 + clip))
    pg = torch.where(adv < 0, torch.minimum(pg, -dual * adv), pg)
    H = -(logp.exp() * logp).sum(-1)
    kl = (logp.exp() * (logp - q)).sum(-1)
    n = h.shape[0]
    return (w * pg).sum() / n - ent_coef * H.sum() / n + kl_coef * kl.sum() / n


@pytest.mark.parametrize("mode", [m for m in ROLLOUT_IS_MODES if m != "none"])
def test_weighted_fused_loss_equals_float64_reference(mode, seed):
    g = torch.Generator().manual_seed(seed)
    N, H, V = 37, 24, 101
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1
    th = torch.randn(N, H, generator=g, dtype=torch.float64)
    tW = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    T = 0.9
    with torch.no_grad():
        true_lp = torch.log_softmax((h @ W.T + b) / T, -1).gather(1, y[:, None])[:, 0]
    old = true_lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)  # ratios clip on both sides
    # the sampler: near the old policy on most tokens, far off on some (hard cases for cap / mask)
    samp = old + 0.05 * torch.randn(N, generator=g, dtype=torch.float64)
    samp[::5] -= 2.0
    samp[1::7] += 2.0
    samp[3] = math.nan  # not recorded: weight 1
    w, st = rollout_is_weights(old, samp, mode, 1.5)
    assert 0 < st["share_corrected"] < 1
    clip, dual, ent_coef, kl_coef = 0.2, 3.0, 0.01, 0.5

    hf, Wf, bf = (t.clone().requires_grad_(True) for t in (h, W, b))
    out = fused_linear_actor_loss(hf, Wf, y, adv * w.double(), old, teacher_hidden=th, teacher_weight=tW,
                                  student_bias=bf, clip_eps=clip, dual_clip=dual, entropy_coef=ent_coef,
                                  teacher_kl_coef=kl_coef, temperature=T, backend="torch")
    out.loss.backward()
    hr, Wr, br = (t.clone().requires_grad_(True) for t in (h, W, b))
    ref = _reference(hr, Wr, br, y, adv, old, w.double(), th, tW, clip, dual, ent_coef, kl_coef, T)
    ref.backward()
    assert abs(out.loss.item() - ref.item()) <= 1e-10
    for got, want in ((hf.grad, hr.grad), (Wf.grad, Wr.grad), (bf.grad, br.grad)):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-11)
    # the weights changed the loss: the correction is not a no-op on these tokens
    plain = _reference(h, W, b, y, adv, old, torch.ones(N, dtype=torch.float64), th, tW, clip, dual, ent_coef, kl_coef, T)
    assert abs(plain.item() - ref.item()) > 1e-3


def test_mismatch_sums_and_figures():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    samp = torch.tensor([-1.0, -2.1, math.nan, -2.0])
    s = mismatch_sums(lp, samp, threshold=0.05)
    d = torch.tensor([0.0, 0.1, -1.0], dtype=torch.float64)
    assert s["n"] == 3 and s["over"] == 2
    assert s["abs_sum"] == pytest.approx(1.1) and s["abs_max"] == pytest.approx(1.0)
    assert s["k3_sum"] == pytest.approx(float((d.exp() - 1 - d).sum()))
    f = mismatch_figures(s, "mismatch")
    assert f["mismatch/mean_abs_dlogp"] == pytest.approx(1.1 / 3)
    assert f["mismatch/share_over_threshold"] == pytest.approx(2 / 3)
    assert f["mismatch/k3_kl"] > 0
    none = mismatch_figures(mismatch_sums(lp, torch.full_like(lp, math.nan)))
    assert all(math.isnan(v) for v in none.values())
