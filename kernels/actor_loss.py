"""Triton path of the fused PPO actor loss (`memopd.ops.fused_linear_actor_loss`).

The wrapper in `memopd.ops.actor_loss` validates and dispatches; this module assumes
validated, contiguous inputs. Work per chunk of TOKEN_CHUNK tokens (kept tokens first,
by the same device-side compaction as the distillation kernels: no host sync):

1. `scaled_logits_kernel` (`memopd.kernels.lm_head_tiles`) writes the chunk's student
   logits / T (and, with a teacher, the teacher's) as fp32 [chunk, V] scratch: one lm_head-sized matmul each, `tl.dot`
   with fp32 accumulation, tiles as in the distillation forward.
2. `_actor_rows_kernel`, one program per token, sweeps its row twice: once for every
   sum (normalisers, entropy sum, E_p[a'], the joint sum that gives the precise
   log-normaliser difference) against running maxima, rescaled exactly as they rise,
   after which it stores the per-token statistics and loss share at the token's own
   index; then, with the loss known, once to write dL/dlogits: into the student scratch
   in place (fp32 heads, or a bias gradient) or, for 16-bit heads, into a scratch of that dtype,
   rounded as the GEMMs rounded it (`grad_scratch_dtype`).
3. dH = dlogits @ W and dW += dlogits^T @ H run the deterministic GEMM kernels that
   the distillation ops run too, through `ChunkGradients` (the gradient scratch, its
   dtype and the launches, shared with the distillation's gradients in the forward); dH
   is split over the vocabulary with a fixed-order sum where a chunk's grid would leave
   SMs idle (`dh_splits`: at the default 768-row chunk, 6 x 16 programs on 132 SMs).

So a training call is 4 lm_head-sized matmuls (3 without a teacher) and the backward
only scales the stored gradients. The scratch is bounded by MEMOPD_DISTILL_SCRATCH_MB
per buffer (default 512 MiB), never [N, V]. Statistic rows follow `ActorStat` of
`memopd.kernels.contract`; the logits tile, the GEMMs and the compaction are those of
`memopd.kernels.lm_head_tiles`; interpreter, precision and tiling policy
`memopd.kernels.runtime`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .contract import PRECISE_LIMIT, ActorLossParams, ActorStat, LinearHead
from .lm_head_tiles import (
    ChunkGradients,
    compaction,
    default_token_chunk,
    expm1_small,
    launch_scaled_logits,
    log1p_small,
    new_scratch,
    store_grad_piece,
)
from .runtime import INTERPRET, NEG

# ActorStat rows as constexprs (compiled Triton reads only constexpr globals in kernels)
_LOGPROB = tl.constexpr(int(ActorStat.LOGPROB))
_ENTROPY = tl.constexpr(int(ActorStat.ENTROPY))
_KL = tl.constexpr(int(ActorStat.KL))
_RATIO = tl.constexpr(int(ActorStat.RATIO))
_CLIPPED = tl.constexpr(int(ActorStat.CLIPPED))


@triton.jit
def _actor_rows_kernel(
    s_ptr, t_ptr, g_ptr, targets_ptr, adv_ptr, old_ptr, klkeep_ptr, order_ptr, count_ptr, stats_ptr, part_ptr,
    N, V, c0, stride_s, stride_t, stride_g,
    clip_low, clip_high, dual_clip, g_h, kl_scale, inv_norm, inv_temp, precise_limit,
    HAS_TEACHER: tl.constexpr, DUAL: tl.constexpr, NEED_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    idx = c0 + r
    count = tl.load(count_ptr)
    active = idx < count
    row = tl.load(order_ptr + idx).to(tl.int64)
    srow = s_ptr + r.to(tl.int64) * stride_s
    trow = t_ptr + r.to(tl.int64) * stride_t
    v_end = tl.where(active, V, 0)
    offs = tl.arange(0, BLOCK_V)
    # Sweep 1: every sum in one pass, against running maxima (one scalar per row and side,
    # raised tile by tile). With s' = s - max s, t' = t - max t, a' = s' - t' and a rise
    # d of a maximum, each sum is rescaled exactly: e^{s'} by e^{d_s}, s' and a' shift by
    # d_s and d_s - d_t, so  sum e^{s'} s' -> e^{d_s} (A + d_s Z_s),
    # sum e^{s'} a' -> e^{d_s} (E + (d_s - d_t) Z_s) and, since
    # expm1(x + c) = e^c expm1(x) + expm1(c),  sum e^{t'} expm1(a') -> e^{d_t} (e^c R + expm1(c) Z_t).
    # Every term of A and of d_s Z_s is <= 0 (no cancellation); E and R are first-order
    # small for p ~ q, as in a sweep with the final maxima, and keep their relative precision.
    m_s = tl.full([], NEG, tl.float32)
    m_t = tl.full([], NEG, tl.float32)
    z_s = tl.zeros([BLOCK_V], tl.float32)
    a_s = tl.zeros([BLOCK_V], tl.float32)
    z_t = tl.zeros([BLOCK_V], tl.float32)
    e_pa = tl.zeros([BLOCK_V], tl.float32)
    r_q = tl.zeros([BLOCK_V], tl.float32)
    a_hi = tl.full([BLOCK_V], NEG, tl.float32)
    # Loads are bounded by the padded row stride (vectorised for any V). The padding holds
    # zeros, which is what a load masked by V gave: the sums mask only what 0 would not
    # leave out (exp), and the maxima mask the padding to NEG.
    for v0 in range(0, v_end, BLOCK_V):
        cols = v0 + offs
        ok = cols < V
        s_raw = tl.load(srow + cols, mask=cols < stride_s, other=0.0)
        ms_new = tl.maximum(m_s, tl.max(tl.where(ok, s_raw, NEG), 0))
        d_s = tl.where(m_s > NEG, m_s - ms_new, 0.0)  # first tile: the sums are still 0
        m_s = ms_new
        al_s = tl.exp(d_s)
        s = s_raw - m_s
        es = tl.where(ok, tl.exp(s), 0.0)
        z_old = z_s
        a_s = al_s * (a_s + d_s * z_old) + es * s
        z_s = al_s * z_old + es
        if HAS_TEACHER:
            t_raw = tl.load(trow + cols, mask=cols < stride_t, other=0.0)
            mt_new = tl.maximum(m_t, tl.max(tl.where(ok, t_raw, NEG), 0))
            d_t = tl.where(m_t > NEG, m_t - mt_new, 0.0)
            m_t = mt_new
            al_t = tl.exp(d_t)
            c = d_s - d_t  # the shift of the earlier a'
            c_small = tl.abs(c) < 1.0
            em1_c = tl.where(c_small, expm1_small(tl.where(c_small, c, 0.0)), tl.exp(tl.minimum(c, precise_limit)) - 1.0)
            t = t_raw - m_t
            et = tl.where(ok, tl.exp(t), 0.0)
            a = s - t
            e_pa = al_s * (e_pa + c * z_old) + es * a
            a_c = tl.minimum(a, precise_limit)
            # expm1 to relative precision: exp(a) - 1 loses it for the tiny a' of p ~ q
            small = tl.abs(a_c) < 1.0
            em1 = tl.where(small, expm1_small(tl.where(small, a_c, 0.0)), tl.exp(a_c) - 1.0)
            r_q = al_t * ((em1_c + 1.0) * r_q + em1_c * z_t) + et * em1
            z_t = al_t * z_t + et
            # an upper bound of every a' both when it was summed (clamped above) and at the
            # end (shifted by the later c): above precise_limit, the plain difference is used
            a_hi = tl.maximum(a_hi + tl.maximum(c, 0.0), tl.where(ok, a, NEG))
    ms = m_s
    mt = m_t
    zs = tl.sum(z_s, 0)
    log_zs = tl.log(tl.where(active, zs, 1.0))
    ent = log_zs - tl.sum(a_s, 0) / tl.where(active, zs, 1.0)
    y = tl.load(targets_ptr + row).to(tl.int64)
    y = tl.minimum(tl.maximum(y, 0), V - 1)
    s_y = tl.where(active, tl.load(srow + y) - ms, 0.0)  # y is clamped: always a valid address
    lp = s_y - log_zs
    kl = 0.0
    dlse = 0.0
    if HAS_TEACHER:
        zt = tl.where(active, tl.sum(z_t, 0), 1.0)
        ratio_q = tl.sum(r_q, 0) / zt
        plain = log_zs - tl.log(zt)
        # log1p(Z_s'/Z_t' - 1) with relative precision (Kahan's form holds for any x > -1)
        use_plain = (tl.max(a_hi, 0) > precise_limit) | (ratio_q <= -1.0)
        dlse = tl.where(use_plain, plain, log1p_small(tl.where(use_plain, 0.0, ratio_q)))
        kl = tl.maximum(tl.sum(e_pa, 0) / tl.where(active, zs, 1.0) - dlse, 0.0)
    adv = tl.load(adv_ptr + row).to(tl.float32)
    old = tl.load(old_ptr + row).to(tl.float32)
    ratio = tl.exp(lp - old)
    l1 = -adv * ratio
    l2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    pg = tl.maximum(l1, l2)
    g_lp = tl.where(l1 >= l2, l1, 0.0)
    clipped = l2 > l1
    if DUAL:
        cap = -dual_clip * adv
        capped = (adv < 0.0) & (pg > cap)
        pg = tl.where(capped, cap, pg)
        g_lp = tl.where(capped, 0.0, g_lp)
        clipped = clipped | capped
    g_pg = g_lp * inv_norm
    g_kl = 0.0
    if HAS_TEACHER:
        g_kl = tl.load(klkeep_ptr + row).to(tl.float32) * kl_scale
    part = pg * inv_norm + g_h * ent + g_kl * kl
    # an inactive program's row is a masked token: it gets the neutral values
    tl.store(part_ptr + row, tl.where(active, part, 0.0))
    tl.store(stats_ptr + _LOGPROB * N + row, tl.where(active, lp, 0.0))
    tl.store(stats_ptr + _ENTROPY * N + row, tl.where(active, ent, 0.0))
    tl.store(stats_ptr + _KL * N + row, tl.where(active, kl, 0.0))
    tl.store(stats_ptr + _RATIO * N + row, tl.where(active, ratio, 1.0))
    tl.store(stats_ptr + _CLIPPED * N + row, tl.where(active & clipped, 1.0, 0.0))
    if NEED_GRAD:
        # sweep 2: dL/dlogits = [p (A + B log p + g_kl a') + g_pg 1[v = y]] / T into the
        # gradient scratch g (the student scratch itself, in place, or a buffer of the GEMM
        # operand's dtype); rows of masked tokens are zeroed (the GEMMs and the bias sum read them)
        coef_a = -g_pg - g_h * ent - g_kl * (dlse + kl)
        coef_b = -g_h
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            ok = cols < V
            s = tl.load(srow + cols, mask=cols < stride_s, other=0.0) - ms  # inactive rows: stored as 0 below
            ls = s - log_zs
            ds = coef_a + coef_b * ls
            if HAS_TEACHER:
                t = tl.load(trow + cols, mask=cols < stride_t, other=0.0) - mt
                ds += g_kl * (s - t)
            ds = tl.exp(ls) * ds + tl.where(cols == y, g_pg, 0.0)
            # the padding past V is written as zeros: the GEMMs read whole padded rows
            store_grad_piece(g_ptr + r.to(tl.int64) * stride_g, cols, tl.where(active & ok, ds * inv_temp, 0.0),
                             stride_g)


def _rows_block(V: int) -> int:
    # one program streams one row: 2048-wide tiles over 8 warps keep ~8 fp32 values of
    # each live vector per thread (memory-bound sweeps, no tl.dot)
    return 64 if INTERPRET else min(2048, triton.next_power_of_2(min(V, 2048)))


_ROWS_LAUNCH = {} if INTERPRET else dict(num_warps=8, num_stages=1)


def actor_loss_forward(student: LinearHead, teacher: Optional[LinearHead], targets, adv, old_lp, keep, kl_keep,
                       params: ActorLossParams, need_grad: tuple, token_chunk: int):
    """Same contract as the PyTorch path: (loss, stats [len(ActorStat), N], dh | None, dw32 | None, db32 | None)."""
    hs, ws = student.hidden, student.weight
    V = params.vocab_size
    N, Hs = hs.shape
    dev = hs.device
    need_dh, need_dw, need_db = need_grad
    stats = torch.zeros((len(ActorStat), N), device=dev, dtype=torch.float32)
    stats[ActorStat.RATIO] = 1.0
    part = torch.zeros(N, device=dev, dtype=torch.float32)
    dh = torch.empty_like(hs) if need_dh else None
    dw32 = torch.zeros(ws.shape, device=dev, dtype=torch.float32) if need_dw else None
    db32 = torch.zeros(ws.shape[0], device=dev, dtype=torch.float32) if need_db else None
    if N == 0:
        return part.sum(), stats, dh, dw32, db32
    order, count = compaction(keep)
    chunk = token_chunk if token_chunk and token_chunk > 0 else default_token_chunk(N, V, 4)
    chunk = min(chunk, N)
    s_buf = new_scratch(chunk, V, torch.float32, dev)
    t_buf = new_scratch(chunk, V, torch.float32, dev) if teacher is not None else s_buf
    inv_t = 1.0 / params.temperature
    any_grad = need_dh or need_dw or need_db
    grads = ChunkGradients(student, V, chunk, s_buf, dh, dw32, db32)
    g_buf = grads.scratch
    for c0 in range(0, N, chunk):
        n_rows = min(chunk, N - c0)
        launch_scaled_logits(student, order, count, s_buf, c0, n_rows, V, inv_t)
        if teacher is not None:
            launch_scaled_logits(teacher, order, count, t_buf, c0, n_rows, V, inv_t)
        _actor_rows_kernel[(n_rows,)](
            s_buf, t_buf, g_buf, targets, adv, old_lp, kl_keep, order, count, stats, part,
            N, V, c0, s_buf.stride(0), t_buf.stride(0), g_buf.stride(0),
            float(params.clip_low), float(params.clip_high), float(params.dual_clip or 0.0),
            -float(params.entropy_coef) / params.normalizer, float(params.teacher_kl_coef) / params.kl_normalizer,
            1.0 / params.normalizer, inv_t, PRECISE_LIMIT,
            HAS_TEACHER=teacher is not None, DUAL=params.dual_clip is not None, NEED_GRAD=any_grad,
            BLOCK_V=_rows_block(V), **_ROWS_LAUNCH,
        )
        if any_grad:
            grads.run(order, count, c0, n_rows)
    return part.sum(), stats, dh, dw32, db32
