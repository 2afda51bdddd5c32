"""memopd.integrations.liger.LigerFusedLinearJSDLoss against Liger's own module
(liger-kernel 0.8.5, its chunked PyTorch path, which runs on CPU), in float64.

Liger accumulates its returned loss in a float32 scalar and computes the hard (CE) loss
on a float32 log-softmax, so values are compared at float32 precision and gradients
with the hard loss at ~1e-7; the soft (JSD) gradients alone agree to float64 rounding.
"""
import math

import pytest
import torch

from memopd.integrations.liger import LigerFusedLinearJSDLoss

liger = pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel not installed (pip install 'memopd[integrations]')")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs(seed, N=45, H=16, Ht=24, Vs=53, Vt=53, close=False, bias=True):
    g = torch.Generator().manual_seed(seed)
    f = dict(generator=g, dtype=torch.float64)
    hs = torch.randn(N, H, **f)
    ws = torch.randn(Vs, H, **f) * 0.5
    if close:  # teacher = student + noise: the divergence is ~1e-8, where cancellation would show
        ht, wt, Ht = hs.clone(), ws.clone() + 1e-4 * torch.randn(Vs, H, **f), H
    else:
        ht, wt = torch.randn(N, Ht, **f), torch.randn(Vt, Ht, **f) * 0.5
    bs = torch.randn(Vs, **f) if bias else None
    bt = None if not bias else (bs.clone() if close else torch.randn(wt.shape[0], **f))
    y = torch.randint(0, Vs, (N,), generator=g)
    y[torch.rand(N, generator=g) < 0.3] = -100
    return hs, ws, ht, wt, y, bs, bt


def _run(module, inputs):
    hs, ws, ht, wt, y, bs, bt = inputs
    leaves = [hs.clone().requires_grad_(), ws.clone().requires_grad_()]
    b = None if bs is None else bs.clone().requires_grad_()
    out = module(leaves[0], leaves[1], ht, wt, y, b, bt)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    grads = [t.grad for t in leaves] + ([] if b is None else [b.grad])
    return out, grads


CASES = [
    dict(),
    dict(beta=0.0),
    dict(beta=1.0, temperature=0.7),
    dict(beta=0.3, temperature=2.0, weight_hard_loss=0.2, weight_soft_loss=0.8),
    dict(beta=0.6, chunk_size=7, return_soft_hard_loss=True),
    dict(temperature=1.5, weight_hard_loss=0.0, ignore_index=5),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
def test_matches_liger_module(seed, kw):
    inputs = _inputs(seed)
    ref, ref_g = _run(liger.LigerFusedLinearJSDLoss(compiled=False, **kw), inputs)
    got, got_g = _run(LigerFusedLinearJSDLoss(**kw), inputs)
    assert isinstance(got, tuple) == isinstance(ref, tuple)
    for a, b in zip(got if isinstance(got, tuple) else [got], ref if isinstance(ref, tuple) else [ref]):
        assert a.shape == b.shape == ()
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-7)
    tol = 1e-12 if kw.get("weight_hard_loss", 0.5) == 0.0 else 1e-7
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_soft_gradients_float64_exact(seed, beta):
    """Soft loss only: nothing in float32 on Liger's side, so float64 agreement."""
    inputs = _inputs(seed + 1, bias=False)
    kw = dict(beta=beta, weight_hard_loss=0.0, weight_soft_loss=1.0, temperature=1.3)
    _, ref_g = _run(liger.LigerFusedLinearJSDLoss(compiled=False, **kw), inputs)
    _, got_g = _run(LigerFusedLinearJSDLoss(**kw), inputs)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_teacher_close_to_student(seed):
    inputs = _inputs(seed + 2, close=True)
    kw = dict(beta=0.4, weight_hard_loss=0.0, weight_soft_loss=1.0, return_soft_hard_loss=True)
    ref, _ = _run(liger.LigerFusedLinearJSDLoss(compiled=False, **kw), inputs)
    got, _ = _run(LigerFusedLinearJSDLoss(**kw), inputs)
    assert 0 < float(got[1].detach()) < 1e-6
    torch.testing.assert_close(got[1].double(), ref[1].double(), rtol=1e-5, atol=1e-12)


def test_smaller_student_head_padded_as_liger(seed):
    """Liger pads a smaller student head with logit-0 columns; the drop-in does the same,
    and `vocab_size=` switches to excluding the padded rows of both heads instead."""
    inputs = _inputs(seed + 3, Vs=50, Vt=57)
    kw = dict(beta=0.5, temperature=1.7, return_soft_hard_loss=True)
    ref, ref_g = _run(liger.LigerFusedLinearJSDLoss(compiled=False, **kw), inputs)
    got, got_g = _run(LigerFusedLinearJSDLoss(**kw), inputs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-7)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
    trimmed, _ = _run(LigerFusedLinearJSDLoss(vocab_size=50, **kw), inputs)
    hs, ws, ht, wt, y, bs, bt = inputs
    keep = y != -100
    s = torch.log_softmax((hs @ ws.T + bs)[keep] / 1.7, -1)
    t = torch.log_softmax((ht @ wt[:50].T + bt[:50])[keep] / 1.7, -1)
    m = torch.logsumexp(torch.stack([s, t]), 0) - math.log(2.0)
    jsd = 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)
    torch.testing.assert_close(trimmed[1], jsd.mean(), rtol=1e-12, atol=1e-14)
    assert abs(float(trimmed[1].detach()) - float(got[1].detach())) > 1e-3  # the two conventions really differ


def test_refusals():
    inputs = _inputs(0, Vs=57, Vt=50)
    with pytest.raises(ValueError, match="vocab_size"):
        _run(LigerFusedLinearJSDLoss(), inputs)
    with pytest.raises(ValueError, match="Temperature"):
        LigerFusedLinearJSDLoss(temperature=0)
