"""`memopd audit --model DIR` audits the model on its own sampled rollouts (held-out sets
of its world, or the user's corpus and question sets); `--random` keeps the random
token-id trajectories; `memopd eval --save-trajectories FILE` writes the episodes it
plays, which `memopd audit --trajectories FILE` reads back."""
import json

import pytest

from memopd.cli import main
from memopd.records import load_trajectories

pytest.importorskip("transformers")


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_audit_of_a_model_uses_its_own_rollouts(sft_dirs, tmp_path, capsys):
    student = sft_dirs[0]
    rc, out, err = _run(capsys, "audit", "--model", student, "--ks", "1", "2", "--n", "2", "--json",
                        str(tmp_path / "a.json"))
    assert rc == 0, err
    assert "== own samples: Q1, held-out sets, temperature 1  (2 trajectories) ==" in out
    assert "== own samples: Q2, held-out sets, temperature 1  (2 trajectories) ==" in out
    rep = json.loads((tmp_path / "a.json").read_text())
    assert rep["passed"] and set(rep["policies"]) == {"own samples: Q1, held-out sets, temperature 1",
                                                      "own samples: Q2, held-out sets, temperature 1"}
    # the same episodes `memopd eval` plays at that temperature and seed, saved and re-audited
    rc, out, err = _run(capsys, "eval", student, "--k", "1", "2", "--n", "2", "--temperature", "1",
                        "--save-trajectories", str(tmp_path / "played.jsonl"))
    assert rc == 0, err
    assert "4 trajectories written to" in out
    played = load_trajectories(tmp_path / "played.jsonl")
    assert [t.rewards["k"] for t in played] == [1, 1, 2, 2]
    actions = sum(len(inv.action_ids) for t in played for inv in t.invocations)
    rows = {r["variant"]: r for r in rep["policies"]["own samples: Q1, held-out sets, temperature 1"]}
    q2 = {r["variant"]: r for r in rep["policies"]["own samples: Q2, held-out sets, temperature 1"]}
    assert rows["aligned"]["actions"] + q2["aligned"]["actions"] == actions
    rc, out, err = _run(capsys, "audit", "--model", student, "--trajectories", str(tmp_path / "played.jsonl"))
    assert rc == 0, err
    assert "== recorded  (4 trajectories) ==" in out


def test_audit_random_trajectories_on_request(sft_dirs, capsys):
    rc, out, err = _run(capsys, "audit", "--model", sft_dirs[0], "--random", "--policy", "summary",
                        "--num-trajectories", "4")
    assert rc == 0, err
    assert "== summary  (4 trajectories) ==" in out and "own samples" not in out


def test_audit_of_a_model_without_a_world_says_what_to_give(tmp_path, capsys):
    from memopd.models import tiny_causal_lm

    d = tmp_path / "hf"
    tiny_causal_lm("qwen2", vocab_size=64).save_pretrained(d)
    rc, _, err = _run(capsys, "audit", "--model", str(d))
    assert rc == 2
    line = err.strip()
    assert "\n" not in line and "has no memopd_env.json" in line and "--random" in line and "--corpus" in line


def test_eval_save_trajectories_to_a_missing_directory_fails_before_playing(sft_dirs, tmp_path, capsys):
    rc, out, err = _run(capsys, "eval", sft_dirs[0], "--k", "1", "--n", "1", "--save-trajectories",
                        str(tmp_path / "nope" / "t.jsonl"))
    assert rc == 2 and "does not exist" in err and out == ""
