"""`memopd train rollout_engine=vllm` and `memopd eval --engine vllm` on tiny SFT'd agents,
`memopd audit --trajectories F --model M` on vLLM's own records, and the one-line refusal
of a model vLLM cannot serve."""
import json

import pytest

from memopd.cli import main


def test_train_three_steps_with_vllm_rollouts(sft_dirs, tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["train", f"student={sft_dirs[0]}", f"teacher={sft_dirs[1]}", f"run_dir={run}", "steps=3",
               "tasks_per_step=2", "group_size=2", "train_k=[1]", "eval_k=[1]", "eval_tasks=2", "ppo_epochs=1",
               "minibatches=2", "checkpoint_every=0", "progress=false", "rollout_engine=vllm",
               "mismatch_flatten=true", "rollout_is=tis", "rollout_is_cap=2.0"])
    assert rc == 0
    lines = [json.loads(x) for x in open(run / "metrics.jsonl")]
    steps = [x for x in lines if "train/pg_loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    for x in steps:
        # vLLM samples with the weights the trainer scores at: synced after every update
        assert x["mismatch/max_abs_dlogp"] <= 1e-4, x
        assert x["mismatch/k3_kl"] < 1e-8
        assert x["mismatch_flatten/max_abs_dlogp"] > x["mismatch/max_abs_dlogp"]
        assert 0.99 < x["train/rollout_is_weight_mean"] <= 1.0 + 1e-4
    print("\n" + json.dumps({k: v for k, v in steps[-1].items() if k.startswith("mismatch")}, indent=1))


def test_eval_and_audit_of_vllm_records(sft_dirs, tmp_path, capsys):
    traj = tmp_path / "vllm.jsonl"
    rc = main(["eval", sft_dirs[0], "--engine", "vllm", "--k", "1", "2", "--n", "3", "--temperature", "1.0",
               "--save-trajectories", str(traj)])
    assert rc == 0
    from memopd.records import load_trajectories

    trajs = load_trajectories(traj)
    assert len(trajs) == 6
    assert all(c["engine"] == "vllm" for tr in trajs for c in tr.info["sampling"]["calls"])
    capsys.readouterr()
    report = tmp_path / "audit.json"
    rc = main(["audit", "--trajectories", str(traj), "--model", sft_dirs[0], "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 0, out
    sampler = json.load(open(report))["sampler"]
    assert sampler["aligned"]["max_abs_dlogp"] <= 1e-4
    assert sampler["flatten"]["max_abs_dlogp"] > sampler["aligned"]["max_abs_dlogp"]
    assert "recorded sampling log-probs vs" in out


def test_refused_model_is_one_line(tmp_path):
    from memopd.env.vllm_engine import VLLMEngine, VLLMError
    from memopd.models import tiny_causal_lm

    lm = tiny_causal_lm("qwen2", vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1)  # head dim 16
    with pytest.raises(VLLMError) as e:
        VLLMEngine.from_model(lm, max_model_len=128)
    msg = str(e.value)
    assert "\n" not in msg and "vLLM refused the model" in msg and "head size is 16" in msg
