"""HF packed forward + RCE audit: aligned layouts restore the sampling states exactly.

Tiny random-init Qwen2 / Llama models (fp32, sharp init so contexts matter) on
trajectories from every memory policy.
"""
import json

import pytest
import torch

from memopd import pack, random_trajectories
from memopd.hf import independent_forward, packed_forward, packed_hidden_states
from memopd.layout import AttentionMeta, SegmentKind
from memopd.memory import POLICIES
from memopd.models import tiny_causal_lm
from memopd.rce import audit

BACKEND = "auto"


@pytest.fixture(scope="module")
def models():
    return {
        "qwen2": tiny_causal_lm("qwen2", vocab_size=128, initializer_range=0.2, seed=1),
        "llama": tiny_causal_lm("llama", vocab_size=128, initializer_range=0.2, seed=2),
        "qwen2-tied": tiny_causal_lm("qwen2", vocab_size=128, initializer_range=0.2, seed=3, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2-tied"])
@pytest.mark.parametrize("policy", POLICIES)
def test_aligned_passes_flatten_fails(models, arch, policy, seed):
    trajs = random_trajectories(policy, 6, seed=seed, group_size=3, vocab_size=128, calls=(3, 5), obs_len=(1, 8))
    res = {r.variant: r for r in audit(models[arch], trajs, attention_backend=BACKEND)}
    for v in ("aligned", "aligned_group", "aligned_unshared", "trie"):
        assert res[v].max_logit_linf <= 1e-4, (v, res[v])
        assert res[v].top1_changes == 0
        assert res[v].must_pass
    assert res["flatten"].max_logit_linf > 0.1
    assert res["flatten"].max_logit_linf > 1000 * res["aligned"].max_logit_linf
    assert res["positions_broken"].max_logit_linf > 0.1
    assert res["visibility_broken"].max_logit_linf > 0.1
    assert res["flatten"].spurious_positions >= 0


@pytest.mark.parametrize("policy", POLICIES)
def test_trie_passes_on_shared_early_calls(models, policy, seed):
    """Rollouts of a group with one x_0 and two identical first steps: the trie lays the
    shared calls out once (fewer tokens than one prefix per group) and every action's
    logits stay within 1e-5 of its call alone (fp32), on every memory policy."""
    trajs = random_trajectories(policy, 6, seed=seed, group_size=3, vocab_size=128, calls=(3, 5), obs_len=(1, 8),
                                initial_context_len=(4, 12), group_context=True, group_steps=2)
    trie = pack(trajs, "trie")
    assert trie.num_tokens < pack(trajs, "aligned", share_prefix="group").num_tokens
    assert trie.action_index.unique().numel() < trie.num_actions  # identical early calls: shared entries
    for arch in ("qwen2", "llama"):
        res = {r.variant: r for r in audit(models[arch], trajs, ("trie", "aligned_group"), attention_backend=BACKEND)}
        assert res["trie"].max_logit_linf <= 1e-5, res["trie"]
        assert res["trie"].top1_changes == 0 and res["trie"].passed


def test_metadata_is_really_used(models):
    """Two segments whose positions look like one contiguous sequence (0..4, 5..9) must
    stay apart: the second equals an independent forward of itself at positions 5..9."""
    m = models["qwen2"]
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    meta = AttentionMeta.from_segments([0, 5, 10], [-1, -1], [SegmentKind.CALL, SegmentKind.CALL])
    from memopd.layout import PackedBatch

    batch = PackedBatch(
        layout="custom", input_ids=ids, position_ids=torch.arange(10), attn=meta, cu_rows=torch.tensor([0, 10]),
        action_mask=torch.zeros(10, dtype=torch.bool), action_index=torch.zeros(0, dtype=torch.long),
        pred_index=torch.zeros(0, dtype=torch.long), target_ids=torch.zeros(0, dtype=torch.long),
        sample_logprobs=torch.zeros(0), teacher_mask=torch.zeros(0, dtype=torch.bool),
        traj_index=torch.zeros(0, dtype=torch.long), call_index=torch.zeros(0, dtype=torch.long),
        token_index=torch.zeros(0, dtype=torch.long), segment_traj=torch.zeros(2, dtype=torch.long),
        segment_call=torch.zeros(2, dtype=torch.long),
    )
    with torch.no_grad():
        h = packed_hidden_states(m, batch, attention_backend=BACKEND)
        alone = m.model(input_ids=ids[5:].unsqueeze(0), position_ids=torch.arange(5, 10).unsqueeze(0)).last_hidden_state[0]
        joined = m.model(input_ids=ids.unsqueeze(0), position_ids=torch.arange(10).unsqueeze(0)).last_hidden_state[0]
    assert torch.allclose(h[5:], alone, atol=1e-5)
    assert (h[5:] - joined[5:]).abs().max() > 1e-2


def test_missing_metadata_is_an_error(models):
    from memopd.hf import use_memopd_attention

    m = models["qwen2"]
    with use_memopd_attention(m), pytest.raises(ValueError, match="memopd_meta"):
        m(input_ids=torch.tensor([[3, 4, 5]]))
    # and the previous implementation is back afterwards
    assert m.config._attn_implementation != "memopd"


@pytest.mark.parametrize("layout", ["aligned", "trie"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gradients_match_independent(models, arch, layout, seed):
    """d(actor loss over action tokens) through one packed forward equals the sum over
    independent per-call forwards (trie: with identical early calls, whose entries share
    tokens)."""
    m = models[arch]
    shared = dict(group_context=True, group_steps=1) if layout == "trie" else {}
    trajs = random_trajectories("summary", 4, seed=seed, group_size=2, vocab_size=128, calls=(2, 4), **shared)
    batch = pack(trajs, layout=layout, share_prefix="group")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(batch.num_actions, generator=g)
    m.zero_grad()
    logits = packed_forward(m, batch, attention_backend=BACKEND)
    lp = torch.log_softmax(logits, -1).gather(1, batch.target_ids.unsqueeze(1)).squeeze(1)
    (w * lp).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    i = 0
    for tr in trajs:
        for inv in tr.invocations:
            lg = independent_forward(m, inv.input_ids)
            n0 = len(inv.prefix_ids) + len(inv.context_ids)
            lps = torch.log_softmax(lg[n0 - 1 : n0 - 1 + len(inv.action_ids)], -1)
            lps = lps.gather(1, torch.tensor(inv.action_ids).unsqueeze(1)).squeeze(1)
            (w[i : i + len(lps)] * lps).sum().backward()
            i += len(lps)
    assert i == batch.num_actions
    for n, p in m.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(packed_grads[n], p.grad, atol=2e-4, rtol=1e-3, msg=n)
    m.zero_grad()


def test_audit_cli(tmp_path):
    from memopd.cli import main

    out = tmp_path / "audit.json"
    rc = main(["audit", "--policy", "window", "--num-trajectories", "4", "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    rows = {r["variant"]: r for r in rep["policies"]["window"]}
    assert rows["aligned"]["passed"] and not rows["flatten"]["passed"]


def test_audit_cli_recorded_file(tmp_path):
    from memopd import save_trajectories
    from memopd.cli import main

    path = tmp_path / "t.jsonl"
    save_trajectories(path, random_trajectories("refresh", 3, seed=0, vocab_size=256))
    assert main(["audit", "--trajectories", str(path), "--arch", "llama"]) == 0


def test_requested_attention_backend_reaches_the_op(monkeypatch):
    """`attention_backend="torch"|"reference"` must select that backend, not "auto"."""
    import memopd.ops.attention as pa
    from memopd import pack, random_trajectories
    from memopd.hf import packed_forward
    from memopd.models import tiny_causal_lm

    seen = []
    real = pa.packed_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend", "auto"))
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "packed_attention", spy)
    model = tiny_causal_lm("qwen2", vocab_size=64, hidden_size=32, num_layers=1)
    batch = pack(random_trajectories("summary", 2, vocab_size=64, seed=0, calls=(2, 2)), layout="aligned")
    for backend in ("torch", "reference"):
        seen.clear()
        packed_forward(model, batch, attention_backend=backend)
        assert seen and set(seen) == {backend}
