"""Question sets from user files, served with the `World.sample_tasks` interface.

`UserTasks(train, eval)` holds the question sets of a training file and (optionally) a
held-out file (`load_tasks_jsonl`: one set of k questions per line, k may differ from
line to line; a flat question list is simply a file of one-question sets).
`sample_tasks(k, n, split=, seed=)` returns n sets of k questions, a pure function of
(the file, split, k, seed):

- if the split's file holds sets of exactly k questions, those sets are used as they
  are (the user grouped them): a deterministic shuffle, cycled when n exceeds them;
- otherwise each set is composed of k distinct questions drawn from the pool of all
  the split's questions (each with its own answer aliases and support), so a flat list
  of single questions trains Q2, Q8, ... sets just like the generated world.

Every returned set has a fresh id (`{split}{seed}-q{k}-{i}`), unique within one call
even when a user set is drawn twice; `meta["source"]` names the user set(s) it came
from. The trainer (`Trainer.rollout`) calls `sample_tasks(k, tasks_per_step,
split="train", seed=...)` exactly as it does on a `World`.
"""
from __future__ import annotations

import random
from typing import Sequence

from .data import DataError, Task

__all__ = ["UserTasks"]


class UserTasks:
    """Train (and held-out) question sets of user files; see the module doc."""

    def __init__(self, train: Sequence[Task], eval: Sequence[Task] | None = None, *,
                 sources: dict[str, str] | None = None):
        self.splits: dict[str, list[Task]] = {"train": list(train)}
        if eval is not None:
            self.splits["eval"] = list(eval)
        for name, sets in self.splits.items():
            if not sets:
                raise DataError(f"the {name} question sets are empty")
        self.sources = dict(sources or {})  # split -> file, for messages

    def _sets(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise DataError(f"no {split!r} question sets were given (have: {', '.join(self.splits)})")
        return self.splits[split]

    def _where(self, split: str) -> str:
        src = self.sources.get(split)
        return f"the {split} question sets" + (f" ({src})" if src else "")

    def sizes(self, split: str = "train") -> dict[int, int]:
        """{k: number of sets of exactly k questions} in the split's file."""
        out: dict[int, int] = {}
        for t in self._sets(split):
            out[t.k] = out.get(t.k, 0) + 1
        return dict(sorted(out.items()))

    def num_questions(self, split: str = "train") -> int:
        return sum(t.k for t in self._sets(split))

    def check_k(self, k: int, split: str = "train") -> str:
        """How k-question sets are formed ("as-is" or "composed"); a DataError if they
        cannot be (k larger than all the split's questions together)."""
        if k < 1:
            raise DataError(f"k must be >= 1, got {k}")
        if any(t.k == k for t in self._sets(split)):
            return "as-is"
        n = self.num_questions(split)
        if k > n:
            raise DataError(f"k={k}: {self._where(split)} hold no set of {k} questions and only {n} questions in "
                            f"all, too few to compose one")
        return "composed"

    def sample_tasks(self, k: int, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        """n question sets of k questions (see the module doc); deterministic."""
        mode = self.check_k(k, split)
        sets = self._sets(split)
        rng = random.Random(f"memopd-user-tasks-{split}-{k}-{seed}")
        out: list[Task] = []
        if mode == "as-is":
            exact = [t for t in sets if t.k == k]
            order: list[int] = []
            while len(order) < n:
                perm = list(range(len(exact)))
                rng.shuffle(perm)
                order += perm
            for i, j in enumerate(order[:n]):
                t = exact[j]
                out.append(Task(f"{split}{seed}-q{k}-{i:05d}", list(t.questions), [list(a) for a in t.answers],
                                support=None if t.support is None else [list(s) for s in t.support],
                                meta={**t.meta, "source": [t.task_id]}))
            return out
        pool = [(t, i) for t in sets for i in range(t.k)]
        for i in range(n):
            picks = [pool[j] for j in rng.sample(range(len(pool)), k)]
            support = None
            if all(t.support is not None for t, _ in picks):
                support = [list(t.support[q]) for t, q in picks]
            out.append(Task(
                f"{split}{seed}-q{k}-{i:05d}",
                [t.questions[q] for t, q in picks],
                [list(t.answers[q]) for t, q in picks],
                support=support,
                meta={"source": [f"{t.task_id}#{q}" for t, q in picks]},
            ))
        return out
