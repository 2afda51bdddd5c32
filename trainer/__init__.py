"""PPO + on-policy distillation trainer of memopd (installed as `memopd.trainer`).

The main names load on first use (they import transformers):
`TrainConfig` (config.py), `Trainer` / `train` / `prepare` (loop.py), `make_backend` /
`TrainBackend` (backend.py), `init_distributed` / `shutdown_distributed`
(collectives.py), `Actor` / `Critic` / `Scoring` (modules.py), `PPOSettings` / `ActorLossCoefs` (settings.py), `score` / `Scored`
(update.py), `gae` / `policy_loss` / `value_loss` / `token_rewards` / `whiten` (ppo.py),
`plot_run` (plot.py).
"""
from __future__ import annotations

import importlib

if __name__ == "trainer":  # the repository root is on sys.path: not memopd.trainer
    from memopd._root_names import hand_over

    hand_over(__name__, __path__[0], keep_if_missing=False)

_LAZY = {
    "TrainConfig": "config", "ARMS": "config", "ConfigError": "config",
    "Trainer": "loop", "train": "loop", "prepare": "loop",
    "make_backend": "backend", "TrainBackend": "backend",
    "init_distributed": "collectives", "shutdown_distributed": "collectives",
    "Actor": "modules", "ActorLossCoefs": "settings", "PPOSettings": "settings", "Critic": "modules", "Scoring": "modules",
    "score": "update", "Scored": "update", "PPOInputs": "modules",
    "gae": "ppo", "policy_loss": "ppo", "value_loss": "ppo", "token_rewards": "ppo", "whiten": "ppo",
    "plot_run": "plot",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
