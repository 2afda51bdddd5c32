"""Inputs the fused ops would otherwise miscount in silence: narrow or unsigned target
ids (ignore_index=-100 wrapping onto a real id), non-finite advantages or old log-probs,
old log-probs above 0, a teacher given without a KL weight, non-finite teacher hidden
states, and integer arguments of the wrong type or range (chunk sizes, vocab_size)."""
import pytest
import torch
from _fused_cases import make_inputs

from memopd.ops import fused_linear_actor_loss, fused_linear_distill, fused_linear_logprob_entropy
from memopd.ops.reference_actor import reference_actor_loss


def _actor(seed, N=30, V=301, **kw):
    inp = make_inputs(seed, N=N, V=V)
    g = torch.Generator().manual_seed(seed + 1)
    adv = torch.randn(N, generator=g)
    old = -torch.rand(N, generator=g) * 3
    return inp, adv, old


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16])
def test_narrow_or_unsigned_targets_are_refused_with_a_dtype_message(seed, dtype):
    """uint8 ids compared with ignore_index=-100 in their own dtype match id 156 and drop it
    silently; int8 was refused with a message naming valid ids out of range. Both now say
    what is wrong: the dtype."""
    inp = make_inputs(seed, N=20, V=200)
    y = inp["y"].clamp(max=120)
    y[3] = 156 if dtype != torch.int8 else 100
    y = y.to(dtype)
    with pytest.raises(TypeError, match=rf"targets must be an int64 \(or int32\).*got {dtype}"):
        fused_linear_logprob_entropy(inp["hs"], inp["ws"], y, bias=inp["bs"])
    with pytest.raises(TypeError, match="targets must be an int64"):
        fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], y)
    adv, old = torch.zeros(20), torch.full((20,), -1.0)
    with pytest.raises(TypeError, match="targets must be an int64"):
        fused_linear_actor_loss(inp["hs"], inp["ws"], y, adv, old)


def test_int32_targets_keep_ignore_index_and_match_int64(seed):
    """int32 ids stay accepted: same outputs as int64, ignore_index honoured, id 156 kept."""
    inp = make_inputs(seed, N=20, V=200)
    y = inp["y"].clone()
    y[2], y[5] = 156, -100
    a = fused_linear_logprob_entropy(inp["hs"], inp["ws"], y, bias=inp["bs"])
    b = fused_linear_logprob_entropy(inp["hs"], inp["ws"], y.to(torch.int32), bias=inp["bs"])
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=0)
    assert a.logprobs[2] < 0 and a.logprobs[5] == 0


@pytest.mark.parametrize("which", ["advantages", "old_logprobs"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_advantage_or_old_logprob_is_refused(seed, which, bad):
    """A NaN advantage made the loss NaN while that token's gradient was silently 0."""
    inp, adv, old = _actor(seed)
    keep_at = int(inp["mask"].nonzero()[0, 0])
    (adv if which == "advantages" else old)[keep_at] = bad
    with pytest.raises(ValueError, match=rf"{which} holds 1 non-finite.*token {keep_at}"):
        fused_linear_actor_loss(inp["hs"], inp["ws"], inp["y"], adv, old, mask=inp["mask"])


def test_non_finite_values_at_masked_tokens_are_fine(seed):
    inp, adv, old = _actor(seed)
    masked = int((~inp["mask"]).nonzero()[0, 0])
    adv[masked] = float("nan")
    out = fused_linear_actor_loss(inp["hs"], inp["ws"], inp["y"], adv, old, mask=inp["mask"])
    assert torch.isfinite(out.loss)


def test_old_logprob_above_zero_is_refused(seed):
    inp, adv, old = _actor(seed)
    old[4] = 0.7  # a probability passed as a log-prob
    with pytest.raises(ValueError, match=r"old_logprobs holds 1 values > 0.*0\.7 at token 4"):
        fused_linear_actor_loss(inp["hs"], inp["ws"], inp["y"], adv, old)
    old[4] = 0.0  # log 1: a certain token is a valid log-prob
    assert torch.isfinite(fused_linear_actor_loss(inp["hs"], inp["ws"], inp["y"], adv, old).loss)


@pytest.mark.parametrize("fn", [fused_linear_actor_loss, reference_actor_loss])
def test_teacher_without_a_weight_is_refused(seed, fn):
    """With the weight defaulting to 0 the teacher's matmuls ran, out.kl looked healthy and
    the loss equalled the teacher-less one: nothing was distilled."""
    inp, adv, old = _actor(seed)
    with pytest.raises(ValueError, match="a teacher is given but no teacher_kl_coef"):
        fn(inp["hs"], inp["ws"], inp["y"], adv, old, teacher_hidden=inp["ht"], teacher_weight=inp["wt"])
    # the explicit weights still work, and 1.0 distils (the loss moves with the teacher)
    plain = fn(inp["hs"], inp["ws"], inp["y"], adv, old).loss
    zero = fn(inp["hs"], inp["ws"], inp["y"], adv, old, teacher_hidden=inp["ht"], teacher_weight=inp["wt"],
              teacher_kl_coef=0.0).loss
    one = fn(inp["hs"], inp["ws"], inp["y"], adv, old, teacher_hidden=inp["ht"], teacher_weight=inp["wt"],
             teacher_kl_coef=1.0).loss
    torch.testing.assert_close(zero, plain)
    assert float(one) > float(plain) + 0.1


def test_non_finite_teacher_hidden_is_refused(seed):
    inp, adv, old = _actor(seed)
    ht = inp["ht"].clone()
    ht[7, 3] = float("nan")
    with pytest.raises(ValueError, match="teacher_hidden holds 1 non-finite values.*row 7"):
        fused_linear_actor_loss(inp["hs"], inp["ws"], inp["y"], adv, old, teacher_hidden=ht, teacher_weight=inp["wt"],
                                teacher_kl_coef=1.0)


@pytest.mark.parametrize("kw, err, msg", [
    (dict(token_chunk_size=-5), ValueError, "token_chunk_size must be >= 1, got -5"),
    (dict(token_chunk_size=True), TypeError, "token_chunk_size must be an integer, got bool"),
    (dict(token_chunk_size=2.5), TypeError, "token_chunk_size must be an integer, got float"),
    (dict(vocab_size=240.7), TypeError, "vocab_size must be an integer, got float 240.7"),
    (dict(vocab_size=True), TypeError, "vocab_size must be an integer, got bool"),
])
def test_actor_loss_integer_arguments_are_checked(seed, kw, err, msg):
    inp, adv, old = _actor(seed)
    with pytest.raises(err, match=msg):
        fused_linear_actor_loss(inp["hs"], inp["ws"], inp["y"], adv, old, **kw)


@pytest.mark.parametrize("kw, err, msg", [
    (dict(chunk_size=-5), ValueError, "chunk_size must be >= 1, got -5"),
    (dict(chunk_size=False), TypeError, "chunk_size must be an integer, got bool"),
    (dict(token_chunk_size=0), ValueError, "token_chunk_size must be >= 1, got 0"),
    (dict(vocab_size=240.7), TypeError, "vocab_size must be an integer, got float"),
])
def test_distill_integer_arguments_are_checked(seed, kw, err, msg):
    inp = make_inputs(seed, N=20, V=301)
    with pytest.raises(err, match=msg):
        fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], **kw)
    with pytest.raises(err, match=msg):
        fused_linear_logprob_entropy(inp["hs"], inp["ws"], inp["y"], **kw)


def test_huge_chunk_sizes_are_clamped_not_allocated(seed):
    """chunk_size=10**9 sized a [rows, 10**9] buffer (76 GB); clamped to the vocabulary it
    gives the same result as the automatic size."""
    inp = make_inputs(seed, N=20, V=301)
    auto = fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"])
    huge = fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], chunk_size=10**9,
                                token_chunk_size=10**9)
    torch.testing.assert_close(huge.loss, auto.loss, rtol=1e-5, atol=1e-6)
    inp2, adv, old = _actor(seed)
    a = fused_linear_actor_loss(inp2["hs"], inp2["ws"], inp2["y"], adv, old)
    b = fused_linear_actor_loss(inp2["hs"], inp2["ws"], inp2["y"], adv, old, token_chunk_size=10**9)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
