"""Recording one episode's model calls for any sampler: the `Recorder`.

A sampler (HF `generate`, vLLM, a hosted endpoint, a hand-written loop) makes one call at
a time; the recorder holds the episode's exact state between calls:

    rec = Recorder(policy, prefix_ids)                  # q, stable all episode
    while not done:
        ids_in = rec.prompt_ids()                       # q + x_t: send exactly these ids
        ids_out, logprobs = my_sampler(ids_in)          # the ids sampled, never re-encoded
        obs = my_environment(ids_out)                   # observation ids (may be empty)
        rec.record(ids_out, logprobs, obs, sampling={"temperature": 1.0, "seed": 7})
    trajectory = rec.trajectory(reward=r)

`record` stores the call as an `Invocation` (prefix, context with provenance, the sampled
ids, their log-probs, the observation) and asks the memory policy for the next context
x_{t+1}, on ids only. The per-call sampling settings given to `record` (temperature,
top-p, top-k, seed, engine) are kept in `trajectory.info["sampling"]["calls"]`, so a
rollout can be replayed. `memopd.env.qa.Episode` records through one of these, so every
engine behind `memopd.env.rollout.rollout` (HFEngine, VLLMEngine) goes through the same
path as a user's own loop.
"""
from __future__ import annotations

from typing import Any, Sequence

from .memory import MemoryPolicy
from .records import Invocation, RecordError, Source, Trajectory

__all__ = ["Recorder"]


class Recorder:
    """The exact state and record of one episode (see module doc).

    prefix_ids: q. initial_context_ids: x_0 (template tokens). policy: a
    `memopd.memory.MemoryPolicy` (or its registry name with `policy_kwargs`), which builds
    x_{t+1} from (x_t, a_t, o_t)."""

    def __init__(self, policy: MemoryPolicy | str, prefix_ids: Sequence[int], *, initial_context_ids: Sequence[int] = (),
                 task_id: str = "", group_id: str = "", **policy_kwargs):
        if isinstance(policy, str):
            from .memory import make_policy

            policy = make_policy(policy, **policy_kwargs)
        elif policy_kwargs:
            raise TypeError(f"Recorder: policy_kwargs {sorted(policy_kwargs)} given with a policy object")
        self.policy = policy
        self.prefix_ids = [int(i) for i in prefix_ids]
        self.context_ids: list[int] = [int(i) for i in initial_context_ids]
        self.context_provenance: list[tuple[int, int, int]] = [(int(Source.TEMPLATE), -1, -1)] * len(self.context_ids)
        self.invocations: list[Invocation] = []
        self.calls_sampling: list[dict[str, Any]] = []
        self.task_id = str(task_id)
        self.group_id = str(group_id)

    @property
    def turn(self) -> int:
        """Calls recorded so far."""
        return len(self.invocations)

    def prompt_ids(self) -> list[int]:
        """Exactly the ids the model receives at the next call: q + x_t."""
        return self.prefix_ids + self.context_ids

    def record(self, action_ids: Sequence[int], logprobs: Sequence[float] | None = None,
               observation_ids: Sequence[int] = (), *, sampling: dict[str, Any] | None = None,
               last: bool = False) -> list[int]:
        """Record one call (the ids sampled for `prompt_ids()`, their log-probs, what the
        environment answered) and build the next context; returns the next prompt ids.
        `last=True` records a final call: the context is not advanced."""
        action_ids = [int(i) for i in action_ids]
        if not action_ids:
            raise RecordError(f"call {self.turn}: an action needs at least one sampled id")
        if logprobs is not None and len(logprobs) != len(action_ids):
            raise RecordError(f"call {self.turn}: {len(logprobs)} log-probs for {len(action_ids)} sampled ids")
        obs = [int(i) for i in observation_ids]
        t = self.turn
        self.invocations.append(Invocation(
            prefix_ids=list(self.prefix_ids), context_ids=list(self.context_ids), action_ids=action_ids,
            sample_logprobs=None if logprobs is None else [float(x) for x in logprobs],
            provenance=list(self.context_provenance), observation_ids=obs))
        self.calls_sampling.append(dict(sampling) if sampling else {})
        if not last:
            upd = self.policy.update(self.context_ids, action_ids, obs, context_provenance=self.context_provenance, call=t)
            self.context_ids, self.context_provenance = list(upd.ids), list(upd.provenance)
        return self.prompt_ids()

    def sampling_info(self) -> dict[str, Any] | None:
        """The per-call sampling settings given to `record`, or None if none were."""
        if not any(self.calls_sampling):
            return None
        return {"calls": [dict(c) for c in self.calls_sampling]}

    def trajectory(self, reward: float = 0.0, *, rewards: dict | None = None, info: dict | None = None) -> Trajectory:
        """The calls so far as a validated `Trajectory` (sampling settings in info["sampling"])."""
        if not self.invocations:
            raise RecordError("the recorder holds no call yet")
        info = dict(info or {})
        s = self.sampling_info()
        if s is not None:
            info.setdefault("sampling", {}).update(s)
        tr = Trajectory(list(self.invocations), reward=float(reward), task_id=self.task_id, group_id=self.group_id,
                        rewards=dict(rewards or {}), info=info)
        tr.validate()
        return tr
