"""Answer scoring: exact match (EM) and token F1, SQuAD-style, max over aliases.

Per question: EM is 1.0 if the normalised prediction equals a normalised alias, else 0;
F1 is the token-overlap F1 against the best alias. Per question set (k questions):
"EM sum" is the number of sub-questions answered right (0..k) and "EM mean" the fraction
(EM sum / k); "F1 sum" / "F1 mean" likewise. Normalisation: lower-case, drop punctuation
and the articles a/an/the, collapse whitespace.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

__all__ = ["normalize_answer", "exact_match", "f1_score", "score_answers"]

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _em(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def _f1(pred: str, gold: str) -> float:
    p = normalize_answer(pred).split()
    g = normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, aliases: Sequence[str]) -> float:
    return max(_em(pred, a) for a in aliases)


def f1_score(pred: str, aliases: Sequence[str]) -> float:
    return max(_f1(pred, a) for a in aliases)


def score_answers(preds: Sequence[str] | None, answers: Sequence[Sequence[str]]) -> dict:
    """Score predictions of one question set; a missing prediction scores 0.

    Returns per-question lists `em`/`f1` and `em_sum`, `em_mean`, `f1_sum`, `f1_mean`.
    """
    preds = list(preds or [])
    k = len(answers)
    em, f1 = [], []
    for i in range(k):
        p = preds[i] if i < len(preds) else ""
        if not normalize_answer(p):
            em.append(0.0)
            f1.append(0.0)
            continue
        em.append(exact_match(p, answers[i]))
        f1.append(f1_score(p, answers[i]))
    return {
        "em": em,
        "f1": f1,
        "em_sum": sum(em),
        "em_mean": sum(em) / k,
        "f1_sum": sum(f1),
        "f1_mean": sum(f1) / k,
    }
