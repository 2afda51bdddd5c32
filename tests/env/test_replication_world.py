"""The "replication" world preset (docs/design.md §10): the default world unchanged, held-out
evaluation checked on the generated data itself, multi-word answers with partial credit,
an expert that solves both memory views within the teacher's positions, and the SFT
recipe and cache key the preset picks."""
import hashlib
import json
import re

import pytest

from memopd.cli import main as cli_main
from memopd.env import EnvConfig, QAEnv, World, WorldConfig, build_tokenizer, expert_trajectories
from memopd.env.qa.expert import expert_options
from memopd.env.qa.metrics import score_answers
from memopd.env.qa.protocol import letters_index, split_answers
from memopd.env.qa.sft import (
    ENV_META_FILE,
    MODEL_PRESETS,
    REPLICATION_MODEL_PRESETS,
    SFT_PRESETS,
    SFTConfig,
    _cache_mismatch,
    expert_examples,
    role_presets,
)
from memopd.env.qa.world import MULTIWORD_VALUES, WORLD_PRESETS, fact_text, max_answer_words, parse_question, world_preset
from memopd.env.rollout import default_max_new_tokens

# sha256 of the default world's corpus, facts, task streams and vocabulary texts (seeds 0
# and 1), taken before the presets existed: the default world must stay bit for bit.
DEFAULT_WORLD_SHA256 = {
    0: "9013629a270197d17a2585b764cee9d33e1cb326064062ec3ad347b0d550ddad",
    1: "ce1d9a29ba0156b56315a15df4b2f6ca309439dcbd2ad0a753ae7a53b0de43bb",
}


def _world_digest(world: World) -> str:
    h = hashlib.sha256()
    for d in world.documents:
        h.update(json.dumps([d.id, d.text, d.title]).encode())
    h.update(json.dumps(sorted((list(k), v) for k, v in world.facts.items())).encode())
    for split in ("train", "eval"):
        for k in (1, 2, 8, 16):
            for t in world.sample_tasks(k, 20, split=split, seed=3):
                h.update(json.dumps(t.to_json(), sort_keys=True).encode())
    h.update(json.dumps(world.vocabulary_texts()).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def replication():
    world = World.generate(world_preset("replication"))
    return world, build_tokenizer(world.vocabulary_texts(), kind="word")


@pytest.mark.parametrize("seed", sorted(DEFAULT_WORLD_SHA256))
def test_default_world_is_unchanged(seed):
    assert world_preset("default", seed=seed) == WorldConfig(seed=seed)
    assert _world_digest(World.generate(WorldConfig(seed=seed))) == DEFAULT_WORLD_SHA256[seed]
    assert not World.generate(WorldConfig(seed=seed)).heldout


def test_presets_and_their_errors():
    assert set(WORLD_PRESETS) == {"default", "replication", "info-gap"}
    cfg = world_preset("replication", seed=3)
    assert cfg.preset == "replication" and cfg.seed == 3 and cfg.heldout_frac > 0
    assert WorldConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="default, replication"):
        world_preset("nope")
    with pytest.raises(ValueError, match="value_set"):
        WorldConfig(value_set="nope")
    with pytest.raises(ValueError, match="heldout_frac"):
        WorldConfig(heldout_frac=1.0)
    with pytest.raises(ValueError, match="holds out no fact"):
        WorldConfig(n_entities=2, heldout_frac=0.05)
    with pytest.raises(ValueError, match="answer_order must be one of ascending, descending"):
        WorldConfig(answer_order="random")


def test_descending_expert_ends_at_question_a_and_default_limits_are_unchanged(replication):
    world, tok = replication
    assert world.config.answer_order == "descending" and expert_options(world.config) == {"descending": True}
    assert expert_options(WorldConfig()) == {"descending": False}
    env = QAEnv.from_world(world, tok, EnvConfig(policy="summary"))
    assert env.answer_words == max_answer_words(world.config) == 4
    for t in expert_trajectories(env, world.sample_tasks(8, 10, split="eval"), descending=True):
        acts = [env.decode(i.action_ids).split() for i in t.invocations]
        assert acts[0][0] == "xh"  # the first entry opened is the last question's
        labels = [w for w in acts[-1] if re.fullmatch(r"x[a-h]", w)]
        # the answering call: its notes run h..a, then the answer in the same order
        assert labels == [f"x{c}" for c in "hgfedcba"] * 2
        assert all(len(a) < default_max_new_tokens(8, 4) for a in acts)
        assert t.rewards["em_mean"] == 1.0
    # the default world keeps one-word answers and its limit of 24 + 5k ids per call
    default = World.generate(WorldConfig())
    assert QAEnv.from_world(default, build_tokenizer(default.vocabulary_texts(), kind="word")).answer_words == 1
    assert [default_max_new_tokens(k) for k in (1, 2, 16)] == [29, 34, 104]
    with pytest.raises(ValueError, match="answer_words"):
        QAEnv(default.documents, tok, answer_words=0)


def _questions_of_prefix(text: str) -> list[tuple]:
    """(attr, rel, entity) of every question in a decoded task prefix."""
    found = re.findall(r"(?:^|\s)q([a-z]{1,2}) (.+?\?)", text)
    qs = [parse_question(q) for _, q in sorted(found, key=lambda f: letters_index(f[0]))]
    assert qs and all(q is not None for q in qs)
    return qs


def test_eval_questions_are_held_out_of_sft_and_rl_data(replication):
    """Disjointness on the generated data: the questions SFT trains on (decoded from the
    examples' ids), the RL task stream and the evaluation sets."""
    world, tok = replication
    env = QAEnv.from_world(world, tok, EnvConfig())
    examples, _ = expert_examples(world, env, (2, 8, 16), 300, seed=0, policies=("summary", "full"))
    bos = 1 if tok.bos_token_id is not None else 0
    sft_qs = set()
    for ids, n_ctx in examples:
        text = tok.decode(ids[bos:n_ctx], skip_special_tokens=False).split("<")[0]
        sft_qs.update(_questions_of_prefix(text))
    rl_qs = {parse_question(q) for k in (2, 8) for s in range(8) for t in world.sample_tasks(k, 16, split="train", seed=s)
             for q in t.questions}
    eval_qs = {parse_question(q) for k in (2, 8, 16) for t in world.sample_tasks(k, 100, split="eval", seed=0)
               for q in t.questions}
    assert len(sft_qs) > 300 and len(rl_qs) > 200 and len(eval_qs) > 300
    assert not eval_qs & (sft_qs | rl_qs)
    # stronger: no training question has an evaluation answer's fact as its own answer ...
    eval_facts = {world.answer_fact(q) for q in eval_qs}
    assert not eval_facts & {world.answer_fact(q) for q in sft_qs | rl_qs}
    # ... while every entity an eval question names also occurs in training questions, and
    # the corpus (the environment, not training data) states every held-out fact
    assert {x for _, _, x in eval_qs} <= {x for _, _, x in world.questions("train")}
    texts = {d.text for d in world.documents}
    assert all(fact_text(x, a, world.facts[(x, a)]) in texts for x, a in eval_facts)


def test_answers_have_one_to_four_words_and_partial_credit(replication):
    world, _ = replication
    lengths = {len(v.split()) for vals in MULTIWORD_VALUES.values() for v in vals}
    assert lengths == {1, 2, 3, 4}
    answers = [a[0] for t in world.sample_tasks(16, 20, split="eval") for a in t.answers]
    assert any(len(a.split()) >= 2 for a in answers) and any(len(a.split()) == 1 for a in answers)
    preds = split_answers("xa dark red ; xb deep sea diver ; xc new york", 3)
    assert preds == ["dark red", "deep sea diver", "new york"]
    sc = score_answers(preds, [["dark blue"], ["sea captain"], ["new york"]])
    assert sc["em"] == [0.0, 0.0, 1.0]
    assert sc["f1"][0] == pytest.approx(0.5) and sc["f1"][1] == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert sc["f1_mean"] > sc["em_mean"]


@pytest.mark.parametrize("policy", ["summary", "full"])
def test_expert_solves_both_views_within_the_teachers_positions(replication, policy):
    world, tok = replication
    env = QAEnv.from_world(world, tok, EnvConfig(policy=policy))
    longest = 0
    for k in (2, 8, 16):
        for split in ("train", "eval"):
            trajs = expert_trajectories(env, world.sample_tasks(k, 40, split=split), **expert_options(world.config))
            assert all(t.rewards["em_mean"] == 1.0 for t in trajs), (policy, k, split)
            longest = max(longest, max(t.info["peak_tokens"] for t in trajs))
    specs, _ = role_presets(world.config)
    if policy == "full":
        # the longest flattened Q16 history, measured, fits the teacher's positions
        assert 1000 < longest <= specs["teacher"].max_position_embeddings
    else:
        assert longest <= specs["student"].max_position_embeddings


def test_replication_recipe_and_cache_key(tmp_path):
    specs, cfgs = role_presets(world_preset("replication"))
    assert specs == REPLICATION_MODEL_PRESETS and set(cfgs["teacher"].policies) == {"summary", "full"}
    assert cfgs["teacher"].balance_policies and not SFT_PRESETS["teacher"].balance_policies
    assert role_presets(WorldConfig()) == (MODEL_PRESETS, SFT_PRESETS)
    assert role_presets(None) == (MODEL_PRESETS, SFT_PRESETS)
    # a checkpoint written before the new fields existed still matches the default job ...
    old_world = {k: v for k, v in WorldConfig().to_json().items()
                 if k not in ("value_set", "heldout_frac", "preset", "answer_order")}
    old_sft = {k: v for k, v in SFTConfig().to_json().items() if k not in ("policies", "balance_policies")}
    meta = {"version": 2, "world": old_world, "env": {}, "sft_config": old_sft, "model_spec": {"hidden_size": 64}}
    (tmp_path / ENV_META_FILE).write_text(json.dumps(meta))
    job = {"world": WorldConfig().to_json(), "env": {}, "sft": SFTConfig().to_json(), "spec": {"hidden_size": 64}}
    assert _cache_mismatch(str(tmp_path), job) == []
    # ... and everything that changes the models is in the key
    for key, field, value in (("world", "world", world_preset("replication").to_json()),
                              ("sft", "sft_config", SFTConfig(policies=("summary", "full")).to_json()),
                              ("sft", "sft_config", SFTConfig(balance_policies=True).to_json())):
        diff = _cache_mismatch(str(tmp_path), {**job, key: value})
        assert diff and all(d.startswith(field + ".") for d in diff)
    # a replication checkpoint of the ascending expert (written before answer_order
    # existed) is not reused for the descending one
    asc = {k: v for k, v in world_preset("replication").to_json().items() if k != "answer_order"}
    (tmp_path / ENV_META_FILE).write_text(json.dumps({**meta, "world": asc}))
    diff = _cache_mismatch(str(tmp_path), {**job, "world": world_preset("replication").to_json()})
    assert diff == ["world.answer_order 'ascending' -> 'descending'"]


def test_teacher_recipe_gives_compact_memory_half_the_steps(replication):
    """The replication teacher's data holds as many summary calls as full-view ones, but
    a full-view Q16 call fills a batch alone while a summary batch holds dozens of calls:
    batches drawn from all of them give summary calls under a third of the loss (the
    teacher then never learned to answer; docs/design.md §10). Balanced by policy: half."""
    import random

    from memopd.env.qa.sft import _batches

    world, tok = replication
    recipe = role_presets(world.config)[1]["teacher"]
    env = QAEnv.from_world(world, tok, EnvConfig())
    examples, stats = expert_examples(world, env, (2, 16), 150, seed=0, policies=recipe.policies)
    assert stats["calls_by_policy"] == {"summary": 300, "full": 300}
    policy = [p for p, n in stats["calls_by_policy"].items() for _ in range(n)]

    def summary_share(groups):
        """Summary calls' share of the loss (a step's loss is the mean over its action tokens)."""
        batches = _batches(examples, recipe.batch_tokens, random.Random(0), groups)
        share = 0.0
        for _ in range(200):
            batch = next(batches)
            action = {i: len(examples[i][0]) - examples[i][1] for i in batch}
            share += sum(n for i, n in action.items() if policy[i] == "summary") / sum(action.values())
        return share / 200

    assert summary_share(None) < 1 / 3
    assert summary_share(policy) == pytest.approx(0.5, abs=1e-12)


def test_cli_world_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own errors, as for every subcommand
        cli_main(["eval", "--world", "nope", "--expert"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    assert cli_main(["eval", "--k", "2"]) == 2
    err = capsys.readouterr().err
    assert "--expert" in err and len(err.strip().splitlines()) == 1
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / ENV_META_FILE).write_text(json.dumps({"world": WorldConfig().to_json()}))
    assert cli_main(["eval", str(ckpt), "--world", "replication"]) == 2
    err = capsys.readouterr().err
    assert "trained in the 'default' world" in err and len(err.strip().splitlines()) == 1


def test_cli_expert_on_the_replication_world(capsys):
    assert cli_main(["eval", "--expert", "--world", "replication", "--ks", "2", "8", "--n", "4", "--policy", "full"]) == 0
    out = capsys.readouterr().out
    assert "policy: full" in out and out.count(" 1.000 ") >= 4  # EM and F1 on both sets
