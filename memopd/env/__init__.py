"""Agent environments for compact-memory LLM agents: the contract and its registry (docs/design.md §10).

Modules:
- `rollout`: the `Engine`, `Environment` and `TaskSource` protocols, `HFEngine`,
  `rollout()` recording `Trajectory`s; `vllm_engine`: the vLLM `Engine`;
- `build`: `EnvSpec` (a run config's environment section), the `{kind: builder}`
  registry and `build_environment`, which turns a spec into an `EnvironmentBundle`
  (models, environment, task source, tokenizer);
- `cli`: `sft_main` / `eval_main`;
- `qa/`: the embedded retrieval-QA world (world, corpus, protocol, tokenizer, `QAEnv`,
  experts, SFT, evaluation), whose public names are re-exported here.
"""
from __future__ import annotations

from .build import EnvironmentBundle, EnvSpec, build_environment
from .qa.data import DataError, Document, Task, load_corpus_jsonl, load_tasks_jsonl, save_corpus_jsonl, save_tasks_jsonl
from .qa.env import EnvConfig, Episode, QAEnv, StepResult
from .qa.expert import ScriptedExpert, expert_action_text, expert_trajectories
from .qa.metrics import exact_match, f1_score, normalize_answer, score_answers
from .qa.protocol import ParsedAction, ProtocolError, ProtocolTokens, parse_action, prefix_text, split_answers
from .qa.retriever import BM25Retriever
from .qa.tasks import UserTasks
from .qa.tokenizer import SPECIAL_TOKENS, build_tokenizer, load_tokenizer
from .qa.world import World, WorldConfig
from .rollout import (
    Engine,
    EnvEpisode,
    Environment,
    EnvTokens,
    HFEngine,
    Sample,
    TaskSource,
    default_max_new_tokens,
    rollout,
    sample_next,
)

__all__ = [
    "DataError", "Document", "Task", "load_corpus_jsonl", "load_tasks_jsonl", "save_corpus_jsonl", "save_tasks_jsonl",
    "ScriptedExpert", "expert_action_text", "expert_trajectories",
    "exact_match", "f1_score", "normalize_answer", "score_answers",
    "ParsedAction", "ProtocolError", "ProtocolTokens", "parse_action", "prefix_text", "split_answers",
    "EnvConfig", "Episode", "QAEnv", "StepResult",
    "BM25Retriever",
    "Engine", "HFEngine", "Sample", "default_max_new_tokens", "rollout", "sample_next",
    "Environment", "EnvEpisode", "EnvTokens", "TaskSource", "EnvSpec", "EnvironmentBundle", "build_environment",
    "UserTasks",
    "SPECIAL_TOKENS", "build_tokenizer", "load_tokenizer",
    "World", "WorldConfig",
]


def __getattr__(name: str):
    # Training / evaluation pull in transformers models; load them on first use only.
    if name in ("sft", "evaluate", "cli"):
        import importlib

        return importlib.import_module(f"memopd.env.qa.{name}" if name != "cli" else "memopd.env.cli")
    raise AttributeError(f"module 'memopd.env' has no attribute {name!r}")
