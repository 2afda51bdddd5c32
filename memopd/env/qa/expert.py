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

`make_expert` picks an expert by name (`EXPERTS`): "scripted" is this one; an experiment's
expert is named by the module that defines it, imported when asked for ("rational", the
info-gap experiment's rule that reads every visible fact:
trainer/experiments/infogap_expert.py).
"""
from __future__ import annotations

import importlib
from typing import Sequence

from ..rollout import Sample, rollout
from .notes import FACT, QUESTION, is_value, parse_entries, parse_question
from .protocol import ProtocolTokens, answer_label, letters_index, marker

__all__ = ["ScriptedExpert", "expert_action_text", "expert_options", "expert_trajectories", "EXPERTS", "make_expert"]


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

    @classmethod
    def for_world(cls, tokenizer, world_config) -> "ScriptedExpert":
        """The expert for a world (`expert_options`: its `answer_order`)."""
        return cls(tokenizer, **expert_options(world_config))

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


# The experts by name: an `Engine` class with `for_world(tokenizer, world_config)`, or the
# name of the module that defines an experiment's such class as `EXPERT`, imported when
# that expert is asked for (this package imports no experiment). "scripted": what the
# student imitates; "rational": the info-gap teacher's rule, which reads every visible fact.
EXPERTS: dict[str, type | str] = {
    "scripted": ScriptedExpert,
    "rational": "memopd.trainer.experiments.infogap_expert",
}


def make_expert(name: str, tokenizer, world_config):
    """The expert `name` (`EXPERTS`) for a world's tasks, built by its `for_world`."""
    found = EXPERTS.get(name)
    if found is None:
        raise ValueError(f"unknown expert {name!r}; choose from {', '.join(EXPERTS)}")
    if isinstance(found, str):
        found = importlib.import_module(found).EXPERT
    return found.for_world(tokenizer, world_config)
