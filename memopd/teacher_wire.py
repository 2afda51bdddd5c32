"""The wire format between `memopd serve-teacher` and its client: safetensors + JSON, never pickle.

Every body, request or response, is one safetensors file: its tensors, and a JSON object
stored as the string `"memopd"` of the safetensors header's `__metadata__`. A reader parses
the 8-byte header length and the JSON header first, so a body whose header is too large,
names an unknown dtype or claims more bytes than it has is refused before any tensor is
built; safetensors itself then copies the raw buffers (it never runs code). Errors travel as
a plain JSON object `{"error": "..."}` with a non-200 status.

A scoring request carries the same `memopd.layout.PackedBatch` the in-process teacher gets:
the token stream (ids, restored positions), the rows, the segment-level attention metadata
(`cu_seqlens`, `prefix_segment`, `segment_kind`, and `prefix_len`, what each segment reads of
its prefix, which the trie layout needs; the receiver derives and validates the
token-level arrays with `AttentionMeta.from_segments`, so it never trusts them) and the
per-action arrays. `batch_to_wire` / `batch_from_wire` are the two directions. A top-k answer
carries int32 ids and fp32 log-probs; `topk_answer_problem` is the client's check of one.
"""
from __future__ import annotations

import json
import struct
from dataclasses import fields

import torch

from .errors import UserError
from .layout import AttentionMeta, PackedBatch

__all__ = ["WireError", "encode", "decode", "batch_to_wire", "batch_from_wire", "MAX_HEADER_BYTES", "TRANSPORT_DTYPES",
           "topk_answer_problem"]

MAX_HEADER_BYTES = 1 << 20  # a scoring request's header is a few KiB
TRANSPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the safetensors dtype names a body may use, and their sizes in bytes
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_ATTN = ("cu_seqlens", "prefix_segment", "segment_kind")
_OPTIONAL = ("action_id", "naive_action_mask", "is_sampled")


class WireError(UserError, ValueError):
    """A body that is not a well-formed memopd wire message (the text says what is wrong)."""


def encode(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    """One safetensors body holding `tensors` (contiguous CPU copies) and `meta` as JSON."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                metadata={"memopd": json.dumps(meta, sort_keys=True)})


def decode(body: bytes, *, max_header: int = MAX_HEADER_BYTES) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a body `encode` wrote; WireError naming the problem otherwise."""
    from safetensors.torch import load

    if len(body) < 8:
        raise WireError(f"body of {len(body)} bytes: not a safetensors message (it starts with an 8-byte header length)")
    (n,) = struct.unpack("<Q", body[:8])
    if n > max_header or 8 + n > len(body):
        raise WireError(f"safetensors header of {n} bytes in a body of {len(body)} bytes (at most {max_header})")
    try:
        header = json.loads(body[8:8 + n])
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WireError("the safetensors header is not a JSON object")
    data_bytes = len(body) - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and entry.get("dtype") in _DTYPE_BYTES and isinstance(entry.get("shape"), list)
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2):
            raise WireError(f"tensor {name!r}: not a safetensors entry of a supported dtype")
        lo, hi = entry["data_offsets"]
        size = _DTYPE_BYTES[entry["dtype"]]
        for d in entry["shape"]:
            size *= d if isinstance(d, int) and d >= 0 else -1
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= data_bytes and hi - lo == size >= 0):
            raise WireError(f"tensor {name!r}: its offsets {entry['data_offsets']} do not fit its shape or the body")
    raw = (header.get("__metadata__") or {}).get("memopd")
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise WireError("the safetensors metadata holds no 'memopd' JSON object")
    try:
        tensors = load(bytes(body))
    except Exception as e:  # noqa: BLE001 safetensors' own refusal of a damaged body, reported as bad input
        raise WireError(f"damaged safetensors body: {str(e).strip().splitlines()[0] if str(e).strip() else e}") from None
    return tensors, meta


def batch_to_wire(batch: PackedBatch) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a PackedBatch: every tensor field, the attention metadata at segment level."""
    tensors: dict[str, torch.Tensor] = {f"attn.{n}": getattr(batch.attn, n) for n in _ATTN}
    tensors["attn.prefix_len"] = batch.attn.segment_prefix_len()  # the trie layout's partial prefix reads
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            tensors[f.name] = v
    meta = {"layout": batch.layout, "num_trajectories": int(batch.num_trajectories), "pad_id": int(batch.pad_id)}
    return tensors, meta


def batch_from_wire(tensors: dict[str, torch.Tensor], meta: dict) -> PackedBatch:
    """The PackedBatch of `batch_to_wire`'s output, its attention metadata rebuilt and
    validated, and the indices every forward reads checked; WireError naming the field otherwise."""
    need = [f.name for f in fields(PackedBatch) if f.name not in ("layout", "attn", "num_trajectories", "pad_id", *_OPTIONAL)]
    missing = [n for n in (*need, *(f"attn.{a}" for a in _ATTN)) if n not in tensors]
    if missing:
        raise WireError(f"packed batch without {', '.join(missing)}")
    for name in ("input_ids", "position_ids", "pred_index", "cu_rows", *(f"attn.{a}" for a in _ATTN), "attn.prefix_len"):
        t = tensors.get(name)
        if t is None:  # attn.prefix_len, optional: absent, every segment reads its whole prefix
            continue
        if t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise WireError(f"{name} must be a 1-D integer tensor, got {t.dtype} of shape {tuple(t.shape)}")
    try:
        attn = AttentionMeta.from_segments(*(tensors[f"attn.{a}"] for a in _ATTN), tensors.get("attn.prefix_len"))
    except ValueError as e:
        raise WireError(f"attention metadata: {e}") from None
    T = int(tensors["input_ids"].shape[0])
    if attn.num_tokens != T or tensors["position_ids"].shape[0] != T:
        raise WireError(f"{T} input ids, {tensors['position_ids'].shape[0]} positions and {attn.num_tokens} tokens "
                        "in the attention metadata: they must agree")
    pred = tensors["pred_index"]
    if pred.numel() and (int(pred.min()) < 0 or int(pred.max()) >= T):
        raise WireError(f"pred_index outside the {T} tokens of the batch")
    n_act = int(pred.shape[0])
    for name in ("target_ids", "teacher_mask", "action_index"):
        if tensors[name].shape[:1] != (n_act,):
            raise WireError(f"{name} has {tuple(tensors[name].shape)} entries for {n_act} actions")
    layout = meta.get("layout")
    if not isinstance(layout, str):
        raise WireError("the batch's meta has no layout name")
    kw = {f.name: tensors[f.name] for f in fields(PackedBatch) if f.name in tensors}
    return PackedBatch(layout=layout, attn=attn, num_trajectories=int(meta.get("num_trajectories", 0)),
                       pad_id=int(meta.get("pad_id", 0)), **kw)


def topk_answer_problem(ids, logprobs, rows: int, k: int, vocab_size: int) -> str | None:
    """What is wrong with a top-k answer for `rows` positions (None if nothing): both tensors
    present and [rows, k], integer ids in [0, vocab_size), floating log-probs, finite and <= 0
    (a log-probability; a little rounding above 0 is allowed)."""
    if ids is None or logprobs is None:
        return "no topk_ids / topk_logprobs tensors"
    if tuple(ids.shape) != (rows, k) or tuple(logprobs.shape) != (rows, k):
        return f"shapes {tuple(ids.shape)} and {tuple(logprobs.shape)} for {rows} positions"
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or not logprobs.dtype.is_floating_point:
        return f"dtypes {ids.dtype} (ids) and {logprobs.dtype} (log-probs)"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return f"token ids outside [0, {vocab_size}) (from {int(ids.min())} to {int(ids.max())})"
    if logprobs.numel() and not (bool(torch.isfinite(logprobs).all()) and float(logprobs.max()) <= 1e-4):
        return "log-probs that are not finite numbers <= 0"
    return None
