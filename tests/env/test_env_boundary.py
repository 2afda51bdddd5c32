"""The environment boundary: the `Environment` / `TaskSource` protocols, a custom environment
driven by `rollout`, the nested `env` section of `TrainConfig` (flat keys still read), and
memopd.env importing nothing of the trainer."""
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from memopd.env.rollout import EnvEpisode, Environment, EnvTokens, Sample, TaskSource, default_max_new_tokens, rollout
from memopd.records import Invocation, Trajectory


def _qa_env():
    from memopd.env import QAEnv, World, WorldConfig, build_tokenizer

    world = World.generate(WorldConfig())
    return QAEnv.from_world(world, build_tokenizer(world.vocabulary_texts(), kind="word")), world


def test_the_embedded_environment_satisfies_the_protocols(tmp_path):
    from memopd.env import Task, UserTasks, save_tasks_jsonl

    env, world = _qa_env()
    assert isinstance(env, Environment) and isinstance(env.tokens, EnvTokens)
    assert isinstance(world, TaskSource)
    assert isinstance(env.reset(world.sample_tasks(2, 1)[0], group_id="g"), EnvEpisode)
    save_tasks_jsonl(tmp_path / "t.jsonl", [Task("t0", ["q a ?", "q b ?"], [["a"], ["b"]])])
    from memopd.env import load_tasks_jsonl

    assert isinstance(UserTasks(load_tasks_jsonl(tmp_path / "t.jsonl")), TaskSource)
    assert not isinstance(object(), Environment) and not isinstance(object(), TaskSource)


# ---- a minimal custom environment: what "Adding an environment" in docs/design.md describes
@dataclass
class _CountTask:
    task_id: str
    k: int = 1


class _CountTokens(EnvTokens):
    stop_ids = (9,)
    pad = 0  # extra_tag_tokens: the protocol's default


class _CountEpisode:
    """Two calls: the context is the previous action; the reward counts sampled 7s."""

    def __init__(self, task, group_id):
        self.task, self.group_id = task, group_id
        self.done, self.invocations, self.rollout_index = False, [], 0
        self._context: list[int] = []

    def prompt_ids(self):
        return [5, 6] + self._context

    def step(self, action_ids, logprobs):
        self.invocations.append(Invocation(prefix_ids=[5, 6], context_ids=list(self._context),
                                           action_ids=list(action_ids), sample_logprobs=logprobs))
        self._context = list(action_ids)
        self.done = len(self.invocations) == 2

    def stop(self, reason):
        self.done = True

    def trajectory(self):
        sevens = sum(inv.action_ids.count(7) for inv in self.invocations)
        return Trajectory(invocations=self.invocations, reward=float(sevens), task_id=self.task.task_id,
                          group_id=self.group_id)


class _CountEnv(Environment):
    tokens = _CountTokens()
    tokenizer = None  # answer_words: the protocol's default

    def reset(self, task, *, group_id=None):
        return _CountEpisode(task, group_id or "")


class _ScriptedEngine:
    def __init__(self):
        self.limits = []

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, stop_ids, seed=None):
        self.limits.append(list(max_new_tokens))
        return [Sample([7, 7, 9], [-0.1, -0.2, -0.3]) for _ in prompts]


def test_a_custom_environment_runs_a_rollout():
    env, engine = _CountEnv(), _ScriptedEngine()
    assert isinstance(env, Environment) and env.answer_words == 1 and env.tokens.extra_tag_tokens == 0
    trajs = rollout(env, engine, [_CountTask("a"), _CountTask("b")], group_size=2, group_prefix="s0-")
    assert [t.task_id for t in trajs] == ["a", "a", "b", "b"]
    assert [t.info["rollout_index"] for t in trajs] == [0, 1, 0, 1] and trajs[0].group_id == "s0-a"
    assert all(len(t) == 2 and t.reward == 4.0 for t in trajs)
    assert trajs[0].invocations[1].context_ids == [7, 7, 9]  # the episode's own memory, not QAEnv's
    # the call budget comes from the declared defaults (one-word answers, one id per tag)
    assert engine.limits == [[default_max_new_tokens(1, 1)] * 4] * 2


# ---- the nested env section of TrainConfig
def test_env_section_nested_and_flat_keys_are_the_same_config(tmp_path):
    from memopd.env.build import EnvSpec
    from memopd.trainer.config import TrainConfig

    nested = TrainConfig.load(None, ["env.policy=full", "env.world_seed=3", "steps=2"])
    flat = TrainConfig.load(None, ["policy=full", "world_seed=3", "steps=2"])
    assert nested == flat and nested.env.policy == "full"
    assert TrainConfig(env=EnvSpec(policy="full", world_seed=3), steps=2) == flat
    f = tmp_path / "c.yaml"
    f.write_text("steps: 2\nenv:\n  policy: full\n  world_seed: 3\n")
    assert TrainConfig.load(str(f)) == flat
    f.write_text("steps: 2\npolicy: full\nworld_seed: 3\n")  # a config file of before the section
    assert TrainConfig.load(str(f)) == flat


def test_env_section_defaults_and_nested_dict():
    """to_dict is the stored format (config.yaml, manifests, reports): nested, the
    environment's keys under env with their defaults unchanged; it reads back equal."""
    from memopd.trainer.config import TrainConfig

    d = TrainConfig().to_dict()
    assert d["env"] == {"corpus": "", "tasks": "", "eval_tasks_file": "", "tokenizer": "", "world": "default",
                        "world_seed": 0, "policy": "summary", "policy_kwargs": {}, "kind": "qa"}
    assert not {"policy", "world", "corpus", "kl_coef", "opd_coef", "clip_eps"} & set(d)
    assert TrainConfig.from_dict(d) == TrainConfig()


def test_a_stored_flat_config_resumes_and_compares():
    """A config.yaml written before the section (flat, no policy_kwargs) matches a new run
    of the same settings, and a changed environment key is still reported by its name."""
    from memopd.trainer.config import TrainConfig, comparable_config
    from memopd.trainer.rundir import check_resume_config, config_differences

    nested = TrainConfig.load(None, ["env.policy=full"]).to_dict()
    old = {k: v for k, v in nested.items() if k != "env"} | {
        k: v for k, v in nested["env"].items() if k not in ("policy_kwargs", "kind")}
    new = comparable_config(nested)
    old, defaults = comparable_config(old), comparable_config(TrainConfig().to_dict())
    assert config_differences(old, new, defaults) == []
    assert check_resume_config(old, new, source="config.yaml", defaults=defaults) == []
    changed = comparable_config(TrainConfig.load(None, ["env.policy=summary"]).to_dict())
    assert config_differences(old, changed, defaults) == [("env.policy", "full", "summary")]


def test_env_section_errors_name_the_key(tmp_path):
    from memopd.trainer.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"unknown config key 'env.nope'"):
        TrainConfig.load(None, ["env.nope=1"])
    with pytest.raises(ConfigError, match=r"override 'env.world_seed=x': world_seed must be an integer"):
        TrainConfig.load(None, ["env.world_seed=x"])
    with pytest.raises(ConfigError, match=r"policy must be one of"):
        TrainConfig.load(None, ["env.policy=nope"])
    with pytest.raises(ConfigError, match=r"policy='window' with policy_kwargs=\{'bogus': 2\}: .*bogus"):
        TrainConfig.load(None, ["policy=window", "env.policy_kwargs={bogus: 2}"])
    assert TrainConfig.load(None, ["policy=window", "env.policy_kwargs={turns: 3}"]).env.policy_kwargs == {"turns": 3}
    f = tmp_path / "c.yaml"
    f.write_text("policy: full\nenv:\n  policy: summary\n")
    with pytest.raises(ConfigError, match=r"policy and env.policy are the same key given twice; keep one"):
        TrainConfig.load(str(f))
    f.write_text("env: full\n")
    with pytest.raises(ConfigError, match=r"env must be a mapping of world, world_seed"):
        TrainConfig.load(str(f))


def test_config_copies_do_not_share_their_env_section():
    import dataclasses

    from memopd.trainer.config import TrainConfig

    a = TrainConfig()
    b = dataclasses.replace(a, steps=5)
    b.env.policy = "full"
    assert (a.env.policy, b.env.policy) == ("summary", "full")


# ---- the dependency direction
def test_memopd_env_imports_nothing_of_the_trainer():
    code = (
        "import importlib, pkgutil, sys, json\n"
        "import memopd.env\n"
        "for m in pkgutil.iter_modules(memopd.env.__path__):\n"
        "    importlib.import_module('memopd.env.' + m.name)\n"
        "import memopd.files\n"
        "print(json.dumps(sorted(n for n in sys.modules if n == 'trainer' or n.startswith(('trainer.', "
        "'memopd.trainer')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
