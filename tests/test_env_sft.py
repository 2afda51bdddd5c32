"""SFT examples, a tiny `memopd sft` run with its cache, and `memopd eval` output."""
import json
import os

import pytest

from memopd.env import QAEnv, World, WorldConfig, build_tokenizer, expert_trajectories
from memopd.cli import main as cli_main
from memopd.env.cli import eval_main, sft_main
from memopd.env.sft import checkpoint_exists, read_env_meta, sft_examples


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
    with pytest.raises(SystemExit):
        eval_main([])  # --model or --expert is required
