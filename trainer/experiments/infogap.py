"""One rational expert rule for both views, information-gap calls, and perturbed states.

The scripted expert (`expert.py`) reads only its notes and the last observation, so it
acts the same whether it is shown a compact call or the whole flattened history: a
teacher that imitates it is indifferent to the view. The rule here uses *every fact the
visible context shows*:

- it fills any question's entry from any visible observation (not only the open one),
  noting every needed fact it sees, and skips a search whose fact is visible;
- it corrects an entry that a visible fact contradicts, and re-searches an entry that is
  missing or not a value of its question's attribute;
- otherwise it works as the scripted expert does (same notes, labels, queries, order).

Under compact memory (`summary`) only the last observation is visible; under the full
history every earlier one is, so the expert reads back. `RationalExpert` is the rule as
an `Engine` (it acts on prompt ids, as models do), `rational_action_text` the rule on text.

- `information_gap_calls(trajectories, tokenizer, ...)`: per call, whether the rule acts
  differently on the call as the agent saw it (compact) and on the flattened history of
  the same episode up to that call: the calls where a teacher that reads what it is shown
  prefers another action under the two views.
- `view_disagreement_ceiling(trajectories, expert)`: the top-1 disagreement between the
  views that a *perfect* imitator of the rule would show on those trajectories' action
  tokens (bounds of it, overall and at information-gap calls): what the manipulation
  check's disagreement can reach at best.
- `perturbed_state(...)`: a call's context with one entry of its notes dropped or
  corrupted (the teacher's SFT data holds a share of these, each labelled by the rule
  under that view, so it learns the view-dependent recovery).
- `efficient_calls(world, questions)`: the calls the rule needs on a set when it sees
  everything (the world's per-set turn budget is this + 1).
- `action_token_roles(action_ids, tokens)`: memory / search / answer per action token.
"""
from __future__ import annotations

import random
import re
from typing import Sequence

from .expert import _FACT, _QUESTION, ScriptedExpert, _parse_entries
from .protocol import ProtocolTokens, answer_label, letters_index, marker, parse_action
from .world import is_value, parse_question

__all__ = ["facts_in", "rational_action_text", "RationalExpert", "efficient_calls", "information_gap_calls",
           "perturbed_state", "action_token_roles", "view_disagreement_ceiling", "ROLES", "EXPERTS", "make_expert"]

ROLES = ("memory", "search", "answer", "other")
EXPERTS = ("scripted", "rational")


def facts_in(text: str) -> dict[tuple[str, str], str]:
    """{(entity, key): value} of every fact a text (observations) states; later ones win."""
    return {(x, a): v for a, x, v in _FACT.findall(text or "")}


def _resolve(q, vals: list[str] | None, facts: dict, values: dict) -> list[str]:
    """The entry of question q from its notes `vals` and the visible `facts`: a final
    value, a middle entity (two-hop, second hop pending) or [] (nothing known)."""
    attr, rel, x = q
    valid = bool(vals) and " ".join(vals) in values.get(attr, ())
    if rel is None:
        if (x, attr) in facts:
            return facts[(x, attr)].split()
        return list(vals) if valid else []
    y = facts.get((x, rel))
    if y is None and vals and len(vals) == 1 and not is_value(vals[0]):
        y = vals[0]  # the middle entity its notes hold
    if y is not None and (y, attr) in facts:
        return facts[(y, attr)].split()
    if valid:
        return list(vals)
    return [y] if y is not None else []


def _final(q, vals: list[str], values: dict) -> bool:
    return bool(vals) and " ".join(vals) in values.get(q[0], ())


def rational_action_text(questions: Sequence[str], mem_text: str | None, info_texts: Sequence[str], *,
                         values: dict, descending: bool = False) -> str:
    """The rule's next action as text, from the visible notes and observations (see the
    module doc). `values`: the world's value set (attribute -> values), which tells a
    final value from a middle entity and a valid entry from a corrupted one."""
    qs = [parse_question(q) for q in questions]
    notes: dict[int, list[str]] = {}
    for i, vals in _parse_entries(mem_text):
        if 1 <= i <= len(qs) and i not in notes:  # a repeated label keeps its first entry
            notes[i] = vals
    facts: dict = {}
    for t in info_texts:
        facts.update(facts_in(t))
    order = range(len(qs), 0, -1) if descending else range(1, len(qs) + 1)
    entries: dict[int, list[str]] = {}
    search = None
    for i in order:
        q = qs[i - 1]
        if q is None:
            entries[i] = ["unknown"]  # a question the rule cannot parse
            continue
        vals = _resolve(q, notes.get(i), facts, values)
        if vals or i in notes:
            entries[i] = vals
        if search is None and not _final(q, vals, values):
            attr, rel, x = q
            entries[i] = vals
            if rel is not None and len(vals) == 1 and not is_value(vals[0]):
                search = f"{marker('r', i)} {attr} {vals[0]}"
            else:
                entries[i] = []
                search = f"{marker('q', i)} {x} {marker('k', i)} {rel or attr}"
    written = [i for i in order if i in entries]
    mem = " ".join(" ".join([answer_label(i)] + entries[i]) for i in written)
    mem_span = f"<mem> {mem}</mem>" if mem else "<mem></mem>"
    if search is not None:
        return f"{mem_span}<search> {search}</search>"
    ans = " ; ".join(f"{answer_label(i)} {' '.join(entries[i]) or 'unknown'}" for i in order)
    return f"{mem_span}<answer> {ans}</answer>"


class RationalExpert(ScriptedExpert):
    """The rule as an `Engine`: it reads the questions, the last notes and every
    observation in the prompt (one under compact memory, all under the full history)."""

    def __init__(self, tokenizer, *, values: dict, descending: bool = False):
        super().__init__(tokenizer, descending=descending)
        self.values = values

    def state(self, ids: Sequence[int]) -> tuple[list[str], str | None, list[str]]:
        """(questions, last notes, every observation) that prompt `ids` shows."""
        ids = [int(i) for i in ids]
        tk = self.tokens
        end_q = next((i for i, t in enumerate(ids) if t in self._tags), len(ids))
        q_text = self.tokenizer.decode(ids[:end_q], skip_special_tokens=True)
        questions = [q for _, q in sorted((letters_index(n), q) for n, q in _QUESTION.findall(q_text))]
        mem = self._span_text(ids, tk.mem_open, tk.mem_close, end_q)
        infos, i = [], end_q
        while i < len(ids):
            if ids[i] == tk.info_open:
                j = next((j for j in range(i + 1, len(ids)) if ids[j] == tk.info_close), None)
                if j is None:
                    break
                infos.append(self.tokenizer.decode(ids[i + 1:j], skip_special_tokens=True))
                i = j
            i += 1
        return questions, mem, infos

    def action_text(self, ids: Sequence[int]) -> str:
        questions, mem, infos = self.state(ids)
        return rational_action_text(questions, mem, infos, values=self.values, descending=self.descending)

    def act(self, prompt: Sequence[int]) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(self.action_text(prompt), add_special_tokens=False)]


def make_expert(name: str, tokenizer, world_config):
    """The SFT data's expert by name (`EXPERTS`): "scripted" (`expert.ScriptedExpert`,
    what the student imitates) or "rational" (`RationalExpert`, the teacher's rule)."""
    from .expert import expert_options
    from .world import VALUE_SETS

    opts = expert_options(world_config)
    if name == "scripted":
        return ScriptedExpert(tokenizer, **opts)
    if name == "rational":
        return RationalExpert(tokenizer, values=VALUE_SETS[world_config.value_set], **opts)
    raise ValueError(f"unknown expert {name!r}; choose from {', '.join(EXPERTS)}")


_SPAN = re.compile(r"<search>(.*?)</search>")


def efficient_calls(world, questions: Sequence[str], max_calls: int = 200) -> int:
    """Calls the rule needs on `questions` when every observation stays visible (the full
    history), searching `world`'s corpus as the environment does (`LINK_TOP_K` documents)."""
    from .world import VALUE_SETS

    values = VALUE_SETS[world.config.value_set]
    descending = world.config.answer_order == "descending"
    mem, infos = None, []
    for calls in range(1, max_calls + 1):
        text = rational_action_text(questions, mem, infos, values=values, descending=descending)
        m = re.search(r"<mem>(.*?)</mem>", text)
        mem = m.group(1) if m else None
        s = _SPAN.search(text)
        if s is None:
            return calls
        infos.append(" | ".join(d.display for d in world.retriever.search(s.group(1))))
    raise RuntimeError(f"the expert did not answer {list(questions)} within {max_calls} calls")


def flattened_prompt(traj, t: int) -> list[int]:
    """What the `flatten` layout shows before call t's action: the persistent history
    `[q, x_0, a_0, ..., x_{t-1}, a_{t-1}, x_t]` (memopd.records, `flattened_tokens`);
    under compact memory every x_s holds the observation before it, so every earlier
    observation is in it."""
    ids = list(traj.invocations[0].prefix_ids)
    for inv in traj.invocations[:t]:
        ids += list(inv.context_ids) + list(inv.action_ids)
    return ids + list(traj.invocations[t].context_ids)


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
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
            part = _common_prefix(c, f)  # where the two views' actions part
            if part <= min(_common_prefix(a, c), _common_prefix(a, f)) and part < len(a):
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


def _last_mem_span(ids: Sequence[int], tk: ProtocolTokens) -> tuple[int, int] | None:
    close = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == tk.mem_close), None)
    if close is None:
        return None
    open_ = next((i for i in range(close - 1, -1, -1) if ids[i] == tk.mem_open), None)
    return None if open_ is None else (open_, close + 1)


def perturbed_state(context_ids: Sequence[int], tokenizer, world, rng: random.Random) -> list[int] | None:
    """`context_ids` with one entry of its last notes dropped or corrupted (a wrong value of
    its attribute, or another middle entity), or None when the notes hold no filled entry."""
    tk = ProtocolTokens.from_tokenizer(tokenizer)
    ids = [int(i) for i in context_ids]
    span = _last_mem_span(ids, tk)
    if span is None:
        return None
    text = tokenizer.decode(ids[span[0] + 1:span[1] - 1], skip_special_tokens=True)
    entries = _parse_entries(text)
    filled = [j for j, (_, vals) in enumerate(entries) if vals]
    if not filled:
        return None
    j = rng.choice(filled)
    vals = entries[j][1]
    if rng.random() < 0.5:
        del entries[j]
    else:
        joined = " ".join(vals)
        pool = [v for a in world.config.attributes for v in world.values[a] if joined in world.values[a]]
        if len(vals) == 1 and not is_value(vals[0]):
            pool = world.entities
        choices = [v for v in pool if v != joined]
        if not choices:
            del entries[j]
        else:
            entries[j][1] = rng.choice(choices).split()
    mem = " ".join(" ".join([answer_label(i)] + v) for i, v in entries)
    new = tokenizer.encode(f"<mem> {mem}</mem>" if mem else "<mem></mem>", add_special_tokens=False)
    return ids[:span[0]] + [int(i) for i in new] + ids[span[1]:]


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
