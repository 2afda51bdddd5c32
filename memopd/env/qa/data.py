"""Corpus and question-set records of the QA environment, and their JSONL loaders.

A `Document` is `{"id", "text"}` with an optional `"title"` (searched and shown as
"title : text", like Wikipedia-derived corpora); a `Task` is one multi-objective question set (the k
questions answered in one episode) with answer aliases per question. Users bring their
own data as JSON Lines:

- corpus: one document per line, `{"id": "...", "text": "..."}` (optional `"title"`);
- question sets: one set per line, `{"questions": [...], "answers": [[alias, ...], ...]}`
  (optional `"id"`; an answer may also be a plain string, read as one alias).

Every loader error names the file and the 1-based line number, so a broken line in a
100k-line file can be found.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from ...errors import UserError

__all__ = [
    "DataError",
    "Document",
    "Task",
    "load_corpus_jsonl",
    "load_tasks_jsonl",
    "save_corpus_jsonl",
    "save_tasks_jsonl",
]


class DataError(UserError, ValueError):
    """A corpus or question-set file (or object) is malformed."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str | None = None

    @property
    def display(self) -> str:
        """What a search shows (and indexes): "title : text", or the text alone."""
        return f"{self.title} : {self.text}" if self.title else self.text


@dataclass
class Task:
    """One question set: k questions answered together in one episode.

    answers[i] holds the accepted aliases of question i (scored with max over aliases).
    support[i] (optional) holds the ids of the documents that prove answer i; the
    generated world fills it, user data usually does not. meta is free-form.
    """

    task_id: str
    questions: list[str]
    answers: list[list[str]]
    support: list[list[str]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.questions:
            raise DataError(f"task {self.task_id!r}: has no questions")
        if len(self.answers) != len(self.questions):
            raise DataError(
                f"task {self.task_id!r}: {len(self.questions)} questions but {len(self.answers)} answer lists"
            )
        for i, a in enumerate(self.answers):
            if not a:
                raise DataError(f"task {self.task_id!r}: question {i} has no answer alias")
        if self.support is not None and len(self.support) != len(self.questions):
            raise DataError(f"task {self.task_id!r}: support has {len(self.support)} entries for {len(self.questions)} questions")

    @property
    def k(self) -> int:
        return len(self.questions)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"id": self.task_id, "questions": self.questions, "answers": self.answers}
        if self.support is not None:
            d["support"] = self.support
        if self.meta:
            d["meta"] = self.meta
        return d


def _read_jsonl(path: str | os.PathLike, what: str) -> Iterable[tuple[int, Any]]:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{what} file {path!r} does not exist")
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are harmless
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def load_corpus_jsonl(path: str | os.PathLike) -> list[Document]:
    """Read `{"id", "text"}` lines; ids must be unique strings, texts non-empty strings."""
    docs: list[Document] = []
    seen: dict[str, int] = {}
    for lineno, d in _read_jsonl(path, "corpus"):
        where = f"{os.fspath(path)}:{lineno}"
        if not isinstance(d, dict):
            raise DataError(f"{where}: expected an object {{\"id\", \"text\"}}, got {type(d).__name__}")
        if "id" not in d or "text" not in d:
            raise DataError(f"{where}: a document needs both 'id' and 'text' (has {sorted(d)})")
        did, text = d["id"], d["text"]
        if isinstance(did, int) and not isinstance(did, bool):
            did = str(did)
        if not isinstance(did, str) or not did:
            raise DataError(f"{where}: 'id' must be a non-empty string, got {did!r}")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: 'text' must be a non-empty string")
        if did in seen:
            raise DataError(f"{where}: duplicate document id {did!r} (first on line {seen[did]})")
        title = d.get("title")
        if title is not None and (not isinstance(title, str) or not title.strip()):
            raise DataError(f"{where}: 'title' must be a non-empty string when given")
        unknown = set(d) - {"id", "text", "title"}
        if unknown:
            raise DataError(f"{where}: unknown fields {sorted(unknown)}")
        seen[did] = lineno
        docs.append(Document(did, text, title))
    if not docs:
        raise DataError(f"{os.fspath(path)}: the corpus is empty")
    return docs


def _aliases(a: Any, where: str, i: int) -> list[str]:
    if isinstance(a, str):
        a = [a]
    if not isinstance(a, list) or not a:
        raise DataError(f"{where}: answers[{i}] must be a non-empty list of alias strings")
    out = []
    for j, s in enumerate(a):
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            s = str(s)
        if not isinstance(s, str) or not s.strip():
            raise DataError(f"{where}: answers[{i}][{j}] = {s!r} is not a non-empty string")
        out.append(s)
    return out


def load_tasks_jsonl(path: str | os.PathLike, *, id_prefix: str | None = None) -> list[Task]:
    """Read question sets: `{"questions": [...], "answers": [[aliases...], ...]}` per line."""
    tasks: list[Task] = []
    stem = id_prefix if id_prefix is not None else os.path.splitext(os.path.basename(os.fspath(path)))[0]
    for lineno, d in _read_jsonl(path, "question-set"):
        where = f"{os.fspath(path)}:{lineno}"
        if not isinstance(d, dict):
            raise DataError(f"{where}: expected an object with 'questions' and 'answers', got {type(d).__name__}")
        unknown = set(d) - {"id", "questions", "answers", "support", "meta"}
        if unknown:
            raise DataError(f"{where}: unknown fields {sorted(unknown)}")
        qs, ans = d.get("questions"), d.get("answers")
        if not isinstance(qs, list) or not qs:
            raise DataError(f"{where}: 'questions' must be a non-empty list of strings")
        for i, q in enumerate(qs):
            if not isinstance(q, str) or not q.strip():
                raise DataError(f"{where}: questions[{i}] is not a non-empty string")
        if not isinstance(ans, list):
            raise DataError(f"{where}: 'answers' must be a list (one alias list per question)")
        if len(ans) != len(qs):
            raise DataError(f"{where}: {len(qs)} questions but {len(ans)} answers")
        answers = [_aliases(a, where, i) for i, a in enumerate(ans)]
        support = d.get("support")
        if support is not None and (not isinstance(support, list) or len(support) != len(qs)):
            raise DataError(f"{where}: 'support' must be a list with one entry per question")
        tid = d.get("id", f"{stem}-{len(tasks):05d}")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise DataError(f"{where}: 'meta' must be an object")
        tasks.append(Task(str(tid), list(qs), answers, support=support, meta=meta))
    if not tasks:
        raise DataError(f"{os.fspath(path)}: no question sets in the file")
    return tasks


def save_corpus_jsonl(path: str | os.PathLike, docs: Iterable[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            row = {"id": d.id, "text": d.text}
            if d.title:
                row["title"] = d.title
            f.write(json.dumps(row) + "\n")


def save_tasks_jsonl(path: str | os.PathLike, tasks: Iterable[Task]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(t.to_json()) + "\n")
