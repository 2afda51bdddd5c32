"""fused_linear_topk_reverse_kl against a float64 reference built from full [N, V] logits:
values and gradients for k = 1, a few, V; ties in the teacher's log-probs; padded entries
and masked rows; temperature != 1; bias; bf16 and float64 inputs; blocks of rows; the
vocabulary walked in several chunks; k = V equal to the full-vocabulary reverse KL; and
one clear error per bad input."""
import math

import pytest
import torch

from memopd.ops import fused_linear_reverse_kl, fused_linear_topk_reverse_kl
from memopd.ops import topk_kl as topk_mod


def _case(seed, N=40, H=24, V=301, k=8, temperature=1.0, bias=True, dtype=torch.float32, ties=False,
          pad_rows=(), pad_entries=0):
    """Student head + a teacher's top-k (ids, full-vocabulary log-probs) from a nearby teacher."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, H, generator=g, dtype=torch.float64)
    ws = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    bs = torch.randn(V, generator=g, dtype=torch.float64) * 0.5 if bias else None
    t_logits = (hs @ ws.t()) + 0.7 * torch.randn(N, V, generator=g, dtype=torch.float64)
    if ties:  # quantised logits: many equal teacher log-probs, topk must still pick distinct ids
        t_logits = (t_logits * 2).round() / 2
    lq = torch.log_softmax(t_logits, dim=-1)
    lt, ids = lq.topk(k, dim=-1)
    ids = ids.clone()
    lt = lt.clone()
    for r in pad_rows:
        ids[r] = topk_mod.PAD_ID
        lt[r] = float("nan")  # never read
    if pad_entries:
        ids[:, k - pad_entries:] = topk_mod.PAD_ID
        lt[:, k - pad_entries:] = -math.inf
    cast = lambda x: None if x is None else x.to(dtype).requires_grad_()  # noqa: E731
    return dict(hs=cast(hs), ws=cast(ws), bs=cast(bs), ids=ids, lt=lt.float(), T=temperature)


def _reference(c, reduction="mean"):
    """float64, full logits, plain autograd: Σ_{v in S} p(v) (log p(v) - log q(v))."""
    hs, ws = c["hs"].detach().double().requires_grad_(), c["ws"].detach().double().requires_grad_()
    bs = None if c["bs"] is None else c["bs"].detach().double().requires_grad_()
    logits = hs @ ws.t() + (0 if bs is None else bs)
    lp = torch.log_softmax(logits / c["T"], dim=-1)
    keep = c["ids"] != topk_mod.PAD_ID
    ids = torch.where(keep, c["ids"], 0)
    lps = lp.gather(1, ids)
    lq = torch.where(keep, c["lt"].double(), 0.0)
    kl = torch.where(keep, lps.exp() * (lps - lq), 0.0).sum(1)
    rows = keep.any(1)
    loss = {"mean": kl.sum() / rows.sum().clamp_min(1), "sum": kl.sum(), "none": kl}[reduction]
    return loss, (hs, ws, bs)


def _grads(loss, leaves, weights=None):
    out = loss if weights is None else (loss * weights).sum()
    return torch.autograd.grad(out, [x for x in leaves if x is not None])


def _compare(c, reduction="mean", rtol=1e-5, atol=1e-6, grad_atol=1e-6):
    got = fused_linear_topk_reverse_kl(c["hs"], c["ws"], c["ids"], c["lt"], student_bias=c["bs"],
                                       temperature=c["T"], reduction=reduction)
    ref, leaves = _reference(c, reduction)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=rtol, atol=atol)
    w = None
    if reduction == "none":
        w = torch.linspace(-1.0, 2.0, got.shape[0], dtype=torch.float64)
    g_got = _grads(got, (c["hs"], c["ws"], c["bs"]), None if w is None else w.to(got.dtype))
    g_ref = _grads(ref, leaves, w)
    for a, b in zip(g_got, g_ref):
        assert a.dtype == c["hs"].dtype
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=grad_atol)
    return got, ref


@pytest.mark.parametrize("k", [1, 5, 64, 301])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_float64_reference(seed, k, temperature):
    _compare(_case(seed, k=k, temperature=temperature))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_padding_and_masked_rows(seed, reduction):
    c = _case(seed, k=6, pad_rows=(0, 7, 39), pad_entries=2, bias=False, temperature=1.3)
    got, _ = _compare(c, reduction)
    if reduction == "none":
        assert got.shape == (40,)
        assert got[0] == 0 and got[7] == 0 and got[39] == 0


def test_ties_in_teacher_logprobs(seed):
    c = _case(seed, k=16, ties=True)
    lt = c["lt"]
    assert bool((lt[:, 1:] == lt[:, :-1]).any()), "the case must hold tied log-probs"
    _compare(c)


def test_float64_is_exact_and_passes_gradcheck(seed):
    c = _case(seed, N=6, H=5, V=23, k=4, temperature=0.8, dtype=torch.float64, pad_rows=(2,))
    _compare(c, rtol=1e-12, atol=1e-12, grad_atol=1e-12)
    ids, lt = c["ids"], c["lt"].double()
    fn = lambda h, w, b: fused_linear_topk_reverse_kl(h, w, ids, lt, student_bias=b, temperature=0.8,  # noqa: E731
                                                      reduction="none")
    assert torch.autograd.gradcheck(fn, (c["hs"], c["ws"], c["bs"]))


def test_bf16_inputs(seed):
    """bf16 heads: fp32 loss, bf16 gradients, against the float64 reference of the same bf16 values."""
    c = _case(seed, k=32, dtype=torch.bfloat16, temperature=0.9)
    got, ref = _compare(c, rtol=2e-2, atol=2e-3, grad_atol=2e-2)
    assert got.dtype == torch.float32


def test_rows_in_many_blocks_and_vocabulary_in_many_chunks(seed, monkeypatch):
    """A small block budget (many row blocks, each against the union of its ids) and a
    vocabulary larger than one chunk of the fused log-sum-exp give the reference too."""
    monkeypatch.setattr(topk_mod, "_BLOCK_ELEMS", 300)
    assert topk_mod._row_block(70, 5, 40000) < 70
    _compare(_case(seed, N=70, H=8, V=40000, k=5, temperature=1.1), rtol=1e-5, atol=1e-6, grad_atol=1e-6)


def test_k_equal_to_v_is_the_full_vocabulary_reverse_kl(seed):
    """With every id served the top-k KL is the full reverse KL of fused_linear_reverse_kl."""
    g = torch.Generator().manual_seed(seed)
    N, H, Ht, V = 30, 16, 12, 97
    hs = torch.randn(N, H, generator=g, requires_grad=True)
    ws = (torch.randn(V, H, generator=g) * 0.4).requires_grad_()
    ht, wt = torch.randn(N, Ht, generator=g), torch.randn(V, Ht, generator=g) * 0.4
    lq = torch.log_softmax((ht @ wt.t()).double() / 0.7, dim=-1)
    perm = torch.argsort(torch.rand(N, V, generator=g), dim=1)  # any order of the support
    a = fused_linear_topk_reverse_kl(hs, ws, perm, lq.gather(1, perm).float(), temperature=0.7)
    b = fused_linear_reverse_kl(hs, ws, ht, wt, torch.zeros(N, dtype=torch.long), temperature=0.7).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for x, y in zip(torch.autograd.grad(a, (hs, ws)), torch.autograd.grad(b, (hs, ws))):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_top1_gradient_is_dense_over_the_vocabulary(seed):
    """k = 1 still moves every logit: the log-sum-exp spreads -p(u)·A over the vocabulary."""
    c = _case(seed, N=4, k=1, bias=True)
    loss = fused_linear_topk_reverse_kl(c["hs"], c["ws"], c["ids"], c["lt"], student_bias=c["bs"])
    (db,) = torch.autograd.grad(loss, [c["bs"]])
    assert int((db != 0).sum()) == db.numel()


def _bad(seed):
    c = _case(seed, N=10, V=50, k=4)
    return c["hs"], c["ws"], c["ids"].clone(), c["lt"].clone()


@pytest.mark.parametrize("edit, err, msg", [
    (lambda h, w, i, lt: (h, w, i[:, :0], lt[:, :0]), ValueError, r"k=0 entries a row: k must be in \[1, V=50\]"),
    (lambda h, w, i, lt: (h, w, i[:5], lt[:5]), ValueError, r"topk_ids has 5 rows, student_hidden has N=10"),
    (lambda h, w, i, lt: (h, w, i, lt[:, :3]), ValueError, r"topk_logprobs \(10, 3\) must have the shape"),
    (lambda h, w, i, lt: (h, w, i.int().to(torch.int16), lt), TypeError, r"topk_ids must be an int64"),
    (lambda h, w, i, lt: (h, w, i, lt.long()), TypeError, r"topk_logprobs must be a floating tensor"),
    (lambda h, w, i, lt: (h, w, i, lt.requires_grad_()), ValueError, r"topk_logprobs requires grad"),
    (lambda h, w, i, lt: (h, w, i[:, 0], lt), ValueError, r"topk_ids must be 2-D"),
    (lambda h, w, i, lt: (h, w, i.index_fill_(1, torch.tensor([2]), 50), lt), ValueError,
     r"topk_ids out of range \[0, 50\).*\[50, 50"),
    (lambda h, w, i, lt: (h, w, i.index_fill_(1, torch.tensor([3]), -1), lt), ValueError, r"out of range.*-1"),
    (lambda h, w, i, lt: (h, w, torch.cat([i[:, :3], i[:, :1]], 1), lt), ValueError, r"repeats id \d+ in row 0"),
    (lambda h, w, i, lt: (h, w, i, lt.index_fill_(0, torch.tensor([4]), float("nan"))), ValueError,
     r"non-finite values .* first in row 4"),
    (lambda h, w, i, lt: (h, w, i, lt.abs()), ValueError, r"values > 0.*not probabilities or logits"),
    (lambda h, w, i, lt: (h, w, i, torch.full_like(lt, -0.5)), ValueError, r"row 0 hold probability 2\.4.* > 1"),
    (lambda h, w, i, lt: (h, w.double(), i, lt), TypeError, r"dtype mismatch: student_hidden"),
    (lambda h, w, i, lt: (h, w[:, :3], i, lt), ValueError, r"student_weight must be \[V, 24\]"),
])
def test_bad_inputs_one_clear_error(seed, edit, err, msg):
    h, w, i, lt = edit(*_bad(seed))
    with pytest.raises(err, match=msg):
        fused_linear_topk_reverse_kl(h, w, i, lt)


@pytest.mark.parametrize("kw, err, msg", [
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    (dict(reduction="avg"), ValueError, "unknown reduction 'avg'"),
])
def test_bad_arguments(seed, kw, err, msg):
    h, w, i, lt = _bad(seed)
    with pytest.raises(err, match=msg):
        fused_linear_topk_reverse_kl(h, w, i, lt, **kw)


def test_padding_entries_may_hold_anything(seed):
    """A padded entry's log-prob (NaN, -inf) is never read, and a row whose served mass sums
    to exactly 1 (k = V) passes the mass check."""
    h, w, i, lt = _bad(seed)
    i[:, 3] = topk_mod.PAD_ID
    lt[:, 3] = float("nan")
    assert torch.isfinite(fused_linear_topk_reverse_kl(h, w, i, lt))
