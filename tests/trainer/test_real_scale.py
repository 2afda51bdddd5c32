"""Defects that only real model pairs on GPUs would show, reproduced with tiny analogs on CPU.

- Collectives under NCCL: a default process group that serves CUDA tensors only
  ("cuda:gloo" on CPU has NCCL's device coverage); a two-rank `train_step` must run and
  equal one process.
- Student and teacher heads of different row counts, both larger than the tokenizer
  (Qwen2.5-3B: 151,936 rows, 7B: 152,064, tokenizer: 151,665 ids), with the padded rows
  made attractive: the sampler never emits them, the PPO ratio of the unchanged policy
  is 1 (clip fraction 0) and the teacher KL equals a float64 reference over the
  tokenizer's ids.
- Sampling temperature: every log-prob is at the sampling temperature, a mismatch is
  refused or shows in `rce/max_dlogp_vs_sampling`, top_p < 1 is refused.
- Heads that are not a plain h @ W.T: a teacher with an lm_head bias and a logit scale
  (Cohere), a student whose logits are divided by a constant (Granite), and Gemma-2's
  soft-capping refused by name.
"""
import copy
import sys

import pytest
import torch
from _launch import REPO, run_worker

from memopd import pack
from memopd.errors import UserError
from memopd.hf import HeadError, head_of, packed_forward
from memopd.trainer.config import ConfigError, TrainConfig
from memopd.trainer.settings import PPOSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPERATURE = 0.7
STUDENT_SCALE = 0.25  # Granite: logits / logits_scaling (4)
TEACHER_SCALE = 0.5  # Cohere: logits * logit_scale


# ---------------------------------------------------------------- 1. NCCL-like groups


def test_two_rank_step_on_a_cuda_only_default_group(tmp_path):
    worker = str(REPO / "tests" / "_dist_worker_trainer.py")
    run_worker([sys.executable, worker, str(tmp_path / "one"), "exact", "plain"])
    run_worker([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                worker, str(tmp_path / "two"), "exact", "plain"],
               extra_env={"MEMOPD_TEST_PROCESS_GROUP": "cuda:gloo"})
    one = torch.load(tmp_path / "one" / "plain_exact.pt", weights_only=False)
    two = torch.load(tmp_path / "two" / "plain_exact.pt", weights_only=False)
    assert two["world_size"] == 2
    for k, ref in one["actor"].items():
        torch.testing.assert_close(two["actor"][k], ref, rtol=1e-4, atol=1e-4, msg=k)
    for step in (0, 1):
        for k in ("train/pg_loss", "train/kl_teacher", "rollout/action_tokens", "train/first_ratio_maxdev"):
            assert two["metrics"][step][k] == pytest.approx(one["metrics"][step][k], rel=1e-4, abs=1e-6), k


# ------------------------------------------------- 2-4. vocabularies, temperature, heads


def _env():
    from memopd.env import EnvConfig, QAEnv, World, WorldConfig, build_tokenizer

    world = World.generate(WorldConfig(seed=0))
    tok = build_tokenizer(world.vocabulary_texts(), kind="word")
    return world, QAEnv.from_world(world, tok, EnvConfig())


def _student(rows: int, vocab: int):
    """A Granite (logits / 4) whose padded rows >= vocab would take most of the mass."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("granite", vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                               logits_scaling=1 / STUDENT_SCALE, tie_word_embeddings=False)
    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        m.lm_head.weight[vocab:] *= 40.0
    return m


def _teacher(rows: int, vocab: int):
    """A Cohere (logits * 0.5) with an lm_head bias and attractive padded rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("cohere", vocab_size=rows, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, initializer_range=0.2,
                               logit_scale=TEACHER_SCALE, tie_word_embeddings=False)
    torch.manual_seed(2)
    m = AutoModelForCausalLM.from_config(cfg)
    head = torch.nn.Linear(48, rows, bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.weight[vocab:] *= 40.0
        head.bias.normal_(0.0, 2.0)
    m.lm_head = head
    return m


def _reference_kl(student0, teacher, trajs, vocab):
    """Float64 reverse KL over the tokenizer's ids at the sampling temperature, teacher
    bias and both scales included, averaged over the teacher-masked entries."""
    batch = pack(trajs, layout="aligned", share_prefix="group")
    with torch.no_grad():
        return _reference_kl_nograd(student0, teacher, batch, vocab)


def _reference_kl_nograd(student0, teacher, batch, vocab):
    hs = packed_forward(student0, batch, output="hidden").double()
    ht = packed_forward(teacher, batch, output="hidden").double()
    ws = student0.lm_head.weight.double()[:vocab]
    wt, bt = teacher.lm_head.weight.double()[:vocab], teacher.lm_head.bias.double()[:vocab]
    ls = torch.log_softmax(hs @ ws.T * STUDENT_SCALE / TEMPERATURE, -1)
    lt = torch.log_softmax((ht @ wt.T + bt) * TEACHER_SCALE / TEMPERATURE, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    m = batch.teacher_mask.double()
    return float((kl * m).sum() / m.sum()), ls, batch


@pytest.mark.parametrize("extra", [(40, 9), (9, 40)], ids=["student_rows_gt_teacher", "student_rows_lt_teacher"])
def test_mismatched_heads_temperature_bias_and_scale(tmp_path, extra):
    from memopd.trainer.loop import Trainer

    world, env = _env()
    vocab = len(env.tokenizer)
    student = _student(vocab + extra[0], vocab)
    teacher = _teacher(vocab + extra[1], vocab)
    student0 = copy.deepcopy(student)
    cfg = TrainConfig(arm="memopd", steps=1, tasks_per_step=3, group_size=2, train_k=[1], ppo_epochs=1,
                      minibatches=1, temperature=TEMPERATURE, ppo=PPOSettings(ref_kl_coef=0.05), checkpoint_every=0, progress=False,
                      run_dir=str(tmp_path)).validate()
    seen = {}

    class Recording(Trainer):
        def rollout(self, step, actor):
            seen["trajs"], k = super().rollout(step, actor)
            return seen["trajs"], k

    tr = Recording(cfg, student_lm=student, teacher_lm=teacher, env=env, tasks=world, log=lambda *_: None)
    assert tr.scoring.vocab_size == vocab and head_of(teacher).bias is not None
    m = tr.train_step(0)
    trajs = seen["trajs"]
    ids = [x for t in trajs for inv in t.invocations for x in inv.action_ids]
    assert ids and max(ids) < vocab  # the padded rows are never sampled ...
    ref_kl, ls, batch = _reference_kl(student0, teacher, trajs, vocab)
    with torch.no_grad():  # ... although unmasked they would hold most of the mass
        full = torch.softmax(packed_forward(student0, batch, output="logits").double() / TEMPERATURE, -1)
    assert float(full[:, vocab:].sum(-1).mean()) > 0.5
    settings = {"temperature": TEMPERATURE, "top_p": 1.0, "vocab_size": vocab}
    assert all({k: t.info["sampling"][k] for k in settings} == settings for t in trajs)
    # and each call's own settings, so a rollout can be replayed (memopd.recording)
    assert all(len(t.info["sampling"]["calls"]) == len(t.invocations) for t in trajs)
    # recorded sampling log-probs == training log-probs (RCE in training), ratio 1, no clipping
    assert m["rce/max_dlogp_vs_sampling"] < 1e-5
    assert m["train/first_ratio_maxdev"] < 1e-5
    assert m["train/clip_frac"] == 0.0
    assert m["train/kl_teacher"] == pytest.approx(ref_kl, rel=1e-4)
    # and the recorded log-probs are the float64 reference's at the sampled ids
    recorded = batch.sample_logprobs.double()
    expect = ls.gather(1, batch.target_ids[:, None])[:, 0]
    torch.testing.assert_close(recorded, expect, atol=2e-5, rtol=0)


def test_temperature_mismatch_is_refused_or_measured(tmp_path):
    from memopd.env.rollout import HFEngine, rollout
    from memopd.trainer.modules import Actor, Critic, Scoring
    from memopd.trainer.update import score

    world, env = _env()
    vocab = len(env.tokenizer)
    student = _student(vocab + 3, vocab)
    tasks = world.sample_tasks(1, 2, split="train", seed=0)
    with torch.no_grad():
        trajs = rollout(env, HFEngine(student, pad_id=env.tokens.pad, vocab_size=vocab), tasks, group_size=2,
                        temperature=TEMPERATURE, seed=0)
    kw = dict(teacher_layout=None, max_tokens=4096, ppo=PPOSettings(ref_kl_coef=0.0, gamma=1.0, lam=0.95))
    critic = Critic(copy.deepcopy(student))
    at = lambda t: Actor(student, scoring=Scoring(t, vocab))  # noqa: E731
    assert score(at(TEMPERATURE), critic, None, None, trajs, **kw).sample_dlogp < 1e-5
    with pytest.raises(UserError, match="temperature 0.7.*temperature=1.0"):
        score(at(1.0), critic, None, None, trajs, **kw)
    for t in trajs:  # an engine that does not record its settings: the RCE metric catches it
        del t.info["sampling"]
    assert score(at(1.0), critic, None, None, trajs, **kw).sample_dlogp > 0.05
    with pytest.raises(ConfigError, match="top_p"):
        TrainConfig(top_p=0.9).validate()
    with pytest.raises(ConfigError, match="temperature"):
        TrainConfig(temperature=0.0).validate()


def test_sampled_id_outside_the_scored_vocabulary_is_refused(tmp_path):
    from memopd.memory import random_trajectories
    from memopd.trainer.modules import Actor, Critic, Scoring
    from memopd.trainer.update import score

    student = _student(100, 90)
    trajs = random_trajectories("summary", 2, vocab_size=90, seed=0, calls=(2, 3))
    trajs[1].invocations[0].action_ids[0] = 95  # a padded row: a teacher of 90 ids cannot score it
    with pytest.raises(UserError, match=r"trajectory 1 .*call 0: sampled id\(s\) \[95\] outside the scored "
                                        r"vocabulary \[0, 90\)"):
        score(Actor(student, scoring=Scoring(1.0, 90)), Critic(student), None, None, trajs, teacher_layout=None,
              max_tokens=4096, ppo=PPOSettings(ref_kl_coef=0.0, gamma=1.0, lam=0.95))


def test_vocab_larger_than_a_head_is_a_config_error():
    from memopd.trainer.loop import resolve_vocab_size

    cfg = TrainConfig(vocab_size=120).validate()
    with pytest.raises(ConfigError, match="vocab_size=120 .* teacher lm_head's 110 rows"):
        resolve_vocab_size(cfg, None, _student(130, 100), _teacher(110, 100))


def test_softcapped_logits_are_refused_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               final_logit_softcapping=30.0)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(HeadError, match="model_type='gemma2'.*non-linear.*final_logit_softcapping=30.0"):
        head_of(model)
    cfg.final_logit_softcapping = None  # without soft-capping it is a plain linear head
    assert head_of(AutoModelForCausalLM.from_config(cfg)).scale == 1.0


def test_measured_scales_of_scaled_heads():
    s, t = _student(50, 50), _teacher(50, 50)
    assert head_of(s).scale == STUDENT_SCALE and head_of(t).scale == TEACHER_SCALE
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():  # packed logits reproduce the model's own logits
        for m in (s, t):
            from memopd.hf import independent_forward

            h = independent_forward(m, ids[0], output="hidden")
            torch.testing.assert_close(head_of(m).logits(h), m(input_ids=ids).logits[0], atol=1e-5, rtol=1e-5)
