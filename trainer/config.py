"""Run configuration: one dataclass, loadable from YAML, overridable from the CLI.

`TrainConfig.load(path, overrides=["steps=20", "arm=ppo", ...])` reads an optional YAML
file, then applies `key=value` overrides (values parsed as YAML scalars), and checks
every field. Unknown keys are errors, not silently ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from memopd.packing import ACTION_DOMAINS

__all__ = ["TrainConfig", "ARMS", "ConfigError"]

ARMS = ("ppo", "persistent", "memopd")


class ConfigError(ValueError):
    pass


@dataclass
class TrainConfig:
    # what to run
    arm: str = "memopd"  # ppo | persistent (teacher on flatten) | memopd (teacher on aligned)
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 40
    # models: checkpoint dirs; empty = SFT'd defaults from cache_dir (built if missing)
    student: str = ""
    teacher: str = ""
    cache_dir: str = ".memopd_cache"
    # environment
    world_seed: int = 0
    # questions per episode while training, cycled step by step (Q16 stays held out)
    train_k: list[int] = field(default_factory=lambda: [2, 8])
    eval_k: list[int] = field(default_factory=lambda: [2, 8, 16])
    eval_tasks: int = 32  # held-out question sets per k at the end
    policy: str = "summary"
    # loss domain: "exact" (the sampled action tokens) or "naive" (also re-encoded copies
    # of model output inside later contexts: the action-domain ablation)
    action_domain: str = "exact"
    # rollouts
    tasks_per_step: int = 4
    group_size: int = 4  # rollouts per task (share the prefix when packed)
    temperature: float = 1.0
    top_p: float = 1.0
    # optimisation
    ppo_epochs: int = 2
    minibatches: int = 2
    actor_lr: float = 2e-4
    critic_lr: float = 5e-4
    warmup_steps: int = 2
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.02  # reference-KL penalty folded into the rewards
    entropy_coef: float = 0.001  # alpha
    opd_coef: float = 1.0  # lambda (ignored by the ppo arm)
    max_tokens: int = 4096  # token budget of one micro-batch
    # run management
    checkpoint_every: int = 10
    eval_every: int = 0  # 0: only at the end
    tensorboard: bool = False
    deepspeed: str = ""  # path to a DeepSpeed JSON config: enables ZeRO
    progress: bool = True
    cpu_threads: int = 1  # torch threads on CPU: tiny models run fastest on one (0 = torch default)

    def validate(self) -> "TrainConfig":
        if self.arm not in ARMS:
            raise ConfigError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if self.action_domain not in ACTION_DOMAINS:
            raise ConfigError(f"action_domain must be one of {', '.join(ACTION_DOMAINS)}, got {self.action_domain!r}")
        for name in ("steps", "tasks_per_step", "group_size", "ppo_epochs", "minibatches", "max_tokens", "eval_tasks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.minibatches > self.tasks_per_step * self.group_size:
            raise ConfigError(
                f"minibatches ({self.minibatches}) exceeds the trajectories per step "
                f"({self.tasks_per_step} tasks x {self.group_size} rollouts)"
            )
        for name in ("actor_lr", "critic_lr"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError("gamma and lam must be in [0, 1]")
        if self.checkpoint_every < 0 or self.eval_every < 0:
            raise ConfigError("checkpoint_every and eval_every must be >= 0")
        if not self.train_k or any(k < 1 for k in self.train_k + self.eval_k):
            raise ConfigError("train_k / eval_k must be non-empty lists of positive integers")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known: {', '.join(sorted(names))}")
        return cls(**d).validate()

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | None = None) -> "TrainConfig":
        d: dict[str, Any] = {}
        if path:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: a config file must hold a mapping of keys to values")
            d.update(loaded)
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value")
            key, raw = item.split("=", 1)
            key = key.strip().replace("-", "_")
            if key not in types:
                raise ConfigError(f"unknown config key {key!r} in override {item!r}")
            value = yaml.safe_load(raw) if raw != "" else ""
            if "list" in str(types[key]) and isinstance(value, int):
                value = [value]
            if str(types[key]) == "str" and value is not None and not isinstance(value, str):
                value = str(raw)
            if str(types[key]) == "float" and not isinstance(value, bool):
                try:  # YAML 1.1 reads "1e-4" as a string
                    value = float(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"{key} must be a number, got {raw!r}") from None
            if str(types[key]) == "int" and isinstance(value, str):
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
            d[key] = value
        return cls.from_dict(d)
