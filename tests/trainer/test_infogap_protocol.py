"""The info-gap protocol (`memopd compare --protocol info-gap`): the seed-and-set bootstrap
and its pairing, the minimal detectable effect against a simulation, the curve area, the
manipulation check against plain forwards and on a teacher blind to the context (the gate
must fail, the flag must force the arms), and a tiny end-to-end run."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from memopd.trainer.experiments.intervals import bootstrap_seeds_sets, curve_area, minimal_detectable_effect, student_t_quantile
from memopd.trainer.experiments.manipulation import GATE_MAX_COSINE, GATE_MIN_TOP1, gate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bootstrap_identical_and_shifted_arms():
    a = np.random.default_rng(1).random((5, 40))
    same = bootstrap_seeds_sets(a, a.copy(), draws=500)
    assert same["diff"] == same["lo"] == same["hi"] == 0.0
    got = bootstrap_seeds_sets(a + 0.25, a, draws=500)
    assert got["lo"] == pytest.approx(0.25, abs=1e-12) and got["hi"] == pytest.approx(0.25, abs=1e-12)
    assert got["positive_seeds"] == 5 and got["seeds"] == 5 and got["sets"] == 40
    with pytest.raises(ValueError, match="one shape"):
        bootstrap_seeds_sets(np.zeros((2, 3)), np.zeros((3, 3)))


def test_bootstrap_matches_a_plain_loop_over_drawn_seeds_and_sets():
    rng = np.random.default_rng(3)
    a, b = rng.random((4, 30)), rng.random((4, 30))
    got = bootstrap_seeds_sets(a, b, draws=300, seed=5)
    r = np.random.default_rng(5)
    si, sj = r.integers(0, 4, size=(300, 4)), r.integers(0, 30, size=(300, 30))
    stats = [float(np.mean([[a[s, j] - b[s, j] for j in sj[d]] for s in si[d]])) for d in range(300)]
    lo, hi = np.quantile(stats, [0.025, 0.975])
    assert got["lo"] == pytest.approx(lo, abs=1e-12) and got["hi"] == pytest.approx(hi, abs=1e-12)


def test_bootstrap_pairs_by_seed():
    """Seeds differ a lot (a seed's run is good or bad for both arms); the arms differ by
    0.05 within every seed. Paired by seed the interval is tight around 0.05; with the
    seeds of one arm shuffled (the pairing broken) it is wide and holds 0."""
    rng = np.random.default_rng(7)
    seed_level = rng.normal(0, 0.3, size=(6, 1))
    b = seed_level + rng.normal(0, 0.02, size=(6, 50))
    a = b + 0.05 + rng.normal(0, 0.01, size=(6, 50))
    paired = bootstrap_seeds_sets(a, b)
    assert 0.03 < paired["lo"] < 0.05 < paired["hi"] < 0.07
    broken = bootstrap_seeds_sets(a, b[[1, 2, 3, 4, 5, 0]])
    assert broken["lo"] < 0 < broken["hi"] and broken["hi"] - broken["lo"] > 5 * (paired["hi"] - paired["lo"])
    # seeds resampled: with one score per seed the interval still has width
    per_seed = bootstrap_seeds_sets(a.mean(1), b.mean(1))
    assert per_seed["sets"] == 1 and per_seed["lo"] < per_seed["diff"] < per_seed["hi"]


# Student's t quantiles from printed tables (df: p = 0.975, 0.8), to the tables' digits
T_TABLE = {1: (12.7062, 1.3764), 2: (4.3027, 1.0607), 4: (2.7764, 0.9410), 7: (2.3646, 0.8960),
           11: (2.2010, 0.8755), 30: (2.0423, 0.8538)}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_student_t_quantile_matches_the_tables(df):
    """The replication's t quantiles are computed in closed form (no scipy): they match the
    printed tables, are odd around p = 0.5, and invert the CDF."""
    from memopd.trainer.experiments.intervals import student_t_cdf

    for p, want in zip((0.975, 0.8), T_TABLE[df]):
        assert student_t_quantile(p, df) == pytest.approx(want, abs=6e-5)
        assert student_t_quantile(1 - p, df) == pytest.approx(-student_t_quantile(p, df), abs=1e-12)
        assert student_t_cdf(student_t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)
    assert student_t_quantile(0.5, df) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="df must be a positive integer"):
        student_t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="p must lie in"):
        student_t_quantile(1.0, df)


def test_minimal_detectable_effect_has_its_power():
    """A true effect equal to the MDE is detected by the two-sided paired t-test in about
    80% of simulated experiments with that many seeds."""
    rng = np.random.default_rng(11)
    sd, n = 0.05, 5
    mde = minimal_detectable_effect(rng.normal(0, sd, size=400), seeds=n)  # the spread, estimated from many seeds
    critical = student_t_quantile(0.975, n - 1)
    samples = rng.normal(mde, sd, size=(3000, n))
    t_stats = samples.mean(1) / (samples.std(1, ddof=1) / np.sqrt(n))
    hits = int((np.abs(t_stats) > critical).sum())
    assert 0.75 <= hits / 3000 <= 0.86
    d = rng.normal(0.01, 0.04, size=5)
    assert minimal_detectable_effect(d, seeds=12) < minimal_detectable_effect(d, seeds=8) < minimal_detectable_effect(d)
    assert minimal_detectable_effect([0.1]) is None


def test_curve_area_is_the_mean_score_over_training():
    assert curve_area([(0, 0.5), (10, 0.5), (40, 0.5)]) == pytest.approx(0.5)
    assert curve_area([(0, 0.0), (10, 1.0), (20, 1.0)]) == pytest.approx(0.75)
    assert curve_area([(10, 1.0), (0, 0.0), (0, 0.0)]) == pytest.approx(0.5)  # sorted, duplicates kept once
    with pytest.raises(ValueError):
        curve_area([])


def test_gate_thresholds():
    assert gate(0.12, 0.5)["passed"]
    assert not gate(GATE_MIN_TOP1 - 1e-6, 0.5)["passed"]
    g = gate(0.2, GATE_MAX_COSINE)
    assert not g["passed"] and "cosine" in g["reasons"][0]
    assert len(gate(0.0, 1.0)["reasons"]) == 2
    # no information-gap call in the check's rollouts, or no gradient there: the gate cannot pass
    assert gate(None, None)["reasons"] == ["the check's rollouts hold no information-gap call",
                                          "no cosine of the two views' OPD gradients at the information-gap calls"]
    assert not gate(0.5, math.nan)["passed"]
    assert "information-gap calls" in gate(0.5, 0.1)["statement"]


def _bundle(student, teacher, **over):
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import prepare

    cfg = TrainConfig.from_dict(dict(student=student, teacher=teacher, arm="memopd", group_size=2, **over))
    return cfg, prepare(cfg, log=lambda *_: None)


def _blind_teacher(teacher_dir: str, out: str) -> str:
    """A copy of the teacher whose layers add nothing to the residual stream (attention and
    MLP outputs zeroed): its state at a token is that token's embedding alone, the same
    under every view."""
    from memopd.models import load_local_model

    shutil.copytree(teacher_dir, out)
    m = load_local_model(out, dtype=torch.float32)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    m.save_pretrained(out)
    for f in os.listdir(out):
        if f.startswith("MANIFEST") or f.endswith(".manifest.json"):
            os.remove(os.path.join(out, f))
    return out


def test_check_disagreement_matches_plain_forwards(sft_dirs):
    from memopd.env.qa.sft import flattened_prompt
    from memopd.hf import independent_forward
    from memopd.trainer.experiments.manipulation import manipulation_check

    cfg, bundle = _bundle(*sft_dirs)
    c = manipulation_check(cfg, bundle, tasks=3)
    # the same rollouts (the check samples deterministically), scored by plain forwards
    from memopd.env.rollout import HFEngine, rollout

    t = bundle.teacher
    V = len(bundle.tokenizer)
    trajs = rollout(bundle.env, HFEngine(bundle.student, pad_id=bundle.env.tokens.pad, vocab_size=V),
                    bundle.tasks.sample_tasks(2, 3, split="train", seed=0), group_size=2, temperature=1.0, seed=0,
                    group_prefix="check-")
    differ = n = 0
    with torch.no_grad():
        for tr in trajs:
            for k, inv in enumerate(tr.invocations):
                a = len(inv.action_ids)
                s = len(inv.prefix_ids) + len(inv.context_ids) - 1
                za = t.lm_head(independent_forward(t, inv.input_ids, output="hidden"))[s:s + a, :V]
                flat = flattened_prompt(tr, k)
                zf = t.lm_head(independent_forward(t, flat + list(inv.action_ids), output="hidden"))
                zf = zf[len(flat) - 1:len(flat) - 1 + a, :V]
                differ += int((za.argmax(-1) != zf.argmax(-1)).sum())
                n += a
    assert c["action_tokens"] == n and n > 100
    assert c["top1"]["all"] == pytest.approx(differ / n, abs=2 / n)
    # per information-gap call: differs at some token; at least the token share's worth of calls
    anyt = c["top1"]["gap_calls_any_token"]
    if c["gap_calls"]:
        assert 0.0 <= anyt <= 1.0 and (anyt > 0) == (c["top1"]["gap_calls"] > 0)
    else:
        assert anyt is None
    assert 0 < c["top1"]["all"]  # this barely trained teacher does read its context
    assert c["grad"]["ppo_norm"] > 0 and c["grad"]["opd_aligned_norm"] > 0
    lam = c["opd_coef_matched"]
    assert lam * 0.5 * (c["grad"]["opd_aligned_norm"] + c["grad"]["opd_flatten_norm"]) == pytest.approx(
        c["grad"]["ppo_norm"], rel=1e-9)
    # the gate reads the information-gap calls' figures; the ceiling counts the same action tokens
    assert c["gate"] == gate(c["top1"]["gap_calls"], c["grad_gap_calls"]["cosine"])
    assert c["ceiling"]["action_tokens"] == n
    assert (c["gap_calls"] > 0) == (c["ceiling"]["gap_call_tokens"] > 0) == (c["grad_gap_calls"]["cosine"] is not None)
    # the broken states move this teacher (it reads positions and context) by a measurable amount
    for x in c["controls"].values():
        assert 0.0 <= x["top1_vs_aligned"] <= 1.0 and -1.0 <= x["cosine_vs_aligned"] <= 1.0 and x["kl"] >= 0.0
    assert c["controls"]["positions_broken"]["top1_vs_aligned"] > 0
    # the student is left as it was: no gradients, the same requires_grad flags
    assert all(p.grad is None for p in bundle.student.parameters())


def test_check_on_a_teacher_blind_to_the_context_fails_the_gate(sft_dirs, tmp_path):
    from memopd.trainer.experiments.manipulation import manipulation_check

    blind = _blind_teacher(sft_dirs[1], str(tmp_path / "blind"))
    cfg, bundle = _bundle(sft_dirs[0], blind)
    c = manipulation_check(cfg, bundle, tasks=3)
    assert c["top1"]["all"] == 0.0
    assert c["kl"]["flatten_minus_aligned"] == pytest.approx(0.0, abs=1e-6)
    assert c["grad"]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert not c["gate"]["passed"] and len(c["gate"]["reasons"]) == 2
    assert c["grad_gap_calls"]["cosine"] is None or c["grad_gap_calls"]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert all("information-gap" in r for r in c["gate"]["reasons"])
    # the negative controls' broken states change nothing for a teacher that reads no context and no position
    assert set(c["controls"]) == {"positions_broken", "visibility_broken"}
    for x in c["controls"].values():
        assert x["top1_vs_aligned"] == 0.0 and x["cosine_vs_aligned"] == pytest.approx(1.0, abs=1e-6)
        assert x["kl"] == pytest.approx(c["kl"]["aligned"], abs=1e-6)


@pytest.mark.slow
def test_protocol_stops_at_the_gate_and_the_flag_forces_the_arms(sft_dirs, tmp_path):
    from memopd.trainer.compare import compare_main

    blind = _blind_teacher(sft_dirs[1], str(tmp_path / "blind"))
    tiny = [f"student={sft_dirs[0]}", f"teacher={blind}", "world=default", "steps=2", "eval_every=1", "eval_k=[2]",
            "eval_tasks=3", "tasks_per_step=2", "group_size=2", "ppo_epochs=1", "minibatches=1"]
    out = tmp_path / "stopped"
    arms = ["persistent", "memopd", "broken_positions"]
    assert compare_main(["--protocol", "info-gap", "--quick", "--arms", *arms, "--out", str(out), *tiny]) == 0
    rep = json.loads((out / "infogap_quick.json").read_text())
    assert not rep["check"]["gate"]["passed"] and rep["arms_run"] is False
    assert not any((out / a).exists() for a in arms)  # no arm ran
    assert json.loads((out / "infogap_quick.check.json").read_text())["check"] == rep["check"]
    assert "The arms were not run" in (out / "infogap_quick.md").read_text()
    forced = tmp_path / "forced"
    assert compare_main(["--protocol", "info-gap", "--quick", "--force-arms", "--arms", *arms, "--seeds", "0", "1",
                         "--jobs", "2", "--out", str(forced), *tiny]) == 0
    rep = json.loads((forced / "infogap_quick.json").read_text())
    assert rep["arms_run"] and rep["forced"] and rep["opd_coef_source"] == "gradient-norm matched at step 0"
    assert "**Forced**" in (forced / "infogap_quick.md").read_text()
    assert all(f"ppo.teacher_kl_coef={rep['opd_coef']:.4g}" in o or not o.startswith("ppo.teacher_kl_coef")
               for o in rep["overrides"])
    assert rep["config"]["ppo"]["teacher_kl_coef"] == pytest.approx(rep["opd_coef"])
    for arm in arms:
        runs = rep["runs"][arm]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert 0 <= r["area_f1_q2"] <= 1 and r["clipped_step_fraction"] is not None
            assert [s for s, _ in r["curve_f1"]["Q2"]][:1] == [0]
    p = rep["stats"]["primary"]
    assert p["seeds"] == 2 and p["lo"] <= p["diff"] <= p["hi"] and set(p["mde_by_seeds"]) == {"5", "8", "12"}
    # broken_positions ran but is not the negative control (the check shows it barely moves a teacher
    # trained on the flattened view); broken_visibility, which is, did not run here
    assert "Q2 F1 area, memopd − broken_positions" in rep["stats"]["secondary"]
    assert not any(n.startswith("negative control") for n in rep["stats"]["secondary"])
    # the curves read the sampled policy (quick budget: temperature 1, 2 episodes per set); each final
    # model is also played greedily on Q2 and Q8; the controls' verdict is stated with the result
    assert rep["config"]["eval_temperature"] == 1.0 and rep["config"]["eval_samples"] == 2
    for arm in arms:
        for r in rep["runs"][arm]:
            assert set(r["per_set_greedy"]) == {"Q2", "Q8"} and len(r["per_set_greedy"]["Q8"]["f1"]) == 3
    assert set(rep["summary_greedy"]) == {"sft student", *arms}
    assert "Q8 final greedy F1 (retention), memopd − persistent" in rep["stats"]["secondary"]
    v = rep["stats"]["controls"]
    assert v == {"positive": None, "negative": None, "endpoint_detects_controls": False}
    assert "Controls: positive not run, negative not run" in (forced / "infogap_quick.md").read_text()
    assert rep["endpoints"]["primary"].startswith("area under the held-out Q2 F1 curve")
    md = (forced / "infogap_quick.md").read_text()
    assert "## Primary endpoint" in md and "minimal detectable effect" in md
    assert (forced / "infogap_quick.png").stat().st_size > 1000
    # the broken teacher state is the teacher's input in that arm
    assert math.isfinite(rep["summary"]["broken_positions"]["Q2"]["f1"][0])


def test_controls_verdict_needs_every_control_above_zero():
    from memopd.trainer.experiments.infogap_protocol import INFOGAP_ARMS, NEGATIVE_CONTROL, controls_verdict

    assert NEGATIVE_CONTROL == "broken_visibility" and NEGATIVE_CONTROL in INFOGAP_ARMS
    up, straddle = {"lo": 0.01, "diff": 0.02, "hi": 0.03}, {"lo": -0.01, "diff": 0.01, "hi": 0.03}
    pos, neg = "positive control: Q2 F1 area, memopd − ppo", "negative control: Q2 F1 area, memopd − broken_visibility"
    other = "Q2 F1 area, memopd − broken_positions"  # reported, not a control
    assert controls_verdict({pos: up, neg: up, other: straddle}) == {"positive": True, "negative": True,
                                                                     "endpoint_detects_controls": True}
    assert controls_verdict({pos: up, neg: straddle})["endpoint_detects_controls"] is False
    assert controls_verdict({pos: straddle, neg: up})["positive"] is False
    assert controls_verdict({neg: up}) == {"positive": None, "negative": True, "endpoint_detects_controls": False}


def test_negative_control_arms_score_the_broken_states():
    from memopd.memory import random_trajectories
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.update import pack_layout

    assert TrainConfig(arm="broken_positions").arm_spec.teacher_layout == "positions_broken"
    assert TrainConfig(arm="broken_visibility").arm_spec.uses_teacher
    trajs = random_trajectories("summary", 6, group_size=2, seed=3)
    aligned = pack_layout(trajs, 4096)
    pos = pack_layout(trajs, 4096, layout="positions_broken")
    vis = pack_layout(trajs, 4096, layout="visibility_broken")
    # the same entries in the same order: the OPD term pairs them with the student's
    for b in (pos, vis):
        assert torch.equal(b.input_ids, aligned.input_ids) and torch.equal(b.target_ids, aligned.target_ids)
    # positions counted along each row instead of restored; visibility: one causal segment per row
    starts = aligned.cu_rows[:-1].tolist()
    assert all(int(pos.position_ids[s]) == 0 for s in starts)
    assert not torch.equal(pos.position_ids, aligned.position_ids)
    assert torch.equal(vis.position_ids, aligned.position_ids)
    assert vis.attn.cu_seqlens.numel() == aligned.num_rows + 1 < aligned.attn.cu_seqlens.numel()
    # micro-batches keep the broken state
    for mb in pos.micro_batches(64):
        assert int(mb.position_ids[0]) == 0


def test_force_arms_belongs_to_the_info_gap_protocol(capsys):
    from memopd.trainer.compare import compare_main

    with pytest.raises(SystemExit) as e:
        compare_main(["--force-arms", "--protocol", "paper"])
    assert e.value.code == 2 and "--force-arms belongs to --protocol info-gap" in capsys.readouterr().err


@pytest.fixture(scope="module")
def infogap_dirs(tmp_path_factory):
    """(student, teacher) of the info-gap world, 3 SFT steps each: barely trained, but
    their rollouts hold information-gap calls, which the default world's do not."""
    from memopd.env.qa.sft import SFTConfig, run_sft
    from memopd.env.qa.world import world_preset

    out = tmp_path_factory.mktemp("sft-info-gap")
    tiny = SFTConfig(steps=3, ks=(1, 2), calls_per_k=8)
    run_sft(out, world_config=world_preset("info-gap"), sft_configs={"teacher": tiny, "student": tiny}, jobs=1,
            progress=False, log=lambda *_: None)
    return str(out / "student"), str(out / "teacher")


def test_gap_token_script_agrees_with_the_check(infogap_dirs, capsys):
    """benchmarks/analysis/infogap_gap_tokens.py draws the check's rollouts and counts, by plain
    forwards, the same differing tokens at the information-gap calls as the check does
    through the trainer's scoring, and the ceiling's one token per call."""
    import importlib.util
    import pathlib
    import re

    from memopd.trainer.experiments.manipulation import manipulation_check

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "analysis" / "infogap_gap_tokens.py"
    spec = importlib.util.spec_from_file_location("infogap_gap_tokens", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg, bundle = _bundle(*infogap_dirs, world="info-gap")
    c = manipulation_check(cfg, bundle, tasks=8)
    assert mod.main([*infogap_dirs, "--tasks", "8", "--group", str(cfg.group_size), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert c["gap_calls"] > 0, "the fixture's rollouts should hold information-gap calls"
    m = re.search(r"(\d+) information-gap calls, (\d+) action tokens; the teacher's top-1 differs at (\d+) "
                  r"\([\d.]+%\), at some token in (\d+) of the calls", out)
    assert m, out
    calls, tokens, differ, hit = map(int, m.groups())
    assert hit / calls == pytest.approx(c["top1"]["gap_calls_any_token"], abs=2 / calls)  # the same 2 near-ties as below
    assert calls == c["gap_calls"] and tokens == c["ceiling"]["gap_call_tokens"]
    assert differ / tokens == pytest.approx(c["top1"]["gap_calls"], abs=2 / tokens)
    assert calls / tokens == pytest.approx(c["ceiling"]["gap_calls"]["one_per_call"])
