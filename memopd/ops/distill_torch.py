"""The PyTorch implementation of the fused distillation op and of its teacher-less mode
(log-prob + entropy): blocked over kept tokens and vocabulary chunks, never [N, V]. It
runs on CPU tensors and on any device with backend="torch"; on CPU float32 the
elementwise work of the resident path runs in the C++ core (`_native_chunks`), and a
bfloat16 head's lm-head GEMMs run there too where the CPU has AVX512-BF16 (bf16 operands,
fp32 accumulation and output; `_HeadLogits`). The algorithm, the blocking and the costs
are in docs/design.md §6.2.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch
from torch import Tensor

from ..kernels.contract import DistillParams, DistillStat, Divergence, LinearHead, head_tensors
from . import _native_chunks

__all__ = ["compute_dtype", "torch_forward", "torch_backward", "torch_forward_with_grads", "token_weight_grads",
           "student_outputs", "log1p_or_plain", "kl_from_sums", "stack_stats"]

_TORCH_TOKEN_CHUNK = 1024  # rows of a token block (PyTorch path)
_TORCH_TILE_ELEMS = 1 << 20  # elements of one [rows, vocab chunk] piece (4 MiB fp32)
_TORCH_ROW_ELEMS = 1 << 23  # elements of one [rows, V] block in full-row mode (JSD forward)
_TORCH_MIN_ROWS = 64  # ... but at least this many rows (GEMM efficiency)
_TORCH_CONVERT_ROWS = 4096  # full-row mode: a bf16/fp16 weight is converted this many rows at a time
_RESIDENT_MIN_BYTES = 64 << 20  # forward with gradients: resident logits may always take this much
_RESIDENT_ROWS = 512  # ... and as many rows as this where the machine's share allows (`_resident_plan`)
_RESIDENT_MACHINE_SHARE = 32  # ... the share: 1/32 of the machine's (or accelerator's) memory
_NEG = -1.0e30


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    # fp32 statistics for fp32/bf16/fp16 inputs; float64 inputs keep float64 (PyTorch path).
    return (torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors)
            else torch.float32)


class _Workspace:
    """Reusable scratch buffers of one call of the PyTorch path, viewed as [r, c] blocks.

    A fresh multi-MiB tensor is a fresh mapping whose pages the kernel zero-fills on
    first touch (~0.1 ms per 4 MiB on CPU: as much as the elementwise work on it), so
    each named buffer is allocated once, at the largest block shape, and every chunk
    uses a contiguous [r, c] prefix of it.
    """

    def __init__(self, rows: int, cols: int, device, dtype):
        self.numel = rows * cols
        self.f = dict(device=device, dtype=dtype)
        self.bufs: dict = {}

    def __call__(self, name: str, r: int, c: int) -> Tensor:
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = torch.empty(self.numel, **self.f)
        return buf[: r * c].view(r, c)


def _logits(h: Tensor, wc: Tensor, b: Optional[Tensor], v0: int, v1: int, inv_t: float,
            out: Tensor) -> Tensor:
    """Logits / T of one vocabulary chunk into `out`, in h's dtype (fp32 / fp64).

    `h` is already multiplied by 1/T (once per token block) and `wc` is the chunk's
    weight rows already in h's dtype, so only the bias is scaled here.
    """
    if b is None:
        return torch.mm(h, wc.t(), out=out)
    return torch.addmm(b[v0:v1].to(h.dtype) * inv_t, h, wc.t(), out=out)


def _weight_chunk(w: Tensor, v0: int, v1: int, dtype: torch.dtype) -> Tensor:
    wc = w[v0:v1]
    return wc if wc.dtype == dtype else wc.to(dtype)  # bf16 @ bf16 on CPU would round to bf16


def _bf16_route(h: Tensor, w: Tensor) -> bool:
    """Whether a head's GEMMs take the C++ core's bf16 GEMM: bf16 hidden states and weight
    on a CPU that runs it (fp32 output; `_native_chunks.bf16_matmul`)."""
    return _native_chunks.bf16_gemm_usable(h, w)


class _HeadLogits:
    """Logits / T of one token block against one head, vocabulary chunk by chunk, and the
    block's dH / dW GEMMs against the same head.

    Without `resident` every request runs the chunk's matmul. With it (the forward that
    also takes the gradients) each chunk is computed once into a [rows, chunk] slot of
    `resident`, laid out chunk after chunk so every slot is contiguous; the statistics
    read it (`kept`) and the gradient pass, its last reader, consumes it (`last_use`).
    That is what saves the backward's two recomputed lm-head matmuls.

    `rows` are the block's hidden rows as given. `h_t` holds them in the compute dtype,
    times 1/T. With a bfloat16 head on a CPU whose core runs the bf16 GEMM (`_bf16_route`)
    the GEMMs read the bf16 rows and weight chunks themselves (`h16`) with fp32 output,
    1/T applied to the product: the logits are the exact products of the bf16 operands up
    to fp32 accumulation, as the fp32 path computes them, at the bf16 rate. The dH / dW
    GEMMs then read dL/ds rounded to bf16 (nearest even), as the GPU kernels' 16-bit
    gradient scratch does (`add_grads`). Otherwise each weight chunk is converted to the
    compute dtype (bf16 @ bf16 in torch on CPU would round the logits to bf16).
    """

    def __init__(self, rows: Tensor, w: Tensor, b: Optional[Tensor], inv_t: float, cdt: torch.dtype,
                 resident: Optional[Tensor] = None):
        self.h_t, self.w, self.b, self.inv_t = rows.to(cdt).mul_(inv_t), w, b, inv_t
        self.h16 = rows if _bf16_route(rows, w) else None
        self._h_packed: Optional[Tensor] = None  # h16ᵀ packed once per block for the logits GEMM
        self.resident = resident
        self._filled: set = set()
        self.jsd_weight = False  # the resident chunks were overwritten with the JSD weight -(δ - u)

    def _compute(self, v0: int, v1: int, out: Tensor) -> Tensor:
        if self.h16 is None:
            return _logits(self.h_t, _weight_chunk(self.w, v0, v1, self.h_t.dtype), self.b, v0, v1,
                           self.inv_t, out)
        if self.b is not None:
            out.copy_((self.b[v0:v1].float() * self.inv_t).expand_as(out))
        wc = self.w[v0:v1]
        if _native_chunks.bf16_in_place_usable(wc):
            # the weight chunk read in place (its bf16 pairs are contiguous), the block's
            # hidden rows packed once for all its chunks: the same sums, bit for bit
            if self._h_packed is None:
                self._h_packed = _native_chunks.bf16_pack_rhs(self.h16.t())
            return _native_chunks.bf16_matmul_nt_packed(wc, self._h_packed, self.h16.shape[0], out,
                                                        alpha=self.inv_t, accumulate=self.b is not None)
        return _native_chunks.bf16_matmul(self.h16, wc.t(), out, alpha=self.inv_t, accumulate=self.b is not None)

    def full(self, V: int, out: Tensor) -> Tensor:
        """Logits / T of whole vocabulary rows into `out` [rows, V] (full-row mode)."""
        if self.h16 is not None:
            return self._compute(0, V, out)
        return _full_logits(self.h_t, self.w, self.b, V, self.inv_t, out)

    def add_grads(self, ds: Tensor, v0: int, v1: int, dh: Optional[Tensor], dw: Optional[Tensor],
                  dw_first: bool = False) -> None:
        """dh += ds @ W[v0:v1] and dw[v0:v1] += ds^T @ (h / T) for the chunk's dL/ds `ds`
        (dh still lacks its 1/T; either may be None); `dw_first` (bf16 GEMM only): dw[v0:v1]
        is written, not added to (its first token block: dw need not be zeroed)."""
        if self.h16 is not None:
            if dh is not None:
                _native_chunks.bf16_matmul(ds, self.w[v0:v1], dh, accumulate=True)
            if dw is not None:
                _native_chunks.bf16_matmul(ds.t(), self.h16, dw[v0:v1], alpha=self.inv_t, accumulate=not dw_first)
            return
        assert not dw_first, "only the bf16 GEMM route writes dW without a zeroed buffer"
        if dh is not None:
            dh.addmm_(ds, _weight_chunk(self.w, v0, v1, self.h_t.dtype))
        if dw is not None:
            dw[v0:v1].addmm_(ds.t(), self.h_t)

    def _slot(self, v0: int, v1: int) -> Tensor:
        n = self.h_t.shape[0]
        slot = self.resident[n * v0: n * v1].view(n, v1 - v0)
        if v0 not in self._filled:
            self._compute(v0, v1, slot)
            self._filled.add(v0)
        return slot

    def scratch(self, v0: int, v1: int, out: Tensor) -> Tensor:
        """The chunk computed into `out`, which the caller may overwrite (no resident buffer:
        the chunked forward and the recomputing backward)."""
        assert self.resident is None, "a resident chunk is read with kept() / last_use()"
        return self._compute(v0, v1, out)

    def kept(self, v0: int, v1: int) -> Tensor:
        """The resident chunk, computed on first use, for readers that leave it intact."""
        return self._slot(v0, v1)

    def last_use(self, v0: int, v1: int, out: Tensor) -> Tensor:
        """The chunk for its last reader, which may overwrite it (the resident slot itself)."""
        if self.resident is None:
            return self._compute(v0, v1, out)
        return self._slot(v0, v1)


def _centre2(x: Tensor, m: Tensor) -> Tensor:
    """In place: x <- (x - m)·log2(e), one pass; then exp2(x) = e^{x - m}.

    exp2 is ~3x cheaper than exp on CPU, and the centring pass is needed anyway.
    """
    return torch.add((-_LOG2E * m)[:, None], x, alpha=_LOG2E, out=x)


def _rowdot(a: Tensor, b: Tensor, tmp: Tensor) -> Tensor:
    """Σ_v a[i, v] b[i, v], through the scratch block `tmp` (vecdot/einsum would allocate
    a fresh [rows, chunk] product, or run as a slow batched matmul)."""
    return torch.mul(a, b, out=tmp).sum(1)


_SQRT_E = math.exp(0.5)
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_CLOSE_KL = 1e-2  # full-row mode: rows whose plain KL estimate is below this get the precise dlse
_JSD_CAP = 80.0  # -δ past which the JSD weight is taken in its far form (e^{-δ} would overflow)


def _any(flags: Tensor) -> bool:
    """bool(flags.any()) on CPU; True elsewhere (a data-dependent skip would sync the device)."""
    return flags.device.type != "cpu" or bool(flags.any())


def _jsd_negw(neg_delta: Tensor, beta: float) -> Tensor:
    """In place: -δ -> -(δ - u(δ)) = log1p(β expm1(-δ)), u = log(β + (1-β) e^δ) = log M - log q.

    δ - u = -log(β e^{-δ} + 1 - β) exactly; the log1p/expm1 form keeps relative precision
    where δ is tiny (p ≈ q). Where -δ > _JSD_CAP (the teacher's probability of an entry is
    more than e^80 times the student's) e^{-δ} would overflow: there the weight is
    -δ + log β + log1p((1-β)/β · e^δ) instead, so the weight, and with it KL(q‖M), stays
    exact whatever the gap (`_far_weights`).
    """
    far = _far_weights(neg_delta, _JSD_CAP, math.log(beta), (1.0 - beta) / beta, bits=False)
    if far is None:  # the max reduction stands in for the clamp, which would change nothing
        return neg_delta.expm1_().mul_(beta).log1p_()
    neg_delta.clamp_max_(_JSD_CAP).expm1_().mul_(beta).log1p_()
    return torch.where(far[0], far[1], neg_delta, out=neg_delta)


def _far_weights(x: Tensor, cap: float, log_beta: float, ratio: float, bits: bool):
    """For the entries of x (-δ in nats, or in bits with `bits`) beyond `cap`: (mask, their
    exact JSD weight x + log β + log(1 + ratio·e^-x), in base 2 with `bits`), or None where
    no entry is (the usual case, found by one max reduction)."""
    if x.numel() == 0 or not _any(x.amax() > cap):
        return None
    if bits:
        hi = torch.exp2(-x).mul_(ratio).add_(1.0).log2_()
    else:
        hi = torch.exp(-x).mul_(ratio).log1p_()
    return x > cap, hi.add_(x).add_(log_beta)


def _jsd_negw2_far(s: Tensor, t: Tensor, dlse: Tensor, lse_s: Tensor, lse_t: Tensor, beta: float, wk,
                   n: int, c: int):
    """The JSD weight -(δ - u) = log2(β q/p + 1 - β) of one chunk in base 2, for rows where
    p and q are not close: (weight [n, c] in `t`, Σ p·weight, Σ q·weight in nats); `t`
    (the teacher logits) is consumed.

    exp2 and log2 of the ratio cost about half of the log1p/expm1 form (`_jsd_negw`); the
    weight then has absolute rather than relative precision (~2^-24, not 2^-24·|weight|),
    which is fp32 roundoff of a divergence that is not small. -δ comes from s - t as in
    `_jsd_negw`, and entries past the same cap are computed apart (no overflow, exact).
    """
    cap2 = _JSD_CAP * _LOG2E
    log2_beta = math.log2(beta) if beta > 0 else -math.inf
    w2 = torch.sub(s, t, out=wk("d", n, c))
    # log2(β q / p) = log2 β - δ log2(e), capped: 2^w2 <= 2^cap2 β
    w2 = torch.add((_LOG2E * dlse + log2_beta)[:, None], w2, alpha=-_LOG2E, out=w2)
    # beyond the cap the weight is log2(β q/p) + log2(1 + (1-β) p / (β q)), computed apart
    far = _far_weights(w2, cap2 + log2_beta, 0.0, 1.0 - beta, bits=True)
    if far is None:
        w2 = w2.exp2_().add_(1.0 - beta).log2_()
    else:
        w2 = w2.clamp_max_(cap2 + log2_beta).exp2_().add_(1.0 - beta).log2_()
        w2 = torch.where(far[0], far[1], w2, out=w2)
    p = torch.add((-_LOG2E * lse_s)[:, None], s, alpha=_LOG2E, out=wk("x", n, c)).exp2_()
    q = _centre2(t, lse_t).exp2_()
    tmp = wk("e", n, c)
    sp, sq = _rowdot(p, w2, tmp) * _LN2, _rowdot(q, w2, tmp) * _LN2
    return torch.mul(w2, _LN2, out=t), sp, sq


def _precise_dlse(d: Tensor, es: Tensor, et: Tensor, m_s: Tensor, m_t: Tensor,
                  tmp: Optional[Tensor] = None):
    """The difference of the two normalisers at a joint max, with relative precision.

    With es = e^{s - m_s}, et = e^{t - m_t}, d = s - t, M = max(m_s, m_t),
    c_S = e^{m_s - M}, c_T = e^{m_t - M}, returns (small, big) such that

        Σ_v (e^{s_v - M} - e^{t_v - M}) = c_T·small + c_S·big,
        small = Σ_v et_v expm1(min(d_v, 1/2)),  big = Σ_v relu(es_v - e^{m_t - m_s} √e et_v)

    exactly (the relu is non-zero iff d_v > 1/2, where it restores the clamped part), with
    no overflow and full relative precision where d is small. `big` is None when no
    d_v exceeds 1/2 (then it is 0 and its three passes are skipped). Works in the scratch
    block `tmp`, or without one in place (consuming `d`, and `es` when `big` is computed).
    """
    big = None
    if _any(d.amax(1) > 0.5):
        k = (torch.exp(m_t - m_s) * _SQRT_E).clamp_max(1e30)[:, None]
        big = (es.addcmul_(k, et, value=-1.0) if tmp is None else
               torch.addcmul(es, k, et, value=-1.0, out=tmp)).relu_().sum(1)
    em1 = d.clamp_max_(0.5) if tmp is None else torch.clamp_max(d, 0.5, out=tmp)
    small = em1.expm1_().mul_(et).sum(1)
    return small, big


def _torch_forward_rows(src_s: _HeadLogits, src_t: Optional[_HeadLogits], y, V, div_code, beta, vchunk, wk):
    """Per-token outputs and stats of one token block.

    One vocabulary chunk covering the row (`vchunk >= V`) takes the full-row route: exact
    row maxima, one exp2 pass per distribution, the precise normaliser difference only on
    rows whose plain KL estimate is small, and the JSD without a second matmul pass.
    Otherwise the vocabulary is walked in chunks with online statistics. `wk` holds the
    [rows, chunk] scratch blocks.

    `src_t is None` is the teacher-less mode: only the student sums (max, sum-exp, entropy
    sum, target logit) are kept, no teacher logits are ever computed, and the divergence
    and the teacher rows of the stats are zero.
    """
    if vchunk >= V:
        return _forward_full_rows(src_s, src_t, y, V, div_code, beta, wk)
    return _forward_chunked(src_s, src_t, y, V, div_code, beta, vchunk, wk)


def student_outputs(m_s, z_s, a_s, s_y):
    """log z_s, lse_s, entropy and log-prob from the student sums: max m_s, target logit
    s_y, z_s = Σ e^{s - m_s} and a_s = Σ e^{s - m_s} (s - m_s) (both back ends)."""
    log_zs = torch.log(z_s)
    lse_s = m_s + log_zs
    ent = log_zs - a_s / z_s
    lp = s_y - lse_s
    return log_zs, lse_s, ent, lp


def log1p_or_plain(ratio: Tensor, plain: Tensor) -> Tensor:
    """lse_s - lse_t = log1p(ratio) where the relative normaliser difference `ratio` is
    small, else `plain` (both back ends)."""
    near = ratio.abs() < 0.5  # False for NaN/inf (teacher mass underflowed at the joint max)
    return torch.where(near, torch.log1p(torch.where(near, ratio, 0.0)), plain)


def kl_from_sums(divergence: Divergence, e_d: Tensor, z_s: Tensor, z_t: Tensor, dlse: Tensor) -> Tensor:
    """The per-token KL (before clamping at 0) from E_d = Σ e^{s - m_s} d (reverse) or
    Σ e^{t - m_t} d (forward), d = s - t: E_p[d] - dlse, or dlse - E_q[d]."""
    if divergence == Divergence.REVERSE_KL:
        return e_d / z_s - dlse
    return dlse - e_d / z_t


def stack_stats(*, lse_s: Tensor, lse_t: Tensor, dlse: Tensor, aux: Tensor, entropy: Tensor) -> Tensor:
    """The saved statistics, one row per `DistillStat`."""
    rows = {DistillStat.LSE_S: lse_s, DistillStat.LSE_T: lse_t, DistillStat.DLSE: dlse,
            DistillStat.AUX: aux, DistillStat.ENTROPY: entropy}
    return torch.stack([rows[r] for r in DistillStat])


def _log1p_ratio(d, es, et, m_s, m_t, z_t, plain, tmp=None):
    """lse_s - lse_t = log1p(Σ (e^{s-M} - e^{t-M}) / Σ e^{t-M}) per row (see
    `_precise_dlse`); `plain` where the ratio is not small (or not finite)."""
    small, big = _precise_dlse(d, es, et, m_s, m_t, tmp)
    m_j = torch.maximum(m_s, m_t)
    c_t = torch.exp(m_t - m_j)
    num = c_t * small
    if big is not None:
        num = num + torch.exp(m_s - m_j) * big
    return log1p_or_plain(num / (c_t * z_t), plain)


def _full_logits(h: Tensor, w: Tensor, b: Optional[Tensor], V: int, inv_t: float,
                 out: Tensor) -> Tensor:
    """Logits / T of whole vocabulary rows into `out` [rows, V]; a half-precision weight is
    converted (and multiplied) in slices of _TORCH_CONVERT_ROWS rows, never whole."""
    if w.dtype == h.dtype:
        return _logits(h, w[:V], b, 0, V, inv_t, out)
    for v0 in range(0, V, _TORCH_CONVERT_ROWS):
        v1 = min(V, v0 + _TORCH_CONVERT_ROWS)
        _logits(h, w[v0:v1].to(h.dtype), b, v0, v1, inv_t, out[:, v0:v1])
    return out


def _forward_full_rows(src_s: _HeadLogits, src_t: Optional[_HeadLogits], y, V, div_code, beta, wk):
    hs_t = src_s.h_t
    n = hs_t.shape[0]
    f = dict(device=hs_t.device, dtype=hs_t.dtype)
    s = src_s.full(V, wk("s", n, V))
    s_y = s.gather(1, y[:, None])[:, 0]
    m_s = s.amax(1)
    if src_t is not None:
        t = src_t.full(V, wk("t", n, V))
        m_t = t.amax(1)
        d = torch.sub(s, t, out=wk("d", n, V))  # before centring: exact where s ≈ t
    s2 = _centre2(s, m_s)
    es = torch.exp2(s2, out=wk("e", n, V))
    z_s = es.sum(1)
    log_zs, lse_s, ent, lp = student_outputs(m_s, z_s, s2.mul_(es).sum(1) * _LN2, s_y)
    if src_t is None:
        zero = torch.zeros(n, **f)
        return zero, lp, ent, stack_stats(lse_s=lse_s, lse_t=zero, dlse=zero, aux=zero, entropy=ent)
    tmp = s  # free from here on
    et = _centre2(t, m_t).exp2_()
    z_t = et.sum(1)
    log_zt = torch.log(z_t)
    lse_t = m_t + log_zt
    plain = (m_s - m_t) + (log_zs - log_zt)  # lse_s - lse_t
    e_pd = _rowdot(es, d, tmp) / z_s if div_code == Divergence.REVERSE_KL else None  # E_p[s - t]
    e_qd = _rowdot(et, d, tmp) / z_t if div_code != Divergence.REVERSE_KL else None  # E_q[s - t]
    # the precise lse_s - lse_t (log1p of the relative normaliser difference) only on rows
    # where p ≈ q, i.e. whose plain KL estimate is small (elsewhere plain is exact enough)
    close = ((e_pd - plain) if div_code == Divergence.REVERSE_KL else (plain - e_qd)) < _CLOSE_KL
    n_close = int(close.sum()) if close.device.type == "cpu" else n
    dlse = plain
    if 2 * n_close > n:  # mostly close (typical of distillation): whole block, no gathering
        dlse = torch.where(close, _log1p_ratio(d, es, et, m_s, m_t, z_t, plain, tmp), plain)
    elif n_close:  # a few close rows: only those (copies, consumed in place)
        idx = close.nonzero().squeeze(1)
        sub = [x.index_select(0, idx) for x in (d, es, et, m_s, m_t, z_t, plain)]
        dlse = plain.index_copy(0, idx, _log1p_ratio(*sub))
    if div_code == Divergence.REVERSE_KL:
        aux = e_pd - dlse
        div = aux.clamp_min(0.0)
    elif div_code == Divergence.FORWARD_KL:
        aux = dlse - e_qd
        div = aux.clamp_min(0.0)
    else:
        # JSD on the resident block: -δ = dlse - (s - t), KL(p‖M) = Σ p w, KL(q‖M) = Σ q (w - δ)
        negw = _jsd_negw(torch.sub(dlse[:, None], d, out=d), beta)
        kl_pm = -_rowdot(es, negw, tmp) / z_s
        kl_qm = (dlse - e_qd) - et.mul_(negw).sum(1) / z_t
        aux = kl_pm
        div = (beta * kl_qm + (1.0 - beta) * kl_pm).clamp_min(0.0)
    return div, lp, ent, stack_stats(lse_s=lse_s, lse_t=lse_t, dlse=dlse, aux=aux, entropy=ent)


def _forward_chunked(src_s: _HeadLogits, src_t: Optional[_HeadLogits], y, V, div_code, beta, vchunk, wk):
    """Online statistics over vocabulary chunks (running maxima, rescaled sums);
    `src_t` None is the teacher-less mode."""
    n = src_s.h_t.shape[0]
    has_teacher = src_t is not None
    cdt = src_s.h_t.dtype
    f = dict(device=src_s.h_t.device, dtype=cdt)
    m_s = torch.full((n,), _NEG, **f)
    z_s = torch.zeros(n, **f)
    a_s = torch.zeros(n, **f)
    s_y = torch.zeros(n, **f)
    if has_teacher:
        m_t = torch.full((n,), _NEG, **f)
        z_t = torch.zeros(n, **f)
        e_d = torch.zeros(n, **f)
        m_j = torch.full((n,), _NEG, **f)
        zt_j = torch.zeros(n, **f)
        dz_j = torch.zeros(n, **f)
    for v0 in range(0, V, vchunk):
        v1 = min(V, v0 + vchunk)
        c = v1 - v0
        s = src_s.scratch(v0, v1, wk("s", n, c))
        in_c = (y >= v0) & (y < v1)
        s_y += torch.where(in_c, s.gather(1, (y - v0).clamp(0, c - 1)[:, None])[:, 0], 0.0)
        m_s_new = torch.maximum(m_s, s.amax(1))
        alpha_s = torch.exp(m_s - m_s_new)
        if has_teacher:
            t = src_t.scratch(v0, v1, wk("t", n, c))
            m_t_new = torch.maximum(m_t, t.amax(1))
            alpha_t = torch.exp(m_t - m_t_new)
            d = torch.sub(s, t, out=wk("d", n, c))  # before centring: exact where s ≈ t
        s2 = _centre2(s, m_s_new)
        es = torch.exp2(s2, out=wk("e", n, c))
        es_sum = es.sum(1)
        a_s = alpha_s * (a_s + (m_s - m_s_new) * _LOG2E * z_s) + s2.mul_(es).sum(1)
        z_s = alpha_s * z_s + es_sum
        if not has_teacher:
            m_s = m_s_new
            continue
        tmp = s  # free from here on
        et = _centre2(t, m_t_new).exp2_()
        et_sum = et.sum(1)
        z_t = alpha_t * z_t + et_sum
        if div_code == Divergence.REVERSE_KL:
            e_d = alpha_s * e_d + _rowdot(es, d, tmp)
        elif div_code == Divergence.FORWARD_KL:
            e_d = alpha_t * e_d + _rowdot(et, d, tmp)
        m_j_new = torch.maximum(m_s_new, m_t_new)
        r_j = torch.exp(m_j - m_j_new)
        c_t = torch.exp(m_t_new - m_j_new)
        small, big = _precise_dlse(d, es, et, m_s_new, m_t_new)
        zt_j = r_j * zt_j + c_t * et_sum
        dz_j = r_j * dz_j + c_t * small
        if big is not None:
            dz_j += torch.exp(m_s_new - m_j_new) * big
        m_s, m_t, m_j = m_s_new, m_t_new, m_j_new
    log_zs, lse_s, ent, lp = student_outputs(m_s, z_s, a_s * _LN2, s_y)
    if not has_teacher:
        zero = torch.zeros(n, **f)
        return zero, lp, ent, stack_stats(lse_s=lse_s, lse_t=zero, dlse=zero, aux=zero, entropy=ent)
    log_zt = torch.log(z_t)
    lse_t = m_t + log_zt
    plain = (m_s - m_t) + (log_zs - log_zt)
    dlse = log1p_or_plain(dz_j / zt_j, plain)
    if div_code != Divergence.JSD:
        aux = kl_from_sums(div_code, e_d, z_s, z_t, dlse)
        div = aux.clamp_min(0.0)
    else:
        # JSD: second pass with normalised log-probs, KL(p‖M) and KL(q‖M) per token
        kl_pm = torch.zeros(n, **f)
        kl_qm = torch.zeros(n, **f)
        for v0 in range(0, V, vchunk):
            v1 = min(V, v0 + vchunk)
            c = v1 - v0
            s = src_s.scratch(v0, v1, wk("s", n, c))
            t = src_t.scratch(v0, v1, wk("t", n, c))
            nd = torch.sub(s, t, out=wk("d", n, c))
            nd = torch.sub(dlse[:, None], nd, out=nd)  # -δ = log q - log p
            p = _centre2(s, lse_s).exp2_()
            q = _centre2(t, lse_t).exp2_()
            tmp = wk("e", n, c)
            kl_qm += _rowdot(q, nd, tmp)
            negw = _jsd_negw(nd, beta)
            kl_pm -= _rowdot(p, negw, tmp)
            kl_qm -= q.mul_(negw).sum(1)
        aux = kl_pm
        div = (beta * kl_qm + (1.0 - beta) * kl_pm).clamp_min(0.0)
    return div, lp, ent, stack_stats(lse_s=lse_s, lse_t=lse_t, dlse=dlse, aux=aux, entropy=ent)


def _forward_resident(src_s: _HeadLogits, src_t: Optional[_HeadLogits], y, V, div_code, beta, vchunk, wk):
    """Per-token outputs and stats of one token block whose logit chunks are resident
    (read, never consumed, so the gradient pass finds them intact; for the JSD the
    teacher chunks end up holding the JSD weight instead, which is all that pass needs).

    With every chunk at hand the exact row maxima come first, so the sums need no online
    rescaling; and, as in full-row mode, the precise lse_s - lse_t (`_precise_dlse`) is
    evaluated only on rows whose plain KL estimate is small, where it matters: for
    distributions that are not close that saves about a third of the elementwise passes.
    `src_t` None is the teacher-less mode.
    """
    h = src_s.h_t
    n = h.shape[0]
    f = dict(device=h.device, dtype=h.dtype)
    spans = [(v0, min(V, v0 + vchunk)) for v0 in range(0, V, vchunk)]
    S = [src_s.kept(v0, v1) for v0, v1 in spans]
    m_s = torch.stack([c.amax(1) for c in S]).amax(0)
    s_y = torch.zeros(n, **f)
    for (v0, v1), c in zip(spans, S):
        in_c = (y >= v0) & (y < v1)
        s_y += torch.where(in_c, c.gather(1, (y - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0], 0.0)
    T = None
    if src_t is not None:
        T = [src_t.kept(v0, v1) for v0, v1 in spans]
        m_t = torch.stack([c.amax(1) for c in T]).amax(0)
        z_t = torch.zeros(n, **f)
        e_d = torch.zeros(n, **f)  # Σ e^{s - m_s} (s - t) (reverse KL) or Σ e^{t - m_t} (s - t)
    z_s = torch.zeros(n, **f)
    a_s = torch.zeros(n, **f)
    native = _native_chunks.usable(h, *S, *(T or ()))
    for k, (v0, v1) in enumerate(spans):
        c = v1 - v0
        if native:  # the sums below in one pass of the C++ core
            _native_chunks.softmax_sums(S[k], None if T is None else T[k], m_s, None if T is None else m_t, z_s, a_s,
                                        None if T is None else z_t, None if T is None else e_d,
                                        weight_teacher=div_code != Divergence.REVERSE_KL)
            continue
        x = torch.add((-_LOG2E * m_s)[:, None], S[k], alpha=_LOG2E, out=wk("x", n, c))  # log2 e · (s - m_s)
        es = torch.exp2(x, out=wk("e", n, c))
        z_s += es.sum(1)
        a_s += x.mul_(es).sum(1)
        if T is None:
            continue
        et = torch.add((-_LOG2E * m_t)[:, None], T[k], alpha=_LOG2E, out=x).exp2_()
        z_t += et.sum(1)
        d = torch.sub(S[k], T[k], out=wk("d", n, c))
        e_d += d.mul_(es if div_code == Divergence.REVERSE_KL else et).sum(1)
    log_zs, lse_s, ent, lp = student_outputs(m_s, z_s, a_s * _LN2, s_y)
    if T is None:
        zero = torch.zeros(n, **f)
        return zero, lp, ent, stack_stats(lse_s=lse_s, lse_t=zero, dlse=zero, aux=zero, entropy=ent)
    log_zt = torch.log(z_t)
    lse_t = m_t + log_zt
    plain = (m_s - m_t) + (log_zs - log_zt)  # lse_s - lse_t
    e_pd = e_d / z_s if div_code == Divergence.REVERSE_KL else None
    e_qd = e_d / z_t if div_code != Divergence.REVERSE_KL else None
    close = ((e_pd - plain) if div_code == Divergence.REVERSE_KL else (plain - e_qd)) < _CLOSE_KL
    dlse = plain
    if _any(close):
        idx = None if (close.device.type != "cpu" or 2 * int(close.sum()) > n) else close.nonzero().squeeze(1)
        pick = (lambda x: x) if idx is None else (lambda x: x.index_select(0, idx))
        ms_c, mt_c = pick(m_s), pick(m_t)
        small = torch.zeros_like(ms_c)
        big = torch.zeros_like(ms_c)
        for k in range(len(spans)):
            s_c, t_c = pick(S[k]), pick(T[k])
            r, c = s_c.shape
            out = (lambda name, r=r, c=c: wk(name, r, c)) if idx is None else (lambda name: None)  # gathered rows: fresh
            d = torch.sub(s_c, t_c, out=out("d"))
            es = torch.add((-_LOG2E * ms_c)[:, None], s_c, alpha=_LOG2E, out=out("x")).exp2_()
            et = torch.add((-_LOG2E * mt_c)[:, None], t_c, alpha=_LOG2E, out=out("e")).exp2_()
            sm, bg = _precise_dlse(d, es, et, ms_c, mt_c)
            small += sm
            if bg is not None:
                big += bg
        m_j = torch.maximum(ms_c, mt_c)
        c_t = torch.exp(mt_c - m_j)
        precise = log1p_or_plain((c_t * small + torch.exp(ms_c - m_j) * big) / (c_t * pick(z_t)), pick(plain))
        if idx is None:
            dlse = torch.where(close, precise, plain)
        else:
            dlse = plain.index_copy(0, idx, precise)
    if div_code != Divergence.JSD:
        aux = kl_from_sums(div_code, e_d, z_s, z_t, dlse)
        return aux.clamp_min(0.0), lp, ent, stack_stats(lse_s=lse_s, lse_t=lse_t, dlse=dlse, aux=aux, entropy=ent)
    # JSD: normalised log-probs, -δ = dlse - (s - t); KL(p‖M) = Σ p w, KL(q‖M) = Σ q (w - δ).
    # The weight -(δ - u) = log M - log p is what the gradient pass needs of the teacher
    # chunk: it is written over it (`_HeadLogits.jsd_weight`), so that pass does not
    # recompute it.
    kl_pm = torch.zeros(n, **f)
    kl_qm = (dlse - e_qd).clone()
    if _any(close):
        for k, (v0, v1) in enumerate(spans):
            c = v1 - v0
            p = torch.add((-_LOG2E * lse_s)[:, None], S[k], alpha=_LOG2E, out=wk("x", n, c)).exp2_()
            q = torch.add((-_LOG2E * lse_t)[:, None], T[k], alpha=_LOG2E, out=wk("e", n, c)).exp2_()
            negw = _jsd_negw(torch.sub(dlse[:, None], torch.sub(S[k], T[k], out=T[k]), out=T[k]), beta)
            kl_pm -= p.mul_(negw).sum(1)
            kl_qm -= q.mul_(negw).sum(1)
    elif native and _native_chunks.has_jsd_weights() and 0.0 < beta <= 1.0:  # one pass per chunk in the C++ core
        sp, sq = torch.zeros(n, **f), torch.zeros(n, **f)
        args = lse_s.contiguous(), lse_t.contiguous(), dlse.contiguous()
        for k in range(len(spans)):
            _native_chunks.jsd_weights(S[k], T[k], *args, beta, sp, sq)
        kl_pm -= sp
        kl_qm -= sq
    else:
        for k, (v0, v1) in enumerate(spans):
            c = v1 - v0
            _, sp, sq = _jsd_negw2_far(S[k], T[k], dlse, lse_s, lse_t, beta, wk, n, c)
            kl_pm -= sp
            kl_qm -= sq
    src_t.jsd_weight = True
    div = (beta * kl_qm + (1.0 - beta) * kl_pm).clamp_min(0.0)
    return div, lp, ent, stack_stats(lse_s=lse_s, lse_t=lse_t, dlse=dlse, aux=kl_pm, entropy=ent)


def _block_plan(n_rows: int, V: int, chunk_size: int, token_chunk: int,
                full_rows: bool) -> tuple[int, int]:
    """(rows per token block, vocabulary columns per chunk) of the PyTorch path.

    Default: token blocks of at most _TORCH_TOKEN_CHUNK rows (split evenly) and chunks of
    about _TORCH_TILE_ELEMS elements per [rows, chunk] piece; explicit `token_chunk_size`
    / `chunk_size` take precedence. `full_rows` (the JSD forward with an automatic
    `chunk_size`): whole vocabulary rows, blocks of about _TORCH_ROW_ELEMS elements.
    """
    if full_rows:
        rows = token_chunk if token_chunk > 0 else max(_TORCH_MIN_ROWS, _TORCH_ROW_ELEMS // V)
        return max(1, min(rows, n_rows)), V
    if token_chunk > 0:
        rows = token_chunk
    else:
        n_blocks = -(-n_rows // _TORCH_TOKEN_CHUNK)
        rows = -(-n_rows // n_blocks)
    rows = max(1, min(rows, n_rows))
    if chunk_size > 0:
        return rows, chunk_size
    c = max(128, _TORCH_TILE_ELEMS // rows)
    return rows, min(V, (c // 64) * 64)


def _zero_outputs(N: int, device, dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(divergence, logprobs, entropy, stats) of N tokens, zero (what masked tokens keep)."""
    f = dict(device=device, dtype=dtype)
    return torch.zeros(N, **f), torch.zeros(N, **f), torch.zeros(N, **f), torch.zeros(len(DistillStat), N, **f)


def torch_forward(student: LinearHead, teacher: Optional[LinearHead], targets: Tensor, keep: Tensor,
                  params: DistillParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(divergence, logprobs, entropy, stats) per token; `teacher` None is the teacher-less op."""
    hs, ws, bs = head_tensors(student)
    ht, wt, bt = head_tensors(teacher)
    V, div_code, beta = params.vocab_size, params.divergence, params.beta
    temperature, chunk_size, token_chunk = params.temperature, params.chunk_size, params.token_chunk
    N = hs.shape[0]
    cdt = compute_dtype(hs, ht)
    div, lp, ent, stats = _zero_outputs(N, hs.device, cdt)
    kept = keep.nonzero().squeeze(1)  # the CPU path may sync: masked rows never reach a matmul
    n_kept = kept.numel()
    if n_kept == 0:
        return div, lp, ent, stats
    # the JSD needs normalised distributions: with whole rows resident it is one matmul pass
    full_rows = ht is not None and div_code == Divergence.JSD and not (chunk_size and chunk_size > 0)
    rows_per_block, vchunk = _block_plan(n_kept, V, int(chunk_size or 0), int(token_chunk or 0),
                                         full_rows)
    inv_t = 1.0 / temperature
    wk = _Workspace(rows_per_block, vchunk, hs.device, cdt)
    for r0 in range(0, n_kept, rows_per_block):
        rows = kept[r0:r0 + rows_per_block]
        src_s = _HeadLogits(hs.index_select(0, rows), ws, bs, inv_t, cdt)
        src_t = None if ht is None else _HeadLogits(ht.index_select(0, rows), wt, bt, inv_t, cdt)
        y = targets.index_select(0, rows).long()
        d_, l_, e_, st_ = _torch_forward_rows(src_s, src_t, y, V, div_code, beta, vchunk, wk)
        div.index_copy_(0, rows, d_)
        lp.index_copy_(0, rows, l_)
        ent.index_copy_(0, rows, e_)
        stats.index_copy_(1, rows, st_)
    return div, lp, ent, stats


def _dlogit_coefficients(grads: tuple, st: Tensor, div_code, beta: float):
    """Per-token coefficients of dL/ds = p ⊙ (A + B ls2 + D X) + g_lp 1[v=y] (+ the
    forward KL's relu term) for one token block: (A [n, 1], B, D, g_lp), B / D / g_lp None
    where their output receives no gradient. `grads` = the block's (g_div, g_lp, g_ent),
    each [n] or None; `st` its saved statistics."""
    g_div, g_lp, g_ent = (None if g is None else g.to(st.dtype) for g in grads)
    _lse_s, _lse_t, dlse, aux, ent = (st[r] for r in DistillStat)
    A = torch.zeros_like(ent)
    B = D = glp = None
    if g_lp is not None:
        glp = g_lp
        A -= glp
    if g_ent is not None:
        gh = g_ent
        A -= gh * ent
        B = (-_LN2 * gh)[:, None]  # -g_H ls = -g_H ln2 ls2
    if g_div is not None:
        gd = g_div
        if div_code == Divergence.REVERSE_KL:  # X = s - t:  g_kl p (X - dlse - KL)
            A -= gd * (dlse + aux)
            D = gd[:, None]
        elif div_code == Divergence.FORWARD_KL:  # X = expm1(min(-δ, 1/2))
            D = (-gd)[:, None]
        else:  # X = -(δ - u)
            A -= (1.0 - beta) * gd * aux
            D = (-(1.0 - beta) * gd)[:, None]
    return A[:, None], B, D, glp


def _chunk_dlogits(s: Tensor, t: Optional[Tensor], y: Tensor, v0: int, v1: int, coef: tuple,
                   st: Tensor, div_code, beta: float, wk, t_is_jsd_weight: bool = False) -> Tensor:
    """dL/ds of one [rows, chunk] piece from its student (and, when the divergence has a
    gradient, teacher) logits / T, both consumed. See `torch_backward` for the terms.
    `t_is_jsd_weight`: `t` already holds the JSD's X = -(δ - u) (the forward computed it)."""
    A, B, D, glp = coef
    lse_s, lse_t, dlse = st[DistillStat.LSE_S], st[DistillStat.LSE_T], st[DistillStat.DLSE]
    n, c = s.shape
    mode = None  # the C++ core takes the reverse and forward KL, a given JSD weight, no divergence term
    if D is None:
        mode = _native_chunks.MODE_NONE
    elif t_is_jsd_weight or div_code == Divergence.REVERSE_KL:
        mode = _native_chunks.MODE_GIVEN if t_is_jsd_weight else _native_chunks.MODE_DIFF
    elif div_code == Divergence.FORWARD_KL and _native_chunks.has_forward_kl():
        mode = _native_chunks.MODE_FORWARD_KL
    if mode is not None and _native_chunks.usable(s, None if D is None else t, lse_s):
        fkl = mode == _native_chunks.MODE_FORWARD_KL
        ds = _native_chunks.dlogits(s, None if D is None else t, lse_s.contiguous(), _row_vector(A.expand(n, 1)),
                                    _row_vector(B), _row_vector(D), mode, lse_t.contiguous() if fkl else None,
                                    dlse.contiguous() if fkl else None)
        return _add_target_term(ds, y, v0, v1, glp)
    X = q = None
    if D is not None and t_is_jsd_weight:
        X = t
    elif D is not None:
        X = torch.sub(s, t, out=wk("d", n, c))
        if div_code != Divergence.REVERSE_KL:
            X = torch.sub(dlse[:, None], X, out=X)  # -δ
        if div_code == Divergence.JSD:
            X = _jsd_negw(X, beta)
        elif div_code == Divergence.FORWARD_KL:
            if _any(X.amax(1) > 0.5):  # some q > √e p: the relu term is needed
                q = _centre2(t, lse_t).exp2_()
            X = X.clamp_max_(0.5).expm1_()
    ls2 = _centre2(s, lse_s)  # log2 p
    if X is not None:
        ds = torch.addcmul(A, D, X, out=X)
        if B is not None:
            ds.addcmul_(B, ls2)
    elif B is not None:
        ds = torch.addcmul(A, B, ls2, out=wk("d", n, c))
    else:
        ds = None
    p = ls2.exp2_()
    if ds is None:
        ds = p.mul_(A)  # log-prob gradient only: -g_lp p
    else:
        ds.mul_(p)
        if q is not None:
            ds.addcmul_(D, q.add_(p, alpha=-_SQRT_E).relu_())
    return _add_target_term(ds, y, v0, v1, glp)


def _row_vector(v: Optional[Tensor]) -> Optional[Tensor]:
    """An [n, 1] coefficient as the contiguous [n] vector the C++ core reads."""
    return None if v is None else v.reshape(-1).contiguous()


def _add_target_term(ds: Tensor, y: Tensor, v0: int, v1: int, glp: Optional[Tensor]) -> Tensor:
    """ds += g_lp at each row's target column, where the target falls in [v0, v1)."""
    if glp is not None:
        in_c = (y >= v0) & (y < v1)
        col = (y - v0).clamp(0, ds.shape[1] - 1)[:, None]
        ds.scatter_add_(1, col, torch.where(in_c, glp, 0.0)[:, None])
    return ds


def _block_gradients(src_s: _HeadLogits, src_t: Optional[_HeadLogits], y: Tensor, coef: tuple,
                     st: Tensor, params: DistillParams, vchunk: int, need: tuple,
                     dw32: Optional[Tensor], db32: Optional[Tensor], wk, dw_first: bool = False) -> Optional[Tensor]:
    """Reduce one token block's dL/ds into dW, db (accumulated in place; dW written instead
    with `dw_first`, see `_HeadLogits.add_grads`) and return its dH rows (hidden-row dtype
    of the compute, times 1/T still missing), None if not needed."""
    hs_t = src_s.h_t
    n = hs_t.shape[0]
    V, div_code, beta = params.vocab_size, params.divergence, params.beta
    cdt = hs_t.dtype
    dh32 = torch.zeros(n, hs_t.shape[1], device=hs_t.device, dtype=cdt) if need[0] else None
    with_teacher = coef[2] is not None
    for v0 in range(0, V, vchunk):
        v1 = min(V, v0 + vchunk)
        c = v1 - v0
        s = src_s.last_use(v0, v1, wk("s", n, c))
        t = src_t.last_use(v0, v1, wk("t", n, c)) if with_teacher else None
        ds = _chunk_dlogits(s, t, y, v0, v1, coef, st, div_code, beta, wk, with_teacher and src_t.jsd_weight)
        del s, t
        if need[2]:  # before add_grads: a bf16 GEMM rounds ds, db is summed from the fp32 values
            db32[v0:v1] += ds.sum(0)
        src_s.add_grads(ds, v0, v1, dh32 if need[0] else None, dw32 if need[1] else None, dw_first)
        del ds
    return dh32


def _gradient_buffers(hs: Tensor, ws: Tensor, cdt, need: tuple, zero_dw: bool = True):
    f = dict(device=hs.device, dtype=cdt)
    return (torch.zeros_like(hs) if need[0] else None,
            (torch.zeros if zero_dw else torch.empty)(ws.shape, **f) if need[1] else None,
            torch.zeros(ws.shape[0], **f) if need[2] else None)


def _finish_gradients(ws: Tensor, bs: Optional[Tensor], dw32, db32, inv_t: float, dw_out: Optional[Tensor] = None):
    """dW, db in the weight's dtype (db gets its 1/T here; dW none: h already carries it);
    dW into `dw_out` where given (a buffer of the weight's shape and dtype)."""
    if db32 is not None:
        db32.mul_(inv_t)
    if dw32 is not None and dw_out is not None:
        return dw_out.copy_(dw32), None if db32 is None else (db32 if bs.dtype == db32.dtype else db32.to(bs.dtype))
    dw = None if dw32 is None else (dw32 if ws.dtype == dw32.dtype else dw32.to(ws.dtype))
    db = None if db32 is None else (db32 if bs.dtype == db32.dtype else db32.to(bs.dtype))
    return dw, db


def torch_backward(grads: tuple, student: LinearHead, teacher: Optional[LinearHead], targets: Tensor,
                   keep: Tensor, stats: Tensor, params: DistillParams, need: tuple) -> tuple:
    """Recompute the chunks and reduce dL/ds (s = logits / T) into dH, dW, db.

    `grads` = (g_div, g_lp, g_ent), each [N] or None; `need` = (need_dh, need_dw, need_db).
    Returns (dh, dw, db), None where not needed.

    Each recomputed student chunk is centred on the saved log-sum-exp in base 2 in one
    pass, ls2 = log2 p = (s - lse_s)·log2(e), so p = exp2(ls2). Per token, with
    δ = log p - log q = (s - t) - dlse (s - t straight from the two logit chunks, exact
    where p ≈ q; dlse the forward's precise lse_s - lse_t):
      log-prob:  g_lp (1[v=y] - p)
      entropy:   -g_H p (ls + H)
      reverse:   g_kl p (δ - KL)
      forward:   g_kl (p - q) = -g_kl (p expm1(min(-δ, 1/2)) + relu(q - √e p))   (exact,
                 relative precision where q ≈ p, no overflow)
      JSD:       (1-β) g_kl p ((δ - u(δ)) - KL(p‖M)),  δ - u = -log1p(β expm1(-δ))
    so dL/ds = p ⊙ (A + B·ls2 + D·X) (+ the forward-KL relu term and the one-hot) with
    per-token A, B, D and one divergence tensor X per chunk (s - t, or a function of -δ):
    a handful of [rows, chunk] passes and one exp2 (two for the forward KL). Working with
    s - t and centred logits rather than raw logits keeps the O(|s|) parts from
    cancelling for the dominant tokens. Hidden rows are pre-multiplied by 1/T, so
    dW = (dL/ds)^T (h/T) needs no extra scaling and dH, db get one 1/T at the end.
    """
    hs, ws, bs = head_tensors(student)
    ht, wt, bt = head_tensors(teacher)
    cdt = compute_dtype(hs, ht)
    dh, dw32, db32 = _gradient_buffers(hs, ws, cdt, need)
    inv_t = 1.0 / params.temperature
    kept = keep.nonzero().squeeze(1)
    n_kept = kept.numel()
    if n_kept > 0 and any(g is not None for g in grads):
        rows_per_block, vchunk = _block_plan(n_kept, params.vocab_size, int(params.chunk_size or 0),
                                             int(params.token_chunk or 0), False)
        wk = _Workspace(rows_per_block, vchunk, hs.device, cdt)
        for r0 in range(0, n_kept, rows_per_block):
            rows = kept[r0:r0 + rows_per_block]
            src_t = None
            if grads[0] is not None:
                src_t = _HeadLogits(ht.index_select(0, rows), wt, bt, inv_t, cdt)
            st = stats.index_select(1, rows).to(cdt)
            coef = _dlogit_coefficients(tuple(None if g is None else g.index_select(0, rows) for g in grads), st,
                                        params.divergence, params.beta)
            dh32 = _block_gradients(_HeadLogits(hs.index_select(0, rows), ws, bs, inv_t, cdt), src_t, targets.index_select(0, rows).long(),
                                    coef, st, params, vchunk, need, dw32, db32, wk)
            if need[0]:
                dh.index_copy_(0, rows, dh32.mul_(inv_t).to(dh.dtype))
    return (dh,) + _finish_gradients(ws, bs, dw32, db32, inv_t)


def _machine_bytes(device) -> int:
    """The memory of the machine (CPU) or accelerator a call runs on, in bytes (0 if unknown)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return 0


def _resident_machine_bytes(device) -> int:
    """`_machine_bytes`, or MEMOPD_RESIDENT_MACHINE_BYTES where set (0 gives the plan
    without the machine's share: the benchmarks' before/after switch)."""
    env = os.environ.get("MEMOPD_RESIDENT_MACHINE_BYTES")
    return int(env) if env else _machine_bytes(device)


def _resident_plan(n_rows: int, V: int, H: int, n_heads: int, elem: int, chunk_size: int,
                   token_chunk: int, machine_bytes: int = 0) -> tuple[int, int]:
    """(rows per token block, vocabulary columns per chunk) of the forward that keeps its
    logits for the gradient.

    The block's resident logits (`n_heads` × rows × V) may take the largest of: half the
    bytes of the weight gradient that the call returns anyway, _RESIDENT_MIN_BYTES, and
    the machine's share (1/_RESIDENT_MACHINE_SHARE of `machine_bytes`, up to what
    _RESIDENT_ROWS rows need: blocks that short make the logits GEMMs ~15% slower than
    unchunked on CPU, 512-row ones a few percent). A block holds at most a quarter of the
    kept tokens, or half of them where half is _RESIDENT_ROWS or more: the peak above the
    inputs is then dW plus a bounded number of rows whatever N is, and never the batch's
    [N, V] logits. Rows are clamped to [_TORCH_MIN_ROWS / 2, _TORCH_TOKEN_CHUNK] and split
    evenly over the kept tokens; an explicit `token_chunk_size` / `chunk_size` takes
    precedence.
    """
    if token_chunk <= 0:
        row_bytes = n_heads * V * elem
        machine = min(_RESIDENT_ROWS * row_bytes, machine_bytes // _RESIDENT_MACHINE_SHARE)
        budget = max(_RESIDENT_MIN_BYTES, V * H * elem // 2, machine)
        half = -(-n_rows // 2)
        share = half if half >= _RESIDENT_ROWS else -(-n_rows // 4)
        cap = min(_TORCH_TOKEN_CHUNK, budget // row_bytes, share)
        cap = max(_TORCH_MIN_ROWS // 2, cap)
        n_blocks = -(-n_rows // cap)
        token_chunk = -(-n_rows // n_blocks)
    return _block_plan(n_rows, V, chunk_size, token_chunk, False)


BlockGrads = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple]


def token_weight_grads(weights: tuple) -> BlockGrads:
    """The block gradients of a loss whose per-token weights are known before the call,
    L = Σ_kept g_div·div + g_lp·logprob + g_ent·entropy, `weights` = (g_div, g_lp, g_ent),
    each [N] or None (`torch_forward_with_grads`): each block takes its rows of them."""
    def grads(rows, *_outputs):
        return tuple(None if g is None else g.index_select(0, rows) for g in weights)
    return grads


def torch_forward_with_grads(student: LinearHead, teacher: Optional[LinearHead], targets: Tensor, keep: Tensor,
                             params: DistillParams, block_grads: BlockGrads, need: tuple) -> tuple:
    """`torch_forward` plus the gradients of a loss known in the forward, in one sweep:
    (divergence, logprobs, entropy, stats, dh, dw, db), None where not needed.

    `block_grads(rows, div, lp, ent, stats)` gives, for one token block (the kept rows
    `rows` and their outputs), the loss's (dL/d div, dL/d logprob, dL/d entropy) per
    token, each [n] or None: weights fixed before the call (`token_weight_grads`: the
    reduced divergence, the teacher-less log-prob + entropy loss), the PPO terms for the
    actor loss. Each token block's logit
    chunks are computed once and kept (`_HeadLogits` with a resident buffer): the
    statistics pass reads them, then the gradient pass consumes them, so the call runs
    4 lm-head-sized matmuls (3 without a teacher) instead of the 6 of forward +
    recomputing backward (`_forward_resident`, then the backward's per-chunk dL/ds
    unchanged). The cost is holding the
    weight gradient from the forward on (the recomputing path is for callers who cannot,
    e.g. a ZeRO-3 weight gathered only for the forward) and `_resident_plan`'s rows.
    """
    hs, ws, bs = head_tensors(student)
    ht, wt, bt = head_tensors(teacher)
    V = params.vocab_size
    N = hs.shape[0]
    cdt = compute_dtype(hs, ht)
    f = dict(device=hs.device, dtype=cdt)
    div, lp, ent, stats = _zero_outputs(N, hs.device, cdt)
    dw_first = need[1] and _bf16_route(hs, ws)  # the bf16 GEMM writes dW in its first block: not zeroed
    dh, dw32, db32 = _gradient_buffers(hs, ws, cdt, need, zero_dw=not dw_first)
    inv_t = 1.0 / params.temperature
    kept = keep.nonzero().squeeze(1)
    n_kept = kept.numel()
    dw_home = None
    if n_kept > 0:
        n_heads = 1 if ht is None else 2
        elem = torch.empty((), dtype=cdt).element_size()
        rows_per_block, vchunk = _resident_plan(n_kept, V, ws.shape[1], n_heads, elem,
                                                int(params.chunk_size or 0), int(params.token_chunk or 0),
                                                _resident_machine_bytes(hs.device))
        wk = _Workspace(rows_per_block, vchunk, hs.device, cdt)
        res_n = rows_per_block * V
        if dw_first and ws.dtype == torch.bfloat16 and rows_per_block * elem <= 2 * ws.shape[1]:
            # the returned bf16 dW will live in the student's resident buffer once its last
            # block is done: memory already touched (a fresh one costs ~0.3 ms a MiB on CPU
            # in page faults), and no bigger than dW, so the gradient holds nothing spare
            res_n = max(res_n, -(-ws.numel() * 2 // elem))
            dw_home = True
        res_s = torch.empty(res_n, **f)
        res_t = None if ht is None else torch.empty(rows_per_block * V, **f)
        for r0 in range(0, n_kept, rows_per_block):
            rows = kept[r0:r0 + rows_per_block]
            n = rows.numel()
            src_s = _HeadLogits(hs.index_select(0, rows), ws, bs, inv_t, cdt, res_s[: n * V])
            src_t = None
            if ht is not None:
                src_t = _HeadLogits(ht.index_select(0, rows), wt, bt, inv_t, cdt, res_t[: n * V])
            y = targets.index_select(0, rows).long()
            d_, l_, e_, st = _forward_resident(src_s, src_t, y, V, params.divergence, params.beta, vchunk, wk)
            div.index_copy_(0, rows, d_)
            lp.index_copy_(0, rows, l_)
            ent.index_copy_(0, rows, e_)
            stats.index_copy_(1, rows, st)
            grads = block_grads(rows, d_, l_, e_, st)
            if not any(need) or all(g is None for g in grads):
                continue
            coef = _dlogit_coefficients(grads, st, params.divergence, params.beta)
            dh32 = _block_gradients(src_s, src_t, y, coef, st, params, vchunk, need, dw32, db32, wk, dw_first)
            dw_first = False
            if need[0]:
                dh.index_copy_(0, rows, dh32.mul_(inv_t).to(dh.dtype))
        if dw_home:
            del src_s, src_t
            dw_home = torch.empty(0, dtype=ws.dtype, device=ws.device).set_(res_s.untyped_storage(), 0, ws.shape)
    if dw_first:  # no token block took gradients
        dw32.zero_()
    dw, db = _finish_gradients(ws, bs, dw32, db32, inv_t, dw_home)
    return div, lp, ent, stats, dh, dw, db


# ----------------------------------------------------------------------------------
# custom ops + autograd
