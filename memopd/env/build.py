"""The environment of a training run, from its config section to the objects a trainer drives.

`EnvSpec` is the environment/data section of a run's config (`TrainConfig.env`): which
world or user data, which tokenizer, which memory policy and its parameters.
`build_environment(spec, student=, teacher=, ...)` turns it, with the model directories
the run uses, into one `EnvironmentBundle`: the loaded student and teacher,
the `Environment` (`QAEnv`), the `TaskSource` the trainer samples question sets from
(`World` or `UserTasks`), and the tokenizer. Two sources:

- the generated world: the world, tokenizer and environment settings are read back from
  the student checkpoint's `memopd_env.json` (a memopd checkpoint, or an SFT'd default,
  built first into the SFT cache when missing); `check_world_checkpoint` refuses a
  student that is not one, before any SFT is run;
- bring-your-own data (`spec.user_data`): any local HF causal-LM student/teacher, their
  tokenizer (tags become id sequences when it splits them), the user's corpus and
  question sets (memopd/env/qa/data.py).

Nothing here imports the trainer: the trainer builds on this module, not the reverse.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from memopd.errors import UserError

from .rollout import Environment, TaskSource

__all__ = ["EnvSpec", "EnvironmentBundle", "build_environment", "check_world_checkpoint", "ENV_SPEC_FIELDS"]


@dataclass
class EnvSpec:
    """The environment/data section of a training config (`TrainConfig.env`).

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

    @property
    def user_data(self) -> bool:
        """Bring-your-own data: a corpus / question sets replace the generated world."""
        return bool(self.corpus or self.tasks or self.eval_tasks_file)

    def policy_problem(self) -> str | None:
        """Why `policy` with `policy_kwargs` cannot be built (None: it can); cheap."""
        import inspect

        from memopd.memory import make_policy

        try:
            policy = make_policy(self.policy, mem_open_id=0, mem_close_id=1, **self.policy_kwargs)
        except (TypeError, ValueError) as e:
            return " ".join(str(e).split())
        # make_policy drops the keywords of a policy without parameters: refuse them here
        takes = set(inspect.signature(type(policy)).parameters) - {"mem_open_id", "mem_close_id"}
        ignored = sorted(set(self.policy_kwargs) - takes)
        if ignored:
            return (f"the {self.policy!r} policy takes {'no parameters' if not takes else ', '.join(sorted(takes))}, "
                    f"not {', '.join(ignored)}")
        return None


ENV_SPEC_FIELDS = tuple(EnvSpec.__dataclass_fields__)


@dataclass
class EnvironmentBundle:
    """Everything a run's trainer drives, by name.

    `tasks` is the `TaskSource` (a `World`, or `UserTasks` for user data); `teacher` is
    None when the run has none; `teacher_dir` is the directory the config names (or the
    SFT'd default) even then. Unpacking it as the 7-tuple
    `(student, teacher, env, tasks, tokenizer, student_dir, teacher_dir)` that `prepare`
    used to return still works, for existing callers; new code reads the names."""

    student: Any
    teacher: Any
    env: Environment
    tasks: TaskSource
    tokenizer: Any
    student_dir: str
    teacher_dir: str

    def __iter__(self) -> Iterator[Any]:
        return iter((self.student, self.teacher, self.env, self.tasks, self.tokenizer, self.student_dir,
                     self.teacher_dir))


def check_world_checkpoint(spec: EnvSpec, student: str) -> None:
    """For the generated world: `student` (if given) must be a memopd checkpoint of a world,
    and no tokenizer may be given. Run before any SFT, so a wrong setting fails at once."""
    import json

    from .qa.sft import ENV_META_FILE

    if spec.tokenizer:
        raise UserError(f"tokenizer={spec.tokenizer!r} is only used with your own data (corpus=, tasks=); the "
                        "generated world uses the tokenizer of its memopd checkpoints")
    if not student:
        return
    from memopd.models import check_model_dir

    check_model_dir(student, "student")
    meta_path = os.path.join(student, ENV_META_FILE)
    if not os.path.exists(meta_path):
        raise UserError(f"student={student!r} is not a memopd checkpoint of the generated world (no "
                        f"{ENV_META_FILE}): to train any HF causal LM, give your data too: corpus=DOCS.jsonl "
                        "tasks=SETS.jsonl [eval_tasks_file=HELD_OUT.jsonl] (see the README, 'Bring your own "
                        "models and data')")
    with open(meta_path) as f:
        if "world" not in json.load(f):
            raise UserError(f"student={student!r} was trained on user data: give corpus=, tasks= again")


def build_environment(spec: EnvSpec, *, student: str = "", teacher: str = "", load_teacher: bool = True,
                      sft_dir: str | None = None, builds_sft: bool = True, after_sft: Callable[[], None] | None = None,
                      train_k: Sequence[int] = (), progress: bool = True,
                      log: Callable[[str], None] = print) -> EnvironmentBundle:
    """The models and environment of `spec` (see the module doc).

    `student` / `teacher`: model directories; for the generated world an empty one is the
    SFT'd default under `sft_dir`, built there first if missing (`run_sft`: on this
    process only when `builds_sft`, e.g. rank 0; `after_sft`, e.g. a barrier, runs on
    every process once the SFT stage is over). `load_teacher`: whether the run needs the
    teacher loaded. `train_k`: the question-set sizes the run trains on (user data: each
    must be servable from the question sets)."""
    if spec.user_data:
        return _build_user(spec, student, teacher, load_teacher, train_k, log)
    check_world_checkpoint(spec, student)
    need = [r for r, given in (("student", student), ("teacher", teacher)) if not given]
    if not load_teacher and "teacher" in need and student:
        need.remove("teacher")
    if need:
        if sft_dir is None:
            raise ValueError(f"build_environment: no {' or '.join(need)} directory and no sft_dir to build it in")
        if builds_sft:
            from .qa.sft import run_sft
            from .qa.world import world_preset

            run_sft(sft_dir, roles=need, world_config=world_preset(spec.world, seed=spec.world_seed),
                    progress=progress, log=log)
        if after_sft is not None:
            after_sft()
    return _build_world(spec, student or os.path.join(sft_dir, "student"), teacher or os.path.join(sft_dir, "teacher"),
                        load_teacher)


def _build_world(spec: EnvSpec, student_dir: str, teacher_dir: str, load_teacher: bool) -> EnvironmentBundle:
    """`build_environment` for the generated world, from the student checkpoint's metadata."""
    from .qa.env import EnvConfig, QAEnv
    from .qa.sft import read_env_meta
    from .qa.tokenizer import load_tokenizer
    from .qa.world import World, WorldConfig

    meta = read_env_meta(student_dir)
    world = World.generate(WorldConfig.from_json(meta["world"]))
    tokenizer = load_tokenizer(student_dir)
    env_kw = dict(meta.get("env", {}))
    env_kw["policy"] = spec.policy
    if spec.policy_kwargs:
        env_kw["policy_kwargs"] = dict(spec.policy_kwargs)
    env = QAEnv.from_world(world, tokenizer, EnvConfig(**env_kw))
    student = _load_lm(student_dir)
    teacher = _load_lm(teacher_dir) if load_teacher else None
    return EnvironmentBundle(student, teacher, env, world, tokenizer, student_dir, teacher_dir)


def _load_lm(path: str):
    import torch

    from memopd.models import load_local_model

    return load_local_model(path, what="model", dtype=torch.float32)


def _build_user(spec: EnvSpec, student_dir: str, teacher_dir: str, load_teacher: bool, train_k: Sequence[int],
                log: Callable[[str], None]) -> EnvironmentBundle:
    """`build_environment` for user data: any local HF causal-LM student/teacher, their
    tokenizer (tags as id sequences when it splits them), the corpus, and a `UserTasks` sampler."""
    from memopd.models import check_model_dir

    from .qa.data import load_corpus_jsonl, load_tasks_jsonl
    from .qa.env import EnvConfig, QAEnv
    from .qa.protocol import ProtocolError
    from .qa.tasks import UserTasks
    from .qa.tokenizer import load_tokenizer

    student_dir = check_model_dir(student_dir, "student")
    teacher_dir = check_model_dir(teacher_dir, "teacher") if load_teacher else teacher_dir
    tok_dir = spec.tokenizer or student_dir
    try:
        tokenizer = load_tokenizer(tok_dir)
    except ProtocolError as e:
        raise UserError(f"tokenizer {tok_dir!r}{'' if spec.tokenizer else ' (the student dir)'}: {e}") from None
    docs = load_corpus_jsonl(spec.corpus)
    tasks = UserTasks(load_tasks_jsonl(spec.tasks),
                      load_tasks_jsonl(spec.eval_tasks_file) if spec.eval_tasks_file else None,
                      sources={"train": spec.tasks, "eval": spec.eval_tasks_file})
    modes = {}
    for k in train_k:
        try:
            modes[k] = tasks.check_k(k, "train")
        except UserError as e:
            raise UserError(f"train_k={list(train_k)}: {e}; lower train_k or add questions") from None
    env = QAEnv(docs, tokenizer, EnvConfig(policy=spec.policy, policy_kwargs=dict(spec.policy_kwargs)))
    student = _load_lm(student_dir)
    teacher = _load_lm(teacher_dir) if load_teacher else None
    for what, d, lm in (("student", student_dir, student), ("teacher", teacher_dir, teacher)):
        if lm is None:
            continue
        rows = int(lm.get_input_embeddings().weight.shape[0])
        if rows < len(tokenizer):
            raise UserError(f"{what} {d!r}: its input embeddings have {rows} rows, fewer than the {len(tokenizer)} "
                            f"ids of the tokenizer {tok_dir!r}: the models must share this tokenizer's vocabulary")
    tk = env.tokens
    tags = ("one token each" if tk.single_token_tags else
            "id sequences (" + ", ".join(f"{t}={len(tk.tag_ids(n))}" for n, t in
                                         (("mem_open", "<mem>"), ("search_close", "</search>"))) + " ids, ...)")
    log(f"user data: {len(docs)} documents ({spec.corpus}); {tasks.num_questions('train')} training questions in "
        f"sets of k={list(tasks.sizes('train'))} ({spec.tasks}); train_k "
        + ", ".join(f"{k}: {m}" for k, m in modes.items())
        + (f"; held-out: {spec.eval_tasks_file}" if spec.eval_tasks_file else "; no held-out file (no final evaluation)")
        + f"; tokenizer {tok_dir} ({len(tokenizer)} ids), protocol tags {tags}")
    return EnvironmentBundle(student, teacher, env, tasks, tokenizer, student_dir, teacher_dir)
