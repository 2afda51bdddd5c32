"""The info-gap experiment's expert: the rational rule, which uses every fact the visible context shows.

The product's scripted expert (memopd/env/qa/expert.py, `ScriptedExpert`) reads its notes
and the last observation only. The rational rule (`rational_action_text` on text,
`RationalExpert` as an `Engine`) reads *every* observation the prompt shows, so it acts
differently under compact memory and the full history (the info-gap teacher learns it):

- it fills any question's entry from any visible observation (not only the open one),
  noting every needed fact it sees, and skips a search whose fact is visible;
- it corrects an entry that a visible fact contradicts, and re-searches an entry that is
  missing or not a value of its question's attribute;
- otherwise it works as the scripted expert does (same notes, labels, queries, order).

`efficient_calls(world, questions)` is the calls the rule needs on a set when it sees
everything (the info-gap world's per-set turn budget, infogap_world.py, is this + 1).
`EXPERT` is the "rational" expert, which the product's `make_expert` reads from this
module by name (`memopd.env.qa.expert.EXPERTS`; the product imports no experiment).
"""
from __future__ import annotations

import re
from typing import Sequence

from memopd.env.qa.expert import ScriptedExpert, expert_options
from memopd.env.qa.notes import QUESTION, VALUE_SETS, facts_in, is_value, parse_entries, parse_question
from memopd.env.qa.protocol import answer_label, letters_index, marker

__all__ = ["RationalExpert", "rational_action_text", "efficient_calls", "EXPERT"]


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
    for i, vals in parse_entries(mem_text):
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

    @classmethod
    def for_world(cls, tokenizer, world_config) -> "RationalExpert":
        """The rule for a world: its value set and `answer_order`."""
        return cls(tokenizer, values=VALUE_SETS[world_config.value_set], **expert_options(world_config))

    def state(self, ids: Sequence[int]) -> tuple[list[str], str | None, list[str]]:
        """(questions, last notes, every observation) that prompt `ids` shows."""
        ids = [int(i) for i in ids]
        tk = self.tokens
        end_q = next((i for i, t in enumerate(ids) if t in self._tags), len(ids))
        q_text = self.tokenizer.decode(ids[:end_q], skip_special_tokens=True)
        questions = [q for _, q in sorted((letters_index(n), q) for n, q in QUESTION.findall(q_text))]
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


EXPERT = RationalExpert  # what `make_expert("rational", ...)` builds


_SPAN = re.compile(r"<search>(.*?)</search>")


def efficient_calls(world, questions: Sequence[str], max_calls: int = 200) -> int:
    """Calls the rule needs on `questions` when every observation stays visible (the full
    history), searching `world`'s corpus as the environment does (`world.SEARCH_TOP_K` documents)."""
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
