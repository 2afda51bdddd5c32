"""The "info-gap" world preset and the rational expert rule (trainer/experiments/infogap.py): linked
question pairs and their per-set turn budgets, the share of information-gap calls the
plain expert's episodes hold, labels that differ between the compact and the flattened
view on information-gap and perturbed states, and the SFT recipe the preset picks."""
import random
import re
from dataclasses import replace

import pytest

from memopd.env import EnvConfig, QAEnv, World, build_tokenizer, rollout
from memopd.env.qa.expert import expert_options, make_expert
from memopd.env.qa.notes import parse_entries
from memopd.env.qa.sft import FLATTEN_VIEW, SFTConfig, flattened_prompt, role_presets
from memopd.env.qa.world import VALUE_SETS, WORLD_PRESETS, WorldConfig, parse_question, world_preset
from memopd.trainer.experiments.infogap import (
    action_token_roles,
    gap_share,
    information_gap_calls,
    view_disagreement_ceiling,
)
from memopd.trainer.experiments.infogap_expert import RationalExpert, efficient_calls, rational_action_text
from memopd.trainer.experiments.infogap_sft import (
    INFOGAP_MODEL_PRESETS,
    INFOGAP_SFT_PRESETS,
    InfoGapSFTConfig,
    expert_examples,
    gap_continuation,
    perturbed_state,
)
from memopd.trainer.experiments.infogap_world import InfoGapWorld, InfoGapWorldConfig

# The share of the plain (scripted) expert's calls on held-out Q2 sets that are
# information-gap calls: 10.9% measured on 100 sets of seed 0; the range leaves room for
# other seeds, and excludes both "no gap" and "every other call".
GAP_SHARE_RANGE = (0.07, 0.16)


@pytest.fixture(scope="module")
def infogap():
    world = World.generate(world_preset("info-gap"))
    return world, build_tokenizer(world.vocabulary_texts(), kind="word")


def _episodes(world, tok, expert, policy, k=2, n=60, split="eval", seed=0):
    env = QAEnv.from_world(world, tok, EnvConfig(policy=policy))
    return env, rollout(env, make_expert(expert, tok, world.config), world.sample_tasks(k, n, split=split, seed=seed),
                        temperature=0.0)


def test_preset_keeps_the_replication_sets_and_adds_links_in_their_own_stream(infogap):
    assert "info-gap" in WORLD_PRESETS and world_preset("info-gap").preset == "info-gap"
    rep = World.generate(world_preset("replication"))
    # the replication world's tasks have neither new meta key (its streams are unchanged)
    assert all(set(t.meta) == {"hops"} for t in rep.sample_tasks(2, 20, split="eval"))
    # the info-gap world without links or budgets draws exactly the replication sets
    plain = World.generate(replace(world_preset("info-gap"), linked_frac=0.0, turn_budget="default"))
    for k in (2, 8):
        a, b = rep.sample_tasks(k, 30, split="train", seed=4), plain.sample_tasks(k, 30, split="train", seed=4)
        assert [t.questions for t in a] == [t.questions for t in b]
    with pytest.raises(ValueError, match="linked_frac"):
        InfoGapWorldConfig(linked_frac=1.5)
    with pytest.raises(ValueError, match="turn_budget must be one of default, efficient"):
        InfoGapWorldConfig(turn_budget="tight")


def test_the_product_world_holds_no_info_gap_field_and_stored_configs_still_load(tmp_path):
    """The info-gap fields live in the experiment's config class; a config stored when
    `WorldConfig` held them loads as before: the info-gap preset's as its class (and world),
    a plain preset's, which recorded them at their plain values, as `WorldConfig`, and its
    SFT checkpoint is reused by a plain job."""
    import json

    from memopd.env.qa import sft

    assert not {"linked_frac", "turn_budget"} & set(WorldConfig.__dataclass_fields__)
    ig = world_preset("info-gap")
    assert type(ig) is InfoGapWorldConfig and (ig.linked_frac, ig.turn_budget) == (0.5, "efficient")
    loaded = WorldConfig.from_json(ig.to_json())
    assert loaded == ig and isinstance(World.generate(loaded), InfoGapWorld)
    assert type(World.generate(loaded).with_redrawn_values("a")) is InfoGapWorld
    # as a plain replication config was recorded while WorldConfig held the fields
    old_plain = {**world_preset("replication").to_json(), "linked_frac": 0.0, "turn_budget": "default"}
    assert list(old_plain)[-2:] == list(ig.to_json())[-2:]  # the fields' place in the JSON is unchanged
    assert WorldConfig.from_json(old_plain) == world_preset("replication")
    assert type(World.generate(world_preset("replication"))) is World
    # a plain preset with a field set to a value that is not plain is refused, not dropped
    with pytest.raises(ValueError, match=r"unknown fields \['linked_frac'\]"):
        WorldConfig.from_json({**old_plain, "linked_frac": 0.5})
    meta = {"version": sft.CHECKPOINT_VERSION, "world": old_plain, "env": {}, "sft_config": SFTConfig().to_json(),
            "model_spec": {"hidden_size": 64}}
    (tmp_path / sft.ENV_META_FILE).write_text(json.dumps(meta))
    job = {"world": world_preset("replication").to_json(), "env": {}, "sft": SFTConfig().to_json(),
           "spec": {"hidden_size": 64}}
    assert sft._cache_mismatch(str(tmp_path), job) == []
    assert sft._cache_mismatch(str(tmp_path), {**job, "world": ig.to_json()}) == [
        "world.linked_frac None -> 0.5", "world.preset 'replication' -> 'info-gap'", "world.turn_budget None -> 'efficient'"]


def test_linked_sets_share_an_entity_whose_fact_the_first_search_shows(infogap):
    world, _ = infogap
    tasks = world.sample_tasks(2, 200, split="eval", seed=1)
    linked = [t for t in tasks if t.meta["linked"]]
    assert 0.4 <= len(linked) / len(tasks) <= 0.6  # half, as the preset asks
    for t in linked:
        two, one = parse_question(t.questions[1]), parse_question(t.questions[0])  # descending: b is worked first
        assert two[1] is not None and one[1] is None and two[2] == one[2]
        shown = world.shown_facts(f"qb {two[2]} kb {two[1]}")
        assert (one[2], one[0]) in shown and shown[(one[2], one[0])] == t.answers[0][0]
        # budget: the efficient expert reads the fact back (2 searches + answer) + 1
        assert efficient_calls(world, t.questions) == 3 and t.meta["max_turns"] == 4
    for t in tasks:
        assert t.meta["max_turns"] >= sum(t.meta["hops"]) + 1  # the plain expert always fits


@pytest.mark.parametrize("expert", ["scripted", "rational"])
@pytest.mark.parametrize("policy", ["summary", "full"])
def test_experts_solve_every_set_within_its_budget(infogap, expert, policy):
    world, tok = infogap
    for k in (2, 8):
        _, trajs = _episodes(world, tok, expert, policy, k=k, n=40, split="train")
        assert all(t.rewards["em_mean"] == 1.0 and t.info["finish"] == "answer" for t in trajs), (expert, policy, k)
        assert all(t.info["turns"] <= t_.meta["max_turns"] for t, t_ in
                   zip(trajs, world.sample_tasks(k, 40, split="train", seed=0)))


def test_budget_is_enforced_per_set_unless_the_environment_fixes_one(infogap):
    world, tok = infogap
    task = next(t for t in world.sample_tasks(2, 20, split="eval") if t.meta["linked"])
    assert QAEnv.from_world(world, tok).reset(task).max_turns == task.meta["max_turns"] == 4
    assert QAEnv.from_world(world, tok, EnvConfig(max_turns=9)).reset(task).max_turns == 9
    # a wasted call on a linked set leaves the plain expert one call short of answering
    env = QAEnv.from_world(world, tok)
    ep = env.reset(task)
    ep.step(env.encode(" " + world.entities[0]))  # malformed: a format error uses up a turn
    expert = make_expert("scripted", tok, world.config)
    while not ep.done:
        ep.step(expert.act(ep.prompt_ids()))
    assert ep.finish == "budget" and ep.predictions is None


def test_information_gap_share_of_the_plain_experts_calls(infogap):
    world, tok = infogap
    rational = make_expert("rational", tok, world.config)
    _, trajs = _episodes(world, tok, "scripted", "summary", n=100)
    share = gap_share(information_gap_calls(trajs, rational))
    assert GAP_SHARE_RANGE[0] <= share <= GAP_SHARE_RANGE[1], share
    # the gaps sit in linked sets; the replication world's Q2 calls have none
    rep = World.generate(world_preset("replication"))
    rtok = build_tokenizer(rep.vocabulary_texts(), kind="word")
    _, rtrajs = _episodes(rep, rtok, "scripted", "summary", n=100)
    assert gap_share(information_gap_calls(rtrajs, make_expert("rational", rtok, rep.config))) <= 0.02
    # the rational expert's own compact episodes note what they see: no gap left
    _, own = _episodes(world, tok, "rational", "summary", n=100)
    assert gap_share(information_gap_calls(own, rational)) <= 0.01


def test_labels_differ_between_views_at_information_gap_calls(infogap):
    world, tok = infogap
    rational = make_expert("rational", tok, world.config)
    env, trajs = _episodes(world, tok, "scripted", "summary", n=60)
    tasks = world.sample_tasks(2, 60, split="eval", seed=0)
    seen = 0
    for tr, task in zip(trajs, tasks):
        for t, gap in enumerate(information_gap_calls([tr], rational)[0]):
            if not gap:
                continue
            seen += 1
            inv = tr.invocations[t]
            compact = rational.action_text(list(inv.prefix_ids) + list(inv.context_ids))
            flat = rational.action_text(flattened_prompt(tr, t))
            attr, _, x = parse_question(task.questions[0])
            # compact: the fact is gone, so it searches for it; flattened: it reads it back
            assert compact.endswith(f"<search> qa {x} ka {attr}</search>"), compact
            assert f"xa {task.answers[0][0]}" in flat and "<search> qa" not in flat, flat
            assert task.meta["linked"]
    assert seen >= 15


def test_rule_on_text_corrects_from_visible_facts_and_re_searches_otherwise():
    values = VALUE_SETS["multiword"]
    qs = ["kalo ka city ?", "kalo kb friend rb job ?"]
    obs = "kalo : city of kalo is tel aviv . | kalo : friend of kalo is mipu ."
    # a corrupted entry: kept when nothing visible contradicts it, corrected when a fact does
    assert rational_action_text(qs, " xb baker xa paris", [], values=values, descending=True).startswith(
        "<mem> xb baker xa paris</mem><answer>")
    assert rational_action_text(qs, " xb baker xa paris", [obs], values=values, descending=True).startswith(
        "<mem> xb baker xa tel aviv</mem><answer>")
    # a dropped entry: re-searched, or read back; a middle entity: its second hop
    assert rational_action_text(qs, " xb baker", [], values=values, descending=True) == \
        "<mem> xb baker xa</mem><search> qa kalo ka city</search>"
    assert rational_action_text(qs, " xb", [obs], values=values, descending=True) == \
        "<mem> xb mipu xa tel aviv</mem><search> rb job mipu</search>"
    # not a value of the attribute: treated as missing
    assert rational_action_text(qs, " xb baker xa dark red", [], values=values, descending=True).endswith(
        "<search> qa kalo ka city</search>")


def test_perturbed_states_are_recovered_from_the_history_only(infogap):
    """Corrupt an entry of the notes of every later call: the rule under the full history
    restores the true value (every noted fact came from an observation it still sees);
    under compact memory it keeps some corrupted values (what it can no longer check)."""
    world, tok = infogap
    rational = make_expert("rational", tok, world.config)
    tasks = world.sample_tasks(2, 40, split="train", seed=2)
    kept_wrong = {"summary": 0, "full": 0}
    states = {"summary": 0, "full": 0}
    for policy in ("summary", "full"):
        env, trajs = _episodes(world, tok, "rational", policy, n=40, split="train", seed=2)
        rng = random.Random(0)
        for tr, task in zip(trajs, tasks):
            truth = {i + 1: a[0] for i, a in enumerate(task.answers)}
            for inv in tr.invocations[1:]:
                new = perturbed_state(inv.context_ids, tok, world, rng)
                if new is None:
                    continue
                states[policy] += 1
                text = rational.action_text(list(inv.prefix_ids) + new)
                for i, vals in parse_entries(re.search(r"<mem>(.*?)</mem>", text).group(1)):
                    v = " ".join(vals)
                    if v in VALUE_SETS["multiword"][parse_question(task.questions[i - 1])[0]] and v != truth[i]:
                        kept_wrong[policy] += 1
    assert states["summary"] > 20 and states["full"] > 20
    assert kept_wrong["full"] == 0
    assert kept_wrong["summary"] > 0


def test_sft_data_of_the_teacher_recipe(infogap):
    world, tok = infogap
    specs, cfgs = role_presets(world.config)
    assert specs == INFOGAP_MODEL_PRESETS and cfgs == INFOGAP_SFT_PRESETS
    assert cfgs["teacher"].expert == "rational" and cfgs["teacher"].perturb_frac == pytest.approx(0.2)
    assert set(cfgs["teacher"].policies) == {"summary", "full", FLATTEN_VIEW} and cfgs["teacher"].balance_policies
    # the student's is the plain recipe: the scripted expert, none of the info-gap options
    assert type(cfgs["student"]) is SFTConfig and cfgs["student"].steps == 1000
    assert cfgs["teacher"].redraw_values and cfgs["teacher"].state_players == ("scripted",)
    assert cfgs["teacher"].gap_copies == 3 and InfoGapSFTConfig().gap_copies == 0
    assert InfoGapSFTConfig().expert == "scripted" and InfoGapSFTConfig().perturb_frac == 0.0
    assert not InfoGapSFTConfig().redraw_values
    env = QAEnv.from_world(world, tok, EnvConfig())
    plain, _ = expert_examples(world, env, (2,), 120, policies=("summary", "full"), expert="rational")
    ex, stats = expert_examples(world, env, (2,), 120, policies=("summary", "full"), expert="rational",
                                perturb_frac=0.5)
    assert stats["expert"] == "rational" and 40 <= stats["perturbed"] <= 140
    # the perturbed examples replace some sampled calls, the others are as without perturbing
    same = sum(a == b for a, b in zip(plain, ex))
    assert same + stats["perturbed"] == len(ex)
    with pytest.raises(ValueError, match="perturb_frac"):
        expert_examples(world, env, (2,), 8, perturb_frac=1.0)
    with pytest.raises(ValueError, match="unknown expert"):
        make_expert("oracle", tok, world.config)
    # "rational" is the experiment's rule, found by its module's name (the product imports no experiment)
    assert type(make_expert("rational", tok, world.config)) is RationalExpert
    assert expert_options(world.config) == {"descending": True}


def test_action_token_roles(infogap):
    world, tok = infogap
    env = QAEnv.from_world(world, tok)
    x = world.entities[0]
    ids = env.encode(f"<mem> xb blue</mem><search> qa {x} ka city</search>")
    roles = action_token_roles(ids, env.tokens)
    assert roles == ["memory"] * 4 + ["search"] * 6
    ans = env.encode("<mem> xa blue</mem><answer> xa blue</answer>")
    assert action_token_roles(ans, env.tokens) == ["memory"] * 4 + ["answer"] * 4
    assert set(action_token_roles(env.encode(f" {x} city"), env.tokens)) == {"other"}


def test_flatten_view_examples_are_the_persistent_history_labelled_by_the_rule(infogap):
    world, tok = infogap
    env = QAEnv.from_world(world, tok, EnvConfig())
    rational = make_expert("rational", tok, world.config)
    ex, stats = expert_examples(world, env, (2,), 60, policies=(FLATTEN_VIEW,), expert="rational", seed=1)
    assert stats["calls_by_policy"] == {FLATTEN_VIEW: 60}
    # the states are exactly the flattened histories of compact-memory episodes of the stream
    _, trajs = _episodes(world, tok, "rational", "summary", n=60, split="train", seed=1000)
    flat = {tuple(flattened_prompt(tr, t)) for tr in trajs for t in range(len(tr.invocations))}
    hits = 0
    for ids, n in ex:
        assert ids[n:] == rational.act(ids[:n])  # labelled by the rule on that very state
        hits += tuple(ids[:n]) in flat
    assert hits > 0
    # the longest Q16 example fits the teacher's positions
    _, long = expert_examples(world, env, (16,), 20, policies=(FLATTEN_VIEW,), expert="rational")
    assert 2048 < long["longest"] <= INFOGAP_MODEL_PRESETS["teacher"].max_position_embeddings


class _StubRule:
    """A rule given as a table prompt -> action ids (what `view_disagreement_ceiling` asks)."""

    def __init__(self, table):
        self.table = {tuple(k): list(v) for k, v in table.items()}

    def act(self, prompt):
        return self.table[tuple(prompt)]


def test_ceiling_counts_the_parting_token_and_the_tokens_after_it():
    from memopd.records import Invocation, Trajectory

    calls = [Invocation([1], [2], [10, 11, 12, 13]),  # first call: both views see the same prompt
             Invocation([1], [3], [10, 11, 20, 21, 22]),  # follows the compact action; the views part at 2
             Invocation([1], [4], [40, 41, 42])]  # has left both views' actions before they part
    tr = Trajectory(calls)
    rule = _StubRule({
        (1, 2): [10, 11, 12, 13],
        (1, 3): [10, 11, 20, 21, 22], tuple(flattened_prompt(tr, 1)): [10, 11, 30, 31],
        (1, 4): [10, 11, 12], tuple(flattened_prompt(tr, 2)): [10, 11, 50],
    })
    got = view_disagreement_ceiling([tr], rule)
    assert got["action_tokens"] == 12 and got["gap_call_tokens"] == 8
    assert got["all"] == {"lower": pytest.approx(1 / 12), "upper": pytest.approx(4 / 12), "gap_tokens": pytest.approx(8 / 12),
                          "one_per_call": pytest.approx(2 / 12)}
    # two information-gap calls: one parting token each, whether or not the recorded action got there
    assert got["gap_calls"] == {"lower": pytest.approx(1 / 8), "upper": pytest.approx(4 / 8),
                                "one_per_call": pytest.approx(2 / 8)}
    # the end of an action is a token: the compact action stops where the flattened one and the recorded one go on
    ends = Trajectory([Invocation([1], [2], [7]), Invocation([1], [3], [10, 11, 12])])
    rule = _StubRule({(1, 2): [7], (1, 3): [10, 11], tuple(flattened_prompt(ends, 1)): [10, 11, 12]})
    got = view_disagreement_ceiling([ends], rule)
    assert got["all"]["lower"] == pytest.approx(1 / 4) and got["all"]["upper"] == pytest.approx(1 / 4)
    # the views part past the end of the recorded action: no recorded token can tell them apart
    short = Trajectory([Invocation([1], [2], [7]), Invocation([1], [3], [10, 11])])
    rule = _StubRule({(1, 2): [7], (1, 3): [10, 11, 12], tuple(flattened_prompt(short, 1)): [10, 11, 13]})
    got = view_disagreement_ceiling([short], rule)
    assert got["all"]["lower"] == 0.0 and got["all"]["upper"] == 0.0 and got["gap_call_tokens"] == 2
    assert got["gap_calls"]["one_per_call"] == pytest.approx(1 / 2)
    assert view_disagreement_ceiling([], rule)["gap_calls"] == {"lower": None, "upper": None, "one_per_call": None}


def test_ceiling_of_the_plain_experts_episodes_is_below_the_gate_overall_and_above_it_at_gap_calls(infogap):
    """The figures the manipulation check's gate statement rests on (trainer/experiments/manipulation.py):
    over all action tokens of the plain expert's held-out Q2 episodes even the upper bound
    stays below the gate's 10%, at the information-gap calls it is far above it."""
    from memopd.trainer.experiments.manipulation import GATE_MIN_TOP1

    world, tok = infogap
    rational = make_expert("rational", tok, world.config)
    _, trajs = _episodes(world, tok, "scripted", "summary", n=100)
    got = view_disagreement_ceiling(trajs, rational)
    flags = information_gap_calls(trajs, rational)
    gap_tokens = sum(len(inv.action_ids) for tr, f in zip(trajs, flags) for inv, g in zip(tr.invocations, f) if g)
    assert got["gap_call_tokens"] == gap_tokens > 0  # the same calls as information_gap_calls
    a, g = got["all"], got["gap_calls"]
    assert 0 < a["lower"] < a["upper"] < a["gap_tokens"] and a["upper"] < GATE_MIN_TOP1
    assert 0 < g["lower"] < GATE_MIN_TOP1 < g["upper"] < 1
    # one token per call: the views of the rule part once per information-gap call
    n_calls = sum(sum(f) for f in flags)
    assert g["one_per_call"] == pytest.approx(n_calls / gap_tokens) and g["lower"] <= g["one_per_call"] < g["upper"]


def test_a_redrawn_world_keeps_its_questions_and_changes_its_values(infogap):
    world, _ = infogap
    copy = world.with_redrawn_values("a")
    attrs = set(world.config.attributes)
    assert copy.entities == world.entities and copy.heldout == world.heldout
    assert all(copy.facts[f] == v for f, v in world.facts.items() if f[1] not in attrs)  # relations kept
    changed = [f for f, v in world.facts.items() if f[1] in attrs and copy.facts[f] != v]
    assert len(changed) > 0.5 * len(world.entities) * len(attrs)
    assert all(copy.facts[f] in copy.values[f[1]] for f in changed)
    # the corpus states the new values, in the tokenizer's vocabulary
    docs = {d.id: d for d in copy.documents}
    x, a = changed[0]
    assert copy.facts[(x, a)] in docs[copy.support_doc[(x, a)]].text
    vocab = {w for t in world.vocabulary_texts() for w in t.split()}
    assert {w for t in copy.vocabulary_texts() for w in t.split()} <= vocab
    # the same questions in every split (the held-out facts are still only eval answers),
    # answered by the copy's facts; the linked pairs follow the copy's searches
    for split in ("train", "eval"):
        assert copy.questions(split) == world.questions(split)
        theirs = copy.sample_tasks(2, 40, split=split, seed=3)
        for t in theirs:
            for q, ans in zip(t.questions, t.answers):
                attr, rel, x = parse_question(q)
                assert ans == [copy.answer(attr, x, rel)]
        assert [t.answers for t in world.sample_tasks(2, 40, split=split, seed=3)] != [t.answers for t in theirs]
    assert world.with_redrawn_values("a").facts == copy.facts
    assert world.with_redrawn_values("b").facts != copy.facts


def test_sft_data_from_redrawn_worlds_is_the_rule_played_in_each_copy(infogap):
    world, tok = infogap
    env = QAEnv.from_world(world, tok, EnvConfig())
    # the expert must be perfect in every copy, or expert_examples raises
    one, plain = expert_examples(world, env, (2,), 150, policies=("summary", FLATTEN_VIEW), expert="rational")
    many, stats = expert_examples(world, env, (2,), 150, policies=("summary", FLATTEN_VIEW), expert="rational",
                                  redraw_values=True)
    assert plain["worlds"] == 0 and stats["worlds"] >= 2 * 2  # more than one copy per view at 150 calls
    assert stats["calls_by_policy"] == plain["calls_by_policy"]
    assert sum(a != b for a, b in zip(one, many)) > len(many) // 2
    # every action quotes only values the copy's corpus may show: the words stay in the vocabulary
    assert all(i < len(tok) for ids, _ in many for i in ids)


def test_states_of_another_player_are_labelled_by_the_rule(infogap):
    world, tok = infogap
    env = QAEnv.from_world(world, tok, EnvConfig())
    rule, plain = make_expert("rational", tok, world.config), make_expert("scripted", tok, world.config)
    alone, _ = expert_examples(world, env, (2,), 60, policies=("summary", FLATTEN_VIEW), expert="rational")
    both, stats = expert_examples(world, env, (2,), 60, policies=("summary", FLATTEN_VIEW), expert="rational",
                                  state_players=("scripted",))
    assert stats["calls_by_policy"] == {"summary": 60, FLATTEN_VIEW: 60, "summary@scripted": 60,
                                        f"{FLATTEN_VIEW}@scripted": 60}
    assert both[:120] == alone  # the rule's own episodes are drawn as without the other player
    others = both[120:]
    assert all(ids[n:] == rule.act(ids[:n]) for ids, n in others)
    # on the plain expert's states the rule acts otherwise at some calls (the states differ too)
    assert any(plain.act(ids[:n]) != ids[n:] for ids, n in others[:60])
    # the same question sets, so first calls coincide; the later states are the other player's
    seen = {tuple(ids[:n]) for ids, n in alone}
    assert sum(tuple(ids[:n]) in seen for ids, n in others) < len(others) // 2


def test_gap_continuation_reads_on_after_the_compact_memory_span(infogap):
    """At an information-gap call the continuation's prompt is the flattened state and the
    compact call's memory span; its label is the rule's own search or answer on the
    flattened state, tokenised as the rule's whole action is."""
    world, tok = infogap
    rational = make_expert("rational", tok, world.config)
    _, trajs = _episodes(world, tok, "scripted", "summary", n=60)
    seen = 0
    for tr in trajs:
        for t, gap in enumerate(information_gap_calls([tr], rational)[0]):
            inv = tr.invocations[t]
            compact, flat = list(inv.prefix_ids) + list(inv.context_ids), flattened_prompt(tr, t)
            cont = gap_continuation(rational, compact, flat)
            if not gap:
                assert cont is None
                continue
            if cont is None:  # the views part after the memory span: the plain example parts them
                c, f = rational.action_text(compact), rational.action_text(flat)
                assert c.split("</mem>")[0] == f.split("</mem>")[0] and c != f
                continue
            seen += 1
            ids, n = cont
            c_text = rational.action_text(compact)
            mem_c = c_text[:c_text.index("</mem>") + 6]
            assert ids[:len(flat)] == flat and tok.decode(ids[len(flat):n]).replace(" ", "") == mem_c.replace(" ", "")
            f_ids = rational.act(flat)
            label = ids[n:]
            assert f_ids[len(f_ids) - len(label):] == label  # the flattened action's own tokens after </mem>
            assert tok.decode(label).replace(" ", "").startswith(("<answer>", "<search>"))
            assert label != rational.act(compact)[-len(label):]  # the compact rule would go on otherwise
    assert seen >= 10


def test_gap_copies_add_to_the_sampled_calls_and_leave_the_rest_as_they_were(infogap):
    world, tok = infogap
    env = QAEnv.from_world(world, tok, EnvConfig())
    kw = dict(policies=("summary", FLATTEN_VIEW), expert="rational", state_players=("scripted",), perturb_frac=0.2,
              seed=3)
    plain, pst = expert_examples(world, env, (2,), 150, **kw)
    ex, st = expert_examples(world, env, (2,), 150, gap_copies=2, **kw)
    assert pst["gap_calls"] == pst["gap_examples"] == 0
    assert st["gap_calls"] >= 5 and 2 * st["gap_calls"] < st["gap_examples"] <= 4 * st["gap_calls"]
    assert len(ex) == len(plain) + st["gap_examples"] and st["perturbed"] == pst["perturbed"]
    # the plain data is all there; each addition is a copy of a sampled call or a continuation
    from collections import Counter

    have, want = Counter((tuple(i), n) for i, n in ex), Counter((tuple(i), n) for i, n in plain)
    assert not want - have
    added = have - want
    assert sum(added.values()) == st["gap_examples"]
    close = env.tokens.mem_close
    conts = [(ids, n) for ids, n in added if ids[n - 1] == close]
    assert conts and all((ids, n) in want or ids[n - 1] == close for ids, n in added)
    # only summary (own episodes) and flatten views were asked; copies only in the flatten groups
    assert set(st["calls_by_policy"]) == {"summary", FLATTEN_VIEW, "summary@scripted", f"{FLATTEN_VIEW}@scripted"}
    assert st["calls_by_policy"]["summary"] == pst["calls_by_policy"]["summary"] == 150
    assert st["calls_by_policy"]["summary@scripted"] == 150
    assert sum(st["calls_by_policy"][v] for v in (FLATTEN_VIEW, f"{FLATTEN_VIEW}@scripted")) == 300 + st["gap_examples"]
    with pytest.raises(ValueError, match="gap_copies needs the rational expert"):
        expert_examples(world, env, (2,), 8, gap_copies=1)
    with pytest.raises(ValueError, match="gap_copies must be"):
        expert_examples(world, env, (2,), 8, expert="rational", gap_copies=-1)


def test_the_info_gap_recipe_with_its_defaults_is_the_plain_one_and_reuses_its_caches(infogap):
    """`InfoGapSFTConfig` at its defaults builds the plain recipe's examples; its JSON
    keeps the plain fields first, and a checkpoint recorded with the options at their
    plain values (as every checkpoint was while `SFTConfig` held them) is reused by a
    plain recipe, while one of the info-gap teacher's is not."""
    from memopd.env.qa import sft

    world, tok = infogap
    env = QAEnv.from_world(world, tok, EnvConfig())
    plain = SFTConfig(ks=(1, 2), calls_per_k=40, seed=2, policies=("summary", FLATTEN_VIEW))
    wide = InfoGapSFTConfig(**vars(plain))
    assert plain.build_examples(world, env)[0] == wide.build_examples(world, env)[0]
    assert list(wide.to_json())[:len(plain.to_json())] == list(plain.to_json())
    assert sft.recipe_class(wide.recipe_name()) is InfoGapSFTConfig
    assert InfoGapSFTConfig.from_json(INFOGAP_SFT_PRESETS["teacher"].to_json()) == INFOGAP_SFT_PRESETS["teacher"]
    with pytest.raises(ValueError, match="not an SFTConfig class"):
        sft.recipe_class("memopd.env.qa.sft:World")
    import json
    import tempfile

    for recorded, reused in ((wide.to_json(), True), (INFOGAP_SFT_PRESETS["teacher"].to_json(), False)):
        with tempfile.TemporaryDirectory() as d:
            meta = {"version": sft.CHECKPOINT_VERSION, "world": world.config.to_json(), "env": {},
                    "sft_config": recorded, "model_spec": {"hidden_size": 64}}
            with open(f"{d}/{sft.ENV_META_FILE}", "w") as f:
                json.dump(meta, f)
            job = {"world": world.config.to_json(), "env": {}, "sft": plain.to_json(), "spec": {"hidden_size": 64}}
            diff = sft._cache_mismatch(d, job)
            assert (diff == []) is reused, diff


# sha256 of the JSON of the examples each preset's teacher recipe built, at small settings
# (ks, 60 calls per k, seed 3, the environment's default config), recorded from the recipe
# as it was before the info-gap options moved out of `SFTConfig`: moving code must not
# change one byte of the data
RECORDED_DATA = {
    "default": ((1, 2, 4), "ca60d669a13e0180ed0522078c70581809b4f2c260f7c681634ec59237693911"),
    "replication": ((1, 2, 4), "3fc5272dc5f3862002b73153941bee3c85b3ef337d73e7264201af00875f7648"),
    "info-gap": ((2, 4), "46d259fed3eb08b47f1ff74fa0b6a0c60deb5379e37cfcecae7afe15c5081843"),
}


@pytest.mark.parametrize("preset", sorted(RECORDED_DATA))
def test_each_presets_teacher_data_is_the_recorded_one(preset):
    import hashlib
    import json

    ks, digest = RECORDED_DATA[preset]
    wc = world_preset(preset)
    world = World.generate(wc)
    env = QAEnv.from_world(world, build_tokenizer(world.vocabulary_texts(), kind="word"), EnvConfig())
    cfg = replace(role_presets(wc)[1]["teacher"], ks=ks, calls_per_k=60, seed=3)
    examples, _ = cfg.build_examples(world, env)
    assert hashlib.sha256(json.dumps(examples).encode()).hexdigest() == digest


# sha256 of the info-gap world's task streams (ids, questions, answers, support and meta:
# linked pairs and turn budgets) at two shares of linked sets, recorded from the world as
# it was before its fields moved out of `WorldConfig`: moving code must not change a set
RECORDED_STREAMS = {0.5: "b3c3cfae4cc37828eb55b6f1b2f51cef429a702d0442ec9f2ef39fdd2de80537",
                    1.0: "f381c2943de0e80c295bda900bc4ac33059609c53767bfb02031f5544b41cc6c"}


@pytest.mark.parametrize("linked_frac", sorted(RECORDED_STREAMS))
def test_the_info_gap_task_streams_are_the_recorded_ones(linked_frac):
    import hashlib
    import json

    world = World.generate(replace(world_preset("info-gap"), linked_frac=linked_frac))
    sets = [[t.task_id, t.questions, t.answers, t.support, t.meta] for split in ("train", "eval") for k in (2, 4)
            for t in world.sample_tasks(k, 25, split=split, seed=1)]
    assert sum(t[4]["linked"] for t in sets) >= 25 * linked_frac  # the streams hold linked sets
    assert hashlib.sha256(json.dumps(sets).encode()).hexdigest() == RECORDED_STREAMS[linked_frac]
