"""The sampler-vs-trainer mismatch metric and the rollout_is correction in a real run (HF
rollouts, tiny SFT'd agents), and the one-line error for rollout_engine=vllm without vLLM."""
import importlib.util
import json

import pytest

from memopd.trainer.config import ConfigError, TrainConfig, check_requirements

pytestmark = pytest.mark.slow


def test_mismatch_logged_every_step_aligned_and_flatten(sft_dirs, tmp_path):
    from memopd.trainer.loop import train
    from memopd.trainer.plot import plot_run

    run = tmp_path / "run"
    cfg = TrainConfig(steps=2, run_dir=str(run), student=sft_dirs[0], teacher=sft_dirs[1], tasks_per_step=2, group_size=2,
                      train_k=[1], eval_k=[1], eval_tasks=2, ppo_epochs=1, minibatches=2, checkpoint_every=0,
                      progress=False, mismatch_flatten=True, rollout_is="mask", rollout_is_cap=2.0).validate()
    train(cfg, log=lambda *_: None)
    steps = [x for x in map(json.loads, open(run / "metrics.jsonl")) if "train/pg_loss" in x]
    assert len(steps) == 2
    for x in steps:
        # HFEngine samples in this process at the trainer's weights: the aligned layout restores its state
        assert x["mismatch/max_abs_dlogp"] < 1e-4 and x["mismatch/share_over_threshold"] == 0.0
        assert x["mismatch/k3_kl"] < 1e-8
        # the persistent history is another state: the same tokens, other log-probs
        assert x["mismatch_flatten/max_abs_dlogp"] > 1e-2
        assert x["mismatch_flatten/share_over_threshold"] > 0
        assert x["train/rollout_is_share_corrected"] == 0.0  # nothing to mask at a matching sampler
    assert plot_run(str(run))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_is_one_line(tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path / "r"), rollout_engine="vllm").validate()
    with pytest.raises(ConfigError) as e:
        check_requirements(cfg)
    assert "\n" not in str(e.value) and "vLLM is not installed" in str(e.value)
    with pytest.raises(ConfigError, match="rollout_engine must be one of"):
        TrainConfig(rollout_engine="sglang").validate()
    with pytest.raises(ConfigError, match="rollout_is must be one of"):
        TrainConfig(rollout_is="clip").validate()
    # the engine itself: one line, and no temporary model directory left behind
    import glob
    import tempfile

    from memopd.env.vllm_engine import VLLMEngine, VLLMError
    from memopd.models import tiny_causal_lm

    pattern = f"{tempfile.gettempdir()}/memopd-vllm-*"
    before = set(glob.glob(pattern))
    with pytest.raises(VLLMError, match="^vLLM is not installed"):
        VLLMEngine.from_model(tiny_causal_lm("qwen2", vocab_size=64))
    assert set(glob.glob(pattern)) == before
