"""The rule teacher (trainer/experiments/ruleteacher.py): on packed rows of any layout it reads the
visible ids and answers with the rational rule; it equals the rule on the rule's own
episodes, is silent where the rule is, and its aligned and flattened readings differ only
where the rule's two views of the same call differ."""
from dataclasses import replace

import pytest
import torch

from memopd.env import EnvConfig, QAEnv, World, build_tokenizer, rollout
from memopd.env.qa.expert import make_expert
from memopd.env.qa.sft import flattened_prompt
from memopd.env.qa.world import world_preset
from memopd.packing import pack
from memopd.trainer.experiments.infogap import information_gap_calls
from memopd.trainer.experiments.ruleteacher import RuleTeacher, beta_for, rule_next_token
from memopd.trainer.settings import PPOSettings


@pytest.fixture(scope="module")
def linked():
    world = World.generate(replace(world_preset("info-gap"), linked_frac=1.0))
    tok = build_tokenizer(world.vocabulary_texts(), kind="word")
    env = QAEnv.from_world(world, tok, EnvConfig(policy="summary"))
    return world, tok, env


def _episodes(world, env, expert, n=24, seed=3, temperature=0.0):
    return rollout(env, make_expert(expert, env.tokenizer, world.config), world.sample_tasks(2, n, split="eval", seed=seed),
                   temperature=temperature)


def _teacher(world, tok, p=0.9):
    return RuleTeacher(tok, world.config, vocab_size=len(tok), p_target=p)


def test_beta_gives_the_stated_probability():
    for p, v in ((0.5, 300), (0.6, 1000), (0.9, 17)):
        z = torch.zeros(v, dtype=torch.float64)
        z[3] = beta_for(p, v)
        assert abs(float(torch.softmax(z, 0)[3]) - p) < 1e-12
    # at temperature 2 the op divides by 2: β doubles
    assert abs(beta_for(0.6, 100, 2.0) - 2 * beta_for(0.6, 100)) < 1e-12
    for bad in (0.0, 1.0, 0.001):
        with pytest.raises(ValueError):
            beta_for(bad, 100)


@pytest.mark.parametrize("layout", ["aligned", "aligned_unshared", "independent"])
def test_equals_the_rule_on_its_own_episodes(linked, layout):
    world, tok, env = linked
    trajs = _episodes(world, env, "rational")
    batch = pack(trajs, layout=layout, max_tokens=4096, share_prefix="group")
    t = _teacher(world, tok)
    ys = t.targets(batch)
    assert len(ys) == batch.target_ids.shape[0] > 100
    assert ys == batch.target_ids.tolist()  # every token the rule wrote, and never silent
    out = t.read_packed(batch)
    assert out.shape == (len(ys), len(tok) + 1) and bool((out[:, -1] == 1).all())
    assert out[:, :-1].argmax(-1).tolist() == ys and float(out[:, :-1].sum()) == len(ys)


def test_silent_where_the_rule_is(linked):
    world, tok, env = linked
    expert = make_expert("rational", tok, world.config)
    trajs = _episodes(world, env, "rational", n=6)
    tk = expert.tokens
    inv = trajs[0].invocations[0]
    state = list(inv.prefix_ids) + list(inv.context_ids)
    own = expert.act(state)
    assert own[0] == tk.mem_open and tk.mem_close in own
    # following the rule: its tokens, then silent past the end of its action
    assert [rule_next_token(expert, state, own[:j]) for j in range(len(own))] == own
    assert rule_next_token(expert, state, own) is None
    # notes that leave the rule's: silent until they close ...
    wrong = tok.encode(" xb", add_special_tokens=False) + tok.encode(" oslo", add_special_tokens=False)
    notes = [tk.mem_open] + [int(i) for i in wrong]
    assert notes != own[:len(notes)]
    assert rule_next_token(expert, state, notes) is None
    # ... then the rule's search or answer for the notes written, and silent once that is left
    closed = notes + [tk.mem_close]
    y = rule_next_token(expert, state, closed)
    assert y in (tk.search_open, tk.answer_open)
    other = tk.answer_open if y == tk.search_open else tk.search_open
    assert rule_next_token(expert, state, closed + [other]) is None
    # an action that does not open notes: silent
    assert rule_next_token(expert, state, [tk.search_open]) is None


def test_views_differ_only_where_the_rules_views_differ(linked):
    """On the plain expert's episodes (it drops facts the flattened history still shows):
    each packed reading is the rule on that view's state, exactly; the aligned and the
    flattened readings agree at every call where the rule's two actions agree and the
    recorded action follows them, and differ at information-gap calls."""
    world, tok, env = linked
    expert = make_expert("rational", tok, world.config)
    trajs = _episodes(world, env, "scripted", n=40)
    t = _teacher(world, tok)
    ya = t.targets(pack(trajs, layout="aligned", max_tokens=4096, share_prefix="group"))
    yf = t.targets(pack(trajs, layout="flatten", max_tokens=4096, share_prefix="group"))
    gaps = information_gap_calls(trajs, expert)
    assert sum(map(sum, gaps)) >= 5
    i = 0
    gap_hits = 0
    for b, tr in enumerate(trajs):
        for c, inv in enumerate(tr.invocations):
            a = [int(x) for x in inv.action_ids]
            compact = list(inv.prefix_ids) + list(inv.context_ids)
            flat = flattened_prompt(tr, c)
            own = expert.act(compact)
            hit = False
            for j in range(len(a)):
                ra, rf = rule_next_token(expert, compact, a[:j]), rule_next_token(expert, flat, a[:j])
                assert (ya[i], yf[i]) == (ra, rf), (b, c, j)
                if ya[i] != yf[i]:
                    hit = True
                    if not gaps[b][c]:  # where the views' actions agree they can part only off the rule's action
                        assert own[:j] != a[:j]
                i += 1
            gap_hits += hit and gaps[b][c]
    assert i == len(ya)
    assert gap_hits >= 0.9 * sum(map(sum, gaps))


def test_score_masks_the_silent_positions_out_of_the_opd_term(linked):
    """Through the trainer's own scoring: `Scored.teacher_speaks` is where the rule speaks,
    and the update's OPD mask leaves the silent entries out."""
    from memopd.models import tiny_causal_lm
    from memopd.trainer.modules import Actor, Critic, Scoring
    from memopd.trainer.update import pack_layout, score, teacher_mask_of

    world, tok, env = linked
    trajs = _episodes(world, env, "scripted", n=8, temperature=1.0)  # scored at the training temperature
    lm = tiny_causal_lm("qwen2", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=2, max_positions=2048, pad_token_id=0, seed=0)
    actor = Actor(lm, scoring=Scoring(1.0, len(tok)))
    teacher = _teacher(world, tok)
    sc = score(actor, Critic(lm), None, teacher, trajs, teacher_layout="flatten", max_tokens=4096,
               ppo=PPOSettings(ref_kl_coef=0.0, gamma=1.0, lam=1.0))
    ys = teacher.targets(pack_layout(trajs, 4096, layout="flatten"))
    assert sc.teacher_speaks.tolist() == [y is not None for y in ys]
    assert 0 < int(sc.teacher_speaks.sum()) < len(ys)  # silent somewhere, speaking mostly
    batch = pack_layout(trajs, 4096)
    gid = sc.offsets[batch.traj_index, batch.call_index] + batch.token_index
    assert teacher_mask_of(sc, batch, gid).tolist() == [y is not None for y in ys]
