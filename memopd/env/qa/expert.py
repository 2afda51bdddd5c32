"""A scripted expert that solves generated-world tasks through the agent protocol.

The expert is an `Engine` (see `rollout`): it receives the same prompt ids a model would
(q + x_t), decodes them, and returns action ids. Its decision is a function of that
visible state only (plus the closed list of attribute values, which tells a value from
an entity name), so a model can in principle imitate it exactly.

Its notes (the `<mem>` span) hold one entry per question, in order: "xa tailor xb rezu
xc" (or from the last question down, "xc tailor xb rezu xa", in a world whose
`answer_order` is "descending": then the entry labelled "xa" is always the last one, and
the decision to answer is made right after writing it). The label "x<letters>"
(`protocol.answer_label`) opens question i's entry when its first search is sent; the
entry then holds the answer, or, for a two-hop question half done, the middle entity (an
entity name rather than a value is what marks "second hop pending"). Each turn the expert

1. copies its notes and fills the open entry from the `<info>` documents: the value of
   the fact its last search asked for ("friend of loro is rezu ." -> "rezu"; a second
   hop's value replaces the middle entity);
2. searches the next needed fact: for a first hop the question's words up to the key
   ("qa gite ka job", "qb loro kb friend"), for a second hop "r<letters> <attribute>
   <middle entity>" ("rb color rezu"); marker words match no document, they only let a
   small model copy the right words (see `world.question_text`). A new question's
   entry is opened in the same notes;
3. or, once every entry holds a value, answers with the labelled list
   `<answer> xa tailor ; xb red</answer>` (its notes, with separators).

Every step is a copy (of the notes, of the word after a marker) or a lookup (the
first document's fact), which keeps the imitation learnable for tiny models. Samples
carry no log-probs (`Sample.logprobs = None`): the expert is not a distribution. Only
generated-world questions ("X ka A ?", "X kb R rb A ?") are supported; a question it
cannot parse is answered "unknown" without a search.

The rational rule (`RationalExpert`, `rational_action_text` on text) uses *every fact the
visible context shows*, so it acts differently under compact memory and the full history
(the teacher of the info-gap world learns it):

- it fills any question's entry from any visible observation (not only the open one),
  noting every needed fact it sees, and skips a search whose fact is visible;
- it corrects an entry that a visible fact contradicts, and re-searches an entry that is
  missing or not a value of its question's attribute;
- otherwise it works as the scripted expert does (same notes, labels, queries, order).

`make_expert` picks one by name (`EXPERTS`); `efficient_calls(world, questions)` is the
calls the rule needs on a set when it sees everything (the info-gap world's per-set
turn budget, trainer/experiments/infogap_world.py, is this + 1).
"""
from __future__ import annotations

import re
from typing import Sequence

from ..rollout import Sample, rollout
from .notes import FACT, QUESTION, VALUE_SETS, facts_in, is_value, parse_entries, parse_question
from .protocol import ProtocolTokens, answer_label, letters_index, marker

__all__ = ["ScriptedExpert", "expert_action_text", "expert_options", "expert_trajectories", "rational_action_text",
           "RationalExpert", "EXPERTS", "make_expert", "efficient_calls"]

EXPERTS = ("scripted", "rational")

def _wanted(q, values: list[str]) -> tuple[str, str] | None:
    """The fact (entity, key word) that entry `values` of question q still needs."""
    if q is None:
        return None
    attr, rel, x = q
    if not values:
        return (x, rel or attr)
    if rel is not None and len(values) == 1 and not is_value(values[0]):  # an entity: the middle step
        return (values[0], attr)
    return None


def expert_action_text(questions: Sequence[str], mem_text: str | None, info_text: str | None, *,
                       descending: bool = False) -> str:
    """The expert's next action as text, from what it can see. `descending`: work from
    the last question to the first (`WorldConfig.answer_order`), answering in that order."""
    qs = [parse_question(q) for q in questions]
    entries = [e for e in parse_entries(mem_text) if 1 <= e[0] <= len(qs)]
    if entries and info_text is not None:
        i, vals = entries[-1]
        want = _wanted(qs[i - 1], vals)
        if want is not None:
            facts = {(x, a): v for a, x, v in FACT.findall(info_text)}
            if want in facts:
                vals[:] = facts[want].split()  # a second hop's value replaces the middle entity
    search = None
    while True:
        if entries:
            i, vals = entries[-1]
            want = _wanted(qs[i - 1], vals)
            if want is not None:
                if not vals:
                    search = f"{marker('q', i)} {want[0]} {marker('k', i)} {want[1]}"
                else:
                    search = f"{marker('r', i)} {want[1]} {want[0]}"
                break
            if not vals:
                vals.append("unknown")  # a question the expert cannot parse
        if descending:
            nxt = entries[-1][0] - 1 if entries else len(qs)
        else:
            nxt = entries[-1][0] + 1 if entries else 1
        if not 1 <= nxt <= len(qs):
            break
        entries.append([nxt, []])
    # A space after each opening tag and none before a closing one: every word is then
    # its single "Ġword" token.
    mem = " ".join(" ".join([answer_label(i)] + vals) for i, vals in entries)
    mem_span = f"<mem> {mem}</mem>" if mem else "<mem></mem>"
    if search is not None:
        return f"{mem_span}<search> {search}</search>"
    final = {i: " ".join(vals) for i, vals in entries}
    order = range(len(qs), 0, -1) if descending else range(1, len(qs) + 1)
    ans = " ; ".join(f"{answer_label(i)} {final.get(i, 'unknown')}" for i in order)
    return f"{mem_span}<answer> {ans}</answer>"


def expert_options(world_config) -> dict:
    """The expert's settings for a world (its `answer_order`)."""
    return {"descending": world_config.answer_order == "descending"}


class ScriptedExpert:
    """The expert as an `Engine`: prompts in, action ids out (deterministic)."""

    def __init__(self, tokenizer, *, descending: bool = False):
        self.tokenizer = tokenizer
        self.descending = descending
        self.tokens = ProtocolTokens.from_tokenizer(tokenizer)
        tk = self.tokens
        self._tags = {tk.mem_open, tk.mem_close, tk.search_open, tk.search_close, tk.answer_open,
                      tk.answer_close, tk.info_open, tk.info_close}

    def _span_text(self, ids: list[int], open_id: int, close_id: int, start: int) -> str | None:
        """Text of the last complete open…close span at or after `start`, or None."""
        close = None
        for i in range(len(ids) - 1, start - 1, -1):
            if close is None and ids[i] == close_id:
                close = i
            elif close is not None and ids[i] == open_id:
                return self.tokenizer.decode(ids[i + 1:close], skip_special_tokens=True)
        return None

    def act(self, prompt: Sequence[int]) -> list[int]:
        ids = [int(i) for i in prompt]
        tk = self.tokens
        # The prefix q holds no protocol tag: it ends where the first tag starts.
        end_q = next((i for i, t in enumerate(ids) if t in self._tags), len(ids))
        q_text = self.tokenizer.decode(ids[:end_q], skip_special_tokens=True)
        found = sorted((letters_index(n), q) for n, q in QUESTION.findall(q_text))
        questions = [q for _, q in found]
        mem = self._span_text(ids, tk.mem_open, tk.mem_close, end_q)
        info = self._span_text(ids, tk.info_open, tk.info_close, end_q)
        text = expert_action_text(questions, mem, info, descending=self.descending)
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=(), seed=None):
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        out = []
        for p, lim in zip(prompts, limits):
            ids = self.act(p)[: int(lim)]
            out.append(Sample(ids=ids, logprobs=None, finish="stop" if ids and ids[-1] in stop_ids else "length"))
        return out


def expert_trajectories(env, tasks, *, descending: bool = False, **kwargs):
    """Run the expert on `tasks` through `env` (the same loop as models); Trajectories."""
    return rollout(env, ScriptedExpert(env.tokenizer, descending=descending), tasks, temperature=0.0, **kwargs)


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


def make_expert(name: str, tokenizer, world_config):
    """The SFT data's expert by name (`EXPERTS`): "scripted" (`ScriptedExpert`,
    what the student imitates) or "rational" (`RationalExpert`, the teacher's rule)."""
    opts = expert_options(world_config)
    if name == "scripted":
        return ScriptedExpert(tokenizer, **opts)
    if name == "rational":
        return RationalExpert(tokenizer, values=VALUE_SETS[world_config.value_set], **opts)
    raise ValueError(f"unknown expert {name!r}; choose from {', '.join(EXPERTS)}")


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
