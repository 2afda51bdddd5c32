"""Teacher scores for every call of a session, each in the state the student sampled it in.

verl 0.9.1's TransferQueue worker scores only the last `AgentLoopOutput` of an agent loop
(`agent_loop_tq.py`, "TODO: Support output:list[AgentLoopOutput]"). `score_every_call`
scores all of a session's rows through a `TeacherScorer` and writes each call's scores
into its row (`extra_fields["memopd_teacher"]`); `ScoreEveryCallMixin` puts it in front of
a worker's `_agent_loop_postprocess`, and `tq_worker_class()` / `MemopdAgentLoopManagerTQ`
give verl's TransferQueue worker and manager that behaviour
(`actor_rollout_ref.rollout.agent.agent_loop_manager_class`).

A scorer turns sessions (`memopd.Trajectory`, rebuilt from the rows) into one `CallScore`
per call, in call order:
- kind "hidden" (full vocabulary): the teacher's last hidden states `[A_t, H]` at the
  positions that predict each action token, plus `head()` -> the teacher's lm_head
  (`memopd.hf.LMHead`); the trainer's fused loss forms the KL over the full vocabulary.
  `LocalTeacherScorer` (an in-process Hugging Face teacher, packed aligned: every call at
  its restored positions and visibility) and `ServedTeacherScorer` (the same packed
  batches sent to `memopd serve-teacher` through `memopd.teacher_client.ServedTeacher`;
  its lm_head read once, from a server whose weight fingerprint is checked) implement it.
- kind "topk": verl's own teacher servers (`VerlTopKScorer`: the ids and log-probs verl's
  `compute_teacher_logprobs_single` returns for `q + x_t + a_t`, which is exactly call t's
  state), for verl's top-k distillation losses.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from memopd.errors import UserError
from memopd.hf import LMHead, head_of, packed_forward
from memopd.packing import pack
from memopd.records import Trajectory

from .rows import ROW_KEY, session_sizes, sessions_from_rows

__all__ = ["CallScore", "TeacherScorer", "LocalTeacherScorer", "ServedTeacherScorer", "VerlTopKScorer", "score_every_call",
           "ScoreEveryCallMixin", "session_groups", "TEACHER_KEY"]

TEACHER_KEY = "memopd_teacher"
RESUME_HINT = "resume the verl run (trainer.resume_mode=auto continues from its last checkpoint)"


@dataclass
class CallScore:
    """The teacher's view of one call's action tokens (A_t of them)."""

    kind: str  # "hidden" or "topk"
    hidden: torch.Tensor | None = None  # [A_t, H]
    topk_ids: torch.Tensor | None = None  # [A_t, k]
    topk_logprobs: torch.Tensor | None = None  # [A_t, k]


class TeacherScorer(Protocol):
    kind: str

    async def score(self, sessions: Sequence[Trajectory]) -> list[list[CallScore]]:
        """One list per session, one `CallScore` per call, in call order."""
        ...


def session_groups(trajs: Sequence[Trajectory], max_tokens: int) -> list[list[int]]:
    """Sessions in order, cut into groups of at most `max_tokens` aligned tokens; a session
    is never split (one over the budget is an error naming it)."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(session_sizes(trajs)):
        if n > max_tokens:
            raise ValueError(f"session {trajs[i].task_id!r} takes {n} tokens packed, over the budget of {max_tokens}: "
                             "raise the micro-batch token budget (a session is never split)")
        if not groups or used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


class LocalTeacherScorer:
    """An in-process Hugging Face teacher: each group of sessions packed in the aligned
    layout (shared prefix, every call at restored positions and visibility) and run once;
    the hidden states at the action-predicting positions are returned per call."""

    kind = "hidden"

    def __init__(self, model, *, max_tokens: int = 8192, attention_backend: str = "auto"):
        self.model = model
        self.max_tokens = int(max_tokens)
        self.attention_backend = attention_backend

    def head(self) -> LMHead:
        return head_of(self.model)

    @torch.no_grad()
    def score_now(self, sessions: Sequence[Trajectory]) -> list[list[CallScore]]:
        sessions = list(sessions)
        out: list[list[CallScore]] = [[None] * len(tr.invocations) for tr in sessions]
        for group in session_groups(sessions, self.max_tokens):
            batch = pack([sessions[i] for i in group], "aligned", self.max_tokens)
            h = packed_forward(self.model, batch, output="hidden", attention_backend=self.attention_backend)
            _split_by_call(h, batch, group, sessions, out)
        return out

    async def score(self, sessions: Sequence[Trajectory]) -> list[list[CallScore]]:
        return self.score_now(sessions)


def _split_by_call(h: torch.Tensor, batch, group: list[int], sessions: Sequence[Trajectory], out) -> None:
    """Write the rows of `h` ([A, H], `batch`'s actions in order) of call t of the b-th
    session of `group` into `out[group[b]][t]`."""
    keys = torch.stack([batch.traj_index, batch.call_index]).cpu()
    for b in range(len(group)):
        for t in range(len(sessions[group[b]].invocations)):
            sel = ((keys[0] == b) & (keys[1] == t)).nonzero().flatten()
            out[group[b]][t] = CallScore("hidden", hidden=h.index_select(0, sel.to(h.device)))


class ServedTeacherScorer:
    """The teacher behind `memopd serve-teacher` (`memopd.teacher_client.ServedTeacher`):
    the packed aligned batches `LocalTeacherScorer` runs (groups of whole sessions of at
    most `max_tokens` tokens, every call at its restored positions and visibility) go to
    the server, one request per group (packed while the previous one is answered); it
    answers the teacher's last hidden states at the action-predicting positions (fp32, or
    bf16 on the wire with `transport="bf16"`), split here per call. `head()` is the
    server's lm_head, read once (from the server, or from `head_dir`, a local copy of the
    teacher's files with the same fingerprint). `fingerprint`, when given (the sha256 of
    the teacher's weight files, or a prefix of it of at least 16 hex digits), must be the
    server's: another teacher is refused at connect. The connection faults are the
    client's: a server that does not answer within `timeout` after `retries` retries is
    one `PeerError` (exit 69) naming it."""

    kind = "hidden"

    def __init__(self, client, *, max_tokens: int = 8192, fingerprint: str | None = None):
        self.client = client
        self.max_tokens = int(max_tokens)
        served = client.fingerprint["sha256"]
        if fingerprint is not None:
            want = str(fingerprint).strip().lower()
            if len(want) < 16 or not served.startswith(want):
                raise UserError(f"memopd.teacher.fingerprint={fingerprint!r}, but the teacher served at {client.url} has "
                                f"weights {served[:16]} ({client.fingerprint.get('path')}): serve the teacher this run was "
                                "set up with, or update the key (at least 16 hex digits of the sha256)")

    @classmethod
    def connect(cls, url: str, *, secret_file: str | None = None, timeout: float = 60.0, retries: int = 3,
                transport: str = "fp32", head_dir: str | None = None, max_tokens: int = 8192,
                fingerprint: str | None = None) -> "ServedTeacherScorer":
        """A scorer over a new `ServedTeacher` at `url` (connected and checked now)."""
        from memopd.teacher_client import ServedTeacher

        client = ServedTeacher(url, secret_file=secret_file, timeout=timeout, retries=retries, transport=transport,
                               head_dir=head_dir, resume_hint=RESUME_HINT)
        try:
            return cls(client, max_tokens=max_tokens, fingerprint=fingerprint)
        except BaseException:
            client.close()
            raise

    @property
    def fingerprint(self) -> dict:
        """The server's weight fingerprint ({"sha256", "path", "files", "url"})."""
        return self.client.fingerprint

    def head(self) -> LMHead:
        return self.client.lm_head()

    def score_now(self, sessions: Sequence[Trajectory]) -> list[list[CallScore]]:
        sessions = list(sessions)
        out: list[list[CallScore]] = [[None] * len(tr.invocations) for tr in sessions]
        sent = []
        for group in session_groups(sessions, self.max_tokens):
            batch = pack([sessions[i] for i in group], "aligned", self.max_tokens)
            sent.append((group, batch, self.client.submit(batch, self.max_tokens)))
        for group, batch, pending in sent:
            _split_by_call(pending.result(), batch, group, sessions, out)
        return out

    async def score(self, sessions: Sequence[Trajectory]) -> list[list[CallScore]]:
        return await asyncio.to_thread(self.score_now, sessions)  # the client blocks: keep the worker's loop free

    def close(self) -> None:
        self.client.close()


class VerlTopKScorer:
    """verl's teacher servers (`AsyncTeacherLLMServerManager`): each call scored on its own
    sequence `q + x_t + a_t`, the ids the student saw plus what it sampled; returns the
    rows of the action tokens."""

    kind = "topk"

    def __init__(self, teacher_server_manager):
        self.manager = teacher_server_manager

    async def score(self, sessions: Sequence[Trajectory]) -> list[list[CallScore]]:
        out = []
        for tr in sessions:
            calls = []
            for inv in tr.invocations:
                ids, lps = await self.manager.compute_teacher_logprobs_single(sequence_ids=inv.input_ids)
                n_in, n_a = len(inv.prefix_ids) + len(inv.context_ids), len(inv.action_ids)
                calls.append(CallScore("topk", topk_ids=ids[n_in:n_in + n_a], topk_logprobs=lps[n_in:n_in + n_a]))
            out.append(calls)
        return out


async def score_every_call(rows: Sequence[Any], scorer: TeacherScorer) -> int:
    """Score every call of the sessions in `rows` (AgentLoopOutputs carrying memopd's
    record) and write each call's `CallScore` into its row's
    `extra_fields[TEACHER_KEY]`. Returns the number of calls scored."""
    rows = list(rows)
    sessions, ids = sessions_from_rows(rows)
    scores = await scorer.score(sessions)
    where = {sid: s for sid, s in zip(ids, scores)}
    for row in rows:
        rec = row.extra_fields[ROW_KEY]
        row.extra_fields[TEACHER_KEY] = where[rec["session_id"]][rec["call"]]
    return len(rows)


class ScoreEveryCallMixin:
    """Put before an `AgentLoopWorker` class: every memopd row of an agent loop's output is
    teacher-scored (all calls, not only the last) before verl's own post-processing.
    `self.memopd_scorer` must be a `TeacherScorer` (set by `build_scorer`)."""

    memopd_scorer: TeacherScorer | None = None

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        rows = output if isinstance(output, list) else [output]
        if not validate and self.memopd_scorer is not None and rows and ROW_KEY in rows[0].extra_fields:
            await score_every_call(rows, self.memopd_scorer)
        return await super()._agent_loop_postprocess(output, validate, **kwargs)


def build_scorer(worker, settings: dict) -> TeacherScorer | None:
    """The scorer named by `memopd.teacher.kind`: "memopd" (an in-process Hugging Face
    teacher loaded from `memopd.teacher.path`), "served" (`memopd serve-teacher` at
    `memopd.teacher.url`, with `secret_file`, `timeout`, `retries`, `transport`, `head_dir`,
    `fingerprint`), "verl_topk" (verl's teacher servers, with verl's distillation config)
    or "none"."""
    t = dict(settings.get("teacher") or {})
    kind = t.get("kind", "none")
    if kind == "none":
        return None
    if kind == "verl_topk":
        manager = getattr(worker, "teacher_server_manager", None)
        if manager is None:
            raise ValueError("memopd.teacher.kind=verl_topk needs verl's distillation enabled (distillation.*)")
        return VerlTopKScorer(manager)
    if kind == "memopd":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(t["path"], torch_dtype=getattr(torch, t.get("dtype", "float32")))
        model.to(t.get("device", "cuda" if torch.cuda.is_available() else "cpu")).eval()
        return LocalTeacherScorer(model, max_tokens=int(t.get("max_tokens", 8192)))
    if kind == "served":
        if not t.get("url"):
            raise UserError("memopd.teacher.kind=served needs memopd.teacher.url=http://HOST:PORT (the address "
                            "`memopd serve-teacher` prints)")
        return ServedTeacherScorer.connect(
            t["url"], secret_file=t.get("secret_file") or None, timeout=float(t.get("timeout", 60.0)),
            retries=int(t.get("retries", 3)), transport=t.get("transport", "fp32"), head_dir=t.get("head_dir") or None,
            max_tokens=int(t.get("max_tokens", 8192)), fingerprint=t.get("fingerprint") or None)
    raise ValueError(f"memopd.teacher.kind={kind!r}; choose memopd, served, verl_topk or none")


def tq_worker_class():
    """verl's TransferQueue agent-loop worker with `ScoreEveryCallMixin`, as a Ray actor class."""
    import ray
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from .agent_loop import memopd_settings

    base = AgentLoopWorkerTQ.__ray_metadata__.modified_class  # the plain class under @ray.remote

    class MemopdAgentLoopWorkerTQ(ScoreEveryCallMixin, base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.memopd_scorer = build_scorer(self, memopd_settings(self.config))

    return ray.remote(MemopdAgentLoopWorkerTQ)


def _manager_class():
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    class MemopdAgentLoopManagerTQ(AgentLoopManagerTQ):
        """verl's TransferQueue agent-loop manager whose workers score every call."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.agent_loop_workers_class = tq_worker_class()

    return MemopdAgentLoopManagerTQ


def __getattr__(name):  # the manager class needs verl's TransferQueue module: built on first use
    if name == "MemopdAgentLoopManagerTQ":
        cls = _manager_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
