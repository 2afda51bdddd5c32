"""Exact records of model calls: `Invocation`, `Trajectory`, and their on-disk format.

An invocation holds the token ids the model received (`prefix_ids` = q, `context_ids` =
x_t) and the ids it sampled (`action_ids` = a_t), never text. Optional per-token
provenance says where each context token came from, so packing and audits can tell a
sampled action token from a later re-encoded copy of it.

On disk a set of trajectories is one JSON-Lines file (readable by any tool): a header
line, one line per trajectory, and a footer with the count and a SHA-256 of the body, so
a truncated or corrupted file is an error instead of a silent partial load.
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
import operator
import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Sequence

from .errors import UserError

__all__ = [
    "Source",
    "Invocation",
    "Trajectory",
    "RecordError",
    "save_trajectories",
    "load_trajectories",
]

FORMAT_NAME = "memopd.trajectories"
FORMAT_VERSION = 1


class RecordError(UserError, ValueError):
    """A record (or a file of records) breaks the contract of docs/design.md §1."""


class Source(enum.IntEnum):
    """Provenance codes of a context token.

    A context token is described by a triple `(source, call, offset)`:
    - `TEMPLATE`: inserted by the environment or the memory policy (tags, separators,
      the initial context); `call` is the call whose update inserted it (-1 for the
      initial context) and `offset` is -1.
    - `ACTION`: copy of `action_ids[offset]` of invocation `call` of the same trajectory.
    - `OBSERVATION`: copy of `observation_ids[offset]` of invocation `call`.
    """

    TEMPLATE = 0
    ACTION = 1
    OBSERVATION = 2

    def __str__(self) -> str:
        return self.name.lower()


_SOURCE_CODES = frozenset(int(s) for s in Source)


def _as_int_list(name: str, values: Any) -> list[int]:
    if values is None:
        raise RecordError(f"{name} is missing")
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise RecordError(f"{name} must be a list of integer token ids, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, int) or _is_bool(v):
            iv = None
            if not _is_bool(v):  # bool is an int subclass: JSON `true` is not token id 1
                try:
                    iv = operator.index(v)  # numpy / torch integers
                except TypeError:
                    if isinstance(v, float) and v.is_integer() and abs(v) < _EXACT_FLOAT_INT:
                        iv = int(v)
            if iv is None:
                raise RecordError(f"{name}[{i}] = {_short(v)} is not an integer token id")
            v = iv
        if v >= _INT64_END:  # no vocabulary is that large, and torch's ids are int64
            raise RecordError(f"{name}[{i}] = {_short(v)} is not a token id (beyond int64)")
        out.append(v)
    return out


_EXACT_FLOAT_INT = 2**53  # a float id is an integer only where floats are exact (1e300 is not an id)
_INT64_END = 2**63


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"


def _to_float(v: Any) -> float | None:
    """float(v) for a real number (numpy and 0-d tensors too); None for anything else."""
    if _is_bool(v) or isinstance(v, (str, bytes)) or v is None:
        return None
    if hasattr(v, "ndim") and getattr(v, "dtype", None) is not None and "bool" in str(v.dtype):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _as_float_list(name: str, values: Any) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise RecordError(f"{name} must be a list of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        f = _to_float(v)
        if f is None:
            raise RecordError(f"{name}[{i}] = {v!r} is not a number")
        out.append(f)
    return out


def _as_number(name: str, v: Any) -> float:
    f = _to_float(v)
    if f is None:
        raise RecordError(f"{name} = {v!r} is not a number")
    return f


@dataclass
class Invocation:
    """One model call: exact ids in, exact ids sampled, their sampling log-probs.

    provenance: None, or one `(source, call, offset)` triple per context token (see
    `Source`). observation_ids: what the environment answered after this call (optional;
    needed for observation provenance and for the flatten layout's naive domain).
    """

    prefix_ids: list[int]
    context_ids: list[int]
    action_ids: list[int]
    sample_logprobs: list[float] | None = None
    provenance: list[tuple[int, int, int]] | None = None
    observation_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.prefix_ids = _as_int_list("prefix_ids", self.prefix_ids)
        self.context_ids = _as_int_list("context_ids", self.context_ids)
        self.action_ids = _as_int_list("action_ids", self.action_ids)
        if self.observation_ids is not None:
            self.observation_ids = _as_int_list("observation_ids", self.observation_ids)
        if self.sample_logprobs is not None:
            self.sample_logprobs = _as_float_list("sample_logprobs", self.sample_logprobs)
        if self.provenance is not None:
            prov = self.provenance.tolist() if hasattr(self.provenance, "tolist") else self.provenance
            if isinstance(prov, (str, bytes, dict)) or not hasattr(prov, "__iter__"):
                raise RecordError(f"provenance must be a list of (source, call, offset), got {type(prov).__name__}")
            self.provenance = [tuple(_as_int_list(f"provenance[{i}]", p)) for i, p in enumerate(prov)]

    @property
    def input_ids(self) -> list[int]:
        """The full sequence the model saw while sampling, plus what it sampled."""
        return self.prefix_ids + self.context_ids + self.action_ids

    def __len__(self) -> int:
        return len(self.prefix_ids) + len(self.context_ids) + len(self.action_ids)

    def validate(self, vocab_size: int | None = None, where: str = "invocation") -> None:
        """Raise `RecordError` naming the first broken rule."""
        if len(self.action_ids) == 0:
            raise RecordError(f"{where}: action_ids is empty (a call must sample at least one token)")
        if len(self.prefix_ids) + len(self.context_ids) == 0:
            raise RecordError(f"{where}: prefix_ids and context_ids are both empty: nothing to condition on")
        for name in ("prefix_ids", "context_ids", "action_ids", "observation_ids"):
            ids = getattr(self, name)
            if ids is None:
                continue
            for i, v in enumerate(ids):
                if v < 0:
                    raise RecordError(f"{where}: {name}[{i}] = {v} is negative")
                if vocab_size is not None and v >= vocab_size:
                    raise RecordError(
                        f"{where}: {name}[{i}] = {v} is out of range for vocab_size {vocab_size}"
                    )
        if self.sample_logprobs is not None:
            if len(self.sample_logprobs) != len(self.action_ids):
                raise RecordError(
                    f"{where}: sample_logprobs has {len(self.sample_logprobs)} values for "
                    f"{len(self.action_ids)} action tokens"
                )
            for i, v in enumerate(self.sample_logprobs):
                if not math.isfinite(v):
                    raise RecordError(f"{where}: sample_logprobs[{i}] = {v} is not finite")
                if v > 1e-6:
                    raise RecordError(f"{where}: sample_logprobs[{i}] = {v} is positive (not a log-probability)")
        if self.provenance is not None:
            if len(self.provenance) != len(self.context_ids):
                raise RecordError(
                    f"{where}: provenance has {len(self.provenance)} entries for "
                    f"{len(self.context_ids)} context tokens"
                )
            for i, p in enumerate(self.provenance):
                if len(p) != 3 or p[0] not in _SOURCE_CODES:
                    raise RecordError(f"{where}: provenance[{i}] = {p} is not (source, call, offset)")

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "prefix_ids": self.prefix_ids,
            "context_ids": self.context_ids,
            "action_ids": self.action_ids,
        }
        if self.sample_logprobs is not None:
            d["sample_logprobs"] = self.sample_logprobs
        if self.provenance is not None:
            d["provenance"] = [list(p) for p in self.provenance]
        if self.observation_ids is not None:
            d["observation_ids"] = self.observation_ids
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Invocation":
        if not isinstance(d, dict):
            raise RecordError(f"an invocation must be a JSON object, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise RecordError(f"invocation has unknown fields {sorted(unknown)}")
        return cls(
            prefix_ids=d.get("prefix_ids"),
            context_ids=d.get("context_ids"),
            action_ids=d.get("action_ids"),
            sample_logprobs=d.get("sample_logprobs"),
            provenance=d.get("provenance"),
            observation_ids=d.get("observation_ids"),
        )


@dataclass
class Trajectory:
    """The ordered invocations of one episode, with its reward(s), task id and group id.

    Rollouts of the same prompt share `group_id`; their calls may share one prefix
    segment when packed. `reward` is the scalar the trainer uses; `rewards` may hold
    per-objective figures (e.g. EM/F1 per sub-question); `info` is free-form metadata.
    """

    invocations: list[Invocation]
    reward: float = 0.0
    task_id: str = ""
    group_id: str = ""
    rewards: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix_ids(self) -> list[int]:
        return self.invocations[0].prefix_ids if self.invocations else []

    def __len__(self) -> int:
        return len(self.invocations)

    @property
    def flattened_tokens(self) -> int:
        """Tokens of the persistent history `[q, x_0, a_0, x_1, a_1, ...]` (the `flatten`
        layout's one sequence per trajectory)."""
        return len(self.prefix_ids) + sum(len(inv.context_ids) + len(inv.action_ids) for inv in self.invocations)

    def validate(self, vocab_size: int | None = None, where: str = "trajectory") -> None:
        if len(self.invocations) == 0:
            raise RecordError(f"{where}: has no invocations")
        try:
            reward = _as_number("reward", self.reward)
        except RecordError as e:
            raise RecordError(f"{where}: {e}") from None
        if not math.isfinite(reward):
            raise RecordError(f"{where}: reward {self.reward} is not finite")
        q = self.invocations[0].prefix_ids
        for t, inv in enumerate(self.invocations):
            inv.validate(vocab_size, where=f"{where}, call {t}")
            if inv.prefix_ids != q:
                raise RecordError(
                    f"{where}, call {t}: prefix_ids differ from call 0's "
                    "(one trajectory must keep one stable task prefix q)"
                )
            if inv.provenance is not None:
                for i, (src, call, off) in enumerate(inv.provenance):
                    if src == Source.TEMPLATE:
                        if not -1 <= call < t:
                            raise RecordError(
                                f"{where}, call {t}: provenance[{i}] is a template token of call {call}, not an earlier call"
                            )
                        continue
                    if not 0 <= call < t:
                        raise RecordError(
                            f"{where}, call {t}: provenance[{i}] points at call {call}, not an earlier call"
                        )
                    ref = self.invocations[call]
                    src_ids = ref.action_ids if src == Source.ACTION else ref.observation_ids
                    if src_ids is None or not 0 <= off < len(src_ids):
                        raise RecordError(
                            f"{where}, call {t}: provenance[{i}] offset {off} is outside "
                            f"{Source(src)} of call {call}"
                        )
                    if src_ids[off] != inv.context_ids[i]:
                        raise RecordError(
                            f"{where}, call {t}: context token {i} (id {inv.context_ids[i]}) does not "
                            f"equal its claimed source {Source(src)}[{off}] of call {call} "
                            f"(id {src_ids[off]})"
                        )

    def to_json(self) -> dict:
        return {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "reward": self.reward,
            "rewards": self.rewards,
            "info": self.info,
            "invocations": [inv.to_json() for inv in self.invocations],
        }

    @classmethod
    def from_json(cls, d: dict) -> "Trajectory":
        if not isinstance(d, dict) or "invocations" not in d:
            raise RecordError("trajectory line has no 'invocations'")
        if not isinstance(d["invocations"], list):
            raise RecordError(f"'invocations' must be a list, got {type(d['invocations']).__name__}")
        for name in ("rewards", "info"):
            if not isinstance(d.get(name, {}), dict):
                raise RecordError(f"{name!r} must be a JSON object, got {type(d[name]).__name__}")
        invocations = []
        for t, x in enumerate(d["invocations"]):
            try:
                invocations.append(Invocation.from_json(x))
            except RecordError as e:
                raise RecordError(f"call {t}: {e}") from None
        return cls(
            invocations=invocations,
            reward=_as_number("reward", d.get("reward", 0.0)),
            task_id=str(d.get("task_id", "")),
            group_id=str(d.get("group_id", "")),
            rewards=dict(d.get("rewards", {})),
            info=dict(d.get("info", {})),
        )


def save_trajectories(path: str | os.PathLike, trajectories: Iterable[Trajectory], *, vocab_size: int | None = None) -> None:
    """Write trajectories as JSON Lines: header, one line each, footer with count + sha256.

    Written to a temporary file, synced and renamed (`memopd.files.atomic_file`), so an
    interrupted or failed save never leaves a half-written file under the final name nor
    a temp file beside it; an OS failure of the write (a full disk) is one `OutputError`
    (exit 74) naming the path.
    """
    from .files import atomic_file

    trajectories = list(trajectories)
    for i, tr in enumerate(trajectories):
        tr.validate(vocab_size, where=f"trajectory {i}")
    h = hashlib.sha256()
    with atomic_file(path, what=f"trajectories file {os.fspath(path)}") as tmp, open(tmp, "w", encoding="utf-8") as f:
        header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "vocab_size": vocab_size}
        f.write(json.dumps(header) + "\n")
        for tr in trajectories:
            line = json.dumps(tr.to_json(), separators=(",", ":"), allow_nan=False) + "\n"
            h.update(line.encode("utf-8"))
            f.write(line)
        f.write(json.dumps({"footer": True, "count": len(trajectories), "sha256": h.hexdigest()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def load_trajectories(path: str | os.PathLike, *, vocab_size: int | None = None, validate: bool = True) -> list[Trajectory]:
    """Read a file written by `save_trajectories`; raise `RecordError` if it is damaged."""
    import stat

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):  # /dev/zero would be read forever
                raise RecordError(f"{path}: a device, not a trajectories file")
            raw = f.read()
    except OSError as e:
        raise RecordError(f"{path}: cannot read the trajectories file ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"{path}: not UTF-8 text ({e}); the file is corrupted") from None
    lines = text.split("\n")
    if not text.endswith("\n") or len(lines) < 3:
        raise RecordError(f"{path}: truncated (no complete footer line)")
    lines = lines[:-1]
    try:
        header = json.loads(lines[0])
    except (ValueError, RecursionError):
        raise RecordError(f"{path}: first line is not a memopd header; not a trajectories file") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise RecordError(f"{path}: not a {FORMAT_NAME} file (header {lines[0][:80]!r})")
    if header.get("version") != FORMAT_VERSION:
        raise RecordError(f"{path}: format version {header.get('version')} is not supported (expected {FORMAT_VERSION})")
    try:
        footer = json.loads(lines[-1])
    except (ValueError, RecursionError):
        footer = None
    if not isinstance(footer, dict) or not footer.get("footer"):
        raise RecordError(f"{path}: truncated (last line is not the footer)")
    body = lines[1:-1]
    if footer.get("count") != len(body):
        raise RecordError(f"{path}: footer says {footer.get('count')} trajectories, file holds {len(body)}")
    h = hashlib.sha256()
    for line in body:
        h.update((line + "\n").encode("utf-8"))
    if h.hexdigest() != footer.get("sha256"):
        raise RecordError(f"{path}: checksum mismatch; the file is corrupted")
    if vocab_size is None:
        vocab_size = header.get("vocab_size")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise RecordError(f"{path}:1: header vocab_size {vocab_size!r} is not a positive integer")
    out = []
    for i, line in enumerate(body):
        where = f"{path}:{i + 2}: trajectory {i}"  # line 1 is the header
        try:
            d = json.loads(line)
        except ValueError as e:  # also an integer of more than 4300 digits
            raise RecordError(f"{where}: not valid JSON ({str(e)[:160]})") from None
        except RecursionError:
            raise RecordError(f"{where}: JSON nested too deeply (not a trajectory)") from None
        try:
            tr = Trajectory.from_json(d)
        except RecordError as e:
            raise RecordError(f"{where}: {e}") from None
        if validate:
            tr.validate(vocab_size, where=where)
        out.append(tr)
    return out


def validate_trajectories(trajectories: Sequence[Trajectory], vocab_size: int | None = None) -> None:
    """Validate a batch; errors name the trajectory index."""
    for i, tr in enumerate(trajectories):
        if not isinstance(tr, Trajectory):
            raise RecordError(f"trajectory {i} is a {type(tr).__name__}, not a memopd.Trajectory")
        tr.validate(vocab_size, where=f"trajectory {i}")
