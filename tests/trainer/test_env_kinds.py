"""A second kind of environment trains through `memopd train`'s own code path, registered
by one line (`memopd.env.build.register_env_kind`): the trainer reaches the environment
only through the bundle (rollouts, held-out evaluation, saved metadata, baseline key).

The environment here is not QA: a *copy* task with a compact memory. The task prefix is
[BOS, target]; each call the agent writes up to a few ids and a stop id; the context of
the next call holds only the previous call's last action id (the memory keeps one id
and drops the rest); the reward is the share of written ids equal to the target.
Stored configs without `env.kind` are QA runs, and stay the same config.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import pytest
import torch

from memopd.env.build import ENV_KINDS, EnvironmentBundle, EnvKind, EnvSpec, register_env_kind
from memopd.env.rollout import Environment, EnvTokens, HFEngine, rollout
from memopd.records import Invocation, Trajectory

pytest.importorskip("transformers")

PAD, BOS, STOP = 0, 1, 2
DIGITS = tuple(range(3, 11))  # the ids a target may be
VOCAB = 12
CALLS = 2  # calls per episode


@dataclass
class CopyTask:
    task_id: str
    target: int
    k: int = 1  # sizes the default action budget (24 + 5k ids)


class CopyTokens(EnvTokens):
    stop_ids = (STOP,)
    pad = PAD


class CopyTokenizer:
    """The environment's tokenizer: its size bounds the sampled ids; saved with a model."""

    def __len__(self) -> int:
        return VOCAB

    def save_pretrained(self, out_dir: str) -> None:
        with open(f"{out_dir}/copy_tokenizer.json", "w") as f:
            json.dump({"vocab_size": VOCAB, "pad": PAD, "bos": BOS, "stop": STOP}, f)


class CopyEpisode:
    def __init__(self, task: CopyTask, group_id: str):
        self.task, self.group_id = task, group_id
        self.done, self.invocations, self.rollout_index = False, [], 0
        self.memory: list[int] = []  # the compact memory: the last id of the previous action

    def prompt_ids(self) -> list[int]:
        return [BOS, self.task.target] + self.memory

    def step(self, action_ids, logprobs):
        self.invocations.append(Invocation(prefix_ids=[BOS, self.task.target], context_ids=list(self.memory),
                                           action_ids=list(action_ids), sample_logprobs=logprobs))
        written = [i for i in action_ids if i != STOP]
        self.memory = written[-1:]
        self.done = len(self.invocations) == CALLS

    def stop(self, reason):
        self.done = True

    def trajectory(self) -> Trajectory:
        written = [i for inv in self.invocations for i in inv.action_ids if i != STOP]
        reward = sum(i == self.task.target for i in written) / max(len(written), 1)
        return Trajectory(invocations=self.invocations, reward=float(reward), task_id=self.task.task_id,
                          group_id=self.group_id)


class CopyEnv(Environment):
    tokens = CopyTokens()
    tokenizer = CopyTokenizer()

    def reset(self, task, *, group_id=None):
        return CopyEpisode(task, group_id or "")


class CopyTasks:
    def sample_tasks(self, k, n, *, split="train", seed=0):
        rng = random.Random(f"{split}-{seed}")
        return [CopyTask(f"{split}{seed}-{i}", rng.choice(DIGITS), k=1) for i in range(n)]


def build_copy(spec: EnvSpec, *, student, teacher, load_teacher, evaluation, log, **_):
    """The copy task's builder: the models from their directories, no SFT stage."""
    from memopd.models import load_local_model

    env, tasks = CopyEnv(), CopyTasks()
    student_lm = load_local_model(student, what="student", dtype=torch.float32)
    teacher_lm = load_local_model(teacher, what="teacher", dtype=torch.float32) if load_teacher else None

    def evaluate(model_dir: str) -> dict:
        lm = load_local_model(model_dir, what="model", dtype=torch.float32).eval()
        trajs = rollout(env, HFEngine(lm, pad_id=PAD, vocab_size=VOCAB), tasks.sample_tasks(1, evaluation["n"], split="eval"),
                        temperature=0.0)
        mean = sum(t.reward for t in trajs) / len(trajs)
        return {"results": {"COPY": {"reward_mean": mean}}, "table": f"copy: reward {mean:.3f} on {len(trajs)} tasks"}

    def save_meta(model_dir: str, role: str) -> None:
        with open(f"{model_dir}/copy_env.json", "w") as f:
            json.dump({"kind": spec.kind, "role": role, "calls": CALLS}, f)

    return EnvironmentBundle(student_lm, teacher_lm, env, tasks, env.tokenizer, student, teacher, evaluate=evaluate,
                             save_meta=save_meta)


@pytest.fixture
def copy_kind():
    register_env_kind("copy", EnvKind(build=build_copy))  # the one registry line of a new environment
    yield
    ENV_KINDS.pop("copy", None)


def _model_dir(path, seed: int) -> str:
    from memopd.models import tiny_causal_lm

    lm = tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        max_positions=128, initializer_range=0.2, pad_token_id=PAD, bos_token_id=BOS,
                        eos_token_id=STOP, seed=seed)
    lm.save_pretrained(path)
    return str(path)


def test_a_second_environment_trains_through_memopd_train(copy_kind, tmp_path):
    from memopd.models import load_local_model
    from memopd.trainer.cli import train_main

    student, teacher = _model_dir(tmp_path / "student", 1), _model_dir(tmp_path / "teacher", 2)
    run = tmp_path / "run"
    argv = ["env.kind=copy", f"student={student}", f"teacher={teacher}", f"run_dir={run}", "steps=2", "train_k=[1]",
            "eval_k=[1]", "eval_tasks=3", "tasks_per_step=2", "group_size=2", "ppo_epochs=1", "minibatches=1",
            "checkpoint_every=1", "progress=false"]
    assert train_main(argv) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "rollout/reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(v) for m in steps for v in m.values() if isinstance(v, float) and not math.isnan(v))
    # the environment's own evaluation at step 0 and at the end, as the run's eval lines
    evals = [m for m in lines if "eval/reward_mean_copy" in m]
    assert [m["step"] for m in evals] == [0, 2]
    report = json.loads((run / "report.json").read_text())
    assert set(report["eval"]) == {"COPY"} and set(report["baseline_eval"]) == {"COPY"}
    # the saved model carries the environment's tokenizer and metadata, and training moved it
    final = run / "final"
    assert json.loads((final / "copy_env.json").read_text()) == {"kind": "copy", "role": "student+memopd", "calls": CALLS}
    assert json.loads((final / "copy_tokenizer.json").read_text())["vocab_size"] == VOCAB
    before = load_local_model(student, dtype=torch.float32).state_dict()
    after = load_local_model(str(final), dtype=torch.float32).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the kind is stored with the run and read back: the run resumes under the same config
    stored = (run / "config.yaml").read_text()
    assert "kind: copy" in stored
    assert train_main([*[a for a in argv if not a.startswith("steps=")], "steps=3", "--resume"]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "rollout/reward_mean" in m] == [1, 2, 3]


def test_an_unknown_kind_is_one_line_naming_the_known_ones():
    from memopd.trainer.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"env.kind='nope': no such environment; known: .*qa"):
        TrainConfig.load(None, ["env.kind=nope"])


def test_stored_configs_without_a_kind_are_qa_runs():
    """A stored config of before the key (no `kind`, in the nested or the old flat form)
    reads back as a QA run equal to a new one, and compares equal to it."""
    from memopd.trainer.config import TrainConfig, comparable_config
    from memopd.trainer.rundir import config_differences

    d = TrainConfig().to_dict()
    assert d["env"]["kind"] == "qa"
    assert TrainConfig.load(None, ["env.kind=qa"]).to_dict() == d
    del d["env"]["kind"]
    assert TrainConfig.from_dict(d).env.kind == "qa"
    flat = {k: v for k, v in d.items() if k != "env"} | d["env"]
    assert TrainConfig.from_dict(flat).env.kind == "qa"
    new = comparable_config(TrainConfig.load(None, ["kind=qa"]).to_dict())
    defaults = comparable_config(TrainConfig().to_dict())
    assert config_differences(comparable_config(d), new, defaults) == []
    assert config_differences(comparable_config(flat), new, defaults) == []
