"""The trie layout: every common prefix laid out once, every call's state restored.

Checked without a model: for every entry, the keys visible at its prediction position,
as (position, id) pairs, are exactly its call's sequence [q, x_t, a_t] up to the token,
and the token sits at its restored position; on every memory policy, with shared call-0
contexts and identical early calls, tight budgets, micro-batches and the naive action
domain. Token counts against `aligned` with one prefix per group, and the partial prefix
links of `AttentionMeta.from_segments` that the layout needs. The forward against
independent calls is the RCE audit's (tests/core/test_hf_rce.py).
"""
import pytest
import torch

from memopd import PackError, pack, random_trajectories
from memopd.layout import AttentionMeta, SegmentKind
from memopd.memory import POLICIES
from memopd.records import Invocation, Trajectory


def assert_states(batch, trajs):
    vis = batch.attn.visible()
    ids, pos = batch.input_ids, batch.position_ids
    assert batch.num_actions
    exact = bool(batch.is_sampled.all())
    for e in range(batch.num_actions):
        b, t, k = int(batch.traj_index[e]), int(batch.call_index[e]), int(batch.token_index[e])
        inv = trajs[b].invocations[t]
        seq = list(inv.prefix_ids) + list(inv.context_ids) + list(inv.action_ids)
        a, p = int(batch.action_index[e]), int(batch.pred_index[e])
        d = int(pos[a])
        assert int(ids[a]) == seq[d] == int(batch.target_ids[e])
        if exact:  # (the naive domain numbers a call's copies first)
            assert d == len(inv.prefix_ids) + len(inv.context_ids) + k
        keys = torch.nonzero(vis[p]).squeeze(1)
        got = sorted(zip(pos[keys].tolist(), ids[keys].tolist()))
        assert got == list(enumerate(seq[:d])), (b, t, k)
        assert int(pos[p]) == d - 1


def _trajs(policy, seed, shared):
    kw = dict(group_context=True, group_steps=2) if shared else {}
    return random_trajectories(policy, 8, seed=seed, group_size=4, vocab_size=6, calls=(2, 5),
                               initial_context_len=(2, 6), **kw)


@pytest.mark.parametrize("shared", [False, True], ids=["random", "shared-early-calls"])
@pytest.mark.parametrize("policy", POLICIES)
def test_trie_restores_every_state(policy, shared, seed):
    trajs = _trajs(policy, seed, shared)
    for budget in (8192, 80):
        batch = pack(trajs, "trie", max_tokens=budget)
        assert max(batch.row_lengths) <= budget
        assert_states(batch, trajs)
        mbs = batch.micro_batches(2 * budget)
        assert sum(mb.num_actions for mb in mbs) == batch.num_actions
        for mb in mbs:  # select_rows keeps the partial prefix links
            assert_states(mb, trajs)
    naive = pack(trajs, "trie", action_domain="naive")
    assert (~naive.is_sampled).any() or policy in ("summary",)
    assert_states(naive, trajs)
    assert int(naive.action_mask.sum()) == naive.action_index.unique().numel()


@pytest.mark.parametrize("policy", POLICIES)
def test_trie_tokens_against_one_prefix_per_group(policy, seed):
    """In one row the trie never packs more than aligned with a group prefix, and shared
    call-0 contexts and identical early calls make it strictly fewer."""
    for shared in (False, True):
        trajs = _trajs(policy, seed, shared)
        trie = pack(trajs, "trie").num_tokens
        group = pack(trajs, "aligned", share_prefix="group").num_tokens
        assert trie <= group
        if shared:
            # the group's 2 identical early calls: 3 copies of each cost 1 token each at most
            early = sum(len(inv.input_ids) for tr in trajs[::4] for inv in tr.invocations[:2])
            assert trie < group - early
    # and no fewer than its trie has nodes: each distinct prefix once
    nodes = {tuple(inv.input_ids[:d + 1]) for tr in trajs for inv in tr.invocations for d in range(len(inv.input_ids))}
    assert trie >= len(nodes)


def _call(q, x, a):
    return Invocation(prefix_ids=q, context_ids=x, action_ids=a)


def test_sharing_only_q_is_the_group_prefix_layout():
    q = [5, 6, 7, 8]
    trajs = [Trajectory([_call(q, [10 + 4 * b + t], [30 + b, 31, 32]) for t in range(2)], group_id="g")
             for b in range(2)]
    trie = pack(trajs, "trie")
    group = pack(trajs, "aligned", share_prefix="group")
    assert trie.num_tokens == group.num_tokens == len(q) + 4 * 4
    assert trie.stats()["prefix_segments"] == group.stats()["prefix_segments"] == 1
    assert torch.equal(trie.attn.prefix_end - trie.attn.prefix_start, group.attn.prefix_end - group.attn.prefix_start)
    assert_states(trie, trajs)


def test_identical_calls_are_computed_once():
    """Four identical rollouts: each call's sequence is laid out once; the rollouts keep
    only its last token, and their other entries read the shared tokens."""
    one = [_call([5, 6, 7], [8, 9], [10, 11, 12]), _call([5, 6, 7], [13], [14, 15])]
    trajs = [Trajectory([Invocation(**vars(inv)) for inv in one], group_id="g") for _ in range(4)]
    batch = pack(trajs, "trie")
    assert_states(batch, trajs)
    alone = pack(trajs[:1], "trie").num_tokens
    # one spine per call, each holding all but its last token; the second repeats q (a spine
    # is one contiguous prefix interval); every copy keeps one token per call
    assert alone == 3 + 5 + 3
    assert batch.num_tokens == (7 + 4) + (3 + 2 + 4) == alone + 3 + 3 * 2
    assert batch.action_index.unique().numel() < batch.num_actions
    assert int(batch.action_mask.sum()) == batch.action_index.unique().numel()


def test_spine_and_readers_fit_the_budget():
    """A call whose tail and the spine it would read do not fit one row reads no spine:
    every row stays within the budget, every state restored; a call over it is named."""
    q = list(range(3, 23))
    ctx = list(range(50, 80))
    trajs = [Trajectory([_call(q, ctx, [100 + b]), _call(q, [7], [200 + b, 3])], group_id="g") for b in range(3)]
    roomy = pack(trajs, "trie", max_tokens=62)
    assert roomy.num_tokens == 50 + 3 * 1 + 3 * 3  # spine [q, ctx]; the later calls read its q
    # spine 50 and its 6 readers' tails (12) do not fit 60: the deep readers keep [q, ctx],
    # the others read a spine of q alone in a row of their own
    split = pack(trajs, "trie", max_tokens=60)
    assert max(split.row_lengths) <= 60
    assert split.num_tokens == (50 + 3 * 1 + 2 * 3) + (20 + 3)
    # 52: two deep readers per row (the third alone), the later calls on a spine of q
    tight = pack(trajs, "trie", max_tokens=52)
    assert max(tight.row_lengths) <= 52
    assert tight.num_tokens == (50 + 2 * 1) + 51 + (20 + 3 * 3)
    for batch in (roomy, split, tight):
        assert_states(batch, trajs)
    with pytest.raises(PackError, match="trajectory 0, call 0 needs 51 tokens, over max_tokens=50"):
        pack(trajs, "trie", max_tokens=50)


def test_from_segments_reads_part_of_a_prefix():
    P, C = SegmentKind.PREFIX, SegmentKind.CALL
    meta = AttentionMeta.from_segments([0, 6, 9, 11], [-1, 0, 0], [P, C, C], [-1, 2, -1])
    assert meta.prefix_start.tolist() == [0] * 11
    assert meta.prefix_end.tolist() == [0] * 6 + [2] * 3 + [6] * 2
    assert meta.max_prefix_len == 6
    vis = meta.visible()
    assert vis[8].nonzero().squeeze(1).tolist() == [0, 1, 6, 7, 8]
    with pytest.raises(ValueError, match="segment 1 reads 7 tokens of its prefix segment, which has 6"):
        AttentionMeta.from_segments([0, 6, 9], [-1, 0], [P, C], [-1, 7])
    with pytest.raises(ValueError, match="prefix_len has shape"):
        AttentionMeta.from_segments([0, 6, 9], [-1, 0], [P, C], [-1])


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_attention_backends_accept_trie_metadata(backend, seed):
    """The CPU backends on a trie batch's metadata (nested prefix intervals of one spine)
    against the float64 dense-mask oracle."""
    from _attention_cases import assert_close, make_inputs, oracle

    from memopd.ops.attention import packed_attention

    trajs = _trajs("full", seed, True)
    meta = pack(trajs, "trie").attn
    widths = set(zip(meta.prefix_start.tolist(), meta.prefix_end.tolist()))
    starts = [s for s, e in widths if e > s]
    assert len(starts) > len(set(starts))  # one spine read to several depths
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 16, torch.float32, seed, device="cpu")
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = packed_attention(qq, kk, vv, meta, None, backend=backend)
    out.backward(do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, qq.grad, kk.grad, vv.grad), oracle(q, k, v, do, meta)):
        assert_close(name, a, b, torch.float32)
