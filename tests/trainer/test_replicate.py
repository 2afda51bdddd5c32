"""The replication driver (`memopd compare --protocol paper`): the paired bootstrap on
synthetic per-set scores, and a tiny end-to-end protocol run on the default world."""
import json

import numpy as np
import pytest

from memopd.trainer.experiments.intervals import paired_bootstrap, relative_change
from memopd.trainer.experiments.paper import BUDGETS


def test_bootstrap_identical_arms_is_exactly_zero():
    a = np.random.default_rng(1).random((3, 50))
    got = paired_bootstrap(a, a.copy())
    assert got["diff"] == got["lo"] == got["hi"] == 0.0


def test_bootstrap_constant_shift_is_recovered_exactly():
    a = np.random.default_rng(2).random((3, 40))
    got = paired_bootstrap(a + 0.25, a)
    # every draw sees the same per-set difference, so the interval collapses onto it
    assert got["diff"] == pytest.approx(0.25, abs=1e-12)
    assert got["lo"] == pytest.approx(0.25, abs=1e-12) and got["hi"] == pytest.approx(0.25, abs=1e-12)


def test_bootstrap_noisy_shift_interval_matches_a_float64_loop():
    rng = np.random.default_rng(3)
    b = rng.random((4, 200))
    a = b + 0.1 + rng.normal(0.0, 0.2, size=b.shape)
    got = paired_bootstrap(a, b, draws=2000, seed=7)
    assert got["lo"] < 0.1 < got["hi"] and got["lo"] > 0  # the shift is inside, zero is not
    # the same draws written as a plain loop over draws, seeds and sets
    idx = np.random.default_rng(7).integers(0, 200, size=(2000, 200))
    stats = [sum(float(a[s, j] - b[s, j]) for s in range(4) for j in row) / (4 * 200) for row in idx]
    lo, hi = np.quantile(np.array(stats, dtype=np.float64), [0.025, 0.975])
    assert got["lo"] == pytest.approx(lo, abs=1e-12) and got["hi"] == pytest.approx(hi, abs=1e-12)
    assert paired_bootstrap(a, b, draws=2000, seed=7) == got  # a fixed seed gives the same interval
    # a pairing that ignored the sets' shared difficulty would be far wider
    assert got["hi"] - got["lo"] < 0.1


def test_bootstrap_and_relative_change_reject_bad_input():
    with pytest.raises(ValueError, match="same shape|one shape"):
        paired_bootstrap(np.zeros((2, 3)), np.zeros((3, 3)))
    with pytest.raises(ValueError):
        paired_bootstrap(np.zeros(3), np.zeros(3))
    assert relative_change(1.143, 1.0) == pytest.approx(14.3)
    assert relative_change(0.5, 0.0) is None


def test_per_set_scores_line_up_on_the_held_out_sets():
    from memopd.env.qa.world import World, WorldConfig
    from memopd.trainer.experiments.runs import per_set_scores

    world = World.generate(WorldConfig())
    ids = [t.task_id for t in world.sample_tasks(2, 4, split="eval", seed=0)]
    # played out of order, one set missing (stopped before its first call)
    sets = {"task_id": [ids[2], ids[0], ids[3]], "em": [1.0, 0.5, 0.0], "f1": [1.0, 0.75, 0.25]}
    got = per_set_scores({"Q2": {"sets": sets, "peak_tokens": 90}}, world, 4)["Q2"]
    assert got["task_id"] == ids and got["em"] == [0.5, 0.0, 1.0, 0.0] and got["f1"] == [0.75, 0.0, 1.0, 0.25]
    assert got["em_mean"] == pytest.approx(0.375) and got["f1_mean"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="not the held-out sets"):
        per_set_scores({"Q2": {"sets": {**sets, "task_id": ["elsewhere", ids[0], ids[3]]}}}, world, 4)
    # a set played several times (sampled evaluation) scores the mean of its episodes
    many = {"task_id": [ids[0], ids[1], ids[0], ids[1], ids[0], ids[1]], "em": [1.0, 0.0, 0.0, 0.0, 0.5, 1.0],
            "f1": [1.0, 0.0, 0.5, 0.25, 0.0, 1.0]}
    got = per_set_scores({"Q2": {"sets": many}}, world, 4)["Q2"]
    assert got["em"] == pytest.approx([0.5, 1 / 3, 0.0, 0.0]) and got["f1"] == pytest.approx([0.5, 1.25 / 3, 0.0, 0.0])


def test_budgets_match_the_protocol():
    full = BUDGETS["full"]
    assert len(full.seeds) >= 3 and full.eval_tasks >= 100 and full.eval_every > 0
    ov = full.overrides()
    assert "world=replication" in ov and "train_k=[2]" in ov and "eval_k=[2,8,16]" in ov


def test_quick_protocol_end_to_end_on_the_default_world(sft_dirs, tmp_path):
    from memopd.trainer.compare import compare_main

    out = tmp_path / "rep"
    # untrained tiny models never answer, so Q8/Q16 episodes run to their turn budget:
    # the test evaluates Q2 only to stay within a couple of minutes
    tiny = [f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}", "world=default", "steps=2", "eval_every=1",
            "eval_k=[2]", "eval_tasks=3", "tasks_per_step=2", "group_size=2", "ppo_epochs=1", "minibatches=1"]
    arms = ["ppo", "persistent", "memopd"]  # memopd:naive's runs are covered by tests/trainer/test_trainer_run.py
    assert compare_main(["--protocol", "paper", "--quick", "--arms", *arms, "--seeds", "0", "1", "--jobs", "2",
                         "--out", str(out), *tiny]) == 0
    rep = json.loads((out / "replication_quick.json").read_text())
    assert rep["config"]["train_k"] == [2] and rep["config"]["env"]["world"] == "default"
    assert list(rep["summary"]) == ["sft student", *arms]
    for arm in arms:
        runs = rep["runs"][arm]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            for q in ("Q2",):
                ps = r["per_set"][q]
                assert len(ps["em"]) == len(ps["f1"]) == 3 and all(0 <= x <= 1 for x in ps["em"] + ps["f1"])
                # the per-set scores are the run's own final evaluation, set by set
                final = json.loads((tmp_path / r["run_dir"] / "report.json").read_text())["eval"][q]
                assert ps["em_mean"] == pytest.approx(final["em_mean"], abs=1e-12)
                assert ps["task_id"] == final["sets"]["task_id"] and ps["f1"] == final["sets"]["f1"]
            assert r["costs"]["steps"] == 2 and r["costs"]["step_s"]["mean"] > 0
        # every arm read the same held-out sets
        assert runs[0]["per_set"]["Q2"]["task_id"] == rep["sft_student_per_set"]["Q2"]["task_id"]
    costs = rep["costs"]
    assert costs["ppo"]["teacher_context_peak"]["max"] == 0
    # the persistent teacher reads whole histories, the memopd teacher one call at a time
    assert costs["persistent"]["teacher_context_peak"]["max"] >= costs["memopd"]["teacher_context_peak"]["max"] > 0
    for name in ("memopd − ppo", "memopd − persistent"):
        d = rep["differences"][name]["Q2"]["f1"]
        assert d["lo"] <= d["diff"] <= d["hi"] and d["seeds"] == 2 and d["sets"] == 3
    band = rep["curves"]["memopd"]["Q2"]
    assert band["steps"] == [0, 1, 2] and len(band["mean"]) == len(band["std"]) == 3
    audit = rep["audit"]["by_set"]["all"]["results"]
    assert audit["aligned"]["passed"] and audit["aligned"]["top1_changes"] == 0
    assert audit["flatten"]["spurious_positions"] is not None and audit["flatten"]["actions"] > 0
    md = (out / "replication_quick.md").read_text()
    assert "| memopd − ppo | Q2 |" in md and "positions_broken" in md and "relative F1" in md
    assert (out / "replication_quick.png").stat().st_size > 1000


def test_world_preset_is_checked_and_selects_its_sft_cache(tmp_path):
    from memopd.trainer.config import ConfigError, TrainConfig
    from memopd.trainer.loop import sft_cache_dir

    base = {"cache_dir": str(tmp_path)}
    assert sft_cache_dir(TrainConfig.from_dict(base)) == str(tmp_path / "sft")  # today's path, unchanged
    assert sft_cache_dir(TrainConfig.from_dict({**base, "env": {"world": "replication"}})) == str(tmp_path / "sft-replication")
    with pytest.raises(ConfigError, match="world"):
        TrainConfig.load(None, ["world=atlantis"])


def test_publish_takes_an_existing_results_directory(tmp_path, monkeypatch):
    """`--publish DIR` copies into DIR (atomically, file by file); a directory that does not
    exist is refused before any run, and a bare `--publish` means ./benchmarks/results."""
    from memopd.errors import UserError
    from memopd.trainer.compare import compare_main
    from memopd.trainer.experiments.runs import DEFAULT_RESULTS_DIR, publish_results, results_dir_of

    assert results_dir_of(None) is None
    with pytest.raises(UserError, match=r"--publish .*nope: not a directory"):
        results_dir_of(str(tmp_path / "nope"))
    src = tmp_path / "out" / "replication_quick.json"
    src.parent.mkdir()
    src.write_text('{"a": 1}')
    said = []
    publish_results([str(src)], results_dir_of(str(tmp_path)), said.append, "replication")
    assert (tmp_path / "replication_quick.json").read_text() == '{"a": 1}'
    assert said == [f"[replication] published {tmp_path / 'replication_quick.json'}"]
    # refused before any run: no SFT, no run directory
    with pytest.raises(UserError, match=r"not a directory"):
        compare_main(["--protocol", "paper", "--quick", "--out", str(tmp_path / "runs"), "--publish",
                      str(tmp_path / "nope")])
    assert not (tmp_path / "runs").exists()
    # a bare --publish before the overrides: the overrides stay overrides
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"--publish benchmarks/results: not a directory"):
        compare_main(["--protocol", "paper", "--quick", "--out", str(tmp_path / "runs"), "--publish", "steps=1"])
    assert DEFAULT_RESULTS_DIR == "benchmarks/results"
