"""The multi-objective retrieval QA environment (k questions in one episode).

`QAEnv` holds a corpus, a BM25 retriever, a tokenizer and a memory policy;
`env.reset(task)` starts an `Episode`. The episode owns the exact state of the agent:

- `prefix_ids` (q): `<bos>` + instruction + the k marked questions, stable all episode;
- `context_ids` (x_t) and their provenance: built by the memory policy of
  `memopd.memory` (default "summary": keep the memory span of the last action, plus the
  last observation); x_0 is empty.

`episode.prompt_ids()` is exactly what the model must receive (q + x_t), and
`episode.step(action_ids, logprobs)` records the call as an `Invocation` (the ids as
given, never re-tokenised), parses the action on ids, runs the search or scores the
answer, tokenises the observation and asks the policy for x_{t+1}. A malformed action
gets `<info> error : ... </info>` and uses up a turn; it never raises.

Rewards (see `metrics`): per sub-question EM and F1 (max over aliases). The trajectory's
scalar `reward` is the mean F1 over the k questions by default (`EnvConfig.reward="em"`
makes it the EM mean, i.e. the fraction answered right); `rewards` holds the per-question
lists and the sums/means ("em_sum" = number right, "em_mean" = fraction right).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from memopd.memory import MemoryPolicy, make_policy
from memopd.recording import Recorder
from memopd.records import Invocation, Trajectory

from .data import DataError, Document, Task
from .metrics import score_answers
from .protocol import DOC_SEPARATOR, ERRORS, NO_RESULTS, ProtocolTokens, parse_action, prefix_text, split_answers
from .retriever import BM25Retriever

__all__ = ["EnvConfig", "QAEnv", "Episode", "StepResult"]


def _one_or_seq(seq: Sequence[int]) -> int | tuple[int, ...]:
    return int(seq[0]) if len(seq) == 1 else tuple(int(i) for i in seq)


@dataclass
class EnvConfig:
    """Environment knobs.

    top_k: documents per search. max_turns: call budget per episode (None: the set's own
    budget, `Task.meta["max_turns"]`, where it has one, else 2k + 2, enough for the
    expert's at most 2k searches + 1 answer, plus one slack turn).
    max_doc_tokens: each retrieved document is cut to this many ids (long user docs).
    policy / policy_kwargs: the memory policy (`memopd.memory.make_policy`).
    require_memory: an action without a `<mem>…</mem>` span is a format error.
    reward: "f1" or "em": which per-question mean becomes `Trajectory.reward`.
    """

    top_k: int = 3
    max_turns: int | None = None
    max_doc_tokens: int = 48
    policy: str = "summary"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    require_memory: bool = True
    reward: str = "f1"

    def __post_init__(self) -> None:
        if self.reward not in ("f1", "em"):
            raise ValueError(f"EnvConfig.reward must be 'f1' or 'em', got {self.reward!r}")
        if self.top_k < 1:
            raise ValueError(f"EnvConfig.top_k must be >= 1, got {self.top_k}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"EnvConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.max_doc_tokens < 1:
            raise ValueError(f"EnvConfig.max_doc_tokens must be >= 1, got {self.max_doc_tokens}")

    def turns_for(self, k: int) -> int:
        return self.max_turns if self.max_turns is not None else 2 * k + 2


@dataclass
class StepResult:
    observation_ids: list[int]
    done: bool
    kind: str  # "search", "answer" or "error"
    error: str | None = None


class QAEnv:
    def __init__(self, documents: Sequence[Document], tokenizer, config: EnvConfig | None = None,
                 retriever: BM25Retriever | None = None, *, answer_words: int = 1):
        """`answer_words`: words the longest answer may take; it sizes the per-call
        token limit (`rollout.default_max_new_tokens`)."""
        if answer_words < 1:
            raise ValueError(f"answer_words must be >= 1, got {answer_words}")
        self.config = config or EnvConfig()
        self.answer_words = int(answer_words)
        self.documents = list(documents)
        self.tokenizer = tokenizer
        self.tokens = ProtocolTokens.from_tokenizer(tokenizer)
        self.retriever = retriever or BM25Retriever(self.documents, top_k=self.config.top_k)
        self.policy: MemoryPolicy = make_policy(
            self.config.policy,
            # one id per tag for the project tokenizer, an id sequence for a generic one
            mem_open_id=_one_or_seq(self.tokens.mem_open_ids),
            mem_close_id=_one_or_seq(self.tokens.mem_close_ids),
            **self.config.policy_kwargs,
        )
        self._doc_ids_cache: dict[int, list[int]] = {}
        # Every text span is encoded with a leading space (" word ..."), so each word is
        # its "Ġword" token wherever it appears (see `tokenizer`).
        self._sep_ids = self.encode(" " + DOC_SEPARATOR)
        self._error_ids = {k: self._wrap(self.encode(" " + v)) for k, v in ERRORS.items()}
        self._no_results_ids = self._wrap(self.encode(" " + NO_RESULTS))

    @classmethod
    def from_world(cls, world, tokenizer, config: EnvConfig | None = None) -> "QAEnv":
        from .world import max_answer_words

        return cls(world.documents, tokenizer, config, answer_words=max_answer_words(world.config))

    # ---- text <-> ids --------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _wrap(self, ids: list[int]) -> list[int]:
        return list(self.tokens.info_open_ids) + ids + list(self.tokens.info_close_ids)

    def prefix_ids(self, task: Task) -> list[int]:
        bos = [] if self.tokens.bos is None else [self.tokens.bos]  # a tokenizer may declare no bos
        return bos + self.encode(prefix_text(task.questions))

    def _doc_ids(self, index: int) -> list[int]:
        ids = self._doc_ids_cache.get(index)
        if ids is None:
            ids = self.encode(" " + self.documents[index].display)[: self.config.max_doc_tokens]
            self._doc_ids_cache[index] = ids
        return ids

    def search_observation(self, query: str) -> tuple[list[int], list[str]]:
        """Observation ids for a query, and the ids of the documents shown."""
        hits = self.retriever.search_indices(query, self.config.top_k)
        if not hits:
            return list(self._no_results_ids), []
        body: list[int] = []
        for j, h in enumerate(hits):
            if j:
                body += self._sep_ids
            body += self._doc_ids(h)
        return self._wrap(body), [self.documents[h].id for h in hits]

    def error_observation(self, code: str) -> list[int]:
        return list(self._error_ids[code])

    def reset(self, task: Task, *, group_id: str | None = None) -> "Episode":
        return Episode(self, task, group_id=task.task_id if group_id is None else group_id)


class Episode:
    """One episode's exact state and record (see module doc)."""

    def __init__(self, env: QAEnv, task: Task, *, group_id: str):
        self.env = env
        self.task = task
        self.group_id = group_id
        # the exact state (q, x_t with provenance) and the calls: memopd.recording.Recorder
        self.recorder = Recorder(env.policy, env.prefix_ids(task), task_id=task.task_id, group_id=group_id)
        # a set's own budget (`Task.meta["max_turns"]`, the "efficient" turn budget of a
        # world) applies unless the environment fixes one for every set
        own = (task.meta or {}).get("max_turns") if env.config.max_turns is None else None
        self.max_turns = int(own) if own is not None else env.config.turns_for(task.k)
        self.done = False
        self.finish: str | None = None  # "answer", "budget" or "overflow"
        self.predictions: list[str] | None = None
        self.format_errors = 0
        self.searches: list[tuple[str, list[str]]] = []  # (query, doc ids shown)
        self.rollout_index = 0  # which of a group's rollouts this is (set by `rollout`)

    @property
    def turn(self) -> int:
        return self.recorder.turn

    @property
    def prefix_ids(self) -> list[int]:
        return self.recorder.prefix_ids

    @property
    def context_ids(self) -> list[int]:
        return self.recorder.context_ids

    @property
    def context_provenance(self) -> list[tuple[int, int, int]]:
        return self.recorder.context_provenance

    @property
    def invocations(self) -> list[Invocation]:
        return self.recorder.invocations

    def prompt_ids(self) -> list[int]:
        """Exactly the ids the model receives at this call: q + x_t."""
        return self.recorder.prompt_ids()

    def step(self, action_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> StepResult:
        if self.done:
            raise RuntimeError(f"episode {self.task.task_id!r} is over ({self.finish}); no more steps")
        action_ids = [int(i) for i in action_ids]
        if not action_ids:
            raise ValueError("an action needs at least one sampled id")
        env, tk = self.env, self.env.tokens
        parsed = parse_action(action_ids, tk, require_memory=env.config.require_memory)
        obs: list[int]
        if parsed.kind == "error":
            self.format_errors += 1
            obs = env.error_observation(parsed.error)
        else:
            s, e = parsed.body
            text = env.decode(action_ids[s:e])
            if parsed.kind == "search":
                if not text.strip():
                    self.format_errors += 1
                    parsed.kind, parsed.error = "error", "empty_query"
                    obs = env.error_observation("empty_query")
                else:
                    obs, shown = env.search_observation(text)
                    self.searches.append((text, shown))
            else:
                self.predictions = split_answers(text, self.task.k)
                self.done, self.finish = True, "answer"
                obs = []  # nothing follows the final answer
        self.recorder.record(action_ids, logprobs, obs, last=self.done)
        if not self.done and self.turn >= self.max_turns:
            self.done, self.finish = True, "budget"
        return StepResult(list(obs), self.done, parsed.kind, parsed.error)

    def stop(self, reason: str) -> None:
        """End the episode from outside (e.g. the context no longer fits the model)."""
        if not self.done:
            self.done, self.finish = True, reason

    def scores(self) -> dict:
        return score_answers(self.predictions, self.task.answers)

    def trajectory(self) -> Trajectory:
        if not self.invocations:
            raise DataError(f"episode {self.task.task_id!r} has no calls yet")
        sc = self.scores()
        rewards = dict(sc)
        rewards["k"] = self.task.k
        rewards["format_errors"] = self.format_errors
        rewards["answered"] = self.predictions is not None
        reward = sc["f1_mean"] if self.env.config.reward == "f1" else sc["em_mean"]
        peak = max(len(inv) for inv in self.invocations)
        info = {
            "k": self.task.k,
            "turns": self.turn,
            "finish": self.finish,
            "predictions": self.predictions,
            "answers": self.task.answers,
            "peak_tokens": peak,
            "policy": self.env.config.policy,
            "reward_kind": self.env.config.reward,
        }
        return Trajectory(list(self.invocations), reward=float(reward), task_id=self.task.task_id,
                          group_id=self.group_id, rewards=rewards, info=info)
