"""The agent protocol: tags, the task prefix, action parsing and observations, on ids.

Each turn the model writes a memory span and then one action:

    <mem> notes</mem><search> query</search>               (ask the retriever)
    <mem> notes</mem><answer> ans1 ; ans2 ; ...</answer>     (answer all k, ends)
    <mem> notes</mem><answer> xa ans1 ; xb ans2</answer>     (same, labelled)

and the environment answers with `<info> doc | doc | ...</info>` or, for a malformed
action, `<info> error : ...</info>`. Parsing works on the sampled ids (the tags are
single tokens), so nothing the model sampled is ever re-tokenised; only the text *inside*
a search/answer span is decoded, to query the retriever or to score the answers.
(Spacing is free for a model; the environment and the expert write a space after an
opening tag and none before a closing one, so every word is its "Ġword" token.)

The task prefix q is `<bos> INSTRUCTION qa question ? qb question ? ...` (questions are
marked with letters, see `index_letters`). Answers are positional (split on ";")
unless the answer starts with a label "x<letters>" (`answer_label`), in which case each
label starts the answer of its question (see `split_answers`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "SPECIAL_TOKENS",
    "INSTRUCTION",
    "ERRORS",
    "MAX_QUESTIONS",
    "DOC_SEPARATOR",
    "NO_RESULTS",
    "ProtocolTokens",
    "ProtocolError",
    "ParsedAction",
    "parse_action",
    "prefix_text",
    "question_marker",
    "answer_label",
    "marker",
    "index_letters",
    "letters_index",
    "split_answers",
]

SPECIAL_TOKENS = (
    "<pad>", "<bos>", "<eos>", "<unk>",
    "<mem>", "</mem>", "<search>", "</search>", "<answer>", "</answer>", "<info>", "</info>",
)

# Short on purpose: q is re-read at every call, and tiny models pay for every token.
INSTRUCTION = "search one fact at a time , keep notes in memory , then answer all in order . questions :"

# Error observations (code -> text). Every word is in the closed-world vocabulary.
ERRORS = {
    "cut_off": "error : no closing search or answer tag ; the action was cut off",
    "no_search_open": "error : missing search tag before the closing tag",
    "no_answer_open": "error : missing answer tag before the closing tag",
    "no_memory": "error : missing memory span before the action",
    "memory_open": "error : the memory span is not closed",
    "two_actions": "error : more than one action in one turn",
    "empty_query": "error : empty search query",
    "info_tag": "error : the agent may not write info tags",
}
DOC_SEPARATOR = "|"
MAX_QUESTIONS = 32  # markers for questions 1..32 exist in the closed-world vocabulary
NO_RESULTS = "no results"


class ProtocolError(ValueError):
    """The tokenizer or the data cannot serve the agent protocol."""


@dataclass(frozen=True)
class ProtocolTokens:
    """Ids of the protocol's special tokens in one tokenizer."""

    pad: int
    bos: int
    eos: int
    unk: int
    mem_open: int
    mem_close: int
    search_open: int
    search_close: int
    answer_open: int
    answer_close: int
    info_open: int
    info_close: int

    @classmethod
    def from_tokenizer(cls, tok) -> "ProtocolTokens":
        ids = []
        for s in SPECIAL_TOKENS:
            enc = tok.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                raise ProtocolError(f"special token {s!r} is not a single token in this tokenizer (got ids {enc})")
            ids.append(int(enc[0]))
        if len(set(ids)) != len(ids):
            raise ProtocolError(f"special tokens share ids: {dict(zip(SPECIAL_TOKENS, ids))}")
        return cls(*ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Generation stops after any of these: an action is complete (or eos)."""
        return (self.search_close, self.answer_close, self.eos)


def index_letters(i: int) -> str:
    """1 -> "a", 26 -> "z", 27 -> "aa", ... (bijective base 26).

    Markers carry letters, not digits: the Qwen2 pre-tokeniser splits every digit into
    its own token, and a marker must stay one token."""
    if i < 1:
        raise ValueError(f"question index must be >= 1, got {i}")
    out = ""
    while i > 0:
        i, r = divmod(i - 1, 26)
        out = chr(ord("a") + r) + out
    return out


def letters_index(s: str) -> int:
    """Inverse of `index_letters`."""
    n = 0
    for ch in s:
        n = n * 26 + (ord(ch) - ord("a") + 1)
    return n


def marker(kind: str, i: int) -> str:
    """Marker word of question i: kind "q" (question), "k" (its first key), "r" (its
    second hop) or "x" (its entry in the notes and its answer label): "qa", "kb", "xc".
    ("x": no English word starts a label by accident, e.g. "no" as an answer.)"""
    return f"{kind}{index_letters(i)}"


def question_marker(i: int) -> str:
    """Marker of question i (1-based) in the prefix: "qa", "qb", ..."""
    return marker("q", i)


def answer_label(i: int) -> str:
    """Label of question i's answer (and of its entry in the expert's notes): "xa", ..."""
    return marker("x", i)


_LABEL = re.compile(r"^x([a-z]+)$")


def split_answers(text: str, k: int) -> list[str]:
    """Answer text -> k answers ("" where missing).

    Positional: "paris ; red" -> ["paris", "red"]. Labelled (the first word is a label
    x<letters> of a question 1..k, see `answer_label`): every label starts the answer of
    its question and ";" is optional: "xa paris ; xb red" -> ["paris", "red"]. A
    repeated label keeps its first answer.
    """
    def label(w: str) -> int | None:
        m = _LABEL.match(w)
        if m and len(m.group(1)) <= 2:
            n = letters_index(m.group(1))
            return n if 1 <= n <= k else None
        return None

    words = text.split()
    first = next((w for w in words if w != ";"), None)
    if first is not None and label(first) is not None:
        out: dict[int, list[str]] = {}
        cur: list[str] | None = None
        for w in words:
            n = label(w)
            if n is not None:
                cur = out.setdefault(n, []) if n not in out else None
                continue
            if w != ";" and cur is not None:
                cur.append(w)
        return [" ".join(out.get(i, [])) for i in range(1, k + 1)]
    parts = [p.strip() for p in text.split(";")]
    return (parts + [""] * k)[:k]


def prefix_text(questions: Sequence[str]) -> str:
    """The task prefix q as text (the `<bos>` id is prepended on ids):
    " INSTRUCTION qa question ? qb question ? ..." (a "?" is added where missing; the
    leading space makes every word its "Ġword" token)."""
    parts = ["", INSTRUCTION]
    for i, q in enumerate(questions, start=1):
        q = q.strip()
        parts.append(f"{question_marker(i)} {q}" if q.endswith("?") else f"{question_marker(i)} {q} ?")
    return " ".join(parts)


@dataclass
class ParsedAction:
    """kind: "search", "answer" or "error". For errors, `error` is a key of ERRORS.

    `memory` is the [start, end) of the memory span in the action ids (tags included),
    `body` the [start, end) of the search/answer content (tags excluded).
    """

    kind: str
    error: str | None = None
    memory: tuple[int, int] | None = None
    body: tuple[int, int] | None = None


def _last_index(ids: Sequence[int], value: int, end: int) -> int:
    for i in range(end - 1, -1, -1):
        if ids[i] == value:
            return i
    return -1


def parse_action(ids: Sequence[int], p: ProtocolTokens, *, require_memory: bool = True) -> ParsedAction:
    """Check one sampled action against the protocol (on ids) and locate its parts."""
    ids = list(ids)
    if any(t in (p.info_open, p.info_close) for t in ids):
        return ParsedAction("error", "info_tag")
    closes = [i for i, t in enumerate(ids) if t in (p.search_close, p.answer_close)]
    if not closes:
        return ParsedAction("error", "cut_off")
    end = closes[0]
    # Generation stops at the first closing tag, so anything after it (or a second
    # action) can only come from a hand-made action; reject rather than guess.
    if len(closes) > 1 or any(t != p.eos for t in ids[end + 1:]):
        return ParsedAction("error", "two_actions")
    kind = "search" if ids[end] == p.search_close else "answer"
    open_id = p.search_open if kind == "search" else p.answer_open
    other_open = p.answer_open if kind == "search" else p.search_open
    start = _last_index(ids, open_id, end)
    if start < 0:
        return ParsedAction("error", "no_search_open" if kind == "search" else "no_answer_open")
    if other_open in ids[:end] or ids[:start].count(open_id):
        return ParsedAction("error", "two_actions")
    mclose = _last_index(ids, p.mem_close, start)
    mopen = _last_index(ids, p.mem_open, start)
    memory = None
    if mopen > mclose:
        return ParsedAction("error", "memory_open")
    if mclose >= 0:
        if mopen < 0:
            return ParsedAction("error", "no_memory")
        memory = (mopen, mclose + 1)
    elif require_memory:
        return ParsedAction("error", "no_memory")
    if any(t in (p.mem_open, p.mem_close) for t in ids[start:end]):
        return ParsedAction("error", "two_actions")
    return ParsedAction(kind, None, memory, (start + 1, end))
