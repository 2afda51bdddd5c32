"""The trie layout's batches stay those of a stored reference, bit for bit, and the C++
trie planner gives the Python one's batches.

`tests/core/data/trie_batches.json` holds, per case, a digest of the trajectories and of
every tensor of the batch that `pack(..., "trie")` returned when the reference was
written (the all-Python trie planner, before the C++ one). Cases: every memory policy,
random and shared early calls (identical call-0 contexts and first steps), a small
vocabulary (deep sharing) and a large one, loose and tight budgets, both action domains,
ids beyond 2**32 and negative ids (validate=False). A case whose trajectory digest no
longer matches names the generator, not the packer, as what changed. Then, on fresh
random batches, the core's planner (`memopd._C.trie_plan`) against the Python one it
replaced (`packing._trie_plan_py`), every tensor equal.

Rewrite the reference only from a commit whose trie batches are trusted:
    python tests/core/test_trie_reference.py --write
"""
import hashlib
import json
import os
import random
import sys

import pytest
import torch

from memopd import Invocation, Trajectory, pack, packing, random_trajectories
from memopd.memory import POLICIES

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "trie_batches.json")


def _shift(trajs, by):
    """The trajectories with every token id moved by `by` (provenance kept)."""
    def ids(v):
        return None if v is None else [i + by for i in v]

    return [Trajectory([Invocation(ids(v.prefix_ids), ids(v.context_ids), ids(v.action_ids), v.sample_logprobs,
                                   v.provenance, ids(v.observation_ids)) for v in tr.invocations],
                       reward=tr.reward, group_id=tr.group_id) for tr in trajs]


def _longest(trajs) -> int:
    return max(len(v.prefix_ids) + len(v.context_ids) + len(v.action_ids) for tr in trajs for v in tr.invocations)


def cases():
    """name -> (trajectories, pack keywords)."""
    out = {}
    for policy in POLICIES:
        for seed in (0, 1, 2):
            for shared in (False, True):
                for vocab in (6, 128):
                    kw = dict(group_context=True, group_steps=2) if shared else {}
                    trajs = random_trajectories(policy, 12, seed=seed, group_size=4, vocab_size=vocab, calls=(2, 6),
                                                initial_context_len=(2, 8), **kw)
                    for budget in (8192, _longest(trajs) + 8):
                        for domain in ("exact", "naive"):
                            tight = "loose" if budget == 8192 else "tight"
                            name = f"{policy}-s{seed}-{'shared' if shared else 'random'}-v{vocab}-{tight}-{domain}"
                            out[name] = (trajs, dict(max_tokens=budget, action_domain=domain))
        trajs = random_trajectories(policy, 8, seed=7, group_size=4, vocab_size=5, calls=(2, 5),
                                    group_context=True, group_steps=1)
        out[f"{policy}-big-ids"] = (_shift(trajs, 2**40), dict(max_tokens=8192))
        out[f"{policy}-negative-ids"] = (_shift(trajs, -4), dict(max_tokens=_longest(trajs) + 4, validate=False))
    return out


def digest_trajs(trajs) -> str:
    h = hashlib.sha256()
    for tr in trajs:
        for v in tr.invocations:
            h.update(repr((v.prefix_ids, v.context_ids, v.action_ids, v.sample_logprobs, v.provenance,
                           v.observation_ids, tr.group_id)).encode())
    return h.hexdigest()[:20]


def digest_batch(batch) -> str:
    h = hashlib.sha256()
    for obj in (batch, batch.attn):
        for k, v in sorted(vars(obj).items()):
            if isinstance(v, torch.Tensor):
                h.update(k.encode() + str(v.dtype).encode() + str(tuple(v.shape)).encode())
                h.update(v.contiguous().numpy().tobytes())
            elif isinstance(v, (int, str, bool)) or v is None:
                h.update(f"{k}={v!r}".encode())
    return h.hexdigest()[:20]


def _reference():
    with open(DATA) as f:
        return json.load(f)


REF = _reference() if os.path.exists(DATA) else {}
CASES = cases()


def test_reference_covers_every_case():
    assert sorted(REF) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_trie_batch_is_the_stored_one(name):
    trajs, kw = CASES[name]
    want = REF[name]
    assert digest_trajs(trajs) == want["trajectories"], "the trajectory generator changed, not the packer"
    assert digest_batch(pack(trajs, "trie", **kw)) == want["batch"]


def test_the_core_trie_planner_is_the_python_one(monkeypatch, seed):
    from memopd import _C

    assert hasattr(_C, "trie_plan"), "the core is older than its source: rebuild it"
    for k in range(12):
        policy = POLICIES[k % len(POLICIES)]
        kw = dict(group_context=True, group_steps=k % 3) if k % 2 else {}
        trajs = random_trajectories(policy, 16, seed=seed * 100 + k, group_size=1 + k % 4, vocab_size=(5, 9, 300)[k % 3],
                                    calls=(1, 7), initial_context_len=(0, 6), prefix_len=(0, 5) if k % 4 == 3 else (3, 12),
                                    **kw)
        budgets = (8192, _longest(trajs) + 10, _longest(trajs))
        core = [pack(trajs, "trie", max_tokens=b, action_domain="naive" if k % 2 else "exact") for b in budgets]
        with monkeypatch.context() as m:
            m.setattr(packing, "_core_trie_plan", lambda: None)
            py = [pack(trajs, "trie", max_tokens=b, action_domain="naive" if k % 2 else "exact") for b in budgets]
        for got, want in zip(core, py):
            assert digest_batch(got) == digest_batch(want), (policy, k)


def _system_prompt_batch(seed: int) -> list:
    """Groups whose q are one system prompt plus 0-3 more ids (some q a proper prefix of
    another's), contexts drawn from few ids: calls of different q interleave in the order."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 6) for _ in range(rng.randint(0, 12))]
    trajs = []
    for g in range(10):
        q = system + [rng.randrange(3, 6) for _ in range(rng.randint(0, 3))]
        for _ in range(rng.randint(1, 4)):
            invs = [Invocation(q, [rng.randrange(3, 6) for _ in range(rng.randint(0 if q else 1, 5))],
                               [rng.randrange(3, 6) for _ in range(rng.randint(1, 4))]) for _ in range(rng.randint(1, 4))]
            trajs.append(Trajectory(invs, group_id=str(g)))
    return trajs


def test_the_core_sorts_and_plans_as_python_with_shared_system_prompts(monkeypatch, seed):
    from memopd import _C

    for k in range(40):
        trajs = _system_prompt_batch(seed * 1000 + k)
        rec = packing._Records(trajs, need_src=False, check=False)
        length = rec.q_len + rec.x_len + rec.a_len
        got = _C.trie_plan(rec.ids, rec.q_off_traj, rec.q_len_traj, rec.traj, rec.x_off, length)
        want = packing._trie_plan_py(rec, length)
        for g, w, what in zip(got, want, ("order", "spine", "depth")):
            assert g.tolist() == w.tolist(), (k, what)
        with monkeypatch.context() as m:
            m.setattr(packing, "_core_trie_plan", lambda: None)
            py = pack(trajs, "trie", max_tokens=30)
        assert digest_batch(pack(trajs, "trie", max_tokens=30)) == digest_batch(py), k


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    os.makedirs(os.path.dirname(DATA), exist_ok=True)
    ref = {name: {"trajectories": digest_trajs(t), "batch": digest_batch(pack(t, "trie", **kw))}
           for name, (t, kw) in CASES.items()}
    with open(DATA, "w") as f:
        json.dump(ref, f, indent=0, sort_keys=True)
    print(f"wrote {len(ref)} cases to {DATA}")
