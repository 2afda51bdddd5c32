"""Packed-batch containers: `AttentionMeta` (who sees whom) and `PackedBatch`.

All tokens of a batch live in one flat stream of `T` tokens (rows concatenated). A row
is a unit of forward compute bounded by the token budget; segments never cross rows.

Visibility (docs/design.md §3.1) is given by O(T) metadata, never by position ids:
key `j` is visible to query `i` iff

    seg_start[i] <= j <= i                        (own segment, causal)
    or prefix_start[i] <= j < prefix_end[i]       (the prefix segment, in full)

Prefix tokens have an empty prefix interval; padding tokens have `seg_start[i] = i + 1`
and an empty prefix interval, so they see nothing (their attention output is zero).

`cached_on_metadata` keeps what a backend derives from the three token-level tensors
(the torch path's plan, the Triton backward's per-key query ranges) on the tensors
themselves, so every layer of a forward and its backward derive it once.
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Optional

import numpy as np
import torch

__all__ = ["SegmentKind", "AttentionMeta", "PackedBatch", "cached_on_metadata"]


class SegmentKind(enum.IntEnum):
    PREFIX = 0  # q, once, causal inside itself
    CALL = 1  # [x_t, a_t] (aligned) or [q, x_t, a_t] (unshared / independent)
    PAD = 2  # padding: sees nothing, seen by nobody
    HISTORY = 3  # one flattened trajectory (flatten layout)


@dataclass
class AttentionMeta:
    """Explicit segment metadata of a packed stream of T tokens in S segments.

    Segment level (a varlen kernel's view):
      cu_seqlens      int32 [S+1]  segment s is tokens cu_seqlens[s] : cu_seqlens[s+1]
      prefix_segment  int32 [S]    index of the prefix segment that segment s sees (in
                                   full, or its first tokens: trie layout), or -1
      segment_kind    int8  [S]    `SegmentKind`
    Token level (what a kernel reads per query row):
      seg_start       int32 [T]    first key of the own segment (causal up to i)
      prefix_start    int32 [T]    prefix interval [prefix_start, prefix_end) seen in full
      prefix_end      int32 [T]
    max_seqlen: longest segment; max_prefix_len: longest prefix interval.
    """

    cu_seqlens: torch.Tensor
    prefix_segment: torch.Tensor
    segment_kind: torch.Tensor
    seg_start: torch.Tensor
    prefix_start: torch.Tensor
    prefix_end: torch.Tensor
    max_seqlen: int
    max_prefix_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.seg_start.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.prefix_segment.shape[0])

    @property
    def device(self) -> torch.device:
        return self.seg_start.device

    def to(self, device) -> "AttentionMeta":
        out = replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )
        if getattr(self, "_checked", False):
            out._checked = True  # same values: no second check (and no host sync) on the device
        return out

    def validate(self) -> "AttentionMeta":
        """Raise `ValueError` naming the field if the metadata contradicts itself; return self.

        Checks shapes and integer dtypes, `cu_seqlens` (starts at 0, non-decreasing, ends at
        T), `prefix_segment` (-1 or a prefix segment), `seg_start[i]` in [0, i + 1],
        `0 <= prefix_start[i] <= prefix_end[i] <= T`, and that max_seqlen / max_prefix_len
        cover the longest segment / prefix interval. O(T) on the small int arrays, with one
        host sync; done once per object (packed_attention calls it at entry; a checked
        meta stays checked through `to()`, so metadata built on the CPU by `from_segments`
        costs no sync on the GPU). Mutating the tensors in place afterwards is not re-checked.
        """
        if getattr(self, "_checked", False):
            return self
        names = ("cu_seqlens", "prefix_segment", "segment_kind", "seg_start", "prefix_start", "prefix_end")
        for name in names:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"AttentionMeta.{name} must be a tensor, got {type(t).__name__}")
            if t.ndim != 1:
                raise ValueError(f"AttentionMeta.{name} must be 1-D, got shape {tuple(t.shape)}")
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"AttentionMeta.{name} must hold integers, got {t.dtype}")
        devices = {getattr(self, n).device for n in names}
        if len(devices) > 1:
            raise ValueError(f"AttentionMeta tensors are on different devices: {sorted(map(str, devices))}")
        T, S = self.num_tokens, self.num_segments
        for name in ("prefix_start", "prefix_end"):
            if getattr(self, name).shape[0] != T:
                raise ValueError(f"AttentionMeta.{name} has {getattr(self, name).shape[0]} entries, seg_start {T}")
        if self.cu_seqlens.shape[0] != S + 1 or self.segment_kind.shape[0] != S:
            raise ValueError(
                f"AttentionMeta.cu_seqlens has {self.cu_seqlens.shape[0]} entries and segment_kind "
                f"{self.segment_kind.shape[0]} for {S} segments (prefix_segment): expected {S + 1} and {S}"
            )
        for name in ("max_seqlen", "max_prefix_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"AttentionMeta.{name} must be an integer >= 0, got {v!r}")
        dev = self.device
        # token-level checks in int32 when the arrays are int32 and T + 1 fits (no int64
        # copies), over blocks of tokens (no T-long temporaries); in int64 otherwise
        tok = (self.seg_start, self.prefix_start, self.prefix_end)
        it = torch.int32 if T < 2**31 - 2 and all(t.dtype == torch.int32 for t in tok) else torch.long
        zero = torch.zeros((), dtype=torch.long, device=dev)

        def token_masks(lo: int, hi: int):
            """Violation masks of seg_start, prefix_start, prefix_end on tokens [lo, hi),
            and the longest prefix interval there."""
            i = torch.arange(lo, hi, device=dev, dtype=it)
            ss, ps, pe = (t[lo:hi].to(it) for t in tok)
            masks = [(ss < 0) | (ss > i + 1), (ps < 0) | (ps > T), (pe < ps) | (pe > T)]
            return masks, ((pe - ps).clamp(min=0).max().long() if hi > lo else zero)

        cu, link = self.cu_seqlens.long(), self.prefix_segment.long()
        seg_len = cu[1:] - cu[:-1]
        linked = self.segment_kind[link.clamp(0, max(S - 1, 0))] if S else link
        # (field, rule, per-entry violation mask or None for the token-level ones); the
        # flags are reduced in one sync
        rules = [
            ("cu_seqlens", f"must start at 0, never decrease and end at T = {T}",
             torch.cat([(cu[:1] != 0), seg_len < 0, (cu[-1:] != T)])),
            ("prefix_segment", f"must be -1 or the index of a prefix segment (< {S})",
             (link < -1) | (link >= S) | ((link >= 0) & (linked != SegmentKind.PREFIX))),
            ("seg_start", "must be in [0, i + 1] for token i (i + 1: a row that sees nothing)", None),
            ("prefix_start", f"must be in [0, T = {T}]", None),
            ("prefix_end", f"must be in [prefix_start, T = {T}]", None),
        ]
        block = 1 << 20
        tok_flags: list[list[torch.Tensor]] = [[], [], []]
        longest_pre = zero
        for lo in range(0, T, block):
            masks, pre = token_masks(lo, min(T, lo + block))
            for acc, m in zip(tok_flags, masks):
                acc.append(m.any())
            longest_pre = torch.maximum(longest_pre, pre)
        longest_seg = seg_len.max() if S else zero
        any_of = [rules[0][2].any(), rules[1][2].any()] + [torch.stack(f).any() if f else zero.bool() for f in tok_flags]
        flags = torch.stack(any_of + [longest_seg > self.max_seqlen, longest_pre > self.max_prefix_len]).tolist()
        for k, ((name, rule, mask), bad) in enumerate(zip(rules, flags)):
            if bad:
                if mask is None:  # a token-level rule: its mask over all tokens, to name the first
                    mask = token_masks(0, T)[0][k - 2]
                at = int(mask.nonzero()[0, 0])
                shown = "" if name == "cu_seqlens" else f"[{at}] = {int(getattr(self, name)[at])}"
                raise ValueError(f"inconsistent AttentionMeta: {name}{shown}: {rule}")
        if flags[-2]:
            raise ValueError(f"inconsistent AttentionMeta: max_seqlen = {self.max_seqlen} is less than the longest "
                             f"segment ({int(longest_seg)} tokens)")
        if flags[-1]:
            raise ValueError(f"inconsistent AttentionMeta: max_prefix_len = {self.max_prefix_len} is less than the "
                             f"longest prefix interval ({int(longest_pre)} tokens)")
        self._checked = True
        return self

    @classmethod
    def from_segments(
        cls,
        cu_seqlens,
        prefix_segment,
        segment_kind,
        prefix_len=None,
    ) -> "AttentionMeta":
        """Derive the token-level arrays from segment boundaries and prefix links.

        `prefix_len` (optional, per segment): how many leading tokens of its linked prefix
        segment a segment reads (-1: all of them, the default for every segment). The trie
        layout links calls that leave a shared spine early to the spine's first tokens only.
        """
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
        ps = torch.as_tensor(prefix_segment, dtype=torch.int64).cpu()
        kind = torch.as_tensor(segment_kind, dtype=torch.int8).cpu()
        S = ps.shape[0]
        if cu.ndim != 1 or cu.shape[0] != S + 1 or kind.shape[0] != S:
            raise ValueError(
                f"metadata shapes disagree: cu_seqlens {tuple(cu.shape)}, prefix_segment {tuple(ps.shape)}, "
                f"segment_kind {tuple(kind.shape)}"
            )
        if S and (cu[0] != 0 or bool((cu[1:] < cu[:-1]).any())):
            raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
        lens = cu[1:] - cu[:-1]
        T = int(cu[-1]) if S else 0
        # the first segment (in order) whose link is not a prefix segment, or links to one
        # that itself links to a prefix
        linked = ps >= 0
        to = ps.clamp(0, max(S - 1, 0))
        not_prefix = linked & ((ps >= S) | (kind[to] != SegmentKind.PREFIX))
        chained = linked & ~not_prefix & (ps[to] >= 0)
        bad = torch.nonzero(not_prefix | chained)
        if bad.numel():
            s = int(bad[0, 0])
            p = int(ps[s])
            if not_prefix[s]:
                raise ValueError(f"segment {s} links to segment {p}, which is not a prefix segment")
            raise ValueError(f"prefix segment {p} itself links to a prefix")
        # token-level arrays: each segment's values repeated over its tokens (numpy's repeat,
        # one pass), in int32 (what they are stored in) when T fits
        it = np.int32 if T < 2**31 - 1 else np.int64
        lens_np = lens.numpy()
        seg_start = np.repeat(cu[:-1].numpy().astype(it), lens_np)
        pad_seg = (kind == SegmentKind.PAD).numpy()
        if pad_seg.any():
            pad = np.flatnonzero(np.repeat(pad_seg, lens_np))
            seg_start[pad] = pad + 1  # a padding token sees nothing
            del pad
        pstart = torch.where(linked, cu[:-1][to], torch.zeros_like(ps))
        pend = torch.where(linked, cu[1:][to], torch.zeros_like(ps))
        if prefix_len is not None:
            pl = torch.as_tensor(prefix_len, dtype=torch.int64).cpu()
            if pl.shape != ps.shape:
                raise ValueError(f"prefix_len has shape {tuple(pl.shape)}, prefix_segment {tuple(ps.shape)}")
            part = linked & (pl >= 0)
            bad = torch.nonzero((pl < -1) | (part & (pl > pend - pstart)))
            if bad.numel():
                s = int(bad[0, 0])
                raise ValueError(f"segment {s} reads {int(pl[s])} tokens of its prefix segment, which has "
                                 f"{int(pend[s] - pstart[s]) if linked[s] else 0}")
            pend = torch.where(part, pstart + pl, pend)
        prefix_lens = pend - pstart
        tokens = {name: torch.from_numpy(np.repeat(v.numpy().astype(it), lens_np)).to(torch.int32)
                  for name, v in (("prefix_start", pstart), ("prefix_end", pend))}
        return cls(
            cu_seqlens=cu.to(torch.int32),
            prefix_segment=ps.to(torch.int32),
            segment_kind=kind,
            seg_start=torch.from_numpy(seg_start).to(torch.int32),
            **tokens,
            max_seqlen=int(lens.max()) if S else 0,
            max_prefix_len=int(prefix_lens.max()) if S else 0,
        ).validate()

    def segment_prefix_len(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[stop - start] int64 (CPU), segments [start, stop): how many leading tokens of its
        linked prefix segment each reads (all of them, or the first ones: trie layout), read
        from its first token's interval; -1 (all) for an empty or unlinked segment. What
        `from_segments(prefix_len=)` takes back."""
        cu = self.cu_seqlens.long().cpu()
        stop = cu.shape[0] - 1 if stop is None else stop
        first = cu[start:stop]
        has = (cu[start + 1 : stop + 1] > first) & (self.prefix_segment.long()[start:stop].cpu() >= 0)
        at = first.clamp(0, max(self.num_tokens - 1, 0)).to(self.prefix_end.device)
        width = (self.prefix_end[at].long() - self.prefix_start[at].long()).cpu()
        return torch.where(has, width, torch.full_like(width, -1))

    def visible(self) -> torch.Tensor:
        """Dense [T, T] bool mask (query, key). For references and tests only: O(T^2)."""
        T = self.num_tokens
        i = torch.arange(T, device=self.device).unsqueeze(1)
        j = torch.arange(T, device=self.device).unsqueeze(0)
        own = (j >= self.seg_start.long().unsqueeze(1)) & (j <= i)
        pre = (j >= self.prefix_start.long().unsqueeze(1)) & (j < self.prefix_end.long().unsqueeze(1))
        return own | pre


def _versions(*ts: torch.Tensor):
    # inference tensors have no version counter: such metadata is simply not cached
    return None if any(t.is_inference() for t in ts) else tuple(t._version for t in ts)


def cached_on_metadata(seg_start: torch.Tensor, prefix_start: torch.Tensor, prefix_end: torch.Tensor, name: str,
                       build: Callable):
    """`build(seg_start, prefix_start, prefix_end)`, computed on first use and kept on
    `seg_start` (attribute `_memopd_<name>`, so it dies with the metadata). Reused while
    prefix_start / prefix_end are the same objects and none of the three tensors changed in
    place since (their version counters); an in-place change builds it anew. The layers of
    one forward, and their backwards, receive the same three tensors and so share one
    result. Inference tensors have no version counter: for them it is built on every call."""
    versions = _versions(seg_start, prefix_start, prefix_end)
    slot = f"_memopd_{name}"
    cached = getattr(seg_start, slot, None)
    if cached is not None and versions is not None:
        ps_ref, pe_ref, seen, value = cached
        if ps_ref() is prefix_start and pe_ref() is prefix_end and seen == versions:
            return value
    value = build(seg_start, prefix_start, prefix_end)
    if versions is not None:
        setattr(seg_start, slot, (weakref.ref(prefix_start), weakref.ref(prefix_end), versions, value))
    return value


@dataclass
class PackedBatch:
    """A batch of trajectories laid out for one training forward.

    Token stream [T] (rows concatenated, `cu_rows` [R+1] marks them):
      input_ids, position_ids (restored), attn (`AttentionMeta`),
      action_mask (m_act: the sampled occurrences of action tokens; with
        `pack(action_domain="naive")`, every entry of that domain),
      naive_action_mask (flatten only: every token that came from a model output,
      re-encoded memory included; else None).
    Per action token [A], in (trajectory, call, k) order:
      action_index  packed index of the action token itself
      pred_index    packed index whose output predicts it (g(t, k) of docs/design.md §3.4)
      target_ids    the sampled id
      sample_logprobs  log-prob at sampling time (NaN where not recorded)
      teacher_mask  m_T (defaults to all True)
      traj_index, call_index, token_index  the map back to (trajectory, call, k)
      action_id     position of the entry in the full batch's action order (kept by
                    `select_rows`, so per-action data of the full batch can be indexed)
      is_sampled    True for sampled action tokens, False for the re-encoded copies a
                    naive action domain adds (all True by default)
    """

    layout: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn: AttentionMeta
    cu_rows: torch.Tensor
    action_mask: torch.Tensor
    action_index: torch.Tensor
    pred_index: torch.Tensor
    target_ids: torch.Tensor
    sample_logprobs: torch.Tensor
    teacher_mask: torch.Tensor
    traj_index: torch.Tensor
    call_index: torch.Tensor
    token_index: torch.Tensor
    segment_traj: torch.Tensor
    segment_call: torch.Tensor
    action_id: Optional[torch.Tensor] = None
    naive_action_mask: Optional[torch.Tensor] = None
    num_trajectories: int = 0
    pad_id: int = 0
    is_sampled: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.is_sampled is None:
            self.is_sampled = torch.ones(self.target_ids.shape[0], dtype=torch.bool, device=self.target_ids.device)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.cu_rows.shape[0]) - 1

    @property
    def num_actions(self) -> int:
        return int(self.target_ids.shape[0])

    @property
    def row_lengths(self) -> list[int]:
        return (self.cu_rows[1:] - self.cu_rows[:-1]).tolist()

    @property
    def padding_tokens(self) -> int:
        # a padding token is the only kind that sees nothing, not even itself
        idx = torch.arange(self.num_tokens, device=self.attn.seg_start.device)
        return int((self.attn.seg_start.long() > idx).sum())

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / max(1, self.num_tokens)

    def to(self, device) -> "PackedBatch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, AttentionMeta)):
                kw[f.name] = v.to(device)
        return replace(self, **kw)

    def stats(self) -> dict:
        """Layout statistics: tokens, rows, segments, padding, action tokens."""
        kinds = self.attn.segment_kind
        return {
            "layout": self.layout,
            "trajectories": self.num_trajectories,
            "rows": self.num_rows,
            "tokens": self.num_tokens,
            "max_row_tokens": max(self.row_lengths) if self.num_rows else 0,
            "segments": self.attn.num_segments,
            "prefix_segments": int((kinds == SegmentKind.PREFIX).sum()),
            "padding_tokens": self.padding_tokens,
            "padding_fraction": round(self.padding_fraction, 4),
            "action_tokens": self.num_actions,
            "naive_action_tokens": None
            if self.naive_action_mask is None
            else int(self.naive_action_mask.sum()),
        }

    def select_rows(self, start: int, stop: int) -> "PackedBatch":
        """Rows [start, stop) as their own batch (indices rebased): a micro-batch."""
        if not 0 <= start < stop <= self.num_rows:
            raise IndexError(f"rows [{start}, {stop}) out of range for {self.num_rows} rows")
        t0 = int(self.cu_rows[start])
        t1 = int(self.cu_rows[stop])
        cu = self.attn.cu_seqlens.long()
        s0 = int(torch.searchsorted(cu, torch.tensor(t0), right=False))
        s1 = int(torch.searchsorted(cu, torch.tensor(t1), right=False))
        ps = self.attn.prefix_segment.long()[s0:s1]
        ps = torch.where(ps >= 0, ps - s0, ps)
        plen = self.attn.segment_prefix_len(s0, s1)
        attn = AttentionMeta.from_segments(cu[s0 : s1 + 1] - t0, ps, self.attn.segment_kind[s0:s1], plen)
        keep = (self.action_index >= t0) & (self.action_index < t1)
        return PackedBatch(
            layout=self.layout,
            input_ids=self.input_ids[t0:t1],
            position_ids=self.position_ids[t0:t1],
            attn=attn.to(self.input_ids.device),
            cu_rows=self.cu_rows[start : stop + 1] - t0,
            action_mask=self.action_mask[t0:t1],
            action_index=self.action_index[keep] - t0,
            pred_index=self.pred_index[keep] - t0,
            target_ids=self.target_ids[keep],
            sample_logprobs=self.sample_logprobs[keep],
            teacher_mask=self.teacher_mask[keep],
            traj_index=self.traj_index[keep],
            call_index=self.call_index[keep],
            token_index=self.token_index[keep],
            segment_traj=self.segment_traj[s0:s1],
            segment_call=self.segment_call[s0:s1],
            action_id=self.action_id[keep] if self.action_id is not None else None,
            naive_action_mask=None if self.naive_action_mask is None else self.naive_action_mask[t0:t1],
            num_trajectories=self.num_trajectories,
            pad_id=self.pad_id,
            is_sampled=self.is_sampled[keep],
        )

    def micro_batches(self, max_tokens: int) -> list["PackedBatch"]:
        """Group consecutive rows into micro-batches of at most `max_tokens` tokens each."""
        return list(self.iter_micro_batches(max_tokens))

    def iter_micro_batches(self, max_tokens: int) -> Iterator["PackedBatch"]:
        """`micro_batches`, each cut when it is asked for (a served teacher sends each as it is cut)."""
        lens = self.row_lengths
        start = 0
        total = 0
        for r, n in enumerate(lens):
            if r > start and total + n > max_tokens:
                yield self.select_rows(start, r)
                start, total = r, 0
            total += n
        if lens:
            yield self.select_rows(start, len(lens))
