"""The Triton kernels of packed attention (block-diagonal causal segments + shared prefix + GQA):
forward, dK/dV with the sum of its split blocks' partials, and the deterministic dQ.

Forward and backward of softmax attention over a packed stream of T tokens whose mask is
given as O(T) metadata (`memopd.layout.AttentionMeta`): key j is visible to query i iff

    seg_start[i] <= j <= i   or   prefix_start[i] <= j < prefix_end[i].

No dense mask and no position ids ever reach the kernels. Layout: q `[T, Hq, D]`,
k/v `[T, Hkv, D]` with Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv)).

Forward (`fwd_kernel`), one program per (query block, query head): the rows'
metadata give two key ranges — the union of the rows' prefix intervals and the own-segment
range [min seg_start, max i] — and the program walks only the key blocks of those ranges
(each block once, even when the ranges overlap). Inside the ranges a block no row sees is
skipped, a block every row sees fully runs without an element mask, and only edge blocks are
element-masked. Rows that see nothing give zeros and LSE = -inf, never NaN.

Backward (`bwd_dkdv_kernel`, `bwd_kv_reduce_kernel`, `bwd_dq_kernel`), FA2 style:
  * dK/dV: one program per (key block, kv head), or per piece of one (the split below).
    Its query tiles stack the GQA group's query heads (tile rows = query rows x heads), so
    one pass sums dK/dV over the group in registers, deterministically. It walks only the
    query blocks that can see the key block: those ranges come from an O(T) per-key
    precomputation (`attention_plan.key_query_ranges`: vectorised torch ops on the
    device, no host sync; the op keeps one per metadata, `key_ranges`).
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
    fp32 partial dK/dV into slots of their own, which `bwd_kv_reduce_kernel` sums in slot
    order (fixed: bitwise reproducible; against the unsplit kernel only the order of that
    fp32 sum differs); unsplit blocks write dK/dV directly as before. Only blocks above
    1.5x the average are split, and no piece is made smaller than a quarter of one SM's
    share of the total work (the plan, its bounds and MEMOPD_ATTENTION_SPLIT:
    `memopd.kernels.attention_plan`).
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

The launchers (`memopd.kernels.packed_attention`) pick the tiles (`memopd.kernels.attention_tuning`)
and build the host-side plan (`memopd.kernels.attention_plan`); interpreter, autotuning and
dot-precision policy come from `memopd.kernels.runtime`; Triton compatibility and what has
been checked on which hardware: docs/design.md §6.1 and §8.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .runtime import LOG2E, helper

__all__ = ["fwd_kernel", "bwd_dkdv_kernel", "bwd_kv_reduce_kernel", "bwd_dq_kernel"]

# The "no range" sentinel of integer min-reductions inside the kernels: far above any
# token index, far below 2^31. Constexprs: compiled Triton reads only those as globals.
_NO_RANGE = tl.constexpr(1 << 30)
# The kernels work in base 2: scores are scaled by softmax_scale * LOG2E, the stored LSE is
# natural log (base-2 LSE * LN2) and is read back into base 2 (* LOG2E).
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(LOG2E)


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
def fwd_kernel(
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
    `bwd_kv_reduce_kernel`), and adds to dQ. Returns, per key row, the flag for the SAFE
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
def bwd_dkdv_kernel(
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
def bwd_kv_reduce_kernel(
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
def bwd_dq_kernel(
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

