"""The rule-teacher replication's statistics and gates (trainer/experiments/rulegap.py): the t-interval,
G0's choice of p, the paired differences with both intervals, the decision rule, and G3's
adoption loss on real expert episodes."""
from dataclasses import replace

import pytest

from memopd.env import EnvConfig, QAEnv, World, build_tokenizer
from memopd.env.qa.world import world_preset
from memopd.trainer.experiments.rulegap import GATES, _paired, _verdict, adoption_loss, g0_choice, interval_t


def test_t_interval_matches_the_tabled_quantile():
    xs = [0.01, 0.03, -0.02, 0.04, 0.00]
    t = interval_t(xs)
    m, sd = 0.012, 0.00057 ** 0.5  # squared deviations sum to 0.00228 over 4 degrees of freedom
    h = 2.7764451051977987 * sd / 5 ** 0.5  # t_{0.975, 4}
    assert abs(t["mean"] - m) < 1e-12 and abs(t["sd"] - sd) < 1e-12
    assert abs(t["lo"] - (m - h)) < 1e-9 and abs(t["hi"] - (m + h)) < 1e-9
    with pytest.raises(ValueError):
        interval_t([0.1])


def test_g0_picks_the_best_passing_p_and_fails_when_none_passes():
    g = g0_choice({"sft": 0.40, "ppo": 0.42, "memopd": {"0.5": 0.45, "0.6": 0.47, "0.9": 0.41}})
    assert g["passed"] and g["p"] == "0.6"
    assert [v["passed"] for v in g["per_p"].values()] == [True, True, False]
    tie = g0_choice({"sft": 0.40, "ppo": 0.42, "memopd": {"0.9": 0.47, "0.6": 0.47}})
    assert tie["p"] == "0.6"  # ties: the smaller p
    none = g0_choice({"sft": 0.50, "ppo": 0.42, "memopd": {"0.5": 0.45, "0.9": 0.49}})
    assert not none["passed"] and none["p"] is None


def _row(seed, curve, per_set):
    return {"job": {"seed": seed}, "curve": curve, "final_per_set": per_set}


def test_paired_differences_and_the_decision_rule():
    sft = 0.4
    a = [_row(s, [[40, 0.5 + 0.01 * s], [80, 0.6]], [0.6, 0.6]) for s in range(5)]
    b = [_row(s, [[40, 0.4], [80, 0.3 + 0.01 * s]], [0.3, 0.3 + 0.02 * s]) for s in range(5)]
    d = _paired(a, b, sft)
    # area: trapezoid over (0, .4), (40, x), (80, y) / 80
    assert d["area"]["per_seed"][0] == pytest.approx(((0.4 + 0.5) * 20 + (0.5 + 0.6) * 20 - (0.4 + 0.4) * 20 - (0.4 + 0.3) * 20) / 80)
    assert d["final"]["per_seed"] == pytest.approx([0.3 - 0.01 * s for s in range(5)])
    t, boot = d["area"]["t"], d["area"]["bootstrap"]
    assert t["lo"] <= d["area"]["mean"] <= t["hi"] and boot["lo"] <= d["area"]["mean"] <= boot["hi"]
    assert boot["resamples"] == "seeds" and d["final"]["bootstrap"]["resamples"] == "seeds and sets"
    assert _verdict(d, True).startswith("harm shown")
    assert _verdict(d, False).endswith("(a gate failed: not read as evidence)")
    null = _paired(a, [_row(s, r["curve"], r["final_per_set"]) for s, r in enumerate(a)], sft)
    null["area"]["per_seed"] = [0.001, -0.001, 0.0005, -0.0005, 0.0]
    null["area"]["t"] = interval_t(null["area"]["per_seed"])
    null["area"]["mde"] = 0.01
    assert _verdict(null, True) == "no harm larger than the MDE"
    null["area"]["mde"] = 0.0001
    assert _verdict(null, True) == "inconclusive"


def test_adoption_loss_guesses_only_what_the_compact_state_cannot_show():
    world = World.generate(replace(world_preset("info-gap"), linked_frac=1.0))
    tok = build_tokenizer(world.vocabulary_texts(), kind="word")
    env = QAEnv.from_world(world, tok, EnvConfig(policy="summary"))
    g = adoption_loss(env, world, world.sample_tasks(2, 40, split="eval", seed=0))
    assert g["aligned"]["gap_calls"] > 10 and g["flatten"]["gap_calls"] > 10
    # the aligned step is the rule on what the call shows: no worse than the scripted expert
    assert g["aligned"]["f1"] >= g["scripted_f1"] - 1e-9
    assert g["loss"] == pytest.approx(g["aligned"]["f1"] - g["flatten"]["f1"])
    assert g["loss"] > 0.1 and GATES["thresholds"]["G3_f1_loss"] == 0.20
