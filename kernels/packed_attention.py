"""Triton kernels for packed attention: block-diagonal causal segments + shared prefix + GQA.

Forward and backward of softmax attention over a packed stream of T tokens whose mask is
given as O(T) metadata (`memopd.layout.AttentionMeta`): key j is visible to query i iff

    seg_start[i] <= j <= i   or   prefix_start[i] <= j < prefix_end[i].

No dense mask and no position ids ever reach the kernels. Layout: q `[T, Hq, D]`,
k/v `[T, Hkv, D]` with Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv)).

Forward (`packed_attention_fwd`), one program per (query block, query head): the rows'
metadata give two key ranges — the union of the rows' prefix intervals and the own-segment
range [min seg_start, max i] — and the program walks only the key blocks of those ranges
(each block once, even when the ranges overlap). Inside the ranges a block no row sees is
skipped, a block every row sees fully runs without an element mask, and only edge blocks are
element-masked. Rows that see nothing give zeros and LSE = -inf, never NaN.

Backward (`packed_attention_bwd`), FA2 style:
  * dK/dV: one program per (key block, kv head), or per piece of one (the split below).
    Its query tiles stack the GQA group's query heads (tile rows = query rows x heads), so
    one pass sums dK/dV over the group in registers, deterministically. It walks only the
    query blocks that can see the key block: those ranges come from an O(T) per-key
    precomputation (`key_query_ranges`: vectorised torch ops on the device, no host sync;
    the op keeps one per metadata, `key_ranges`).
    For prefix keys the range covers every call segment linked to the prefix, so the
    prefix's dK/dV are summed over all its readers without copying prefix K/V per segment.
    Being per token, it needs none of the kernel's block sizes (autotuned on GPU).
  * The split: a key block read by many rows (a prefix read by 16 calls walks 7-11x the
    query tiles of an average block) would set the kernel's critical path alone, so the
    walk is cut into pieces of about the average work per key block (`dkdv_split_plan`,
    O(T) torch on the device, no host sync; the op caches it on the metadata beside
    `key_ranges`). One program per (piece, key block of BLOCK_N, kv head); a piece is a
    window of query rows, so the pieces of a block partition its query tiles and every
    (query tile, key block) pair is still walked once. Programs of a split block write
    fp32 partial dK/dV into slots of their own, which `_bwd_kv_reduce_kernel` sums in slot
    order (fixed: bitwise reproducible; against the unsplit kernel only the order of that
    fp32 sum differs); unsplit blocks write dK/dV directly as before. Only blocks above
    1.5x the average are split, and no piece is made smaller than a quarter of one SM's
    share of the total work. The plan's buffers are sized by host bounds, so it needs no
    sync: up to 2x the key blocks in plan entries (unused ones do nothing) and 5/3x the
    key blocks, or of 4 x SMs / Hkv, in partial slots (Hkv x PLAN_N x D x 8 bytes each).
    The longest pieces launch first. The plan's key blocks are the largest candidate
    BLOCK_N (its query cuts: multiples of the largest BLOCK_M), so one plan serves every
    autotune candidate. MEMOPD_ATTENTION_SPLIT=off turns the split off; a number caps the
    query rows per piece (tests force the split on small shapes with it).
  * dQ: by default accumulated with fp32 atomics from the dK/dV programs (fewest FLOPs);
    with `deterministic=True` a separate query-major kernel recomputes P and writes dQ once
    per row (no atomics, bitwise reproducible). The atomics are `sem="relaxed"`: the dQ sum
    is only read after the kernel ends, so no add needs ordering against any other memory
    access (the default acq_rel puts a GPU-wide fence and a cache invalidation around
    every atomic, 16 per inner iteration at the production tiles).

Non-finite inputs. A tile straddling a segment boundary multiplies masked weights (P, dS:
exact zeros) with every row of the other operand, and 0 * NaN = NaN: one NaN/inf k, v, q
or dO row would reach rows of other segments and trajectories in its tiles. Sanitising
every masked tile would cost the common case (an operand changed in registers no longer
feeds the MMA straight from its pipelined shared-memory buffer, and the extra code costs
registers: these kernels sit near 255 on sm_90), so each kernel is launched twice:
  1. the plain launch (SAFE=False): the loops exactly as without this feature, then, per
     program, a row whose accumulator (O, dQ; dK/dV per key row) is non-finite is flagged
     in an int8 [heads, T] buffer. A spread NaN stays NaN (NaN * x, NaN + x, 0 * NaN), so a
     block without a flagged row is exact. The dK/dV program also checks its resident k/v
     block first: if that holds a NaN/inf, its atomic dQ adds are masked off (they could
     not be undone later) and it is flagged to redo them.
  2. the SAFE launch (same grid and configuration): a program returns at once unless one of
     its rows is flagged (the common case: one cheap launch). A flagged block is recomputed
     with fully visible tiles as in the plain launch (every row reads every key there) and
     masked tiles sanitised: the operand contracted over masked entries (v in P @ V; k in
     dS @ K; q and dO in dS^T @ Q and P^T @ dO) gets zeros for its non-finite entries,
     masked dS entries are exact zeros, and the rows that see a non-finite value get NaN
     in its place (NaN score for a bad v row, NaN LSE for a bad q/dO row; a bad k row gives
     NaN scores by itself). On finite values this is the plain arithmetic plus selects.
Result: every output and gradient element that does not depend on the bad value is bitwise
the clean run's (checked under the interpreter; on a GPU this relies on the SAFE kernel
contracting the same expressions into the same FMAs), except the atomic dQ: a key block
whose k/v holds the bad value adds its share in the SAFE launch, so in another order, which
changes the rounding as between any two atomic runs (deterministic=True is bitwise); a row that sees a NaN/inf in k or v
gets NaN over the whole head dim (as the torch backend), and the gradients that depend on
it are NaN. One IEEE corner differs from the torch backend: an inf in k can give a row a
score of exactly -inf for that key, i.e. weight 0 (as in the reference backend), so that
row stays finite where the torch backend makes it NaN. Clean inputs give bitwise the
results of the kernels without this feature (the same loops run). Cost on clean inputs: per
program a row reduction of the accumulator and an int8 store (dK/dV: also a reduction over
its resident k/v tiles), plus one extra launch per kernel whose programs read BLOCK flags;
compiled offline for sm_90 (bf16, D=64/128), the plain launches keep their register use
(+-10) and their loops' spills (none where there were none), configuration by configuration.

Interpreter, autotuning and dot-precision policy come from `memopd.kernels.runtime`;
Triton compatibility and what has been checked on which hardware: docs/design.md §6.1 and §8.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .contract import TRITON_DTYPES as _SUPPORTED_DTYPES
from .contract import TRITON_HEAD_DIMS as SUPPORTED_HEAD_DIMS
from .runtime import INTERPRET, LOG2E, USE_AUTOTUNE, autotuned, dot_precision, helper, tuning_bucket, upcast

__all__ = [
    "INTERPRET",
    "SUPPORTED_HEAD_DIMS",
    "packed_attention_fwd",
    "packed_attention_bwd",
    "key_query_ranges",
    "dkdv_split_plan",
    "dkdv_plan_spec",
    "sm_count",
    "check_triton_inputs",
]

# The "no range" sentinel of integer min-reductions inside the kernels: far above any
# token index, far below 2^31. Constexprs: compiled Triton reads only those as globals.
_NO_RANGE = tl.constexpr(1 << 30)
# The kernels work in base 2: scores are scaled by softmax_scale * LOG2E, the stored LSE is
# natural log (base-2 LSE * LN2) and is read back into base 2 (* LOG2E).
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(LOG2E)

# Interpreter block sizes: tl.dot needs every dimension >= 16.
_INTERP_BLOCK = 16


# --------------------------------------------------------------------------------------
# shared helpers (inlined by Triton)
# --------------------------------------------------------------------------------------
# per-tile helpers: plain Python under the interpreter (see runtime.helper)
@helper
def _row_meta(SEG, PST, PEND, offs_m, T, valid):
    """Per query row: own range [own_lo, own_hi] (inclusive) and prefix range [pre_lo, pre_hi).

    Empty ranges are normalised to (BIG, -1) / (BIG, 0) so that interval tests and
    min/max reductions need no extra flags; rows past T, or not `valid`, are empty.
    """
    row_ok = (offs_m < T) & valid
    ss = tl.load(SEG + offs_m, mask=row_ok, other=_NO_RANGE)
    ps = tl.load(PST + offs_m, mask=row_ok, other=0)
    pe = tl.load(PEND + offs_m, mask=row_ok, other=0)
    own_ok = row_ok & (ss <= offs_m)
    pre_ok = row_ok & (ps < pe)
    own_lo = tl.where(own_ok, ss, _NO_RANGE)
    own_hi = tl.where(own_ok, offs_m, -1)
    pre_lo = tl.where(pre_ok, ps, _NO_RANGE)
    pre_hi = tl.where(pre_ok, pe, 0)
    return own_lo, own_hi, pre_lo, pre_hi, row_ok


@helper
def _block_class(own_lo, own_hi, pre_lo, pre_hi, row_ok, n0, BLOCK_N: tl.constexpr):
    """(does any row see a key of [n0, n0+BLOCK_N), does every row see all of it)."""
    n_last = n0 + BLOCK_N - 1
    sees_any = ((pre_lo <= n_last) & (pre_hi > n0)) | ((own_lo <= n_last) & (own_hi >= n0))
    # "full" implies n_last < T: own_hi < T and pre_hi <= T. Rows past T never count as
    # full, so the ragged tail always goes through the masked path.
    sees_all = row_ok & (((pre_lo <= n0) & (pre_hi > n_last)) | ((own_lo <= n0) & (own_hi >= n_last)))
    # both answers from one reduction (reductions are the costly part in the interpreter):
    # low 16 bits count rows that see something, high bits rows that do not see it all
    # (BLOCK_M <= 2^15, so the fields cannot overflow into each other)
    code = tl.sum(sees_any.to(tl.int32) + (1 - sees_all.to(tl.int32)) * 65536, axis=0)
    any_blk = (code & 65535) > 0
    full_blk = (code >> 16) == 0
    return any_blk, full_blk


@helper
def _visible(own_lo, own_hi, pre_lo, pre_hi, offs_n):
    """Element mask [BM, BN] of the rows (their ranges from `_row_meta`) over keys offs_n."""
    n = offs_n[None, :]
    return ((n >= pre_lo[:, None]) & (n < pre_hi[:, None])) | ((n >= own_lo[:, None]) & (n <= own_hi[:, None]))


@helper
def _visible_t(own_lo, own_hi, pre_lo, pre_hi, offs_n):
    """The same mask transposed, [BN, BM] (keys x rows), built directly in that layout."""
    n = offs_n[:, None]
    return ((n >= pre_lo[None, :]) & (n < pre_hi[None, :])) | ((n >= own_lo[None, :]) & (n <= own_hi[None, :]))


@helper
def _ranges_to_blocks(lo, hi, BLOCK: tl.constexpr):
    """Token range [lo, hi) -> block range [b0, b1); empty ranges become (0, 0)."""
    nonempty = hi > lo
    b0 = tl.where(nonempty, lo // BLOCK, 0)
    b1 = tl.where(nonempty, (hi + BLOCK - 1) // BLOCK, 0)
    return b0, b1


# --------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------
@helper
def _fwd_step(
    acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
    own_lo, own_hi, pre_lo, pre_hi, T, n0, full_blk, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SAFE: tl.constexpr,
):
    """One key block of the online softmax. SAFE: the rerun of a query block that met a
    NaN/inf (see "Non-finite inputs" in the module docstring)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    rows_n = offs_n.to(tl.int64)
    kT = tl.load(K_head + rows_n[None, :] * stride_kt + offs_d[:, None], mask=key_ok[None, :], other=0.0)
    v = tl.load(V_head + rows_n[:, None] * stride_vt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    if UPCAST:
        kT = kT.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, kT, input_precision=PREC) * qk_scale
    if SAFE:
        # fully visible tiles: as in the plain pass (every row is a reader). Masked tiles:
        # a masked weight 0 times a NaN/inf value is NaN, so multiply zeros instead, and
        # give the rows that see a non-finite value a NaN score for its key (v - v: 0
        # where v is finite, NaN elsewhere). Selects only: visible scores keep their bits.
        if full_blk:
            vv = v
        else:
            z = v - v
            s = tl.where(tl.sum(z, 1)[None, :] == 0.0, s, float("nan"))
            s = tl.where(_visible(own_lo, own_hi, pre_lo, pre_hi, offs_n), s, float("-inf"))
            vv = tl.where(z == 0.0, v, 0.0)
    else:
        vv = v
        if not full_blk:
            s = tl.where(_visible(own_lo, own_hi, pre_lo, pre_hi, offs_n), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing visible so far keeps m = -inf; subtracting 0 instead of -inf
    # keeps exp2 at 0 instead of NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), vv, acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
    own_lo, own_hi, pre_lo, pre_hi, row_ok, T, blk_lo, blk_hi, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SKIP_EMPTY: tl.constexpr, SAFE: tl.constexpr,
):
    """Key blocks [blk_lo, blk_hi). SKIP_EMPTY tests each block for a reader first; it is
    only used where the range may have gaps, so the common loops carry no conditional
    around their loads (which would keep Triton from pipelining them)."""
    for nb in range(blk_lo, blk_hi):
        n0 = nb * BLOCK_N
        any_blk, full_blk = _block_class(own_lo, own_hi, pre_lo, pre_hi, row_ok, n0, BLOCK_N)
        if SKIP_EMPTY:
            if any_blk:
                acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
                                          own_lo, own_hi, pre_lo, pre_hi, T, n0, full_blk, qk_scale,
                                          BLOCK_N, HEAD_DIM, UPCAST, PREC, SAFE)
        else:
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
                                      own_lo, own_hi, pre_lo, pre_hi, T, n0, full_blk, qk_scale,
                                      BLOCK_N, HEAD_DIM, UPCAST, PREC, SAFE)
    return acc, l_i, m_i


@triton.jit
def _fwd_pass(
    q, K_head, V_head, stride_kt, stride_vt, own_lo, own_hi, pre_lo, pre_hi, row_ok, T,
    a0, a1, a_uniform, b0, b1, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, SAFE: tl.constexpr,
):
    """All key blocks of a query block: A, then the parts of B below and above A (every
    needed key block exactly once). Returns (acc, l, m)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if a_uniform:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
                                   own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, qk_scale,
                                   BLOCK_N, HEAD_DIM, UPCAST, PREC, False, SAFE)
    else:  # rows of calls linked to different prefixes: the union may hold unread blocks
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
                                   own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, qk_scale,
                                   BLOCK_N, HEAD_DIM, UPCAST, PREC, True, SAFE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
                               own_lo, own_hi, pre_lo, pre_hi, row_ok, T, b0, tl.minimum(b1, a0), qk_scale,
                               BLOCK_N, HEAD_DIM, UPCAST, PREC, False, SAFE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head, V_head, stride_kt, stride_vt,
                               own_lo, own_hi, pre_lo, pre_hi, row_ok, T, tl.maximum(b0, a1), b1, qk_scale,
                               BLOCK_N, HEAD_DIM, UPCAST, PREC, False, SAFE)
    return acc, l_i, m_i


@helper
def _query_block_ranges(own_lo, own_hi, pre_lo, pre_hi, BLOCK_N: tl.constexpr):
    """Key block ranges of a query block: A (prefix intervals) and B (own segments), and
    whether A is gap-free (all rows that have a prefix share the same interval)."""
    lo_min = tl.min(pre_lo, 0)
    hi_max = tl.max(pre_hi, 0)
    lo_max = tl.max(tl.where(pre_hi > 0, pre_lo, -1), 0)
    hi_min = tl.min(tl.where(pre_hi > 0, pre_hi, _NO_RANGE), 0)
    a_uniform = (lo_min == lo_max) & (hi_min == hi_max)
    a0, a1 = _ranges_to_blocks(lo_min, hi_max, BLOCK_N)
    # own ranges of consecutive rows chain into one interval (only long padding runs leave
    # gaps, and those are masked, not wrong)
    b0, b1 = _ranges_to_blocks(tl.min(own_lo, 0), tl.max(own_hi, 0) + 1, BLOCK_N)
    return a0, a1, a_uniform, b0, b1


@triton.jit
def _fwd_block(
    Q, K, V, O, LSE, SEG, PST, PEND, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr,
):
    """One (query block, query head): writes O and LSE; returns, per row, whether its
    accumulator is non-finite (acc - acc: NaN there, 0 elsewhere), i.e. the block met a
    NaN/inf. (Per row, not per block: a block-wide reduction here costs the plain launch
    registers and spills on sm_90.)"""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    own_lo, own_hi, pre_lo, pre_hi, row_ok = _row_meta(SEG, PST, PEND, offs_m, T, offs_m >= 0)

    rows_m = offs_m.to(tl.int64)
    q = tl.load(Q + h * stride_qh + rows_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    a0, a1, a_uniform, b0, b1 = _query_block_ranges(own_lo, own_hi, pre_lo, pre_hi, BLOCK_N)
    acc, l_i, m_i = _fwd_pass(q, K + kvh * stride_kh, V + kvh * stride_vh, stride_kt, stride_vt,
                              own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, a_uniform, b0, b1, qk_scale,
                              BLOCK_M, BLOCK_N, HEAD_DIM, UPCAST, PREC, SAFE)
    if SAFE:
        # rows that read a NaN/inf: NaN over the whole head dim (through fully visible
        # tiles a bad v entry leaves only its own dim non-finite), as the torch backend
        acc = tl.where((tl.sum(acc - acc, 1) != 0)[:, None], float("nan"), acc)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + h * stride_oh + rows_m[:, None] * stride_ot + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    # natural-log LSE; -inf for rows that see nothing
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    tl.store(LSE + h * T + offs_m, lse, mask=row_ok)
    return tl.sum(acc - acc, 1) != 0


# the GQA group is a runtime argument, never specialised (not even 1): it only picks the
# kv head, so one binary per configuration serves every group (and every model)
@triton.jit(do_not_specialize=["GROUP"])
def _fwd_kernel(
    Q, K, V, O, LSE, SEG, PST, PEND, FLAGS, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr,
):
    # FLAGS [Hq, T] int8: the plain launch (SAFE=False) flags the rows whose accumulator is
    # non-finite; the SAFE launch that follows redoes exactly the query blocks holding one
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    flags = FLAGS + tl.program_id(1) * T + offs_m
    if SAFE:
        if tl.max(tl.load(flags, mask=offs_m < T, other=0), 0) != 0:
            _fwd_block(Q, K, V, O, LSE, SEG, PST, PEND, T,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                       qk_scale, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, UPCAST, PREC, True)
    else:
        bad = _fwd_block(Q, K, V, O, LSE, SEG, PST, PEND, T,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                         qk_scale, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, UPCAST, PREC, False)
        tl.store(flags, bad.to(tl.int8), mask=offs_m < T)


# --------------------------------------------------------------------------------------
# backward: dK/dV (+ atomic dQ)
# --------------------------------------------------------------------------------------
@helper
def _bwd_kv_step(
    dk, dv, k, v, Q, DO, DQ, LSE, DELTA, head_r,
    own_lo, own_hi, pre_lo, pre_hi, row_ok, rows, offs_n, full_blk,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, T, sm_scale, qk_scale, dq_on,
    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SAFE: tl.constexpr,
):
    """One query tile's contribution to a key block's dK/dV (and, with atomics and dq_on,
    to dQ). Tile row r is query row rows[r] of query head head_r[r]. SAFE: the rerun of a
    key block that met a NaN/inf."""
    offs_d = tl.arange(0, HEAD_DIM)
    rows64 = rows.to(tl.int64)
    q = tl.load(Q + rows64[:, None] * stride_qt + head_r[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + rows64[:, None] * stride_dot + head_r[:, None] * stride_doh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + head_r * T + rows, mask=row_ok, other=0.0)
    # rows that see nothing have LSE -inf; their elements are all masked below
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
    delta = tl.load(DELTA + head_r * T + rows, mask=row_ok, other=0.0)
    sT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # [BN, BM]
    if SAFE and not full_blk:
        # masked tiles of the rerun: products of masked zeros (weights, dS) with a
        # non-finite operand row are kept out; rows with a non-finite q or dO get NaN
        # weights for the keys they see instead (q - q: 0 where finite, NaN elsewhere).
        # Fully visible tiles run the plain code below (every row is a reader).
        vis = _visible_t(own_lo, own_hi, pre_lo, pre_hi, offs_n)
        zq = q - q
        zdo = do - do
        lse2 = tl.where(tl.sum(zq, 1) + tl.sum(zdo, 1) == 0.0, lse2, float("nan"))
        pT = tl.where(vis, tl.math.exp2(sT - lse2[None, :]), 0.0)
        dv = tl.dot(pT.to(do.dtype), tl.where(zdo == 0.0, do, 0.0), dv, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = tl.where(vis, pT * (dpT - delta[None, :]), 0.0)
        dk = tl.dot(dsT.to(q.dtype), tl.where(zq == 0.0, q, 0.0), dk, input_precision=PREC)
        if ATOMIC_DQ:
            if dq_on:
                dq = tl.dot(tl.trans(dsT).to(k.dtype), tl.where(k - k == 0.0, k, 0.0), input_precision=PREC)
                tl.atomic_add(DQ + rows64[:, None] * stride_dqt + head_r[:, None] * stride_dqh + offs_d[None, :],
                              dq * sm_scale, mask=row_ok[:, None], sem="relaxed")
    else:
        pT = tl.math.exp2(sT - lse2[None, :])
        if not full_blk:
            pT = tl.where(_visible_t(own_lo, own_hi, pre_lo, pre_hi, offs_n), pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dsT).to(k.dtype), k, input_precision=PREC) * sm_scale
            tl.atomic_add(DQ + rows64[:, None] * stride_dqt + head_r[:, None] * stride_dqh + offs_d[None, :], dq,
                          mask=tl.where(dq_on, row_ok[:, None], False),  # (`&` breaks the interpreter)
                          sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_kv_inner(
    dk, dv, k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, head_r, m_r, head_ok,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh, T, n0, blk_lo, blk_hi, sm_scale, qk_scale,
    dq_on,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr, SKIP_EMPTY: tl.constexpr,
    SAFE: tl.constexpr,
):
    """Query blocks [blk_lo, blk_hi) of ROWS rows each (all heads of the group per tile)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    for mb in range(blk_lo, blk_hi):
        rows = mb * ROWS + m_r
        own_lo, own_hi, pre_lo, pre_hi, row_ok = _row_meta(SEG, PST, PEND, rows, T, head_ok)
        any_blk, full_blk = _block_class(own_lo, own_hi, pre_lo, pre_hi, row_ok, n0, BLOCK_N)
        if SKIP_EMPTY:
            if any_blk:
                dk, dv = _bwd_kv_step(dk, dv, k, v, Q, DO, DQ, LSE, DELTA, head_r,
                                      own_lo, own_hi, pre_lo, pre_hi, row_ok, rows, offs_n, full_blk,
                                      stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                                      T, sm_scale, qk_scale, dq_on, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, SAFE)
        else:
            dk, dv = _bwd_kv_step(dk, dv, k, v, Q, DO, DQ, LSE, DELTA, head_r,
                                  own_lo, own_hi, pre_lo, pre_hi, row_ok, rows, offs_n, full_blk,
                                  stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                                  T, sm_scale, qk_scale, dq_on, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, SAFE)
    return dk, dv


@triton.jit
def _bwd_kv_pass(
    k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, KQR, kvh,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    T, n0, w0, w1, sm_scale, qk_scale, dq_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SAFE: tl.constexpr,
):
    """The query blocks in [w0, w1) (this program's piece of the split plan) that read a
    key block. Returns (dK / sm_scale, dV). The tile rows and query ranges are derived here
    rather than passed in, so that nothing but k/v stays live from the plain pass into a
    SAFE rerun (the plain pass keeps its registers)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    offs_r = tl.arange(0, BLOCK_M)
    g_r = offs_r // ROWS
    m_r = offs_r % ROWS
    head_ok = g_r < GROUP
    head_r = kvh * GROUP + tl.where(head_ok, g_r, 0)

    # query token ranges that can see this key block. KQR rows, per key token:
    # 0/1 prefix readers [lo, hi), 2/3 own-segment readers [lo, hi), 4 prefix readers gap-free
    p_lo = tl.load(KQR + 0 * T + offs_n, mask=key_ok, other=_NO_RANGE)
    p_hi = tl.load(KQR + 1 * T + offs_n, mask=key_ok, other=0)
    p_dense = tl.load(KQR + 4 * T + offs_n, mask=key_ok, other=1)
    has_p = p_hi > p_lo
    pq_lo = tl.min(p_lo, 0)
    pq_hi = tl.max(p_hi, 0)
    # gap-free only if every key of the block with readers has the same gap-free range
    p_uniform = (tl.max(tl.where(has_p, p_lo, -1), 0) == pq_lo) & \
        (tl.min(tl.where(has_p, p_hi, _NO_RANGE), 0) == pq_hi) & (tl.min(p_dense, 0) > 0)
    oq_lo = tl.min(tl.load(KQR + 2 * T + offs_n, mask=key_ok, other=_NO_RANGE), 0)
    oq_hi = tl.max(tl.load(KQR + 3 * T + offs_n, mask=key_ok, other=0), 0)
    a0, a1 = _ranges_to_blocks(pq_lo, pq_hi, ROWS)
    b0, b1 = _ranges_to_blocks(oq_lo, oq_hi, ROWS)
    # clamped into the window: the pieces of a split key block partition the query axis,
    # so every (query tile, key block) pair is still walked exactly once
    a0 = tl.minimum(tl.maximum(a0, w0), w1)
    a1 = tl.minimum(tl.maximum(a1, w0), w1)
    b0 = tl.minimum(tl.maximum(b0, w0), w1)
    b1 = tl.minimum(tl.maximum(b1, w0), w1)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # A: the readers of the prefix keys in this block, i.e. every call segment linked to
    # the prefix — this is where the prefix's dK/dV are summed over its calls
    if p_uniform:
        dk, dv = _bwd_kv_inner(dk, dv, k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, head_r, m_r, head_ok,
                               stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                               T, n0, a0, a1, sm_scale, qk_scale, dq_on,
                               ROWS, BLOCK_N, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, False, SAFE)
    else:  # readers interleaved with other segments: test each query block first
        dk, dv = _bwd_kv_inner(dk, dv, k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, head_r, m_r, head_ok,
                               stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                               T, n0, a0, a1, sm_scale, qk_scale, dq_on,
                               ROWS, BLOCK_N, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, True, SAFE)
    # B minus A: the own-segment readers
    dk, dv = _bwd_kv_inner(dk, dv, k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, head_r, m_r, head_ok,
                           stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                           T, n0, b0, tl.minimum(b1, a0), sm_scale, qk_scale, dq_on,
                           ROWS, BLOCK_N, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, False, SAFE)
    dk, dv = _bwd_kv_inner(dk, dv, k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, head_r, m_r, head_ok,
                           stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                           T, n0, tl.maximum(b0, a1), b1, sm_scale, qk_scale, dq_on,
                           ROWS, BLOCK_N, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, False, SAFE)
    return dk, dv


@triton.jit
def _bwd_kv_block(
    Q, K, V, DO, DQ, DK, DV, PART, LSE, DELTA, SEG, PST, PEND, KQR, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    sm_scale, qk_scale, dq_on, PLAN, n_pieces, kvh, HKV,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PLAN_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, SAFE: tl.constexpr,
):
    """This program's plan entry (`_plan_entry`: key block [n0, n0 + BLOCK_N), query rows
    [q_lo, q_hi), [0, 2^30) when the block is not split) for kv head kvh: writes dK/dV, or,
    when the entry has a slot, its fp32 partial sums into that slot of PART (summed by
    `_bwd_kv_reduce_kernel`), and adds to dQ. Returns, per key row, the flag for the SAFE
    launch (which takes the block's maximum): 0 clean; 1 redo dK/dV (a non-finite dK/dV
    row: a NaN/inf q, dO or O row may have spread through masked products; the block's dQ
    contributions were exact); 3 redo dQ too (a NaN/inf in this block's k or v would reach
    the atomic dQ of rows that cannot see it, so the plain pass adds none)."""
    # GQA: the query tile stacks the GROUP query heads that read this kv head — BLOCK_M tile
    # rows = ROWS query rows x GROUP_P2 heads (GROUP rounded up to a power of two, the
    # padding heads masked). One pass then sums dK/dV over the group deterministically,
    # with no loop over heads around the query loop (which cost registers and spills).
    ROWS: tl.constexpr = BLOCK_M // GROUP_P2
    n0, q_lo, q_hi, _ = _plan_entry(PLAN, n_pieces, BLOCK_N, PLAN_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < T
    rows_n = offs_n.to(tl.int64)
    k = tl.load(K + kvh * stride_kh + rows_n[:, None] * stride_kt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + kvh * stride_vh + rows_n[:, None] * stride_vt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # the piece's query rows as query tiles (the plan aligns them to a multiple of ROWS)
    w0 = q_lo // ROWS
    w1 = q_hi // ROWS
    if SAFE:
        dk, dv = _bwd_kv_pass(k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, KQR, kvh,
                              stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                              T, n0, w0, w1, sm_scale, qk_scale, dq_on,
                              GROUP, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, True)
        flag = 0
    else:
        # (the pass runs regardless, only its dQ atomics are masked off: an `if` around it
        # costs the pass registers and spills on sm_90)
        kv_bad = (tl.sum(tl.sum(k - k, 1), 0) + tl.sum(tl.sum(v - v, 1), 0)) != 0
        dk, dv = _bwd_kv_pass(k, v, Q, DO, DQ, LSE, DELTA, SEG, PST, PEND, KQR, kvh,
                              stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                              T, n0, w0, w1, sm_scale, qk_scale, not kv_bad,
                              GROUP, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, UPCAST, PREC, ATOMIC_DQ, False)
        redo = (tl.sum(dk - dk, 1) + tl.sum(dv - dv, 1)) != 0
        flag = tl.where(kv_bad, 3, redo.to(tl.int32))

    # every key block is written, including keys nobody sees (their gradient is 0): in
    # place when it is not split, else as this piece's fp32 partial sums (unscaled dK, dV).
    # The plan entry is read again here rather than kept in registers through the loop
    # (the atomic dQ adds keep the compiler from merging the two reads): at D=128 the plain
    # launch has no register to spare.
    n0, _, _, slot = _plan_entry(PLAN, n_pieces, BLOCK_N, PLAN_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    rows_n = offs_n.to(tl.int64)
    part_row = tl.where(slot >= 0, slot * 2 * HKV * PLAN_N + n0 % PLAN_N, -1)
    direct = tl.where(part_row < 0, key_ok, False)  # (`&` breaks the interpreter)
    tl.store(DK + kvh * stride_dkh + rows_n[:, None] * stride_dkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=direct[:, None])
    tl.store(DV + kvh * stride_dvh + rows_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=direct[:, None])
    # PART [slots, 2, HKV, PLAN_N, HEAD_DIM]: part_row = slot * 2 * HKV * PLAN_N + key offset
    # in the plan's key block; + HKV * PLAN_N for dV
    split = tl.where(part_row >= 0, key_ok, False)
    prow = (tl.maximum(part_row, 0).to(tl.int64) + kvh * PLAN_N + tl.arange(0, BLOCK_N)) * HEAD_DIM
    tl.store(PART + prow[:, None] + offs_d[None, :], dk, mask=split[:, None])
    tl.store(PART + HKV * PLAN_N * HEAD_DIM + prow[:, None] + offs_d[None, :], dv, mask=split[:, None])
    return flag


@helper
def _plan_entry(PLAN, n_pieces, BLOCK_N: tl.constexpr, PLAN_N: tl.constexpr):
    """This program's entry of the split plan: (first key, first and end query row, slot).
    Program id 1 enumerates (piece, key block of BLOCK_N inside the plan's PLAN_N keys)."""
    N_SUB: tl.constexpr = PLAN_N // BLOCK_N
    rest = tl.program_id(1)
    piece = rest // N_SUB
    n0 = tl.load(PLAN + piece) * PLAN_N + (rest % N_SUB) * BLOCK_N
    q_lo = tl.load(PLAN + n_pieces + piece)
    q_hi = tl.load(PLAN + 2 * n_pieces + piece)
    slot = tl.load(PLAN + 3 * n_pieces + piece)
    return tl.multiple_of(n0, BLOCK_N), q_lo, q_hi, slot


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DQ, DK, DV, PART, LSE, DELTA, SEG, PST, PEND, KQR, PLAN, FLAGS, T, HKV, n_pieces,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    sm_scale, qk_scale,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PLAN_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, SAFE: tl.constexpr,
):
    # One program per (kv head, piece of the split plan x key block of BLOCK_N inside the
    # plan's key block of PLAN_N keys): kv heads fastest in the launch order. PLAN int32
    # [4, n_pieces], in launch order: plan key block (past the end for an unused entry),
    # query rows [lo, hi), slot of the fp32 partial sums (-1: not split, write dK/dV
    # directly). See `dkdv_split_plan`. (The kv head is a program id of its own, not derived
    # from a flat one, and the entry is re-read where needed: registers, see _bwd_kv_block.)
    kvh = tl.program_id(0)
    # FLAGS int8, BLOCK_N per program: set by the plain launch, read by the SAFE launch
    # (see _bwd_kv_block). Unused plan entries have no key in range: no flag, no store.
    if SAFE:
        n0, _, _, _ = _plan_entry(PLAN, n_pieces, BLOCK_N, PLAN_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        flags = FLAGS + (tl.program_id(1).to(tl.int64) * HKV + kvh) * BLOCK_N + tl.arange(0, BLOCK_N)
        f = tl.max(tl.load(flags, mask=offs_n < T, other=0), 0)
        if f != 0:
            _bwd_kv_block(Q, K, V, DO, DQ, DK, DV, PART, LSE, DELTA, SEG, PST, PEND, KQR, T,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                          sm_scale, qk_scale, f > 1, PLAN, n_pieces, kvh, HKV,
                          GROUP, GROUP_P2, HEAD_DIM, BLOCK_M, BLOCK_N, PLAN_N, UPCAST, PREC, ATOMIC_DQ, True)
    else:
        f = _bwd_kv_block(Q, K, V, DO, DQ, DK, DV, PART, LSE, DELTA, SEG, PST, PEND, KQR, T,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                          sm_scale, qk_scale, True, PLAN, n_pieces, kvh, HKV,
                          GROUP, GROUP_P2, HEAD_DIM, BLOCK_M, BLOCK_N, PLAN_N, UPCAST, PREC, ATOMIC_DQ, False)
        # (addressed after the pass: nothing of it stays live through the loop)
        n0, _, _, _ = _plan_entry(PLAN, n_pieces, BLOCK_N, PLAN_N)
        flags = FLAGS + (tl.program_id(1).to(tl.int64) * HKV + kvh) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(flags, f.to(tl.int8), mask=n0 + tl.arange(0, BLOCK_N) < T)


@triton.jit
def _bwd_kv_reduce_kernel(
    PART, DK, DV, RED, T, HKV, n_blocks, plan_n, stride_dkt, stride_dkh, stride_dvt, stride_dvh, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """dK (axis 2 = 0) or dV (= 1) of BLOCK_R keys of kv head axis 1, for a split plan key
    block: the sum of its pieces' fp32 partials, in slot order (fixed: bitwise reproducible).
    RED int32 [2, n_blocks]: first slot and number of pieces (0: not split, nothing to do)."""
    r0 = tl.program_id(0) * BLOCK_R
    kvh = tl.program_id(1)
    which = tl.program_id(2)
    g = r0 // plan_n
    first = tl.load(RED + g)
    count = tl.load(RED + n_blocks + g)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = tl.where(count > 0, offs_r < T, False)
    local = (r0 - g * plan_n + tl.arange(0, BLOCK_R)).to(tl.int64)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for i in range(0, count):
        row = (((first + i).to(tl.int64) * 2 + which) * HKV + kvh) * plan_n + local
        acc += tl.load(PART + row[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    rows = offs_r.to(tl.int64)
    if which == 0:
        tl.store(DK + kvh * stride_dkh + rows[:, None] * stride_dkt + offs_d[None, :],
                 (acc * sm_scale).to(DK.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(DV + kvh * stride_dvh + rows[:, None] * stride_dvt + offs_d[None, :],
                 acc.to(DV.dtype.element_ty), mask=ok[:, None])


# --------------------------------------------------------------------------------------
# backward: deterministic dQ (query-major, recomputes P)
# --------------------------------------------------------------------------------------
@helper
def _bwd_dq_step(
    dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
    own_lo, own_hi, pre_lo, pre_hi, T, n0, full_blk, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SAFE: tl.constexpr,
):
    """One key block's contribution to dQ. SAFE: the rerun of a query block that met a
    NaN/inf."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    rows_n = offs_n.to(tl.int64)
    k = tl.load(K_head + rows_n[:, None] * stride_kt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    vT = tl.load(V_head + rows_n[None, :] * stride_vt + offs_d[:, None], mask=key_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        vT = vT.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    if SAFE and not full_blk:
        # masked tiles of the rerun: masked dS entries exactly 0 (not 0 * NaN from a
        # non-finite v row), and a non-finite k row replaced by zeros in dS @ K (the rows
        # that see it have NaN scores for it, so NaN dS entries, already). Fully visible
        # tiles run the plain code below (every row is a reader).
        vis = _visible(own_lo, own_hi, pre_lo, pre_hi, offs_n)
        p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        dq = tl.dot(ds.to(k.dtype), tl.where(k - k == 0.0, k, 0.0), dq, input_precision=PREC)
    else:
        if not full_blk:
            p = tl.where(_visible(own_lo, own_hi, pre_lo, pre_hi, offs_n), p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    # one return after the branches: Triton 3.6 cannot lower a return inside a dynamic
    # `if` (full_blk is a runtime value) and fails the whole SAFE compile
    return dq


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
    own_lo, own_hi, pre_lo, pre_hi, row_ok, T, blk_lo, blk_hi, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    SKIP_EMPTY: tl.constexpr, SAFE: tl.constexpr,
):
    for nb in range(blk_lo, blk_hi):
        n0 = nb * BLOCK_N
        any_blk, full_blk = _block_class(own_lo, own_hi, pre_lo, pre_hi, row_ok, n0, BLOCK_N)
        if SKIP_EMPTY:
            if any_blk:
                dq = _bwd_dq_step(dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                                  own_lo, own_hi, pre_lo, pre_hi, T, n0, full_blk, qk_scale,
                                  BLOCK_N, HEAD_DIM, UPCAST, PREC, SAFE)
        else:
            dq = _bwd_dq_step(dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                              own_lo, own_hi, pre_lo, pre_hi, T, n0, full_blk, qk_scale,
                              BLOCK_N, HEAD_DIM, UPCAST, PREC, SAFE)
    return dq


@triton.jit
def _bwd_dq_pass(
    q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
    own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, a_uniform, b0, b1, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, SAFE: tl.constexpr,
):
    """All key blocks of a query block (as in the forward). Returns dQ / sm_scale."""
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if a_uniform:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                           own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, qk_scale,
                           BLOCK_N, HEAD_DIM, UPCAST, PREC, False, SAFE)
    else:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                           own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, qk_scale,
                           BLOCK_N, HEAD_DIM, UPCAST, PREC, True, SAFE)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                       own_lo, own_hi, pre_lo, pre_hi, row_ok, T, b0, tl.minimum(b1, a0), qk_scale,
                       BLOCK_N, HEAD_DIM, UPCAST, PREC, False, SAFE)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                       own_lo, own_hi, pre_lo, pre_hi, row_ok, T, tl.maximum(b0, a1), b1, qk_scale,
                       BLOCK_N, HEAD_DIM, UPCAST, PREC, False, SAFE)
    return dq


@triton.jit
def _bwd_dq_block(
    Q, K, V, DO, DQ, LSE, DELTA, SEG, PST, PEND, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    sm_scale, qk_scale,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr,
):
    """One (query block, query head): writes dQ; returns, per row, whether it is non-finite."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    own_lo, own_hi, pre_lo, pre_hi, row_ok = _row_meta(SEG, PST, PEND, offs_m, T, offs_m >= 0)
    rows_m = offs_m.to(tl.int64)
    q = tl.load(Q + h * stride_qh + rows_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + h * stride_doh + rows_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + h * T + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
    delta = tl.load(DELTA + h * T + offs_m, mask=row_ok, other=0.0)

    a0, a1, a_uniform, b0, b1 = _query_block_ranges(own_lo, own_hi, pre_lo, pre_hi, BLOCK_N)
    K_head = K + kvh * stride_kh
    V_head = V + kvh * stride_vh
    dq = _bwd_dq_pass(q, do, lse2, delta, K_head, V_head, stride_kt, stride_vt,
                      own_lo, own_hi, pre_lo, pre_hi, row_ok, T, a0, a1, a_uniform, b0, b1, qk_scale,
                      BLOCK_M, BLOCK_N, HEAD_DIM, UPCAST, PREC, SAFE)
    tl.store(DQ + h * stride_dqh + rows_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    return tl.sum(dq - dq, 1) != 0


# the GQA group is a runtime argument, never specialised (not even 1): it only picks the
# kv head, so one binary per configuration serves every group (and every model)
@triton.jit(do_not_specialize=["GROUP"])
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, SEG, PST, PEND, FLAGS, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    sm_scale, qk_scale,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr,
):
    # as in the forward: the plain launch flags rows with a non-finite dQ, the SAFE launch
    # redoes the query blocks holding one
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    flags = FLAGS + tl.program_id(1) * T + offs_m
    if SAFE:
        if tl.max(tl.load(flags, mask=offs_m < T, other=0), 0) != 0:
            _bwd_dq_block(Q, K, V, DO, DQ, LSE, DELTA, SEG, PST, PEND, T,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_dot, stride_doh, stride_dqt, stride_dqh, sm_scale, qk_scale,
                          GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, UPCAST, PREC, True)
    else:
        bad = _bwd_dq_block(Q, K, V, DO, DQ, LSE, DELTA, SEG, PST, PEND, T,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_dot, stride_doh, stride_dqt, stride_dqh, sm_scale, qk_scale,
                            GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, UPCAST, PREC, False)
        tl.store(flags, bad.to(tl.int8), mask=offs_m < T)


# --------------------------------------------------------------------------------------
# launch configuration
# --------------------------------------------------------------------------------------
def _make_prune(resident: str, n_acc: int, smem_factor: float = 1.0, spills=None, spills32=None):
    """Config pruner for one kernel. `resident` names the tile that stays put for the whole
    program ("M": queries, "N": keys); the other one streams through `num_stages` buffers.
    `n_acc` fp32 [resident, D] accumulators live in registers. `spills` / `spills32`:
    {head dim: set of (BLOCK_M, BLOCK_N, num_warps, num_stages)} measured to spill with
    16-bit / fp32 inputs. Candidates in `_FP32_ONLY` are offered to fp32 inputs only."""

    def prune(configs, named_args, **kwargs):
        def arg(name, default=None):
            return named_args.get(name, kwargs.get(name, default))

        d = arg("HEAD_DIM")
        q = arg("Q")
        elt = q.element_size() if q is not None else 2
        # dK/dV tiles stack the GQA group's heads: BLOCK_M must hold one row of each
        min_m = arg("GROUP_P2", 1) or 1
        keep = []
        for c in configs:
            bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
            res, stream = (bm, bn) if resident == "M" else (bn, bm)
            # H100/H200 give a block at most 227 KB of shared memory: resident tile(s) plus
            # num_stages buffered pairs of streamed tiles, times a factor fitted to what
            # Triton 3.9 allocates for sm_90 (the dK/dV kernel also stages P^T and dS^T)
            smem = smem_factor * (2 * res * d + c.num_stages * 2 * stream * d) * elt
            # keep fp32 accumulators at <= 128 registers per thread, else they spill. fp32
            # inputs run IEEE dots on the FMA units with operands in registers: count the
            # operand tiles too, x2 (roughly fitted to ptxas' sm_90 spills at D=16..128)
            regs = n_acc * res * d // (32 * c.num_warps)
            if elt == 4:
                operands = (res * (2 if resident == "N" else 1) + 2 * stream) * d
                regs = 2 * (n_acc * res * d + operands) // (32 * c.num_warps)
            # 16-bit inputs at D >= 64: the resident side is the M side of the kernel's
            # main dots; below 64 rows Hopper's warp-group MMA cannot run them, and such a
            # tile never beats one that can (it is only compiled, on the first call, to lose)
            wgmma_ok = elt == 4 or d < 64 or res >= 64
            # ... and a candidate whose plain launch ptxas spills at this head dim (with
            # Triton 3.6.0 or 3.9.0, at any GQA group) is dropped before tuning
            launch = (bm, bn, c.num_warps, c.num_stages)
            spilled = launch in ((spills if elt == 2 else spills32) or {}).get(d, ())
            other_dtype = elt != 4 and launch in _FP32_ONLY
            if smem <= 220 * 1024 and regs <= 128 and bm >= min_m and wgmma_ok and not spilled and not other_dtype:
                keep.append(c)
        if keep:
            return keep
        c = min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
        return [triton.Config({"BLOCK_M": max(c.kwargs["BLOCK_M"], min_m), "BLOCK_N": c.kwargs["BLOCK_N"]},
                              num_warps=c.num_warps, num_stages=c.num_stages)]

    return prune


def _cfgs(triples):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in triples
    ]


# H100/H200 candidates, in order of preference (the first one that passes the pruner is
# also the fixed choice when autotuning is off). Forward and dQ: query tiles of 128 rows
# stream key tiles of 32-64 (the FA2 sweet spot for D=64/128); smaller tiles remain for
# D=256 and fp32. dK/dV: a resident 64-128-key tile streams query tiles of 16-64 rows
# (rows x GQA heads). The order comes from compiling every candidate for sm_90a offline
# (Triton 3.6.0 and 3.9.0, no GPU at hand): at D=128 bf16 the first entry that survives
# the pruner is one ptxas fits in 255 registers without spilling (fwd 128x64/8 warps: 235
# registers with both; dK/dV 32x64/8 warps, 2 stages with 3.9, 1 stage with 3.6 (see
# _SPILLS_MEASURED); dQ 128x32/8 warps: 187-202). Timings on a real H100/H200 are still to
# be taken; the autotuner picks among the survivors there. The lists are short on
# purpose: every candidate costs a compile on first use.
_FWD_CONFIGS = _cfgs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2),
                      (32, 32, 4, 2), (16, 16, 4, 2)])
_BWD_KV_CONFIGS = _cfgs([(32, 64, 8, 2), (32, 64, 8, 1), (16, 64, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2),
                         (32, 64, 4, 3), (16, 32, 4, 2), (16, 16, 8, 1), (16, 16, 4, 2)])
_BWD_DQ_CONFIGS = _cfgs([(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2),
                         (16, 16, 4, 2)])
# The candidates whose plain launch spills registers on sm_90a with 16-bit inputs, per
# Triton release and head dim: measured by compiling every candidate with Triton 3.6.0
# and 3.9.0 at GQA groups 1/4/8 (tests/kernels/test_aot_matrix.py, which fails when a candidate
# the pruner keeps spills; a candidate that spills at any group is listed). The register
# estimate above cannot tell these from neighbours that fit (fwd 128x64 at 8 warps fits at
# D=128 with 235 registers, 64x64 at 4 warps spills 8 bytes with 3.9), and the two ptxas
# disagree (dK/dV 32x64 at 8 warps, 2 stages spills 48 bytes with 3.6 at D=128, groups
# 4/8, and fits with 3.9; with 1 stage the other way round): ptxas decides, its verdict is
# recorded. (The SAFE relaunch, which runs only for blocks that met a NaN/inf, may spill.)
_SPILLS_MEASURED = {
    (3, 6): {"fwd": {128: {(128, 128, 8, 2), (128, 64, 4, 3)}},
             "dkdv": {64: {(64, 64, 8, 2)},
                      128: {(64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 4, 3), (32, 64, 8, 2)}},
             "dq": {}},
    (3, 9): {"fwd": {64: {(128, 128, 8, 2), (128, 64, 4, 3)},
                     128: {(128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)}},
             "dkdv": {64: {(64, 64, 8, 2)},
                      128: {(64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 4, 3), (32, 64, 8, 1)}},
             "dq": {128: {(64, 64, 4, 3)}}},
}


# fp32 inputs: IEEE dots on the FMA units, where each thread holds its rows of both
# operands for the whole reduction (D long in S^T = K Q^T and dP^T = V dO^T), so the dK/dV
# kernel's 16x16 tiles spill on 4 warps (D=128: 1,308 bytes with Triton 3.6.0; D=64, group
# 1: 12 bytes with 3.9.0) and on 8 warps with 2 stages (D=128: 108 bytes with 3.9.0). They
# fit on 8 warps with one stage (170-236 registers): that candidate is offered to fp32 only
# (a 16-bit dK/dV tile at D >= 64 is never this small, see wgmma_ok). Measured with both
# Tritons at D=64/128, GQA groups 1/4/8 (tests/kernels/test_aot_matrix.py); one table for
# both releases.
_FP32_ONLY = {(16, 16, 8, 1)}
_SPILLS_FP32 = {"fwd": {}, "dkdv": {64: {(16, 16, 4, 2)}, 128: {(16, 16, 4, 2)}}, "dq": {}}


def _spills_for_this_triton():
    """The measured table of the Triton in use; for an unmeasured release, that of the
    nearest measured one not newer than it (the oldest measured below that)."""
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        version = max(_SPILLS_MEASURED)
    known = sorted(_SPILLS_MEASURED)
    older = [v for v in known if v <= version]
    return _SPILLS_MEASURED[older[-1] if older else known[0]]


_SPILLS = _spills_for_this_triton()
_FWD_PRUNE = _make_prune("M", 1, spills=_SPILLS["fwd"], spills32=_SPILLS_FP32["fwd"])
_BWD_KV_PRUNE = _make_prune("N", 2, smem_factor=1.5, spills=_SPILLS["dkdv"], spills32=_SPILLS_FP32["dkdv"])
_BWD_DQ_PRUNE = _make_prune("M", 1, spills=_SPILLS["dq"], spills32=_SPILLS_FP32["dq"])

# Autotuning (GPU only; it needs a driver) can be switched off with
# MEMOPD_TRITON_AUTOTUNE=0 or by setting this flag: the first surviving candidate is used.
AUTOTUNE = USE_AUTOTUNE
# Test hook: launch parameters (BLOCK_M, BLOCK_N, num_warps, num_stages) forced on every
# launch, which also bypasses autotuning. In the interpreter only the block sizes matter.
_FIXED: dict = {}

# per kernel: (kernel, candidates, pruner, the tuner's key, what its trial runs must
# re-zero: DQ is accumulated with atomics)
_TUNED_KERNELS = {
    "fwd": (_fwd_kernel, _FWD_CONFIGS, _FWD_PRUNE, ["HEAD_DIM", "GROUP", "PREC"], None),
    "dkdv": (_bwd_dkdv_kernel, _BWD_KV_CONFIGS, _BWD_KV_PRUNE, ["HEAD_DIM", "GROUP", "GROUP_P2", "PREC", "ATOMIC_DQ"],
             ["DQ"]),
    "dq": (_bwd_dq_kernel, _BWD_DQ_CONFIGS, _BWD_DQ_PRUNE, ["HEAD_DIM", "GROUP", "PREC"], None),
}
_TUNERS: dict = {}


def _tuner(kind: str, T: int):
    """The autotuner of kernel `kind` for a stream of T tokens, or None where nothing is
    tuned (interpreter, AUTOTUNE off, parameters forced through _FIXED). One autotuner per
    kernel and size class of T (`tuning_bucket`), since the tuners' own keys name the
    model's sizes only: the first call's T must not decide the tiles for every later one."""
    if INTERPRET or not AUTOTUNE or _FIXED:
        return None
    bucket = tuning_bucket(T)
    if (kind, bucket) not in _TUNERS:
        fn, configs, prune, key, reset = _TUNED_KERNELS[kind]
        _TUNERS[kind, bucket] = autotuned(fn, configs, key, name=f"{fn.__name__}[T<={bucket}]", prune=prune,
                                          reset_to_zero=reset)
    return _TUNERS[kind, bucket]


def _pick(raw, tuned, configs, prune, q, group_p2=1):
    """(kernel, launch kwargs) for one launch: the autotuner `tuned` (`_tuner`'s answer), or
    where that is None (interpreter, AUTOTUNE off, or forced through _FIXED) the raw kernel
    with fixed parameters. group_p2: the smallest BLOCK_M the kernel accepts (dK/dV tiles
    stack the GQA group's heads)."""
    if INTERPRET:
        return raw, {"BLOCK_M": max(_FIXED.get("BLOCK_M", _INTERP_BLOCK), group_p2),
                     "BLOCK_N": _FIXED.get("BLOCK_N", _INTERP_BLOCK)}
    if tuned is not None:
        return tuned, {}
    c = prune(configs, {"HEAD_DIM": q.shape[-1], "Q": q, "GROUP_P2": group_p2})[0]
    params = {"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_N": c.kwargs["BLOCK_N"],
              "num_warps": c.num_warps, "num_stages": c.num_stages}
    params.update(_FIXED)
    params["BLOCK_M"] = max(params["BLOCK_M"], group_p2)
    return raw, params


def _grid(T, heads, block_key):
    return lambda meta: (triton.cdiv(T, meta[block_key]), heads)


def _launch_with_rerun(raw, kernel, params, T, heads, block_key, args, consts, grid=None, n_flags=None):
    """The plain launch, then the SAFE launch of the same kernel over the same programs
    (same configuration, autotuned or not), which redoes exactly the blocks the plain launch
    flagged as having met a NaN/inf ("Non-finite inputs" in the module docstring). `args`:
    the kernel's arguments before FLAGS, then those after it. grid / n_flags: for a kernel
    whose programs are not (blocks of T, heads), its grid and the size of its flag buffer."""
    before, after = args
    # every element the SAFE launch reads is written by the plain launch
    flags = torch.empty(n_flags if n_flags is not None else (heads, T), dtype=torch.int8, device=before[0].device)
    grid = grid if grid is not None else _grid(T, heads, block_key)
    kernel[grid](*before, flags, *after, **consts, SAFE=False, **params)
    if kernel is not raw:  # autotuned: rerun with the configuration it just used
        params = kernel.best_config.all_kwargs()
    raw[grid](*before, flags, *after, **consts, SAFE=True, **params)


# --------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------
def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError for inputs the kernels do not support (shapes checked elsewhere)."""
    D = q.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"Triton packed attention supports head dims {SUPPORTED_HEAD_DIMS}; got {D} "
            "(use backend='torch' for other sizes)"
        )
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"Triton packed attention supports float16, bfloat16 and float32; got {q.dtype}")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "Triton packed attention got CPU tensors but TRITON_INTERPRET=1 was not set when "
            "memopd.kernels.packed_attention was imported; use backend='torch' on CPU"
        )


def _meta_arrays(seg_start, prefix_start, prefix_end, device):
    out = []
    for name, a in (("seg_start", seg_start), ("prefix_start", prefix_start), ("prefix_end", prefix_end)):
        if a.device != device:
            raise ValueError(f"metadata {name} is on {a.device}, the tensors on {device}")
        out.append(a.to(torch.int32).contiguous())
    return out


def _flags(dtype):
    return upcast(dtype), dot_precision(dtype)


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
    mode this module was imported in; the cost model asks for the GPU's). spread: the
    pieces per kv head over which the work may spread at most (`dkdv_split_plan`)."""
    if INTERPRET if interpreted is None else interpreted:
        bn, bm = _FIXED.get("BLOCK_N", _INTERP_BLOCK), _FIXED.get("BLOCK_M", _INTERP_BLOCK)
    else:
        bn = max([c.kwargs["BLOCK_N"] for c in _BWD_KV_CONFIGS] + [_FIXED.get("BLOCK_N", 0)])
        bm = max([c.kwargs["BLOCK_M"] for c in _BWD_KV_CONFIGS] + [_FIXED.get("BLOCK_M", 0)])
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
    clamped to the piece's window, as `_bwd_kv_pass` computes them. For the cost model and
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
    a0)), [max(b0, a1), b1) as `_query_block_ranges` computes them. For the cost model."""
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


def _reduce_partials(part, dk, dv, plan, T, Hkv, D, sm_scale):
    """Sum the split key blocks' fp32 partials into dK/dV (`_bwd_kv_reduce_kernel`)."""
    block_r = min(32, plan.block_n)
    grid = (triton.cdiv(T, block_r), Hkv, 2)
    _bwd_kv_reduce_kernel[grid](part, dk, dv, plan.reduce, T, Hkv, plan.reduce.shape[1], plan.block_n,
                                dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), sm_scale,
                                HEAD_DIM=D, BLOCK_R=block_r, num_warps=4, num_stages=3)


def _contig(x):
    return x if x.is_contiguous() else x.contiguous()


def packed_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg_start: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_end: torch.Tensor,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
):
    """Forward kernel. Returns (out [T, Hq, D] in q's dtype, lse [Hq, T] fp32, natural log;
    -inf on rows that see nothing). `out`, if given, is written in place (every element)."""
    check_triton_inputs(q, k, v)
    q, k, v = _contig(q), _contig(k), _contig(v)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    ss, ps, pe = _meta_arrays(seg_start, prefix_start, prefix_end, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}")
    lse = torch.empty((Hq, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    upcast, prec = _flags(q.dtype)
    kernel, params = _pick(_fwd_kernel, _tuner("fwd", T), _FWD_CONFIGS, _FWD_PRUNE, q)
    _launch_with_rerun(
        _fwd_kernel, kernel, params, T, Hq, "BLOCK_M",
        ((q, k, v, out, lse, ss, ps, pe),
         (T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
          out.stride(0), out.stride(1), scale * LOG2E)),
        dict(GROUP=Hq // Hkv, HEAD_DIM=D, UPCAST=upcast, PREC=prec),
    )
    return out, lse


def packed_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    seg_start: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_end: torch.Tensor,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    key_ranges: torch.Tensor | None = None,
    split_plan: DkdvPlan | None = None,
):
    """Backward kernels. Returns (dq, dk, dv) in the inputs' dtype.

    deterministic=False: dQ accumulated with fp32 atomics inside the dK/dV kernel.
    deterministic=True: no atomics anywhere; a second, query-major kernel writes dQ.
    dq/dk/dv, if given, are output buffers (every element is written; used by tests).
    key_ranges: `key_query_ranges` of this metadata, if the caller keeps it (it depends on
    the metadata only, so every layer's backward can share one); computed here if None.
    split_plan: `dkdv_split_plan(key_ranges, *dkdv_plan_spec(Hkv, sm_count(device)))` of
    this metadata, likewise
    (the op caches it on the metadata); computed here if None.
    """
    check_triton_inputs(q, k, v)
    q, k, v, o, do = _contig(q), _contig(k), _contig(v), _contig(o), _contig(do)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    ss, ps, pe = _meta_arrays(seg_start, prefix_start, prefix_end, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    for name, buf, ref in (("dk", dk, k), ("dv", dv, v)):
        if buf.shape != ref.shape or buf.dtype != ref.dtype or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {tuple(ref.shape)} {ref.dtype} tensor")
    if deterministic:
        dq = torch.empty_like(q) if dq is None else dq
        if dq.shape != q.shape or dq.dtype != q.dtype or not dq.is_contiguous():
            raise ValueError(f"dq must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
        dq_acc = dq
    else:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if T == 0:
        return (dq_acc.to(q.dtype) if dq is None else dq), dk, dv

    # delta_i = sum_d dO_i * O_i, the softmax-backward row term, [Hq, T] fp32
    delta = (o.float() * do.float()).sum(-1).transpose(0, 1).contiguous()
    lse = lse.float().contiguous()
    kqr = key_query_ranges(ss, ps, pe) if key_ranges is None else key_ranges
    if kqr.shape != (5, T) or kqr.dtype != torch.int32 or kqr.device != q.device or not kqr.is_contiguous():
        raise ValueError(f"key_ranges must be the contiguous int32 [5, {T}] key_query_ranges of this metadata "
                         f"on {q.device}; got {kqr.dtype} {tuple(kqr.shape)} on {kqr.device}")
    spec = dkdv_plan_spec(Hkv, sm_count(q.device))
    plan = dkdv_split_plan(kqr, *spec) if split_plan is None else split_plan
    if not isinstance(plan, DkdvPlan) or plan.spec != spec or plan.T != T or plan.table.device != q.device:
        raise ValueError(f"split_plan must be the dkdv_split_plan of this metadata for {spec} on {q.device}")
    upcast, prec = _flags(q.dtype)
    group = Hq // Hkv
    group_p2 = triton.next_power_of_2(group)
    kernel, params = _pick(_bwd_dkdv_kernel, _tuner("dkdv", T), _BWD_KV_CONFIGS, _BWD_KV_PRUNE, q, group_p2)
    plan_n, align_m = spec[0], spec[1]

    def grid(meta):
        rows = meta["BLOCK_M"] // group_p2
        if plan_n % meta["BLOCK_N"] or rows < 1 or align_m % rows:
            raise ValueError(f"dK/dV tiles BLOCK_N={meta['BLOCK_N']}, BLOCK_M={meta['BLOCK_M']} do not divide the "
                             f"split plan's {plan_n} keys / {align_m} query rows")
        programs = plan.n_pieces * (plan_n // meta["BLOCK_N"])
        if programs > 65535:
            raise ValueError(f"{T} tokens need {programs} dK/dV programs per kv head, past the grid's limit of 65535")
        return (Hkv, programs)

    # fp32 partial sums of the split key blocks: [slots, dK / dV, Hkv, plan_n, D]
    part = torch.empty((max(plan.n_slots, 1), 2, Hkv, plan_n, D), dtype=torch.float32, device=q.device)
    _launch_with_rerun(
        _bwd_dkdv_kernel, kernel, params, T, Hkv, "BLOCK_N",
        ((q, k, v, do, dq_acc, dk, dv, part, lse, delta, ss, ps, pe, kqr, plan.table),
         (T, Hkv, plan.n_pieces, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
          do.stride(0), do.stride(1), dq_acc.stride(0), dq_acc.stride(1),
          dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), scale, scale * LOG2E)),
        dict(GROUP=group, GROUP_P2=group_p2, HEAD_DIM=D, PLAN_N=plan_n, UPCAST=upcast, PREC=prec,
             ATOMIC_DQ=not deterministic),
        grid=grid, n_flags=plan.n_pieces * plan_n * Hkv,
    )
    if plan.n_slots:
        _reduce_partials(part, dk, dv, plan, T, Hkv, D, scale)
    if deterministic:
        kernel, params = _pick(_bwd_dq_kernel, _tuner("dq", T), _BWD_DQ_CONFIGS, _BWD_DQ_PRUNE, q)
        _launch_with_rerun(
            _bwd_dq_kernel, kernel, params, T, Hq, "BLOCK_M",
            ((q, k, v, do, dq_acc, lse, delta, ss, ps, pe),
             (T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              do.stride(0), do.stride(1), dq_acc.stride(0), dq_acc.stride(1), scale, scale * LOG2E)),
            dict(GROUP=group, HEAD_DIM=D, UPCAST=upcast, PREC=prec),
        )
        return dq_acc, dk, dv
    if dq is not None:
        dq.copy_(dq_acc)
        return dq, dk, dv
    return dq_acc.to(q.dtype), dk, dv
