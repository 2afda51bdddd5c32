"""End-to-end trainer runs on tiny SFT'd models: every arm, kill-and-resume, plot."""
import json
import os

import pytest
import torch

from memopd.trainer.config import ConfigError, TrainConfig


def _cfg(sft_dirs, run_dir, **kw):
    base = dict(steps=3, run_dir=str(run_dir), student=sft_dirs[0], teacher=sft_dirs[1], tasks_per_step=2,
                group_size=2, train_k=[1], eval_k=[1], eval_tasks=2, ppo_epochs=1, minibatches=2,
                checkpoint_every=0, progress=False)
    base.update(kw)
    return TrainConfig.from_dict(base)


@pytest.mark.parametrize("arm", ["ppo", "persistent", "memopd"])
def test_smoke_run_each_arm(sft_dirs, tmp_path, arm):
    from memopd.trainer.loop import train

    rep = train(_cfg(sft_dirs, tmp_path / arm, arm=arm, tensorboard=arm == "memopd"), log=lambda *_: None)
    lines = [json.loads(x) for x in open(tmp_path / arm / "metrics.jsonl")]
    train_lines = [x for x in lines if "train/pg_loss" in x]
    assert [x["step"] for x in train_lines] == [1, 2, 3]
    for x in train_lines:
        assert all(v == v for v in (x["train/pg_loss"], x["train/vf_loss"], x["train/entropy"]))  # no NaN
        # the aligned training forward reproduces the sampling log-probs (RCE in training)
        assert x["rce/max_dlogp_vs_sampling"] < 1e-4
        if arm == "ppo":
            assert x["train/kl_teacher"] == 0.0
        else:
            assert x["train/kl_teacher"] > 0.0
    assert "Q1" in rep["eval"] and os.path.exists(os.path.join(rep["final_model"], "config.json"))
    from memopd.trainer.plot import plot_run

    assert os.path.getsize(plot_run(str(tmp_path / arm))) > 1000
    if arm == "memopd":  # the same scalars as TensorBoard events
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ev = EventAccumulator(str(tmp_path / arm / "tb"))
        ev.Reload()
        pg = ev.Scalars("train/pg_loss")
        assert [e.step for e in pg] == [1, 2, 3]
        assert [e.value for e in pg] == pytest.approx([x["train/pg_loss"] for x in train_lines], rel=1e-6)
        assert "eval/em_mean_q1" in ev.Tags()["scalars"]


def test_naive_action_domain_ablation_runs(sft_dirs, tmp_path):
    from memopd.trainer.loop import Trainer, prepare

    def run(domain):
        cfg = _cfg(sft_dirs, tmp_path / domain, steps=1, arm="memopd", action_domain=domain, policy="full")
        student, teacher, env, world, *_ = prepare(cfg)
        tr = Trainer(cfg, student_lm=student, teacher_lm=teacher, env=env, tasks=world, log=lambda *_: None)
        return tr.fit()[0]

    exact, naive = run("exact"), run("naive")
    # same rollouts (same seeds and start weights); the naive run also trains on the
    # copies of earlier actions that the "full" memory policy keeps in later contexts
    assert naive["rollout/action_tokens"] == exact["rollout/action_tokens"]
    assert exact["train/context_copies"] == 0 and naive["train/context_copies"] > 0
    assert naive["rce/max_dlogp_vs_sampling"] < 1e-4
    assert naive["train/kl_teacher"] != pytest.approx(exact["train/kl_teacher"], rel=1e-6)


def test_kill_and_resume_equals_uninterrupted(sft_dirs, tmp_path):
    from memopd.trainer.loop import Trainer, prepare

    def make(run_dir):
        cfg = _cfg(sft_dirs, run_dir, steps=4, checkpoint_every=2, arm="memopd")
        student, teacher, env, world, *_ = prepare(cfg)
        return Trainer(cfg, student_lm=student, teacher_lm=teacher, env=env, tasks=world, log=lambda *_: None)

    full = make(tmp_path / "a")
    h_full = full.fit()
    part = make(tmp_path / "b")
    part.fit(stop_after=2)
    del part  # the "kill"
    resumed = make(tmp_path / "b")
    h_res = resumed.fit(resume=True)
    assert [m["step"] for m in h_res] == [3, 4]
    skip = ("time/",)
    for a, b in zip(h_full[2:], h_res):
        for k, v in a.items():
            if not k.startswith(skip):
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for (n, p), (_, q) in zip(full.actor.unwrapped.named_parameters(), resumed.actor.unwrapped.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    lines_a = [json.loads(x)["step"] for x in open(tmp_path / "a" / "metrics.jsonl")]
    lines_b = [json.loads(x)["step"] for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert lines_a == lines_b == [1, 2, 3, 4]


def test_compare_arms_table(sft_dirs, tmp_path, capsys):
    from memopd.trainer.compare import compare_main

    out = tmp_path / "cmp"
    common = [f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}", "steps=1", "tasks_per_step=2", "group_size=2",
              "train_k=[1]", "eval_k=[1]", "eval_tasks=2", "ppo_epochs=1", "minibatches=1", "checkpoint_every=0"]
    assert compare_main(["--arms", "ppo", "memopd:naive", "--seeds", "0", "--jobs", "2", "--out", str(out), *common]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert [r["arm"] for r in res["rows"]] == ["sft student", "ppo", "memopd:naive"]
    for r in res["rows"][1:]:
        assert 0.0 <= r["eval"]["Q1"]["em_mean"] <= 1.0 and r["cpu_s"] > 0
        cfg = json.loads(json.dumps(__import__("yaml").safe_load(open(os.path.join(r["run_dir"], "config.yaml")))))
        assert cfg["arm"] == r["arm"].split(":")[0] and cfg["steps"] == 1
    assert cfg["action_domain"] == "naive"
    table = (out / "compare.md").read_text()
    assert "| memopd:naive | 1 |" in table and "Q1 em_mean" in table and "Q1 f1_mean" in table
    with pytest.raises(SystemExit):
        compare_main(["--arms", "bogus", "--out", str(out)])
    with pytest.raises(SystemExit):
        compare_main(["--out", str(out), "seed=3"])
    # a rerun into the same --out is refused up front (no SFT, no training), unless --overwrite
    from memopd.errors import RunDirError

    with pytest.raises(RunDirError, match="--overwrite"):
        compare_main(["--arms", "ppo", "--seeds", "0", "--out", str(out), *common])
    assert compare_main(["--arms", "ppo", "--seeds", "0", "--jobs", "1", "--out", str(out), "--overwrite", *common]) == 0


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="arm must be one of"):
        TrainConfig.load(None, ["arm=nope"])
    with pytest.raises(ConfigError, match="action_domain"):
        TrainConfig.load(None, ["action_domain=all"])
    with pytest.raises(ConfigError, match="unknown config key"):
        TrainConfig.load(None, ["stepz=3"])
    p = tmp_path / "c.yaml"
    p.write_text("steps: 7\narm: ppo\ntrain_k: [2, 8]\n")
    cfg = TrainConfig.load(str(p), ["steps=9", "actor_lr=1e-4"])
    assert (cfg.steps, cfg.arm, cfg.train_k, cfg.actor_lr) == (9, "ppo", [2, 8], 1e-4)
    with pytest.raises(ConfigError, match="minibatches"):
        TrainConfig(tasks_per_step=1, group_size=1, minibatches=2).validate()
    # held-out evaluation: greedy by default; several episodes per set only when sampled
    assert (TrainConfig().eval_temperature, TrainConfig().eval_samples) == (0.0, 1)
    assert TrainConfig.load(None, ["eval_temperature=1.0", "eval_samples=8"]).eval_samples == 8
    with pytest.raises(ConfigError, match="eval_samples=4 needs eval_temperature > 0"):
        TrainConfig.load(None, ["eval_samples=4"])
    with pytest.raises(ConfigError, match="eval_samples must be >= 1"):
        TrainConfig.load(None, ["eval_temperature=1.0", "eval_samples=0"])
    with pytest.raises(ConfigError, match="eval_temperature must be >= 0"):
        TrainConfig.load(None, ["eval_temperature=-1"])


def test_prepare_returns_a_named_environment_bundle(sft_dirs, tmp_path):
    from memopd.env.build import EnvironmentBundle
    from memopd.env.qa.world import World
    from memopd.env.rollout import Environment, TaskSource
    from memopd.trainer.loop import prepare

    cfg = _cfg(sft_dirs, tmp_path / "run", arm="ppo", policy="window", policy_kwargs={"turns": 3})
    bundle = prepare(cfg, log=lambda *_: None)
    assert isinstance(bundle, EnvironmentBundle) and bundle.teacher is None
    assert isinstance(bundle.env, Environment) and isinstance(bundle.tasks, World) and isinstance(bundle.tasks, TaskSource)
    assert (bundle.student_dir, bundle.teacher_dir) == sft_dirs
    assert bundle.env.config.policy == "window" and bundle.env.config.policy_kwargs == {"turns": 3}
    assert bundle.env.policy.turns == 3
    # the 7-tuple order callers unpacked before the bundle had names
    assert list(bundle) == [bundle.student, None, bundle.env, bundle.tasks, bundle.tokenizer, *sft_dirs]
