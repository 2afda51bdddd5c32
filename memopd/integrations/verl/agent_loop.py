"""The registered verl agent loop `memopd_compact_memory`: one compact-memory episode through
verl's server manager, one `AgentLoopOutput` per model call.

Each call sends exactly `q + x_t` (the prefix and the current compact context) to
`server_manager.generate` (the session's id as request id, so verl's load balancer keeps
the session on one server), records the sampled ids and log-probs with a
`memopd.recording.Recorder`, asks the environment for the observation, and lets the memory
policy rewrite the context for the next call. The episode's rows carry memopd's exact
record of their call (`memopd.integrations.verl.rows`), from which the trainer restores
and packs the session.

Configuration (top-level `memopd` key of verl's trainer config, Hydra `+memopd.*=`):
`policy` (a `memopd.memory.POLICIES` name; default "window"), `policy_kwargs`,
`max_calls` (cap on calls per episode; default 8), `environment` (dotted path of a
class built as `cls(row)`; default `ScriptedEnvironment`). An environment gives
`reset() -> (prefix_ids, initial_context_ids)` and `step(action_ids) -> (observation_ids,
done, reward | None)`; a reward of None leaves the score to verl's reward loop.

Importing this module imports verl (its `AgentLoopBase`, `AgentLoopOutput`, `register`).
"""
from __future__ import annotations

import importlib
import time
from typing import Any, Sequence
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from memopd.memory import make_policy
from memopd.recording import Recorder

from .rows import ROW_KEY, call_record

__all__ = ["AGENT_NAME", "CompactMemoryAgentLoop", "ScriptedEnvironment", "memopd_settings"]

AGENT_NAME = "memopd_compact_memory"
DEFAULTS = {"policy": "window", "policy_kwargs": {}, "max_calls": 8,
            "environment": "memopd.integrations.verl.agent_loop.ScriptedEnvironment"}


def memopd_settings(config) -> dict[str, Any]:
    """The `memopd` section of verl's trainer config over the defaults (plain dict)."""
    sec = config.get("memopd", None) if hasattr(config, "get") else None
    out = dict(DEFAULTS)
    if sec is not None:
        from omegaconf import OmegaConf

        out.update(OmegaConf.to_container(sec, resolve=True) if not isinstance(sec, dict) else sec)
    return out


def _as_ids(name: str, v: Any) -> list[int]:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"dataset field {name!r} must be a list of token ids, got {type(v).__name__}")
    return [int(x) for x in v]


class ScriptedEnvironment:
    """An id-level environment read from the dataset row: `memopd_prefix_ids` (q),
    optional `memopd_context_ids` (x_0), `memopd_observations` (what the environment
    answers after each call; the episode has one call per entry) and optional
    `memopd_reward` (the session's reward, else None: verl's reward loop scores it)."""

    def __init__(self, row: dict):
        for key in ("memopd_prefix_ids", "memopd_observations"):
            if key not in row:
                raise ValueError(f"ScriptedEnvironment: the dataset row has no {key!r} field")
        self.prefix = _as_ids("memopd_prefix_ids", row["memopd_prefix_ids"])
        self.context = _as_ids("memopd_context_ids", row.get("memopd_context_ids", []))
        obs = row["memopd_observations"]
        obs = obs.tolist() if hasattr(obs, "tolist") else obs
        self.observations = [_as_ids(f"memopd_observations[{i}]", o) for i, o in enumerate(obs)]
        if not self.observations:
            raise ValueError("ScriptedEnvironment: memopd_observations is empty (one entry per call)")
        self.reward = None if row.get("memopd_reward") is None else float(row["memopd_reward"])
        self.t = 0

    def reset(self) -> tuple[list[int], list[int]]:
        self.t = 0
        return self.prefix, self.context

    def step(self, action_ids: Sequence[int]) -> tuple[list[int], bool, float | None]:
        obs = self.observations[self.t]
        self.t += 1
        done = self.t == len(self.observations)
        return obs, done, (self.reward if done else None)


def _environment(path: str, row: dict):
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"memopd.environment={path!r} is not an importable class: {exc}") from None
    return cls(row)


@register(AGENT_NAME)
class CompactMemoryAgentLoop(AgentLoopBase):
    """A compact-memory episode through verl's server manager (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = memopd_settings(self.config)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[AgentLoopOutput]:
        s = self.settings
        env = _environment(s["environment"], kwargs)
        prefix, context = env.reset()
        policy = make_policy(s["policy"], **dict(s.get("policy_kwargs") or {}))
        uid = kwargs.get("uid")
        session = f"{uid}_{kwargs['session_id']}" if uid is not None and "session_id" in kwargs else uuid4().hex
        rec = Recorder(policy, prefix, initial_context_ids=context, task_id=session)
        timings: list[float] = []
        reward = None
        for t in range(int(s["max_calls"])):
            start = time.perf_counter()
            out = await self.server_manager.generate(request_id=session, prompt_ids=rec.prompt_ids(),
                                                     sampling_params=dict(sampling_params))
            timings.append(time.perf_counter() - start)
            action = list(out.token_ids)[: self.response_length]
            logprobs = list(out.log_probs)[: len(action)] if out.log_probs else None
            obs, done, reward = env.step(action)
            last = done or t == int(s["max_calls"]) - 1
            rec.record(action, logprobs, obs, sampling={k: sampling_params.get(k) for k in ("temperature", "top_p", "top_k")},
                       last=last)
            if last:
                break
        n = rec.turn
        outputs = []
        for t, inv in enumerate(rec.invocations):
            record = call_record(inv, session_id=session, call=t, num_calls=n, reward=reward or 0.0,
                                 group_id=str(uid if uid is not None else ""))
            outputs.append(AgentLoopOutput(
                prompt_ids=inv.prefix_ids + inv.context_ids,
                response_ids=inv.action_ids,
                response_mask=record["action_domain_mask"],
                response_logprobs=inv.sample_logprobs,
                reward_score=reward,
                num_turns=2,
                metrics=AgentLoopMetrics(generate_sequences=timings[t]),
                extra_fields={ROW_KEY: record, "turn_scores": [], "tool_rewards": [], "reward_extra_info": {}},
            ))
        return outputs
