"""Agent protocol, malformed actions, turn budget, the scripted expert, records."""
import pytest

from memopd.env import EnvConfig, QAEnv, World, WorldConfig, build_tokenizer, expert_trajectories
from memopd.env.qa.protocol import ERRORS, parse_action, split_answers
from memopd.records import Source, load_trajectories, save_trajectories


@pytest.fixture(scope="module")
def world():
    return World.generate(WorldConfig(seed=0))


@pytest.fixture(scope="module")
def tok(world):
    return build_tokenizer(world.vocabulary_texts())


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("k", [2, 8, 16])
def test_expert_full_marks(world, tok, k):
    env = QAEnv.from_world(world, tok)
    trajs = expert_trajectories(env, world.sample_tasks(k, 12, split="eval"))
    for tr in trajs:
        assert tr.rewards["em_sum"] == k and tr.rewards["em_mean"] == 1.0 and tr.reward == 1.0
        assert tr.rewards["format_errors"] == 0 and tr.info["finish"] == "answer"
        assert tr.info["turns"] <= 2 * k + 1
        tr.validate(vocab_size=len(tok))


@pytest.mark.parametrize("policy,kw", [("full", {}), ("refresh", {}), ("window", {"turns": 1}),
                                       ("suffix", {"max_tokens": 256})])
def test_expert_under_other_policies(world, tok, policy, kw):
    env = QAEnv.from_world(world, tok, EnvConfig(policy=policy, policy_kwargs=kw))
    for tr in expert_trajectories(env, world.sample_tasks(4, 4, split="eval")):
        assert tr.rewards["em_mean"] == 1.0
        tr.validate()


def test_summary_context_is_memory_plus_observation(world, tok):
    env = QAEnv.from_world(world, tok)
    tr = expert_trajectories(env, world.sample_tasks(2, 1))[0]
    p = env.tokens
    assert tr.invocations[0].context_ids == []
    for t in range(1, len(tr)):
        inv, prev = tr.invocations[t], tr.invocations[t - 1]
        s = prev.action_ids.index(p.mem_open)
        e = prev.action_ids.index(p.mem_close) + 1
        assert inv.context_ids == prev.action_ids[s:e] + prev.observation_ids
        assert [src for src, _, _ in inv.provenance] == [Source.ACTION] * (e - s) + [Source.OBSERVATION] * len(
            prev.observation_ids)
        assert inv.prefix_ids == tr.invocations[0].prefix_ids


def test_trajectories_round_trip(world, tok, tmp_path):
    env = QAEnv.from_world(world, tok)
    trajs = expert_trajectories(env, world.sample_tasks(3, 4), group_size=2)
    assert [t.group_id for t in trajs] == [t.task_id for t in trajs]
    assert trajs[0].group_id == trajs[1].group_id != trajs[2].group_id
    path = tmp_path / "t.jsonl"
    save_trajectories(path, trajs, vocab_size=len(tok))
    back = load_trajectories(path)
    assert [t.to_json() for t in back] == [t.to_json() for t in trajs]


def test_parse_action_cases(tok, world):
    env = QAEnv.from_world(world, tok)
    p = env.tokens
    ok = parse_action(enc(tok, f"<mem> xa</mem><search> qa {world.entities[0]} ka job</search>"), p)
    assert ok.kind == "search" and ok.memory == (0, 3) and ok.body == (4, 8)
    cases = {
        "<mem> xa</mem><search> qa x y": "cut_off",
        "<mem> xa</mem> qa x</search>": "no_search_open",
        "<mem> xa</mem> red</answer>": "no_answer_open",
        "<search> qa x</search>": "no_memory",
        "<mem> xa<search> qa x</search>": "memory_open",
        "<mem></mem><search> x</search><answer> y</answer>": "two_actions",
        "<mem></mem><search> x<answer> y</answer>": "two_actions",
        "<mem></mem><info> x</info><search> y</search>": "info_tag",
    }
    for text, code in cases.items():
        r = parse_action(enc(tok, text), p)
        assert (r.kind, r.error) == ("error", code), text
    assert parse_action(enc(tok, "<search> qa x</search>"), p, require_memory=False).kind == "search"
    assert parse_action(enc(tok, "<mem></mem><answer> red</answer><eos>"), p).kind == "answer"


def test_malformed_actions_use_budget_and_never_crash(world, tok):
    env = QAEnv.from_world(world, tok, EnvConfig(max_turns=4))
    task = world.sample_tasks(2, 1)[0]
    ep = env.reset(task)
    bad = [enc(tok, " paris paris"), enc(tok, "<mem></mem><search></search>"), enc(tok, "<eos>"),
           enc(tok, "<search> qa x</search>")]
    kinds = []
    for a in bad:
        r = ep.step(a)
        kinds.append(r.error)
        assert env.decode(r.observation_ids).startswith(" error :")
        assert r.observation_ids[0] == env.tokens.info_open and r.observation_ids[-1] == env.tokens.info_close
    assert kinds == ["cut_off", "empty_query", "cut_off", "no_memory"]
    assert ep.done and ep.finish == "budget"
    tr = ep.trajectory()
    tr.validate()
    assert tr.rewards["format_errors"] == 4 and tr.rewards["em_sum"] == 0 and tr.reward == 0.0
    assert tr.rewards["answered"] is False
    with pytest.raises(RuntimeError, match="is over"):
        ep.step(enc(tok, "<mem></mem><answer> x</answer>"))
    assert set(ERRORS) >= set(kinds)


def test_answers_partial_and_labelled(world, tok):
    env = QAEnv.from_world(world, tok)
    task = world.sample_tasks(3, 1)[0]
    gold = [a[0] for a in task.answers]
    ep = env.reset(task)
    ep.step(enc(tok, f"<mem></mem><answer> xc {gold[2]} ; xa {gold[0]}</answer>"))
    tr = ep.trajectory()
    assert tr.rewards["em"] == [1.0, 0.0, 1.0] and tr.rewards["em_sum"] == 2.0
    assert tr.reward == pytest.approx(2 / 3)  # mean F1 by default
    assert tr.info["predictions"] == [gold[0], "", gold[2]]
    assert split_answers("x ; y", 3) == ["x", "y", ""]
    assert split_answers("xb y xa x", 2) == ["x", "y"]
    assert split_answers("no ; yes", 20) == ["no", "yes"] + [""] * 18  # an answer word is no label
    env_em = QAEnv.from_world(world, tok, EnvConfig(reward="em"))
    ep = env_em.reset(task)
    ep.step(enc(tok, f"<mem></mem><answer> {gold[0]} ; nope ; nope</answer>"))
    assert ep.trajectory().reward == pytest.approx(1 / 3)


def test_unknown_policy_is_a_clear_error(world, tok):
    with pytest.raises(ValueError, match="unknown memory policy 'nope'"):
        QAEnv.from_world(world, tok, EnvConfig(policy="nope"))
