"""Supervised fine-tuning of tiny agents on scripted-expert episodes (`memopd sft`).

Builds the teacher and student (`MODEL_PRESETS`, or those the world's preset picks:
`role_presets`; via `memopd.models`), their training data (`expert_examples`: one
example per recorded expert call, loss on the action ids only; `copy_warmup_examples`:
the synthetic copy pre-training before SFT), trains them
(`train_sft`, with the trainer's AdamW and LR schedule) and saves each role as a Hugging
Face checkpoint directory with its environment metadata and manifest (`run_sft`, which
reuses a cached checkpoint only when it verifies and matches the settings asked for).
Recipe, presets and their measured cost: docs/design.md §10.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import torch

from memopd.errors import UserError

from ..rollout import rollout
from .data import DataError
from .env import EnvConfig, QAEnv
from .expert import make_expert
from .protocol import SPECIAL_TOKENS, ProtocolTokens
from .world import World, WorldConfig

__all__ = [
    "ModelSpec",
    "MODEL_PRESETS",
    "SFTConfig",
    "SFT_PRESETS",
    "REPLICATION_MODEL_PRESETS",
    "REPLICATION_SFT_PRESETS",
    "WORLD_ROLE_PRESETS",
    "register_role_presets",
    "recipe_class",
    "role_presets",
    "ENV_META_FILE",
    "make_model",
    "sft_examples",
    "copy_warmup_examples",
    "expert_examples",
    "view_env",
    "view_calls",
    "expert_rollouts",
    "episodes_per_round",
    "data_stats",
    "flattened_prompt",
    "train_sft",
    "save_checkpoint",
    "checkpoint_exists",
    "read_env_meta",
    "run_sft",
]

ENV_META_FILE = "memopd_env.json"
FLATTEN_VIEW = "flatten"  # an SFT view that is not a memory policy (SFTConfig.policies)
SFT_LOCK_FILE = ".memopd_sft.lock"  # in the cache (output) directory, held while it is built
RUNS_FILE = "runs.json"  # in the cache: which runs trained from which cached weights (record_run)


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024


# Sizes chosen to learn in CPU minutes: a 4-layer teacher needed several times more
# steps to form its copy heads; two layers of width 128 (4 heads) learn the task to
# near-perfect Q2/Q8/Q16 in ~4000 steps, the 64-wide student is ~3.5x smaller.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "teacher": ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=384),
    "student": ModelSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=192),
}


@dataclass
class SFTConfig:
    """Training knobs.

    ks / calls_per_k: the expert data: question-set sizes, and how many recorded calls
    of each size to train on (long episodes have many more calls; balancing by calls
    keeps short and long contexts equally represented). steps: optimizer steps;
    batch_tokens: padded tokens per batch. warmup_copy_steps / warmup_copy_len: the
    synthetic copy pre-training before SFT and its longest string (0 steps by default,
    so a smoke-test config stays tiny; both presets use 1000, which the real task needs).
    threads: torch CPU threads while training
    (1 is fastest for these tiny models, and leaves the other core free).
    """

    steps: int = 3000
    batch_tokens: int = 1024
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    calls_per_k: int = 2500
    warmup_copy_steps: int = 0
    warmup_copy_len: int = 20
    attn_implementation: str = "sdpa"
    threads: int | None = 1
    # memory policies of the expert episodes, calls_per_k calls of each (empty: the
    # environment's own policy only, as the default presets train); "flatten" is the view
    # the flatten layout scores: the persistent history [q, x_0, a_0, ..., x_t] of
    # compact-memory episodes, each call labelled by the expert on that state
    policies: tuple[str, ...] = ()
    # each batch from one policy's examples, the policies taking turns step by step;
    # False: batches drawn from all examples at once, where long full-view batches
    # crowd out compact-memory ones (docs/design.md §10)
    balance_policies: bool = False
    def to_json(self) -> dict[str, Any]:
        """The recipe as JSON (tuples as lists): recorded in a checkpoint and compared
        field by field before a cached one is reused (`_cache_mismatch`)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SFTConfig":
        """The inverse of `to_json` (lists back to tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def build_examples(self, world: World, env: QAEnv) -> tuple[list[tuple[list[int], int]], dict[str, Any]]:
        """This recipe's training data for `env` in `world` (examples, stats): the scripted
        expert's calls (`expert_examples`). A recipe that builds its data otherwise is a
        subclass that overrides this (with its own fields after these, so that its JSON
        keeps theirs first); `recipe_name` names it for a worker process."""
        return expert_examples(world, env, self.ks, self.calls_per_k, seed=self.seed, policies=self.policies)

    def recipe_name(self) -> str:
        """"module:class" of this recipe, what a worker process imports to rebuild it."""
        return f"{type(self).__module__}:{type(self).__qualname__}"


def recipe_class(name: str) -> type[SFTConfig]:
    """The `SFTConfig` (sub)class `SFTConfig.recipe_name` named."""
    import importlib

    module, _, qualname = name.partition(":")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, SFTConfig)):
        raise DataError(f"SFT recipe {name!r} is not an SFTConfig class")
    return cls


# The student is weak on purpose (a third of the teacher's SFT steps, a smaller model):
# on-policy distillation has something to teach it.
SFT_PRESETS: dict[str, SFTConfig] = {
    "teacher": SFTConfig(steps=3000, warmup_copy_steps=1000),
    "student": SFTConfig(steps=1000, warmup_copy_steps=1000),
}

# The replication world (docs/design.md §10). The teacher reads both views: compact
# memory ("summary") and the whole flattened history ("full"), whose longest Q16 episode
# is ~1,900 tokens, hence 2,048 positions and batches that hold one such example. The
# student acts under compact memory only.
REPLICATION_MODEL_PRESETS: dict[str, ModelSpec] = {
    "teacher": ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=384, max_position_embeddings=2048),
    "student": ModelSpec(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=288, max_position_embeddings=1024),
}
REPLICATION_SFT_PRESETS: dict[str, SFTConfig] = {
    # 6,000 balanced steps: at 2,500 this teacher still miscopied values (docs/design.md §10)
    "teacher": SFTConfig(steps=6000, warmup_copy_steps=800, batch_tokens=2304, ks=(1, 2, 4, 8, 12, 16),
                         calls_per_k=2500, policies=("summary", "full"), balance_policies=True),
    # 1,500 steps: chosen by measurement between 800 (held-out EM ~0 on every k) and 2,000
    # (near the teacher on Q8) so the student sits between zero and the teacher (§10)
    "student": SFTConfig(steps=1500, warmup_copy_steps=800, ks=(1, 2, 4, 8, 12, 16), calls_per_k=2500,
                         policies=("summary",)),
}


# Role presets of other world presets, by world preset: (model specs, SFT recipes), or the
# name of the module that defines them as `ROLE_PRESETS` (imported when that world is
# asked for: the info-gap world's recipe is an experiment's, which this package does not
# import). `register_role_presets` adds one.
WORLD_ROLE_PRESETS: dict[str, tuple[dict[str, ModelSpec], dict[str, SFTConfig]] | str] = {
    "replication": (REPLICATION_MODEL_PRESETS, REPLICATION_SFT_PRESETS),
    "info-gap": "memopd.trainer.experiments.infogap_sft",
}


def register_role_presets(world_preset: str, model_specs: dict[str, ModelSpec],
                          sft_configs: dict[str, SFTConfig]) -> None:
    """Make `role_presets` answer (model specs, SFT recipes) for worlds of `world_preset`."""
    WORLD_ROLE_PRESETS[world_preset] = (dict(model_specs), dict(sft_configs))


def role_presets(world_config: WorldConfig | None = None) -> tuple[dict[str, ModelSpec], dict[str, SFTConfig]]:
    """(model specs, SFT recipes) per role for a world: its `preset` picks them
    (`WORLD_ROLE_PRESETS`; the default ones for any other)."""
    found = WORLD_ROLE_PRESETS.get(world_config.preset) if world_config is not None else None
    if isinstance(found, str):
        import importlib

        found = importlib.import_module(found).ROLE_PRESETS
    if found is None:
        return dict(MODEL_PRESETS), dict(SFT_PRESETS)
    return dict(found[0]), dict(found[1])


def make_model(spec: ModelSpec, tokenizer, *, seed: int = 0, attn_implementation: str = "eager"):
    """A randomly initialised Qwen2 causal LM sized by `spec` for `tokenizer` (tied
    embeddings, the tokenizer's pad/bos/eos ids), built by `memopd.models.tiny_causal_lm`."""
    from memopd.models import tiny_causal_lm

    tk = ProtocolTokens.from_tokenizer(tokenizer)
    return tiny_causal_lm(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_hidden_layers,
        num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads,
        max_positions=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tk.pad,
        bos_token_id=tk.bos,
        eos_token_id=tk.eos,
        seed=seed,
        attn_implementation=attn_implementation,
    )


def sft_examples(trajectories) -> list[tuple[list[int], int]]:
    """(ids = q + x_t + a_t, n_context = |q| + |x_t|) for every recorded call."""
    out = []
    for tr in trajectories:
        for inv in tr.invocations:
            n = len(inv.prefix_ids) + len(inv.context_ids)
            out.append((inv.prefix_ids + inv.context_ids + inv.action_ids, n))
    return out


def flattened_prompt(traj, t: int) -> list[int]:
    """What the `flatten` layout shows before call t's action: the persistent history
    `[q, x_0, a_0, ..., x_{t-1}, a_{t-1}, x_t]` (memopd.records, `flattened_tokens`);
    under compact memory every x_s holds the observation before it, so every earlier
    observation is in it."""
    ids = list(traj.invocations[0].prefix_ids)
    for inv in traj.invocations[:t]:
        ids += list(inv.context_ids) + list(inv.action_ids)
    return ids + list(traj.invocations[t].context_ids)


def view_env(env: QAEnv, view: str) -> QAEnv:
    """The environment whose episodes give `view`'s calls: `env` under the memory policy
    `view` (under "summary" for `FLATTEN_VIEW`, whose states are the persistent history
    of compact-memory episodes)."""
    policy = "summary" if view == FLATTEN_VIEW else view
    if policy == env.config.policy:
        return env
    return QAEnv(env.documents, env.tokenizer, replace(env.config, policy=policy), retriever=env.retriever,
                 answer_words=env.answer_words)


def episodes_per_round(k: int, calls_per_k: int) -> int:
    """Question sets played per round of expert episodes of k questions: about enough for
    `calls_per_k` calls (an episode of k questions makes about 1 + 3k/2 calls)."""
    return max(8, calls_per_k // (1 + 3 * k // 2) + 1)


def expert_rollouts(env: QAEnv, expert, tasks, name: str) -> list:
    """The expert's greedy episodes on `tasks`; raises if it misses any answer (it must be
    perfect, or the data would teach mistakes)."""
    trajs = rollout(env, expert, tasks, temperature=0.0)
    bad = [t.task_id for t in trajs if t.rewards["em_mean"] < 1.0]
    if bad:
        raise RuntimeError(f"the {name} expert failed on {len(bad)} training tasks (e.g. {bad[0]})")
    return trajs


def view_calls(trajs, view: str, labeller, own: bool = True) -> list[tuple[tuple[list[int], int], list[int],
                                                                           list[int], list[int] | None]]:
    """Every call of `trajs` as an SFT example under `view`: (example, prefix, context,
    compact state or None). Under `FLATTEN_VIEW` the state is the flattened history
    (`flattened_prompt`) labelled by `labeller`, and the compact state is the call as it
    was played; otherwise the recorded action is the label of the player's `own` calls,
    and `labeller` labels another player's states."""
    out = []
    for t in trajs:
        for c, inv in enumerate(t.invocations):
            prefix, context = list(inv.prefix_ids), list(inv.context_ids)
            if view == FLATTEN_VIEW:
                state = flattened_prompt(t, c)
                out.append(((state + labeller.act(state), len(state)), prefix, state[len(prefix):], prefix + context))
            elif own:
                out.append(((inv.prefix_ids + inv.context_ids + inv.action_ids, len(prefix) + len(context)),
                            inv.prefix_ids, inv.context_ids, None))
            else:
                state = prefix + context
                out.append(((state + labeller.act(state), len(state)), inv.prefix_ids, inv.context_ids, None))
    return out


def data_stats(examples: Sequence[tuple[list[int], int]], stats: dict[str, Any]) -> dict[str, Any]:
    """`stats` with the size of the data added: calls, tokens, action tokens, longest."""
    stats["calls"] = len(examples)
    stats["tokens"] = sum(len(e[0]) for e in examples)
    stats["action_tokens"] = sum(len(e[0]) - e[1] for e in examples)
    stats["longest"] = max(len(e[0]) for e in examples)
    return stats


def expert_examples(world: World, env: QAEnv, ks: Sequence[int], calls_per_k: int, *, seed: int = 0,
                    split: str = "train", policies: Sequence[str] = ()) -> tuple[list[tuple[list[int], int]],
                                                                                 dict[str, Any]]:
    """SFT examples from the scripted expert's episodes: `calls_per_k` calls for each k
    (and for each memory policy of `policies`, if given; else `env`'s own policy).

    Episodes are drawn from the `split` stream (held out from "eval") until there are
    enough calls, then exactly `calls_per_k` calls are sampled. Raises if the expert
    misses any answer (`expert_rollouts`). The examples come policy by policy, in the
    order of `policies`; `stats["calls_by_policy"]` says how many each has; the view
    `FLATTEN_VIEW` holds the calls of compact-memory episodes as the flatten layout shows
    them (`flattened_prompt`), labelled by the expert on that state.
    """
    expert = make_expert("scripted", env.tokenizer, world.config)
    rng = random.Random(f"sft-{seed}")
    examples: list[tuple[list[int], int]] = []
    stats: dict[str, Any] = {"episodes": 0, "calls": 0, "calls_by_policy": {}, "expert": "scripted"}
    for view in list(policies) or [env.config.policy]:
        play, first = view_env(env, view), len(examples)
        for k in ks:
            pool: list[tuple[list[int], int]] = []
            rnd = 0
            while len(pool) < calls_per_k:
                tasks = world.sample_tasks(k, episodes_per_round(k, calls_per_k), split=split, seed=seed * 1000 + rnd)
                trajs = expert_rollouts(play, expert, tasks, "scripted")
                pool += [call[0] for call in view_calls(trajs, view, expert)]
                stats["episodes"] += len(trajs)
                rnd += 1
            # sampling indices draws exactly what sampling the pool itself would
            examples += [pool[i] for i in rng.sample(range(len(pool)), calls_per_k)]
        stats["calls_by_policy"][view] = len(examples) - first
    return examples, data_stats(examples, stats)


def copy_warmup_examples(vocab_size: int, n: int, *, first_id: int, max_len: int = 20, max_gap: int = 40,
                         seed: int = 0, bos_id: int = 1) -> list[tuple[list[int], int]]:
    """Synthetic copy data: `<bos> S gap S`, S a random string of ids >= first_id
    (8..max_len long), gap random ids (0..max_gap); the loss covers the repeated S.
    Same (ids, n_context) layout as `sft_examples`."""
    rng = random.Random(f"copy-warmup-{seed}")
    out = []
    for _ in range(n):
        s = [rng.randrange(first_id, vocab_size) for _ in range(rng.randint(8, max(8, max_len)))]
        gap = [rng.randrange(first_id, vocab_size) for _ in range(rng.randint(0, max_gap))]
        ctx = [bos_id] + s + gap
        out.append((ctx + s, len(ctx)))
    return out


def _batches(examples, batch_tokens: int, rng: random.Random, groups: Sequence[Any] | None = None):
    """Endless length-bucketed batches: each padded batch holds <= batch_tokens ids.

    With `groups` (one label per example), every batch holds one group's examples and
    the groups take turns, one batch each: the share of steps is then the same for
    every group, however many of its examples a batch holds.
    """
    if groups is not None:
        if len(groups) != len(examples):
            raise ValueError(f"{len(groups)} group labels for {len(examples)} examples")
        members: dict[Any, list[int]] = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        def group_batches(idx: list[int]):
            for batch in _batches([examples[i] for i in idx], batch_tokens, rng):
                yield [idx[j] for j in batch]

        streams = [group_batches(idx) for idx in members.values()]
        while True:
            for stream in streams:
                yield next(stream)
    while True:
        idx = list(range(len(examples)))
        rng.shuffle(idx)
        for c in range(0, len(idx), 1024):
            chunk = sorted(idx[c:c + 1024], key=lambda i: len(examples[i][0]))
            batches, cur, longest = [], [], 0
            for i in chunk:
                n = len(examples[i][0])
                if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
                    batches.append(cur)
                    cur, longest = [], 0
                cur.append(i)
                longest = max(longest, n)
            if cur:
                batches.append(cur)
            rng.shuffle(batches)
            yield from batches


def _collate(examples, batch, pad_id: int):
    L = max(len(examples[i][0]) for i in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    for r, i in enumerate(batch):
        seq, n = examples[i]
        ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        labels[r, n: len(seq)] = torch.tensor(seq[n:], dtype=torch.long)
    return ids, labels


def train_sft(model, examples: Sequence[tuple[list[int], int]], cfg: SFTConfig, *, pad_id: int = 0,
              progress: bool = True, desc: str = "sft", position: int | None = None,
              groups: Sequence[Any] | None = None, resume_file: str | None = None,
              resume_key: str = "") -> dict[str, Any]:
    """Train `model` in place on action tokens only; returns loss/accuracy/time stats.
    `groups` (a label per example, e.g. its memory policy): each batch holds one group's
    examples and the groups take turns step by step (`_batches`).

    `resume_file`: the training state (model, optimizer, schedule, RNG, running stats) is
    written there atomically about once a minute and at the end, and a later call with the
    same `resume_key` (what identifies the job: data, config, model) continues from it, so
    a killed build loses at most a minute. The continuation is exact: the batches are
    replayed from the seed and the result equals an uninterrupted run bitwise. A state
    written for another key is ignored. The caller removes the file once the model is saved.

    Right padding without an attention mask is exact here: causal attention never lets
    a real token see the pads that come after it, and pads carry no loss.
    """
    if not examples:
        raise DataError("no SFT examples")
    if cfg.steps < 1:
        raise UserError(f"SFT needs steps >= 1, got {cfg.steps}")
    old_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(model, examples, cfg, pad_id=pad_id, progress=progress, desc=desc, position=position,
                      groups=groups, resume_file=resume_file, resume_key=resume_key)
    finally:
        torch.set_num_threads(old_threads)


RESUME_SAVE_EVERY_S = 60.0  # wall seconds between two writes of an SFT resume state


def _load_resume_state(path: str | None, key: str) -> dict[str, Any] | None:
    """The resume state at `path` written for `key`, or None (no file, another job, or a
    file that does not load: training then starts from the beginning)."""
    if not path or not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError):
        return None  # a damaged state only costs the steps it held
    return state if isinstance(state, dict) and state.get("key") == key else None


def _save_resume_state(path: str, state: dict[str, Any]) -> None:
    from memopd.files import atomic_file

    with atomic_file(path, what=f"SFT resume state {path}") as tmp:
        torch.save(state, tmp)


def _train(model, examples, cfg: SFTConfig, *, pad_id: int, progress: bool, desc: str,
           position: int | None, groups: Sequence[Any] | None = None, resume_file: str | None = None,
           resume_key: str = "") -> dict[str, Any]:
    from memopd.optim import build_lr_lambda, build_optimizer

    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    # the trainer's AdamW and schedule (docs/deepspeed.md §6): linear warm-up, then cosine
    # down to min_lr_ratio * lr
    opt = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, build_lr_lambda(cfg.warmup, cfg.steps, "cosine", cfg.min_lr_ratio))
    batches = _batches(examples, cfg.batch_tokens, rng, groups)
    bar = None
    if progress:
        from memopd.progress import progress_bar

        bar = progress_bar(cfg.steps, desc, unit="step", position=position)
    model.train()
    t0, c0 = time.time(), time.process_time()
    ema_loss, ema_acc, tokens = None, None, 0
    history = []
    start, wall0, cpu0 = 0, 0.0, 0.0  # steps, wall and CPU seconds of the runs this one continues
    state = _load_resume_state(resume_file, resume_key)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["torch_rng"])
        start, ema_loss, ema_acc, tokens = state["step"], state["ema_loss"], state["ema_acc"], state["tokens"]
        history, wall0, cpu0 = list(state["history"]), state["wall_s"], state["cpu_s"]
        for _ in range(start):  # the batch stream is a function of the seed alone: replay it
            next(batches)
        if bar is not None:
            bar.update(start)

    def save_state(done: int) -> None:
        _save_resume_state(resume_file, {
            "key": resume_key, "step": done, "model": model.state_dict(), "opt": opt.state_dict(),
            "sched": sched.state_dict(), "torch_rng": torch.get_rng_state(), "ema_loss": ema_loss,
            "ema_acc": ema_acc, "tokens": tokens, "history": history,
            "wall_s": wall0 + time.time() - t0, "cpu_s": cpu0 + time.process_time() - c0})

    saved_at = time.time()
    for step in range(start, cfg.steps):
        ids, labels = _collate(examples, next(batches), pad_id)
        logits = model(input_ids=ids).logits[:, :-1].float()
        tgt = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        with torch.no_grad():
            m = tgt != -100
            acc = (logits.argmax(-1)[m] == tgt[m]).float().mean().item()
        tokens += int(ids.numel())
        lv = float(loss.item())
        ema_loss = lv if ema_loss is None else 0.95 * ema_loss + 0.05 * lv
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        if step % 25 == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": round(ema_loss, 4), "acc": round(ema_acc, 4)})
        if bar is not None:
            bar.set_postfix(loss=f"{ema_loss:.3f}", acc=f"{ema_acc:.3f}")
            bar.update(1)
        if resume_file and (step == cfg.steps - 1 or time.time() - saved_at >= RESUME_SAVE_EVERY_S):
            save_state(step + 1)
            saved_at = time.time()
    if bar is not None:
        bar.close()
    model.eval()
    return {
        "steps": cfg.steps,
        "final_loss": ema_loss,
        "final_action_token_acc": ema_acc,
        "tokens_seen": tokens,
        "wall_s": round(wall0 + time.time() - t0, 2),
        "cpu_s": round(cpu0 + time.process_time() - c0, 2),
        "resumed_from_step": start,
        "history": history,
    }


def save_checkpoint(model, tokenizer, out_dir: str | os.PathLike, meta: dict[str, Any]) -> None:
    """HF save_pretrained of model + tokenizer, plus the environment metadata, then the
    manifest (size + sha256 of every file) that `run_sft` verifies before reusing it.
    Written into a sibling directory that replaces `out_dir` in one rename: a reader sees
    the previous checkpoint or this one, never a part; a failed write (e.g. a full disk)
    leaves `out_dir` as it was and is one `OutputError` (exit 74)."""
    from memopd.files import atomic_directory, write_manifest

    out_dir = os.fspath(out_dir)
    with atomic_directory(out_dir, what=f"SFT checkpoint {out_dir}") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, ENV_META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        write_manifest(tmp)  # complete once the directory takes its name


# Bumped whenever a change of the data, tokenizer or training recipe makes older cached
# checkpoints unlike what `run_sft` would train now (2: byte-level BPE tokenizer and the
# copy warm-up).
CHECKPOINT_VERSION = 2


# Fields of the JSON configs that checkpoints of CHECKPOINT_VERSION 2 always recorded;
# any other field is newer and defaults as above.
_PRE_EXISTING = {
    "world": {"seed", "n_entities", "attributes", "relations", "distractors_per_entity", "two_hop_frac"},
    "sft_config": {f for f in SFTConfig.__dataclass_fields__ if f not in ("policies", "balance_policies")},
}
# Fields that checkpoints recorded for every recipe while the SFT recipe held the
# info-gap experiment's data options (now `InfoGapSFTConfig`, trainer/experiments/infogap_sft.py),
# at the values that mean the plain recipe: a config without them reads them so, and so
# does a checkpoint, so neither a plain nor an info-gap cache is retrained for the move.
_RECIPE_NEUTRAL = {"expert": "scripted", "perturb_frac": 0.0, "redraw_values": False, "state_players": [],
                   "gap_copies": 0}


def _world_json(d: dict[str, Any]) -> dict[str, Any]:
    """A recorded world config as its class writes it now (`WorldConfig.from_json`: the
    fields of an experiment's world that every world recorded at their plain values while
    `WorldConfig` held them are dropped), or as recorded when it does not load."""
    try:
        return WorldConfig.from_json(d).to_json()
    except (DataError, TypeError):
        return d


def _cache_mismatch(path: str, job: dict[str, Any]) -> list[str]:
    """What differs between a cached checkpoint and the training job asked for ([] = reusable)."""
    meta = read_env_meta(path)
    diff = []
    if meta.get("version") != CHECKPOINT_VERSION:
        diff.append(f"checkpoint version {meta.get('version')} (current {CHECKPOINT_VERSION})")
    # a field added after a checkpoint was written reads as its default (which reproduces
    # what the checkpoint was trained with), so adding one does not stale every cache
    defaults = {"world": WorldConfig().to_json(), "sft_config": SFTConfig().to_json()}
    for key, want in (("world", job["world"]), ("env", job["env"]), ("sft_config", job["sft"]),
                      ("model_spec", job["spec"])):
        have = meta.get(key, {})
        if key in defaults:
            have = {**{f: v for f, v in defaults[key].items() if f not in _PRE_EXISTING[key]}, **have}
        if key == "world":
            have = _world_json(have)
        if key == "sft_config":
            have, want = {**_RECIPE_NEUTRAL, **have}, {**_RECIPE_NEUTRAL, **want}
        for name in sorted(set(want) | set(have)):
            if key == "sft_config" and name in ("threads",):
                continue  # how it ran, not what it learned
            if have.get(name) != want.get(name):
                diff.append(f"{key}.{name} {have.get(name)!r} -> {want.get(name)!r}")
    return diff


def checkpoint_exists(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "tokenizer.json", ENV_META_FILE))


def read_env_meta(path: str | os.PathLike) -> dict[str, Any]:
    f = os.path.join(os.fspath(path), ENV_META_FILE)
    if not os.path.exists(f):
        raise DataError(f"{os.fspath(path)!r} is not a memopd env checkpoint (no {ENV_META_FILE}); "
                        "train one with `memopd sft --out DIR`")
    try:
        with open(f, encoding="utf-8") as fh:
            meta = json.load(fh)
    except ValueError as e:  # JSON only: a file of another kind is damaged, never unpickled
        raise DataError(f"{f}: not JSON ({type(e).__name__}: {str(e)[:120]}); the checkpoint is damaged, "
                        "retrain it with `memopd sft --force`") from None
    if not isinstance(meta, dict):
        raise DataError(f"{f}: not a JSON object; the checkpoint is damaged, retrain it with `memopd sft --force`")
    return meta


def _train_role(job: dict[str, Any]) -> dict[str, Any]:
    """Build the data and train + save one role (runs in-process or in a worker)."""
    from .tokenizer import build_tokenizer

    role, out = job["role"], job["out"]
    if job.get("bar_relay") is not None:  # a worker: the parent draws this role's bar
        from memopd.progress import relay_to

        relay_to(job["bar_relay"])

    def log(*a, **k):  # workers cannot receive the caller's log function: print or stay quiet
        if job.get("verbose", True):
            print(*a, **k)
    world_config = WorldConfig.from_json(job["world"])
    env_config = EnvConfig(**job["env"])
    cfg = recipe_class(job.get("recipe", SFTConfig().recipe_name())).from_json(job["sft"])
    spec = ModelSpec(**job["spec"])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.process_time()
    world = World.generate(world_config)
    tokenizer = build_tokenizer(world.vocabulary_texts(), kind="word")
    env = QAEnv.from_world(world, tokenizer, env_config)
    examples, dstats = cfg.build_examples(world, env)
    if dstats["longest"] > spec.max_position_embeddings:
        raise DataError(f"{role}: an SFT example has {dstats['longest']} tokens, beyond the model's "
                        f"{spec.max_position_embeddings} positions")
    log(f"[memopd sft] {role}: expert data: {dstats['episodes']} episodes -> {dstats['calls']} calls, "
        f"{dstats['tokens']} tokens ({time.process_time() - t0:.1f} s CPU)", flush=True)
    model = make_model(spec, tokenizer, seed=cfg.seed, attn_implementation=cfg.attn_implementation)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[memopd sft] {role}: {n_params / 1e6:.2f}M params, {cfg.warmup_copy_steps} copy warm-up + "
        f"{cfg.steps} SFT steps of {cfg.batch_tokens} tokens", flush=True)
    # a killed build resumes each phase where its last state left it (`train_sft`); the key
    # is everything that decides the training, so a state of other settings is not used
    resume_key = json.dumps({**{k: job[k] for k in ("role", "world", "env", "spec")},
                             "sft": {**_RECIPE_NEUTRAL, **job["sft"]}}, sort_keys=True, default=str)
    resume_files = {phase: f"{out}.resume-{phase}.pt" for phase in ("warmup", "sft")}
    warm = None
    if cfg.warmup_copy_steps > 0:
        wex = copy_warmup_examples(len(tokenizer), 20000, first_id=len(SPECIAL_TOKENS), max_len=cfg.warmup_copy_len,
                                   seed=cfg.seed, bos_id=tokenizer.bos_token_id)
        wcfg = replace(cfg, steps=cfg.warmup_copy_steps)
        warm = train_sft(model, wex, wcfg, pad_id=tokenizer.pad_token_id, progress=job["progress"],
                         desc=f"copy warm-up {role}", position=job.get("position"),
                         resume_file=resume_files["warmup"], resume_key=resume_key)
    groups = None
    if cfg.balance_policies:
        groups = [p for p, n in dstats["calls_by_policy"].items() for _ in range(n)]
    stats = train_sft(model, examples, cfg, pad_id=tokenizer.pad_token_id, progress=job["progress"],
                      desc=f"sft {role}", position=job.get("position"), groups=groups,
                      resume_file=resume_files["sft"], resume_key=resume_key)
    if warm is not None:
        stats["warmup"] = {k: v for k, v in warm.items() if k != "history"}
        stats["cpu_s"] = round(stats["cpu_s"] + warm["cpu_s"], 2)
        stats["wall_s"] = round(stats["wall_s"] + warm["wall_s"], 2)
    stats["params"] = n_params
    stats["data"] = dstats
    stats["data_cpu_s"] = round(time.process_time() - t0 - stats["cpu_s"], 2)
    meta = {
        "format": "memopd.env.checkpoint",
        "version": CHECKPOINT_VERSION,
        "role": role,
        "world": world_config.to_json(),
        "env": asdict(env_config),
        "tokenizer_kind": "word",
        "model_spec": asdict(spec),
        "sft_config": cfg.to_json(),
        "sft": {k: v for k, v in stats.items() if k != "history"},
        "sft_history": stats["history"],
    }
    save_checkpoint(model, tokenizer, out, meta)
    for f in resume_files.values():
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)
    log(f"[memopd sft] {role}: saved to {out} (loss {stats['final_loss']:.3f}, action-token acc "
        f"{stats['final_action_token_acc']:.3f}, {stats['cpu_s']:.0f} s CPU, {stats['wall_s']:.0f} s wall)",
        flush=True)
    return {"path": out, "skipped": False, **meta["sft"]}


def _stop_pool(ex) -> None:
    """Cancel what has not started and end the running workers of a ProcessPoolExecutor
    (it has no public way to end a running task before Python 3.14)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)


def run_sft(
    out_dir: str | os.PathLike,
    *,
    roles: Sequence[str] = ("teacher", "student"),
    force: bool = False,
    world_config: WorldConfig | None = None,
    env_config: EnvConfig | None = None,
    sft_configs: dict[str, SFTConfig] | None = None,
    model_specs: dict[str, ModelSpec] | None = None,
    jobs: int | None = None,
    progress: bool = True,
    log=print,
) -> dict[str, Any]:
    """Train (or reuse) each role under `out_dir/<role>`; returns a summary per role.

    With `jobs` > 1 (default: one per role, at most the CPU count) the roles train at
    the same time in separate processes, one torch thread each: tiny models gain little
    from intra-op threads, so two single-threaded trainings use two cores far better.
    """
    out_dir = os.fspath(out_dir)
    preset_specs, preset_cfgs = role_presets(world_config)
    specs = dict(preset_specs, **(model_specs or {}))
    cfgs = dict(preset_cfgs, **(sft_configs or {}))
    for r in roles:
        if r not in specs or r not in cfgs:
            raise ValueError(f"unknown role {r!r}; known: {', '.join(sorted(set(specs) & set(cfgs)))}")
    world_config = world_config or WorldConfig()
    env_config = env_config or EnvConfig()
    EnvConfig(**asdict(env_config))  # validate before spawning anything
    from memopd.files import DirectoryLock, check_writable_dir

    check_writable_dir(out_dir, "SFT output directory")  # a file or read-only place fails now, not after training
    # one builder per cache: a second waits, then reuses what the first built (the same
    # lock as a run directory's: its holder is named, and the kernel frees it if that dies)
    lock = DirectoryLock(out_dir, name=SFT_LOCK_FILE, what="SFT cache")
    lock.acquire(wait=lambda msg: log(f"[memopd sft] {msg}"))
    try:
        return _build_or_reuse(out_dir, roles, force, world_config, env_config, specs, cfgs, jobs, progress, log)
    finally:
        lock.release()


def _build_or_reuse(out_dir, roles, force, world_config, env_config, specs, cfgs, jobs, progress, log) -> dict[str, Any]:
    """`run_sft`'s work once it holds the cache lock."""
    import shutil

    from memopd.files import verify_manifest, weights_fingerprint

    before = {r: weights_fingerprint(os.path.join(out_dir, r)) for r in roles}
    for name in os.listdir(out_dir):  # the half-built directory of a builder that was killed
        if name.endswith(".tmp") and name.split(".")[0] in roles and os.path.isdir(os.path.join(out_dir, name)):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    summary: dict[str, Any] = {}
    todo = []
    jobs_by_role = {
        r: {"role": r, "out": os.path.join(out_dir, r), "world": world_config.to_json(), "env": asdict(env_config),
            "sft": cfgs[r].to_json(), "recipe": cfgs[r].recipe_name(), "spec": asdict(specs[r]), "progress": progress,
            "verbose": log is print}
        for r in roles
    }
    for r in roles:
        d = os.path.join(out_dir, r)
        if not force and os.path.isdir(d) and os.listdir(d):
            # a damaged cache (missing, truncated or altered files) is retrained, never loaded
            damaged = verify_manifest(d) or ([] if checkpoint_exists(d) else ["model files missing"])
            if damaged:
                shown = "; ".join(damaged[:3]) + (f"; +{len(damaged) - 3} more" if len(damaged) > 3 else "")
                log(f"[memopd sft] {r}: cached checkpoint at {d} is damaged or incomplete ({shown}); retraining")
                todo.append(r)
                continue
            diff = _cache_mismatch(d, jobs_by_role[r])
            if not diff:
                log(f"[memopd sft] {r}: checkpoint exists at {d}; skipping (use --force to retrain)")
                summary[r] = {"path": d, "skipped": True, **read_env_meta(d).get("sft", {})}
                continue
            # a stale cache would silently stand in for the model asked for
            shown = "; ".join(diff[:4]) + (f"; +{len(diff) - 4} more" if len(diff) > 4 else "")
            log(f"[memopd sft] {r}: checkpoint at {d} was trained with other settings ({shown}); retraining")
        todo.append(r)
    if not todo:
        return summary
    job_list = [{**jobs_by_role[r], "position": i} for i, r in enumerate(todo)]
    if jobs is None:
        jobs = min(len(todo), os.cpu_count() or 1)
    t0 = time.time()
    if jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from memopd.progress import BarRelay

        # spawn: a clean interpreter per role (fork + torch threads is fragile). One bar
        # per role, drawn here: bars drawn by two processes overwrite each other's line
        with contextlib.ExitStack() as stack:
            relay = stack.enter_context(BarRelay()) if progress else None
            job_list = [{**j, "bar_relay": relay.queue if relay else None} for j in job_list]
            ex = stack.enter_context(ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                                                         mp_context=multiprocessing.get_context("spawn")))
            try:
                for r, res in zip(todo, ex.map(_train_role, job_list)):
                    summary[r] = res
            except BaseException:
                # Ctrl-C or a failed role: leaving the `with` would wait for the other
                # role's whole training. Its model is written as an atomic directory, so
                # stopping it now loses nothing already saved
                _stop_pool(ex)
                raise
    else:
        for r, job in zip(todo, job_list):
            summary[r] = _train_role(job)
    if log is not print:
        for r in todo:
            x = summary[r]
            log(f"[memopd sft] {r}: saved to {x['path']} (loss {x['final_loss']:.3f}, {x['cpu_s']:.0f} s CPU)")
    log(f"[memopd sft] trained {', '.join(todo)} in {time.time() - t0:.0f} s wall")
    for r in todo:
        _tell_replaced(out_dir, r, before[r], weights_fingerprint(os.path.join(out_dir, r)), log)
    return summary


def record_run(cache_dir: str | os.PathLike, run_dir: str, fingerprints: dict[str, dict | None]) -> None:
    """Note in the cache's RUNS_FILE that `run_dir` trains from the cached models whose
    fingerprints (`memopd.files.weights_fingerprint`) are given, so that retraining them
    can name the runs whose --resume the new weights would stop. Best effort (a hint)."""
    from memopd.files import DirectoryLock, atomic_write_json

    cache_dir = os.path.abspath(os.fspath(cache_dir))
    used = {os.path.basename(fp["path"]): fp["sha256"] for fp in fingerprints.values()
            if fp and os.path.dirname(fp["path"]) == cache_dir}
    if not used:
        return
    lock = DirectoryLock(cache_dir, name=".runs.lock", what="SFT cache")
    try:
        lock.acquire(command="run record", wait=lambda _message: None)
        try:
            atomic_write_json(os.path.join(cache_dir, RUNS_FILE), {**_runs(cache_dir), os.path.abspath(run_dir): used})
        finally:
            lock.release()
    except (OSError, UserError):
        pass


def _runs(cache_dir: str) -> dict:
    try:
        with open(os.path.join(cache_dir, RUNS_FILE)) as f:
            runs = json.load(f)
        return runs if isinstance(runs, dict) else {}
    except (OSError, ValueError):
        return {}


def _tell_replaced(out_dir: str, role: str, old: dict | None, new: dict | None, log) -> None:
    """After `role` was retrained over a cached copy: name the runs that trained from the
    replaced weights (their --resume refuses the new ones)."""
    if not old or not new or old["sha256"] == new["sha256"]:
        return
    runs = sorted(run for run, used in _runs(os.path.abspath(out_dir)).items()
                  if isinstance(used, dict) and used.get(role) == old["sha256"] and os.path.isdir(run))
    if runs:
        log(f"[memopd sft] {role}: replaced weights that {len(runs)} run(s) trained from ({', '.join(runs[:3])}"
            f"{', ...' if len(runs) > 3 else ''}; fingerprint {old['sha256'][:16]} -> {new['sha256'][:16]}): "
            "their --resume will refuse the new weights")
