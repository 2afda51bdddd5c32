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
states every fact (it is the environment, not training data). A preset may be an
experiment's world, defined outside this package: a `WorldConfig` subclass with more
fields whose `world_class` is a `World` subclass that fixes some of each set's questions
and adds to its meta (`pinned_questions`, `task_meta`); `WORLD_PRESETS` then names the
module that defines it, imported when the preset, or a stored config of it, is read
("info-gap": trainer/experiments/infogap_world.py). memopd/env/qa/expert.py holds the
scripted expert and the experts by name, notes.py the text grammar (values, questions,
facts, notes) this module writes.
"""
from __future__ import annotations

import importlib
import itertools
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from .data import DataError, Document, Task
from .notes import DEFAULT_VALUES, MULTIWORD_VALUES, VALUE_SETS, VALUE_WORDS, fact_text, is_value, parse_question, question_text
from .protocol import MAX_QUESTIONS

__all__ = ["WorldConfig", "World", "DEFAULT_VALUES", "MULTIWORD_VALUES", "VALUE_SETS", "HELDOUT_SPLITS", "WORLD_PRESETS",
           "world_preset", "preset_config", "ANSWER_ORDERS", "max_answer_words", "question_text", "parse_question", "fact_text", "is_value"]

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
# documents a search shows (EnvConfig.top_k's default): what `World.retriever` shows
SEARCH_TOP_K = 3
Question = tuple[str, str | None, str]  # (attribute, relation or None, entity)

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
        if not 0.0 <= self.two_hop_frac <= 1.0:
            raise DataError(f"two_hop_frac must be in [0, 1], got {self.two_hop_frac}")
        if self.two_hop_frac > 0 and not self.relations:
            raise DataError("two-hop questions need at least one relation")
        bad = set(self.relations) & (set(DEFAULT_VALUES) | VALUE_WORDS | {"of", "the", "is", "s"})
        if bad:
            raise DataError(f"relation names {sorted(bad)} collide with other words")
        if self.distractors_per_entity < 0:
            raise DataError(f"distractors_per_entity must be >= 0, got {self.distractors_per_entity}")

    def world_class(self) -> type["World"]:
        """The `World` (sub)class that generates this config's world (a subclass of this
        config with fields of its own names its own)."""
        return World

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["attributes"] = list(self.attributes)
        d["relations"] = list(self.relations)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorldConfig":
        """The inverse of `to_json`. Read as `WorldConfig`, a config of an experiment's
        preset loads as that preset's config class (`preset_config`); a field this class
        lacks that an experiment's class holds at its default value is dropped: every world
        recorded it so while this class held the field, and it means the plain world."""
        d = dict(d)
        if cls is WorldConfig and isinstance(d.get("preset"), str) and d["preset"] in WORLD_PRESETS:
            cls = preset_config(d["preset"])[0]
        unknown = {f for f in set(d) - set(cls.__dataclass_fields__) if not _plain_default(f, d[f])}
        if unknown:
            raise DataError(f"world config has unknown fields {sorted(unknown)}")
        d = {f: v for f, v in d.items() if f in cls.__dataclass_fields__}
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
        world = config.world_class()(config, names, facts)
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
        so each split asks the same questions (the questions a subclass pins follow the
        copy's own searches). SFT data played in such copies cannot be answered from a
        memorised fact, only from what the context shows (the info-gap SFT recipe's
        `redraw_values`)."""
        rng = random.Random(f"memopd-redraw-{self.config.seed}-{seed}")
        facts = dict(self.facts)
        for x in self.entities:
            for a in self.config.attributes:
                facts[(x, a)] = rng.choice(self.values[a])
        world = type(self)(self.config, list(self.entities), facts, heldout=self.heldout)
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

    def allowed(self, q: Question, split: str) -> bool:
        """Whether `split` may ask `q`: with held-out facts, an "eval" question has one as
        its answer and a question of any other split does not."""
        return not self.heldout or (self.answer_fact(q) in self.heldout) == (split in HELDOUT_SPLITS)

    def questions(self, split: str = "train") -> list[tuple[str, str | None, str]]:
        """Every distinct (attr, rel or None, entity) question `split` can draw."""
        rels: list[str | None] = [None] + (list(self.config.relations) if self.config.two_hop_frac > 0 else [])
        if self.config.two_hop_frac >= 1.0:
            rels = rels[1:]
        out = [(a, r, x) for x in self.entities for a in self.config.attributes for r in rels]
        return [q for q in out if self.allowed(q, split)]

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
        pinned = self.pinned_questions(split, k, seed)
        tasks = []
        for i in range(n):
            qs: list[Question] = []
            slots = next(pinned)
            while len(qs) < k:
                if len(qs) in slots:
                    qs.append(slots[len(qs)])
                    continue
                q = self.sample_question(rng)
                if q not in qs and q not in slots.values() and self.allowed(q, split):
                    qs.append(q)
            texts = [question_text(a, x, r, j + 1) for j, (a, r, x) in enumerate(qs)]
            meta = self.task_meta(texts, qs, slots)
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

    def pinned_questions(self, split: str, k: int, seed: int) -> Iterator[dict[int, Question]]:
        """For each set `sample_tasks(k, ..., split=split, seed=seed)` draws, in turn: the
        questions fixed at positions of the set before the random draw fills the others.
        This world fixes none; a subclass that does draws them from its own stream, so the
        other questions stay those this world draws."""
        return itertools.repeat({})

    def task_meta(self, texts: list[str], questions: list[Question], pinned: dict[int, Question]) -> dict[str, Any]:
        """A set's `Task.meta`: the hops of each question (a subclass adds its own keys)."""
        return {"hops": [1 if r is None else 2 for _, r, _ in questions]}

    @property
    def retriever(self):
        """A BM25 index of the corpus showing `SEARCH_TOP_K` documents, built on first use
        (what a search of the environment shows with its default `top_k`)."""
        if getattr(self, "_retriever", None) is None:
            from .retriever import BM25Retriever

            self._retriever = BM25Retriever(self.documents, top_k=SEARCH_TOP_K)
        return self._retriever

    def vocabulary_texts(self) -> list[str]:
        """Every text the environment can show or expect, for building the tokenizer."""
        texts = [d.display for d in self.documents]
        texts += [" ".join(self.entities)]
        texts += [" ".join(v) for v in self.values.values()]
        texts += [" ".join(self.config.attributes + self.config.relations)]
        return texts


# The named worlds. "replication": 192 entities, a quarter of their attribute facts held
# out for evaluation, multi-word values; the rest as in the default world. docs/design.md §10.
WORLD_PRESETS: dict[str, dict[str, Any] | str] = {
    "default": {},
    "replication": {"n_entities": 192, "value_set": "multiword", "heldout_frac": 0.25, "answer_order": "descending"},
    # an experiment's world, by the module that defines its config class as `WORLD_CONFIG`
    # and its fields as `WORLD_PRESET`, imported when asked for (this package imports no
    # experiment): the replication world with information-gap sets and per-set turn
    # budgets (docs/research/replication.md)
    "info-gap": "memopd.trainer.experiments.infogap_world",
}


def preset_config(name: str) -> tuple[type[WorldConfig], dict[str, Any]]:
    """(config class, fields) of world preset `name` (`WORLD_PRESETS`)."""
    found = WORLD_PRESETS[name]
    if isinstance(found, str):
        module = importlib.import_module(found)
        return module.WORLD_CONFIG, dict(module.WORLD_PRESET)
    return WorldConfig, dict(found)


def _plain_default(name: str, value: Any) -> bool:
    """Whether `name` is a field of an experiment preset's config class whose default is
    `value` (the value that leaves the world plain)."""
    for preset, found in WORLD_PRESETS.items():
        if isinstance(found, str):
            f = preset_config(preset)[0].__dataclass_fields__.get(name)
            if f is not None and f.default == value:
                return True
    return False


def max_answer_words(config: WorldConfig) -> int:
    """Words in the longest value of a world's value set: what one answer may take."""
    return max(len(v.split()) for a in config.attributes for v in VALUE_SETS[config.value_set][a])


def world_preset(name: str, seed: int = 0) -> WorldConfig:
    """The `WorldConfig` of a named preset (its `preset` field records the name)."""
    if name not in WORLD_PRESETS:
        raise ValueError(f"unknown world preset {name!r}; choose from {', '.join(WORLD_PRESETS)}")
    cls, fields = preset_config(name)
    return cls(seed=seed, preset=name, **fields)
