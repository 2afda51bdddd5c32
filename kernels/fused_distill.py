"""Triton kernels of the fused linear distillation op (reverse KL / forward KL / JSD)
and of its teacher-less mode (student log-prob + entropy).

The public, validated, dispatching wrapper is `memopd.ops.fused_distill`; this module
only holds the kernels and thin launchers that assume validated, contiguous inputs.

Layout of the work (N tokens, V true vocabulary, Hs / Ht hidden sizes):

* Masked-out tokens are never computed. The wrapper passes `order`, a permutation that
  puts the kept rows first (a stable argsort of ~keep, made on the device), and
  `count`, the number of kept rows as a 1-element device tensor. Programs whose whole
  token block lies at or beyond `count` run their loops zero times (the loop bound is
  read from device memory), so nothing is synchronised with the host.
* Forward (`_distill_fwd_kernel`): grid (token blocks of BLOCK_N kept tokens) x
  (vocabulary splits), splits fastest, so that the hidden rows of the resident
  programs stay in L2 (`fwd_program_block`). Each program loops over its split in BLOCK_V tiles, computes
  the student and the teacher logits tile with `tl.dot` (fp32 accumulation), and folds
  each tile into fp32 online statistics per token: running maxima and sum-exps of both
  distributions, the entropy sum, the target logit, the expectation of d = s - t
  under the student (or the teacher), and a *joint-max* sum of exp(s) - exp(t)
  written as exp(t)·expm1(d). That last sum gives lse_s - lse_t = log1p(ΔZ / Z_t)
  with relative precision even when the teacher equals the student up to noise,
  which is where the textbook "E_p[s] - lse_s - E_p[t] + lse_t" form loses everything
  to cancellation. The vocabulary split exists for occupancy: with N = 4096 and
  BLOCK_N = 64 there are only 64 token blocks for 132 SMs, so the vocabulary is cut
  into enough splits for ~4 programs per SM; the partial statistics are merged
  log-sum-exp style by a few device-side torch ops (`merge_partials`), and the
  per-token outputs are finalised by the same code as the PyTorch path.
  The generalised JSD needs log(β q + (1-β) p) per entry, i.e. normalised
  distributions, so it runs a second kernel (`_jsd_pass_kernel`, same grid) once
  both log-sum-exps are known.
* Backward, per chunk of TOKEN_CHUNK kept tokens (bounded scratch of
  TOKEN_CHUNK × V, never N × V):
  - `_distill_dlogits_kernel` (2-D grid over token blocks × vocab tiles) recomputes the
    logit tiles with `tl.dot` and writes dL/dlogits into the scratch;
  - `dh_kernel` computes dH = dlogits @ W_s and writes each token's row directly at
    its original index (masked rows get zeros);
  - `dw_kernel` (one program per vocab block × hidden block, hidden blocks fastest so
    that the programs reading one scratch slab run together) accumulates
    dW += dlogits^T @ H into an fp32 buffer. Each output tile is owned by one program
    and the token loop runs in a fixed order: deterministic, no atomics.
  A fully recomputing backward that keeps dH in registers is only possible when the
  hidden size is small (like flash-attention's head dim); with H = 2048..4096 the
  dH / dW accumulators do not fit, and re-reading them from global memory once per
  vocabulary tile costs far more than one bf16 scratch write, hence the scratch.
* Gradients in the forward (the default for a reduced loss, `gradients="forward"`):
  `memopd.kernels.distill_rows` writes both logits chunks to fp32 scratch, a row
  kernel computes the statistics and dL/dlogits in place, then the same dH / dW GEMMs
  run in the forward: 4 lm-head-sized matmuls against the 6 of `distill_forward` +
  `distill_backward` here, which stay the path of `gradients="recompute"`. Both use the
  divergence math of this module (`dlse_terms`, `jsd_kl_terms`, `dlogits_terms`).
* Teacher-less mode (`memopd.ops.fused_linear_logprob_entropy`: student log-prob and
  entropy only, like verl's fused linear-for-PPO): the launchers take `ht = wt = bt =
  None` and pass dummy pointers; the forward kernel's HAS_TEACHER=False constexpr
  compiles out the teacher tile matmul, its online statistics and the joint-max sums
  (one [BLOCK_N, BLOCK_V] tile live instead of two, hence larger tiles in its
  autotune list), and the backward runs with HAS_GDIV=False, which already compiles
  out the teacher tile of `_distill_dlogits_kernel`.

Written for H100/H200: bf16 (or fp16) tiles into `tl.dot`, fp32 accumulation, BLOCK
sizes 64..128; autotuning, dot precision and the interpreter's upcast follow
`memopd.kernels.runtime`; the logits tile, the dH / dW GEMMs and the row compaction are
shared with the actor loss (`memopd.kernels.lm_head_tiles`). Statistic rows, partial rows
and divergence codes are those of `memopd.kernels.contract`. Only plain pointer arithmetic is used (no block pointers) so the
same source runs on Triton 3.4 .. 3.9.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .contract import DistillParams, DistillStat, Divergence, LinearHead, Partial, head_tensors
from .lm_head_tiles import (
    compaction,
    default_token_chunk,
    expm1_small,
    gemm_meta,
    launch_dh,
    launch_dw,
    log1p_small,
    logits_tile,
    new_scratch,
)
from .runtime import INTERPRET, NEG, USE_AUTOTUNE, autotuned, dot_precision, or_dummy, tuning_bucket, upcast

# Protocol values as constexprs: compiled Triton reads only constexpr globals in kernels.
REVERSE_KL = tl.constexpr(int(Divergence.REVERSE_KL))
FORWARD_KL = tl.constexpr(int(Divergence.FORWARD_KL))
LSE_S = tl.constexpr(int(DistillStat.LSE_S))
LSE_T = tl.constexpr(int(DistillStat.LSE_T))
DLSE = tl.constexpr(int(DistillStat.DLSE))
AUX = tl.constexpr(int(DistillStat.AUX))
ENTROPY = tl.constexpr(int(DistillStat.ENTROPY))
NUM_PART = len(Partial)
_P_M_S = tl.constexpr(int(Partial.M_S))
_P_Z_S = tl.constexpr(int(Partial.Z_S))
_P_A_S = tl.constexpr(int(Partial.A_S))
_P_M_T = tl.constexpr(int(Partial.M_T))
_P_Z_T = tl.constexpr(int(Partial.Z_T))
_P_E_D = tl.constexpr(int(Partial.E_D))
_P_M_J = tl.constexpr(int(Partial.M_J))
_P_ZT_J = tl.constexpr(int(Partial.ZT_J))
_P_DZ_J = tl.constexpr(int(Partial.DZ_J))
_P_S_Y = tl.constexpr(int(Partial.S_Y))


# ----------------------------------------------------------------------------------
# JSD numerics (expm1_small / log1p_small: memopd.kernels.lm_head_tiles)
# ----------------------------------------------------------------------------------
@triton.jit
def _jsd_u(delta, beta):
    # u = log(beta + (1 - beta) * exp(delta)) = lm - lt, with delta = ls - lt.
    # Small |delta|: log1p((1-beta) * expm1(delta)) keeps the O(delta) precision that the
    # JSD of two close distributions needs; large |delta|: the direct forms cannot
    # overflow because the exponent is always <= 0.
    small = tl.abs(delta) < 0.5
    d_small = tl.where(small, delta, 0.0)
    u_small = log1p_small((1.0 - beta) * expm1_small(d_small))
    pos = delta > 0.0
    d_pos = tl.where(pos, delta, 0.0)
    d_neg = tl.where(pos, 0.0, delta)
    u_pos = d_pos + tl.log((1.0 - beta) + beta * tl.exp(-d_pos))
    u_neg = tl.log(beta + (1.0 - beta) * tl.exp(d_neg))
    return tl.where(small, u_small, tl.where(pos, u_pos, u_neg))


# ----------------------------------------------------------------------------------
# divergence math shared by the tile kernels here and the row kernel of
# `memopd.kernels.distill_rows`: elementwise over a [BLOCK_N, BLOCK_V] tile (per-token
# values passed as [BLOCK_N, 1] columns) or over a [BLOCK_V] piece of one row (per-token
# values passed as scalars). s, t are logits / T.
# ----------------------------------------------------------------------------------
@triton.jit
def dlse_terms(es, et, d, c_s, c_t):
    """(e^{t - M}, e^{s - M} - e^{t - M}) at a joint max M, from es = e^{s - m_s},
    et = e^{t - m_t}, d = s - t, c_s = e^{m_s - M}, c_t = e^{m_t - M}. The difference is
    et·expm1(d) where |d| is small, so its sum gives lse_s - lse_t = log1p(ΣΔ / Σe^{t-M})
    with relative precision when the teacher is the student up to noise."""
    eS = es * c_s
    eT = et * c_t
    small = tl.abs(d) < 0.5
    return eT, tl.where(small, eT * expm1_small(tl.where(small, d, 0.0)), eS - eT)


@triton.jit
def jsd_kl_terms(s, t, lse_s, lse_t, dlse, beta, valid):
    """Per entry, the terms of KL(p || M) and KL(q || M) (M = beta q + (1 - beta) p), from
    the log-sum-exps and the precise dlse = lse_s - lse_t; 0 where not `valid`."""
    p = tl.where(valid, tl.exp(s - lse_s), 0.0)
    q = tl.where(valid, tl.exp(t - lse_t), 0.0)
    delta = tl.where(valid, (s - t) - dlse, 0.0)
    u = _jsd_u(delta, beta)
    return p * (delta - u), q * (-u)


@triton.jit
def dlogits_terms(s, t, is_y, valid, lse_s, lse_t, dlse, aux, ent, g_lp, g_h, g_d, beta,
                   DIV: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, HAS_GDIV: tl.constexpr):
    """dL/ds for L = Σ g_lp·logprob + g_h·entropy + g_d·divergence (each term present only
    where its HAS_* is set; `t` is read only with HAS_GDIV), 0 where not `valid`."""
    ls = s - lse_s
    p = tl.where(valid, tl.exp(ls), 0.0)
    acc = p * 0.0
    if HAS_GLP:
        acc += g_lp * (tl.where(is_y, 1.0, 0.0) - p)
    if HAS_GENT:
        acc -= g_h * p * tl.where(valid, ls + ent, 0.0)
    if HAS_GDIV:
        delta = tl.where(valid, (s - t) - dlse, 0.0)
        if DIV == REVERSE_KL:
            # d KL(p||q) / ds_v = p_v * ((ls_v - lt_v) - KL)
            acc += g_d * p * (delta - aux)
        elif DIV == FORWARD_KL:
            # d KL(q||p) / ds_v = p_v - q_v = -p_v expm1(-δ_v): relative precision when
            # q ~ p; the plain difference where |δ| is large (no cancellation, no overflow)
            q = tl.where(valid, tl.exp(t - lse_t), 0.0)
            small = tl.abs(delta) < 0.5
            acc += g_d * tl.where(small, -p * expm1_small(-tl.where(small, delta, 0.0)), p - q)
        else:
            # d JSD / ds_v = (1 - beta) * p_v * ((ls_v - lm_v) - KL(p||M))
            u = _jsd_u(delta, beta)
            acc += ((1.0 - beta) * g_d) * p * ((delta - u) - aux)
    return acc


# ----------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------
@triton.jit
def fwd_program_block(pid, n_split):
    """(token block, vocabulary split) of program `pid` of the forward's 1-D grid
    (`fwd_grid`): vocabulary splits fastest.

    Each program re-reads its token block's hidden rows (BLOCK_N x (Hs + Ht)) once per
    vocabulary tile, so the rows of all resident programs must stay in L2. With token
    blocks fastest the ~132 resident programs held ~132 different blocks (~95 MB at Hs
    2048 + Ht 3584, BLOCK_N 64: more than the 50 MB L2) and those re-reads streamed from
    HBM; with splits fastest they hold 132 / splits blocks (`_num_splits` keeps those
    within FWD_L2_BYTES), and the resident programs of one split still share each weight
    tile. Every program computes what it computed before, so the outputs are unchanged
    bit for bit. Plain integer arithmetic, evaluable on the host through
    `fwd_program_block.fn`."""
    return pid // n_split, pid % n_split


@triton.jit
def _distill_fwd_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr, order_ptr, count_ptr, part_ptr,
    N, Hs, Ht, V, v_per_split, n_split, stride_hs, stride_ws, stride_ht, stride_wt, inv_temp,
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, DIV: tl.constexpr, UPCAST: tl.constexpr,
    PREC_S: tl.constexpr, PREC_T: tl.constexpr, HAS_TEACHER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Online statistics of one token block over one vocabulary split.

    Grid: token blocks x splits in the order of `fwd_program_block`. Splitting
    the vocabulary keeps every SM busy when N is small (N = 4096 gives only 64 token
    blocks of 64); the per-split partial statistics are merged afterwards (log-sum-exp
    style, on the device).

    HAS_TEACHER=False is the teacher-less op (log-prob + entropy only): the teacher
    tile, its statistics and the joint-max sums are compiled out, the teacher pointers
    are unused dummies, and only rows m_s, z_s, a_s, s_y of `part` are written.
    """
    pid, pid_s = fwd_program_block(tl.program_id(0), n_split)
    count = tl.load(count_ptr)
    pos = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = pos < N
    row_ok = pos < count
    rows = tl.load(order_ptr + pos, mask=in_range, other=0)
    rows64 = rows.to(tl.int64)
    y = tl.load(tgt_ptr + rows64, mask=row_ok, other=-1).to(tl.int32)
    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    # Whole block masked out: every loop below runs zero times (no host sync needed).
    active = pid * BLOCK_N < count
    v_end = tl.where(active, v_hi, v_lo)
    ks_end = tl.where(active, Hs, 0)
    kt_end = tl.where(active, Ht, 0)

    m_s = tl.full([BLOCK_N], NEG, tl.float32)   # running max of s
    z_s = tl.zeros([BLOCK_N], tl.float32)        # sum exp(s - m_s)
    a_s = tl.zeros([BLOCK_N], tl.float32)        # sum exp(s - m_s) * (s - m_s)  (entropy)
    m_t = tl.full([BLOCK_N], NEG, tl.float32)
    z_t = tl.zeros([BLOCK_N], tl.float32)
    e_d = tl.zeros([BLOCK_N], tl.float32)        # sum exp(s - m_s) * d  (reverse, JSD) or
                                                 # sum exp(t - m_t) * d  (forward)
    m_j = tl.full([BLOCK_N], NEG, tl.float32)   # joint max of s and t
    zt_j = tl.zeros([BLOCK_N], tl.float32)       # sum exp(t - m_j)
    dz_j = tl.zeros([BLOCK_N], tl.float32)       # sum exp(s - m_j) - exp(t - m_j)
    s_y = tl.zeros([BLOCK_N], tl.float32)

    for v0 in range(v_lo, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        valid = col_ok[None, :]
        # Student tile first, folded into the student-only sums before the teacher tile
        # is computed: only the shifted tile `sc` stays live across the teacher's K-loop.
        s = logits_tile(hs_ptr, ws_ptr, bs_ptr, rows64, row_ok, cols, col_ok, Hs, stride_hs,
                         stride_ws, ks_end, HAS_BS, UPCAST, PREC_S, BLOCK_N, BLOCK_V, BLOCK_K)
        s = tl.where(valid, s * inv_temp, NEG)
        s_y += tl.sum(tl.where(cols[None, :] == y[:, None], s, 0.0), axis=1)
        m_s_new = tl.maximum(m_s, tl.max(s, axis=1))
        alpha_s = tl.exp(m_s - m_s_new)
        sc = s - m_s_new[:, None]            # <= 0; about -1e30 on padded columns
        es = tl.exp(sc)                      # exactly 0 on padded columns
        a_s = alpha_s * (a_s + (m_s - m_s_new) * z_s) + tl.sum(es * tl.where(valid, sc, 0.0), axis=1)
        z_s = alpha_s * z_s + tl.sum(es, axis=1)

        if HAS_TEACHER:
            t = logits_tile(ht_ptr, wt_ptr, bt_ptr, rows64, row_ok, cols, col_ok, Ht, stride_ht,
                             stride_wt, kt_end, HAS_BT, UPCAST, PREC_T, BLOCK_N, BLOCK_V, BLOCK_K)
            t = tl.where(valid, t * inv_temp, NEG)
            m_t_new = tl.maximum(m_t, tl.max(t, axis=1))
            alpha_t = tl.exp(m_t - m_t_new)
            tc = t - m_t_new[:, None]
            et = tl.exp(tc)
            z_t = alpha_t * z_t + tl.sum(et, axis=1)

            # d = s - t from the shifted tiles (0 on padded columns)
            d = tl.where(valid, (sc - tc) + (m_s_new - m_t_new)[:, None], 0.0)
            es = tl.exp(sc)  # recomputed rather than kept live across the teacher dot
            if DIV == FORWARD_KL:
                e_d = alpha_t * e_d + tl.sum(et * d, axis=1)
            else:
                e_d = alpha_s * e_d + tl.sum(es * d, axis=1)

            # joint-max difference of the two normalisers, precise where d is small
            m_j_new = tl.maximum(m_s_new, m_t_new)
            r_j = tl.exp(m_j - m_j_new)
            eT, g = dlse_terms(es, et, d, tl.exp(m_s_new - m_j_new)[:, None], tl.exp(m_t_new - m_j_new)[:, None])
            zt_j = r_j * zt_j + tl.sum(eT, axis=1)
            dz_j = r_j * dz_j + tl.sum(g, axis=1)
            m_t = m_t_new
            m_j = m_j_new

        m_s = m_s_new

    # part[Partial row, split, token]
    base = part_ptr + pid_s * N + rows64
    step = n_split * N
    tl.store(base + _P_M_S * step, m_s, mask=in_range)
    tl.store(base + _P_Z_S * step, z_s, mask=in_range)
    tl.store(base + _P_A_S * step, a_s, mask=in_range)
    if HAS_TEACHER:
        tl.store(base + _P_M_T * step, m_t, mask=in_range)
        tl.store(base + _P_Z_T * step, z_t, mask=in_range)
        tl.store(base + _P_E_D * step, e_d, mask=in_range)
        tl.store(base + _P_M_J * step, m_j, mask=in_range)
        tl.store(base + _P_ZT_J * step, zt_j, mask=in_range)
        tl.store(base + _P_DZ_J * step, dz_j, mask=in_range)
    tl.store(base + _P_S_Y * step, s_y, mask=in_range)


@triton.jit
def _jsd_pass_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, order_ptr, count_ptr, stats_ptr, part_ptr,
    N, Hs, Ht, V, v_per_split, n_split, stride_hs, stride_ws, stride_ht, stride_wt, inv_temp, beta,
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, UPCAST: tl.constexpr,
    PREC_S: tl.constexpr, PREC_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Second JSD pass: partial KL(p || M) and KL(q || M) per split, once lse_s, lse_t are
    known. Grid and program order: those of the forward (`fwd_program_block`)."""
    pid, pid_s = fwd_program_block(tl.program_id(0), n_split)
    count = tl.load(count_ptr)
    pos = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = pos < N
    row_ok = pos < count
    rows = tl.load(order_ptr + pos, mask=in_range, other=0)
    rows64 = rows.to(tl.int64)
    lse_s = tl.load(stats_ptr + LSE_S * N + rows64, mask=row_ok, other=0.0)
    lse_t = tl.load(stats_ptr + LSE_T * N + rows64, mask=row_ok, other=0.0)
    dlse = tl.load(stats_ptr + DLSE * N + rows64, mask=row_ok, other=0.0)
    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    active = pid * BLOCK_N < count
    v_end = tl.where(active, v_hi, v_lo)
    kl_pm = tl.zeros([BLOCK_N], tl.float32)
    kl_qm = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(v_lo, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        valid = col_ok[None, :]
        s = logits_tile(hs_ptr, ws_ptr, bs_ptr, rows64, row_ok, cols, col_ok, Hs, stride_hs,
                         stride_ws, Hs, HAS_BS, UPCAST, PREC_S, BLOCK_N, BLOCK_V, BLOCK_K)
        t = logits_tile(ht_ptr, wt_ptr, bt_ptr, rows64, row_ok, cols, col_ok, Ht, stride_ht,
                         stride_wt, Ht, HAS_BT, UPCAST, PREC_T, BLOCK_N, BLOCK_V, BLOCK_K)
        pm, qm = jsd_kl_terms(s * inv_temp, t * inv_temp, lse_s[:, None], lse_t[:, None], dlse[:, None], beta, valid)
        kl_pm += tl.sum(pm, axis=1)
        kl_qm += tl.sum(qm, axis=1)
    base = part_ptr + pid_s * N + rows64
    tl.store(base, kl_pm, mask=in_range)
    tl.store(base + n_split * N, kl_qm, mask=in_range)


# ----------------------------------------------------------------------------------
# backward: dlogits tiles into a bounded scratch, then two deterministic GEMMs
# ----------------------------------------------------------------------------------
@triton.jit
def _distill_dlogits_kernel(
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, tgt_ptr, order_ptr, count_ptr, stats_ptr,
    gdiv_ptr, glp_ptr, gent_ptr, out_ptr,
    N, Hs, Ht, V, c0, n_rows, stride_hs, stride_ws, stride_ht, stride_wt, stride_out,
    inv_temp, beta,
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, DIV: tl.constexpr, UPCAST: tl.constexpr,
    PREC_S: tl.constexpr, PREC_T: tl.constexpr,
    HAS_GDIV: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    count = tl.load(count_ptr)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = c0 + local
    in_chunk = local < n_rows
    row_ok = in_chunk & (pos < count)
    rows = tl.load(order_ptr + pos, mask=in_chunk, other=0)
    rows64 = rows.to(tl.int64)
    active = c0 + pid_n * BLOCK_N < count
    ks_end = tl.where(active, Hs, 0)
    kt_end = tl.where(active, Ht, 0)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    valid = col_ok[None, :]

    s = logits_tile(hs_ptr, ws_ptr, bs_ptr, rows64, row_ok, cols, col_ok, Hs, stride_hs,
                     stride_ws, ks_end, HAS_BS, UPCAST, PREC_S, BLOCK_N, BLOCK_V, BLOCK_K)
    s = s * inv_temp
    lse_s = tl.load(stats_ptr + LSE_S * N + rows64, mask=row_ok, other=0.0)
    # per-token values a term does not use stay these zeros (compiled out with the term)
    zero = tl.zeros([BLOCK_N], dtype=tl.float32)
    g_lp, y, g_h, ent, g_d, dlse, aux, lse_t = zero, zero.to(tl.int32) - 1, zero, zero, zero, zero, zero, zero
    t = s
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        y = tl.load(tgt_ptr + rows64, mask=row_ok, other=-1).to(tl.int32)
    if HAS_GENT:
        g_h = tl.load(gent_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        ent = tl.load(stats_ptr + ENTROPY * N + rows64, mask=row_ok, other=0.0)
    if HAS_GDIV:
        g_d = tl.load(gdiv_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        t = logits_tile(ht_ptr, wt_ptr, bt_ptr, rows64, row_ok, cols, col_ok, Ht, stride_ht,
                         stride_wt, kt_end, HAS_BT, UPCAST, PREC_T, BLOCK_N, BLOCK_V, BLOCK_K)
        t = t * inv_temp
        dlse = tl.load(stats_ptr + DLSE * N + rows64, mask=row_ok, other=0.0)
        aux = tl.load(stats_ptr + AUX * N + rows64, mask=row_ok, other=0.0)
        if DIV == FORWARD_KL:
            lse_t = tl.load(stats_ptr + LSE_T * N + rows64, mask=row_ok, other=0.0)
    acc = dlogits_terms(s, t, cols[None, :] == y[:, None], valid, lse_s[:, None], lse_t[:, None], dlse[:, None],
                         aux[:, None], ent[:, None], g_lp[:, None], g_h[:, None], g_d[:, None], beta,
                         DIV, HAS_GLP, HAS_GENT, HAS_GDIV)
    ds = tl.where(valid & row_ok[:, None], acc * inv_temp, 0.0)
    out = out_ptr + local.to(tl.int64)[:, None] * stride_out + cols[None, :]
    # the whole padded scratch row: ds is 0 past V, and a stride-bounded mask keeps the
    # store vectorised for an odd V (lm_head_tiles: scratch layout)
    tl.store(out, ds.to(out_ptr.dtype.element_ty), mask=in_chunk[:, None] & (cols < stride_out)[None, :])


# ----------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------
def _cfg(bn, bv, bk, warps, stages):
    return triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk},
                         num_warps=warps, num_stages=stages)


# Two [BLOCK_N, BLOCK_V] fp32 tiles (student, teacher) plus the online statistics are
# live at once, which bounds the tiles by register spills: a 128x128 tile is offered only
# to the KL dlogits kernel, the JSD (three-way log/exp per entry) needs 8 warps on 64x64
# tiles or narrower, and fp32 "ieee" dots need small tiles. The sm_90 resource checks
# behind these lists are in docs/design.md §6.2.
_KL16_CONFIGS = [
    _cfg(64, 64, 64, 4, 3),
    _cfg(64, 64, 64, 8, 3),
    _cfg(64, 128, 64, 8, 3),
    _cfg(128, 64, 64, 8, 3),
    _cfg(64, 128, 64, 8, 4),
]
_JSD16_CONFIGS = [
    _cfg(64, 64, 64, 8, 3),
    _cfg(64, 64, 32, 8, 3),
    _cfg(32, 128, 64, 8, 3),
    _cfg(64, 64, 64, 8, 4),
]
# fp32 heads: exact ("ieee") dots run on the FMA units, each thread holding its rows of
# both operands for the whole BLOCK_K beside two fp32 logits tiles, so the tiles are half
# the 16-bit ones: 8 logits per thread and tile (64x32 or 32x64 over 8 warps, 32x32 over
# 4). 64x64 / 8 warps, the earlier first choice, spilled in the teacher forward (96 bytes
# with Triton 3.6.0, 28 with 3.9.0), as did 32x64 / 4 warps (116 / 28). 64x32 comes first:
# the forward's token block stays 64 rows, so the weight (the tensor read from DRAM) is
# streamed no more often than before; the hidden rows it re-reads twice as often sit in L2.
_FP32_CONFIGS = [
    _cfg(64, 32, 32, 8, 2),
    _cfg(32, 64, 32, 8, 2),
    _cfg(32, 32, 32, 4, 2),
]
# The teacher-less forward (HAS_TEACHER=False) keeps one tile live, so 128x128 fits
# without spilling and the larger tiles are offered.
_LPE16_FWD_CONFIGS = _KL16_CONFIGS + [
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
]


# 16-bit candidates that ptxas spills on sm_90a with Triton 3.6.0 or 3.9.0 at the
# production lm-head shapes (V=151,936 / 151,665, H=2048 / 3584), per (kernel, variant):
# measured by tests/kernels/test_aot_matrix.py, which fails when a listed candidate spills; they
# are dropped before any autotuner sees them. (BLOCK_N, BLOCK_V, BLOCK_K, warps, stages)
_SPILLS16 = {
    ("fwd", "teacher"): {(64, 64, 64, 4, 3), (128, 64, 64, 8, 3)},
    ("jsd", "jsd"): {(32, 128, 64, 8, 3)},
    ("dlogits", "reverse_kl"): {(128, 128, 64, 8, 3)},
}
# The same for the fp32 candidates: the JSD pass (three exp/log per entry) spills on 8
# warps (64x32: 56 / 32 bytes with 3.9.0 / 3.6.0; 32x64: 16 with 3.6.0) and runs 32x32 / 4.
_SPILLS32 = {
    ("jsd", "jsd"): {(64, 32, 32, 8, 2), (32, 64, 32, 8, 2)},
}


def _variant(kind: str, divergence: int, has_teacher: bool) -> str:
    if not has_teacher:
        return "no-teacher"
    if kind == "fwd":
        return "teacher"
    return Divergence(divergence).name.lower()


def _configs(kind: str, divergence: int, fp32: bool, has_teacher: bool = True):
    """The autotune candidates of one kernel variant, in order of preference (the first
    one is the fixed choice when autotuning is off), spilling ones removed."""
    if fp32:
        cfgs, spills = _FP32_CONFIGS, _SPILLS32.get((kind, _variant(kind, divergence, has_teacher)), ())
        return [c for c in cfgs if _key(c) not in spills]
    if kind == "fwd" and not has_teacher:
        cfgs = _LPE16_FWD_CONFIGS
    elif kind == "fwd":  # the forward kernel is the same for every divergence
        cfgs = _KL16_CONFIGS
    elif divergence == Divergence.JSD:  # the JSD pass and the JSD dlogits
        cfgs = _JSD16_CONFIGS
    elif kind == "dlogits" and divergence == Divergence.REVERSE_KL:
        cfgs = _KL16_CONFIGS + [_cfg(128, 128, 64, 8, 3)]
    else:
        cfgs = _KL16_CONFIGS
    spills = _SPILLS16.get((kind, _variant(kind, divergence, has_teacher)), ())
    return [c for c in cfgs if _key(c) not in spills]


def _key(c) -> tuple:
    """(BLOCK_N, BLOCK_V, BLOCK_K, warps, stages) of a candidate, as the spill tables list it."""
    return c.kwargs["BLOCK_N"], c.kwargs["BLOCK_V"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages


_LOSS_INTERP = dict(BLOCK_N=32, BLOCK_V=64, BLOCK_K=32)

_KERNELS = {"fwd": _distill_fwd_kernel, "jsd": _jsd_pass_kernel, "dlogits": _distill_dlogits_kernel}
_KEYS = {"fwd": ["Hs", "Ht", "V", "DIV", "HAS_TEACHER"],
         "jsd": ["Hs", "Ht", "V"],
         "dlogits": ["Hs", "Ht", "V", "DIV", "HAS_GDIV", "HAS_GLP", "HAS_GENT"]}
_TUNERS = {}


def _launcher(kind: str, divergence: int, fp32: bool, has_teacher: bool = True, rows: int = 0):
    """(kernel or autotuner, explicit meta-parameters) for one kernel variant launched over
    `rows` token rows. The candidates are pruned (`_configs`: spilling ones never reach a
    tuner); one autotuner per variant and size class of the rows (`tuning_bucket`), since
    the tuners' own keys name the model's sizes only."""
    if INTERPRET:
        return _KERNELS[kind], dict(_LOSS_INTERP)
    cfgs = _configs(kind, divergence, fp32, has_teacher)
    if not USE_AUTOTUNE:
        c = cfgs[0]
        return _KERNELS[kind], dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    bucket = tuning_bucket(rows)
    name = (kind, divergence, fp32, has_teacher, bucket)
    if name not in _TUNERS:
        label = (f"{_KERNELS[kind].__name__}[{Divergence(divergence).name.lower()}"
                 f"{'' if has_teacher else ',no-teacher'}{',fp32' if fp32 else ''},rows<={bucket}]")
        _TUNERS[name] = autotuned(_KERNELS[kind], cfgs, _KEYS[kind], name=label)
    return _TUNERS[name], {}


def _num_splits(N: int, V: int, device, row_bytes: int = 0) -> int:
    """Vocabulary splits of the forward grid: ~4 programs per SM, and at least enough that
    the hidden rows of one wave of programs (one per SM, each BLOCK_N = 64 token rows of
    `row_bytes`, the fixed tile's) fit FWD_L2_BYTES in the splits-fastest order of
    `fwd_program_block`; >= 1024 columns each. Up to N = 16k at Qwen2.5-3B / 7B sizes the
    first rule decides (3 splits at 16k); past it the second keeps the forward's
    re-reads of the hidden rows in L2."""
    env = os.environ.get("MEMOPD_DISTILL_SPLITS")
    if env:
        return max(1, int(env))
    if INTERPRET:
        return min(3, triton.cdiv(V, 128))  # small, but exercises the merge
    try:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    except Exception:  # noqa: BLE001 no queryable device (e.g. the interpreter): an H100/H200's count
        sms = 132
    want = triton.cdiv(4 * sms, triton.cdiv(N, 64))
    wave_fits = triton.cdiv(sms * 64 * row_bytes, FWD_L2_BYTES)
    return max(1, min(max(want, wave_fits), triton.cdiv(V, 1024)))


def hidden_row_bytes(student: LinearHead, teacher: Optional[LinearHead]) -> int:
    """Bytes of one token's hidden rows, both heads (what a forward program re-reads)."""
    return sum(h.shape[1] * h.element_size() for h in (student.hidden, None if teacher is None else teacher.hidden)
               if h is not None)


def _split_plan(N: int, V: int, device, row_bytes: int = 0):
    splits = _num_splits(N, V, device, row_bytes)
    # multiple of 128 so that no tile straddles two splits for any BLOCK_V <= 128
    per = triton.cdiv(triton.cdiv(V, splits), 128) * 128
    return triton.cdiv(V, per), per


# Bytes of hidden rows the resident forward programs may keep in L2 (of an H100/H200's
# 50 MB; the rest is left to the weight tiles in flight).
FWD_L2_BYTES = 32 << 20


def fwd_grid(N: int, splits: int, meta: dict) -> tuple:
    """Launch grid of the forward and JSD-pass kernels: every (token block, split) once."""
    return (triton.cdiv(N, meta["BLOCK_N"]) * splits,)


def merge_partials(part: torch.Tensor, divergence: int, has_teacher: bool = True):
    """Merge [NUM_PART, splits, N] partial statistics into [NUM_PART, N] (device ops only).

    has_teacher=False: only the student rows (m_s, z_s, a_s, s_y) were written by the
    kernel; the teacher rows of the result are zeros.
    """
    m_s, z_s, a_s, m_t, z_t, e_d, m_j, zt_j, dz_j, s_y = part.unbind(0)  # rows in `Partial` order
    M_s = m_s.amax(0)
    w_s = torch.exp(m_s - M_s)
    if not has_teacher:
        zero = torch.zeros_like(M_s)
        return torch.stack([M_s, (w_s * z_s).sum(0), (w_s * (a_s + (m_s - M_s) * z_s)).sum(0),
                            zero, zero, zero, zero, zero, zero, s_y.sum(0)])
    M_t = m_t.amax(0)
    w_t = torch.exp(m_t - M_t)
    M_j = m_j.amax(0)
    w_j = torch.exp(m_j - M_j)
    return torch.stack([
        M_s, (w_s * z_s).sum(0), (w_s * (a_s + (m_s - M_s) * z_s)).sum(0),
        M_t, (w_t * z_t).sum(0), ((w_t if divergence == Divergence.FORWARD_KL else w_s) * e_d).sum(0),
        M_j, (w_j * zt_j).sum(0), (w_j * dz_j).sum(0), s_y.sum(0),
    ])


def _pointers(student: LinearHead, teacher: Optional[LinearHead]) -> tuple:
    """The six head pointers (hs, ws, bs, ht, wt, bt) of a kernel call. Absent tensors (a
    bias, or the whole teacher of the teacher-less op) become stand-ins the kernels never
    dereference (their HAS_* constexprs are False)."""
    hs, ws, bs = head_tensors(student)
    ht, wt, bt = head_tensors(teacher)
    ht, wt = or_dummy(ht, hs), or_dummy(wt, ws)
    return hs, ws, or_dummy(bs, ws), ht, wt, or_dummy(bt, wt)


def _precision_flags(hs: torch.Tensor, ht: torch.Tensor, *more: torch.dtype) -> dict:
    return dict(UPCAST=upcast(hs.dtype, ht.dtype, *more), PREC_S=dot_precision(hs.dtype),
                PREC_T=dot_precision(ht.dtype))


def distill_forward(student: LinearHead, teacher: Optional[LinearHead], targets: torch.Tensor,
                    keep: torch.Tensor, params: DistillParams) -> torch.Tensor:
    """Launch the fused forward. Returns the merged online statistics [NUM_PART, N] fp32
    (rows: `Partial`).

    The per-token outputs are finalised from these by `memopd.ops.fused_distill` (the same
    code as its PyTorch path); the JSD then needs `jsd_second_pass`. `teacher` None runs
    the teacher-less kernel: only the student rows of the result are meaningful.
    """
    has_teacher = teacher is not None
    hs, ws, bs, ht, wt, bt = _pointers(student, teacher)
    N = hs.shape[0]
    V = params.vocab_size
    dev = hs.device
    if N == 0:
        return torch.zeros((NUM_PART, 0), device=dev, dtype=torch.float32)
    order, count = compaction(keep)
    splits, per = _split_plan(N, V, dev, hidden_row_bytes(student, teacher))
    part = torch.empty((NUM_PART, splits, N), device=dev, dtype=torch.float32)
    fp32 = hs.dtype == torch.float32 or ht.dtype == torch.float32
    launch, meta = _launcher("fwd", params.divergence, fp32, has_teacher, rows=N)
    launch[lambda m: fwd_grid(N, splits, m)](
        hs, ws, bs, ht, wt, bt, targets, order, count, part,
        N, hs.shape[1], ht.shape[1], V, per, splits,
        hs.stride(0), ws.stride(0), ht.stride(0), wt.stride(0), 1.0 / params.temperature,
        HAS_BS=student.bias is not None, HAS_BT=has_teacher and teacher.bias is not None,
        DIV=int(params.divergence), HAS_TEACHER=has_teacher, **_precision_flags(hs, ht), **meta,
    )
    return part[:, 0] if splits == 1 else merge_partials(part, params.divergence, has_teacher)


def jsd_second_pass(student: LinearHead, teacher: LinearHead, keep: torch.Tensor, stats: torch.Tensor,
                    params: DistillParams) -> torch.Tensor:
    """KL(p||M) and KL(q||M) per token ([2, N] fp32) from `stats`, whose first rows are
    DistillStat.LSE_S, LSE_T and DLSE."""
    hs, ws, bs, ht, wt, bt = _pointers(student, teacher)
    N = hs.shape[0]
    V = params.vocab_size
    dev = hs.device
    if N == 0:
        return torch.zeros((2, 0), device=dev, dtype=torch.float32)
    order, count = compaction(keep)
    splits, per = _split_plan(N, V, dev, hidden_row_bytes(student, teacher))
    part = torch.empty((2, splits, N), device=dev, dtype=torch.float32)
    fp32 = hs.dtype == torch.float32 or ht.dtype == torch.float32
    launch, meta = _launcher("jsd", Divergence.JSD, fp32, rows=N)
    launch[lambda m: fwd_grid(N, splits, m)](
        hs, ws, bs, ht, wt, bt, order, count, stats, part,
        N, hs.shape[1], ht.shape[1], V, per, splits,
        hs.stride(0), ws.stride(0), ht.stride(0), wt.stride(0), 1.0 / params.temperature, float(params.beta),
        HAS_BS=student.bias is not None, HAS_BT=teacher.bias is not None, **_precision_flags(hs, ht), **meta,
    )
    return part.sum(1)


def distill_backward(grads: tuple, student: LinearHead, teacher: Optional[LinearHead], targets: torch.Tensor,
                     keep: torch.Tensor, stats: torch.Tensor, params: DistillParams, need: tuple) -> tuple:
    """Launch the backward. `grads` = (g_div, g_lp, g_ent) ([N] fp32 or None), `need` =
    (need_dh, need_dw, need_db). Returns (dh, dw, db); entries not needed are None.

    Teacher-less op: `teacher` and `g_div` are None (the teacher tile of the dlogits kernel
    is compiled out by HAS_GDIV=False).
    """
    g_div, g_lp, g_ent = grads
    need_dh, need_dw, need_db = need
    if teacher is None:
        assert g_div is None, "the teacher-less op has no divergence gradient"
    hs, ws, bs, ht, wt, bt = _pointers(student, teacher)
    vocab_size, token_chunk = params.vocab_size, params.token_chunk
    bias_dtype = ws.dtype if student.bias is None else student.bias.dtype
    N, Hs = hs.shape
    V_full = ws.shape[0]
    dev = hs.device
    dh = torch.empty_like(hs) if need_dh else None
    # fp32 accumulation of dW across token chunks; rows of padded columns stay zero.
    dw32 = torch.zeros((V_full, Hs), device=dev, dtype=torch.float32) if need_dw else None
    db32 = torch.zeros(V_full, device=dev, dtype=torch.float32) if need_db else None
    if N == 0 or not (need_dh or need_dw or need_db) or (g_div is None and g_lp is None and g_ent is None):
        if dh is not None:
            dh.zero_()
        return (dh, None if dw32 is None else dw32.to(ws.dtype),
                None if db32 is None else db32.to(bias_dtype))
    order, count = compaction(keep)
    scratch_dtype = ws.dtype if ws.dtype in (torch.bfloat16, torch.float16) else torch.float32
    elem = torch.empty((), dtype=scratch_dtype).element_size()
    chunk = token_chunk if token_chunk and token_chunk > 0 else default_token_chunk(N, vocab_size, elem)
    chunk = min(chunk, N)
    scratch = new_scratch(chunk, vocab_size, scratch_dtype, dev)
    fp32 = hs.dtype == torch.float32 or ht.dtype == torch.float32
    launch, meta = _launcher("dlogits", params.divergence, fp32, rows=chunk)
    gm = gemm_meta(scratch_dtype == torch.float32)
    flags = _precision_flags(hs, ht, scratch_dtype)
    gemm_prec = dot_precision(scratch_dtype)
    for c0 in range(0, N, chunk):
        n_rows = min(chunk, N - c0)
        grid = lambda m, n_rows=n_rows: (triton.cdiv(n_rows, m["BLOCK_N"]), triton.cdiv(vocab_size, m["BLOCK_V"]))  # noqa: E731
        launch[grid](
            hs, ws, bs, ht, wt, bt,
            targets, order, count, stats,
            or_dummy(g_div, stats), or_dummy(g_lp, stats), or_dummy(g_ent, stats), scratch,
            N, Hs, ht.shape[1], vocab_size, c0, n_rows,
            hs.stride(0), ws.stride(0), ht.stride(0), wt.stride(0), scratch.stride(0),
            1.0 / params.temperature, float(params.beta),
            HAS_BS=student.bias is not None, HAS_BT=teacher is not None and teacher.bias is not None,
            DIV=int(params.divergence), **flags,
            HAS_GDIV=g_div is not None, HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None,
            **meta,
        )
        if need_dh:
            launch_dh(scratch, ws, order, count, dh, vocab_size, c0, n_rows, flags["UPCAST"], gemm_prec, gm)
        if need_dw:
            launch_dw(scratch, hs, order, count, dw32, vocab_size, c0, n_rows, flags["UPCAST"], gemm_prec, gm)
        if need_db:
            # rows of masked tokens are zero in the scratch; torch's sum is deterministic
            db32[:vocab_size] += scratch[:n_rows, :vocab_size].sum(0, dtype=torch.float32)
    dw = None
    if need_dw:
        dw = dw32 if ws.dtype == torch.float32 else dw32.to(ws.dtype)
    db = None
    if need_db:
        db = db32 if bias_dtype == torch.float32 else db32.to(bias_dtype)
    return dh, dw, db
