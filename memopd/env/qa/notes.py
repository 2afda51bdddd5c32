"""The QA world's text grammar: values, questions, facts and the agent's notes.

One module that the world (memopd/env/qa/world.py), its experts (expert.py) and the
experiments (trainer/experiments/) read, so none of them imports another for it:

- the value tables (`DEFAULT_VALUES`, `MULTIWORD_VALUES`, `VALUE_SETS`) and `is_value`;
- a question as a keyword chain with markers (`question_text`, `parse_question`) and as a
  task prefix line (`QUESTION`: "qa gite ka job ?");
- a fact as a document states it (`fact_text`, `FACT`, `facts_in`);
- the notes an agent keeps in its memory span ("xa tailor xb rezu": `NOTE_MARK`,
  `parse_entries`).
"""
from __future__ import annotations

import re

from .protocol import letters_index, marker

__all__ = ["DEFAULT_VALUES", "MULTIWORD_VALUES", "VALUE_SETS", "VALUE_WORDS", "is_value", "question_text", "parse_question",
           "fact_text", "QUESTION", "FACT", "NOTE_MARK", "parse_entries", "facts_in"]

DEFAULT_VALUES: dict[str, tuple[str, ...]] = {
    "city": ("paris", "rome", "oslo", "lima", "cairo", "delhi", "tokyo", "berlin", "madrid", "dublin", "quito", "seoul"),
    "color": ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown"),
    "job": ("baker", "pilot", "nurse", "farmer", "doctor", "painter", "singer", "lawyer", "tailor", "miner"),
}

# Values of 1-4 words that share words ("dark blue" / "navy blue", "bus driver" / "truck
# driver"), so a near miss earns partial F1. No value word is an attribute, relation,
# fact-template word ("of", "is") or a marker-like word (x/q/k/r + 1-2 letters).
MULTIWORD_VALUES: dict[str, tuple[str, ...]] = {
    "city": ("paris", "oslo", "new york", "new delhi", "san jose", "san diego", "los angeles", "buenos aires",
             "port au prince", "hong kong", "cape town", "tel aviv", "kuala lumpur", "santa cruz de tenerife"),
    "color": ("blue", "dark blue", "light blue", "navy blue", "dark green", "light green", "olive green",
              "deep purple", "bright orange", "soft pink", "golden yellow", "dark red", "bright red"),
    "job": ("baker", "pilot", "bus driver", "truck driver", "deep sea diver", "sea captain", "night nurse",
            "school teacher", "piano teacher", "tax lawyer", "forest ranger", "street painter", "opera singer",
            "rocket scientist"),
}

VALUE_SETS: dict[str, dict[str, tuple[str, ...]]] = {"default": DEFAULT_VALUES, "multiword": MULTIWORD_VALUES}


VALUE_WORDS = frozenset(w for table in VALUE_SETS.values() for vals in table.values() for v in vals for w in v.split())


def is_value(word: str) -> bool:
    """True for a word of an attribute value (of any value set), False for anything else
    (entity names): a note holding an entity is a two-hop question's middle step."""
    return word in VALUE_WORDS


def question_text(attr: str, x: str, rel: str | None = None, i: int = 1) -> str:
    """Question i (1-based) of a set, as a keyword chain with per-question markers:

        "gite ka job ?"              (gite's job; question 1)
        "loro kb friend rb color ?"  (the color of loro's friend; question 2)

    The task prefix writes the question marker ("qa", "qb", ...) in front. Why markers:
    a small transformer learns "copy the word that follows marker m" (an induction head
    keyed on a unique token) far sooner than it learns to find a word by its place in a
    sentence, so every word a search needs follows a marker: the first hop sends
    "qa gite ka job", the second "rb color <middle entity>". Marker words match no
    document; BM25 ignores them.
    """
    if rel is None:
        return f"{x} {marker('k', i)} {attr} ?"
    return f"{x} {marker('k', i)} {rel} {marker('r', i)} {attr} ?"


_MARKER = re.compile(r"^([qkrx])([a-z]{1,2})$")


def parse_question(text: str) -> tuple[str, str | None, str] | None:
    """Inverse of `question_text`: (attr, rel or None, entity), or None if not ours."""
    w = [t for t in text.split() if t != "?"]
    if w and _MARKER.match(w[0]) and w[0][0] == "q":
        w = w[1:]

    def is_marker(t: str, kind: str) -> bool:
        m = _MARKER.match(t)
        return bool(m) and m.group(1) == kind

    if len(w) == 3 and is_marker(w[1], "k"):
        return w[2], None, w[0]
    if len(w) == 5 and is_marker(w[1], "k") and is_marker(w[3], "r"):
        return w[4], w[2], w[0]
    return None


def fact_text(x: str, key: str, value: str) -> str:
    """The document stating one fact: "friend of kalo is mipu ." (titled "kalo")."""
    return f"{key} of {x} is {value} ."


QUESTION = re.compile(r"(?:^|\s)q([a-z]{1,2}) (.+?\?)")
# "friend of loro is rezu ." / "job of gite is deep sea diver .": a value runs to the " ." that ends its fact
FACT = re.compile(r"(\S+) of (\S+) is ([^.|]+?) \.")
NOTE_MARK = re.compile(r"^x([a-z]{1,2})$")


def parse_entries(mem_text: str | None) -> list[list]:
    """Notes "xa tailor xb rezu" -> [[1, ["tailor"]], [2, ["rezu"]]]."""
    entries: list[list] = []
    for w in (mem_text or "").split():
        m = NOTE_MARK.match(w)
        if m:
            entries.append([letters_index(m.group(1)), []])
        elif entries:
            entries[-1][1].append(w)
    return entries


def facts_in(text: str) -> dict[tuple[str, str], str]:
    """{(entity, key): value} of every fact a text (observations) states; later ones win."""
    return {(x, a): v for a, x, v in FACT.findall(text or "")}
