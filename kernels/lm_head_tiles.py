"""Triton tiles shared by the kernels that stream an lm_head over the vocabulary (the
fused distillation / log-prob op, `memopd.kernels.fused_distill`, and the fused actor loss,
`memopd.kernels.actor_loss`): the logits tile h @ W^T (+ b) and a kernel that writes
a chunk of scaled logits to scratch, the deterministic dH / dW
GEMMs over a dlogits scratch (dH optionally split over the vocabulary, `dh_splits`, with
a fixed-order reduction), accurate expm1 / log1p for small arguments, the device-side
compaction of kept rows, and the sizing of the dlogits scratch.

Every launcher here assumes validated, contiguous inputs. Rows are addressed through
`order` (kept rows first) and `count` (their number, a device tensor) from `compaction`,
so a chunk past the last kept row runs its loops zero times without a host sync.

Scratch rows (`new_scratch`) are padded to a multiple of SCRATCH_ROW_ALIGN elements and the
padding holds zeros: every kernel that reads or writes a scratch row bounds its row mask
by the row stride, not by V, so the mask is uniform over 16-byte vectors and the accesses
stay vectorised for any vocabulary size (Qwen2.5's tokenizer has 151,665 entries: masked
by V, every scratch access became a scalar one). Columns >= V are written as zeros and
read as zeros, so they never contribute.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .contract import LinearHead
from .runtime import INTERPRET, dot_precision, or_dummy, upcast

__all__ = ["expm1_small", "log1p_small", "logits_tile", "scaled_logits_kernel", "logits_meta", "launch_scaled_logits",
           "dh_tile", "dh_kernel", "dh_split_kernel", "dh_reduce_kernel", "dh_splits", "dh_split_width",
           "wave_fill", "multiprocessor_count", "dw_kernel", "dw_program_tile", "dw_grid",
           "launch_dh", "launch_dw", "store_grad_piece", "grad_scratch_dtype", "dh_split_plan",
           "ChunkGradients", "GEMM_GPU", "GEMM_GPU_FP32", "GEMM_INTERP", "gemm_meta", "compaction",
           "SCRATCH_ROW_ALIGN", "scratch_row_stride", "new_scratch", "default_token_chunk"]


# plain exp/log so that the helpers exist in every Triton version
@triton.jit
def expm1_small(x):
    # Kahan's trick: accurate expm1 for |x| < 1 from exp and log only.
    u = tl.exp(x)
    um1 = u - 1.0
    safe = tl.where(um1 == 0.0, 1.0, um1)
    return tl.where(um1 == 0.0, x, safe * x / tl.log(tl.where(um1 == 0.0, 2.0, u)))


@triton.jit
def log1p_small(x):
    # Kahan's trick: accurate log1p for |x| < 1.
    u = 1.0 + x
    um1 = u - 1.0
    safe = tl.where(um1 == 0.0, 1.0, um1)
    return tl.where(um1 == 0.0, x, tl.log(tl.where(um1 == 0.0, 2.0, u)) * x / safe)


@triton.jit
def logits_tile(h_ptr, w_ptr, b_ptr, rows64, row_ok, cols, col_ok, H, stride_h, stride_w,
                 k_end, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Raw logits tile h[rows] @ w[cols]^T (+ b[cols]) in fp32, [BLOCK_N, BLOCK_V]."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    cols64 = cols.to(tl.int64)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < H
        h = tl.load(h_ptr + rows64[:, None] * stride_h + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols64[:, None] * stride_w + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PREC)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    return acc


@triton.jit
def scaled_logits_kernel(
    h_ptr, w_ptr, b_ptr, order_ptr, count_ptr, out_ptr,
    H, V, c0, n_rows, stride_h, stride_w, stride_out, inv_temp,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[i, v] = (h[order[c0 + i]] @ w[v] + b[v]) / T for the kept rows of the chunk."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    count = tl.load(count_ptr)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_chunk = local < n_rows
    row_ok = in_chunk & (c0 + local < count)
    rows64 = tl.load(order_ptr + c0 + local, mask=in_chunk, other=0).to(tl.int64)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    k_end = tl.where(c0 + pid_n * BLOCK_N < count, H, 0)
    acc = logits_tile(h_ptr, w_ptr, b_ptr, rows64, row_ok, cols, col_ok, H, stride_h, stride_w, k_end,
                       HAS_BIAS, UPCAST, PREC, BLOCK_N, BLOCK_V, BLOCK_K)
    out = out_ptr + local.to(tl.int64)[:, None] * stride_out + cols[None, :]
    # acc is 0 past V (masked W and bias): the padded scratch row is written whole, with a
    # stride-bounded mask that stays vectorised for an odd V (lm_head_tiles: scratch layout)
    tl.store(out, acc * inv_temp, mask=in_chunk[:, None] & (cols < stride_out)[None, :])


@triton.jit
def dh_tile(g_ptr, w_ptr, local, in_chunk, hh, h_ok, k_lo, k_hi, V, stride_g, stride_w,
            UPCAST: tl.constexpr, PREC: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_H] tile of dlogits[local, k_lo:k_hi] @ W[k_lo:k_hi, hh]."""
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < V
        # the scratch row is stride_g wide with zeros past V (see the module docstring)
        a = tl.load(g_ptr + local.to(tl.int64)[:, None] * stride_g + kk[None, :],
                    mask=in_chunk[:, None] & (kk < stride_g)[None, :], other=0.0)
        b = tl.load(w_ptr + kk.to(tl.int64)[:, None] * stride_w + hh[None, :],
                    mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=PREC)
    return acc


@triton.jit
def store_grad_piece(g_row, cols, out, stride_g):
    """Store a piece of a dL/dlogits row (fp32 values, zeros past V) into the gradient
    scratch, whole padded row bounded by its stride (vectorised for any V). A 16-bit
    scratch gets the values rounded to nearest even: the GEMMs' own conversion of an fp32
    operand, spelled out because the interpreter's default conversion truncates."""
    if g_row.dtype.element_ty != tl.float32:
        out = out.to(g_row.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(g_row + cols, out, mask=cols < stride_g)


@triton.jit
def dh_kernel(
    g_ptr, w_ptr, order_ptr, count_ptr, dh_ptr,
    V, H, c0, n_rows, stride_g, stride_w, stride_dh,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dH[order[c0 + i]] = dlogits[i] @ W  (rows of masked tokens get zeros)."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    count = tl.load(count_ptr)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_chunk = local < n_rows
    rows = tl.load(order_ptr + c0 + local, mask=in_chunk, other=0).to(tl.int64)
    hh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    active = c0 + pid_m * BLOCK_M < count
    k_end = tl.where(active, V, 0)
    acc = dh_tile(g_ptr, w_ptr, local, in_chunk, hh, h_ok, 0, k_end, V, stride_g, stride_w,
                  UPCAST, PREC, BLOCK_M, BLOCK_H, BLOCK_K)
    tl.store(dh_ptr + rows[:, None] * stride_dh + hh[None, :], acc.to(dh_ptr.dtype.element_ty),
             mask=in_chunk[:, None] & h_ok[None, :])


@triton.jit
def dh_split_kernel(
    g_ptr, w_ptr, count_ptr, part_ptr,
    V, H, c0, n_rows, k_per_split, stride_g, stride_w,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """part[split, i] = dlogits[i, K_split] @ W[K_split] over one share K_split of the
    vocabulary (k_per_split columns, a multiple of BLOCK_K): the dH GEMM split over V so
    that a chunk of few token blocks still fills the GPU. `dh_reduce_kernel` adds the
    shares in split order (deterministic)."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    count = tl.load(count_ptr)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_chunk = local < n_rows
    hh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    active = c0 + pid_m * BLOCK_M < count
    k_lo = split * k_per_split
    k_hi = tl.where(active, tl.minimum(k_lo + k_per_split, V), k_lo)
    acc = dh_tile(g_ptr, w_ptr, local, in_chunk, hh, h_ok, k_lo, k_hi, V, stride_g, stride_w,
                  UPCAST, PREC, BLOCK_M, BLOCK_H, BLOCK_K)
    out = part_ptr + (split.to(tl.int64) * n_rows + local.to(tl.int64))[:, None] * H + hh[None, :]
    tl.store(out, acc, mask=in_chunk[:, None] & h_ok[None, :])


@triton.jit
def dh_reduce_kernel(
    part_ptr, order_ptr, dh_ptr, H, c0, n_rows, n_splits, stride_dh,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """dH[order[c0 + i]] = sum over splits of part[split, i], in split order."""
    local = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_chunk = local < n_rows
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = in_chunk[:, None] & (hh < H)[None, :]
    rows = tl.load(order_ptr + c0 + local, mask=in_chunk, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for s in range(0, n_splits):
        p = part_ptr + (s * n_rows + local.to(tl.int64))[:, None] * H + hh[None, :]
        acc += tl.load(p, mask=ok, other=0.0)
    tl.store(dh_ptr + rows[:, None] * stride_dh + hh[None, :], acc.to(dh_ptr.dtype.element_ty), mask=ok)


@triton.jit
def dw_program_tile(pid, n_h_tiles):
    """(vocabulary tile, hidden tile) of dW program `pid` of the 1-D grid `dw_grid`.

    Hidden tiles run fastest: the programs that read one dlogits slab (one vocabulary
    tile, every hidden tile) are adjacent, so the slab comes from HBM once and from L2
    for the others. With vocabulary tiles fastest they ran ~V / BLOCK_M programs apart
    and every hidden tile streamed the whole scratch again. Plain integer arithmetic, so
    the host (tests, cost model) can evaluate it through `dw_program_tile.fn`.
    """
    return pid // n_h_tiles, pid % n_h_tiles


@triton.jit
def dw_kernel(
    g_ptr, h_ptr, order_ptr, count_ptr, dw_ptr,
    V, H, c0, n_rows, stride_g, stride_h, stride_dw,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dW32[v] += sum_i dlogits[i, v] * h[order[c0 + i]]  (fp32 buffer, fixed order)."""
    pid_m, pid_h = dw_program_tile(tl.program_id(0), tl.cdiv(H, BLOCK_H))
    count = tl.load(count_ptr)
    vv = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    v_ok = vv < V
    hh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    # Only kept tokens of this chunk contribute: loop bound from device memory.
    k_end = tl.minimum(tl.maximum(count - c0, 0), n_rows)
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_end
        # zeros past V in the padded scratch row: those dW rows get nothing (store mask v_ok)
        a = tl.load(g_ptr + kk.to(tl.int64)[:, None] * stride_g + vv[None, :],
                    mask=k_ok[:, None] & (vv < stride_g)[None, :], other=0.0)
        rows = tl.load(order_ptr + c0 + kk, mask=k_ok, other=0).to(tl.int64)
        b = tl.load(h_ptr + rows[:, None] * stride_h + hh[None, :],
                    mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a.to(b.dtype)), b, acc, input_precision=PREC)
    out = dw_ptr + vv.to(tl.int64)[:, None] * stride_dw + hh[None, :]
    omask = v_ok[:, None] & h_ok[None, :]
    prev = tl.load(out, mask=omask, other=0.0)
    tl.store(out, prev + acc, mask=omask)


# Fixed GEMM tiling for the (non-idempotent) dW accumulation and for dH: autotuning a
# kernel that accumulates into its output would corrupt it across benchmark runs.
GEMM_GPU = dict(BLOCK_M=128, BLOCK_H=128, BLOCK_K=64, num_warps=8, num_stages=3)
GEMM_GPU_FP32 = dict(BLOCK_M=64, BLOCK_H=64, BLOCK_K=32, num_warps=4, num_stages=2)
GEMM_INTERP = dict(BLOCK_M=32, BLOCK_H=32, BLOCK_K=32)


def gemm_meta(fp32: bool):
    if INTERPRET:
        return dict(GEMM_INTERP)
    return dict(GEMM_GPU_FP32 if fp32 else GEMM_GPU)


def dw_grid(V: int, H: int, meta: dict) -> tuple:
    """Launch grid of `dw_kernel`: one program per (vocabulary tile, hidden tile), in the
    order of `dw_program_tile`."""
    return (triton.cdiv(V, meta["BLOCK_M"]) * triton.cdiv(H, meta["BLOCK_H"]),)


def logits_meta(fp32: bool):
    if INTERPRET:
        return dict(BLOCK_N=32, BLOCK_V=64, BLOCK_K=32)
    if fp32:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)


def launch_scaled_logits(head: LinearHead, order, count, out, c0, n_rows, V, inv_t):
    h, w, b = head.hidden, head.weight, head.bias
    meta = logits_meta(h.dtype == torch.float32)
    grid = (triton.cdiv(n_rows, meta["BLOCK_N"]), triton.cdiv(V, meta["BLOCK_V"]))
    scaled_logits_kernel[grid](
        h, w, or_dummy(b, w), order, count, out,
        h.shape[1], V, c0, n_rows, h.stride(0), w.stride(0), out.stride(0), inv_t,
        HAS_BIAS=b is not None, UPCAST=upcast(h.dtype, w.dtype), PREC=dot_precision(h.dtype), **meta,
    )


def launch_dh(g, w, order, count, dh, V, c0, n_rows, upcast, prec, meta, splits=1, partials=None):
    """dH[order[c0 + i]] = g[i, :V] @ w[:V] for the n_rows rows of one chunk of scratch g.

    splits > 1 splits the vocabulary (the GEMM's K) into that many shares, one program
    per (token block, hidden block, share), with fp32 partial sums in `partials` (at
    least [splits, n_rows, H] fp32, allocated when None) that a second kernel adds in a
    fixed order: deterministic, and equal to splits=1 up to fp32 summation order. See
    `dh_splits` for when it pays. `partials` may be any contiguous fp32 buffer that large
    (it is addressed as [splits, n_rows, H])."""
    H = dh.shape[1]
    if splits <= 1:
        grid = (triton.cdiv(n_rows, meta["BLOCK_M"]), triton.cdiv(H, meta["BLOCK_H"]))
        dh_kernel[grid](g, w, order, count, dh, V, H, c0, n_rows, g.stride(0), w.stride(0), dh.stride(0),
                        UPCAST=upcast, PREC=prec, **meta)
        return
    k_per = dh_split_width(V, splits, meta)
    splits = triton.cdiv(V, k_per)
    if partials is None:
        partials = torch.empty((splits, n_rows, H), device=g.device, dtype=torch.float32)
    if partials.dtype != torch.float32 or not partials.is_contiguous() or partials.numel() < splits * n_rows * H:
        raise ValueError(f"launch_dh: partials must be a contiguous fp32 buffer of at least {splits} x {n_rows} x {H} "
                         f"elements, got {partials.dtype} {tuple(partials.shape)}")
    grid = (triton.cdiv(n_rows, meta["BLOCK_M"]), triton.cdiv(H, meta["BLOCK_H"]), splits)
    dh_split_kernel[grid](g, w, count, partials, V, H, c0, n_rows, k_per, g.stride(0), w.stride(0),
                          UPCAST=upcast, PREC=prec, **meta)
    r = DH_REDUCE_INTERP if INTERPRET else DH_REDUCE_GPU
    grid = (triton.cdiv(n_rows, r["BLOCK_M"]), triton.cdiv(H, r["BLOCK_H"]))
    dh_reduce_kernel[grid](partials, order, dh, H, c0, n_rows, splits, dh.stride(0), **r)


# The reduction of the dH shares: an elementwise sum, memory-bound (fp32 partials of a
# chunk are a few tens of MB); 16 B loads per thread.
DH_REDUCE_GPU = dict(BLOCK_M=16, BLOCK_H=256, num_warps=4)
DH_REDUCE_INTERP = dict(BLOCK_M=16, BLOCK_H=32)
MAX_DH_SPLITS = 8
MIN_DH_SPLIT_K_STEPS = 16  # BLOCK_K steps per share at least: the partial sums stay a small cost


def dh_split_width(V: int, splits: int, meta: dict) -> int:
    """Vocabulary columns per dH share: a multiple of BLOCK_K, so only the last share is ragged."""
    return triton.cdiv(triton.cdiv(V, meta["BLOCK_K"]), splits) * meta["BLOCK_K"]


def wave_fill(n_programs: int, n_sms: int) -> float:
    """Fraction of the SMs' time a grid of equal, long programs keeps busy: programs over
    whole waves of n_sms."""
    return n_programs / (triton.cdiv(n_programs, n_sms) * n_sms) if n_programs else 0.0


def dh_splits(n_rows: int, H: int, V: int, meta: dict, n_sms: int) -> int:
    """Vocabulary shares of the dH GEMM for one chunk: the count in 1..MAX_DH_SPLITS (each
    share at least MIN_DH_SPLIT_K_STEPS BLOCK_K steps) whose grid fills n_sms SMs best,
    the fewest among equals. Every dH program runs the whole K loop, so a grid of
    (token blocks x hidden blocks) programs short of a whole number of waves leaves SMs
    idle for the whole GEMM: 6 x 16 = 96 programs on 132 SMs use 73 % of them."""
    tiles = triton.cdiv(n_rows, meta["BLOCK_M"]) * triton.cdiv(H, meta["BLOCK_H"])
    most = max(1, min(MAX_DH_SPLITS, triton.cdiv(V, meta["BLOCK_K"]) // MIN_DH_SPLIT_K_STEPS))
    best, best_fill = 1, wave_fill(tiles, n_sms)
    for s in range(2, most + 1):
        s_eff = triton.cdiv(V, dh_split_width(V, s, meta))  # the shares launch_dh launches
        fill = wave_fill(tiles * s_eff, n_sms)
        if fill > best_fill + 1e-9:
            best, best_fill = s_eff, fill
    return best


def multiprocessor_count(device) -> int:
    """SMs of a CUDA device (cached by torch); 1 elsewhere (the interpreter: no waves)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def grad_scratch_dtype(gemm_dtype: torch.dtype, need_db: bool) -> torch.dtype:
    """dtype of the dL/dlogits scratch the dH / dW GEMMs read (gemm_dtype: that of the
    hidden states and weight, one dtype per head). The compiled GEMMs round it to that
    dtype before `tl.dot` anyway, so for 16-bit heads the row kernels store it rounded,
    with the same round-to-nearest-even conversion (`store_grad_piece`): the same GEMM
    operands, half the bytes written and read, and the GEMMs' plain 16-bit operand path.
    fp32 (the student's logits scratch itself, in place) for fp32 heads, and where a bias
    gradient is needed: it is summed from the unrounded values. (The interpreter's GEMMs
    upcast to fp32; with a 16-bit scratch they then compute from the same rounded values
    as the GPU.)"""
    if need_db or gemm_dtype not in (torch.bfloat16, torch.float16):
        return torch.float32
    return gemm_dtype


def dh_split_plan(n_rows: int, H: int, V: int, meta: dict, device) -> int:
    """`dh_splits` on `device`'s SMs: the one place the launchers ask, so that tests can
    force a split under the interpreter."""
    return dh_splits(n_rows, H, V, meta, multiprocessor_count(device))


class ChunkGradients:
    """dH, dW and db of an lm-head call whose row kernel writes dL/dlogits chunk by chunk
    (the actor loss; the distillation ops with their gradients in the forward): the
    gradient scratch (`grad_scratch_dtype`: a 16-bit buffer, or the student's fp32 logits
    scratch itself, in place), the dH vocabulary-split plan of the full and the last chunk
    with one fp32 buffer of partial sums for both, and the GEMM launches of a chunk.

    dh / dw32 / db32 are the outputs (None where not needed); dw32 and db32 accumulate
    over the chunks in fp32."""

    def __init__(self, student: LinearHead, vocab_size: int, chunk: int, logits_scratch: torch.Tensor,
                 dh: torch.Tensor | None, dw32: torch.Tensor | None, db32: torch.Tensor | None):
        hs, ws = student.hidden, student.weight
        N, H = hs.shape
        self.hs, self.ws, self.V = hs, ws, vocab_size
        self.dh, self.dw32, self.db32 = dh, dw32, db32
        self.prec = dot_precision(ws.dtype)
        self.meta = gemm_meta(self.prec == "ieee")
        self.upcast = upcast(hs.dtype, ws.dtype)
        dtype = torch.float32
        if dh is not None or dw32 is not None or db32 is not None:
            dtype = grad_scratch_dtype(ws.dtype if hs.dtype == ws.dtype else torch.float32, db32 is not None)
        self.scratch = logits_scratch if dtype == torch.float32 else new_scratch(chunk, vocab_size, dtype, hs.device)
        last = N - (N - 1) // chunk * chunk
        self.plan = {n: dh_split_plan(n, H, vocab_size, self.meta, hs.device) if dh is not None else 1
                     for n in {chunk, last}}
        n_part = max((sp * n * H for n, sp in self.plan.items() if sp > 1), default=0)
        self.partials = torch.empty(n_part, device=hs.device, dtype=torch.float32) if n_part else None

    def run(self, order: torch.Tensor, count: torch.Tensor, c0: int, n_rows: int) -> None:
        """The GEMMs of the chunk of n_rows token rows at c0 (its rows in `self.scratch`)."""
        g, V = self.scratch, self.V
        if self.dh is not None:
            launch_dh(g, self.ws, order, count, self.dh, V, c0, n_rows, self.upcast, self.prec, self.meta,
                      splits=self.plan[n_rows], partials=self.partials)
        if self.dw32 is not None:
            launch_dw(g, self.hs, order, count, self.dw32, V, c0, n_rows, self.upcast, self.prec, self.meta)
        if self.db32 is not None:
            # rows of masked tokens are zeros in the scratch; torch's sum is deterministic
            self.db32[:V] += g[:n_rows, :V].sum(0)


def launch_dw(g, h, order, count, dw32, V, c0, n_rows, upcast, prec, meta):
    """dW32[:V] += g[:n_rows, :V]^T @ h[order[c0:c0 + n_rows]] for one chunk of scratch g."""
    H = dw32.shape[1]
    dw_kernel[dw_grid(V, H, meta)](g, h, order, count, dw32, V, H, c0, n_rows, g.stride(0), h.stride(0),
                                   dw32.stride(0), UPCAST=upcast, PREC=prec, **meta)


def compaction(keep: torch.Tensor):
    """Kept rows first (stable), and their count as a device tensor: no host sync."""
    order = torch.argsort((~keep).to(torch.int8), stable=True).to(torch.int32)
    count = keep.sum(dtype=torch.int32).reshape(1)
    return order, count


SCRATCH_ROW_ALIGN = 64  # elements: 128 B rows in bf16, 256 B in fp32


def scratch_row_stride(vocab_size: int) -> int:
    """Row stride (elements) of a [rows, vocab_size] scratch: the next multiple of SCRATCH_ROW_ALIGN."""
    return -(-vocab_size // SCRATCH_ROW_ALIGN) * SCRATCH_ROW_ALIGN


def new_scratch(rows: int, vocab_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A [rows, scratch_row_stride(vocab_size)] buffer whose padding columns are zero (the
    kernels keep them zero); callers address it with its stride and bound columns by V."""
    buf = torch.empty((rows, scratch_row_stride(vocab_size)), device=device, dtype=dtype)
    buf[:, vocab_size:].zero_()
    return buf


def default_token_chunk(n_tokens: int, vocab_size: int, elem_bytes: int) -> int:
    """Rows of the backward dlogits scratch: ~512 MiB by default (MEMOPD_DISTILL_SCRATCH_MB),
    counted at the padded row stride (`scratch_row_stride`).

    Each chunk adds one read-modify-write of the fp32 dW buffer (V x H x 8 bytes, ~4 GB
    at Qwen2.5-7B shapes), so fewer, larger chunks are faster; the budget bounds memory.
    """
    budget = int(float(os.environ.get("MEMOPD_DISTILL_SCRATCH_MB", "512")) * 2**20)
    rows = max(128, budget // max(1, scratch_row_stride(vocab_size) * elem_bytes))
    rows = (rows // 128) * 128
    return max(1, min(rows, n_tokens))
