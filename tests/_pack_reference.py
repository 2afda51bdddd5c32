"""The pack compiler as it was before its array rewrite: a per-token Python reference.

`reference_pack` is the list-building `pack` (and `reference_from_segments` the
per-segment `AttentionMeta.from_segments`) kept verbatim, so that tests can demand that
the array-based `memopd.pack` returns the same batches bit for bit, and the pack-speed
benchmark can time both in one run. Not part of the package.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch

from memopd.layout import AttentionMeta, PackedBatch, SegmentKind
from memopd.packing import _ALIASES, ACTION_DOMAINS, LAYOUTS, PackError
from memopd.planner import plan_rows, rows_from_assignment
from memopd.records import Source, Trajectory, validate_trajectories

__all__ = ["reference_pack", "reference_from_segments"]


def _budget_error(what: str, need: int, max_tokens: int) -> PackError:
    return PackError(
        f"{what} needs {need} tokens, over max_tokens={max_tokens}; raise max_tokens "
        "(items are never truncated)"
    )


def reference_from_segments(
    cu_seqlens,
    prefix_segment,
    segment_kind,
) -> "AttentionMeta":
    """Derive the token-level arrays from segment boundaries and prefix links."""
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
    seg_of_tok = torch.repeat_interleave(torch.arange(S), lens)
    idx = torch.arange(T)
    seg_start = cu[:-1][seg_of_tok]
    pad = kind[seg_of_tok] == SegmentKind.PAD
    seg_start = torch.where(pad, idx + 1, seg_start)
    for s in range(S):
        p = int(ps[s])
        if p < 0:
            continue
        if p >= S or kind[p] != SegmentKind.PREFIX:
            raise ValueError(f"segment {s} links to segment {p}, which is not a prefix segment")
        if ps[p] >= 0:
            raise ValueError(f"prefix segment {p} itself links to a prefix")
    has_p = ps >= 0
    pstart = torch.where(has_p, cu[:-1][ps.clamp(min=0)], torch.zeros_like(ps))
    pend = torch.where(has_p, cu[1:][ps.clamp(min=0)], torch.zeros_like(ps))
    prefix_lens = pend - pstart
    return AttentionMeta(
        cu_seqlens=cu.to(torch.int32),
        prefix_segment=ps.to(torch.int32),
        segment_kind=kind,
        seg_start=seg_start.to(torch.int32),
        prefix_start=pstart[seg_of_tok].to(torch.int32),
        prefix_end=pend[seg_of_tok].to(torch.int32),
        max_seqlen=int(lens.max()) if S else 0,
        max_prefix_len=int(prefix_lens.max()) if S else 0,
    ).validate()



class _Builder:  # noqa: D101 (reference copy)
    """Accumulates the flat token stream, segments and action entries."""

    def __init__(self, action_domain: str = "exact") -> None:
        self.naive_domain = action_domain == "naive"
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.act_mask: list[bool] = []
        self.naive: list[bool] = []
        self.cu = [0]
        self.seg_prefix: list[int] = []
        self.seg_kind: list[int] = []
        self.seg_traj: list[int] = []
        self.seg_call: list[int] = []
        self.cu_rows = [0]
        # per action token
        self.a_index: list[int] = []
        self.p_index: list[int] = []
        self.targets: list[int] = []
        self.lps: list[float] = []
        self.a_traj: list[int] = []
        self.a_call: list[int] = []
        self.a_k: list[int] = []
        self.a_sampled: list[bool] = []

    def segment(self, ids, positions, kind, prefix_seg, traj, call, naive=None) -> tuple[int, int]:
        start = len(self.ids)
        self.ids += ids
        self.pos += positions
        self.act_mask += [False] * len(ids)
        self.naive += naive if naive is not None else [False] * len(ids)
        self.cu.append(len(self.ids))
        self.seg_prefix.append(prefix_seg)
        self.seg_kind.append(kind)
        self.seg_traj.append(traj)
        self.seg_call.append(call)
        return len(self.seg_kind) - 1, start

    def _entry(self, idx: int, pred: int, tok: int, lp: float, traj: int, call: int, k: int, sampled: bool) -> None:
        self.act_mask[idx] = True
        self.a_index.append(idx)
        self.p_index.append(pred)
        self.targets.append(tok)
        self.lps.append(lp)
        self.a_traj.append(traj)
        self.a_call.append(call)
        self.a_k.append(k)
        self.a_sampled.append(sampled)

    def call_entries(self, x_start: int, x_pred: int, first_index: int, first_pred: int, inv, q_len: int,
                     traj: int, call: int) -> None:
        """Entries of one call. x_t starts at packed index `x_start` (its first token
        is predicted at `x_pred`), a_t at `first_index` (a_{t,0} predicted at
        `first_pred`); every later token is predicted at the token just before it.
        Context copies enter only in the naive domain; a copy at position 0 of
        [q, x_t, a_t] (empty q) has nothing to be predicted from and is left out."""
        k = 0
        prov = inv.provenance
        if self.naive_domain and prov is not None:
            for j, (src, _, _) in enumerate(prov):
                if src != Source.ACTION or (j == 0 and q_len == 0):
                    continue
                idx = x_start + j
                self._entry(idx, x_pred if j == 0 else idx - 1, inv.context_ids[j], math.nan, traj, call, k, False)
                k += 1
        lps = inv.sample_logprobs
        for i, tok in enumerate(inv.action_ids):
            idx = first_index + i
            self.naive[idx] = True
            self._entry(idx, first_pred if i == 0 else idx - 1, tok, math.nan if lps is None else lps[i],
                        traj, call, k, True)
            k += 1

    def end_row(self) -> None:
        self.cu_rows.append(len(self.ids))

    def build(self, layout: str, n_traj: int, pad_id: int) -> PackedBatch:
        attn = reference_from_segments(self.cu, self.seg_prefix, self.seg_kind)
        # action entries in (trajectory, call, k) order, whatever the row order was
        order = sorted(range(len(self.a_index)), key=lambda i: (self.a_traj[i], self.a_call[i], self.a_k[i]))

        def take(xs, dtype):
            return torch.tensor([xs[i] for i in order], dtype=dtype)

        return PackedBatch(
            layout=layout,
            input_ids=torch.tensor(self.ids, dtype=torch.long),
            position_ids=torch.tensor(self.pos, dtype=torch.long),
            attn=attn,
            cu_rows=torch.tensor(self.cu_rows, dtype=torch.long),
            action_mask=torch.tensor(self.act_mask, dtype=torch.bool),
            action_index=take(self.a_index, torch.long),
            pred_index=take(self.p_index, torch.long),
            target_ids=take(self.targets, torch.long),
            sample_logprobs=take(self.lps, torch.float32),
            teacher_mask=torch.ones(len(order), dtype=torch.bool),
            traj_index=take(self.a_traj, torch.long),
            call_index=take(self.a_call, torch.long),
            token_index=take(self.a_k, torch.long),
            segment_traj=torch.tensor(self.seg_traj, dtype=torch.long),
            segment_call=torch.tensor(self.seg_call, dtype=torch.long),
            action_id=torch.arange(len(order), dtype=torch.long),
            is_sampled=take(self.a_sampled, torch.bool),
            naive_action_mask=torch.tensor(self.naive, dtype=torch.bool) if layout == "flatten" else None,
            num_trajectories=n_traj,
            pad_id=pad_id,
        )


def _pack_aligned(trajs: Sequence[Trajectory], max_tokens: int, shared: bool, share_prefix: str, b: _Builder) -> None:
    items: list[tuple[int, int]] = []
    lengths: list[int] = []
    groups: list[int] = []
    group_keys: "OrderedDict[tuple, int]" = OrderedDict()
    group_cost: list[int] = []
    group_prefix: list[list[int]] = []
    for bi, tr in enumerate(trajs):
        q = tr.prefix_ids
        if shared and q:
            key = (tr.group_id, tuple(q)) if share_prefix == "group" else (bi,)
            if key not in group_keys:
                group_keys[key] = len(group_cost)
                group_cost.append(len(q))
                group_prefix.append(list(q))
            g = group_keys[key]
        else:
            g = -1
        for t, inv in enumerate(tr.invocations):
            n = len(inv.context_ids) + len(inv.action_ids) + (0 if shared else len(q))
            need = n + (len(q) if g >= 0 else 0)
            if need > max_tokens:
                raise _budget_error(f"trajectory {bi}, call {t} (|q|={len(q)}, |x|={len(inv.context_ids)}, "
                                    f"|a|={len(inv.action_ids)})", need, max_tokens)
            items.append((bi, t))
            lengths.append(n)
            groups.append(g)
    rows = rows_from_assignment(plan_rows(lengths, groups, group_cost, max_tokens)) if items else []
    for row in rows:
        # prefix segment first, then that group's calls in (trajectory, call) order
        by_group: "OrderedDict[int, list[int]]" = OrderedDict()
        for i in row:
            by_group.setdefault(groups[i], []).append(i)
        for g, members in by_group.items():
            pseg, pstart, plen = -1, -1, 0
            if g >= 0:
                q = group_prefix[g]
                plen = len(q)
                owner = items[members[0]][0] if share_prefix != "group" else -1
                pseg, pstart = b.segment(list(q), list(range(plen)), SegmentKind.PREFIX, -1, owner, -1)
            for i in members:
                bi, t = items[i]
                inv = trajs[bi].invocations[t]
                q = trajs[bi].prefix_ids
                body = ([] if g >= 0 else list(q)) + inv.context_ids + inv.action_ids
                # restored positions: a call segment under a shared prefix starts at |q|
                p0 = len(q) if g >= 0 else 0
                positions = list(range(p0, p0 + len(body)))
                _, start = b.segment(body, positions, SegmentKind.CALL, pseg, bi, t)
                first = start + len(body) - len(inv.action_ids)
                # a_{t,0} is read at the token before it; with an empty x_t under a shared
                # prefix, that token is the last one of the prefix segment
                first_pred = first - 1 if first > start else pstart + plen - 1
                x_start = first - len(inv.context_ids)
                x_pred = x_start - 1 if x_start > start else pstart + plen - 1
                b.call_entries(x_start, x_pred, first, first_pred, inv, len(q), bi, t)
        b.end_row()


def _pack_independent(trajs: Sequence[Trajectory], max_tokens: int, pad_id: int, b: _Builder) -> None:
    calls = [(bi, t) for bi, tr in enumerate(trajs) for t in range(len(tr.invocations))]
    width = max((len(trajs[bi].invocations[t]) for bi, t in calls), default=0)
    if width > max_tokens:
        bi, t = max(calls, key=lambda c: len(trajs[c[0]].invocations[c[1]]))
        raise _budget_error(f"trajectory {bi}, call {t} (the longest call, one padded row each)", width, max_tokens)
    for bi, t in calls:
        inv = trajs[bi].invocations[t]
        body = inv.input_ids
        _, start = b.segment(body, list(range(len(body))), SegmentKind.CALL, -1, bi, t)
        first = start + len(body) - len(inv.action_ids)
        x_start = first - len(inv.context_ids)
        b.call_entries(x_start, x_start - 1, first, first - 1, inv, len(inv.prefix_ids), bi, t)
        pad = width - len(body)
        if pad:
            b.segment([pad_id] * pad, [0] * pad, SegmentKind.PAD, -1, -1, -1)
        b.end_row()


def _pack_flatten(trajs: Sequence[Trajectory], max_tokens: int, b: _Builder) -> None:
    lengths = []
    for bi, tr in enumerate(trajs):
        n = tr.flattened_tokens
        if n > max_tokens:
            raise _budget_error(f"trajectory {bi} flattened", n, max_tokens)
        lengths.append(n)
    rows = rows_from_assignment(plan_rows(lengths, [-1] * len(trajs), [], max_tokens)) if trajs else []
    for row in rows:
        for bi in row:
            tr = trajs[bi]
            ids = list(tr.prefix_ids)
            naive = [False] * len(ids)
            starts = []
            for inv in tr.invocations:
                prov = inv.provenance
                ids += inv.context_ids
                # a re-encoded copy of earlier model output looks like a decision to a
                # trainer that marks every model-written token: the naive domain
                naive += [p[0] == Source.ACTION for p in prov] if prov is not None else [False] * len(inv.context_ids)
                starts.append(len(ids))
                ids += inv.action_ids
                naive += [False] * len(inv.action_ids)
            _, start = b.segment(ids, list(range(len(ids))), SegmentKind.HISTORY, -1, bi, -1, naive=naive)
            for t, inv in enumerate(tr.invocations):
                first = start + starts[t]
                x_start = first - len(inv.context_ids)
                b.call_entries(x_start, x_start - 1, first, first - 1, inv, len(tr.prefix_ids), bi, t)
        b.end_row()


def reference_pack(
    trajectories: Sequence[Trajectory],
    layout: str = "aligned",
    max_tokens: int = 8192,
    *,
    share_prefix: str = "trajectory",
    pad_id: int = 0,
    vocab_size: int | None = None,
    validate: bool = True,
    action_domain: str = "exact",
) -> PackedBatch:
    """Lay trajectories out for one training forward (see the module docstring).

    share_prefix: for `aligned`, "trajectory" (one prefix segment per trajectory per
    row) or "group" (trajectories with the same group_id and identical prefix ids
    share one prefix segment per row).
    action_domain: "exact" (the sampled action tokens) or "naive" (also re-encoded
    copies of model output inside later contexts: the ablation; module docstring).
    """
    layout = _ALIASES.get(layout, layout)
    if layout not in LAYOUTS:
        raise PackError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if share_prefix not in ("trajectory", "group"):
        raise PackError(f"share_prefix must be 'trajectory' or 'group', got {share_prefix!r}")
    if action_domain not in ACTION_DOMAINS:
        raise PackError(f"action_domain must be one of {', '.join(ACTION_DOMAINS)}, got {action_domain!r}")
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise PackError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(trajectories, Trajectory):
        raise PackError("pack() takes a sequence of trajectories, got one Trajectory: pass [trajectory]")
    try:
        trajectories = list(trajectories)
    except TypeError:
        raise PackError(f"pack() takes a sequence of memopd.Trajectory, got a {type(trajectories).__name__}") from None
    if not trajectories:
        raise PackError("no trajectories to pack")
    if validate:
        validate_trajectories(trajectories, vocab_size)
    b = _Builder(action_domain)
    if layout == "aligned":
        _pack_aligned(trajectories, max_tokens, True, share_prefix, b)
    elif layout == "aligned_unshared":
        _pack_aligned(trajectories, max_tokens, False, share_prefix, b)
    elif layout == "independent":
        _pack_independent(trajectories, max_tokens, pad_id, b)
    else:
        _pack_flatten(trajectories, max_tokens, b)
    return b.build(layout, len(trajectories), pad_id)
