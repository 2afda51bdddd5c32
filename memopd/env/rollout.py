"""Rollout engine: many episodes at once, every model call recorded exactly.

- `Engine` is the interface a generator implements (`HFEngine` here, `VLLMEngine` in
  `memopd.env.vllm_engine`): `generate(prompts, max_new_tokens=, temperature=, top_p=,
  stop_ids=, seed=)` returns one `Sample(ids, logprobs, finish, sampling=)` per prompt;
  `sampling` is the settings the request was drawn with, kept per call in the trajectory.
- `HFEngine` runs a Hugging Face causal LM: left-padded batches, explicit attention mask
  and position ids (so a padded row sees the positions it would see alone), KV cache,
  and its own temperature / top-p sampling. Generation stops right after a stop id
  (`</search>`, `</answer>`, eos), included in the sample, or at `max_new_tokens`. A stop
  entry may be an id sequence (a closing tag that the tokenizer splits into several
  tokens): generation then stops once the sampled ids end with it.
- `Environment` is the interface `rollout` and the trainer drive (`QAEnv` implements it;
  docs/design.md, "Adding an environment"): `reset(task, group_id=)` returns an
  `EnvEpisode` (`qa.Episode` is one), `tokens` gives the stop ids and the pad id, and
  the optional members (`tokens.extra_tag_tokens`, `answer_words`) have declared
  defaults that a class subclassing the protocol inherits. `TaskSource` is where the
  trainer draws question sets from (`World`, `UserTasks`): `sample_tasks(k, n, split=,
  seed=)`.
- `rollout(env, engine, tasks, ...)` drives `Environment` episodes: each round it sends
  every live episode's `prompt_ids()` (q + x_t) to the engine, and hands the sampled ids, as
  they are, to `episode.step`, which records them in an `Invocation`. The action ids are
  the sampled ids (never decoded and re-encoded); observations are tokenised by the
  environment; the next context is built on ids by the memory policy, with provenance
  (the episode records through a `memopd.recording.Recorder`, as a user's own loop does).

Recorded log-probs (`Sample.logprobs` -> `Invocation.sample_logprobs`) are the
log-probabilities of the sampled ids under the tempered, untruncated distribution
log_softmax(logits[:vocab_size] / temperature): the policy a trainer recomputes at the
same temperature (PPO ratio, RCE audit). Greedy decoding (temperature 0) records the
temperature-1 log-probs. `HFEngine(vocab_size=V)` samples only ids < V (lm_head rows
past the tokenizer's vocabulary are padding). The log-probability after top-p
truncation is in `Sample.sampling_logprobs`. `rollout` stores the settings with every
trajectory (`info["sampling"]`: temperature, top_p, vocab_size) so a trainer can refuse
trajectories drawn from another distribution than the one it scores.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from memopd.records import Trajectory

__all__ = ["Sample", "Engine", "HFEngine", "Environment", "EnvTokens", "EnvEpisode", "TaskSource", "sample_next",
           "rollout", "default_max_new_tokens", "split_stops"]


@dataclass
class Sample:
    """What an engine sampled for one prompt.

    ids: the sampled ids, stop id included when one was hit. logprobs: the model's
    log-softmax at the sampling temperature (1 when greedy), before top-p, at each
    sampled id, or None for non-model engines.
    finish: "stop" (a stop id ended it) or "length" (max_new_tokens reached).
    """

    ids: list[int]
    logprobs: list[float] | None
    finish: str = "stop"
    sampling_logprobs: list[float] | None = None
    # the settings this request was sampled with (engine, temperature, top_p, top_k, seed),
    # kept per call in the trajectory (info["sampling"]["calls"]) so a rollout can be replayed
    sampling: dict | None = None


@runtime_checkable
class Engine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float,
        stop_ids: Sequence[int | Sequence[int]],  # ids, or id sequences (multi-token closing tags)
        seed: int | None = None,
    ) -> list[Sample]: ...


@runtime_checkable
class EnvTokens(Protocol):
    """The ids `rollout` and the trainer need from an environment's tokenizer."""

    stop_ids: Sequence[int | Sequence[int]]  # a sample ends right after one (ids, or multi-token closing tags)
    pad: int  # the id left-padded batches are filled with
    # ids an action's tags take beyond one id each; rollout adds it to every call's budget
    extra_tag_tokens: int = 0


@runtime_checkable
class EnvEpisode(Protocol):
    """One episode of an `Environment`: its calls are recorded as they are made."""

    task: Any  # has `k` (questions: sizes the default action budget) and `task_id`
    done: bool
    invocations: list  # the recorded calls so far (empty: stopped before its first)
    rollout_index: int  # which of the task's group this is; set by `rollout`

    def prompt_ids(self) -> list[int]: ...

    def step(self, action_ids: list[int], logprobs: list[float] | None) -> Any: ...

    def stop(self, reason: str) -> None: ...

    def trajectory(self) -> Trajectory: ...


@runtime_checkable
class Environment(Protocol):
    """What `rollout` and the trainer use of an environment (`QAEnv` is one).

    Required: `reset`, `tokens`, `tokenizer` (its size bounds the sampled ids, and the
    trainer saves it with the model). Optional, with the defaults below: a class that
    subclasses `Environment` inherits them, so `rollout` reads them directly."""

    tokens: EnvTokens
    tokenizer: Any
    # words the longest answer may take: sizes the default action budget
    answer_words: int = 1

    def reset(self, task: Any, *, group_id: str | None = None) -> EnvEpisode: ...


@runtime_checkable
class TaskSource(Protocol):
    """Where a trainer draws question sets from (`World`, `UserTasks`)."""

    def sample_tasks(self, k: int, n: int, *, split: str = "train", seed: int = 0) -> list: ...


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None):
    """Draw one id per row of `logits` [B, V].

    Returns (ids [B], log-prob [B] under log_softmax(logits / temperature) (temperature
    1 when greedy), log-prob [B] under the distribution actually sampled from, i.e.
    after top-p). temperature <= 0 means greedy.
    """
    logits = logits.float()
    if temperature <= 0:
        ids = logits.argmax(dim=-1)
        raw = torch.log_softmax(logits, dim=-1)
        return ids, raw.gather(-1, ids[:, None])[:, 0], torch.zeros_like(ids, dtype=torch.float32)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    raw = logp
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(dim=-1)
        # Keep a token if the mass strictly before it is < top_p (the first always stays).
        drop_sorted = (cum - sorted_lp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    ids = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return ids, raw.gather(-1, ids[:, None])[:, 0], logp.gather(-1, ids[:, None])[:, 0]


class HFEngine:
    """`Engine` over a HF causal LM (KV cache, left-padded batches, own sampling)."""

    def __init__(self, model, *, pad_id: int = 0, batch_size: int = 32, device: str | torch.device | None = None,
                 vocab_size: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if vocab_size is not None:
            rows = int(model.get_output_embeddings().weight.shape[0])
            if not 1 <= vocab_size <= rows:
                raise ValueError(f"vocab_size must be in [1, {rows}] (the lm_head's rows), got {vocab_size}")
        self.vocab_size = int(vocab_size) if vocab_size is not None else None  # None: every row
        self.model = model
        self.pad_id = int(pad_id)
        self.batch_size = int(batch_size)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values -> cache; accept both.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def _forward(self, ids, mask, pos, cache, logits_to_keep: int = 1):
        from transformers import DynamicCache

        kw = {self._cache_kw: cache if cache is not None else DynamicCache()}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=logits_to_keep, **kw)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        # only ids the tokenizer can emit: padded lm_head rows are never sampled
        return out.logits[:, -1, : self.vocab_size].float(), new_cache  # [:None] keeps all

    @torch.no_grad()
    def _generate_batch(self, prompts, limits, temperature, top_p, stop_set, generator,
                        stop_seqs: tuple[tuple[int, ...], ...] = ()) -> list[Sample]:
        B = len(prompts)
        L = max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, L - len(p):] = 1
        # Position of a real token = number of real tokens before it: exactly the
        # positions the prompt would have alone, so padding changes nothing.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        logits, cache = self._forward(ids, mask, pos, None)
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        out_slp: list[list[float]] = [[] for _ in range(B)]
        finish = ["length"] * B
        live = [lim > 0 for lim in limits]
        for _ in range(max(limits)):
            tok, raw, samp = sample_next(logits, temperature, top_p, generator)
            tok_l, raw_l, samp_l = tok.tolist(), raw.tolist(), samp.tolist()
            for b in range(B):
                if not live[b]:
                    continue
                out_ids[b].append(int(tok_l[b]))
                out_lp[b].append(float(raw_l[b]))
                out_slp[b].append(float(samp_l[b]))
                if tok_l[b] in stop_set or (stop_seqs and _ends_with_any(out_ids[b], stop_seqs)):
                    live[b], finish[b] = False, "stop"
                elif len(out_ids[b]) >= limits[b]:
                    live[b] = False
            if not any(live):
                break
            # Finished rows keep decoding (their tokens are discarded): cheaper than
            # reshaping the cache, and it cannot affect the live rows.
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=mask.device)], dim=1)
            pos = pos[:, -1:] + 1
            logits, cache = self._forward(tok[:, None].to(self.device), mask, pos, cache)
        return [Sample(out_ids[b], out_lp[b], finish[b], out_slp[b]) for b in range(B)]

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=(), seed=None):
        prompts = [[int(t) for t in p] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("HFEngine.generate: an empty prompt has nothing to condition on")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_new_tokens values for {len(prompts)} prompts")
        stop_set, stop_seqs = split_stops(stop_ids)
        generator = None
        if seed is not None and temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(int(seed))
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Sample | None] = [None] * len(prompts)
            # Similar lengths together: less padding. Order is deterministic.
            order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
            for s in range(0, len(order), self.batch_size):
                chunk = order[s:s + self.batch_size]
                res = self._generate_batch([prompts[i] for i in chunk], [limits[i] for i in chunk],
                                           temperature, top_p, stop_set, generator, stop_seqs)
                for i, r in zip(chunk, res):
                    # one generator per generate(): the seed reproduces the whole batch, in this order
                    r.sampling = {"engine": "hf", "temperature": float(temperature), "top_p": float(top_p),
                                  "top_k": 0, "seed": None if seed is None else int(seed), "seed_scope": "batch"}
                    out[i] = r
        finally:
            self.model.train(was_training)
        return out  # type: ignore[return-value]


def default_max_new_tokens(k: int, answer_words: int = 1) -> int:
    """Room for the longest expert action on k questions (notes + k labelled answers of
    up to `answer_words` words each + separators + tags), with one id per tag (`rollout`
    adds what multi-token tags take beyond that). 24 + 5k for one-word answers."""
    return 24 + (3 + 2 * answer_words) * k


def split_stops(stop_ids) -> tuple[set[int], tuple[tuple[int, ...], ...]]:
    """Stop entries (ids, or id sequences for multi-token closing tags) as (a set of stop
    ids, the sequences of two or more ids)."""
    single: set[int] = set()
    seqs: list[tuple[int, ...]] = []
    for x in stop_ids:
        if isinstance(x, int) or hasattr(x, "__index__"):
            single.add(int(x))
            continue
        seq = tuple(int(i) for i in x)
        if not seq:
            raise ValueError("an empty stop sequence")
        if len(seq) == 1:
            single.add(seq[0])
        else:
            seqs.append(seq)
    return single, tuple(seqs)


def _ends_with_any(ids: list[int], seqs: tuple[tuple[int, ...], ...]) -> bool:
    n = len(ids)
    for s in seqs:
        m = len(s)
        if n >= m and ids[n - 1] == s[-1] and tuple(ids[n - m:]) == s:
            return True
    return False


def rollout(
    env: Environment,
    engine: Engine,
    tasks,
    *,
    group_size: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int | None = None,
    seed: int = 0,
    group_prefix: str = "",
    progress: bool = False,
) -> list[Trajectory]:
    """Run `group_size` episodes per task with `engine`; return their Trajectories.

    Trajectories come task-major (all rollouts of task 0, then task 1, ...); rollouts of
    one task share `group_id = group_prefix + task_id`. Each round sends one call of
    every live episode to the engine in a single `generate`, with seed `seed + round`.
    An episode whose next prompt would not fit the model's position limit is stopped
    (`info["finish"] == "overflow"`).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    episodes = []
    for task in tasks:
        for g in range(group_size):
            ep = env.reset(task, group_id=f"{group_prefix}{task.task_id}")
            ep.rollout_index = g
            episodes.append(ep)
    if not episodes:
        return []
    max_pos = getattr(engine, "max_positions", None)
    stop_ids = env.tokens.stop_ids
    extra = env.tokens.extra_tag_tokens  # multi-token tags take more room
    answer_words = env.answer_words
    bar = None
    if progress:
        from memopd.progress import progress_bar

        bar = progress_bar(len(episodes), "rollout", unit="ep")
    calls: dict[int, list[dict]] = {id(e): [] for e in episodes}  # per-call sampling settings
    rnd = 0
    while True:
        live = [e for e in episodes if not e.done]
        if not live:
            break
        prompts, limits, active = [], [], []
        for e in live:
            p = e.prompt_ids()
            lim = max_new_tokens if max_new_tokens is not None else default_max_new_tokens(e.task.k, answer_words) + extra
            if max_pos is not None:
                lim = min(lim, max_pos - len(p))
                if lim < 1:
                    e.stop("overflow")
                    continue
            prompts.append(p)
            limits.append(lim)
            active.append(e)
        if active:
            samples = engine.generate(prompts, max_new_tokens=limits, temperature=temperature, top_p=top_p,
                                      stop_ids=stop_ids, seed=seed + rnd)
            if len(samples) != len(active):
                raise RuntimeError(f"engine returned {len(samples)} samples for {len(active)} prompts")
            for e, s in zip(active, samples):
                if not s.ids:
                    e.stop("empty_action")
                    continue
                e.step(s.ids, s.logprobs)
                calls[id(e)].append(dict(s.sampling or {}))
        if bar is not None:
            bar.update(sum(e.done for e in episodes) - bar.n)
        rnd += 1
    if bar is not None:
        bar.close()
    out = []
    for e in episodes:
        if not e.invocations:
            continue  # stopped before its first call (prompt longer than the model)
        tr = e.trajectory()
        tr.info["rollout_index"] = e.rollout_index
        tr.info["sampling"] = {"temperature": float(temperature), "top_p": float(top_p),
                               "vocab_size": getattr(engine, "vocab_size", None)}
        if any(calls[id(e)]):
            tr.info["sampling"]["calls"] = calls[id(e)]
        out.append(tr)
    return out
