"""The host-side plan of the packed-attention backward, in plain torch: which query rows
can see each key (`key_query_ranges`), the dK/dV split into pieces of about equal work
(`dkdv_split_plan`, for the spec `dkdv_plan_spec` gives), and host replays of the kernels'
walks for the cost model and the schedule tests (`dkdv_program_ranges`, `fwd_program_ranges`).

Everything here is vectorised torch on the metadata's device with no host synchronisation
(the replays excepted: they run on the CPU); it depends on the metadata only, so the op
caches the ranges and the plan on the metadata and every layer's backward shares them.
Why the split exists and how the kernels use it: `memopd.kernels.attention_kernels`.

The plan's buffers are sized by host bounds, so it needs no sync: up to 2x the key blocks
in plan entries (unused ones do nothing) and 5/3x the key blocks, or of 4 x SMs / Hkv, in
partial slots (Hkv x PLAN_N x D x 8 bytes each). The longest pieces launch first. The
plan's key blocks are the largest candidate BLOCK_N (its query cuts: multiples of the
largest BLOCK_M; `memopd.kernels.attention_tuning`), so one plan serves every autotune
candidate. MEMOPD_ATTENTION_SPLIT=off turns the split off; a number caps the query rows
per piece (tests force the split on small shapes with it).
"""
from __future__ import annotations

import os

import torch

from .attention_tuning import BWD_KV_CONFIGS, FIXED, INTERP_BLOCK
from .runtime import INTERPRET

__all__ = ["key_query_ranges", "DkdvPlan", "SPLIT_ROWS", "DEFAULT_SMS", "sm_count", "dkdv_plan_spec",
           "dkdv_split_plan", "dkdv_program_ranges", "fwd_program_ranges"]


def key_query_ranges(seg_start: torch.Tensor, prefix_start: torch.Tensor, prefix_end: torch.Tensor) -> torch.Tensor:
    """Per key token j, the query token ranges that can see it: int32 [5, T] rows
    (prefix_lo, prefix_hi, own_lo, own_hi, prefix_dense): two half-open ranges [lo, hi) of
    query rows, and whether every row of the prefix range reads j (no gaps).

    O(T log T) vectorised work on the tensors' device, no host synchronisation.
    * prefix: query rows whose prefix interval contains j. Prefix intervals of a valid
      layout with different starts are disjoint, and those of one start nested (the trie
      layout reads one spine to several depths), so j belongs to the intervals with the
      latest start <= j; their readers span [min row, max row + 1) — every call segment
      linked to the prefix, wherever it lies in the stream (a superset where some of them
      stop before j; such a range is not gap-free).
    * own: rows i >= j with seg_start[i] <= j. With seg_start non-decreasing (every layout
      built by `AttentionMeta.from_segments`, padding included) that is [j, X_j) with
      X_j = #rows having seg_start <= j.
    The ranges only bound the kernel's walk (it re-tests every element), so when the
    assumptions fail they fall back to conservative ranges instead of giving wrong results.
    """
    device = seg_start.device
    T = seg_start.shape[0]
    ss = seg_start.long()
    ps = prefix_start.long()
    pe = prefix_end.long()
    idx = torch.arange(T, device=device)
    big = torch.full((T,), T, dtype=torch.long, device=device)
    zero = torch.zeros(T, dtype=torch.long, device=device)

    # ---- prefix readers, bucketed by interval start
    has = pe > ps
    starts = torch.where(has, ps, zero).clamp(0, max(T - 1, 0))
    rd_lo = big.clone().scatter_reduce_(0, starts, torch.where(has, idx, big), "amin")
    rd_hi = zero.clone().scatter_reduce_(0, starts, torch.where(has, idx + 1, zero), "amax")
    end_max = zero.clone().scatter_reduce_(0, starts, torch.where(has, pe, zero), "amax")
    end_min = big.clone().scatter_reduce_(0, starts, torch.where(has, pe, big), "amin")
    present = rd_hi > 0
    # latest present start <= j
    last = torch.cummax(torch.where(present, idx, torch.full_like(idx, -1)), 0).values
    lastc = last.clamp(min=0)
    inside = (last >= 0) & (end_max[lastc] > idx)
    pre_lo = torch.where(inside, rd_lo[lastc], big)
    pre_hi = torch.where(inside, rd_hi[lastc], zero)
    # validity: the intervals of one start end before the next start
    nxt = torch.flip(torch.cummin(torch.flip(torch.where(present, idx, big), [0]), 0).values, [0])
    nxt_after = torch.cat([nxt[1:], nxt.new_full((1,), T)]) if T else nxt
    ok = ~present | (end_max <= nxt_after)
    pre_ok = ok.all()
    # gap-free: the readers fill their range (no other segment interleaved between them)
    # and every one of them reads j (no shorter interval of the same start)
    n_rd = zero.clone().scatter_add_(0, starts, has.long())
    dense = torch.where(inside, (n_rd[lastc] == rd_hi[lastc] - rd_lo[lastc]) & (end_min[lastc] > idx),
                        torch.ones_like(inside))
    pre_lo = torch.where(pre_ok, pre_lo, zero)
    pre_hi = torch.where(pre_ok, pre_hi, torch.full_like(idx, T))
    dense = dense & pre_ok

    # ---- own-segment readers
    x = torch.searchsorted(ss.contiguous(), idx, right=True)
    own_nonempty = x > idx
    own_lo = torch.where(own_nonempty, idx, big)
    own_hi = torch.where(own_nonempty, x, zero)
    mono = (ss[1:] >= ss[:-1]).all() if T > 1 else torch.ones((), dtype=torch.bool, device=device)
    own_lo = torch.where(mono, own_lo, idx)
    own_hi = torch.where(mono, own_hi, torch.full_like(idx, T))
    return torch.stack([pre_lo, pre_hi, own_lo, own_hi, dense.long()]).to(torch.int32).contiguous()


# --------------------------------------------------------------------------------------
# the dK/dV split plan
# --------------------------------------------------------------------------------------
# Query rows of the last window of a key block: a multiple of every tile height, far past
# any token index (the kernels clamp the walk to the key block's reader ranges anyway).
_WINDOW_END = 1 << 30


def _split_setting(text: str | None):
    """MEMOPD_ATTENTION_SPLIT: "auto" (default) pieces of about the average work; "off" / "0"
    no split; an integer N > 0: also at most N query rows per piece (tests force the split
    on small shapes with it)."""
    text = (text or "auto").strip().lower()
    if text == "auto":
        return None
    if text in ("off", "0"):
        return 0
    if not text.isdigit():
        raise ValueError(f"MEMOPD_ATTENTION_SPLIT must be 'auto', 'off' or a positive number of query rows; got {text!r}")
    return int(text)


# The split of the dK/dV backward: None (auto), 0 (off) or a row cap; read at every launch,
# so tests may set it (the plan's cache key names it).
SPLIT_ROWS = _split_setting(os.environ.get("MEMOPD_ATTENTION_SPLIT"))


class DkdvPlan:
    """The dK/dV kernel's work list for one metadata (`dkdv_split_plan`); device tensors.

    table    int32 [4, n_pieces], in launch order: plan key block (n_blocks for an unused
             entry), first and end query row of the piece, partial-sum slot (-1: the key
             block is not split and its programs write dK/dV directly)
    reduce   int32 [2, n_blocks]: first slot and piece count of each split key block (count
             0 where it is not split)
    n_slots  host bound on the slots used (the fp32 partial buffer is allocated at this size)
    spec     (block_n, align_m, max_rows, spread) it was built for
    """

    def __init__(self, table, reduce, n_slots, spec, T):
        self.table, self.reduce, self.n_slots, self.spec, self.T = table, reduce, n_slots, spec, T

    @property
    def n_pieces(self) -> int:
        return int(self.table.shape[1])

    @property
    def block_n(self) -> int:
        return self.spec[0]


# SMs assumed where the device has none to ask (the interpreter; the cost model): H100/H200
DEFAULT_SMS = 132
# The split never makes pieces smaller than 1 / (this x SMs) of the total work: then the
# longest program is at most a quarter of an SM's fair share, and list scheduling ends
# within 1.25x of the ideal; smaller pieces would only cost partial-sum memory.
_PIECES_PER_SM = 4


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (DEFAULT_SMS for other devices)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_SMS


def dkdv_plan_spec(hkv: int = 1, sms: int = DEFAULT_SMS, interpreted: bool | None = None):
    """(block_n, align_m, max_rows, spread) of the plan the dK/dV launch over `hkv` kv heads
    on `sms` SMs needs now: the plan's key
    blocks must be a multiple of the launched BLOCK_N and its query cuts a multiple of the
    tile height (BLOCK_M / GROUP_P2, a power of two dividing BLOCK_M). Autotuned or not, a GPU
    launch uses the largest candidate tile, so one plan serves every candidate; the
    interpreter uses its own (forced) blocks. `interpreted`: which of the two (default: the
    mode the kernels were imported in, `runtime.INTERPRET`; the cost model asks for the GPU's). spread: the
    pieces per kv head over which the work may spread at most (`dkdv_split_plan`)."""
    if INTERPRET if interpreted is None else interpreted:
        bn, bm = FIXED.get("BLOCK_N", INTERP_BLOCK), FIXED.get("BLOCK_M", INTERP_BLOCK)
    else:
        bn = max([c.kwargs["BLOCK_N"] for c in BWD_KV_CONFIGS] + [FIXED.get("BLOCK_N", 0)])
        bm = max([c.kwargs["BLOCK_M"] for c in BWD_KV_CONFIGS] + [FIXED.get("BLOCK_M", 0)])
    return int(bn), int(bm), SPLIT_ROWS, max(1, _PIECES_PER_SM * int(sms) // max(1, int(hkv)))


def _plan_bounds(n_blocks: int, T: int, align_m: int, max_rows, spread: int) -> tuple[int, int]:
    """Host bounds on the number of pieces and of partial-sum slots (known before the device
    has the plan: no sync). Auto mode: t >= W / m with m = min(n_blocks, spread), W the total
    work, so sum(ceil(w / t)) <= sum(w / t + 1) <= n_blocks + m; it splits only blocks with
    w > 1.5 t, fewer than m / 1.5 of them, so their pieces (the slots) number < m + m / 1.5.
    With a row cap N, a block's work (an aligned union of query ranges, < T + align_m rows)
    gives at most ceil((T + align_m) / N) pieces."""
    if max_rows == 0:
        return n_blocks, 0
    if max_rows is None:
        m = min(n_blocks, spread)
        return n_blocks + m, m + -(-2 * m // 3)
    bound = max(2 * n_blocks, n_blocks * -(-(T + align_m) // max_rows))
    return bound, bound


def dkdv_split_plan(key_ranges: torch.Tensor, block_n: int, align_m: int, max_rows=None,
                    spread: int = _PIECES_PER_SM * DEFAULT_SMS) -> DkdvPlan:
    """The split of the dK/dV backward for one metadata, from its `key_query_ranges`:
    vectorised torch on the ranges' device, no host synchronisation.

    Per plan key block of block_n keys: its readers are two query ranges (prefix readers,
    own-segment readers: the unions the kernel derives per block) aligned to align_m rows;
    its work w is the length of their union. The target t is the average work per key block,
    or 1 / spread of the total if that is more (rounded up; with max_rows, at most max_rows;
    max_rows=0: no split). A block with w >
    1.5 t (with max_rows: w > t) is cut into ceil(w / t) pieces of about equal work, the
    cuts on align_m boundaries; a split block's
    programs write fp32 partial sums into slots of their own, summed afterwards in slot
    order. The pieces are launched longest first (list scheduling then finishes within one
    piece of the ideal). Unused entries (the host bound on the pieces is fixed before the
    device knows the count) point past the last key block and do nothing."""
    device = key_ranges.device
    T = int(key_ranges.shape[1])
    spec = (int(block_n), int(align_m), max_rows, int(spread))
    n_blocks = -(-T // block_n)
    if n_blocks == 0:
        empty = torch.zeros((4, 0), dtype=torch.int32, device=device)
        return DkdvPlan(empty, torch.zeros((2, 0), dtype=torch.int32, device=device), 0, spec, T)
    n_pieces, n_slots = _plan_bounds(n_blocks, T, align_m, max_rows, int(spread))
    big = 1 << 40
    r = key_ranges.long()
    pad = n_blocks * block_n - T
    if pad:
        fill = torch.tensor([big, 0, big, 0, 1], dtype=torch.long, device=device)
        r = torch.cat([r, fill[:, None].expand(5, pad)], 1)
    r = r.view(5, n_blocks, block_n)

    def block_range(lo, hi):  # union over the block's keys, aligned; empty -> (big, big)
        has = hi > lo
        lo = torch.where(has, lo, big).amin(1)
        hi = torch.where(has, hi, 0).amax(1)
        empty = hi <= lo
        lo = torch.where(empty, big, lo // align_m * align_m)
        hi = torch.where(empty, big, (hi + align_m - 1) // align_m * align_m)
        return lo, hi

    a_lo, a_hi = block_range(r[0], r[1])
    b_lo, b_hi = block_range(r[2], r[3])
    # the union as two disjoint ranges [s1_lo, s1_hi) < [s2_lo, s2_hi) (the second may be empty)
    a_first = a_lo <= b_lo
    f_lo, f_hi = torch.where(a_first, a_lo, b_lo), torch.where(a_first, a_hi, b_hi)
    g_lo, g_hi = torch.where(a_first, b_lo, a_lo), torch.where(a_first, b_hi, a_hi)
    merged = g_lo <= f_hi
    s1_lo = f_lo
    s1_hi = torch.where(merged, torch.maximum(f_hi, g_hi), f_hi)
    s2_lo = torch.where(merged, s1_hi, g_lo)
    s2_hi = torch.where(merged, s1_hi, g_hi)
    len1 = s1_hi - s1_lo
    work = len1 + (s2_hi - s2_lo)

    if max_rows == 0:
        pieces = torch.ones_like(work)
    else:
        total = work.sum()
        target = torch.maximum((total + n_blocks - 1) // n_blocks, (total + spread - 1) // spread)
        if max_rows:
            target = torch.clamp(target, max=max_rows)
        target = torch.clamp(target, min=1)
        pieces = torch.clamp((work + target - 1) // target, min=1)
        if max_rows is None:  # a block up to 1.5x the average stays whole (halving it gains little)
            pieces = torch.where(2 * work > 3 * target, pieces, 1)
    cum = torch.cumsum(pieces, 0)
    p = torch.arange(n_pieces, device=device)
    g = torch.searchsorted(cum, p, right=True)
    used = g < n_blocks
    gc = g.clamp(max=n_blocks - 1)
    n_g, w_g = pieces[gc], work[gc]
    i = p - (cum[gc] - n_g)

    def cut(u):  # work coordinate -> query row, aligned down
        pos = torch.where(u < len1[gc], s1_lo[gc] + u, s2_lo[gc] + (u - len1[gc]))
        return pos // align_m * align_m

    lo = torch.where(i == 0, 0, cut(i * w_g // n_g))
    hi = torch.where(i + 1 >= n_g, _WINDOW_END, cut((i + 1) * w_g // n_g))
    split = used & (n_g > 1)
    slot = torch.where(split, torch.cumsum(split.long(), 0) - 1, -1)
    table = torch.stack([torch.where(used, gc, n_blocks), torch.where(used, lo, 0), torch.where(used, hi, 0), slot])
    # longest first; unused entries last
    est = torch.where(used, w_g // n_g, -1)
    order = torch.sort(est, descending=True, stable=True).indices
    table = table[:, order].to(torch.int32).contiguous()
    counts = torch.where(pieces > 1, pieces, 0)
    first = torch.cumsum(counts, 0) - counts
    reduce = torch.stack([first, counts]).to(torch.int32).contiguous()
    return DkdvPlan(table, reduce, n_slots, spec, T)


def dkdv_program_ranges(key_ranges: torch.Tensor, plan: DkdvPlan, block_n: int, rows: int) -> torch.Tensor:
    """Host replay of the dK/dV kernel's walk, one row per program of one kv head in launch
    order (every kv head's programs are the same; the launch interleaves the heads):
    int64 [n_programs, 7] = key block of block_n keys (-1: nothing to do), then the three
    query-tile ranges [lo, hi) it walks (prefix readers; own readers below and above them),
    clamped to the piece's window, as the dK/dV kernel's `_bwd_kv_pass` computes them
    (`memopd.kernels.attention_kernels`). For the cost model and
    the schedule tests; `rows` is the tile height BLOCK_M // GROUP_P2."""
    T = int(key_ranges.shape[1])
    r = key_ranges.long().cpu()
    table = plan.table.long().cpu()
    n_sub = plan.block_n // block_n
    n_blocks = -(-T // block_n)
    pad = n_blocks * block_n - T
    if pad:
        r = torch.cat([r, torch.tensor([1 << 30, 0, 1 << 30, 0, 1])[:, None].expand(5, pad)], 1)
    r = r.view(5, n_blocks, block_n)
    pq_lo, pq_hi = r[0].amin(1), r[1].amax(1)
    oq_lo, oq_hi = r[2].amin(1), r[3].amax(1)

    def blocks(lo, hi):
        ne = hi > lo
        return torch.where(ne, lo // rows, 0), torch.where(ne, (hi + rows - 1) // rows, 0)

    a0, a1 = blocks(pq_lo, pq_hi)
    b0, b1 = blocks(oq_lo, oq_hi)
    kb = (table[0][:, None] * n_sub + torch.arange(n_sub)).reshape(-1)
    w0 = (table[1] // rows).repeat_interleave(n_sub)
    w1 = (table[2] // rows).repeat_interleave(n_sub)
    live = kb < n_blocks
    kc = kb.clamp(max=n_blocks - 1)

    def clamp(x):
        return torch.minimum(torch.maximum(x[kc], w0), w1)

    A0, A1, B0, B1 = clamp(a0), clamp(a1), clamp(b0), clamp(b1)
    out = torch.stack([torch.where(live, kb, -1), A0, A1, B0, torch.minimum(B1, A0), torch.maximum(B0, A1), B1], 1)
    out[~live, 1:] = 0
    return out


def fwd_program_ranges(seg_start, prefix_start, prefix_end, block_m: int, block_n: int) -> torch.Tensor:
    """Host replay of the forward (and deterministic dQ) kernel's walk, one row per query
    block of one query head: int64 [n_blocks, 6] = key-block ranges [a0, a1), [b0, min(b1,
    a0)), [max(b0, a1), b1) as the kernels' `_query_block_ranges` computes them. For the cost model."""
    T = int(seg_start.shape[0])
    idx = torch.arange(T)
    ss, ps, pe = (x.long().cpu() for x in (seg_start, prefix_start, prefix_end))
    big = 1 << 30
    own_ok = ss <= idx
    pre_ok = ps < pe
    own_lo, own_hi = torch.where(own_ok, ss, big), torch.where(own_ok, idx, -1)
    pre_lo, pre_hi = torch.where(pre_ok, ps, big), torch.where(pre_ok, pe, 0)
    n = -(-T // block_m)
    pad = n * block_m - T

    def padded(x, value):
        return torch.cat([x, x.new_full((pad,), value)]).view(n, block_m)

    own_lo, own_hi, pre_lo, pre_hi = padded(own_lo, big), padded(own_hi, -1), padded(pre_lo, big), padded(pre_hi, 0)

    def blocks(lo, hi):
        ne = hi > lo
        return torch.where(ne, lo // block_n, 0), torch.where(ne, (hi + block_n - 1) // block_n, 0)

    a0, a1 = blocks(pre_lo.amin(1), pre_hi.amax(1))
    b0, b1 = blocks(own_lo.amin(1), own_hi.amax(1) + 1)
    return torch.stack([a0, a1, b0, torch.minimum(b1, a0), torch.maximum(b0, a1), b1], 1)

