"""Packed attention keeps one trajectory's bad values to itself, and refuses metadata that
contradicts itself with an error naming the field (torch and reference backends).

A NaN (or inf) in one key or value row must reach exactly the rows that can see it: a dense
product with a masked weight 0 gives 0 * NaN = NaN, which used to spread to every row
batched with that key (other trajectories included)."""
import dataclasses

import pytest
import torch
from _attention_cases import make_inputs, random_meta  # noqa: E402

from memopd.layout import AttentionMeta, SegmentKind
from memopd.memory import random_trajectories

# the public export (importing the submodule `memopd.ops.attention` first would make
# `memopd.ops.attention` the module for test_packed_attention's import check)
from memopd.ops import packed_attention

BACKENDS = ["torch", "reference"]


@pytest.fixture(scope="module")
def packed():
    """A real packed batch (6 trajectories, 2 per group, in several rows) and the trajectory
    of every token (-1: padding, if any)."""
    from memopd.packing import pack

    trajs = random_trajectories("summary", 6, seed=3, group_size=2, vocab_size=100, calls=(3, 5))
    batch = pack(trajs, "aligned", max_tokens=96)
    meta = batch.attn
    lens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).long()
    seg_of_tok = torch.repeat_interleave(torch.arange(meta.num_segments), lens)
    traj = batch.segment_traj.long()[seg_of_tok]
    traj = torch.where(meta.segment_kind.long()[seg_of_tok] == SegmentKind.PAD, -1, traj)
    assert len(set(traj.tolist()) - {-1}) == 6 and batch.num_rows > 1
    return meta, traj


def _poisoned_token(meta, traj, t):
    """A token in the middle of a call segment of trajectory t (has rows before it in its
    own segment that cannot see it, and rows after it that can)."""
    kinds = meta.segment_kind.long()
    cu = meta.cu_seqlens.long()
    for s in range(meta.num_segments):
        a, b = int(cu[s]), int(cu[s + 1])
        if kinds[s] == SegmentKind.CALL and b - a >= 4 and int(traj[a]) == t:
            return (a + b) // 2
    raise AssertionError("no call segment of 4+ tokens")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_key_or_value_stays_in_its_trajectory(packed, backend, which, bad):
    meta, traj = packed
    T = meta.num_tokens
    q, k, v, _ = make_inputs(T, 4, 2, 16, torch.float32, 0)
    clean = packed_attention(q, k, v, meta, backend=backend)
    j = _poisoned_token(meta, traj, 2)
    k2, v2 = k.clone(), v.clone()
    (k2 if which == "k" else v2)[j] = bad
    out = packed_attention(q, k2, v2, meta, backend=backend)
    sees = meta.visible()[:, j]
    others = traj != 2
    # every other trajectory (and padding): finite and exactly the clean result
    assert torch.isfinite(out[others]).all()
    assert torch.equal(out[others], clean[others])
    # the poisoned trajectory: rows that cannot see token j (its earlier rows) are untouched
    assert torch.equal(out[~sees], clean[~sees])
    assert ((traj == 2) & ~sees).any()
    # and the rows that can see it carry the bad value
    assert sees.sum() > 1 and (~torch.isfinite(out[sees])).any(-1).any(-1).all()


def test_nonfinite_value_gives_no_gradient_to_other_trajectories(packed):
    meta, traj = packed
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 16, torch.float64, 1)
    others = (traj != 1).view(-1, 1, 1).double()

    def grads(k_in, v_in):
        xs = [x.clone().requires_grad_() for x in (q, k_in, v_in)]
        out = packed_attention(*xs, meta, backend="torch")
        (out * do * others).sum().backward()  # a loss over the other trajectories only
        return [x.grad for x in xs]

    want = grads(k, v)
    v2, k2 = v.clone(), k.clone()
    j = _poisoned_token(meta, traj, 1)
    v2[j, 0, 3] = float("nan")
    k2[j + 1, 1, 0] = float("nan")
    got = grads(k2, v2)
    mine = traj == 1
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g[~mine], w[~mine], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_query_row_stays_in_its_row(packed, backend):
    meta, traj = packed
    q, k, v, _ = make_inputs(meta.num_tokens, 2, 2, 16, torch.float32, 2)
    clean = packed_attention(q, k, v, meta, backend=backend)
    q2 = q.clone()
    q2[0, 1, 0] = float("nan")  # token 0: what padded batch rows of the torch path used to gather
    out = packed_attention(q2, k, v, meta, backend=backend)
    assert torch.isnan(out[0, 1]).all()
    assert torch.equal(out[1:], clean[1:]) and torch.equal(out[0, 0], clean[0, 0])


# --------------------------------------------------------------------------------------
# metadata that contradicts itself
# --------------------------------------------------------------------------------------
def _with(meta, **kw):
    return dataclasses.replace(meta, **kw)  # a new object: not marked as checked


def _set(t, i, value):
    t = t.clone()
    t[i] = value
    return t


BAD_META = [
    ("negative seg_start", lambda m: _with(m, seg_start=_set(m.seg_start, 5, -1)), r"seg_start\[5\] = -1"),
    ("seg_start after the row", lambda m: _with(m, seg_start=_set(m.seg_start, 5, 9)), r"seg_start\[5\] = 9: must be in \[0, i \+ 1\]"),
    ("prefix_end > T", lambda m: _with(m, prefix_end=_set(m.prefix_end, 7, m.num_tokens + 3)), r"prefix_end\[7\]"),
    ("prefix_start > prefix_end", lambda m: _with(m, prefix_start=_set(m.prefix_start, 7, int(m.prefix_end[7]) + 1)),
     r"prefix_end\[7\] = 4: must be in \[prefix_start"),
    ("negative prefix_start", lambda m: _with(m, prefix_start=_set(m.prefix_start, 2, -4)), r"prefix_start\[2\] = -4"),
    ("cu_seqlens short of T", lambda m: _with(m, cu_seqlens=_set(m.cu_seqlens, -1, m.num_tokens - 1)), r"cu_seqlens: must start at 0"),
    ("prefix link to a call", lambda m: _with(m, prefix_segment=_set(m.prefix_segment, 1, 1)), r"prefix_segment\[1\] = 1"),
    ("float seg_start", lambda m: _with(m, seg_start=m.seg_start.float()), r"seg_start must hold integers"),
    ("short prefix_end", lambda m: _with(m, prefix_end=m.prefix_end[:-1]), r"prefix_end has \d+ entries"),
    ("max_seqlen too small", lambda m: _with(m, max_seqlen=1), r"max_seqlen = 1 is less than the longest segment"),
    ("max_prefix_len too small", lambda m: _with(m, max_prefix_len=0), r"max_prefix_len = 0"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_META, ids=[c[0] for c in BAD_META])
def test_inconsistent_metadata_is_a_clear_error(case, backend):
    _, mutate, msg = case
    P, C, D = SegmentKind.PREFIX, SegmentKind.CALL, SegmentKind.PAD
    # tokens 0-3 prefix, 4-8 and 9-11 calls seeing it, 12-13 padding, 14-17 a lone call
    meta = AttentionMeta.from_segments([0, 4, 9, 12, 14, 18], [-1, 0, 0, -1, -1], [P, C, C, D, C])
    bad = mutate(meta)
    q = torch.randn(meta.num_tokens, 2, 16)
    with pytest.raises(ValueError, match=msg):
        packed_attention(q, q, q, bad, backend=backend)


def test_metadata_is_checked_once_per_object():
    meta = random_meta(4, 80)
    assert getattr(meta, "_checked", False)  # from_segments checks what it builds
    assert getattr(meta.to("cpu"), "_checked", False)  # and the check travels with to()
    hand = AttentionMeta(**{f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)})
    assert not getattr(hand, "_checked", False)
    assert hand.validate() is hand and hand._checked
