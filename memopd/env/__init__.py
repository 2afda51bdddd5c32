"""Agent environment for compact-memory LLM agents (docs/design.md §10).

Modules:
- `world`: the generated default world (entities, attributes, relations), its corpus
  and single/two-hop question sets, deterministic from a seed;
- `data`: `Document` / `Task` records and the user JSONL loaders;
- `tasks`: `UserTasks`, user question sets behind the `World.sample_tasks` interface;
- `retriever`: BM25 search (`bm25s`) over a corpus;
- `protocol`: tags, task prefix, action parsing, answer splitting;
- `tokenizer`: the local HF tokenizer (Qwen2-compatible byte-level BPE: one token per
  world word, or an open BPE for user corpora);
- `qa`: `QAEnv` / `Episode`: exact per-call state, memory policy, rewards;
- `metrics`: EM / token F1;
- `rollout`: the `Engine`, `Environment` and `TaskSource` protocols, `HFEngine`,
  `rollout()` recording `Trajectory`s;
- `build`: `EnvSpec` (a run config's environment section) and `build_environment`, which
  turns it into an `EnvironmentBundle` (models, environment, task source, tokenizer);
- `expert`: the scripted expert (an `Engine`);
- `sft`: tiny teacher / student models and their supervised training;
- `evaluate`: held-out evaluation; `cli`: `sft_main` / `eval_main`.
"""
from __future__ import annotations

from .build import EnvironmentBundle, EnvSpec, build_environment
from .data import DataError, Document, Task, load_corpus_jsonl, load_tasks_jsonl, save_corpus_jsonl, save_tasks_jsonl
from .expert import ScriptedExpert, expert_action_text, expert_trajectories
from .metrics import exact_match, f1_score, normalize_answer, score_answers
from .protocol import ParsedAction, ProtocolError, ProtocolTokens, parse_action, prefix_text, split_answers
from .qa import EnvConfig, Episode, QAEnv, StepResult
from .retriever import BM25Retriever
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
from .tasks import UserTasks
from .tokenizer import SPECIAL_TOKENS, build_tokenizer, load_tokenizer
from .world import World, WorldConfig

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

        return importlib.import_module(f"memopd.env.{name}")
    raise AttributeError(f"module 'memopd.env' has no attribute {name!r}")
