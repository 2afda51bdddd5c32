"""Triton path of the fused distillation op with its gradients taken in the forward
(`memopd.ops.fused_linear_distill(..., gradients="forward")` on the Triton back end):
the same outputs as `memopd.ops.distill_torch.torch_forward_with_grads`, on the actor
loss's design (`memopd.kernels.actor_loss`).

Per chunk of kept tokens (the device-side compaction of `memopd.kernels.lm_head_tiles`:
kept rows first, their count read by the kernels, no host sync):

1. `scaled_logits_kernel` writes the student logits / T, and with a teacher the
   teacher's, as fp32 [chunk, V] scratch (rows padded to the 64-element stride, the
   padding zero): one lm-head-sized matmul per head.
2. `_distill_rows_kernel`, one program per token, sweeps its row(s): the sums, folded
   online with running maxima (normalisers, entropy sum, target logit, the expectation
   of s - t, and the joint-max sum that gives lse_s - lse_t with relative precision
   where p ≈ q); for the JSD a second sweep for KL(p‖M) and KL(q‖M); then, with the
   per-token outputs known, it writes dL/dlogits (zeros past V and for masked tokens)
   and the outputs and `DistillStat` rows at the token's own index.
3. dH = dlogits @ W and dW += dlogits^T @ H, db = Σ rows, through the actor loss's
   `ChunkGradients` (`memopd.kernels.lm_head_tiles`): dL/dlogits goes to a scratch of
   the head's 16-bit dtype, rounded as the GEMMs would round it (into the student's
   fp32 scratch in place for fp32 heads or a bias gradient), and dH is split over the
   vocabulary where a chunk's grid would leave SMs idle.

So a training call is 4 lm-head-sized matmuls with a teacher (3 without) and the
backward only scales the stored gradients; the recomputing path (`distill_forward` +
`distill_backward` of `memopd.kernels.fused_distill`) does 6 (4). The loss is given by
per-token gradient weights known before the call, (g_div, g_lp, g_ent), each [N] fp32
or None: L = Σ g_div·divergence + g_lp·logprob + g_ent·entropy (the distillation op's
reduced loss is g_div = 1 / n_kept or 1). The divergence math is the tile kernels'
(`dlse_terms`, `jsd_kl_terms`, `dlogits_terms` of `memopd.kernels.fused_distill`).
Scratch: two fp32 buffers of MEMOPD_DISTILL_SCRATCH_MB (default 512 MiB) each, or
`token_chunk` rows, plus a half-size 16-bit gradient buffer; never [N, V].
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .contract import DistillParams, DistillStat, LinearHead

# the divergence math and the DistillStat / Divergence constexprs of the tile kernels
from .fused_distill import (
    AUX,
    DLSE,
    ENTROPY,
    FORWARD_KL,
    LSE_S,
    LSE_T,
    REVERSE_KL,
    dlogits_terms,
    dlse_terms,
    jsd_kl_terms,
)
from .lm_head_tiles import (
    ChunkGradients,
    compaction,
    default_token_chunk,
    launch_scaled_logits,
    log1p_small,
    new_scratch,
    store_grad_piece,
)
from .runtime import INTERPRET, NEG, or_dummy


@triton.jit
def _distill_rows_kernel(
    s_ptr, t_ptr, g_ptr, tgt_ptr, order_ptr, count_ptr, gdiv_ptr, glp_ptr, gent_ptr, div_ptr, lp_ptr, stats_ptr,
    N, V, c0, stride_s, stride_t, stride_g, inv_temp, beta,
    DIV: tl.constexpr, HAS_TEACHER: tl.constexpr, HAS_GDIV: tl.constexpr, HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr, NEED_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    idx = c0 + r
    count = tl.load(count_ptr)
    active = idx < count
    row = tl.load(order_ptr + idx).to(tl.int64)
    srow = s_ptr + r.to(tl.int64) * stride_s
    trow = t_ptr + r.to(tl.int64) * stride_t
    y = tl.load(tgt_ptr + row).to(tl.int32)
    v_end = tl.where(active, V, 0)  # a masked token's program skips the statistics sweeps
    offs = tl.arange(0, BLOCK_V)
    # Loads are bounded by the padded row stride, so they stay 16-byte vectors for any V;
    # the padding holds zeros, so sums mask only what 0 would not leave out (exp), maxima
    # mask it to NEG.
    # sweep 1: the sums, folded online (running maxima, as in the tile kernel's forward);
    # the maxima are scalars of the row, so each rescaling is one scalar exp per piece
    neg = tl.max(tl.full([BLOCK_V], NEG, tl.float32), 0)  # an fp32 scalar (loop-carried below)
    ms = neg  # running max of s
    mt = neg  # ... of t
    mj = neg  # ... of both
    z_s = tl.zeros([BLOCK_V], tl.float32)   # Σ e^{s - ms}
    a_s = tl.zeros([BLOCK_V], tl.float32)   # Σ e^{s - ms} (s - ms)       (entropy)
    s_y = tl.zeros([BLOCK_V], tl.float32)   # target logit
    z_t = tl.zeros([BLOCK_V], tl.float32)   # Σ e^{t - mt}
    e_d = tl.zeros([BLOCK_V], tl.float32)   # Σ e^{s - ms} d (reverse KL) or Σ e^{t - mt} d (forward), d = s - t
    dz_j = tl.zeros([BLOCK_V], tl.float32)  # Σ e^{s - mj} - e^{t - mj}, precise where d is small
    for v0 in range(0, v_end, BLOCK_V):
        cols = v0 + offs
        ok = cols < V
        s = tl.load(srow + cols, mask=cols < stride_s, other=0.0)
        ms_new = tl.maximum(ms, tl.max(tl.where(ok, s, NEG), 0))
        alpha_s = tl.exp(ms - ms_new)
        sc = s - ms_new
        es = tl.where(ok, tl.exp(sc), 0.0)
        a_s = alpha_s * (a_s + (ms - ms_new) * z_s) + es * sc
        z_s = alpha_s * z_s + es
        s_y += tl.where(cols == y, s, 0.0)  # an out-of-range target finds nothing, as in the tile kernel
        if HAS_TEACHER:
            t = tl.load(trow + cols, mask=cols < stride_t, other=0.0)
            mt_new = tl.maximum(mt, tl.max(tl.where(ok, t, NEG), 0))
            alpha_t = tl.exp(mt - mt_new)
            et = tl.where(ok, tl.exp(t - mt_new), 0.0)
            z_t = alpha_t * z_t + et
            d = tl.where(ok, s - t, 0.0)  # straight from the two logits: exact where s ≈ t
            if DIV == FORWARD_KL:
                e_d = alpha_t * e_d + et * d
            elif DIV == REVERSE_KL:
                e_d = alpha_s * e_d + es * d
            mj_new = tl.maximum(ms_new, mt_new)
            _eT, g = dlse_terms(es, et, d, tl.exp(ms_new - mj_new), tl.exp(mt_new - mj_new))
            dz_j = tl.exp(mj - mj_new) * dz_j + g
            mt = mt_new
            mj = mj_new
        ms = ms_new
    c_t = tl.exp(mt - mj)  # Σ e^{t - mj} = c_t z_t
    # per-token outputs (a masked token's program stores zeros)
    zs = tl.where(active, tl.sum(z_s, 0), 1.0)
    log_zs = tl.log(zs)
    lse_s = tl.where(active, ms + log_zs, 0.0)
    ent = tl.where(active, log_zs - tl.sum(a_s, 0) / zs, 0.0)
    lp = tl.where(active, tl.sum(s_y, 0) - lse_s, 0.0)
    lse_t = 0.0
    dlse = 0.0
    aux = 0.0
    div = 0.0
    if HAS_TEACHER:
        zt = tl.where(active, tl.sum(z_t, 0), 1.0)
        lse_t = tl.where(active, mt + tl.log(zt), 0.0)
        # lse_s - lse_t = log1p(ΣΔ / Σ e^{t - mj}) where that ratio is small, else the plain
        # difference (also when the teacher mass underflowed at the joint max: NaN / inf)
        ratio = tl.sum(dz_j, 0) / (c_t * zt)
        near = tl.abs(ratio) < 0.5
        dlse = tl.where(active, tl.where(near, log1p_small(tl.where(near, ratio, 0.0)), lse_s - lse_t), 0.0)
        if DIV == REVERSE_KL:
            aux = tl.sum(e_d, 0) / zs - dlse
            div = tl.maximum(aux, 0.0)
        elif DIV == FORWARD_KL:
            aux = dlse - tl.sum(e_d, 0) / zt
            div = tl.maximum(aux, 0.0)
        else:
            # sweep 2 (JSD): KL(p || M) and KL(q || M), normalised distributions needed
            kl_pm = tl.zeros([BLOCK_V], tl.float32)
            kl_qm = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, v_end, BLOCK_V):
                cols = v0 + offs
                s = tl.load(srow + cols, mask=cols < stride_s, other=0.0)
                t = tl.load(trow + cols, mask=cols < stride_t, other=0.0)
                pm, qm = jsd_kl_terms(s, t, lse_s, lse_t, dlse, beta, cols < V)
                kl_pm += pm
                kl_qm += qm
            aux = tl.sum(kl_pm, 0)
            div = tl.maximum(beta * tl.sum(kl_qm, 0) + (1.0 - beta) * aux, 0.0)
        aux = tl.where(active, aux, 0.0)
        div = tl.where(active, div, 0.0)
    tl.store(div_ptr + row, div)
    tl.store(lp_ptr + row, lp)
    tl.store(stats_ptr + LSE_S * N + row, lse_s)
    tl.store(stats_ptr + LSE_T * N + row, lse_t)
    tl.store(stats_ptr + DLSE * N + row, dlse)
    tl.store(stats_ptr + AUX * N + row, aux)
    tl.store(stats_ptr + ENTROPY * N + row, ent)
    if NEED_GRAD:
        # last sweep: dL/dlogits over the student row, into the gradient scratch (the
        # student's own row in place, or a 16-bit one: `ChunkGradients`). Every program
        # writes its whole padded row (the GEMMs and the bias sum read it): a masked
        # token's row becomes zeros without its logits being read.
        g_d = 0.0
        g_lp = 0.0
        g_h = 0.0
        if HAS_GDIV:
            g_d = tl.load(gdiv_ptr + row).to(tl.float32)
        if HAS_GLP:
            g_lp = tl.load(glp_ptr + row).to(tl.float32)
        if HAS_GENT:
            g_h = tl.load(gent_ptr + row).to(tl.float32)
        grow = g_ptr + r.to(tl.int64) * stride_g
        s_lim = tl.where(active, stride_s, 0)  # a masked token's row is not read
        t_lim = tl.where(active, stride_t, 0)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            ok = cols < V
            s = tl.load(srow + cols, mask=cols < s_lim, other=0.0)
            t = s
            if HAS_GDIV:
                t = tl.load(trow + cols, mask=cols < t_lim, other=0.0)
            acc = dlogits_terms(s, t, cols == y, ok, lse_s, lse_t, dlse, aux, ent, g_lp, g_h, g_d, beta,
                                 DIV, HAS_GLP, HAS_GENT, HAS_GDIV)
            store_grad_piece(grow, cols, tl.where(ok & active, acc * inv_temp, 0.0), stride_g)


def rows_block(V: int) -> int:
    """BLOCK_V of `_distill_rows_kernel`: one program streams one row (memory-bound
    sweeps, no tl.dot). 1024-wide pieces over 8 warps give each thread 4 fp32 values of
    each live vector, one 16-byte access, and at most 80 registers on sm_90a, so three
    programs share an SM; 2048-wide ones spilled in the JSD variant with Triton 3.6's
    ptxas and needed ~100-140 registers elsewhere. A multiple of 64, so the sweeps cover
    the whole padded row."""
    return 64 if INTERPRET else min(1024, max(64, triton.next_power_of_2(min(V, 1024))))


ROWS_LAUNCH = {} if INTERPRET else dict(num_warps=8, num_stages=1)


def chunk_rows(N: int, V: int, token_chunk: int = 0) -> int:
    """Token rows per chunk of the fp32 logits scratch: `token_chunk` when given, else
    MEMOPD_DISTILL_SCRATCH_MB per buffer (`default_token_chunk` at 4-byte elements)."""
    rows = token_chunk if token_chunk and token_chunk > 0 else default_token_chunk(N, V, 4)
    return max(1, min(rows, N))


def distill_forward_with_grads(grads: tuple, student: LinearHead, teacher: Optional[LinearHead], targets: torch.Tensor,
                               keep: torch.Tensor, params: DistillParams, need: tuple) -> tuple:
    """The outputs and the loss's gradients in one sweep: (divergence, logprobs, entropy,
    stats [len(DistillStat), N], dh, dw, db), each fp32 [N] / the inputs' dtypes, None
    where not needed: the contract of `torch_forward_with_grads`.

    `grads` = (g_div, g_lp, g_ent), each [N] fp32 (the loss's per-token weights) or None;
    the teacher-less op (`teacher` None) has no divergence, so g_div must be None there.
    `need` = (need_dh, need_dw, need_db).
    """
    g_div, g_lp, g_ent = grads
    if teacher is None:
        assert g_div is None, "the teacher-less op has no divergence gradient"
    need_dh, need_dw, need_db = need
    hs, ws, bs = student.hidden, student.weight, student.bias
    V = params.vocab_size
    N, Hs = hs.shape
    dev = hs.device
    div = torch.zeros(N, device=dev, dtype=torch.float32)
    lp = torch.zeros(N, device=dev, dtype=torch.float32)
    stats = torch.zeros((len(DistillStat), N), device=dev, dtype=torch.float32)
    dh = torch.empty_like(hs) if need_dh else None
    dw32 = torch.zeros(ws.shape, device=dev, dtype=torch.float32) if need_dw else None
    db32 = torch.zeros(ws.shape[0], device=dev, dtype=torch.float32) if need_db else None
    want_grad = (need_dh or need_dw or need_db) and any(g is not None for g in grads)
    if N > 0:
        order, count = compaction(keep)
        chunk = chunk_rows(N, V, params.token_chunk)
        s_buf = new_scratch(chunk, V, torch.float32, dev)
        t_buf = new_scratch(chunk, V, torch.float32, dev) if teacher is not None else s_buf
        inv_t = 1.0 / params.temperature
        gemms = ChunkGradients(student, V, chunk, s_buf, dh, dw32, db32) if want_grad else None
        g_buf = s_buf if gemms is None else gemms.scratch
        for c0 in range(0, N, chunk):
            n_rows = min(chunk, N - c0)
            launch_scaled_logits(student, order, count, s_buf, c0, n_rows, V, inv_t)
            if teacher is not None:
                launch_scaled_logits(teacher, order, count, t_buf, c0, n_rows, V, inv_t)
            _distill_rows_kernel[(n_rows,)](
                s_buf, t_buf, g_buf, targets, order, count, or_dummy(g_div, div), or_dummy(g_lp, div),
                or_dummy(g_ent, div), div, lp, stats, N, V, c0, s_buf.stride(0), t_buf.stride(0), g_buf.stride(0),
                inv_t, float(params.beta),
                DIV=int(params.divergence), HAS_TEACHER=teacher is not None, HAS_GDIV=g_div is not None,
                HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None, NEED_GRAD=want_grad,
                BLOCK_V=rows_block(V), **ROWS_LAUNCH,
            )
            if gemms is not None:
                gemms.run(order, count, c0, n_rows)
    if dh is not None and not want_grad:
        dh.zero_()
    dw = None if dw32 is None else (dw32 if ws.dtype == torch.float32 else dw32.to(ws.dtype))
    db = None
    if db32 is not None:
        db = db32 if bs.dtype == torch.float32 else db32.to(bs.dtype)
    return div, lp, stats[DistillStat.ENTROPY].clone(), stats, dh, dw, db
