"""The retrieval-QA world: memopd's embedded default environment (docs/design.md §10).

One environment behind the contract of `memopd.env` (`memopd/env/rollout.py`'s
`Environment` / `TaskSource`, built by `memopd/env/build.py`'s registry):

- `world`: the generated world (entities, attributes, relations), its corpus and its
  single/two-hop question sets, deterministic from a seed;
- `notes`: the world's text grammar (questions, facts, the agent's notes) that the world,
  its experts and the experiments read;
- `data`: `Document` / `Task` records and the user JSONL loaders; `tasks`: `UserTasks`;
- `retriever`: BM25 search; `protocol`: tags, task prefix, action parsing;
- `tokenizer`: the local HF tokenizer; `env`: `QAEnv` / `Episode` (exact per-call state,
  memory policy, rewards); `metrics`: EM / token F1;
- `expert`: the scripted and rational experts (`Engine`s); `sft`: the tiny teacher /
  student and their supervised training; `evaluate`: held-out EM/F1 evaluation.
"""
from __future__ import annotations

from .env import EnvConfig, Episode, QAEnv, StepResult

__all__ = ["EnvConfig", "Episode", "QAEnv", "StepResult"]
