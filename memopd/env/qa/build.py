"""The QA world's builder (`EnvKind` "qa" of memopd/env/build.py): a run's `EnvSpec`
to its `EnvironmentBundle`, and what the run needs of the world beyond rollouts.

Two sources:

- the generated world: the world, tokenizer and environment settings are read back from
  the student checkpoint's `memopd_env.json` (a memopd checkpoint, or an SFT'd default,
  built first into the SFT cache when missing); `check_world_checkpoint` refuses a
  student that is not one, before any SFT is run;
- bring-your-own data (`spec.user_data`): any local HF causal-LM student/teacher, their
  tokenizer (tags become id sequences when it splits them), the user's corpus and
  question sets (memopd/env/qa/data.py).

Beyond rollouts: the held-out EM/F1 evaluation (the world's Q-k sets, or the user's
held-out file), the environment metadata saved beside a model (`memopd_env.json`, so
`memopd eval` loads it back), and the key of a cached step-0 evaluation.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

from memopd.errors import UserError

from ..build import EnvironmentBundle, EnvKind, EnvSpec

__all__ = ["QA_KIND", "build", "check", "check_world_checkpoint", "sft_cache_name", "baseline_key"]


def check(spec: EnvSpec) -> None:
    """A world preset that exists, before any work."""
    from .world import world_preset

    try:
        world_preset(spec.world, seed=spec.world_seed)
    except ValueError as e:
        raise UserError(f"world: {' '.join(str(e).split())}") from None


def sft_cache_name(spec: EnvSpec) -> str:
    """The SFT cache folder of the world's default models: `sft` for the default world
    (unchanged, so existing caches stay valid), `sft-<preset>` otherwise."""
    return "sft" if spec.world == "default" else f"sft-{spec.world}"


def build(spec: EnvSpec, *, student: str = "", teacher: str = "", load_teacher: bool = True,
          sft_dir: str | None = None, builds_sft: bool = True, after_sft: Callable[[], None] | None = None,
          train_k: Sequence[int] = (), evaluation: dict | None = None, progress: bool = True,
          log: Callable[[str], None] = print) -> EnvironmentBundle:
    """`memopd.env.build.build_environment` for the QA world (see the module doc)."""
    evaluation = evaluation or {}
    if spec.user_data:
        bundle = _build_user(spec, student, teacher, load_teacher, train_k, log)
        return _with_run_parts(bundle, spec, evaluation, log)
    check_world_checkpoint(spec, student)
    need = [r for r, given in (("student", student), ("teacher", teacher)) if not given]
    if not load_teacher and "teacher" in need and student:
        need.remove("teacher")
    if need:
        if sft_dir is None:
            raise ValueError(f"build_environment: no {' or '.join(need)} directory and no sft_dir to build it in")
        if builds_sft:
            from .sft import run_sft
            from .world import world_preset

            run_sft(sft_dir, roles=need, world_config=world_preset(spec.world, seed=spec.world_seed),
                    progress=progress, log=log)
        if after_sft is not None:
            after_sft()
    bundle = _build_world(spec, student or os.path.join(sft_dir, "student"), teacher or os.path.join(sft_dir, "teacher"),
                          load_teacher)
    return _with_run_parts(bundle, spec, evaluation, log)


def check_world_checkpoint(spec: EnvSpec, student: str) -> None:
    """For the generated world: `student` (if given) must be a memopd checkpoint of a world,
    and no tokenizer may be given. Run before any SFT, so a wrong setting fails at once."""
    import json

    from .sft import ENV_META_FILE

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


def _build_world(spec: EnvSpec, student_dir: str, teacher_dir: str, load_teacher: bool) -> EnvironmentBundle:
    """`build_environment` for the generated world, from the student checkpoint's metadata."""
    from .env import EnvConfig, QAEnv
    from .sft import read_env_meta
    from .tokenizer import load_tokenizer
    from .world import World, WorldConfig

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

    from .data import load_corpus_jsonl, load_tasks_jsonl
    from .env import EnvConfig, QAEnv
    from .protocol import ProtocolError
    from .tasks import UserTasks
    from .tokenizer import load_tokenizer

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


def _with_run_parts(bundle: EnvironmentBundle, spec: EnvSpec, evaluation: dict, log) -> EnvironmentBundle:
    """`bundle` with the run's QA parts: held-out EM/F1 evaluation, the metadata saved
    with a model, the baseline cache key."""
    from .evaluate import evaluate as evaluate_dir
    from .evaluate import format_comparison, format_table

    temperature, samples = evaluation.get("temperature", 0.0), evaluation.get("samples", 1)

    def evaluate(model_dir: str) -> dict:
        if spec.user_data:  # the held-out file's sets as they are, grouped by k (as `memopd eval --questions`)
            report = evaluate_dir(model_dir, corpus=spec.corpus, questions=spec.eval_tasks_file, temperature=temperature,
                                  samples=samples)
        else:
            report = evaluate_dir(model_dir, ks=evaluation.get("ks", (2, 8, 16)), n=evaluation.get("n", 32),
                                  temperature=temperature, samples=samples)
        return {**report, "table": format_table(report)}

    def save_meta(model_dir: str, role: str) -> None:
        _save_env_meta(bundle, spec, model_dir, role, log)

    can_eval = not spec.user_data or bool(spec.eval_tasks_file)
    return dataclasses.replace(
        bundle, evaluate=evaluate if can_eval else None, compare=format_comparison, save_meta=save_meta,
        baseline_key=None if spec.user_data else baseline_key(spec, evaluation),
        no_evaluation="no eval_tasks_file: the final model is not evaluated (give eval_tasks_file=HELD_OUT.jsonl)")


def baseline_key(spec: EnvSpec, evaluation: dict) -> dict:
    """What identifies a world student's step-0 evaluation beside its weights: the memory
    policy and the held-out settings (the keys of caches written before a setting existed
    stay valid: a default setting adds nothing)."""
    key = {"policy": spec.policy, "eval_k": list(evaluation.get("ks", (2, 8, 16))), "eval_tasks": evaluation.get("n", 32)}
    temperature, samples = evaluation.get("temperature", 0.0), evaluation.get("samples", 1)
    if temperature or samples != 1:  # absent for greedy: existing keys stay valid
        key["eval_temperature"] = temperature
        key["eval_samples"] = samples
    if spec.policy_kwargs:  # absent when empty: the keys of existing caches stay valid
        key["policy_kwargs"] = spec.policy_kwargs
    return key


def _save_env_meta(bundle: EnvironmentBundle, spec: EnvSpec, out_dir: str, role: str, log) -> None:
    """memopd_env.json beside a saved model: the world (copied from the student's) or the
    user data files and environment settings, the run's memory policy, and the role."""
    from .sft import ENV_META_FILE

    if spec.user_data:
        # no world to regenerate: the data files and the environment settings instead
        # (`memopd eval --model DIR --corpus C --questions Q` evaluates it)
        _check_saved_tokenizer(bundle.tokenizer, out_dir, bundle.env, log)
        meta = {
            "data": {"corpus": os.path.abspath(spec.corpus), "tasks": os.path.abspath(spec.tasks),
                     "eval_tasks": os.path.abspath(spec.eval_tasks_file) if spec.eval_tasks_file else None,
                     "tokenizer": os.path.abspath(spec.tokenizer or bundle.student_dir)},
            "env": dataclasses.asdict(bundle.env.config),
            "student": os.path.abspath(bundle.student_dir),
        }
    else:
        with open(os.path.join(bundle.student_dir, ENV_META_FILE)) as f:
            meta = json.load(f)
    meta["env"]["policy"] = spec.policy
    if spec.policy_kwargs:
        meta["env"]["policy_kwargs"] = dict(spec.policy_kwargs)
    meta["role"] = role
    with open(os.path.join(out_dir, ENV_META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def _check_saved_tokenizer(tokenizer, out_dir: str, env, log: Callable[[str], None]) -> None:
    """Warn if the tokenizer reloaded from a saved agent dir (AutoTokenizer may rebuild it
    by the model config's type) encodes differently from the one the run used."""
    from .protocol import SPECIAL_TOKENS, prefix_text
    from .tokenizer import load_tokenizer

    probe = [prefix_text(["what is it ?", "who said so"]), " ".join(SPECIAL_TOKENS[4:])]
    probe += [" " + d.display for d in env.documents[:8]]
    try:
        again = load_tokenizer(out_dir)
        same = all(again.encode(t, add_special_tokens=False) == tokenizer.encode(t, add_special_tokens=False)
                   for t in probe)
    except Exception as e:  # noqa: BLE001 a warning, not a failure at the end of a run
        same, why = False, f" ({type(e).__name__}: {e})"
    else:
        why = ""
    if not same:
        log(f"warning: the tokenizer saved in {out_dir} does not reload to the same encoding{why}: "
            "`memopd eval` of that dir will not see what training saw; pass tokenizer= a dir whose "
            "tokenizer_config.json names its class explicitly")


def _record_run(cache_dir: str, run_dir: str, fingerprints: dict) -> None:
    from .sft import record_run

    record_run(cache_dir, run_dir, fingerprints)


QA_KIND = EnvKind(build=build, check=check, cache_name=sft_cache_name, record_run=_record_run)
