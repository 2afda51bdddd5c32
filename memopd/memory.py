"""Memory policies (docs/design.md §5) and a model-free trajectory driver.

A policy rewrites the mutable context after each call, on token ids only:
`update(context_ids, action_ids, observation_ids, ...) -> ContextUpdate(ids, provenance)`.
Every token of the next context carries provenance `(source, call, offset)` (see
`memopd.records.Source`), so a later copy of action text is known to be context.

`drive(policy, prefix_ids, steps)` turns a stream of (action, observation) ids into a
valid `Trajectory` without a model; `random_trajectories` makes many for tests/audits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from .records import Invocation, Source, Trajectory

__all__ = [
    "ContextUpdate",
    "MemoryPolicy",
    "FullRetention",
    "SuffixRetention",
    "SummaryReplacement",
    "SlidingWindow",
    "RetrievalRefresh",
    "POLICIES",
    "POLICY_CLASSES",
    "make_policy",
    "drive",
    "random_trajectories",
]

Prov = tuple[int, int, int]


@dataclass
class ContextUpdate:
    ids: list[int]
    provenance: list[Prov]


def _tagged(ids: Sequence[int], source: int, call: int) -> list[Prov]:
    return [(source, call, i) for i in range(len(ids))]


class MemoryPolicy:
    """Base class. Subclasses implement `update`; `name` is the CLI/registry key
    (`POLICY_CLASSES`); `parameters` the keyword arguments a run may set
    (`env.policy_kwargs`); `memory_tags`: built with the ids of the memory span's tags."""

    name = "base"
    parameters: tuple[str, ...] = ()
    memory_tags = False

    def update(
        self,
        context_ids: Sequence[int],
        action_ids: Sequence[int],
        observation_ids: Sequence[int],
        *,
        context_provenance: Sequence[Prov] | None = None,
        call: int = 0,
    ) -> ContextUpdate:
        raise NotImplementedError

    @staticmethod
    def _ctx_prov(context_ids: Sequence[int], context_provenance: Sequence[Prov] | None) -> list[Prov]:
        if context_provenance is None:
            return [(Source.TEMPLATE, -1, -1)] * len(context_ids)
        if len(context_provenance) != len(context_ids):
            raise ValueError(
                f"context_provenance has {len(context_provenance)} entries for {len(context_ids)} context tokens"
            )
        return list(context_provenance)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class FullRetention(MemoryPolicy):
    """Keep everything: next context = context + full response + observation."""

    name = "full"

    def update(self, context_ids, action_ids, observation_ids, *, context_provenance=None, call=0):
        prov = self._ctx_prov(context_ids, context_provenance)
        ids = list(context_ids) + list(action_ids) + list(observation_ids)
        prov = prov + _tagged(action_ids, Source.ACTION, call) + _tagged(observation_ids, Source.OBSERVATION, call)
        return ContextUpdate(ids, prov)


class SuffixRetention(MemoryPolicy):
    """Keep only the last `max_tokens` tokens of context + response + observation."""

    name = "suffix"
    parameters = ("max_tokens",)

    def __init__(self, max_tokens: int = 64):
        if max_tokens < 1:
            raise ValueError(f"SuffixRetention.max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = int(max_tokens)

    def update(self, context_ids, action_ids, observation_ids, *, context_provenance=None, call=0):
        full = FullRetention().update(
            context_ids, action_ids, observation_ids, context_provenance=context_provenance, call=call
        )
        return ContextUpdate(full.ids[-self.max_tokens:], full.provenance[-self.max_tokens:])


def _tag_seq(tag) -> tuple[int, ...]:
    if isinstance(tag, int) or hasattr(tag, "__index__"):
        return (int(tag),)
    seq = tuple(int(i) for i in tag)
    if not seq:
        raise ValueError("a memory tag needs at least one id")
    return seq


def _rfind(ids: Sequence[int], seq: tuple[int, ...], limit: int) -> int:
    """Last i with ids[i:i+len(seq)] == seq and i + len(seq) <= limit, or -1."""
    n = len(seq)
    for i in range(limit - n, -1, -1):
        if ids[i] == seq[0] and all(ids[i + j] == seq[j] for j in range(1, n)):
            return i
    return -1


def _last_span(ids: Sequence[int], open_id, close_id) -> tuple[int, int] | None:
    """[start, end) of the last `open ... close` span (tags included), or None.

    A tag is one id or an id sequence: the last occurrence of the closing tag, and the
    last occurrence of the opening tag that ends before it."""
    o, c = _tag_seq(open_id), _tag_seq(close_id)
    cs = _rfind(ids, c, len(ids))
    if cs < 0:
        return None
    os_ = _rfind(ids, o, cs)
    return None if os_ < 0 else (os_, cs + len(c))


class SummaryReplacement(MemoryPolicy):
    """Replace the context with the memory span of the response plus the observation.

    The span is the last `mem_open … mem_close` of the action, tags included. With no
    complete span the memory is empty (the agent forgot to write one: its loss). A tag
    is one id, or an id sequence for a tokenizer that splits the tag into several tokens.
    """

    name = "summary"
    memory_tags = True

    def __init__(self, mem_open_id: "int | Sequence[int]", mem_close_id: "int | Sequence[int]"):
        o, c = _tag_seq(mem_open_id), _tag_seq(mem_close_id)
        self.mem_open_id = o[0] if len(o) == 1 else o
        self.mem_close_id = c[0] if len(c) == 1 else c

    def update(self, context_ids, action_ids, observation_ids, *, context_provenance=None, call=0):
        span = _last_span(action_ids, self.mem_open_id, self.mem_close_id)
        ids: list[int] = []
        prov: list[Prov] = []
        if span is not None:
            s, e = span
            ids += list(action_ids[s:e])
            prov += [(Source.ACTION, call, i) for i in range(s, e)]
        ids += list(observation_ids)
        prov += _tagged(observation_ids, Source.OBSERVATION, call)
        return ContextUpdate(ids, prov)


class SlidingWindow(MemoryPolicy):
    """Keep the initial context and the last `turns` (response, observation) turns."""

    name = "window"
    parameters = ("turns",)

    def __init__(self, turns: int = 2):
        if turns < 1:
            raise ValueError(f"SlidingWindow.turns must be >= 1, got {turns}")
        self.turns = int(turns)

    def update(self, context_ids, action_ids, observation_ids, *, context_provenance=None, call=0):
        prov = self._ctx_prov(context_ids, context_provenance)
        oldest = call - self.turns + 1
        keep = [i for i, p in enumerate(prov) if p[1] == -1 or p[1] >= oldest]
        ids = [context_ids[i] for i in keep] + list(action_ids) + list(observation_ids)
        prov = [prov[i] for i in keep] + _tagged(action_ids, Source.ACTION, call) + _tagged(
            observation_ids, Source.OBSERVATION, call
        )
        return ContextUpdate(ids, prov)


class RetrievalRefresh(MemoryPolicy):
    """Keep responses, but the new observation replaces the old one(s)."""

    name = "refresh"

    def update(self, context_ids, action_ids, observation_ids, *, context_provenance=None, call=0):
        prov = self._ctx_prov(context_ids, context_provenance)
        keep = [i for i, p in enumerate(prov) if p[0] != Source.OBSERVATION]
        ids = [context_ids[i] for i in keep] + list(action_ids) + list(observation_ids)
        prov = [prov[i] for i in keep] + _tagged(action_ids, Source.ACTION, call) + _tagged(
            observation_ids, Source.OBSERVATION, call
        )
        return ContextUpdate(ids, prov)


# The registry: name -> class. A new policy is its class plus one entry (docs/design.md §6.7).
POLICY_CLASSES: dict[str, type[MemoryPolicy]] = {
    "full": FullRetention,
    "suffix": SuffixRetention,
    "summary": SummaryReplacement,
    "window": SlidingWindow,
    "refresh": RetrievalRefresh,
}
POLICIES = tuple(POLICY_CLASSES)


def make_policy(name: str, *, mem_open_id: int | None = None, mem_close_id: int | None = None, **kwargs) -> MemoryPolicy:
    """Build a policy by registry name (`POLICY_CLASSES`) with its `parameters` as keyword
    arguments; a keyword the policy does not take is a `TypeError` naming those it takes."""
    cls = POLICY_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown memory policy {name!r}; choose one of {', '.join(POLICIES)}")
    unknown = sorted(set(kwargs) - set(cls.parameters))
    if unknown:
        takes = ", ".join(sorted(cls.parameters)) if cls.parameters else "no parameters"
        raise TypeError(f"the {name!r} policy takes {takes}, not {', '.join(unknown)}")
    if cls.memory_tags:
        if mem_open_id is None or mem_close_id is None:
            raise ValueError(f"the {name!r} policy needs mem_open_id and mem_close_id")
        return cls(mem_open_id, mem_close_id, **kwargs)
    return cls(**kwargs)


def drive(
    policy: MemoryPolicy,
    prefix_ids: Sequence[int],
    steps: Iterable[tuple[Sequence[int], Sequence[int]]],
    *,
    initial_context_ids: Sequence[int] = (),
    sample_logprobs: Sequence[Sequence[float]] | None = None,
    reward: float = 0.0,
    task_id: str = "",
    group_id: str = "",
) -> Trajectory:
    """Build a Trajectory from (action_ids, observation_ids) steps, applying `policy`.

    Call t's context is what the policy built from call t-1 (call 0's is
    `initial_context_ids`). The last observation is kept on the record even though no
    further call sees it.
    """
    ctx = list(initial_context_ids)
    prov: list[Prov] = [(Source.TEMPLATE, -1, -1)] * len(ctx)
    invs = []
    for t, (act, obs) in enumerate(steps):
        lp = None if sample_logprobs is None else list(sample_logprobs[t])
        invs.append(
            Invocation(
                prefix_ids=list(prefix_ids),
                context_ids=list(ctx),
                action_ids=list(act),
                sample_logprobs=lp,
                provenance=list(prov),
                observation_ids=list(obs),
            )
        )
        upd = policy.update(ctx, act, obs, context_provenance=prov, call=t)
        ctx, prov = upd.ids, upd.provenance
    return Trajectory(invs, reward=reward, task_id=task_id, group_id=group_id)


def random_trajectories(
    policy: MemoryPolicy | str,
    n: int,
    *,
    vocab_size: int = 128,
    seed: int = 0,
    group_size: int = 1,
    calls: tuple[int, int] = (2, 5),
    prefix_len: tuple[int, int] = (3, 12),
    action_len: tuple[int, int] = (1, 10),
    obs_len: tuple[int, int] = (0, 8),
    initial_context_len: tuple[int, int] = (0, 4),
    mem_open_id: int = 1,
    mem_close_id: int = 2,
    with_logprobs: bool = True,
    group_context: bool = False,
    group_steps: int = 0,
) -> list[Trajectory]:
    """Random but valid trajectories for tests, audits and benchmarks (no model).

    Actions sometimes contain a `mem_open … mem_close` span so summary replacement has
    something to keep; trajectories of one group (`group_size` in a row) share their
    prefix, like rollouts of one prompt. Ids 0..2 are reserved (pad/mem tags).
    `group_context`: the rollouts of a group also share their initial context x_0;
    `group_steps`: and their first `group_steps` (action, observation) steps, so that
    their early calls are identical (what the trie layout shares). Both off, the draws
    are those of before the options existed.
    """
    if isinstance(policy, str):
        policy = make_policy(policy, mem_open_id=mem_open_id, mem_close_id=mem_close_id)
    rng = random.Random(seed)
    lo = 3
    if vocab_size <= lo + 1:
        raise ValueError("vocab_size too small for random trajectories")

    def toks(rng_range):
        return [rng.randrange(lo, vocab_size) for _ in range(rng.randint(*rng_range))]

    out = []
    prefix: list[int] = []
    shared_ctx: list[int] = []
    shared_steps: list = []
    for i in range(n):
        first_of_group = i % group_size == 0
        if first_of_group:
            prefix = toks(prefix_len)
            if not prefix:
                prefix = [lo]
        steps = []
        lps = []
        for _ in range(rng.randint(*calls)):
            act = toks(action_len) or [lo]
            if rng.random() < 0.6 and len(act) >= 1:
                a, b = sorted(rng.sample(range(len(act) + 1), 2)) if len(act) >= 1 else (0, 0)
                act = act[:a] + [mem_open_id] + act[a:b] + [mem_close_id] + act[b:]
            steps.append((act, toks(obs_len)))
            lps.append([-rng.uniform(0.01, 5.0) for _ in act])
        ctx0 = toks(initial_context_len)
        if group_context:
            if first_of_group:
                shared_ctx = ctx0
            ctx0 = shared_ctx
        if group_steps:
            if first_of_group:
                shared_steps = list(zip(steps, lps))[:group_steps]
            k = min(len(shared_steps), len(steps))
            steps[:k] = [s for s, _ in shared_steps[:k]]
            lps[:k] = [lp for _, lp in shared_steps[:k]]
        out.append(
            drive(
                policy,
                prefix,
                steps,
                initial_context_ids=ctx0,
                sample_logprobs=lps if with_logprobs else None,
                reward=rng.uniform(0, 1),
                task_id=f"task{i // group_size}",
                group_id=f"g{i // group_size}",
            )
        )
    return out
