"""The info-gap experiment's world: the QA world with information-gap sets and per-set turn budgets.

`InfoGapWorldConfig` is the product's `WorldConfig` (memopd/env/qa/world.py) with two
fields, `InfoGapWorld` the `World` that draws its sets:

- `linked_frac`: a share of the sets of k >= 2 questions hold a linked pair (the question
  the expert works first is two-hop from entity x; the next one asks another attribute of
  x, a fact the first hop's search shows), so that a flattened history holds a needed fact
  a compact memory dropped. The pairs come from their own random stream: every other
  question of a set is the one the plain world draws.
- `turn_budget`: "default" (`EnvConfig.turns_for`: 2k + 2) or "efficient" (per set, the
  calls of the expert that uses every visible fact + 1, at least the plain expert's calls,
  in `Task.meta["max_turns"]`).

At their defaults (0, "default") the world is the plain one. `WORLD_CONFIG` and
`WORLD_PRESET` are the "info-gap" world preset, which the product reads from this module
by name (`memopd.env.qa.world.WORLD_PRESETS`; the product imports no experiment).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Iterator

from memopd.env.qa.data import DataError
from memopd.env.qa.notes import facts_in
from memopd.env.qa.protocol import marker
from memopd.env.qa.world import WORLD_PRESETS, Question, World, WorldConfig

from .infogap_expert import efficient_calls

__all__ = ["InfoGapWorldConfig", "InfoGapWorld", "TURN_BUDGETS", "WORLD_CONFIG", "WORLD_PRESET"]

TURN_BUDGETS = ("default", "efficient")


@dataclass(frozen=True)
class InfoGapWorldConfig(WorldConfig):
    """`WorldConfig` with the information-gap sets and the turn budget (module docstring).
    Its fields follow the plain ones, so its JSON is the one these worlds recorded when the
    fields lived in `WorldConfig`."""

    linked_frac: float = 0.0
    turn_budget: str = "default"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.linked_frac <= 1.0:
            raise DataError(f"linked_frac must be in [0, 1], got {self.linked_frac}")
        if self.linked_frac > 0 and not self.relations:
            raise DataError("linked (information-gap) sets need at least one relation")
        if self.turn_budget not in TURN_BUDGETS:
            raise DataError(f"turn_budget must be one of {', '.join(TURN_BUDGETS)}, got {self.turn_budget!r}")

    def world_class(self) -> type[World]:
        return InfoGapWorld


class InfoGapWorld(World):
    """A world of `InfoGapWorldConfig`: linked pairs pinned in a share of the sets, their
    `Task.meta["linked"]` (when `linked_frac` > 0) and `["max_turns"]` (an "efficient" budget)."""

    config: InfoGapWorldConfig

    def pinned_questions(self, split: str, k: int, seed: int) -> Iterator[dict[int, Question]]:
        # its own stream: the plain draw of every other question is left as it is
        rng = random.Random(f"memopd-linked-{self.config.seed}-{split}-{k}-{seed}")
        while True:
            slots: dict[int, Question] = {}
            if k >= 2 and self.config.linked_frac > 0 and rng.random() < self.config.linked_frac:
                # the pair sits where the expert starts: first and second in its order of work
                first, second = (k - 1, k - 2) if self.config.answer_order == "descending" else (0, 1)
                slots[first], slots[second] = self.linked_pair(rng, split, k)
            yield slots

    def task_meta(self, texts: list[str], questions: list[Question], pinned: dict[int, Question]) -> dict[str, Any]:
        meta = super().task_meta(texts, questions, pinned)
        if self.config.linked_frac > 0:
            meta["linked"] = bool(pinned)
        if self.config.turn_budget == "efficient":
            meta["max_turns"] = max(efficient_calls(self, texts) + 1, sum(meta["hops"]) + 1)
        return meta

    def shown_facts(self, query: str) -> dict[tuple[str, str], str]:
        """The facts {(entity, key): value} that the documents a search for `query` shows state."""
        return facts_in(" | ".join(d.display for d in self.retriever.search(query)))

    def linked_pair(self, rng: random.Random, split: str, k: int) -> tuple[Question, Question]:
        """(two-hop question on x, one-hop question on another attribute of x) such that the
        two-hop question's first search shows the one-hop question's fact."""
        first_pos = k if self.config.answer_order == "descending" else 1
        for _ in range(10000):
            x, rel, attr = rng.choice(self.entities), rng.choice(self.config.relations), rng.choice(self.config.attributes)
            two = (attr, rel, x)
            if not self.allowed(two, split):
                continue
            shown = self.shown_facts(f"{marker('q', first_pos)} {x} {marker('k', first_pos)} {rel}")
            cands = [a for a in self.config.attributes if (x, a) in shown and self.allowed((a, None, x), split)]
            if cands:
                return two, (rng.choice(cands), None, x)
        raise DataError(f"no linked question pair found in the {split!r} split of this world")


# The "info-gap" preset: the replication world with information-gap sets (half of them)
# and per-set turn budgets, the world where the view a teacher is shown can matter
# (docs/research/replication.md).
WORLD_CONFIG = InfoGapWorldConfig
WORLD_PRESET: dict[str, Any] = {**WORLD_PRESETS["replication"], "linked_frac": 0.5, "turn_budget": "efficient"}
