"""The environment of a training run, from its config section to the objects a trainer drives.

`EnvSpec` is the environment/data section of a run's config (`TrainConfig.env`): which
kind of environment (`kind`, a key of `ENV_KINDS`), which world or user data, which
tokenizer, which memory policy and its parameters. `build_environment(spec, student=,
teacher=, ...)` hands it to the builder registered for its kind, which returns one
`EnvironmentBundle`: the loaded student and teacher, the `Environment`, the `TaskSource`
the trainer samples task sets from, the tokenizer, and what the run needs of the
environment beyond rollouts (held-out evaluation, the metadata saved with a model, the
key of a cached step-0 evaluation).

`ENV_KINDS` maps a kind to its builder ("module:NAME" of an `EnvKind`, imported on first
use); a new environment is its own module plus one entry here (or one
`register_env_kind` call). The embedded kind "qa" is the retrieval-QA world
(memopd/env/qa/build.py).

Nothing here imports the trainer: the trainer builds on this module, not the reverse.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from memopd.errors import UserError

from .rollout import Environment, TaskSource

__all__ = ["EnvSpec", "EnvironmentBundle", "EnvKind", "ENV_KINDS", "register_env_kind", "env_kind", "build_environment",
           "ENV_SPEC_FIELDS"]


@dataclass
class EnvSpec:
    """The environment/data section of a training config (`TrainConfig.env`).

    kind: the environment's kind, a key of `ENV_KINDS` ("qa": the embedded retrieval-QA
    world; a config stored before the key existed is one).
    world / world_seed: a world preset of `memopd.env.qa.world` ("default", "replication":
    the held-out replication world of docs/design.md §10) and its seed.
    corpus / tasks / eval_tasks_file: bring your own data, a corpus JSONL and training
    question sets JSONL (memopd/env/qa/data.py) that replace the generated world; the
    held-out sets JSONL is evaluated at the end (grouped by their k).
    tokenizer: a tokenizer directory for user data (default: the student directory).
    policy / policy_kwargs: the memory policy (`memopd.memory.POLICIES`) and its
    parameters (e.g. {"turns": 3} for "window"); empty: the policy's defaults, or those a
    memopd checkpoint records.
    """

    world: str = "default"
    world_seed: int = 0
    corpus: str = ""
    tasks: str = ""
    eval_tasks_file: str = ""
    tokenizer: str = ""
    policy: str = "summary"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    kind: str = "qa"

    @property
    def user_data(self) -> bool:
        """Bring-your-own data: a corpus / question sets replace the generated world."""
        return bool(self.corpus or self.tasks or self.eval_tasks_file)

    def policy_problem(self) -> str | None:
        """Why `policy` with `policy_kwargs` cannot be built (None: it can); cheap."""
        from memopd.memory import make_policy

        try:
            make_policy(self.policy, mem_open_id=0, mem_close_id=1, **self.policy_kwargs)
        except (TypeError, ValueError) as e:
            return " ".join(str(e).split())
        return None


ENV_SPEC_FIELDS = tuple(EnvSpec.__dataclass_fields__)


@dataclass
class EnvironmentBundle:
    """Everything a run's trainer drives, by name.

    `tasks` is the `TaskSource` (a `World`, or `UserTasks` for user data); `teacher` is
    None when the run has none; `teacher_dir` is the directory the config names (or the
    SFT'd default) even then. Unpacking it as the 7-tuple
    `(student, teacher, env, tasks, tokenizer, student_dir, teacher_dir)` that `prepare`
    used to return still works, for existing callers; new code reads the names.

    What the run needs of the environment beyond rollouts, each optional:
    - `evaluate(model_dir)`: the held-out evaluation of a saved model directory, a report
      whose "results" map each held-out set to {metric: value} and whose "table" is its
      text; None: the run is not evaluated (`no_evaluation` then says why);
    - `compare(named_results)`: the text of a table setting results side by side (the
      starting student against the trained one);
    - `save_meta(model_dir, role)`: writes what loading the saved model back into this
      environment needs (after the weights and the tokenizer);
    - `baseline_key`: what, beside the student's weights, identifies its step-0
      evaluation, so the run can reuse it from the SFT cache; None: never cached.
    """

    student: Any
    teacher: Any
    env: Environment
    tasks: TaskSource
    tokenizer: Any
    student_dir: str
    teacher_dir: str
    evaluate: Callable[[str], dict] | None = None
    compare: Callable[[Sequence[tuple[str, dict]]], str] | None = None
    save_meta: Callable[[str, str], None] | None = None
    baseline_key: dict | None = None
    no_evaluation: str = "the environment has no held-out evaluation: the final model is not evaluated"

    def __iter__(self) -> Iterator[Any]:
        return iter((self.student, self.teacher, self.env, self.tasks, self.tokenizer, self.student_dir,
                     self.teacher_dir))


@dataclass(frozen=True)
class EnvKind:
    """One kind of environment. `build(spec, *, student, teacher, load_teacher, sft_dir,
    builds_sft, after_sft, train_k, evaluation, progress, log)` returns the run's
    `EnvironmentBundle` (see `build_environment` for the arguments); `check(spec)` raises
    `UserError` for a spec it cannot build, cheaply (no model loaded), when the config is
    read; `cache_name(spec)` is the SFT cache folder of its default models;
    `record_run(cache_dir, run_dir, fingerprints)`, if given, notes in that cache which run
    trains from its models (so retraining them names the run)."""

    build: Callable[..., EnvironmentBundle]
    check: Callable[[EnvSpec], None] = lambda spec: None
    cache_name: Callable[[EnvSpec], str] = lambda spec: f"sft-{spec.kind}"
    record_run: Callable[[str, str, dict], None] | None = None


# kind -> its EnvKind, or "module:NAME" naming it (imported on first use)
ENV_KINDS: dict[str, EnvKind | str] = {
    "qa": "memopd.env.qa.build:QA_KIND",
}


def register_env_kind(name: str, kind: EnvKind | str) -> None:
    """Make `kind` buildable as `env.kind=name` (the same as an entry of `ENV_KINDS`)."""
    ENV_KINDS[name] = kind


def env_kind(name: str) -> EnvKind:
    """The `EnvKind` registered as `name`; `UserError` naming the known kinds otherwise."""
    kind = ENV_KINDS.get(name)
    if kind is None:
        raise UserError(f"env.kind={name!r}: no such environment; known: {', '.join(sorted(ENV_KINDS))}")
    if isinstance(kind, str):
        module, _, attr = kind.partition(":")
        kind = ENV_KINDS[name] = getattr(importlib.import_module(module), attr)
    return kind


def build_environment(spec: EnvSpec, *, student: str = "", teacher: str = "", load_teacher: bool = True,
                      sft_dir: str | None = None, builds_sft: bool = True, after_sft: Callable[[], None] | None = None,
                      train_k: Sequence[int] = (), evaluation: dict | None = None, progress: bool = True,
                      log: Callable[[str], None] = print) -> EnvironmentBundle:
    """The models and environment of `spec`, built by the builder of `spec.kind`.

    `student` / `teacher`: model directories; an empty one is the kind's default model
    under `sft_dir` (the QA world builds its SFT'd defaults there first if missing: on
    this process only when `builds_sft`, e.g. rank 0; `after_sft`, e.g. a barrier, runs on
    every process once that stage is over). `load_teacher`: whether the run needs the
    teacher loaded. `train_k`: the task-set sizes the run trains on. `evaluation`: the
    run's held-out evaluation settings (`ks`, `n`, `temperature`, `samples`)."""
    return env_kind(spec.kind).build(spec, student=student, teacher=teacher, load_teacher=load_teacher, sft_dir=sft_dir,
                                     builds_sft=builds_sft, after_sft=after_sft, train_k=train_k,
                                     evaluation=dict(evaluation or {}), progress=progress, log=log)
