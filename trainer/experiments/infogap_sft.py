"""The info-gap experiment's SFT recipe: the teacher's data and the info-gap world's role presets.

`InfoGapSFTConfig` is the product's `SFTConfig` (memopd/env/qa/sft.py) with the data
options of the info-gap teacher (docs/research/replication.md, "The third teacher" to
"The sixth teacher"): the expert whose calls are the data ("rational" reads every fact its
context shows), a share of perturbed states, episodes played in worlds of redrawn values,
states from other players' episodes, and extra copies of the information-gap calls and
their continuations. Its `build_examples` builds that data (`expert_examples` here); the
product trains and caches it as any recipe. `ROLE_PRESETS` are the info-gap world's
models and recipes, which `memopd.env.qa.sft.role_presets` reads from this module by name
(the product imports no experiment).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Sequence

from memopd.env.qa.data import DataError
from memopd.env.qa.env import QAEnv
from memopd.env.qa.expert import make_expert
from memopd.env.qa.notes import is_value, parse_entries
from memopd.env.qa.protocol import ProtocolTokens, answer_label
from memopd.env.qa.sft import (
    FLATTEN_VIEW,
    REPLICATION_MODEL_PRESETS,
    REPLICATION_SFT_PRESETS,
    ModelSpec,
    SFTConfig,
    data_stats,
    episodes_per_round,
    expert_rollouts,
    view_calls,
    view_env,
)
from memopd.env.qa.world import World

__all__ = ["InfoGapSFTConfig", "INFOGAP_MODEL_PRESETS", "INFOGAP_SFT_PRESETS", "ROLE_PRESETS", "REDRAW_ROUND_SETS",
           "expert_examples", "perturbed_state", "gap_continuation", "gap_examples"]

Example = tuple[list[int], int]

# Sets per round of expert episodes when each round has its own redrawn world: small
# enough that a value is shared by few episodes.
REDRAW_ROUND_SETS = 64


@dataclass
class InfoGapSFTConfig(SFTConfig):
    """`SFTConfig` with the info-gap teacher's data options (their defaults give the plain
    recipe's data). Its fields follow the plain ones, so its JSON (the cache key) is the
    one the recipe recorded when these options lived in `SFTConfig`."""

    # the expert whose calls are the data (`memopd.env.qa.expert.EXPERTS`): "scripted" (reads its notes
    # and the last observation) or "rational" (every fact the visible context shows, so
    # it acts differently under compact memory and the full history: infogap_expert.py)
    expert: str = "scripted"
    # share of each (policy, k)'s calls replaced by a perturbed state (an entry of the
    # notes dropped or corrupted) labelled by the expert under that view
    perturb_frac: float = 0.0
    # each round of expert episodes (at most REDRAW_ROUND_SETS sets) played in a copy of the
    # world with its attribute values drawn afresh (`World.with_redrawn_values`): a value can
    # then only be read from the context, never recalled. Trained on the one world, a
    # teacher recalls the training facts and so fails on held-out ones (docs/research/replication.md)
    redraw_values: bool = False
    # experts that, beside `expert`, play episodes in every view whose states `expert` then
    # labels (e.g. ("scripted",): the plain expert's kind of state, the one the student
    # visits and OPD scores, where its notes miss a fact the history shows)
    state_players: tuple[str, ...] = ()
    # with expert "rational": each sampled call of the flatten view at which the rule acts
    # otherwise on the compact call (an information-gap call) is added this many more
    # times as it is, and as many times as its *continuation*: the flattened state and the
    # compact call's memory span as the prompt, the rule's own search or answer on the
    # flattened state as the label. OPD scores the teacher on the student's tokens, so at
    # such a call the teacher reads on after a memory span that is not its own; the rule's
    # next step there still follows from what the history shows (docs/research/replication.md)
    gap_copies: int = 0

    def build_examples(self, world: World, env: QAEnv) -> tuple[list[Example], dict[str, Any]]:
        return expert_examples(world, env, self.ks, self.calls_per_k, seed=self.seed, policies=self.policies,
                               expert=self.expert, perturb_frac=self.perturb_frac, redraw_values=self.redraw_values,
                               state_players=self.state_players, gap_copies=self.gap_copies)


# The info-gap world (docs/research/replication.md, "A replication that can tell the arms apart"):
# a teacher trained on the rational rule under compact memory, the full history and the
# persistent history the flatten layout scores (the `persistent` arm's teacher state; its
# longest Q16 examples, 2,700 tokens measured, set the positions), with a fifth of its calls
# perturbed (the view-dependent recovery), its episodes played in worlds of redrawn values
# (on the one world it recalled the training facts and failed on held-out ones), as many
# states again from the plain expert's episodes labelled by the rule (the student's kind of
# state, which OPD scores), 8,000 steps (about 0.8 passes over its data, the exposure at
# which the third teacher peaked), and each information-gap call of the flatten view three
# more times as it is and three times as its continuation after the compact call's memory
# span (`InfoGapSFTConfig.gap_copies`: such calls were ~1% of its data): docs/research/replication.md,
# "The third teacher" to "The sixth teacher"; and a student with room on Q2 (1,000 SFT
# steps of the scripted expert, the plain recipe: a student RL can still improve).
INFOGAP_MODEL_PRESETS: dict[str, ModelSpec] = {
    "teacher": replace(REPLICATION_MODEL_PRESETS["teacher"], max_position_embeddings=3072),
    "student": REPLICATION_MODEL_PRESETS["student"],
}
INFOGAP_SFT_PRESETS: dict[str, SFTConfig] = {
    "teacher": InfoGapSFTConfig(**{**vars(replace(REPLICATION_SFT_PRESETS["teacher"], steps=8000, batch_tokens=2560,
                                                  policies=("summary", "full", FLATTEN_VIEW)))},
                                expert="rational", perturb_frac=0.2, redraw_values=True,
                                state_players=("scripted",), gap_copies=3),
    "student": replace(REPLICATION_SFT_PRESETS["student"], steps=1000),
}
ROLE_PRESETS = (INFOGAP_MODEL_PRESETS, INFOGAP_SFT_PRESETS)  # what `role_presets` reads for the "info-gap" world


def _last_mem_span(ids: Sequence[int], tk: ProtocolTokens) -> tuple[int, int] | None:
    close = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == tk.mem_close), None)
    if close is None:
        return None
    open_ = next((i for i in range(close - 1, -1, -1) if ids[i] == tk.mem_open), None)
    return None if open_ is None else (open_, close + 1)


def perturbed_state(context_ids: Sequence[int], tokenizer, world, rng: random.Random) -> list[int] | None:
    """`context_ids` with one entry of its last notes dropped or corrupted (a wrong value of
    its attribute, or another middle entity), or None when the notes hold no filled entry."""
    tk = ProtocolTokens.from_tokenizer(tokenizer)
    ids = [int(i) for i in context_ids]
    span = _last_mem_span(ids, tk)
    if span is None:
        return None
    text = tokenizer.decode(ids[span[0] + 1:span[1] - 1], skip_special_tokens=True)
    entries = parse_entries(text)
    filled = [j for j, (_, vals) in enumerate(entries) if vals]
    if not filled:
        return None
    j = rng.choice(filled)
    vals = entries[j][1]
    if rng.random() < 0.5:
        del entries[j]
    else:
        joined = " ".join(vals)
        pool = [v for a in world.config.attributes for v in world.values[a] if joined in world.values[a]]
        if len(vals) == 1 and not is_value(vals[0]):
            pool = world.entities
        choices = [v for v in pool if v != joined]
        if not choices:
            del entries[j]
        else:
            entries[j][1] = rng.choice(choices).split()
    mem = " ".join(" ".join([answer_label(i)] + v) for i, v in entries)
    new = tokenizer.encode(f"<mem> {mem}</mem>" if mem else "<mem></mem>", add_special_tokens=False)
    return ids[:span[0]] + [int(i) for i in new] + ids[span[1]:]


def expert_examples(world: World, env: QAEnv, ks: Sequence[int], calls_per_k: int, *, seed: int = 0,
                    split: str = "train", policies: Sequence[str] = (), expert: str = "scripted",
                    perturb_frac: float = 0.0, redraw_values: bool = False, state_players: Sequence[str] = (),
                    gap_copies: int = 0) -> tuple[list[Example], dict[str, Any]]:
    """The product's `expert_examples` (memopd/env/qa/sft.py) with the info-gap options;
    with their defaults, the same examples.

    `expert`: "scripted" or "rational" (`memopd.env.qa.expert.make_expert`); `perturb_frac`: the share of
    sampled calls whose context gets one entry of its notes dropped or corrupted
    (`perturbed_state`), the action then being the expert's on that state under the same
    view (`stats["perturbed"]` counts them). `redraw_values`: each round of at most
    `REDRAW_ROUND_SETS` sets is played in its own `world.with_redrawn_values` copy
    (`stats["worlds"]` counts them). `state_players`: experts whose episodes give
    `calls_per_k` more calls per view and k, each state labelled by `expert`
    (`calls_by_policy` key "VIEW@PLAYER"). `gap_copies` (with the rational expert): each
    sampled, unperturbed flatten-view call that is an information-gap call is added that
    many more times, and as many times as its continuation after the compact call's memory
    span (`gap_continuation`; `stats["gap_calls"]` and `stats["gap_examples"]` count them).
    """
    if not 0.0 <= perturb_frac < 1.0:
        raise DataError(f"perturb_frac must be in [0, 1), got {perturb_frac}")
    if isinstance(gap_copies, bool) or not isinstance(gap_copies, int) or gap_copies < 0:
        raise DataError(f"gap_copies must be an integer >= 0, got {gap_copies!r}")
    if gap_copies and expert != "rational":
        raise DataError(f"gap_copies needs the rational expert (information-gap calls are its own), got {expert!r}")
    build = _Build(world, env, make_expert(expert, env.tokenizer, world.config), calls_per_k, seed, split,
                   perturb_frac, redraw_values, gap_copies)
    build.stats["expert"] = expert
    players = [(expert, build.engine)] + [(p, make_expert(p, env.tokenizer, world.config)) for p in state_players
                                          if p != expert]
    examples: list[Example] = []
    for name, player in players:
        for view in list(policies) or [env.config.policy]:
            play, first = view_env(env, view), len(examples)
            for k in ks:
                pool = build.pool(play, view, k, name, player)
                # sampling indices draws exactly what sampling the pool itself would
                for i in build.rng.sample(range(len(pool)), calls_per_k):
                    examples += build.sampled(pool[i])
            build.stats["calls_by_policy"][view if player is build.engine else f"{view}@{name}"] = len(examples) - first
    return examples, data_stats(examples, build.stats)


class _Build:
    """The settings and random streams of one `expert_examples` call, and its counts."""

    def __init__(self, world: World, env: QAEnv, engine, calls_per_k: int, seed: int, split: str,
                 perturb_frac: float, redraw_values: bool, gap_copies: int):
        self.world, self.env, self.engine, self.calls_per_k = world, env, engine, calls_per_k
        self.seed, self.split = seed, split
        self.perturb_frac, self.redraw_values, self.gap_copies = perturb_frac, redraw_values, gap_copies
        self.rng = random.Random(f"sft-{seed}")
        self.prng = random.Random(f"sft-perturb-{seed}")  # its own stream: unperturbed data as without it
        self.stats: dict[str, Any] = {"episodes": 0, "calls": 0, "calls_by_policy": {}, "perturbed": 0,
                                      "expert": None, "worlds": 0, "gap_calls": 0, "gap_examples": 0}

    def pool(self, play: QAEnv, view: str, k: int, name: str, player) -> list:
        """Rounds of `player`'s episodes of k questions in `view` until they hold
        `calls_per_k` calls (`view_calls`), each round in its own redrawn world if asked."""
        own = player is self.engine  # the labelling expert's own episodes: their recorded actions are its labels
        tag = "" if own else f"-{name}"
        chunk = episodes_per_round(k, self.calls_per_k)
        if self.redraw_values:
            chunk = min(chunk, REDRAW_ROUND_SETS)
        pool: list = []
        rnd = 0
        while len(pool) < self.calls_per_k:
            w, env = self.world, play
            if self.redraw_values:  # the sets' answers are those of the copy they are played in
                w = self.world.with_redrawn_values(f"{self.seed}-{view}-{k}-{rnd}{tag}")
                env = QAEnv.from_world(w, self.env.tokenizer, play.config)
                self.stats["worlds"] += 1
            tasks = w.sample_tasks(k, chunk, split=self.split, seed=self.seed * 1000 + rnd)
            trajs = expert_rollouts(env, player, tasks, name)
            pool += view_calls(trajs, view, self.engine, own)
            self.stats["episodes"] += len(trajs)
            rnd += 1
        return pool

    def sampled(self, call) -> list[Example]:
        """A sampled call's examples: the call (or its perturbed state, labelled by the
        expert) and, at an unperturbed information-gap call, its gap copies."""
        ex, prefix, context, compact = call
        perturbed = False
        if self.perturb_frac > 0 and self.prng.random() < self.perturb_frac:
            new = perturbed_state(context, self.env.tokenizer, self.world, self.prng)
            if new is not None:
                state = list(prefix) + new
                ex, perturbed = (state + self.engine.act(state), len(state)), True
                self.stats["perturbed"] += 1
        copies = []
        if self.gap_copies and compact is not None and not perturbed:
            copies = gap_examples(self.engine, compact, ex, self.gap_copies)
        if copies:
            self.stats["gap_calls"] += 1
            self.stats["gap_examples"] += len(copies)
        return [ex] + copies


def gap_continuation(expert, compact_state: Sequence[int], flat_state: Sequence[int]) -> Example | None:
    """The rule's continuation on the flattened state after the compact call's memory span:
    (flattened state + the compact action's memory span + the flattened action's search or
    answer, the prompt length that leaves only that last part as the label), or None where
    the two views' actions write the same memory span (the plain example already parts
    them). `expert`: the `infogap_expert.RationalExpert`, whose next step does not depend on the
    memory span its action writes, only on what the state shows."""
    return _continuation(expert, flat_state, expert.action_text(compact_state), expert.action_text(flat_state))


def _continuation(expert, flat_state: Sequence[int], c: str, f: str) -> Example | None:
    """`gap_continuation` from the rule's action texts on the compact call (c) and on the
    flattened state (f)."""
    cut_c, cut_f = c.find("</mem>"), f.find("</mem>")
    if cut_c < 0 or cut_f < 0:
        raise RuntimeError(f"the rule wrote an action without a memory span: {c!r} / {f!r}")
    mem_c, rest_f = c[:cut_c + len("</mem>")], f[cut_f + len("</mem>"):]
    if mem_c == f[:cut_f + len("</mem>")]:
        return None
    enc = expert.tokenizer.encode
    prompt = [int(i) for i in flat_state] + [int(i) for i in enc(mem_c, add_special_tokens=False)]
    return prompt + [int(i) for i in enc(rest_f, add_special_tokens=False)], len(prompt)


def gap_examples(expert, compact_state: Sequence[int], example: Example, copies: int) -> list[Example]:
    """`copies` more of a flattened state's own `example` (state + the rule's action, the
    state's length) and `copies` of its continuation (`gap_continuation`) where the rule
    acts otherwise on the compact call; [] elsewhere."""
    flat_state = example[0][:example[1]]
    c, f = expert.action_text(compact_state), expert.action_text(flat_state)
    if c == f:
        return []
    cont = _continuation(expert, flat_state, c, f)
    return [example] * copies + ([cont] * copies if cont is not None else [])
