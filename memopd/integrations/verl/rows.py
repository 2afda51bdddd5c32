"""memopd's exact record of one call inside a verl row, and the sessions rebuilt from rows.

The agent loop returns one `AgentLoopOutput` per call; verl's TransferQueue trainer
stores each as a row keyed `{uid}_{session_id}_{i}`. Each row carries, under
`extra_fields[ROW_KEY]`, the call's `memopd.records.Invocation` (prefix, context with
provenance, action ids, sampling log-probs, observation), the action-domain mask of its
response (1 on the sampled tokens that train), the call index, the session's id and call
count, and the session's reward. `call_record` writes that dict; `sessions_from_rows`
groups rows back into `memopd.Trajectory`s (calls in order, every call present), which
`memopd.pack` lays out with restored positions and visibility.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from memopd.records import Invocation, RecordError, Trajectory

__all__ = ["ROW_KEY", "call_record", "sessions_from_rows", "row_record", "session_sizes"]

ROW_KEY = "memopd"


def call_record(inv: Invocation, *, session_id: str, call: int, num_calls: int, reward: float = 0.0,
                group_id: str = "") -> dict[str, Any]:
    """The JSON-able dict a row carries for call `call` of session `session_id`."""
    return {
        "session_id": str(session_id),
        "group_id": str(group_id),
        "call": int(call),
        "num_calls": int(num_calls),
        "reward": float(reward),
        "invocation": inv.to_json(),
        # the exact action domain: every sampled token of this call trains, no context token does
        "action_domain_mask": [1] * len(inv.action_ids),
    }


def row_record(row: Any) -> dict[str, Any]:
    """The memopd record of a row: an `AgentLoopOutput`, its `as_dict()`, or the record itself."""
    extra = getattr(row, "extra_fields", None)
    if extra is None and isinstance(row, dict):
        extra = row.get("extra_fields", row)
    if not isinstance(extra, dict):
        raise RecordError(f"a verl row must carry extra_fields, got {type(row).__name__}")
    rec = extra.get(ROW_KEY, extra if "invocation" in extra else None)
    if not isinstance(rec, dict) or "invocation" not in rec:
        raise RecordError(f"a verl row without memopd's record (extra_fields[{ROW_KEY!r}]): was it produced by the "
                          "memopd_compact_memory agent loop?")
    return rec


def sessions_from_rows(rows: Iterable[Any]) -> tuple[list[Trajectory], list[str]]:
    """Rows (any order) -> (one `Trajectory` per session, in first-seen order; their ids).

    Every session must arrive whole: calls 0..num_calls-1, each once. The invocation of
    each row is checked against the record rules (`Trajectory.validate`)."""
    by_session: dict[str, dict[int, dict]] = {}
    for row in rows:
        rec = row_record(row)
        calls = by_session.setdefault(rec["session_id"], {})
        if rec["call"] in calls:
            raise RecordError(f"session {rec['session_id']!r}: call {rec['call']} appears twice")
        calls[rec["call"]] = rec
    trajs, ids = [], []
    for sid, calls in by_session.items():
        n = {r["num_calls"] for r in calls.values()}
        if len(n) != 1 or sorted(calls) != list(range(n.pop())):
            raise RecordError(f"session {sid!r}: calls {sorted(calls)} of {sorted({r['num_calls'] for r in calls.values()})}"
                              " — a session must be trained whole (all its calls in one batch)")
        ordered = [calls[t] for t in sorted(calls)]
        tr = Trajectory([Invocation.from_json(r["invocation"]) for r in ordered], reward=ordered[-1]["reward"],
                        task_id=sid, group_id=ordered[0].get("group_id", ""))
        tr.validate(where=f"session {sid!r}")
        trajs.append(tr)
        ids.append(sid)
    return trajs, ids


def session_sizes(trajs: Sequence[Trajectory]) -> list[int]:
    """Tokens each session takes in the aligned layout: |q| + sum over calls of |x_t| + |a_t|."""
    return [len(tr.invocations[0].prefix_ids) + sum(len(i.context_ids) + len(i.action_ids) for i in tr.invocations)
            for tr in trajs]
