"""The packed-attention dK/dV backward's schedule at production shapes, on CPU (nothing is
launched): the split plan (`dkdv_split_plan`) and the kernel's walk replayed on the host
(`dkdv_program_ranges`, the range logic of `_bwd_kv_pass`), through the cost model of
benchmarks/gpu_cost_model.py.

* With 16 calls sharing one prefix in a row of 16k tokens (Hq 16, Hkv 2, D 128), the
  predicted critical path of the dK/dV kernel on 132 SMs is within 1.5x of its total work
  / 132; with the split off (one program per key block, as before) it is not: the prefix's
  key blocks, read by every call, set it.
* The split changes which program walks a (query tile, key block) pair, never the pairs:
  every pair the unsplit kernel walks is walked exactly once with the split, at every
  shape of the model, and the plan's device-side piece count fits the host bound its
  buffers were sized with.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_cost_model as cm  # noqa: E402

import memopd.kernels.attention_plan as pa  # noqa: E402
import memopd.kernels.attention_tuning as tuning  # noqa: E402

TARGET = 1.5  # critical path / (total work / SMs)


@pytest.mark.parametrize("shape", ["16 calls, one 2k prefix", "16 calls, one 1k prefix"])
def test_dkdv_critical_path_within_target_of_total_work(shape):
    T, Hq, Hkv, D, layout = cm.ATTN_SHAPES[shape]
    split = cm.attention_dkdv(T, Hq, Hkv, D, layout, split=True)
    before = cm.attention_dkdv(T, Hq, Hkv, D, layout, split=False)
    # the same work, other programs
    assert split["tflop"] == pytest.approx(before["tflop"], rel=1e-12)
    assert split["critical_ms"] <= TARGET * split["bound_ms"], split
    assert before["critical_ms"] > TARGET * before["bound_ms"], before
    # the longest program was a prefix key block walking every call's query tiles
    assert before["max_us"] > 4 * split["max_us"]


def _walked_pairs(ranges, n_tiles):
    """(key block, query tile) codes of every pair the programs walk, with repeats."""
    live = ranges[:, 0] >= 0
    r = ranges[live]
    codes = []
    for lo, hi in ((1, 2), (3, 4), (5, 6)):
        n = (r[:, hi] - r[:, lo]).clamp(min=0)
        kb = r[:, 0].repeat_interleave(n)
        start = r[:, lo].repeat_interleave(n)
        offset = torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
        codes.append(kb * n_tiles + start + offset)
    return torch.sort(torch.cat(codes)).values


@pytest.mark.parametrize("shape", list(cm.ATTN_SHAPES))
def test_split_walks_every_pair_exactly_once(shape):
    T, Hq, Hkv, D, layout = cm.ATTN_SHAPES[shape]
    meta = cm.attention_meta(T, layout)
    kqr = pa.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end)
    group_p2 = triton.next_power_of_2(Hq // Hkv)
    bm, bn = cm._first_config(tuning.BWD_KV_CONFIGS, tuning.BWD_KV_PRUNE, D, group_p2)
    rows = bm // group_p2
    plan_n, align_m, _, spread = pa.dkdv_plan_spec(Hkv, cm.ATTN_SMS, interpreted=False)
    n_tiles = -(-T // rows) + 1
    pairs = {}
    for max_rows in (0, None, 512):
        plan = pa.dkdv_split_plan(kqr, plan_n, align_m, max_rows, spread)
        table = plan.table.long()
        n_blocks = -(-T // plan_n)
        used = table[0] < n_blocks
        # every plan key block is there with all its pieces (none cut off by the host bound),
        # their windows tile the query axis, and the slots fit the partial buffer
        counts = torch.bincount(table[0][used], minlength=n_blocks)
        assert torch.equal(counts, plan.reduce[1].long().clamp(min=1))
        for g in torch.nonzero(plan.reduce[1] > 1).flatten().tolist():
            mine = table[:, table[0] == g]
            lo, hi = torch.sort(mine[1]).values, torch.sort(mine[2]).values
            assert lo[0] == 0 and hi[-1] == pa._WINDOW_END and torch.equal(lo[1:], hi[:-1])
        assert int(plan.reduce[1].sum()) <= plan.n_slots
        slots = table[3][used & (table[3] >= 0)]
        assert torch.equal(torch.sort(slots).values, torch.arange(int(plan.reduce[1].sum())))
        if max_rows == 512:  # the row cap holds for every program
            ranges = pa.dkdv_program_ranges(kqr, plan, bn, rows)
            trips = sum((ranges[:, h] - ranges[:, lo]).clamp(min=0) for lo, h in ((1, 2), (3, 4), (5, 6)))
            assert int(trips.max()) * rows <= 512 + 2 * align_m
        pairs[max_rows] = _walked_pairs(pa.dkdv_program_ranges(kqr, plan, bn, rows), n_tiles)
    assert torch.equal(pairs[None], pairs[0]) and torch.equal(pairs[512], pairs[0])
    assert bool((pairs[0][1:] != pairs[0][:-1]).all())  # each pair once


def test_forward_replay_matches_the_visible_blocks():
    """The forward's replayed walk covers every (query block, key block) pair holding a
    visible (query, key) pair, on a small layout checked against the dense mask."""
    meta = cm.attention_meta(512, ("prefix", 128, 4))
    bm, bn = 64, 32
    r = pa.fwd_program_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end, bm, bn)
    vis = meta.visible()
    need = vis.view(512 // bm, bm, 512 // bn, bn).any(3).any(1)
    walked = torch.zeros_like(need)
    for m in range(need.shape[0]):
        for lo, hi in ((0, 1), (2, 3), (4, 5)):
            walked[m, int(r[m, lo]):max(int(r[m, lo]), int(r[m, hi]))] = True
    assert not (need & ~walked).any()
