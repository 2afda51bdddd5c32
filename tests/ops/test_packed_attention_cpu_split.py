"""The fused CPU path of packed attention splits each row's keys into its own keys (causal
calls) and its prefix (one call per prefix interval), merged by log-sum-exp: every kind of
call it plans (causal own-key batches, prefixes whose rows are or are not one contiguous
range, masked [prefix, own] batches for runs that do not start their segment, blind rows)
must give the float64 oracle's output and gradients."""
import sys

import pytest
import torch
from _attention_cases import assert_close, make_inputs, oracle, random_meta, random_token_meta

from memopd.layout import AttentionMeta
from memopd.ops import packed_attention

pa_mod = sys.modules["memopd.ops.attention_torch"]


def _run(q, k, v, do, meta):
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = packed_attention(qq, kk, vv, meta, backend="torch")
    out.backward(do)
    return out.detach(), qq.grad, kk.grad, vv.grad


def _token_meta_without_overlaps(seed: int, T: int) -> AttentionMeta:
    """`random_token_meta` (seg_start jumping around, blind rows) with every prefix interval
    that would meet its row's own range emptied: metadata the fused path takes, whose runs
    mostly do not start at their seg_start."""
    m = random_token_meta(seed, T)
    i = torch.arange(T)
    ss, ps, pe = m.seg_start.long(), m.prefix_start.long(), m.prefix_end.long()
    meets = (pe > ps) & (ps <= i) & (ss < pe)
    ps, pe = torch.where(meets, 0, ps), torch.where(meets, 0, pe)
    return AttentionMeta(cu_seqlens=m.cu_seqlens, prefix_segment=m.prefix_segment, segment_kind=m.segment_kind,
                         seg_start=m.seg_start, prefix_start=ps.int(), prefix_end=pe.int(), max_seqlen=T,
                         max_prefix_len=m.max_prefix_len)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["segments", "shuffled", "token_level"])
def test_split_calls_match_the_oracle(dtype, case):
    if case == "token_level":
        meta = _token_meta_without_overlaps(5, 300)
    else:
        meta = random_meta(31, 600, shuffle=case == "shuffled")
    plan = pa_mod._plan_of(meta.seg_start, meta.prefix_start, meta.prefix_end)
    assert plan.cpu is not None, "no overlapping runs: the fused CPU path must take this layout"
    cp = plan.cpu
    if case == "segments":  # every run starts its segment: causal own-key calls + contiguous prefixes
        assert cp.batches and all(b.causal for b in cp.batches)
        assert cp.prefixes and any(p.first is not None for p in cp.prefixes)
    elif case == "shuffled":  # calls before their prefix, interleaved groups: gathered prefix rows
        assert any(p.first is None for p in cp.prefixes)
    else:  # runs that do not start at their seg_start keep masked [prefix, own] calls; blind rows stay 0
        assert any(not b.causal for b in cp.batches) and cp.blind is not None
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 16, dtype, 7)
    assert pa_mod._fused_cpu_ok(q, k, v, plan)
    got = _run(q, k, v, do, meta)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, oracle(q, k, v, do, meta)):
        assert_close(name, a, b, dtype)
    if cp.blind is not None:
        assert (got[0][cp.blind] == 0).all() and (got[1][cp.blind] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lone_runs_read_their_rows_in_place(dtype):
    """A call far longer than the others gets a batch of its own, whose operands are views
    of the token rows (no gathered copy) and whose key gradients are added to a slice:
    output and gradients still equal the oracle's, and so do those of the batched calls."""
    from memopd.layout import SegmentKind

    P, C = SegmentKind.PREFIX, SegmentKind.CALL
    lengths = [(P, 20, -1), (C, 160, 0), (C, 9, 0), (C, 11, 0), (C, 10, 0), (C, 140, -1), (C, 5, -1), (C, 6, -1)]
    cu = [0]
    for _, n, _ in lengths:
        cu.append(cu[-1] + n)
    meta = AttentionMeta.from_segments(cu, [link for *_, link in lengths], [kind for kind, *_ in lengths])
    cp = pa_mod._plan_of(meta.seg_start, meta.prefix_start, meta.prefix_end).cpu
    lone = [b for b in cp.batches if b.q_span is not None]
    assert len(lone) >= 2 and all(b.k_span is not None for b in lone), [(b.n, b.lq) for b in cp.batches]
    assert any(b.q_span is None for b in cp.batches), "the short calls should share a padded batch"
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 16, dtype, 3)
    # the views then meet the incoming gradient as it comes: contiguous, strided, expanded
    for grad in (do, do.transpose(0, 1).contiguous().transpose(0, 1), torch.ones(()).expand_as(do)):
        got = _run(q, k, v, grad, meta)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, oracle(q, k, v, grad.contiguous(), meta)):
            assert_close(name, a, b, dtype)
