"""The agent protocol: tags, the task prefix, action parsing and observations, on ids.

Each turn the model writes a memory span and then one action:

    <mem> notes</mem><search> query</search>               (ask the retriever)
    <mem> notes</mem><answer> ans1 ; ans2 ; ...</answer>     (answer all k, ends)
    <mem> notes</mem><answer> xa ans1 ; xb ans2</answer>     (same, labelled)

and the environment answers with `<info> doc | doc | ...</info>` or, for a malformed
action, `<info> error : ...</info>`. Parsing works on the sampled ids: a tag is its id
sequence in the tokenizer (one special token in the project tokenizer, several tokens in
a generic BPE tokenizer, see `ProtocolTokens`), so nothing the model sampled is ever
re-tokenised; only the text *inside* a search/answer span is decoded, to query the
retriever or to score the answers.
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

from ...errors import UserError

__all__ = [
    "SPECIAL_TOKENS",
    "INSTRUCTION",
    "ERRORS",
    "MAX_QUESTIONS",
    "DOC_SEPARATOR",
    "NO_RESULTS",
    "TAG_NAMES",
    "TAGS",
    "ProtocolTokens",
    "ProtocolError",
    "find_tags",
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


class ProtocolError(UserError, ValueError):
    """The tokenizer or the data cannot serve the agent protocol."""


TAG_NAMES = ("mem_open", "mem_close", "search_open", "search_close", "answer_open", "answer_close",
             "info_open", "info_close")
TAGS = dict(zip(TAG_NAMES, SPECIAL_TOKENS[4:]))  # name -> tag text ("mem_open" -> "<mem>")


@dataclass(frozen=True)
class ProtocolTokens:
    """Ids of the protocol's tags and special tokens in one tokenizer.

    Each tag is an id *sequence* (`mem_open_ids`, ...): the tokenizer's own encoding of
    the tag text alone. The project tokenizer has every tag as one special token (each
    sequence has length 1, and `mem_open` etc. give the id); any other tokenizer (a
    Llama/GPT-2-style BPE) usually splits a tag into several tokens ("<", "mem", ">"),
    which works the same way: the environment writes the tag's sequence, and a tag in a
    sampled action is an exact occurrence of its sequence (see `find_tags`). A model
    must therefore write a tag as this canonical sequence; other tokenisations of the
    same text are not tags (nothing sampled is ever re-tokenised).

    pad / bos / eos / unk are the tokenizer's declared special tokens; bos and unk may be
    None (no `<bos>` then starts the prefix), pad falls back to eos (it only fills left
    padding, which the attention mask hides), eos is required.
    """

    pad: int
    bos: int | None
    eos: int
    unk: int | None
    mem_open_ids: tuple[int, ...]
    mem_close_ids: tuple[int, ...]
    search_open_ids: tuple[int, ...]
    search_close_ids: tuple[int, ...]
    answer_open_ids: tuple[int, ...]
    answer_close_ids: tuple[int, ...]
    info_open_ids: tuple[int, ...]
    info_close_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tok) -> "ProtocolTokens":
        def declared(name: str) -> int | None:
            v = getattr(tok, f"{name}_token_id", None)
            if v is None:  # no declared token: the project's own name, if it is one token
                enc = tok.encode(f"<{name}>", add_special_tokens=False)
                special = set(getattr(tok, "all_special_ids", ()) or ())
                v = int(enc[0]) if len(enc) == 1 and int(enc[0]) in special else None
            return None if v is None else int(v)

        eos = declared("eos")
        if eos is None:
            raise ProtocolError("the tokenizer declares no eos token (eos_token); the agent protocol needs one "
                                "to end generation")
        pad = declared("pad")
        pad = eos if pad is None else pad
        bos, unk = declared("bos"), declared("unk")
        tags: dict[str, tuple[int, ...]] = {}
        basics = {i for i in (pad, bos, eos, unk) if i is not None}
        for name, text in TAGS.items():
            enc = tuple(int(i) for i in tok.encode(text, add_special_tokens=False))
            if not enc:
                raise ProtocolError(f"the tokenizer encodes the tag {text!r} to no ids")
            if basics & set(enc):
                raise ProtocolError(f"the tag {text!r} encodes to ids {list(enc)}, which include a pad/bos/eos/unk "
                                    f"id ({sorted(basics & set(enc))}): the tokenizer cannot represent the tag")
            tags[name] = enc
        # A tag must never occur inside another one (nor equal it): parsing could not tell
        # them apart. ("<", "mem", ">" vs "<", "/", "mem", ">" is fine.)
        for a, sa in tags.items():
            for b, sb in tags.items():
                if a != b and _find(sb, sa, 0) >= 0:
                    raise ProtocolError(f"the tag {TAGS[a]!r} (ids {list(sa)}) occurs inside the tag {TAGS[b]!r} "
                                        f"(ids {list(sb)}) in this tokenizer: tags would be ambiguous")
        return cls(pad, bos, eos, unk, **{f"{n}_ids": s for n, s in tags.items()})

    # ---- the tags ------------------------------------------------------------------
    def tag_ids(self, name: str) -> tuple[int, ...]:
        """The id sequence of tag `name` ("mem_open", ..., see TAG_NAMES)."""
        return getattr(self, f"{name}_ids")

    @property
    def single_token_tags(self) -> bool:
        """Every tag is one token (the project tokenizer)."""
        return all(len(self.tag_ids(n)) == 1 for n in TAG_NAMES)

    @property
    def extra_tag_tokens(self) -> int:
        """Ids an action's four tags take beyond one id each (0 for single-token tags): the
        longest of `<mem>…</mem><search>…</search>` / `<mem>…</mem><answer>…</answer>`."""
        mem = len(self.mem_open_ids) + len(self.mem_close_ids) - 2
        act = max(len(self.search_open_ids) + len(self.search_close_ids),
                  len(self.answer_open_ids) + len(self.answer_close_ids)) - 2
        return mem + act

    def _single(self, name: str) -> int:
        seq = self.tag_ids(name)
        if len(seq) != 1:
            raise ProtocolError(f"the tag {TAGS[name]!r} is {len(seq)} tokens ({list(seq)}) in this tokenizer; "
                                f"use `{name}_ids` (the id sequence)")
        return seq[0]

    mem_open = property(lambda self: self._single("mem_open"), doc="id of `<mem>` (single-token tags only)")
    mem_close = property(lambda self: self._single("mem_close"), doc="id of `</mem>` (single-token tags only)")
    search_open = property(lambda self: self._single("search_open"), doc="id of `<search>` (single-token tags only)")
    search_close = property(lambda self: self._single("search_close"), doc="id of `</search>` (single-token only)")
    answer_open = property(lambda self: self._single("answer_open"), doc="id of `<answer>` (single-token tags only)")
    answer_close = property(lambda self: self._single("answer_close"), doc="id of `</answer>` (single-token only)")
    info_open = property(lambda self: self._single("info_open"), doc="id of `<info>` (single-token tags only)")
    info_close = property(lambda self: self._single("info_close"), doc="id of `</info>` (single-token tags only)")

    @property
    def stop_ids(self) -> tuple[int | tuple[int, ...], ...]:
        """Generation stops right after any of these: an action is complete (or eos).

        An int is a stop id; a tuple is a stop sequence (a multi-token closing tag):
        generation stops once the sampled ids end with it. Single-token tags give ints
        only, so engines that only know stop ids keep working with the project tokenizer.
        """
        out: list[int | tuple[int, ...]] = []
        for seq in (self.search_close_ids, self.answer_close_ids):
            out.append(seq[0] if len(seq) == 1 else tuple(seq))
        out.append(self.eos)
        return tuple(out)

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        """`stop_ids` with every entry as a sequence."""
        return tuple((s,) if isinstance(s, int) else tuple(s) for s in self.stop_ids)


def _find(ids: Sequence[int], seq: Sequence[int], start: int) -> int:
    """First index >= start where `seq` occurs in `ids`, or -1."""
    n = len(seq)
    first = seq[0]
    for i in range(start, len(ids) - n + 1):
        if ids[i] == first and all(ids[i + j] == seq[j] for j in range(1, n)):
            return i
    return -1


def find_tags(ids: Sequence[int], p: ProtocolTokens) -> list[tuple[str, int, int]]:
    """The protocol tags in `ids`, left to right, as (name, start, end) with ids[start:end]
    the tag's sequence. Matching is greedy from the left, a longer tag first where two
    start at the same id; matched ids are consumed (tags never overlap)."""
    by_first: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name in TAG_NAMES:
        seq = p.tag_ids(name)
        by_first.setdefault(seq[0], []).append((name, seq))
    for cands in by_first.values():
        cands.sort(key=lambda c: -len(c[1]))
    out: list[tuple[str, int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        cands = by_first.get(ids[i])
        hit = None
        if cands:
            for name, seq in cands:
                m = len(seq)
                if i + m <= n and (m == 1 or all(ids[i + j] == seq[j] for j in range(1, m))):
                    hit = (name, i, i + m)
                    break
        if hit is None:
            i += 1
        else:
            out.append(hit)
            i = hit[2]
    return out


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


def parse_action(ids: Sequence[int], p: ProtocolTokens, *, require_memory: bool = True) -> ParsedAction:
    """Check one sampled action against the protocol (on ids) and locate its parts.

    Tags are found as their id sequences (`find_tags`); with single-token tags that is
    every occurrence of a tag id. Positions below are those of the tags' first ids."""
    ids = list(ids)
    tags = find_tags(ids, p)
    if any(name in ("info_open", "info_close") for name, _, _ in tags):
        return ParsedAction("error", "info_tag")
    closes = [(name, s, e) for name, s, e in tags if name in ("search_close", "answer_close")]
    if not closes:
        return ParsedAction("error", "cut_off")
    cname, end, close_end = closes[0]
    # Generation stops at the first closing tag, so anything after it (or a second
    # action) can only come from a hand-made action; reject rather than guess.
    if len(closes) > 1 or any(t != p.eos for t in ids[close_end:]):
        return ParsedAction("error", "two_actions")
    kind = "search" if cname == "search_close" else "answer"
    before = [(name, s, e) for name, s, e in tags if s < end]

    def last(name: str, limit: int) -> tuple[int, int] | None:
        hit = None
        for n, s, e in before:
            if n == name and s < limit:
                hit = (s, e)
        return hit

    open_name, other_name = ("search_open", "answer_open") if kind == "search" else ("answer_open", "search_open")
    op = last(open_name, end)
    if op is None:
        return ParsedAction("error", "no_search_open" if kind == "search" else "no_answer_open")
    start, body_start = op
    if any(n == other_name for n, _, _ in before) or any(n == open_name and s < start for n, s, _ in before):
        return ParsedAction("error", "two_actions")
    mclose = last("mem_close", start)
    mopen = last("mem_open", start)
    memory = None
    if mopen is not None and (mclose is None or mopen[0] > mclose[0]):
        return ParsedAction("error", "memory_open")
    if mclose is not None:
        if mopen is None:
            return ParsedAction("error", "no_memory")
        memory = (mopen[0], mclose[1])
    elif require_memory:
        return ParsedAction("error", "no_memory")
    if any(n in ("mem_open", "mem_close") and start <= s < end for n, s, _ in before):
        return ParsedAction("error", "two_actions")
    return ParsedAction(kind, None, memory, (body_start, end))
