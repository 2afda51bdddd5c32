"""The embedded default data: a generated world, its corpus and its question sets.

Everything is a pure function of a `WorldConfig` (seed included), so no download is
needed and two processes that share a config see the same world, corpus and tasks.

- Entities have made-up short names ("kalo", "mipu"), attributes (city, color, job)
  and relations to other entities (friend, mentor).
- The corpus holds one short document per fact, titled with its entity ("kalo : city
  of kalo is paris ."), plus distractors that mention the entity with a wrong value but
  not the attribute word ("kalo : kalo once visited rome ."), so a search returns near
  misses as well.
- Questions are single-hop ("kalo ka city ?": kalo's city) or two-hop ("kalo kb friend
  rb color ?": the color of kalo's friend); a `Task` is k of them, answered in one
  episode. The ka/kb/rb words are markers (see `question_text`).

The vocabulary is deliberately small (a few hundred words) so tiny models can learn it.

Named presets (`WORLD_PRESETS`, `world_preset`): "default" is `WorldConfig()` as it has
always been; "replication" (docs/design.md §10) is a larger world whose values have 1-4
words ("new york", "deep sea diver": token F1 gives partial credit) and a share of whose
(entity, attribute) facts is held out: an "eval" question is one whose answer is a
held-out fact (asked directly, or as the second hop of a two-hop chain), a question of
any other split never has a held-out fact as its answer. Evaluation questions are thus
disjoint from training ones by construction, while every entity name still occurs in
training (a tiny model cannot write a name it never wrote) and the corpus still
states every fact (it is the environment, not training data). "info-gap" is the
replication world plus information-gap sets (`linked_frac`: a share of the sets hold a
pair of questions on one entity, the second's fact shown by the first's search, so that
a flattened history holds a needed fact a compact memory dropped) and a per-set turn
budget (`turn_budget="efficient"`: the efficient expert's calls + 1, in
`Task.meta["max_turns"]`); memopd/env/qa/expert.py holds the expert rule of both views, notes.py
the text grammar (values, questions, facts, notes) this module writes.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from .data import DataError, Document, Task
from .notes import DEFAULT_VALUES, MULTIWORD_VALUES, VALUE_SETS, VALUE_WORDS, fact_text, facts_in, is_value, parse_question, question_text
from .protocol import MAX_QUESTIONS, marker

__all__ = ["WorldConfig", "World", "DEFAULT_VALUES", "MULTIWORD_VALUES", "VALUE_SETS", "HELDOUT_SPLITS", "WORLD_PRESETS",
           "world_preset", "ANSWER_ORDERS", "TURN_BUDGETS", "max_answer_words", "question_text", "parse_question", "fact_text", "is_value"]

# Distractors mention an entity (and sometimes a value) without the attribute keyword,
# so BM25 still ranks the true fact first but the observation holds near misses.
_DISTRACTORS = (
    ("city", "{x} once visited {city} ."),
    ("color", "{x} has a {color} bike ."),
    ("job", "{x} wants to be a {job} ."),
    ("city", "{x} and {y} went to {city} together ."),
    ("", "{x} never met {y} ."),
    ("job", "{y} thinks {x} is a good {job} ."),
)

# Splits whose questions have held-out facts as answers; every other split ("train", an
# RL stream, SFT data) has the other facts only.
HELDOUT_SPLITS = frozenset({"eval"})

ANSWER_ORDERS = ("ascending", "descending")
TURN_BUDGETS = ("default", "efficient")
# documents a search shows (EnvConfig.top_k's default): what a linked pair is checked against
LINK_TOP_K = 3

_ALL_VALUES = frozenset(v for vals in DEFAULT_VALUES.values() for v in vals)


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    n_entities: int = 64
    attributes: tuple[str, ...] = ("city", "color", "job")
    relations: tuple[str, ...] = ("friend", "mentor")
    distractors_per_entity: int = 2
    two_hop_frac: float = 0.5
    # Fields below default to the world as it always was (its corpus and tasks unchanged).
    # value_set: a `VALUE_SETS` key. heldout_frac: share of (entity, attribute) facts held
    # out as the "eval" split's answers (0: none; eval sets are then an independent stream).
    # preset: the `WORLD_PRESETS` name, which also picks the SFT models and recipe.
    value_set: str = "default"
    heldout_frac: float = 0.0
    preset: str = "default"
    # answer_order: the order in which the expert works through the questions. With
    # "descending" it starts at the last question and ends at "a", so whether an entry is
    # the last one is written in its own label: the decision to stop searching and
    # answer is local, and a tiny model need not check that no further question exists
    # (docs/design.md §10).
    answer_order: str = "ascending"
    # linked_frac: share of the sets of k >= 2 questions that hold one linked pair (the
    # question worked first is two-hop from entity x; the next one asks another attribute
    # of x, a fact the first hop's search shows): the information-gap sets. 0: none, and
    # the task streams are those of a world without the field.
    linked_frac: float = 0.0
    # turn_budget: "default" (EnvConfig.turns_for: 2k + 2) or "efficient" (per set, the
    # calls of the expert that uses every visible fact + 1, at least the plain expert's
    # calls: `Task.meta["max_turns"]`)
    turn_budget: str = "default"

    def __post_init__(self) -> None:
        if not 2 <= self.n_entities <= 2000:
            raise DataError(f"n_entities must be in [2, 2000], got {self.n_entities}")
        if not self.attributes:
            raise DataError("a world needs at least one attribute")
        if self.value_set not in VALUE_SETS:
            raise DataError(f"unknown value_set {self.value_set!r}; choose from {sorted(VALUE_SETS)}")
        for a in self.attributes:
            if a not in VALUE_SETS[self.value_set]:
                raise DataError(f"unknown attribute {a!r}; choose from {sorted(VALUE_SETS[self.value_set])}")
        if not 0.0 <= self.heldout_frac < 1.0:
            raise DataError(f"heldout_frac must be in [0, 1), got {self.heldout_frac}")
        if self.heldout_frac > 0 and round(self.n_entities * len(self.attributes) * self.heldout_frac) < 1:
            raise DataError(f"heldout_frac={self.heldout_frac} holds out no fact of {self.n_entities} entities")
        if self.preset not in WORLD_PRESETS:
            raise DataError(f"unknown world preset {self.preset!r}; choose from {', '.join(WORLD_PRESETS)}")
        if self.answer_order not in ANSWER_ORDERS:
            raise DataError(f"answer_order must be one of {', '.join(ANSWER_ORDERS)}, got {self.answer_order!r}")
        if not 0.0 <= self.linked_frac <= 1.0:
            raise DataError(f"linked_frac must be in [0, 1], got {self.linked_frac}")
        if self.linked_frac > 0 and not self.relations:
            raise DataError("linked (information-gap) sets need at least one relation")
        if self.turn_budget not in TURN_BUDGETS:
            raise DataError(f"turn_budget must be one of {', '.join(TURN_BUDGETS)}, got {self.turn_budget!r}")
        if not 0.0 <= self.two_hop_frac <= 1.0:
            raise DataError(f"two_hop_frac must be in [0, 1], got {self.two_hop_frac}")
        if self.two_hop_frac > 0 and not self.relations:
            raise DataError("two-hop questions need at least one relation")
        bad = set(self.relations) & (set(DEFAULT_VALUES) | VALUE_WORDS | {"of", "the", "is", "s"})
        if bad:
            raise DataError(f"relation names {sorted(bad)} collide with other words")
        if self.distractors_per_entity < 0:
            raise DataError(f"distractors_per_entity must be >= 0, got {self.distractors_per_entity}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["attributes"] = list(self.attributes)
        d["relations"] = list(self.relations)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorldConfig":
        d = dict(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise DataError(f"world config has unknown fields {sorted(unknown)}")
        for key in ("attributes", "relations"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


@dataclass
class World:
    """A generated world: entity names, facts, and the corpus describing them."""

    config: WorldConfig
    entities: list[str]
    facts: dict[tuple[str, str], str]  # (entity, attribute or relation) -> value
    documents: list[Document] = field(default_factory=list)
    support_doc: dict[tuple[str, str], str] = field(default_factory=dict)  # fact -> doc id
    heldout: frozenset[tuple[str, str]] = frozenset()  # (entity, attribute) facts only eval questions ask

    @property
    def values(self) -> dict[str, tuple[str, ...]]:
        return VALUE_SETS[self.config.value_set]

    @classmethod
    def generate(cls, config: WorldConfig | None = None, **kwargs) -> "World":
        config = config or WorldConfig(**kwargs)
        rng = random.Random(f"memopd-world-{config.seed}")
        values = VALUE_SETS[config.value_set]
        reserved = {w for vals in values.values() for v in vals for w in v.split()}
        reserved |= set(config.attributes) | set(config.relations)
        reserved |= {"is", "the", "of", "once", "has", "bike", "wants", "never", "met", "went", "together",
                     "thinks", "good", "to", "be", "and", "a"}
        names: list[str] = []
        seen: set[str] = set()
        while len(names) < config.n_entities:
            # CVCV names: 4900 possibilities, all 4 letters (BM25's tokenizer keeps them).
            n = "".join(rng.choice(s) for s in (_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS))
            if n in seen or n in reserved:
                continue
            seen.add(n)
            names.append(n)
        facts: dict[tuple[str, str], str] = {}
        for x in names:
            for a in config.attributes:
                facts[(x, a)] = rng.choice(values[a])
        # Each relation is a derangement (a permutation without fixed points): every
        # entity is the friend of exactly one other, so "friend of X is Y" has one
        # inverse twin ("friend of W is X"), and with titled documents the true fact
        # (which names X twice) ranks first for the search "X friend".
        for r in config.relations:
            while True:
                perm = names[:]
                rng.shuffle(perm)
                if all(a != b for a, b in zip(names, perm)):
                    break
            for x, y in zip(names, perm):
                facts[(x, r)] = y
        world = cls(config, names, facts)
        world._build_corpus(rng)
        if config.heldout_frac > 0:
            # its own stream, so holding facts out leaves names, facts and corpus as they are
            pairs = [(x, a) for x in names for a in config.attributes]
            world.heldout = frozenset(random.Random(f"memopd-heldout-{config.seed}").sample(
                pairs, round(len(pairs) * config.heldout_frac)))
        return world

    def with_redrawn_values(self, seed: str | int) -> "World":
        """A copy of this world whose attribute values are drawn afresh (from the same value
        sets, by `seed`) and whose corpus states them; names, relations and held-out facts stay,
        so each split asks the same questions (the linked pairs of its sets follow the copy's
        own searches). SFT data played in such copies cannot be answered from a memorised
        fact, only from what the context shows (the info-gap SFT recipe's `redraw_values`)."""
        rng = random.Random(f"memopd-redraw-{self.config.seed}-{seed}")
        facts = dict(self.facts)
        for x in self.entities:
            for a in self.config.attributes:
                facts[(x, a)] = rng.choice(self.values[a])
        world = World(self.config, list(self.entities), facts, heldout=self.heldout)
        world._build_corpus(rng)
        return world

    def _build_corpus(self, rng: random.Random) -> None:
        docs: list[Document] = []
        for x in self.entities:
            for a in list(self.config.attributes) + list(self.config.relations):
                did = f"{x}/{a}"
                docs.append(Document(did, fact_text(x, a, self.facts[(x, a)]), title=x))
                self.support_doc[(x, a)] = did
            usable = [t for need, t in _DISTRACTORS if need == "" or need in self.config.attributes]
            for j in range(self.config.distractors_per_entity):
                t = rng.choice(usable)
                fill = {a: rng.choice(vals) for a, vals in self.values.items()}
                fill["x"] = x
                fill["y"] = rng.choice([y for y in self.entities if y != x])
                docs.append(Document(f"{x}/d{j}", t.format(**fill), title=x))
        # Shuffle so document order carries no signal about which doc is the fact.
        rng.shuffle(docs)
        self.documents = docs

    # ---- questions -------------------------------------------------------------------
    def answer(self, attr: str, x: str, rel: str | None = None) -> str:
        try:
            y = x if rel is None else self.facts[(x, rel)]
            return self.facts[(y, attr)]
        except KeyError:
            raise DataError(f"the world has no fact for ({attr}, {rel}, {x})") from None

    def support(self, attr: str, x: str, rel: str | None = None) -> list[str]:
        if rel is None:
            return [self.support_doc[(x, attr)]]
        y = self.facts[(x, rel)]
        return [self.support_doc[(x, rel)], self.support_doc[(y, attr)]]

    def answer_fact(self, q: tuple[str, str | None, str]) -> tuple[str, str]:
        """The (entity, attribute) fact a question's answer is: the subject's own, or for
        a two-hop question that of the entity its relation leads to."""
        attr, rel, x = q
        return (x if rel is None else self.facts[(x, rel)], attr)

    def _allowed(self, q: tuple[str, str | None, str], split: str) -> bool:
        return not self.heldout or (self.answer_fact(q) in self.heldout) == (split in HELDOUT_SPLITS)

    def questions(self, split: str = "train") -> list[tuple[str, str | None, str]]:
        """Every distinct (attr, rel or None, entity) question `split` can draw."""
        rels: list[str | None] = [None] + (list(self.config.relations) if self.config.two_hop_frac > 0 else [])
        if self.config.two_hop_frac >= 1.0:
            rels = rels[1:]
        out = [(a, r, x) for x in self.entities for a in self.config.attributes for r in rels]
        return [q for q in out if self._allowed(q, split)]

    def sample_question(self, rng: random.Random) -> tuple[str, str | None, str]:
        x = rng.choice(self.entities)
        attr = rng.choice(self.config.attributes)
        rel = rng.choice(self.config.relations) if rng.random() < self.config.two_hop_frac else None
        return attr, rel, x

    def sample_tasks(self, k: int, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        """n question sets of k distinct questions; deterministic in (world seed, split, k, seed).

        Different `split` names give independent streams, so "train" and "eval" sets are
        held out from each other (`memopd eval` uses split "eval"); with held-out
        facts (`WorldConfig.heldout_frac`) the "eval" questions are moreover disjoint
        from every other split's by construction.
        """
        if k < 1:
            raise DataError(f"k must be >= 1, got {k}")
        if k > MAX_QUESTIONS:
            raise DataError(f"k={k}: generated question sets hold at most {MAX_QUESTIONS} questions "
                            "(one vocabulary marker per question)")
        if self.heldout:
            n_distinct = len(self.questions(split))
        else:
            n_distinct = len(self.entities) * len(self.config.attributes) * (1 + len(self.config.relations))
        if k > n_distinct:
            raise DataError(f"k={k} exceeds the {n_distinct} distinct questions of this world's {split!r} split")
        rng = random.Random(f"memopd-tasks-{self.config.seed}-{split}-{k}-{seed}")
        # its own stream: a world without linked sets draws exactly the sets it always drew
        link_rng = random.Random(f"memopd-linked-{self.config.seed}-{split}-{k}-{seed}")
        tasks = []
        for i in range(n):
            qs: list[tuple[str, str | None, str]] = []
            linked = k >= 2 and self.config.linked_frac > 0 and link_rng.random() < self.config.linked_frac
            slots: dict[int, tuple[str, str | None, str]] = {}
            if linked:
                # the pair sits where the expert starts: first and second in its order of work
                first, second = (k - 1, k - 2) if self.config.answer_order == "descending" else (0, 1)
                slots[first], slots[second] = self._linked_pair(link_rng, split, k)
            while len(qs) < k:
                if len(qs) in slots:
                    qs.append(slots[len(qs)])
                    continue
                q = self.sample_question(rng)
                if q not in qs and q not in slots.values() and self._allowed(q, split):
                    qs.append(q)
            texts = [question_text(a, x, r, j + 1) for j, (a, r, x) in enumerate(qs)]
            meta: dict[str, Any] = {"hops": [1 if r is None else 2 for _, r, _ in qs]}
            if self.config.linked_frac > 0:
                meta["linked"] = linked
            if self.config.turn_budget == "efficient":
                from .expert import efficient_calls

                meta["max_turns"] = max(efficient_calls(self, texts) + 1, sum(meta["hops"]) + 1)
            tasks.append(
                Task(
                    task_id=f"{split}{seed}-q{k}-{i:05d}",
                    questions=texts,
                    answers=[[self.answer(a, x, r)] for a, r, x in qs],
                    support=[self.support(a, x, r) for a, r, x in qs],
                    meta=meta,
                )
            )
        return tasks

    @property
    def retriever(self):
        """A BM25 index of the corpus showing `LINK_TOP_K` documents, built on first use
        (what a search of the environment shows with its default `top_k`)."""
        if getattr(self, "_retriever", None) is None:
            from .retriever import BM25Retriever

            self._retriever = BM25Retriever(self.documents, top_k=LINK_TOP_K)
        return self._retriever

    def shown_facts(self, query: str) -> dict[tuple[str, str], str]:
        """The facts {(entity, key): value} that the documents a search for `query` shows state."""
        return facts_in(" | ".join(d.display for d in self.retriever.search(query)))

    def _linked_pair(self, rng: random.Random, split: str, k: int):
        """(two-hop question on x, one-hop question on another attribute of x) such that the
        two-hop question's first search shows the one-hop question's fact."""
        first_pos = k if self.config.answer_order == "descending" else 1
        for _ in range(10000):
            x, rel, attr = rng.choice(self.entities), rng.choice(self.config.relations), rng.choice(self.config.attributes)
            two = (attr, rel, x)
            if not self._allowed(two, split):
                continue
            shown = self.shown_facts(f"{marker('q', first_pos)} {x} {marker('k', first_pos)} {rel}")
            cands = [a for a in self.config.attributes if (x, a) in shown and self._allowed((a, None, x), split)]
            if cands:
                return two, (rng.choice(cands), None, x)
        raise DataError(f"no linked question pair found in the {split!r} split of this world")

    def vocabulary_texts(self) -> list[str]:
        """Every text the environment can show or expect, for building the tokenizer."""
        texts = [d.display for d in self.documents]
        texts += [" ".join(self.entities)]
        texts += [" ".join(v) for v in self.values.values()]
        texts += [" ".join(self.config.attributes + self.config.relations)]
        return texts


# The named worlds. "replication": 192 entities, a quarter of their attribute facts held
# out for evaluation, multi-word values; the rest as in the default world. docs/design.md §10.
WORLD_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "replication": {"n_entities": 192, "value_set": "multiword", "heldout_frac": 0.25, "answer_order": "descending"},
    # the replication world with information-gap sets (half of them) and per-set turn
    # budgets: the world where the view a teacher is shown can matter (docs/research/replication.md)
    "info-gap": {"n_entities": 192, "value_set": "multiword", "heldout_frac": 0.25, "answer_order": "descending",
                 "linked_frac": 0.5, "turn_budget": "efficient"},
}


def max_answer_words(config: WorldConfig) -> int:
    """Words in the longest value of a world's value set: what one answer may take."""
    return max(len(v.split()) for a in config.attributes for v in VALUE_SETS[config.value_set][a])


def world_preset(name: str, seed: int = 0) -> WorldConfig:
    """The `WorldConfig` of a named preset (its `preset` field records the name)."""
    if name not in WORLD_PRESETS:
        raise ValueError(f"unknown world preset {name!r}; choose from {', '.join(WORLD_PRESETS)}")
    return WorldConfig(seed=seed, preset=name, **WORLD_PRESETS[name])
