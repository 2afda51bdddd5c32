"""Bring your own models and data: `memopd train student=DIR teacher=DIR corpus= tasks=`.

Everything is built locally in a tmp dir (no download): a standard byte-level BPE
tokenizer trained on the test corpus (it does NOT have the protocol tags as tokens, so
every tag is an id sequence), a Llama student and a Qwen2 teacher with different lm_head
sizes (both larger than the tokenizer), a corpus and question-set JSONL files.
"""
import json
import os

import pytest
import torch

from memopd.env import Document, HFEngine, QAEnv, Task, UserTasks, rollout
from memopd.env.qa.protocol import TAG_NAMES, ProtocolError, ProtocolTokens, find_tags, parse_action
from memopd.errors import UserError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FACTS = [  # (place, capital, river)
    ("norland", "vesk", "amber"), ("sudmark", "tollo", "grey"), ("ostria", "pell", "swift"),
    ("westfal", "rund", "cold"), ("karavia", "mibo", "long"), ("lundor", "sarn", "bright"),
    ("pelagon", "dorr", "still"), ("tamsey", "quill", "red"),
]


def _docs():
    docs = []
    for i, (p, c, r) in enumerate(FACTS):
        docs.append({"id": f"d{i}a", "title": p, "text": f"the capital of {p} is {c} ."})
        docs.append({"id": f"d{i}b", "title": p, "text": f"the river of {p} is the {r} river ."})
    return docs


def _questions():
    qs = []
    for p, c, r in FACTS:
        qs.append((f"what is the capital of {p} ?", [c]))
        qs.append((f"which river flows in {p} ?", [r, f"the {r} river"]))
    return qs


def build_tokenizer(texts):
    """A GPT-2-style byte-level BPE wrapped as a standard PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>", "</s>", "<pad>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def act_ids(env, *parts):
    """Action ids from parts: a tag name ("mem_open", ...) or a text span (" words")."""
    out = []
    for p in parts:
        out += list(env.tokens.tag_ids(p)) if p in TAG_NAMES else env.encode(p)
    return out


def search_action(env):
    return act_ids(env, "mem_open", " seen", "mem_close", "search_open", " capital", "search_close")


def answer_action(env):
    return act_ids(env, "mem_open", " seen", "mem_close", "answer_open", " vesk", "answer_close")


def quick_sft(model, env, tasks, steps=120):
    """Teach a random student the format (search first, then answer) so that the trainer's
    sampled actions really contain multi-token tags."""
    examples = []
    for t in tasks:
        ep = env.reset(t)
        for a in (search_action(env), answer_action(env)):
            examples.append((ep.prompt_ids(), a))
            ep.step(a)
    L = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), L), env.tokens.pad, dtype=torch.long)
    labels = torch.full((len(examples), L), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), L), dtype=torch.long)
    for b, (p, a) in enumerate(examples):
        seq = p + a
        ids[b, :len(seq)] = torch.tensor(seq)
        mask[b, :len(seq)] = 1
        labels[b, len(p):len(seq)] = torch.tensor(a)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    from memopd.env.qa.protocol import ERRORS, INSTRUCTION
    from memopd.models import tiny_causal_lm

    root = tmp_path_factory.mktemp("byo")
    docs, qs = _docs(), _questions()
    with open(root / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    with open(root / "train.jsonl", "w") as f:  # a flat list: one question per line
        for q, a in qs[:12]:
            f.write(json.dumps({"questions": [q], "answers": [a]}) + "\n")
    with open(root / "heldout.jsonl", "w") as f:  # held-out: two 2-question sets
        f.write(json.dumps({"id": "h0", "questions": [qs[12][0], qs[13][0]], "answers": [qs[12][1], qs[13][1]]}) + "\n")
        f.write(json.dumps({"id": "h1", "questions": [qs[14][0], qs[15][0]], "answers": [qs[14][1], qs[15][1]]}) + "\n")
    texts = [f"{d['title']} : {d['text']}" for d in docs] + [q for q, _ in qs] + [INSTRUCTION, *ERRORS.values()]
    tok = build_tokenizer(texts)
    V = len(tok)
    student = tiny_causal_lm("llama", vocab_size=V + 5, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                             max_positions=1024, seed=1)
    teacher = tiny_causal_lm("qwen2", vocab_size=V + 37, hidden_size=48, num_layers=2, num_heads=4,
                             num_kv_heads=2, max_positions=1024, seed=2)
    env = QAEnv([Document(d["id"], d["text"], d["title"]) for d in docs], tok)
    tasks = UserTasks([Task(f"t{i}", [q], [a]) for i, (q, a) in enumerate(qs[:12])])
    sft_tasks = tasks.sample_tasks(1, 6, seed=0) + tasks.sample_tasks(2, 6, seed=0)
    loss = quick_sft(student, env, sft_tasks)
    sdir, tdir = root / "student", root / "teacher"
    student.save_pretrained(sdir)
    tok.save_pretrained(sdir)
    teacher.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    return {"root": root, "tok": tok, "student": str(sdir), "teacher": str(tdir), "env": env, "tasks": tasks,
            "sft_loss": loss, "corpus": str(root / "corpus.jsonl"), "train": str(root / "train.jsonl"),
            "heldout": str(root / "heldout.jsonl")}


def test_tags_are_id_sequences(byo):
    tok, env = byo["tok"], byo["env"]
    p = ProtocolTokens.from_tokenizer(tok)
    assert p == env.tokens
    assert not p.single_token_tags and all(len(p.tag_ids(n)) > 1 for n in TAG_NAMES)
    assert (p.bos, p.eos, p.pad) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert p.extra_tag_tokens > 0
    with pytest.raises(ProtocolError, match="use `mem_open_ids`"):
        _ = p.mem_open
    # the stop entries are the closing tags' sequences (and eos)
    assert p.stop_ids == (p.search_close_ids, p.answer_close_ids, p.eos)
    a = search_action(env)
    assert [n for n, _, _ in find_tags(a, p)] == ["mem_open", "mem_close", "search_open", "search_close"]
    r = parse_action(a, p)
    assert r.kind == "search" and r.memory == (0, len(act_ids(env, "mem_open", " seen", "mem_close")))
    assert env.decode(a[r.body[0]:r.body[1]]) == " capital"
    assert parse_action(answer_action(env) + [p.eos], p).kind == "answer"
    cases = {
        ("mem_open", " x", "mem_close", "search_open", " q"): "cut_off",
        ("mem_open", " x", "mem_close", " q", "search_close"): "no_search_open",
        ("mem_open", " x", "mem_close", " red", "answer_close"): "no_answer_open",
        ("search_open", " q", "search_close"): "no_memory",
        ("mem_open", " x", "search_open", " q", "search_close"): "memory_open",
        ("mem_open", "mem_close", "search_open", " x", "search_close", "answer_open", " y", "answer_close"): "two_actions",
        ("mem_open", "mem_close", "search_open", " x", "answer_open", " y", "answer_close"): "two_actions",
        ("mem_open", "mem_close", "info_open", " x", "info_close", "search_open", " y", "search_close"): "info_tag",
    }
    for parts, code in cases.items():
        r = parse_action(act_ids(env, *parts), p)
        assert (r.kind, r.error) == ("error", code), parts
    assert tok.convert_ids_to_tokens(list(p.mem_open_ids))[0] == "<"


def test_episode_with_multi_token_tags(byo):
    env = byo["env"]
    p = env.tokens
    task = Task("t", ["what is the capital of norland ?"], [["vesk"]])
    ep = env.reset(task)
    assert ep.prefix_ids[0] == p.bos
    a0 = act_ids(env, "mem_open", " note", "mem_close", "search_open", " capital norland", "search_close")
    r = ep.step(a0)
    assert r.kind == "search" and not r.done
    obs = r.observation_ids
    assert tuple(obs[:len(p.info_open_ids)]) == p.info_open_ids
    assert tuple(obs[-len(p.info_close_ids):]) == p.info_close_ids
    assert "the capital of norland is vesk" in env.decode(obs)
    mem = act_ids(env, "mem_open", " note", "mem_close")
    assert ep.context_ids == mem + obs  # the summary policy keeps the multi-token memory span
    r = ep.step(answer_action(env))
    assert r.done and r.kind == "answer"
    tr = ep.trajectory()
    assert tr.rewards["em_mean"] == 1.0 and tr.rewards["format_errors"] == 0
    tr.validate(vocab_size=len(byo["tok"]))


def test_engine_stops_on_tag_sequences_and_records_exactly(byo):
    from transformers import AutoModelForCausalLM

    env, tok = byo["env"], byo["tok"]
    model = AutoModelForCausalLM.from_pretrained(byo["student"]).eval()
    V = len(tok)
    engine = HFEngine(model, pad_id=env.tokens.pad, batch_size=4, vocab_size=V)
    tasks = byo["tasks"].sample_tasks(2, 2, seed=3) + byo["tasks"].sample_tasks(1, 2, seed=3)
    stops = env.tokens.stop_sequences
    n_tag_actions = 0
    for temperature in (0.0, 1.0):
        trajs = rollout(env, engine, tasks, group_size=2, temperature=temperature, seed=4)
        for tr in trajs:
            tr.validate(vocab_size=V)
            for inv in tr.invocations:
                a = inv.action_ids
                ends = [len(a) - len(s) for s in stops if tuple(a[-len(s):]) == s]
                # stopped right after the first complete closing tag (or ran out of tokens)
                for s in stops:
                    for i in range(len(a) - len(s)):
                        assert tuple(a[i:i + len(s)]) != s, "generation went on past a closing tag"
                n_tag_actions += bool(ends) and parse_action(a, env.tokens).kind != "error"
                ids = inv.prefix_ids + inv.context_ids + a
                n = len(inv.prefix_ids) + len(inv.context_ids)
                with torch.no_grad():
                    lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :, :V].float(), -1)
                ref = [float(lp[n - 1 + j, t]) for j, t in enumerate(a)]
                assert max(abs(x - y) for x, y in zip(ref, inv.sample_logprobs)) < 1e-5
        if temperature == 0.0:  # the SFT'd student follows the format: search, then answer
            assert all(t.info["finish"] == "answer" and t.rewards["format_errors"] == 0 for t in trajs), \
                [t.info for t in trajs]
    assert n_tag_actions > 0


def test_user_tasks_sampling():
    sets = [Task(f"s{i}", [f"q{i} ?"], [[f"a{i}"]]) for i in range(5)]
    sets += [Task("pair", ["p1 ?", "p2 ?"], [["x"], ["y"]])]
    ut = UserTasks(sets, [Task("e0", ["e ?"], [["z"]])])
    assert ut.sizes() == {1: 5, 2: 1} and ut.num_questions() == 7
    assert ut.check_k(1) == "as-is" and ut.check_k(2) == "as-is" and ut.check_k(3) == "composed"
    a = ut.sample_tasks(3, 4, seed=7)
    assert [t.to_json() for t in a] == [t.to_json() for t in ut.sample_tasks(3, 4, seed=7)]  # deterministic
    assert [t.questions for t in a] != [t.questions for t in ut.sample_tasks(3, 4, seed=8)]
    assert all(t.k == 3 and len(set(t.questions)) == 3 for t in a)
    allq = {q: ans for t in sets for q, ans in zip(t.questions, t.answers)}
    assert all(allq[q] == ans for t in a for q, ans in zip(t.questions, t.answers))  # answers follow questions
    two = ut.sample_tasks(2, 3, seed=0)  # the file's own 2-question set, as is, cycled
    assert all(t.questions == ["p1 ?", "p2 ?"] and t.meta["source"] == ["pair"] for t in two)
    assert len({t.task_id for t in two}) == 3  # unique ids even when a set repeats
    ones = ut.sample_tasks(1, 5, seed=0)  # n <= sets: each set once
    assert sorted(t.questions[0] for t in ones) == [f"q{i} ?" for i in range(5)]
    assert ut.sample_tasks(1, 1, split="eval")[0].questions == ["e ?"]
    with pytest.raises(UserError, match="too few"):
        ut.check_k(8)
    with pytest.raises(UserError, match="no 'eval' question sets"):
        UserTasks(sets).sample_tasks(1, 1, split="eval")


def test_prepare_refuses_clearly(byo, tmp_path):
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import prepare

    base = dict(student=byo["student"], teacher=byo["teacher"], run_dir=str(tmp_path / "r"), progress=False)

    def refuse(match, **kw):
        with pytest.raises(UserError, match=match):
            prepare(TrainConfig.from_dict({**base, **kw}), log=lambda *_: None)

    refuse("not a memopd checkpoint of the generated world.*corpus=")  # a generic model, no data
    refuse("needs both corpus=.*missing: tasks", corpus=byo["corpus"])
    refuse("tasks=.*no such file", corpus=byo["corpus"], tasks=str(tmp_path / "nope.jsonl"))
    refuse("arm=memopd distils from a teacher", corpus=byo["corpus"], tasks=byo["train"], teacher="")
    refuse("train_k=.*too few", corpus=byo["corpus"], tasks=byo["train"], train_k=[40])
    refuse("only used with your own data", tokenizer=byo["student"])
    refuse("holds no tokenizer", corpus=byo["corpus"], tasks=byo["train"], tokenizer=str(tmp_path))
    out = prepare(TrainConfig.from_dict({**base, "corpus": byo["corpus"], "tasks": byo["train"], "arm": "ppo",
                                         "teacher": ""}), log=lambda *_: None)
    student, teacher, env, world, tokenizer, sdir, _ = out
    assert teacher is None and isinstance(world, UserTasks) and len(tokenizer) == len(byo["tok"])
    assert env.tokens == byo["env"].tokens and sdir == byo["student"]


def test_train_end_to_end(byo, tmp_path, monkeypatch):
    """2 PPO+OPD steps of a Llama student distilled from a Qwen2 teacher on user data."""
    import importlib

    rollout_mod = importlib.import_module("memopd.env.rollout")  # `memopd.env.rollout` is also a function
    from memopd.env.qa.evaluate import evaluate
    from memopd.trainer.cli import train_main

    captured = []
    orig = rollout_mod.rollout

    def spy(*a, **kw):
        out = orig(*a, **kw)
        captured.extend(out)
        return out

    monkeypatch.setattr(rollout_mod, "rollout", spy)
    run = tmp_path / "run"
    argv = [f"student={byo['student']}", f"teacher={byo['teacher']}", f"corpus={byo['corpus']}",
            f"tasks={byo['train']}", f"eval_tasks_file={byo['heldout']}", "arm=memopd", "steps=2",
            "train_k=[1,2]", "tasks_per_step=2", "group_size=2", "ppo_epochs=1", "minibatches=2",
            "checkpoint_every=0", "progress=false", f"run_dir={run}"]
    assert train_main(argv) == 0
    lines = [json.loads(x) for x in open(run / "metrics.jsonl")]
    steps = [x for x in lines if "train/pg_loss" in x]
    assert [x["step"] for x in steps] == [1, 2] and [x["rollout/k"] for x in steps] == [1, 2]
    for x in steps:
        assert x["rce/max_dlogp_vs_sampling"] < 1e-4, x
        if "train/first_ratio_maxdev" in x:
            assert x["train/first_ratio_maxdev"] < 1e-5, x
        assert x["train/kl_teacher"] > 0.0
    # the sampled actions really used the multi-token tags, and episodes ran their course
    p = byo["env"].tokens
    assert captured and all(len(tr.invocations) >= 1 for tr in captured)
    closes = (p.search_close_ids, p.answer_close_ids)
    tagged = [inv for tr in captured for inv in tr.invocations
              if any(tuple(inv.action_ids[-len(c):]) == c for c in closes)]
    assert tagged, "no sampled action ended with a (multi-token) closing tag"
    assert any(len(inv.context_ids) > 0 and find_tags(inv.context_ids, p) for tr in captured for inv in tr.invocations)
    assert {tr.info["finish"] for tr in captured} <= {"answer", "budget", "overflow", "empty_action"}
    # final evaluation on the held-out file (its 2-question sets, as they are)
    report = json.load(open(run / "report.json"))
    assert set(report["eval"]) == {"Q2"} and report["eval"]["Q2"]["episodes"] == 2
    assert any(x.get("eval/em_mean_q2") is not None for x in lines)
    final = report["final_model"]
    meta = json.load(open(os.path.join(final, "memopd_env.json")))
    assert meta["data"]["corpus"] == os.path.abspath(byo["corpus"]) and "world" not in meta
    again = evaluate(final, corpus=byo["corpus"], questions=byo["heldout"])
    assert again["results"]["Q2"]["em_mean"] == report["eval"]["Q2"]["em_mean"]
    with pytest.raises(UserError, match="trained on user data"):
        evaluate(final)
