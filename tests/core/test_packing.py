"""Pack compiler: every action token's restored state is exactly [q, x_t, a_{t,<k}].

States are rebuilt from the packed batch alone (ids, positions and the visibility of
the reference attention mask) and compared with the invocation records.
"""
import pytest
import torch

from memopd import LAYOUTS, PackError, pack, random_trajectories
from memopd.layout import SegmentKind
from memopd.memory import POLICIES
from memopd.ops import reference_packed_attention


def visible_state(batch, vis, index):
    keys = torch.nonzero(vis[index]).flatten()
    return batch.input_ids[keys].tolist(), batch.position_ids[keys].tolist()


def expected_state(tr, t, k):
    inv = tr.invocations[t]
    ids = inv.prefix_ids + inv.context_ids + inv.action_ids[:k]
    return ids, list(range(len(ids)))


def state_mismatches(batch, trajs):
    vis = batch.attn.visible()
    bad = 0
    for i in range(batch.num_actions):
        b, t, k = (int(batch.traj_index[i]), int(batch.call_index[i]), int(batch.token_index[i]))
        inv = trajs[b].invocations[t]
        ids, pos = expected_state(trajs[b], t, k)
        got = visible_state(batch, vis, int(batch.pred_index[i]))
        # the prediction is read at the last visible token: it must be the newest one
        last_ok = got[1] and got[1][-1] == max(got[1])
        # the action token itself sits at position |q|+|x|+k and sees the state plus itself
        a = int(batch.action_index[i])
        self_ok = (
            int(batch.input_ids[a]) == inv.action_ids[k]
            and int(batch.position_ids[a]) == len(ids)
            and visible_state(batch, vis, a) == (ids + [inv.action_ids[k]], pos + [len(ids)])
        )
        if got != (ids, pos) or not last_ok or not self_ok:
            bad += 1
    return bad


def check_common(batch, trajs):
    n_act = sum(len(inv.action_ids) for tr in trajs for inv in tr.invocations)
    assert batch.num_actions == n_act
    assert int(batch.action_mask.sum()) == n_act
    assert torch.equal(torch.nonzero(batch.action_mask).flatten().sort().values, batch.action_index.sort().values)
    assert torch.equal(batch.input_ids[batch.action_index], batch.target_ids)
    # map back to records, in (trajectory, call, k) order
    order = [(b, t, k) for b, tr in enumerate(trajs) for t, inv in enumerate(tr.invocations) for k in range(len(inv.action_ids))]
    assert list(zip(batch.traj_index.tolist(), batch.call_index.tolist(), batch.token_index.tolist())) == order
    lps = [lp for tr in trajs for inv in tr.invocations for lp in inv.sample_logprobs]
    assert torch.allclose(batch.sample_logprobs, torch.tensor(lps, dtype=torch.float32))
    assert batch.row_lengths and all(n > 0 for n in batch.row_lengths)
    # segments never cross rows
    rows = set(batch.cu_rows.tolist())
    for s in range(batch.attn.num_segments):
        lo, hi = int(batch.attn.cu_seqlens[s]), int(batch.attn.cu_seqlens[s + 1])
        assert not any(lo < r < hi for r in rows)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", ["aligned", "aligned_unshared", "independent"])
def test_restored_states_exact(policy, layout, seed):
    trajs = random_trajectories(policy, 6, seed=seed, group_size=3, initial_context_len=(0, 3))
    batch = pack(trajs, layout=layout, max_tokens=160)
    check_common(batch, trajs)
    assert state_mismatches(batch, trajs) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_group_prefix_sharing(policy, seed):
    trajs = random_trajectories(policy, 8, seed=seed, group_size=4)
    per_traj = pack(trajs, layout="aligned", max_tokens=4096)
    per_group = pack(trajs, layout="aligned", max_tokens=4096, share_prefix="group")
    check_common(per_group, trajs)
    assert state_mismatches(per_group, trajs) == 0
    assert per_group.stats()["prefix_segments"] == 2
    assert per_traj.stats()["prefix_segments"] == 8
    q = len(trajs[0].prefix_ids)
    assert per_traj.num_tokens - per_group.num_tokens == 3 * q + 3 * len(trajs[4].prefix_ids)


@pytest.mark.parametrize("policy", POLICIES)
def test_flatten_shows_states_never_seen(policy, seed):
    trajs = random_trajectories(policy, 6, seed=seed, calls=(3, 5), obs_len=(1, 6))
    batch = pack(trajs, layout="flatten", max_tokens=4096)
    check_common(batch, trajs)
    # every call after the first sees history it never saw at sampling time
    later = sum(len(inv.action_ids) for tr in trajs for inv in tr.invocations[1:])
    assert state_mismatches(batch, trajs) >= later > 0
    naive = batch.naive_action_mask
    assert bool((naive | ~batch.action_mask).all())  # naive domain contains m_act
    spurious = int(naive.sum()) - int(batch.action_mask.sum())
    copied = sum(p[0] == 1 for tr in trajs for inv in tr.invocations for p in inv.provenance)
    assert spurious == copied


def test_empty_context_predicts_from_prefix():
    from memopd import Invocation, Trajectory

    tr = Trajectory([Invocation([5, 6, 7], [], [8, 9], [-1.0, -2.0]), Invocation([5, 6, 7], [], [10], [-0.5])])
    b = pack([tr], layout="aligned")
    assert b.stats()["prefix_segments"] == 1
    first = [i for i in range(b.num_actions) if int(b.token_index[i]) == 0]
    for i in first:  # a_{t,0} is read at the last token of q, shared by both calls
        assert int(b.pred_index[i]) == 2
    assert state_mismatches(b, [tr]) == 0


def test_padding_tokens_see_nothing(seed):
    trajs = random_trajectories("full", 4, seed=seed)
    b = pack(trajs, layout="independent")
    vis = b.attn.visible()
    pads = torch.nonzero(b.attn.seg_start.long() > torch.arange(b.num_tokens)).flatten()
    assert len(pads) == b.padding_tokens > 0
    assert not vis[pads].any() and not vis[:, pads].any()
    assert len(set(b.row_lengths)) == 1


def test_over_budget_errors():
    trajs = random_trajectories("full", 2, seed=0, calls=(4, 4))
    longest = max(len(inv) for tr in trajs for inv in tr.invocations)
    with pytest.raises(PackError, match=r"trajectory \d+, call \d+ .* over max_tokens=5"):
        pack(trajs, layout="aligned", max_tokens=5)
    with pytest.raises(PackError, match="over max_tokens"):
        pack(trajs, layout="independent", max_tokens=longest - 1)
    with pytest.raises(PackError, match="flattened needs"):
        pack(trajs, layout="flatten", max_tokens=longest)
    # Trajectory.flattened_tokens is the flatten layout's sequence length: it fits exactly
    flat = max(tr.flattened_tokens for tr in trajs)
    assert pack(trajs, layout="flatten", max_tokens=flat).num_tokens >= flat
    with pytest.raises(PackError, match="flattened needs"):
        pack(trajs, layout="flatten", max_tokens=flat - 1)
    with pytest.raises(PackError, match="unknown layout"):
        pack(trajs, layout="nope")
    with pytest.raises(PackError, match="no trajectories"):
        pack([], layout="aligned")


def test_rows_respect_budget_and_micro_batches(seed):
    trajs = random_trajectories("full", 10, seed=seed, calls=(3, 6))
    b = pack(trajs, layout="aligned", max_tokens=120)
    assert max(b.row_lengths) <= 120 and b.num_rows > 1
    parts = b.micro_batches(250)
    assert sum(p.num_actions for p in parts) == b.num_actions
    assert sum(p.num_tokens for p in parts) == b.num_tokens
    for p in parts:
        assert p.num_tokens <= 250 or p.num_rows == 1
        # the map back still points at the right records, and states stay exact
        sub = [trajs[i] for i in range(len(trajs))]
        assert state_mismatches(p, sub) == 0


def _token_qkv(ids, pos, H=2, Hkv=1, D=8, seed=0):
    """q/k/v that depend on (token id, position), as after an embedding + RoPE."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(200, 3, H, D, generator=g, dtype=torch.float64)
    pe = torch.randn(512, 3, H, D, generator=g, dtype=torch.float64)
    x = emb[ids] + pe[pos]
    return x[:, 0], x[:, 1, :Hkv], x[:, 2, :Hkv]


@pytest.mark.parametrize("layout", ["aligned", "aligned_unshared", "independent", "flatten"])
def test_reference_attention_matches_independent_calls(layout, seed):
    """Mini-RCE: attention outputs at prediction positions equal a causal attention over
    each call alone; `flatten` must not."""
    trajs = random_trajectories("summary", 4, seed=seed, group_size=2, calls=(3, 4), obs_len=(1, 5))
    b = pack(trajs, layout=layout, max_tokens=4096, share_prefix="group")
    q, k, v = _token_qkv(b.input_ids, b.position_ids, seed=seed)
    out = reference_packed_attention(q, k, v, b.attn)
    worst = 0.0
    for i in range(b.num_actions):
        bi, t, kk = int(b.traj_index[i]), int(b.call_index[i]), int(b.token_index[i])
        inv = trajs[bi].invocations[t]
        ids = torch.tensor(inv.input_ids)
        qi, ki, vi = _token_qkv(ids, torch.arange(len(ids)), seed=seed)
        n = len(inv.prefix_ids) + len(inv.context_ids) + kk
        att = torch.nn.functional.scaled_dot_product_attention(
            qi[:n].transpose(0, 1), ki[:n].repeat(1, 2, 1).transpose(0, 1), vi[:n].repeat(1, 2, 1).transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        worst = max(worst, float((out[int(b.pred_index[i])] - att[n - 1]).abs().max()))
    if layout == "flatten":
        assert worst > 1e-3
    else:
        assert worst < 1e-10


def test_reference_attention_masked_rows_zero_and_errors():
    from memopd.layout import AttentionMeta

    meta = AttentionMeta.from_segments([0, 3, 5], [-1, -1], [SegmentKind.CALL, SegmentKind.PAD])
    q = torch.randn(5, 2, 4, requires_grad=True)
    out = reference_packed_attention(q, q.detach()[:, :1], q.detach()[:, :1], meta)
    assert torch.isfinite(out).all() and (out[3:] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        reference_packed_attention(torch.randn(5, 3, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4), meta)
    with pytest.raises(ValueError, match="metadata describes 5 tokens"):
        reference_packed_attention(torch.randn(4, 2, 4), torch.randn(4, 2, 4), torch.randn(4, 2, 4), meta)


def naive_entries(trajs):
    """(trajectory, call, index, target id, is_sampled) of the naive action domain, in order."""
    out = []
    for b, tr in enumerate(trajs):
        for t, inv in enumerate(tr.invocations):
            k = 0
            for j, p in enumerate(inv.provenance or []):
                if p[0] == 1 and not (j == 0 and not tr.prefix_ids):
                    out.append((b, t, k, inv.context_ids[j], False))
                    k += 1
            for a in inv.action_ids:
                out.append((b, t, k, a, True))
                k += 1
    return out


@pytest.mark.parametrize("policy", ["full", "summary", "suffix"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_naive_action_domain_adds_context_copies(policy, layout, seed):
    trajs = random_trajectories(policy, 6, seed=seed, group_size=3, calls=(3, 5))
    exact = pack(trajs, layout=layout, max_tokens=4096, share_prefix="group")
    naive = pack(trajs, layout=layout, max_tokens=4096, share_prefix="group", action_domain="naive")
    want = naive_entries(trajs)
    got = list(zip(naive.traj_index.tolist(), naive.call_index.tolist(), naive.token_index.tolist(),
                   naive.target_ids.tolist(), naive.is_sampled.tolist()))
    assert got == want
    n_copies = sum(not e[4] for e in want)
    assert n_copies > 0  # these policies keep model output in later contexts
    assert naive.num_actions == exact.num_actions + n_copies
    assert torch.equal(naive.input_ids[naive.action_index], naive.target_ids)
    # one marked token per entry; the trie lays identical states out once, so there several
    # entries may share one token
    assert int(naive.action_mask.sum()) == naive.action_index.unique().numel()
    if layout != "trie":
        assert int(naive.action_mask.sum()) == naive.num_actions
    # copies carry no sampling log-prob; the sampled entries are those of the exact domain
    assert bool(torch.isnan(naive.sample_logprobs[~naive.is_sampled]).all())
    s = naive.is_sampled
    assert torch.equal(naive.target_ids[s], exact.target_ids)
    assert torch.equal(naive.pred_index[s], exact.pred_index)
    assert torch.equal(naive.sample_logprobs[s], exact.sample_logprobs)
    assert bool(exact.is_sampled.all())
    # every copy is predicted from the token just before it in the state it sits in
    vis = naive.attn.visible()
    for i in torch.nonzero(~s).flatten().tolist():
        p, a = int(naive.pred_index[i]), int(naive.action_index[i])
        assert bool(vis[a, p]) and int(naive.position_ids[p]) == int(naive.position_ids[a]) - 1
    if layout in ("aligned", "aligned_unshared", "independent", "trie"):
        # restored layouts score a copy in its own call's state [q, x_t[:j]]
        for i in torch.nonzero(~s).flatten().tolist():
            b, t = int(naive.traj_index[i]), int(naive.call_index[i])
            inv = trajs[b].invocations[t]
            j = int(naive.position_ids[naive.action_index[i]]) - len(inv.prefix_ids)
            ids, _ = visible_state(naive, vis, int(naive.pred_index[i]))
            assert ids == inv.prefix_ids + inv.context_ids[:j]


def test_naive_domain_micro_batches_keep_entries(seed):
    trajs = random_trajectories("summary", 8, seed=seed, group_size=4, calls=(3, 5))
    naive = pack(trajs, layout="aligned", max_tokens=300, share_prefix="group", action_domain="naive")
    mbs = naive.micro_batches(300)
    assert len(mbs) > 1
    ids = torch.cat([mb.action_id for mb in mbs]).sort().values
    assert torch.equal(ids, torch.arange(naive.num_actions))
    for mb in mbs:
        assert torch.equal(mb.is_sampled, naive.is_sampled[mb.action_id])
        assert torch.equal(mb.input_ids[mb.action_index], mb.target_ids)


def test_unknown_action_domain_is_an_error():
    trajs = random_trajectories("full", 2, seed=0)
    with pytest.raises(PackError, match="action_domain"):
        pack(trajs, action_domain="everything")
