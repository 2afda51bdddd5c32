"""Evaluation of an agent checkpoint (or the scripted expert) on held-out question sets.

`evaluate(...)` rebuilds the environment a checkpoint was trained in (world, tokenizer,
memory policy: from `memopd_env.json`), draws held-out sets (split "eval", disjoint from
the "train" stream SFT uses) for each k, runs greedy (or sampled) episodes with
`HFEngine`, and reports per k:

- em_mean: mean over episodes of the fraction of sub-questions answered exactly
  ("EM mean", 0..1); em_sum: mean number of sub-questions right per episode ("EM sum",
  0..k); f1_mean / f1_sum likewise for token F1;
- peak_tokens: the largest |q| + |x_t| + |a_t| of any call (the longest sequence the
  model had to attend over), max and mean over episodes; turns: calls per episode;
- format_errors per episode, answered (fraction of episodes that answered before the
  budget ran out), wall and CPU seconds;
- sets: each episode's task id, EM mean and F1 mean, in the order played (what paired
  comparisons of two agents on the same sets need); with `samples` > 1 every set is
  played that many times (sampled decoding), its id repeated once per episode.

A user corpus (`--corpus docs.jsonl`) and question sets (`--questions sets.jsonl`)
replace the generated ones; results are then grouped by the sets' k.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from typing import Any, Sequence

from ..rollout import HFEngine, rollout
from .data import DataError, load_corpus_jsonl, load_tasks_jsonl
from .env import EnvConfig, QAEnv
from .world import World, WorldConfig

__all__ = ["evaluate", "summarize", "format_table", "format_comparison", "load_agent", "load_agent_env",
           "agent_engine"]


def load_agent(model_dir: str | os.PathLike, *, device: str = "cpu", require_env: bool = True):
    """(model, tokenizer, meta) of a checkpoint written by `memopd sft`; a missing or
    foreign directory is a `UserError` (`memopd.models.check_model_dir`). With
    `require_env=False` any HF causal-LM directory with a tokenizer will do (meta {}):
    it can then play a user corpus and question sets, not the generated world."""
    from memopd.models import check_model_dir, load_local_model

    from .sft import ENV_META_FILE, read_env_meta
    from .tokenizer import load_tokenizer

    path = check_model_dir(model_dir, "--model")
    has_env = os.path.exists(os.path.join(path, ENV_META_FILE))
    meta = read_env_meta(path) if (require_env or has_env) else {}
    tok = load_tokenizer(path)
    model = load_local_model(path, what="--model").to(device).eval()
    return model, tok, meta


def agent_engine(model, tokenizer, *, batch_size: int = 32) -> HFEngine:
    """The `HFEngine` that plays a loaded agent: the tokenizer's pad id (else eos), and
    only ids the tokenizer has (lm_head rows past it are padding)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = int(model.get_output_embeddings().weight.shape[0])
    return HFEngine(model, pad_id=pad, batch_size=batch_size, vocab_size=min(len(tokenizer), rows))


def load_agent_env(model_dir: str | os.PathLike):
    """(model, tokenizer, env, world) of a checkpoint of the generated world: the agent and
    the environment it was trained in (world, memory policy: from `memopd_env.json`)."""
    model, tok, meta = load_agent(model_dir)
    if "world" not in meta:
        raise DataError(f"{os.fspath(model_dir)!r} was trained on user data, not the generated world")
    world = World.generate(WorldConfig.from_json(meta["world"]))
    return model, tok, QAEnv.from_world(world, tok, EnvConfig(**meta.get("env", {}))), world


def summarize(trajectories) -> dict[str, Any]:
    """Aggregate figures of a list of trajectories (see module doc)."""
    if not trajectories:
        return {"episodes": 0}
    r = [t.rewards for t in trajectories]
    peaks = [t.info["peak_tokens"] for t in trajectories]
    return {
        "episodes": len(trajectories),
        "k": trajectories[0].rewards.get("k"),
        "em_mean": statistics.mean(x["em_mean"] for x in r),
        "em_sum": statistics.mean(x["em_sum"] for x in r),
        "f1_mean": statistics.mean(x["f1_mean"] for x in r),
        "f1_sum": statistics.mean(x["f1_sum"] for x in r),
        "peak_tokens": max(peaks),
        "peak_tokens_mean": statistics.mean(peaks),
        "turns": statistics.mean(t.info["turns"] for t in trajectories),
        "format_errors": statistics.mean(x["format_errors"] for x in r),
        "answered": statistics.mean(1.0 if x["answered"] else 0.0 for x in r),
        "sets": {"task_id": [t.task_id for t in trajectories], "em": [float(x["em_mean"]) for x in r],
                 "f1": [float(x["f1_mean"]) for x in r]},
    }


def evaluate(
    model_dir: str | os.PathLike | None = None,
    *,
    expert: bool = False,
    ks: Sequence[int] = (2, 8, 16),
    n: int = 32,
    seed: int = 0,
    policy: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    samples: int = 1,
    batch_size: int = 32,
    max_new_tokens: int | None = None,
    corpus: str | None = None,
    questions: str | None = None,
    world_config: WorldConfig | None = None,
    progress: bool = False,
    trajectories: list | None = None,
    engine: str = "hf",
) -> dict[str, Any]:
    """Evaluate a checkpoint (or the scripted expert with `expert=True`).

    `trajectories`: a list that every played episode's `memopd.Trajectory` is appended
    to (k by k, in the order played), e.g. to save them (`memopd eval
    --save-trajectories`) or to audit a model on its own samples (`memopd audit`).

    `samples`: episodes played per set (sampled decoding only: greedy decoding would play
    the same episode each time); the per-k figures are means over every episode, which
    with the same count per set are means over sets of the per-set means.

    `engine`: "hf" (transformers, in process) or "vllm" (`memopd.env.vllm_engine.VLLMEngine`
    serving the checkpoint directory; stopped when the evaluation ends)."""
    from .expert import ScriptedExpert, expert_options
    from .tokenizer import build_tokenizer

    if (model_dir is None) == (not expert):
        raise ValueError("give exactly one of a model directory or expert=True")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    if samples > 1 and not temperature > 0:
        raise ValueError(f"samples={samples} needs sampled decoding (temperature > 0): greedy decoding plays the "
                         "same episode every time")
    meta: dict[str, Any] = {}
    if model_dir is not None:
        model, tok, meta = load_agent(model_dir, require_env=corpus is None)
        if engine == "vllm":
            from ..vllm_engine import VLLMEngine

            rows = int(model.get_output_embeddings().weight.shape[0])
            dtype = str(next(model.parameters()).dtype).replace("torch.", "")
            del model  # vLLM holds its own copy
            engine = VLLMEngine(os.fspath(model_dir), vocab_size=min(len(tok), rows), dtype=dtype, seed=seed)
        elif engine == "hf":
            engine = agent_engine(model, tok, batch_size=batch_size)
        else:
            raise ValueError(f"engine must be 'hf' or 'vllm', got {engine!r}")
        # a checkpoint trained on user data (`memopd train corpus=... tasks=...`) has no world
        wcfg = WorldConfig.from_json(meta["world"]) if "world" in meta else None
        env_kw = dict(meta.get("env", {}))
    else:
        wcfg = world_config or WorldConfig()
        env_kw = {}
        tok = None
    if policy is not None:
        env_kw["policy"] = policy
        env_kw.setdefault("policy_kwargs", {})
    env_cfg = EnvConfig(**env_kw)
    if corpus is not None or questions is not None:
        if corpus is None or questions is None:
            raise DataError("a user evaluation needs both --corpus and --questions")
        docs = load_corpus_jsonl(corpus)
        tasks = load_tasks_jsonl(questions)
        if tok is None:
            tok = build_tokenizer([d.display for d in docs] + [q for t in tasks for q in t.questions], kind="bpe")
        env = QAEnv(docs, tok, env_cfg)
        by_k: dict[int, list] = defaultdict(list)
        for t in tasks:
            by_k[t.k].append(t)
        plan = sorted(by_k.items())
        source = {"corpus": os.fspath(corpus), "questions": os.fspath(questions)}
    else:
        if wcfg is None:
            data = meta.get("data") or {}
            raise DataError(f"{os.fspath(model_dir)!r} was trained on user data, not the generated world: evaluate it "
                            f"with --corpus {data.get('corpus') or 'DOCS.jsonl'} --questions "
                            f"{data.get('eval_tasks') or 'HELD_OUT.jsonl'}")
        world = World.generate(wcfg)
        if tok is None:
            tok = build_tokenizer(world.vocabulary_texts(), kind="word")
        env = QAEnv.from_world(world, tok, env_cfg)
        plan = [(k, world.sample_tasks(k, n, split="eval", seed=seed)) for k in ks]
        source = {"world": wcfg.to_json(), "split": "eval", "seed": seed, "n": n}
    if expert:
        engine = ScriptedExpert(tok, **(expert_options(wcfg) if wcfg is not None else {}))
    results: dict[str, Any] = {}
    try:
        _play(plan, env, engine, samples, temperature, top_p, max_new_tokens, seed, progress, trajectories, results)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    return {
        "model": "scripted-expert" if expert else os.fspath(model_dir),
        "role": meta.get("role"),
        "policy": env_cfg.policy,
        "temperature": temperature,
        "top_p": top_p,
        "samples": samples,
        "source": source,
        "results": results,
    }


def _play(plan, env, engine, samples, temperature, top_p, max_new_tokens, seed, progress, trajectories, results) -> None:
    for k, tasks_k in plan:
        t0, c0 = time.time(), time.process_time()
        trajs = rollout(env, engine, tasks_k, group_size=samples, temperature=temperature, top_p=top_p,
                        max_new_tokens=max_new_tokens, seed=seed, progress=progress)
        if trajectories is not None:
            trajectories.extend(trajs)
        s = summarize(trajs)
        s["wall_s"] = round(time.time() - t0, 3)
        s["cpu_s"] = round(time.process_time() - c0, 3)
        results[f"Q{k}"] = s


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of `evaluate`'s report."""
    head = (f"{'set':>5} {'n':>4} {'EM mean':>8} {'EM sum':>7} {'F1 mean':>8} {'F1 sum':>7} "
            f"{'peak tok':>8} {'turns':>6} {'fmt err':>7} {'answered':>8} {'wall s':>7}")
    samples = report.get("samples", 1)
    lines = [f"model: {report['model']}  policy: {report['policy']}  temperature: {report['temperature']}"
             + (f"  samples per set: {samples}" if samples > 1 else ""), head,
             "-" * len(head)]
    for name, s in report["results"].items():
        if not s.get("episodes"):
            lines.append(f"{name:>5}    0  (no episodes)")
            continue
        lines.append(
            f"{name:>5} {s['episodes']:>4} {s['em_mean']:>8.3f} {s['em_sum']:>7.2f} {s['f1_mean']:>8.3f} "
            f"{s['f1_sum']:>7.2f} {s['peak_tokens']:>8d} {s['turns']:>6.1f} {s['format_errors']:>7.2f} "
            f"{s['answered']:>8.2f} {s['wall_s']:>7.1f}"
        )
    lines.append("EM mean = fraction of sub-questions answered exactly; EM sum = sub-questions right per "
                 "episode (of k); F1 likewise; peak tok = longest |q|+|x_t|+|a_t| of any call.")
    return "\n".join(lines)


def format_comparison(named_results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """EM / F1 (means) of several models on the same sets, one row per model, one column
    pair per Qk, and the change of the last row from the first: `named_results` is
    [(name, evaluate(...)["results"]), ...]."""
    sets = [q for q in named_results[0][1] if all(q in r for _, r in named_results)]
    width = max(len(n) for n, _ in named_results + [("change", {})])
    lines = [f"{'':<{width}}  " + "  ".join(f"{q + ' EM':>7} {q + ' F1':>7}" for q in sets)]

    def cells(results, fmt):
        return "  ".join(f"{format(results[q].get('em_mean', float('nan')), fmt):>7} "
                         f"{format(results[q].get('f1_mean', float('nan')), fmt):>7}" for q in sets)

    for name, results in named_results:
        lines.append(f"{name:<{width}}  " + cells(results, ".3f"))
    if len(named_results) > 1:
        first, last = named_results[0][1], named_results[-1][1]
        delta = {q: {m: last[q].get(m, float("nan")) - first[q].get(m, float("nan")) for m in ("em_mean", "f1_mean")}
                 for q in sets}
        lines.append(f"{'change':<{width}}  " + cells(delta, "+.3f"))
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | os.PathLike) -> None:
    d = os.path.dirname(os.fspath(path))
    if d:
        os.makedirs(d, exist_ok=True)
    from memopd.files import atomic_write_json

    atomic_write_json(path, report)  # whole or not at all, and exit 74 on an OS failure
