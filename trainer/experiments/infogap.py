"""The info-gap experiment's measures: information-gap calls, the views' disagreement
ceiling, and the role of each action token.

The rational expert rule these read (infogap_expert.py, `RationalExpert`) uses every
fact the visible context shows, so under compact memory (only the last observation
visible) and under the flattened history (every earlier one) it can act differently:

- `information_gap_calls(trajectories, expert)`: per call, whether the rule acts
  differently on the call as the agent saw it (compact) and on the flattened history of
  the same episode up to that call: the calls where a teacher that reads what it is shown
  prefers another action under the two views; `gap_share` their share.
- `view_disagreement_ceiling(trajectories, expert)`: the top-1 disagreement between the
  views that a *perfect* imitator of the rule would show on those trajectories' action
  tokens (bounds of it, overall and at information-gap calls): what the manipulation
  check's disagreement can reach at best.
- `action_token_roles(action_ids, tokens)`: memory / search / answer per action token.
"""
from __future__ import annotations

from typing import Sequence

from memopd.env.qa.protocol import ProtocolTokens, parse_action
from memopd.env.qa.sft import flattened_prompt

from .infogap_expert import RationalExpert

__all__ = ["information_gap_calls", "gap_share", "common_prefix", "action_token_roles", "view_disagreement_ceiling", "ROLES"]

ROLES = ("memory", "search", "answer", "other")


def information_gap_calls(trajectories, expert: RationalExpert) -> list[list[bool]]:
    """Per trajectory, per call: True where the rule's action on the call as recorded
    (its prefix and context) differs from its action on the flattened history up to it
    (`flattened_prompt`: the state the persistent arm's teacher scores)."""
    out = []
    for tr in trajectories:
        row = []
        for t, inv in enumerate(tr.invocations):
            compact = expert.action_text(list(inv.prefix_ids) + list(inv.context_ids))
            row.append(compact != expert.action_text(flattened_prompt(tr, t)))
        out.append(row)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def view_disagreement_ceiling(trajectories, expert: RationalExpert) -> dict:
    """How often a perfect imitator of the rule would change its top-1 between the views
    on the recorded action tokens, as the manipulation check scores them (teacher-forced
    on the action the agent took, every action token counted).

    Per call: c, f = the rule's actions on the compact call and on the flattened history
    (`information_gap_calls`), a = the recorded action. The imitator's next token after
    a[:j] under a view is the rule's token there while a[:j] follows that view's action
    (the end of the action counts as a token) and is not defined by the rule once a has
    left it. Hence
    - `lower`: positions where both views are defined and differ: at most one per call,
      where c and f part, if a has followed them that far;
    - `upper`: every recorded token from the position where c and f part to the end of
      the action (there the views differ or at least one is undefined), in calls where
      they part;
    - `gap_tokens`: the share of action tokens in information-gap calls (no imitator that
      agrees with itself wherever the rule's views agree can exceed it);
    - `one_per_call`: one token per information-gap call: what an imitator shows that
      prefers the other view's token at the one point where the rule's views part, and
      follows the recorded tokens elsewhere (the rule's views part once per call; after
      that point the rule says nothing about the recorded tokens).
    Each is given as a share of all action tokens (`all`) and of those in
    information-gap calls (`gap_calls`, None without such calls)."""
    n_all = n_gap = low = up = calls = 0
    for tr in trajectories:
        for t, inv in enumerate(tr.invocations):
            a = [int(x) for x in inv.action_ids]
            c = expert.act(list(inv.prefix_ids) + list(inv.context_ids))
            f = expert.act(flattened_prompt(tr, t))
            n_all += len(a)
            if c == f:
                continue
            n_gap += len(a)
            calls += 1 if a else 0
            part = common_prefix(c, f)  # where the two views' actions part
            if part <= min(common_prefix(a, c), common_prefix(a, f)) and part < len(a):
                low += 1
            up += max(0, len(a) - part)

    def share(x, n):
        return x / n if n else None

    return {"action_tokens": n_all, "gap_call_tokens": n_gap,
            "all": {"lower": share(low, n_all), "upper": share(up, n_all), "gap_tokens": share(n_gap, n_all),
                    "one_per_call": share(calls, n_all)},
            "gap_calls": {"lower": share(low, n_gap), "upper": share(up, n_gap), "one_per_call": share(calls, n_gap)}}


def gap_share(flags: list[list[bool]]) -> float:
    """Share of calls that are information-gap calls."""
    n = sum(len(r) for r in flags)
    return sum(sum(r) for r in flags) / n if n else 0.0


def action_token_roles(action_ids: Sequence[int], tokens: ProtocolTokens) -> list[str]:
    """The role of each action token (`ROLES`): inside the memory span (tags included),
    the search or the answer (its tags included), or "other" (a malformed action)."""
    ids = list(action_ids)
    parsed = parse_action(ids, tokens, require_memory=False)
    roles = ["other"] * len(ids)
    if parsed.kind == "error":
        return roles
    act_start = parsed.body[0] - 1
    if parsed.memory is not None:
        for i in range(parsed.memory[0], parsed.memory[1]):
            roles[i] = "memory"
        act_start = parsed.memory[1]
    for i in range(act_start, len(ids)):
        roles[i] = parsed.kind
    return roles
