"""The C++ core's logit-chunk kernels (csrc/logit_chunks.cpp through
memopd/ops/_native_chunks.py) against float64, in both compiled copies (AVX2+FMA and the
portable one), with masked entries, ragged chunk widths, one row and several threads; and
the fused ops with the kernels switched off (MEMOPD_NATIVE_CHUNKS=0), so that the PyTorch
elementwise path the kernels replace stays tested as well."""
from __future__ import annotations

import math

import pytest
import torch

from memopd.ops import _native_chunks as nc

pytestmark = pytest.mark.skipif(not nc._HAVE, reason="memopd._C was built without the logit-chunk kernels")

LOG2E = 1.0 / math.log(2.0)
SHAPES = [(1, 1), (3, 7), (5, 256), (9, 257), (17, 1000), (64, 4099)]


@pytest.fixture(params=["auto", "base"])
def isa(request):
    used = nc._C.set_logit_chunks_isa(request.param)
    yield used
    nc._C.set_logit_chunks_isa("auto")


def _block(seed, n, c, masked=True):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, c, generator=g) * 4
    t = s + torch.randn(n, c, generator=g) * 2
    if masked and c > 2:  # 300 nats below the row's max: below 2^-126, exactly nothing
        s[:, -1] = s.amax(1) - 300.0
        t[:, -2] = t.amax(1) - 300.0
    return s, t


def _ref_sums(s, t, m_s, m_t, weight_teacher):
    s64, t64 = s.double(), t.double()
    xs = s64 - m_s.double()[:, None]
    es = torch.exp(xs)
    et = torch.exp(t64 - m_t.double()[:, None])
    return es.sum(1), (LOG2E * xs * es).sum(1), et.sum(1), ((s64 - t64) * (et if weight_teacher else es)).sum(1)


@pytest.mark.parametrize("n,c", SHAPES)
@pytest.mark.parametrize("weight_teacher", [False, True])
def test_softmax_sums_match_float64(isa, seed, n, c, weight_teacher):
    s, t = _block(seed, n, c)
    m_s, m_t = s.amax(1), t.amax(1)
    got = [torch.full((n,), 0.25) for _ in range(4)]  # the kernel adds to what is there
    nc.softmax_sums(s, t, m_s, m_t, *got, weight_teacher=weight_teacher)
    for name, a, r in zip(("z_s", "a_s", "z_t", "e_d"), got, _ref_sums(s, t, m_s, m_t, weight_teacher)):
        err = ((a.double() - 0.25) - r).abs().max().item()
        scale = 1.0 + r.abs().max().item()
        assert err <= 2e-6 * scale, f"{name} [{isa}] {n}x{c}: err {err:.2e} (scale {scale:.1f}, seed={seed})"
    only = [torch.zeros(n), torch.zeros(n)]
    nc.softmax_sums(s, None, m_s, None, only[0], only[1], None, None, weight_teacher=False)
    assert torch.equal(only[0] + 0.25, got[0]) and torch.equal(only[1] + 0.25, got[1]), "teacher-less sums differ"


@pytest.mark.parametrize("n,c", SHAPES)
@pytest.mark.parametrize("mode", [nc.MODE_NONE, nc.MODE_DIFF, nc.MODE_GIVEN])
def test_dlogits_match_float64(isa, seed, n, c, mode):
    s, t = _block(seed, n, c)
    g = torch.Generator().manual_seed(seed + 1)
    lse = torch.logsumexp(s.double(), 1).float()
    a, b, d = (torch.randn(n, generator=g) for _ in range(3))
    p = torch.exp(s.double() - lse.double()[:, None])
    x = {nc.MODE_NONE: 0.0, nc.MODE_DIFF: s.double() - t.double(), nc.MODE_GIVEN: t.double()}[mode]
    ref = p * (a.double()[:, None] + b.double()[:, None] * LOG2E * (s.double() - lse.double()[:, None])
               + d.double()[:, None] * x)
    out = s.clone()
    ret = nc.dlogits(out, None if mode == nc.MODE_NONE else t, lse, a, b, None if mode == nc.MODE_NONE else d, mode)
    assert ret is out, "dlogits works in place"
    err = (out.double() - ref).abs().max().item()
    assert err <= 2e-6 * (1.0 + ref.abs().max().item()), f"[{isa}] {n}x{c} mode {mode}: err {err:.2e} (seed={seed})"
    if c > 2:
        assert (out[:, -1] == 0).all(), "a column 300 nats below the max got a gradient"


@pytest.mark.parametrize("n,c", SHAPES)
@pytest.mark.parametrize("gap", [2.0, 1e-3, 60.0])
def test_forward_kl_dlogits_match_float64(isa, seed, n, c, gap):
    """MODE_FORWARD_KL: p (a + b log2 p) + d (q - p), with q - p to relative precision where
    q ~ p (gap 1e-3), and exact where the teacher puts far more mass (gap 60: q/p up to e^200)."""
    if not nc.has_forward_kl():
        pytest.skip("memopd._C was built without MODE_FORWARD_KL")
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, c, generator=g) * 4
    t = s + torch.randn(n, c, generator=g) * gap
    if c > 2:  # both distributions put nothing there
        s[:, -1] = s.amax(1) - 300.0
        t[:, -1] = t.amax(1) - 300.0
    lse_s64, lse_t64 = torch.logsumexp(s.double(), 1), torch.logsumexp(t.double(), 1)
    lse, lse_t, dlse = lse_s64.float(), lse_t64.float(), (lse_s64 - lse_t64).float()
    a, b, d = (torch.randn(n, generator=g) for _ in range(3))
    s64, t64 = s.double(), t.double()
    l = s64 - lse.double()[:, None]
    p = torch.exp(l)
    # q as the kernel defines it from its inputs: e^{t - lse_t} where -δ > 1/2, else p e^{-δ}
    nd = dlse.double()[:, None] - (s64 - t64)
    q_minus_p = torch.where(nd > 0.5, torch.exp(t64 - lse_t.double()[:, None]) - p, p * torch.expm1(nd))
    for coef in ((a, b, d), (torch.zeros(n), torch.zeros(n), torch.ones(n))):  # the full form; q - p alone
        A, B, D = (x.double()[:, None] for x in coef)
        ref = p * (A + B * LOG2E * l) + D * q_minus_p
        out = nc.dlogits(s.clone(), t, lse, *coef, nc.MODE_FORWARD_KL, lse_t=lse_t, dlse=dlse)
        err = (out.double() - ref).abs().max().item()
        # fp32 roundoff, plus that of t - lse_t itself where the logits are large (gap 60)
        rel = 2e-6 + 2 * 2.0 ** -24 * t.abs().max().item()
        assert err <= rel * ref.abs().max().item() + 1e-30, f"[{isa}] {n}x{c} gap {gap}: err {err:.2e} (seed={seed})"
        assert torch.isfinite(out).all()
    if c > 2:
        assert (out[:, -1] == 0).all(), "a column 300 nats below both maxima got a gradient"
    with pytest.raises(ValueError, match="MODE_FORWARD_KL"):
        nc.dlogits(s.clone(), t, lse, a, b, d, nc.MODE_FORWARD_KL)


@pytest.mark.parametrize("n,c", SHAPES)
@pytest.mark.parametrize("gap,beta", [(2.0, 0.5), (2.0, 0.1), (60.0, 0.5), (2.0, 1.0)])
def test_jsd_weights_match_float64(isa, seed, n, c, gap, beta):
    """The JSD weight log(β q/p + 1 - β) written over t, and Σ p w, Σ q w, against float64:
    absolute precision, finite however far q is above p (gap 60: q/p up to e^200)."""
    if not nc.has_jsd_weights():
        pytest.skip("memopd._C was built without jsd_weights")
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, c, generator=g) * 4
    t = s + torch.randn(n, c, generator=g) * gap
    lse_s64, lse_t64 = torch.logsumexp(s.double(), 1), torch.logsumexp(t.double(), 1)
    lse_s, lse_t, dlse = lse_s64.float(), lse_t64.float(), (lse_s64 - lse_t64).float()
    s64, t64 = s.double(), t.double()
    x = math.log(beta) + dlse.double()[:, None] - (s64 - t64)  # log(β q/p)
    w_ref = x if beta == 1.0 else torch.logaddexp(x, torch.full_like(x, math.log1p(-beta)))
    p = torch.exp(s64 - lse_s.double()[:, None])
    q = torch.exp(t64 - lse_t.double()[:, None])
    sp, sq = torch.full((n,), 0.5), torch.full((n,), 0.5)  # the kernel adds to what is there
    w = t.clone()
    assert nc.jsd_weights(s, w, lse_s, lse_t, dlse, beta, sp, sq) is w, "jsd_weights works in place over t"
    # fp32 roundoff of the weight, and that of s - t itself where the logits are large
    tol = 2e-6 * (1.0 + w_ref.abs()) + 4 * 2.0 ** -24 * torch.maximum(s64.abs(), t64.abs())
    bad = ((w.double() - w_ref).abs() > tol)
    assert not bad.any() and torch.isfinite(w).all(), f"[{isa}] {n}x{c} gap {gap} beta {beta}: weight off (seed={seed})"
    for name, got, wt in (("sum p w", sp, p), ("sum q w", sq, q)):
        ref = (wt * w_ref).sum(1)
        err = ((got.double() - 0.5) - ref).abs()
        assert (err <= (wt * tol).sum(1) + 2e-6 * (1.0 + ref.abs())).all(), f"{name} [{isa}] {n}x{c}: {err.max():.2e}"
    with pytest.raises(ValueError, match="beta"):
        nc.jsd_weights(s, t.clone(), lse_s, lse_t, dlse, 0.0, sp, sq)


def test_threads_split_rows_without_changing_a_bit(seed):
    s, t = _block(seed, 300, 2048)
    m_s, m_t = s.amax(1), t.amax(1)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            z = [torch.zeros(300) for _ in range(4)]
            nc.softmax_sums(s, t, m_s, m_t, *z, weight_teacher=False)
            ds = nc.dlogits(s.clone(), t, torch.logsumexp(s, 1), z[0], z[1], z[2], nc.MODE_DIFF)
            outs.append((z, ds))
    finally:
        torch.set_num_threads(before)
    for z, ds in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(z, outs[0][0])) and torch.equal(ds, outs[0][1])


def test_bad_blocks_are_refused_by_name():
    s = torch.zeros(4, 8)
    v = torch.zeros(4)
    with pytest.raises(ValueError, match="float32"):
        nc.softmax_sums(s.double(), None, v, None, v, v, None, None, weight_teacher=False)
    with pytest.raises(ValueError, match="contiguous"):
        nc.dlogits(torch.zeros(8, 4).t(), None, v, v, None, None, nc.MODE_NONE)
    with pytest.raises(ValueError, match="per-row vector must be 4"):
        nc.softmax_sums(s, None, torch.zeros(3), None, v, v, None, None, weight_teacher=False)
    with pytest.raises(ValueError, match="mode"):
        nc.dlogits(s, None, v, v, None, v, nc.MODE_DIFF)
    with pytest.raises(ValueError, match="'auto' or 'base'"):
        nc._C.set_logit_chunks_isa("avx512")
    assert not nc.usable(s.double()) and not nc.usable(torch.zeros(8, 4).t()) and nc.usable(s, None)


def test_the_switch_turns_the_kernels_off(monkeypatch):
    assert nc.usable(torch.zeros(2, 2))
    monkeypatch.setenv("MEMOPD_NATIVE_CHUNKS", "0")
    assert not nc.usable(torch.zeros(2, 2))


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_fused_ops_agree_with_float64_on_both_paths(monkeypatch, seed, native):
    """The ops whose elementwise work the kernels take (reverse KL, the teacher-less
    log-prob + entropy op's declared loss, the JSD's resident pass, the actor loss) on each path."""
    from memopd.ops import (
        fused_linear_actor_loss,
        fused_linear_distill,
        fused_linear_logprob_entropy,
        reference_actor_loss,
        reference_linear_distill,
    )

    monkeypatch.setenv("MEMOPD_NATIVE_CHUNKS", native)
    g = torch.Generator().manual_seed(seed)
    N, H, V = 37, 24, 301
    hs, ws = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    ht, wt = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    y = torch.randint(0, V, (N,), generator=g)
    adv, old = torch.randn(N, generator=g), -torch.rand(N, generator=g) * 3 - 2

    def grads(fn, dtype):
        h, w = hs.to(dtype).clone().requires_grad_(), ws.to(dtype).clone().requires_grad_()
        out = fn(h, w, ht.to(dtype), wt.to(dtype))
        out.loss.backward()
        return [out.loss.detach().double(), h.grad.double(), w.grad.double()]

    cases = {
        "reverse_kl": lambda op: lambda h, w, a, b: op(h, w, a, b, y, divergence="reverse_kl", chunk_size=64),
        "jsd": lambda op: lambda h, w, a, b: op(h, w, a, b, y, divergence="jsd", beta=0.3, chunk_size=64),
    }
    for name, make in cases.items():
        got, ref = grads(make(fused_linear_distill), torch.float32), grads(make(reference_linear_distill), torch.float64)
        for what, a, r in zip(("loss", "dh", "dw"), got, ref):
            err = (a - r).abs().max().item()
            assert err <= 2e-5 * (1 + r.abs().max().item()), f"{name} {what} native={native}: {err:.2e} (seed={seed})"
    coef = dict(clip_eps=0.2, entropy_coef=0.01, teacher_kl_coef=0.5)
    got = grads(lambda h, w, a, b: fused_linear_actor_loss(h, w, y, adv, old, teacher_hidden=a, teacher_weight=b, **coef),
                torch.float32)
    ref = grads(lambda h, w, a, b: reference_actor_loss(h, w, y, adv.double(), old.double(), teacher_hidden=a,
                                                        teacher_weight=b, **coef), torch.float64)
    for what, a, r in zip(("loss", "dh", "dw"), got, ref):
        err = (a - r).abs().max().item()
        assert err <= 2e-5 * (1 + r.abs().max().item()), f"actor {what} native={native}: {err:.2e} (seed={seed})"
    h = hs.clone().requires_grad_()
    lpe = fused_linear_logprob_entropy(h, ws, y, logprob_weight=-1.0 / N, entropy_weight=0.02)
    lpe.loss.backward()
    h64 = hs.double().requires_grad_()
    logits = h64 @ ws.double().t()
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    (-(logp.gather(1, y[:, None])[:, 0]).sum() / N + 0.02 * ent.sum()).backward()
    err = (h.grad.double() - h64.grad).abs().max().item()
    assert err <= 2e-5 * (1 + h64.grad.abs().max().item()), f"logprob+entropy dh native={native}: {err:.2e}"
