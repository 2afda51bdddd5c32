"""The pack compiler: `pack(trajectories, layout=..., max_tokens=...) -> PackedBatch`.

Layouts (docs/design.md §2):
- `aligned`: each call is a segment `[x_t, a_t]` at positions restarting at |q|, reading
  one prefix segment `q` (positions 0..|q|-1) shared by the calls of its trajectory in
  the same row, or by every trajectory of one group with `share_prefix="group"`.
- `aligned_unshared`: each call is its own segment `[q, x_t, a_t]` at positions 0...
- `independent`: one row per call, `[q, x_t, a_t]` padded to the longest call: the
  unpacked reference.
- `flatten`: one segment per trajectory `[q, x_0, a_0, x_1, a_1, ...]` with global
  positions and plain causal attention: what persistent-history trainers do. Its
  `naive_action_mask` marks every token that came from a model output, including
  re-encoded memory, to count the spurious decision positions.
- `trie`: every token prefix common to several calls (the task prefix, a group's shared
  call-0 context, identical early calls, the memory carried into later calls) laid out
  once, as spines (PREFIX segments at positions 0..); each call is a segment with the rest
  of `[q, x_t, a_t]` from its branch depth b, reading the first b tokens of its spine
  (docs/design.md §2.5). Several entries may point at one token (identical states).

Action domain (`action_domain=`, any layout):
- `"exact"` (default): the per-action entries are the sampled occurrences of action
  tokens (m_act of docs/design.md §3.5).
- `"naive"`: also every re-encoded copy of earlier model output inside a later context
  x_t (context tokens whose provenance is an action), each predicted from the token
  before it, as a trainer that marks "every model-written token" would score them.
  The ablation of the action domain. Copies come first in their call's entries
  (`token_index` 0..c-1, then the action tokens), carry NaN sampling log-probs and
  `is_sampled=False`. The entry set does not depend on the layout, so batches of one
  set of trajectories under different layouts index the same entries.

Rows are planned by the C++ planner under `max_tokens`; an item that cannot fit is an
error, never a truncation.

How (nothing here is per token in Python): the records are read once into flat int64
arrays (`_Records`: by the C++ core's `read_records` where it is built, else by a Python
reader), the record rules are checked on those arrays (`_Records.valid`; only when one
may fail does `validate_trajectories` run, to name the problem in its words), each layout
computes its segments and, per call, where x_t and a_t land (`_layout_*`; the trie's plan
by the core's `trie_plan`, else by `_trie_plan_py`), and the token
stream, positions and action entries are gathered from the arrays in a few vectorised
passes (`_tokens`, `_entries`). The batches are those of the earlier per-token compiler,
bit for bit (tests/core/test_pack_equivalence.py).
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Sequence

import numpy as np
import torch

from .errors import UserError
from .layout import AttentionMeta, PackedBatch, SegmentKind
from .planner import plan_rows
from .records import Source, Trajectory, validate_trajectories

__all__ = ["LAYOUTS", "ACTION_DOMAINS", "PackError", "pack"]

LAYOUTS = ("aligned", "aligned_unshared", "independent", "flatten", "trie")
ACTION_DOMAINS = ("exact", "naive")
_ALIASES = {"aligned_shared": "aligned", "packed": "aligned", "unshared": "aligned_unshared"}


class PackError(UserError, ValueError):
    """The trajectories cannot be packed as asked (e.g. an item over the budget)."""


_I64 = np.int64


class _Unfit(Exception):
    """Records that cannot be laid out. Carries the PackError; `pack` first lets the
    record rules name the problem when asked to validate."""

    def __init__(self, error: PackError) -> None:
        super().__init__(str(error))
        self.error = error


def _first_bad_id(trajs: Sequence[Trajectory], names: tuple[str, ...]) -> PackError:
    """The first id that is no integer in int64 range, named by trajectory, call, field, index."""
    for bi, tr in enumerate(trajs):
        for t, inv in enumerate(tr.invocations):
            for name in names:
                for i, v in enumerate(getattr(inv, name) or ()):
                    if not isinstance(v, (int, np.integer)) or not -(2**63) <= v < 2**63:
                        return PackError(f"trajectory {bi}, call {t}: {name}[{i}] = {v!r} is not a token id "
                                         "(an integer in [0, vocab_size), at most 2**63 - 1)")
    return PackError("a token id is not an integer in int64 range")


def _ints(values: list, trajs: Sequence[Trajectory], names: tuple[str, ...]) -> np.ndarray:
    try:
        return np.fromiter(values, _I64, count=len(values))
    except (OverflowError, TypeError, ValueError):
        raise _Unfit(_first_bad_id(trajs, names)) from None


def _core(name: str):
    """The C++ core's function `name` (`read_records`, the record reader; `trie_plan`, the
    trie planner), or None: no core, or one built before it existed (then the Python
    version here, which gives the same result)."""
    try:
        from . import _C
    except ImportError:
        return None
    return getattr(_C, name, None)


def _core_reader():
    return _core("read_records")


def _core_trie_plan():
    return _core("trie_plan")


def _locate(find, trajs: Sequence[Trajectory]) -> tuple[int, int, int]:
    for bi, tr in enumerate(trajs):
        for t, inv in enumerate(tr.invocations):
            hits = find(inv)
            if hits:
                return bi, t, hits[0]
    return -1, -1, -1


def _read_records(trajs: Sequence[Trajectory], read_prov: bool, check: bool) -> dict:
    """The arrays of `_Records`, in Python: what the C++ reader returns, except that the
    provenance comes as its triples (`prov`, checked by `_Records.valid`) and the
    observation ids as themselves (`obs`, `o_len`) instead of the core's verdict (`src`,
    `prov_ok`) and range (`obs_min`, `obs_max`). Raises `_Unfit` naming the first record
    it cannot read."""
    ids: list = []
    lps: list = []
    prov: list = []
    obs: list = []
    q_off: list[int] = []
    q_len: list[int] = []
    n_calls: list[int] = []
    x_len: list[int] = []
    a_len: list[int] = []
    o_len: list[int] = []
    has_lp: list[bool] = []
    has_prov: list[bool] = []
    odd_prefix = False
    nan = math.nan
    for bi, tr in enumerate(trajs):
        if not isinstance(tr, Trajectory):
            raise _Unfit(PackError(f"trajectory {bi} is a {type(tr).__name__}, not a memopd.Trajectory"))
        invs = tr.invocations
        if not invs:
            raise _Unfit(PackError(f"trajectory {bi} has no invocations"))
        q = invs[0].prefix_ids
        q_off.append(len(ids))
        q_len.append(len(q))
        n_calls.append(len(invs))
        ids += q
        for t, inv in enumerate(invs):
            p = inv.prefix_ids
            if p is not q and p != q:
                odd_prefix = True
            x = inv.context_ids
            a = inv.action_ids
            ids += x
            ids += a
            x_len.append(len(x))
            a_len.append(len(a))
            lp = inv.sample_logprobs
            if lp is None:
                lps += [nan] * len(a)
                has_lp.append(False)
            else:
                if len(lp) != len(a):
                    raise _Unfit(PackError(f"trajectory {bi}, call {t}: sample_logprobs has {len(lp)} values "
                                           f"for {len(a)} action tokens"))
                lps += lp
                has_lp.append(True)
            if read_prov:
                pv = inv.provenance
                if pv is None:
                    has_prov.append(False)
                else:
                    if len(pv) != len(x):
                        raise _Unfit(PackError(f"trajectory {bi}, call {t}: provenance has {len(pv)} entries "
                                               f"for {len(x)} context tokens"))
                    prov += pv
                    has_prov.append(True)
            if check:
                ob = inv.observation_ids
                if ob is None:
                    o_len.append(-1)
                else:
                    o_len.append(len(ob))
                    obs += ob
    d = {"ids": _ints(ids, trajs, ("prefix_ids", "context_ids", "action_ids")), "lps": np.array(lps, dtype=np.float64),
         "odd_prefix": odd_prefix, "has_lp": np.array(has_lp, dtype=bool)}
    for name, v in (("q_off", q_off), ("q_len", q_len), ("n_calls", n_calls), ("x_len", x_len), ("a_len", a_len)):
        d[name] = np.array(v, dtype=_I64)
    if read_prov:
        d["has_prov"] = np.array(has_prov, dtype=bool)
        n = len(prov)
        if n and set(map(len, prov)) != {3}:
            bi, t, i = _locate(lambda inv: [j for j, p in enumerate(inv.provenance or ()) if len(p) != 3], trajs)
            raise _Unfit(PackError(f"trajectory {bi}, call {t}: provenance[{i}] is not (source, call, offset)"))
        try:
            d["prov"] = np.fromiter(chain.from_iterable(prov), _I64, count=3 * n).reshape(n, 3)
        except (OverflowError, TypeError, ValueError):
            bi, t, i = _locate(lambda inv: [j for j, p in enumerate(inv.provenance or ())
                                            if not all(isinstance(v, (int, np.integer)) and -(2**63) <= v < 2**63 for v in p)],
                               trajs)
            raise _Unfit(PackError(f"trajectory {bi}, call {t}: provenance[{i}] is not three int64 integers")) from None
    if check:
        d["o_len"] = np.array(o_len, dtype=_I64)
        d["obs"] = _ints(obs, trajs, ("observation_ids",))
    return d


class _Records:
    """The batch's records as flat int64 arrays, read in one pass over the Python lists.

    `ids` holds, per trajectory, q (call 0's prefix) and then x_0, a_0, x_1, a_1, ...
    (the `flatten` layout's history). Calls are numbered 0..C-1 in (trajectory, call)
    order; per call: `traj`, `t`, `x_off`/`x_len` (x_t in `ids`), `a_off`/`a_len` (a_t),
    `q_len` (its trajectory's |q|). Per action token, in call order: `lps` (NaN where the
    call has none). With `need_src`: `src`, per context token the provenance source (-1
    where the call has no provenance). With `check`, also what the record checks read:
    the provenance triples, the observation ids, and which calls hold a prefix other
    than call 0's.
    """

    def __init__(self, trajs: Sequence[Trajectory], need_src: bool, check: bool) -> None:
        read_prov = need_src or check
        core = _core_reader()
        d = core(trajs, Trajectory, read_prov, check) if core is not None else None
        if d is None:  # no core, or a record that is not plain: the Python reader names problems
            d = _read_records(trajs, read_prov, check)
        self.B = B = len(trajs)
        self.odd_prefix = bool(d["odd_prefix"])  # a call whose prefix is not call 0's
        self.ids = d["ids"]
        self.lps = d["lps"]
        n_calls, x_len, a_len, q_len, q_off = d["n_calls"], d["x_len"], d["a_len"], d["q_len"], d["q_off"]
        self.n_calls = n_calls
        self.C = C = int(self.n_calls.sum())
        self.call_base = np.cumsum(self.n_calls) - self.n_calls
        self.traj = np.repeat(np.arange(B, dtype=_I64), self.n_calls)
        self.t = np.arange(C, dtype=_I64) - self.call_base[self.traj]
        self.x_len = x_len
        self.a_len = a_len
        self.q_len_traj = q_len
        self.q_len = self.q_len_traj[self.traj]
        # x_t of call c starts after its trajectory's q and the earlier calls' [x, a]
        xa = self.x_len + self.a_len
        before = np.cumsum(xa) - xa
        before -= before[self.call_base][self.traj]
        self.q_off_traj = q_off
        self.x_off = self.q_off_traj[self.traj] + self.q_len + before
        self.a_off = self.x_off + self.x_len
        self.has_lp = d["has_lp"]
        self.src = None
        self.prov_ok: bool | None = d.get("prov_ok")  # the core checked the provenance triples
        self.prov = d.get("prov")  # else the Python reader's triples, checked in valid()
        if read_prov:
            self.has_prov = d["has_prov"]
            self.src = d.get("src")
            if self.src is None:
                # per context token: the provenance source (3 for a code that is none), -1
                # where the call has no provenance
                code = self.prov[:, 0]
                self.src = np.full(int(self.x_len.sum()), -1, dtype=np.int8)
                self.src[np.repeat(self.has_prov, self.x_len)] = np.where((code >= 0) & (code <= 2), code, 3)
        if check:
            self.obs = d.get("obs")
            if self.obs is not None:
                self.o_len = d["o_len"]
                self.obs_range = (int(self.obs.min()), int(self.obs.max())) if self.obs.size else (0, -1)
            else:
                self.obs_range = (d["obs_min"], d["obs_max"])

    def valid(self, trajs: Sequence[Trajectory], vocab_size: int | None) -> bool:
        """True when every rule of `Trajectory.validate` holds (checked on the arrays);
        False when one may not, and the record rules must run to name it."""
        if self.odd_prefix:
            return False
        for tr in trajs:
            r = tr.reward
            if not ((type(r) is float and r - r == 0.0) or (type(r) is int and abs(r) < 2**1000)):
                return False
        if self.C and (self.a_len.min() == 0 or (self.q_len + self.x_len).min() == 0):
            return False
        id_range = (int(self.ids.min()), int(self.ids.max())) if self.ids.size else (0, -1)
        for lo, hi in (id_range, self.obs_range):
            if hi >= lo and (lo < 0 or (vocab_size is not None and hi >= vocab_size)):
                return False
        lp = self.lps[np.repeat(self.has_lp, self.a_len)]
        if lp.size and not (np.isfinite(lp).all() and (lp <= 1e-6).all()):
            return False
        if self.prov_ok is not None:
            return self.prov_ok
        if self.prov is not None and len(self.prov):
            return self._provenance_valid()
        return True

    def _provenance_valid(self) -> bool:
        """Every provenance triple points at an earlier call's token of its kind and equals it."""
        src, call, off = self.prov[:, 0], self.prov[:, 1], self.prov[:, 2]
        # the call and the context position of each triple
        tok_has = np.repeat(self.has_prov, self.x_len)
        tok_call = np.repeat(np.arange(self.C, dtype=_I64), self.x_len)[tok_has]
        j = (np.arange(int(self.x_len.sum()), dtype=_I64) - np.repeat(np.cumsum(self.x_len) - self.x_len, self.x_len))[tok_has]
        t = self.t[tok_call]
        if not np.isin(src, (Source.TEMPLATE, Source.ACTION, Source.OBSERVATION)).all():
            return False
        tmpl = src == Source.TEMPLATE
        if not ((call[tmpl] >= -1) & (call[tmpl] < t[tmpl])).all():
            return False
        ref = ~tmpl
        call, off, src, t = call[ref], off[ref], src[ref], t[ref]
        if not ((call >= 0) & (call < t)).all():
            return False
        rc = self.call_base[self.traj[tok_call[ref]]] + call
        is_act = src == Source.ACTION
        n_src = np.where(is_act, self.a_len[rc], self.o_len[rc])  # -1: no observation ids
        if not ((off >= 0) & (off < n_src)).all():
            return False
        o_off = np.cumsum(np.maximum(self.o_len, 0)) - np.maximum(self.o_len, 0)
        got = np.where(is_act, self.ids[np.where(is_act, self.a_off[rc] + off, 0)],
                       self.obs[np.where(is_act, 0, o_off[rc] + off)] if self.obs.size else 0)
        want = self.ids[self.x_off[tok_call[ref]] + j[ref]]
        return bool((got == want).all())


def _budget_error(what: str, need: int, max_tokens: int) -> PackError:
    return PackError(
        f"{what} needs {need} tokens, over max_tokens={max_tokens}; raise max_tokens "
        "(items are never truncated)"
    )


class _Layout:
    """Segments in stream order and, per call (in call order), where its x_t and a_t
    landed: `x_start`/`first` (packed index of x_t / a_t's first token) and
    `x_pred`/`first_pred` (the index whose output predicts that first token)."""

    def __init__(self, seg_len, seg_kind, seg_link, seg_traj, seg_call, seg_row, pieces, x_start, x_pred, first,
                 first_pred) -> None:
        self.seg_len, self.seg_kind, self.seg_link = seg_len, seg_kind, seg_link
        self.seg_traj, self.seg_call, self.seg_row = seg_traj, seg_call, seg_row
        self.pieces = pieces  # (src in rec.ids, length, first position), two per segment
        self.x_start, self.x_pred, self.first, self.first_pred = x_start, x_pred, first, first_pred
        self.seg_plen = None  # per segment, tokens read of its linked prefix (-1: all); trie only
        self.depth_map = None  # trie: per call (branch depth b, spine start, tail start), see _at_depth


def _plan(lengths: np.ndarray, groups: np.ndarray, group_cost: np.ndarray, max_tokens: int) -> np.ndarray:
    return np.array(plan_rows(lengths.tolist(), groups.tolist(), group_cost.tolist(), max_tokens), dtype=_I64)


def _empty_item(rec: _Records, c: int) -> PackError:
    return PackError(f"trajectory {int(rec.traj[c])}, call {int(rec.t[c])} has no tokens to pack")


def _stream_order(row_of: np.ndarray, groups: np.ndarray, n_groups: int):
    """Where the calls go in the stream: in each row the groups in order of their first
    call, a group's prefix segment first, then its calls in (trajectory, call) order;
    ungrouped calls (-1) form one group without a prefix. Returns the calls in stream
    order, their groups, whether a prefix segment opens before each, the segment index
    of each call and of each prefix, each call's link (-1: none), the segment count, and
    per call (in call order) the index of its (row, group) pair."""
    C = row_of.size
    pair = row_of * (n_groups + 1) + (groups + 1)
    _, first_idx, inverse = np.unique(pair, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    pair_first = first_idx[inverse]
    order = np.lexsort((np.arange(C, dtype=_I64), pair_first, row_of))
    g_s = groups[order]
    opens = (pair_first[order] == order) & (g_s >= 0)  # a prefix segment before this call
    call_seg = np.arange(C, dtype=_I64) + np.cumsum(opens)
    S = C + int(opens.sum())
    pre_seg = call_seg[opens] - 1
    link_s = np.where(g_s >= 0, np.maximum.accumulate(np.where(opens, call_seg - 1, -1)) if C else g_s, -1)
    return order, g_s, opens, call_seg, pre_seg, link_s, S, inverse


def _layout_aligned(rec: _Records, trajs, max_tokens: int, shared: bool, share_prefix: str) -> _Layout:
    C, ql = rec.C, rec.q_len
    xa = rec.x_len + rec.a_len
    n = xa if shared else xa + ql
    if shared:
        keys: dict = {}
        first_traj: list[int] = []
        g_of: list[int] = []
        for bi, tr in enumerate(trajs):
            if rec.q_len_traj[bi]:
                key = (tr.group_id, tuple(tr.invocations[0].prefix_ids)) if share_prefix == "group" else (bi,)
                g = keys.setdefault(key, len(keys))
                if g == len(first_traj):
                    first_traj.append(bi)
                g_of.append(g)
            else:
                g_of.append(-1)
        groups = np.array(g_of, dtype=_I64)[rec.traj]
        group_traj = np.array(first_traj, dtype=_I64)
        group_cost = rec.q_len_traj[group_traj]
    else:
        groups = np.full(C, -1, dtype=_I64)
        group_traj = group_cost = np.zeros(0, dtype=_I64)
    grouped = groups >= 0
    need = n + np.where(grouped, ql, 0)
    over = np.flatnonzero(need > max_tokens)
    if over.size:
        c = int(over[0])
        raise _budget_error(f"trajectory {int(rec.traj[c])}, call {int(rec.t[c])} (|q|={int(ql[c])}, |x|={int(rec.x_len[c])}, "
                            f"|a|={int(rec.a_len[c])})", int(need[c]), max_tokens)
    if C and n.min() <= 0:
        raise _empty_item(rec, int(np.flatnonzero(n <= 0)[0]))
    row_of = _plan(n, groups, group_cost, max_tokens)
    # in each row: the groups in order of their first call, a group's prefix segment
    # first, then its calls in (trajectory, call) order; ungrouped calls form one group
    order, g_s, opens, call_seg, pre_seg, link_s, S, _ = _stream_order(row_of, groups, len(group_cost))

    seg_len = np.empty(S, dtype=_I64)
    seg_kind = np.full(S, int(SegmentKind.CALL), dtype=np.int8)
    seg_link = np.full(S, -1, dtype=_I64)
    seg_traj = np.empty(S, dtype=_I64)
    seg_call = np.full(S, -1, dtype=_I64)
    seg_row = np.empty(S, dtype=_I64)
    src = np.zeros((S, 2), dtype=_I64)
    plen = np.zeros((S, 2), dtype=_I64)
    pos0 = np.zeros((S, 2), dtype=_I64)
    tr_s = rec.traj[order]
    seg_len[call_seg] = n[order]
    seg_link[call_seg] = link_s
    seg_traj[call_seg] = tr_s
    seg_call[call_seg] = rec.t[order]
    seg_row[call_seg] = row_of[order]
    if not shared:
        src[call_seg, 0] = rec.q_off_traj[tr_s]
        plen[call_seg, 0] = ql[order]
    src[call_seg, 1] = rec.x_off[order]
    plen[call_seg, 1] = xa[order]
    pos0[call_seg, 1] = ql[order]
    if S > C:
        g_open = g_s[opens]
        seg_len[pre_seg] = group_cost[g_open]
        seg_kind[pre_seg] = int(SegmentKind.PREFIX)
        seg_traj[pre_seg] = tr_s[opens] if share_prefix != "group" else -1
        seg_row[pre_seg] = row_of[order][opens]
        src[pre_seg, 0] = rec.q_off_traj[group_traj[g_open]]
        plen[pre_seg, 0] = group_cost[g_open]

    seg_start = np.cumsum(seg_len) - seg_len
    start = seg_start[call_seg]
    # the last token of the call's prefix segment reads x_t[0] (or a_t[0]) when they open the
    # call; -2 without a prefix segment (start -1 + length 0 - 1), reached only by a call
    # with neither q nor x_t (a broken record packed with validate=False)
    to = np.maximum(link_s, 0)
    pend = np.where(link_s >= 0, seg_start[to] + seg_len[to] - 1, -2)
    first_s = start + n[order] - rec.a_len[order]
    x_start_s = first_s - rec.x_len[order]
    per_call = [np.empty(C, dtype=_I64) for _ in range(4)]
    for out, v in zip(per_call, (x_start_s, np.where(x_start_s > start, x_start_s - 1, pend), first_s,
                                 np.where(first_s > start, first_s - 1, pend))):
        out[order] = v
    return _Layout(seg_len, seg_kind, seg_link, seg_traj, seg_call, seg_row, (src, plen, pos0), *per_call)


def _layout_independent(rec: _Records, max_tokens: int) -> _Layout:
    C = rec.C
    if rec.odd_prefix:
        raise PackError("a call's prefix_ids differ from call 0's in its trajectory; the independent layout "
                        "needs one prefix per trajectory (pack with validate=True to see which)")
    body = rec.q_len + rec.x_len + rec.a_len
    width = int(body.max()) if C else 0
    if width > max_tokens:
        c = int(np.argmax(body))
        raise _budget_error(f"trajectory {int(rec.traj[c])}, call {int(rec.t[c])} (the longest call, one padded row each)",
                            width, max_tokens)
    if C and width <= 0:
        raise _empty_item(rec, 0)
    pad = width - body
    padded = pad > 0
    # per call a CALL segment, then a PAD segment where the call is shorter than the widest
    nseg = 1 + padded.astype(_I64)
    call_seg = np.cumsum(nseg) - nseg
    S = int(nseg.sum())
    pad_seg = call_seg[padded] + 1
    seg_len = np.empty(S, dtype=_I64)
    seg_kind = np.full(S, int(SegmentKind.CALL), dtype=np.int8)
    seg_traj = np.full(S, -1, dtype=_I64)
    seg_call = np.full(S, -1, dtype=_I64)
    seg_row = np.empty(S, dtype=_I64)
    seg_len[call_seg] = body
    seg_len[pad_seg] = pad[padded]
    seg_kind[pad_seg] = int(SegmentKind.PAD)
    seg_traj[call_seg] = rec.traj
    seg_call[call_seg] = rec.t
    calls = np.arange(C, dtype=_I64)
    seg_row[call_seg] = calls
    seg_row[pad_seg] = calls[padded]
    src = np.zeros((S, 2), dtype=_I64)
    plen = np.zeros((S, 2), dtype=_I64)
    pos0 = np.zeros((S, 2), dtype=_I64)
    src[call_seg, 0] = rec.q_off_traj[rec.traj]
    plen[call_seg, 0] = rec.q_len
    src[call_seg, 1] = rec.x_off
    plen[call_seg, 1] = rec.x_len + rec.a_len
    pos0[call_seg, 1] = rec.q_len
    plen[pad_seg, 0] = pad[padded]  # placeholder ids and positions, set to pad_id / 0 afterwards
    x_start = calls * width + rec.q_len
    first = x_start + rec.x_len
    return _Layout(seg_len, seg_kind, np.full(S, -1, dtype=_I64), seg_traj, seg_call, seg_row, (src, plen, pos0),
                   x_start, x_start - 1, first, first - 1)


def _layout_flatten(rec: _Records, max_tokens: int) -> _Layout:
    B = rec.B
    xa = rec.x_len + rec.a_len
    per_traj = np.bincount(rec.traj, weights=xa, minlength=B).astype(_I64) if rec.C else np.zeros(B, dtype=_I64)
    lengths = rec.q_len_traj + per_traj
    over = np.flatnonzero(lengths > max_tokens)
    if over.size:
        raise _budget_error(f"trajectory {int(over[0])} flattened", int(lengths[over[0]]), max_tokens)
    row_of = _plan(lengths, np.full(B, -1, dtype=_I64), np.zeros(0, dtype=_I64), max_tokens)
    order = np.argsort(row_of, kind="stable")
    seg_len = lengths[order]
    seg_start_s = np.cumsum(seg_len) - seg_len
    start = np.empty(B, dtype=_I64)
    start[order] = seg_start_s
    src = np.zeros((B, 2), dtype=_I64)
    plen = np.zeros((B, 2), dtype=_I64)
    src[:, 0] = rec.q_off_traj[order]
    plen[:, 0] = seg_len
    first = start[rec.traj] + (rec.a_off - rec.q_off_traj[rec.traj])
    x_start = first - rec.x_len
    return _Layout(seg_len, np.full(B, int(SegmentKind.HISTORY), dtype=np.int8), np.full(B, -1, dtype=_I64), order,
                   np.full(B, -1, dtype=_I64), row_of[order], (src, plen, np.zeros((B, 2), dtype=_I64)),
                   x_start, x_start - 1, first, first - 1)


def _call_tokens(rec: _Records, calls: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Index in `rec.ids` of token `depth` of each call's sequence [q, x_t, a_t]."""
    ql = rec.q_len[calls]
    return np.where(depth < ql, rec.q_off_traj[rec.traj[calls]] + depth, rec.x_off[calls] + depth - ql)


def _trie_plan_py(rec: _Records, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The calls in sorted order, and per call its spine and branch depth, in Python."""
    order, lcp = _sorted_calls(rec)
    spine, b = _trie_spines(order, lcp, length)
    return order, spine, b


def _sorted_calls(rec: _Records) -> tuple[np.ndarray, np.ndarray]:
    """The calls in lexicographic order of their sequences [q, x_t, a_t] (ties: call order),
    and the longest common prefix of each neighbouring pair."""
    C = rec.C
    ids = rec.ids
    # fixed-width big-endian codes: byte order is token order, so sequences with a common
    # prefix sort next to each other
    lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    code = ids.astype(">u4") if lo >= 0 and hi < 2**32 else (ids.astype(np.uint64) ^ np.uint64(1 << 63)).astype(">u8")
    w = code.itemsize
    buf = code.tobytes()
    q_bytes = [buf[w * o: w * (o + n)] for o, n in zip(rec.q_off_traj.tolist(), rec.q_len_traj.tolist())]
    x_off, xa = rec.x_off.tolist(), (rec.x_len + rec.a_len).tolist()
    keys = [q_bytes[b] + buf[w * o: w * (o + n)] for b, o, n in zip(rec.traj.tolist(), x_off, xa)]
    order = np.array(sorted(range(C), key=keys.__getitem__), dtype=_I64)
    del keys, q_bytes, buf, code
    length = rec.q_len + rec.x_len + rec.a_len
    if C < 2:
        return order, np.zeros(0, dtype=_I64)
    c1, c2 = order[:-1], order[1:]
    m = np.minimum(length[c1], length[c2])
    lcp = m.copy()
    # token by token over pairs of calls, in blocks of about `block` tokens (no T-long
    # temporaries): the first differing depth of each pair, or the shorter length
    ends = np.cumsum(m)
    lo, block = 0, 1 << 16
    while lo < C - 1:
        hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - m[lo] + block, side="right")))
        mb = m[lo:hi]
        starts = np.cumsum(mb) - mb
        pair = np.repeat(np.arange(lo, hi, dtype=_I64), mb)
        d = np.arange(pair.size, dtype=_I64) - starts[pair - lo]
        diff = ids[_call_tokens(rec, c1[pair], d)] != ids[_call_tokens(rec, c2[pair], d)]
        first = np.where(diff, d, m[pair])
        nz = mb > 0
        if nz.any():
            lcp[lo:hi][nz] = np.minimum.reduceat(first, starts[nz])
        lo = hi
    return order, lcp


def _trie_spines(order: np.ndarray, lcp: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which spine each call reads (-1: none) and how many tokens of it (its branch depth).

    The calls, sorted, with the common prefix of neighbours, give the compressed trie of
    their sequences (its nodes are the intervals of the sorted order whose calls share a
    prefix). A spine is a root path laid out once; a call reads one spine, down to the
    depth where it leaves it, always keeping at least its last token for itself. Bottom
    up, each node v (depth D, children c) is priced two ways: `A(c)`, c's calls read the
    spine that passes through v down to D; `G(c)`, c owns a spine of its own (repeating
    the D tokens above it). A spine through v continues into one child, the one where
    owning instead of reading gains most: G(v) = sum_c min(A, G)(c) + min_c (G(c) -
    min(A, G)(c)). The plan is the cheapest such decomposition; with every call sharing
    only q it is the aligned layout's one prefix per group.
    """
    C = order.size
    lens = length[order].tolist()
    # node: [depth, lo, hi (sorted range), n, sum of lengths, G, heavy child, children]
    # a child is ["L", k] (the k-th sorted call) or ["N", node, owns its spine]
    stack: list[list] = [[0, 0, 0, 0, 0, 0.0, None, []]]
    lcps = lcp.tolist()

    def close(v) -> list:
        D = v[0]
        best, heavy, tot, n, s = math.inf, None, 0, 0, 0
        for c in v[7]:
            if c[0] == "L":
                ln = lens[c[1]]
                a = ln - min(D, ln - 1)
                f, g = a, D + a
                n, s = n + 1, s + ln
            else:
                u = c[1]
                a = u[4] - u[3] * D
                g = u[5]
                f = min(a, g)
                c.append(g < a)  # owns its spine
                n, s = n + u[3], s + u[4]
            tot += f
            if g - f < best:
                best, heavy = g - f, c
        v[3], v[4], v[5], v[6] = n, s, tot + best, heavy
        return v

    for k in range(C):
        last = ["L", k]
        h = lcps[k] if k < C - 1 else 0
        while stack[-1][0] > h:
            v = stack.pop()
            v[7].append(last)
            v[2] = k + 1
            last = ["N", close(v)]
        if stack[-1][0] == h:
            stack[-1][7].append(last)
        else:
            lo = last[1] if last[0] == "L" else last[1][1]
            stack.append([h, lo, 0, 0, 0, 0.0, None, [last]])
    root = stack[0]
    spine = np.full(C, -1, dtype=_I64)  # per sorted call
    depth = np.zeros(C, dtype=_I64)
    n_spines = 0
    todo = []
    for c in root[7]:  # depth 0: reading the root is reading nothing; own a spine where it pays
        if c[0] == "N" and c[1][5] < c[1][4]:
            todo.append(c[1])
    while todo:
        v = todo.pop()
        s = n_spines
        n_spines += 1
        while v is not None:
            D, nxt = v[0], None
            for c in v[7]:
                if c[0] == "L":
                    k = c[1]
                    spine[k], depth[k] = s, min(D, lens[k] - 1)
                elif c is v[6]:
                    nxt = c[1]
                elif c[2]:
                    todo.append(c[1])
                else:
                    u = c[1]
                    spine[u[1]:u[2]], depth[u[1]:u[2]] = s, D
            v = nxt
    out_spine = np.empty(C, dtype=_I64)
    out_depth = np.empty(C, dtype=_I64)
    out_spine[order] = spine
    out_depth[order] = depth
    return out_spine, out_depth


def _layout_trie(rec: _Records, max_tokens: int) -> _Layout:
    """Every token prefix common to several calls laid out once (docs/design.md §2.5): per
    spine one PREFIX segment (a root path of the calls' trie, positions 0..), then per call
    a CALL segment with the rest of its sequence, at positions from its branch depth b,
    reading the spine's first b tokens."""
    C = rec.C
    if rec.odd_prefix:
        raise PackError("a call's prefix_ids differ from call 0's in its trajectory; the trie layout "
                        "needs one prefix per trajectory (pack with validate=True to see which)")
    length = rec.q_len + rec.x_len + rec.a_len
    over = np.flatnonzero(length > max_tokens)
    if over.size:
        c = int(over[0])
        raise _budget_error(f"trajectory {int(rec.traj[c])}, call {int(rec.t[c])}", int(length[c]), max_tokens)
    if C and length.min() <= 0:
        raise _empty_item(rec, int(np.flatnonzero(length <= 0)[0]))
    core = _core_trie_plan()
    if core is not None:
        order, spine, b = core(rec.ids, rec.q_off_traj, rec.q_len_traj, rec.traj, rec.x_off, length)
    else:
        order, spine, b = _trie_plan_py(rec, length)
    spine[b <= 0] = -1
    b[b <= 0] = 0
    # a spine is as long as its deepest reader. A spine whose readers do not fit one row:
    # its readers, deepest first (then in trie order, so that calls sharing deeper nodes
    # stay together), cut into runs that fit, each a spine of its own as long as its first
    # reader's depth (the planner would repeat the whole spine in every row instead). A call
    # alone always fits; a spine with one reader saves nothing and is dropped.
    reads = spine >= 0
    n_sp = int(spine.max()) + 1 if C else 0
    L = np.zeros(n_sp, dtype=_I64)
    np.maximum.at(L, spine[reads], b[reads])
    total = L + np.bincount(spine[reads], weights=(length - b)[reads], minlength=n_sp).astype(_I64)
    rank = np.empty(C, dtype=_I64)
    rank[order] = np.arange(C, dtype=_I64)
    split = np.flatnonzero(reads & (total[np.maximum(spine, 0)] > max_tokens))
    split = split[np.lexsort((rank[split], -b[split], spine[split]))]
    g, cur, run_cost = -1, -1, 0
    for c, gc, bc, lc in zip(split.tolist(), spine[split].tolist(), b[split].tolist(), length[split].tolist()):
        if gc != g:  # the first run keeps the spine's number
            g, cur, run_cost = gc, gc, bc
        elif run_cost + lc - bc > max_tokens:
            cur, run_cost, n_sp = n_sp, bc, n_sp + 1  # the run's deepest reader: its spine's length
        run_cost += lc - bc
        spine[c] = cur
    readers = np.bincount(spine[reads], minlength=n_sp)
    alone = reads & (readers[np.maximum(spine, 0)] < 2)
    spine[alone], b[alone] = -1, 0
    reads = spine >= 0
    _, spine = np.unique(spine, return_inverse=True)  # renumber the spines left 0..
    spine = np.where(reads, spine.reshape(-1) - (0 if reads.all() else 1), -1)
    n_sp = int(spine.max()) + 1 if reads.any() else 0
    L = np.zeros(n_sp, dtype=_I64)
    np.maximum.at(L, spine[reads], b[reads])
    tail = length - b
    row_of = _plan(tail, spine, L, max_tokens)
    # in each row: the spines in order of their first call, a spine's PREFIX segment first,
    # then its readers in call order; calls that read no spine stand alone. A spine's copy
    # in a row is as long as the deepest of its readers there (the planner priced all of it).
    order, g_s, opens, call_seg, pre_seg, link_s, S, inverse = _stream_order(row_of, spine, n_sp)
    n_pairs = int(inverse.max()) + 1 if C else 0
    L_pair = np.zeros(n_pairs, dtype=_I64)
    np.maximum.at(L_pair, inverse[reads], b[reads])
    rep = np.zeros(n_pairs, dtype=_I64)  # per (row, spine): a call whose first L tokens are the spine
    deepest = reads & (b == L_pair[inverse])
    rep[inverse[deepest]] = np.flatnonzero(deepest)
    seg_len = np.empty(S, dtype=_I64)
    seg_kind = np.full(S, int(SegmentKind.CALL), dtype=np.int8)
    seg_link = np.full(S, -1, dtype=_I64)
    seg_plen = np.full(S, -1, dtype=_I64)
    seg_traj = np.full(S, -1, dtype=_I64)
    seg_call = np.full(S, -1, dtype=_I64)
    seg_row = np.empty(S, dtype=_I64)
    src = np.zeros((S, 2), dtype=_I64)
    plen = np.zeros((S, 2), dtype=_I64)
    pos0 = np.zeros((S, 2), dtype=_I64)
    b_s, ql_s = b[order], rec.q_len[order]
    seg_len[call_seg] = tail[order]
    seg_link[call_seg] = link_s
    seg_plen[call_seg] = np.where(link_s >= 0, b_s, -1)
    seg_traj[call_seg] = rec.traj[order]
    seg_call[call_seg] = rec.t[order]
    seg_row[call_seg] = row_of[order]
    # a tail from depth b: the rest of q (if b < |q|), then [x_t, a_t] from depth max(b, |q|)
    in_q = np.minimum(b_s, ql_s)
    src[call_seg, 0] = rec.q_off_traj[rec.traj[order]] + in_q
    plen[call_seg, 0] = ql_s - in_q
    pos0[call_seg, 0] = in_q
    past = np.maximum(b_s, ql_s)
    src[call_seg, 1] = rec.x_off[order] + past - ql_s
    plen[call_seg, 1] = length[order] - past
    pos0[call_seg, 1] = past
    if n_sp:
        p_open = inverse[order][opens]
        r = rep[p_open]
        Lg = L_pair[p_open]
        seg_len[pre_seg] = Lg
        seg_kind[pre_seg] = int(SegmentKind.PREFIX)
        seg_row[pre_seg] = row_of[order][opens]
        src[pre_seg, 0] = rec.q_off_traj[rec.traj[r]]
        plen[pre_seg, 0] = np.minimum(Lg, rec.q_len[r])
        src[pre_seg, 1] = rec.x_off[r]
        plen[pre_seg, 1] = Lg - plen[pre_seg, 0]
        pos0[pre_seg, 1] = rec.q_len[r]
    seg_start = np.cumsum(seg_len) - seg_len
    spine_at = np.zeros(C, dtype=_I64)
    tail_at = np.empty(C, dtype=_I64)
    tail_at[order] = seg_start[call_seg]
    spine_at[order] = np.where(link_s >= 0, seg_start[np.maximum(link_s, 0)], 0)
    lay = _Layout(seg_len, seg_kind, seg_link, seg_traj, seg_call, seg_row, (src, plen, pos0), None, None, None, None)
    lay.seg_plen = seg_plen
    lay.depth_map = (b, spine_at, tail_at)
    return lay


def _at_depth(rec: _Records, lay: _Layout, calls: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Packed index of token `depth` of each call's sequence [q, x_t, a_t] in a trie layout."""
    b, spine_at, tail_at = lay.depth_map
    bc = b[calls]
    return np.where(depth < bc, spine_at[calls] + depth, tail_at[calls] + depth - bc)


def _tokens(rec: _Records, pieces) -> tuple[np.ndarray, np.ndarray]:
    """Ids and positions of the pieces laid end to end (piece k: ids[src:src+len] at
    positions pos0, pos0+1, ...)."""
    src, length, pos0 = (p.reshape(-1) for p in pieces)
    starts = np.cumsum(length) - length
    at = np.repeat(src - starts, length)
    _add_arange(at)
    ids = rec.ids[at]
    del at
    pos = np.repeat(pos0 - starts, length)
    _add_arange(pos)
    return ids, pos


def _add_arange(x: np.ndarray, block: int = 1 << 20) -> None:
    """x += arange(len(x)), in place and in blocks (no second array of len(x) at once)."""
    for lo in range(0, x.size, block):
        hi = min(x.size, lo + block)
        x[lo:hi] += np.arange(lo, hi, dtype=x.dtype)


def _action_copies(rec: _Records) -> tuple[np.ndarray, np.ndarray]:
    """(call, context position j) of every context token whose provenance is an action:
    re-encoded copies of earlier model output."""
    at = np.flatnonzero(rec.src == Source.ACTION)
    x_end = np.cumsum(rec.x_len)
    call = np.searchsorted(x_end, at, side="right")
    return call, at - (x_end - rec.x_len)[call]


def _entries(rec: _Records, lay: _Layout, naive_domain: bool) -> dict:
    """Per-entry arrays in (trajectory, call, k) order: in the naive domain a call's
    re-encoded copies of model output (context positions j whose source is an action;
    j = 0 only under a non-empty q) come before its action tokens."""
    C, al = rec.C, rec.a_len
    calls = np.arange(C, dtype=_I64)
    A = int(al.sum())
    a_call = np.repeat(calls, al)
    i = np.arange(A, dtype=_I64) - np.repeat(np.cumsum(al) - al, al)
    trie = lay.depth_map is not None
    if trie:  # a token's index depends on whether its depth is on the call's spine
        a_depth = (rec.q_len + rec.x_len)[a_call] + i
        a_idx = _at_depth(rec, lay, a_call, a_depth)
        a_pred = _at_depth(rec, lay, a_call, a_depth - 1)
        del a_depth
    else:
        a_idx = lay.first[a_call] + i
        a_pred = a_idx - 1
        a_pred[i == 0] = lay.first_pred[al > 0]
    a_tgt = rec.ids[rec.a_off[a_call] + i]
    lps = rec.lps
    if not naive_domain or rec.src is None:
        return {"index": a_idx, "pred": a_pred, "target": a_tgt, "lps": lps, "call": a_call, "k": i,
                "sampled": np.ones(A, dtype=bool)}
    cc, cj = _action_copies(rec)
    # j = 0 has nothing to be predicted from when q is empty: not an entry
    keep = (cj > 0) | (rec.q_len[cc] > 0)
    cc, cj = cc[keep], cj[keep]
    ncopy = np.bincount(cc, minlength=C).astype(_I64)
    per_call = ncopy + al
    base = np.cumsum(per_call) - per_call
    N = int(per_call.sum())
    rank = np.arange(cc.size, dtype=_I64) - (np.cumsum(ncopy) - ncopy)[cc]
    at_c = base[cc] + rank
    at_a = base[a_call] + ncopy[a_call] + i
    def scatter(a_val, c_val, dtype=_I64) -> np.ndarray:
        o = np.empty(N, dtype=dtype)
        o[at_a] = a_val
        o[at_c] = c_val
        return o

    # one entry array at a time, each action-token temporary dropped once placed
    if trie:
        c_idx = _at_depth(rec, lay, cc, rec.q_len[cc] + cj)
        c_pred = _at_depth(rec, lay, cc, rec.q_len[cc] + cj - 1)
    else:
        c_idx = lay.x_start[cc] + cj
        c_pred = np.where(cj == 0, lay.x_pred[cc], c_idx - 1)
    out = {"pred": scatter(a_pred, c_pred)}
    del c_pred
    del a_pred
    out["index"] = scatter(a_idx, c_idx)
    del a_idx, c_idx
    out["target"] = scatter(a_tgt, rec.ids[rec.x_off[cc] + cj])
    del a_tgt
    out["k"] = scatter(ncopy[a_call] + i, rank)
    del i
    out["call"] = scatter(a_call, cc)
    del a_call
    out["lps"] = scatter(lps, math.nan, np.float64)
    out["sampled"] = scatter(True, False, bool)
    return out


def _build(rec: _Records, lay: _Layout, layout: str, naive_domain: bool, pad_id: int) -> PackedBatch:
    cu = np.zeros(lay.seg_len.size + 1, dtype=_I64)
    np.cumsum(lay.seg_len, out=cu[1:])
    attn = AttentionMeta.from_segments(cu, lay.seg_link, lay.seg_kind, lay.seg_plen)
    ids, pos = _tokens(rec, lay.pieces)
    T = ids.size
    if layout == "independent" and T:
        pads = np.repeat(lay.seg_kind == SegmentKind.PAD, lay.seg_len)
        ids[pads] = pad_id
        pos[pads] = 0
        del pads
    rows = int(lay.seg_row[-1]) + 1 if lay.seg_row.size else 0
    cu_rows = np.zeros(rows + 1, dtype=_I64)
    cu_rows[1:] = cu[np.searchsorted(lay.seg_row, np.arange(rows, dtype=_I64), side="right")]
    e = _entries(rec, lay, naive_domain)
    act = np.zeros(T, dtype=bool)
    act[e["index"]] = True
    naive = None
    if layout == "flatten":
        # every token that came from a model output: the action tokens and, in later
        # contexts, their re-encoded copies
        naive = np.zeros(T, dtype=bool)
        naive[e["index"][e["sampled"]]] = True
        if rec.src is not None:
            cc, cj = _action_copies(rec)
            naive[lay.x_start[cc] + cj] = True
    N = e["index"].size
    t = torch.from_numpy
    return PackedBatch(
        layout=layout,
        input_ids=t(ids),
        position_ids=t(pos),
        attn=attn,
        cu_rows=t(cu_rows),
        action_mask=t(act),
        action_index=t(e["index"]),
        pred_index=t(e["pred"]),
        target_ids=t(e["target"]),
        sample_logprobs=t(e["lps"].astype(np.float32)),
        teacher_mask=torch.ones(N, dtype=torch.bool),
        traj_index=t(rec.traj[e["call"]]),
        call_index=t(rec.t[e["call"]]),
        token_index=t(e["k"]),
        segment_traj=t(lay.seg_traj),
        segment_call=t(lay.seg_call),
        action_id=torch.arange(N, dtype=torch.long),
        is_sampled=t(e["sampled"]),
        naive_action_mask=None if naive is None else t(naive),
        num_trajectories=rec.B,
        pad_id=pad_id,
    )


def pack(
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
    share one prefix segment per row). `trie` shares whatever is identical and ignores it.
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
    naive_domain = action_domain == "naive"
    try:
        rec = _Records(trajectories, need_src=naive_domain or layout == "flatten", check=validate)
    except _Unfit as e:
        if validate:  # the record rules name what is wrong, in their words
            validate_trajectories(trajectories, vocab_size)
        raise e.error from None
    if validate and not rec.valid(trajectories, vocab_size):
        validate_trajectories(trajectories, vocab_size)
    if layout in ("aligned", "aligned_unshared"):
        lay = _layout_aligned(rec, trajectories, max_tokens, layout == "aligned", share_prefix)
    elif layout == "independent":
        lay = _layout_independent(rec, max_tokens)
    elif layout == "trie":
        lay = _layout_trie(rec, max_tokens)
    else:
        lay = _layout_flatten(rec, max_tokens)
    return _build(rec, lay, layout, naive_domain, pad_id)
