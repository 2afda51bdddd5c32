"""SFT examples, a tiny `memopd sft` run with its cache, and `memopd eval` output."""
import json
import os

import pytest

from memopd.cli import main as cli_main
from memopd.env import QAEnv, World, WorldConfig, build_tokenizer, expert_trajectories
from memopd.env.cli import eval_main, sft_main
from memopd.env.qa.sft import (
    MODEL_PRESETS,
    ModelSpec,
    SFTConfig,
    checkpoint_exists,
    copy_warmup_examples,
    make_model,
    read_env_meta,
    sft_examples,
    train_sft,
)
from memopd.errors import UserError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_sft_examples_are_the_recorded_states():
    world = World.generate(WorldConfig(seed=0, n_entities=16))
    tok = build_tokenizer(world.vocabulary_texts())
    env = QAEnv.from_world(world, tok)
    trajs = expert_trajectories(env, world.sample_tasks(2, 3))
    ex = sft_examples(trajs)
    calls = [inv for tr in trajs for inv in tr.invocations]
    assert len(ex) == len(calls)
    for (ids, n), inv in zip(ex, calls):
        assert ids[:n] == inv.prefix_ids + inv.context_ids and ids[n:] == inv.action_ids


@pytest.fixture(scope="module")
def world_tokenizer():
    world = World.generate(WorldConfig(seed=0, n_entities=16))
    return build_tokenizer(world.vocabulary_texts(), kind="word")


@pytest.mark.parametrize("role", sorted(MODEL_PRESETS))
def test_make_model_is_the_qwen2_built_by_hand(world_tokenizer, role):
    """The SFT models come from `memopd.models`; they must stay the Qwen2 models that a
    hand-written config and the same seed give, weight for weight (cached checkpoints and
    recorded results depend on it)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok, spec = world_tokenizer, MODEL_PRESETS[role]
    by_hand = Qwen2Config(vocab_size=len(tok), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                          num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                          num_key_value_heads=spec.num_key_value_heads,
                          max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(5)
    want = Qwen2ForCausalLM._from_config(by_hand, attn_implementation="eager")
    got = make_model(spec, tok, seed=5)
    assert got.config.to_dict() == want.config.to_dict()
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, w in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], w), name
    other = make_model(spec, tok, seed=6)
    assert not torch.equal(other.model.embed_tokens.weight, got.model.embed_tokens.weight)


def test_sft_uses_the_trainer_optimizer_and_schedule(world_tokenizer):
    """Warm-up then cosine to min_lr_ratio (float64 reference), decay on matrices only."""
    import math

    import torch

    tok = world_tokenizer
    model = make_model(ModelSpec(16, 1, 2, 1, 32, max_position_embeddings=128), tok, seed=0)
    examples = copy_warmup_examples(len(tok), 64, first_id=20, max_len=8, max_gap=4, bos_id=tok.bos_token_id)
    cfg = SFTConfig(steps=9, warmup=3, lr=1e-2, min_lr_ratio=0.2, weight_decay=0.1, batch_tokens=128, threads=None)
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(opt, *a, **k):
        seen.append([(g["lr"], g["weight_decay"], {p.ndim for p in g["params"]}) for g in opt.param_groups])
        return step(opt, *a, **k)

    torch.optim.AdamW.step = recording_step
    try:
        stats = train_sft(model, examples, cfg, pad_id=tok.pad_token_id, progress=False)
    finally:
        torch.optim.AdamW.step = step
    assert stats["steps"] == 9 and math.isfinite(stats["final_loss"]) and len(seen) == 9
    for s, groups in enumerate(seen):
        if s < cfg.warmup:
            want = cfg.lr * (s + 1) / cfg.warmup
        else:
            cos = 0.5 * (1 + math.cos(math.pi * (s - cfg.warmup) / (cfg.steps - cfg.warmup)))
            want = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)
        assert [g[0] for g in groups] == pytest.approx([want, want], rel=1e-12), s
        assert [(g[1], g[2]) for g in groups] == [(0.1, {2}), (0.0, {1})]  # biases and norm gains never decay
    with pytest.raises(UserError, match="steps >= 1"):
        train_sft(model, examples, SFTConfig(steps=0), pad_id=tok.pad_token_id, progress=False)


def test_policy_groups_take_turns_one_batch_each():
    """With groups, every batch holds one group's examples and the groups alternate step
    by step, each group's examples all seen once per pass over that group; without, short
    examples (many to a batch) get far fewer steps than long ones (one or two a batch)."""
    import random

    from memopd.env.qa.sft import _batches

    short = [([7] * 10, 5)] * 64  # exactly one batch of 640 tokens
    long_ = [([7] * 300, 150)] * 30
    examples = short + long_
    groups = ["summary"] * len(short) + ["full"] * len(long_)
    mixed = _batches(examples, 640, random.Random(0))
    mixed_steps = [{groups[i] for i in next(mixed)} for _ in range(40)]
    assert sum(g == {"summary"} for g in mixed_steps) < 10  # the imbalance the groups remove
    balanced = _batches(examples, 640, random.Random(0), groups)
    seen = {"summary": [], "full": []}
    for step in range(30):  # 15 full batches = exactly one pass over the 30 long examples
        batch = next(balanced)
        labels = {groups[i] for i in batch}
        assert labels == {("summary", "full")[step % 2]}, step
        assert max(len(examples[i][0]) for i in batch) * len(batch) <= 640
        seen[labels.pop()] += batch
    assert sorted(seen["full"]) == list(range(64, 94))
    assert sorted(seen["summary"]) == sorted(list(range(64)) * 15)
    with pytest.raises(ValueError, match="group labels"):
        next(_batches(examples, 640, random.Random(0), groups[:-1]))


def test_balanced_sft_groups_examples_by_their_policy(tmp_path, monkeypatch):
    """`balance_policies` hands `_batches` the memory policy of every example: a full-view
    context keeps the searches, a summary one never does."""
    import memopd.env.qa.sft as sft

    seen = {}
    real = sft._batches

    def recording(examples, batch_tokens, rng, groups=None):
        if not seen:  # the first call is the SFT's (no copy warm-up here)
            seen.update(examples=examples, groups=groups)
        return real(examples, batch_tokens, rng, groups)

    monkeypatch.setattr(sft, "_batches", recording)
    cfg = SFTConfig(steps=2, ks=(1, 2), calls_per_k=10, batch_tokens=2048, policies=("summary", "full"),
                    balance_policies=True, threads=None)
    sft.run_sft(tmp_path, roles=["teacher"], world_config=WorldConfig(seed=0, n_entities=12),
                sft_configs={"teacher": cfg}, model_specs={"teacher": ModelSpec(16, 1, 2, 1, 32, 1024)},
                progress=False, log=lambda *a, **k: None)
    tok = build_tokenizer(World.generate(WorldConfig(seed=0, n_entities=12)).vocabulary_texts(), kind="word")
    search = tok.convert_tokens_to_ids("<search>")
    groups = seen["groups"]
    assert groups == ["summary"] * 20 + ["full"] * 20
    for (ids, n), g in zip(seen["examples"], groups):
        if search in ids[:n]:
            assert g == "full"
    assert any(search in ids[:n] for ids, n in seen["examples"][20:])
    assert read_env_meta(tmp_path / "teacher")["sft"]["data"]["calls_by_policy"] == {"summary": 20, "full": 20}
    assert not list(tmp_path.glob("*.resume-*")), "the resume states go once the checkpoint is saved"


def test_tiny_sft_cache_and_eval(tmp_path, capsys):
    out = tmp_path / "ckpt"
    args = ["--out", str(out), "--entities", "12", "--teacher-steps", "3", "--student-steps", "2",
            "--calls-per-k", "12", "--copy-warmup-steps", "2", "--ks", "1,2", "--batch-tokens", "512", "--no-progress",
            "--json", str(tmp_path / "sft.json")]
    assert sft_main(args) == 0
    for role in ("teacher", "student"):
        d = out / role
        assert checkpoint_exists(d)
        assert {"config.json", "tokenizer.json", "memopd_env.json"} <= set(os.listdir(d))
        meta = read_env_meta(d)
        assert meta["role"] == role and meta["world"]["n_entities"] == 12
    s = json.loads((tmp_path / "sft.json").read_text())
    assert s["teacher"]["steps"] == 3 and s["student"]["params"] < s["teacher"]["params"]
    assert s["teacher"]["warmup"]["steps"] == 2
    mtime = os.path.getmtime(out / "teacher" / "memopd_env.json")
    assert sft_main(args) == 0  # cached: nothing retrained
    assert "skipping" in capsys.readouterr().out
    assert os.path.getmtime(out / "teacher" / "memopd_env.json") == mtime
    # a cache trained with other settings is never reused silently
    changed = [a if a != "2" or i == 0 or args[i - 1] != "--student-steps" else "3" for i, a in enumerate(args)]
    assert sft_main(changed) == 0
    said = capsys.readouterr().out
    assert "student: checkpoint at" in said and "sft_config.steps 2 -> 3" in said and "retraining" in said
    assert read_env_meta(out / "student")["sft"]["steps"] == 3
    assert os.path.getmtime(out / "teacher" / "memopd_env.json") == mtime  # teacher unchanged: reused

    rep = tmp_path / "eval.json"
    assert eval_main(["--model", str(out / "student"), "--k", "2", "--n", "2", "--json", str(rep)]) == 0
    text = capsys.readouterr().out
    assert "EM mean" in text and "EM sum" in text and "Q2" in text
    r = json.loads(rep.read_text())["results"]["Q2"]
    assert r["episodes"] == 2 and 0.0 <= r["em_mean"] <= 1.0 and r["peak_tokens"] > 0 and r["turns"] >= 1
    # sampled evaluation, several episodes per set: each set's id once per episode, the mean over all
    assert eval_main(["--model", str(out / "student"), "--k", "2", "--n", "2", "--temperature", "1", "--samples", "3",
                      "--json", str(rep)]) == 0
    assert "samples per set: 3" in capsys.readouterr().out
    r = json.loads(rep.read_text())
    sets = r["results"]["Q2"]["sets"]
    assert r["samples"] == 3 and r["results"]["Q2"]["episodes"] == 6
    assert sorted(sets["task_id"].count(i) for i in set(sets["task_id"])) == [3, 3]
    assert r["results"]["Q2"]["f1_mean"] == pytest.approx(sum(sets["f1"]) / 6)


def test_eval_user_corpus(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"id": f"d{i}", "title": t, "text": f"{t} is a city in {c}."})
                              for i, (t, c) in enumerate([("Paris", "France"), ("Rome", "Italy"), ("Oslo", "Norway")])))
    qs = tmp_path / "q.jsonl"
    qs.write_text(json.dumps({"questions": ["where is Rome?", "where is Oslo?"], "answers": [["Italy"], ["Norway"]]}))
    rep = tmp_path / "r.json"
    # the scripted expert cannot parse free-text questions: it answers "unknown" (EM 0)
    assert eval_main(["--expert", "--corpus", str(docs), "--questions", str(qs), "--json", str(rep)]) == 0
    r = json.loads(rep.read_text())
    assert r["results"]["Q2"]["episodes"] == 1 and r["results"]["Q2"]["em_sum"] == 0.0
    assert r["source"]["corpus"] == str(docs)
    assert cli_main(["eval", "--expert", "--corpus", str(docs)]) == 2  # bad input
    assert "needs both --corpus and --questions" in capsys.readouterr().err


def test_eval_expert_and_errors(tmp_path, capsys):
    assert eval_main(["--expert", "--k", "2", "--n", "3"]) == 0
    out = capsys.readouterr().out
    assert " 1.000 " in out  # the expert answers everything
    assert cli_main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    assert cli_main(["eval", "--model", str(tmp_path / "plain")]) == 2
    assert "not a memopd env checkpoint" in capsys.readouterr().err
    with pytest.raises(UserError, match="--expert"):
        eval_main([])  # a checkpoint or --expert is required
    # several episodes per set need sampled decoding: one line, exit 2, before any episode
    assert cli_main(["eval", "--expert", "--k", "2", "--n", "2", "--samples", "4"]) == 2
    assert "--samples 4 needs --temperature > 0" in capsys.readouterr().err
    assert cli_main(["eval", "--expert", "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err
    from memopd.env.qa.evaluate import evaluate

    with pytest.raises(ValueError, match="greedy decoding plays the same episode"):
        evaluate(expert=True, ks=(2,), n=1, samples=2)
    with pytest.raises(ValueError, match="samples must be a positive integer"):
        evaluate(expert=True, ks=(2,), n=1, samples=0, temperature=1.0)


def test_a_killed_sft_resumes_exactly(world_tokenizer, tmp_path, monkeypatch):
    """A training stopped mid-way (here: an interrupt at step 5 of 9, the state written at
    every step) and started again with the same resume key ends bitwise equal to an
    uninterrupted one, with the same running stats; a state of another key is ignored."""
    import torch

    from memopd.env import sft

    tok = world_tokenizer
    spec = ModelSpec(16, 1, 2, 1, 32, max_position_embeddings=128)
    examples = copy_warmup_examples(len(tok), 64, first_id=20, max_len=8, max_gap=4, bos_id=tok.bos_token_id)
    cfg = SFTConfig(steps=9, warmup=3, lr=1e-2, batch_tokens=128, threads=None)
    want_model = make_model(spec, tok, seed=0)
    want = train_sft(want_model, examples, cfg, pad_id=tok.pad_token_id, progress=False)

    monkeypatch.setattr(sft, "RESUME_SAVE_EVERY_S", 0.0)
    state = str(tmp_path / "role.resume-sft.pt")
    calls = {"n": 0}
    collate = sft._collate

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return collate(*a, **k)

    monkeypatch.setattr(sft, "_collate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_sft(make_model(spec, tok, seed=0), examples, cfg, pad_id=tok.pad_token_id, progress=False,
                  resume_file=state, resume_key="job")
    monkeypatch.setattr(sft, "_collate", collate)
    assert torch.load(state, weights_only=True)["step"] == 5

    got_model = make_model(spec, tok, seed=0)
    got = train_sft(got_model, examples, cfg, pad_id=tok.pad_token_id, progress=False, resume_file=state,
                    resume_key="job")
    assert got["resumed_from_step"] == 5 and want["resumed_from_step"] == 0
    for k in ("final_loss", "final_action_token_acc", "tokens_seen", "history"):
        assert got[k] == want[k], k
    for name, w in want_model.state_dict().items():
        assert torch.equal(got_model.state_dict()[name], w), name
    # the finished state (step 9) belongs to "job": another job starts from the beginning
    other = train_sft(make_model(spec, tok, seed=0), examples, cfg, pad_id=tok.pad_token_id, progress=False,
                      resume_file=state, resume_key="another job")
    assert other["resumed_from_step"] == 0 and other["history"] == want["history"]


def test_a_damaged_sft_resume_state_starts_over(world_tokenizer, tmp_path):
    tok = world_tokenizer
    spec = ModelSpec(16, 1, 2, 1, 32, max_position_embeddings=128)
    examples = copy_warmup_examples(len(tok), 64, first_id=20, max_len=8, max_gap=4, bos_id=tok.bos_token_id)
    cfg = SFTConfig(steps=3, warmup=1, lr=1e-2, batch_tokens=128, threads=None)
    state = tmp_path / "role.resume-sft.pt"
    state.write_bytes(b"not a torch file")
    got = train_sft(make_model(spec, tok, seed=0), examples, cfg, pad_id=tok.pad_token_id, progress=False,
                    resume_file=str(state), resume_key="job")
    assert got["resumed_from_step"] == 0 and got["steps"] == 3
