"""Roofline cost model of the lm-head Triton kernels at Qwen2.5-3B shapes, computed on CPU
from the launchers' own grids, tiles and program orders (no GPU, nothing is run).

    python3 benchmarks/gpu_cost_model.py [--tokens 16384] [--vocab 151665] [--json predictions.jsonl]
                                         [--hbm-tbps 3.0] [--gemm-tflops 790]

Per kernel and per op call (all token chunks of the backward): FLOPs, the bytes its
programs request from memory, the HBM bytes left after an L2 model, and the predicted
time and fraction of peak. What it models, and what it does not:

* Grids, tiles and token chunks are the launchers' (`_split_plan`, `_configs(...)[0]` (the
  fixed choice when autotuning is off), `fwd_grid` / `fwd_program_block`, `gemm_meta`,
  `dw_grid` / `dw_program_tile`, `default_token_chunk`, `distill_rows.chunk_rows` /
  `rows_block`, `scratch_row_stride`), imported, not copied.
* L2: programs run in program-id order, CONCURRENT_PROGRAMS at a time (one wave). Each
  program's operand slabs (a block of token rows, a block of W rows or columns, a scratch
  slab) are read from HBM once per wave (the programs of a wave stream a shared slab in
  near lockstep) and then stay in a least-recently-used cache of L2_BYTES for later
  waves. Real waves overlap and slabs stream tile by tile, so this is coarse: it separates
  an order that re-reads a slab ~V / 128 programs later (a miss) from one that re-reads it
  in the same wave (a hit), not a 20 % difference.
* Two kernels are stepped finer: the distillation forward, whose programs re-read their
  hidden rows with every vocabulary tile (a wave's programs step through their tiles
  together, each step's reads through the same L2 model), and the distillation row
  kernel (one program per token; its sweeps stream from HBM unless the rows of all
  resident programs fit in L2, which at these vocabularies they do not).
* Time = max(FLOPs / MATMUL_SUSTAINED, HBM bytes / HBM_BYTES_PER_S); the fraction of peak
  is FLOPs / (time x PEAK_BF16). No launch overheads, no occupancy; of the tails only the
  dH GEMM's, whose few long programs per chunk leave SMs idle (its compute time divided
  by `wave_fill` over CONCURRENT_PROGRAMS SMs; the logits and dW grids fill >= 99 %).
* The per-token reductions, the compaction and the bias sum are left out (O(N + V)).

Bound and band. The time above is an upper bound on the speed, not a prediction: every
Triton GEMM at the stated rate (`--gemm-tflops`, default 790 TFLOP/s: faster than
cuBLAS's own lm-head forward + backward), perfect overlap of compute and memory. Beside
it, per op, a realistic band at the device's bandwidth (`--hbm-tbps`: gpu_check.sh passes
the copy rate it measured; H100 ~3.0, H200 ~4.3 TB/s): its fast end runs the GEMMs at
cuBLAS's lm-head rate (CUBLAS_LM_HEAD_FRAC of peak) with perfect overlap, its slow end
at TRITON_OF_CUBLAS of that rate with no overlap (compute and memory times added). The
kernel table and the `ms` / `peak` of `--json` are the bound; `band_peak` is the band.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections import OrderedDict

os.environ.setdefault("MEMOPD_TRITON_AUTOTUNE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import memopd.kernels.actor_loss as al  # noqa: E402
import memopd.kernels.distill_rows as dr  # noqa: E402
import memopd.kernels.fused_distill as fd  # noqa: E402
from memopd.kernels.contract import Divergence  # noqa: E402
from memopd.kernels.lm_head_tiles import (  # noqa: E402
    GEMM_GPU,
    default_token_chunk,
    dh_split_width,
    dh_splits,
    dw_grid,
    dw_program_tile,
    grad_scratch_dtype,
    logits_meta,
    scratch_row_stride,
    wave_fill,
)

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 tensor-core peak, FLOP/s
MATMUL_SUSTAINED = 790e12  # what a large bf16 matmul measures on them (--gemm-tflops)
HBM_BYTES_PER_S = 4.3e12  # H200's copy rate; an H100 SXM measures ~3.0e12 (--hbm-tbps)
CUBLAS_LM_HEAD_FRAC = 0.74  # cuBLAS's lm-head forward + backward, of PEAK_BF16: the band's fast end
TRITON_OF_CUBLAS = 0.8  # the band's slow end: Triton GEMMs at this fraction of cuBLAS's rate
L2_BYTES = 50 * 2**20
CONCURRENT_PROGRAMS = 132  # one program per SM: the 8-warp 128 x 128 tiles of these kernels
BF16, FP32 = 2, 4

STUDENT_H, TEACHER_H = 2048, 3584  # Qwen2.5-3B student, Qwen2.5-7B teacher
HEAD_ROWS = 151936  # rows of Qwen2.5's lm_head (padded)


class L2:
    """Slabs shared within a wave of concurrent programs, then a least-recently-used cache
    of whole slabs. Call `program()` before each program's reads, in launch order."""

    def __init__(self, capacity: int, concurrent: int = CONCURRENT_PROGRAMS):
        self.capacity, self.used, self.lines = capacity, 0, OrderedDict()
        self.concurrent, self.n_programs, self.wave = concurrent, 0, set()
        self.requested = self.hbm = 0

    def program(self):
        if self.n_programs % self.concurrent == 0:
            self.wave = set()
        self.n_programs += 1

    def read(self, key, nbytes: int):
        self.requested += nbytes
        if key in self.wave or key in self.lines:
            if key in self.lines:
                self.lines.move_to_end(key)
            return
        self.wave.add(key)
        self.hbm += nbytes
        self.lines[key] = nbytes
        self.used += nbytes
        while self.used > self.capacity and len(self.lines) > 1:
            _, b = self.lines.popitem(last=False)
            self.used -= b

    def write(self, nbytes: int):
        self.requested += nbytes
        self.hbm += nbytes


def _row(name, flops, cache, note="", compute_s=None):
    # compute_s: the compute time when the grid does not keep every SM busy (`wave_fill`)
    compute_s = flops / MATMUL_SUSTAINED if compute_s is None else compute_s
    t = max(compute_s, cache.hbm / HBM_BYTES_PER_S)
    bound = "memory" if cache.hbm / HBM_BYTES_PER_S > compute_s else "compute"
    return dict(kernel=name, tflop=flops / 1e12, requested_gb=cache.requested / 1e9, hbm_gb=cache.hbm / 1e9,
                ms=t * 1e3, peak=flops / (t * PEAK_BF16) if flops else 0.0,
                hbm_util=cache.hbm / (t * HBM_BYTES_PER_S), bound=bound, note=note,
                compute_s=compute_s, hbm_bytes=cache.hbm)


def retime_ms(row, gemm_flops_per_s: float, hbm_bytes_per_s: float, overlap: bool) -> float:
    """A kernel row's time at another GEMM rate and bandwidth; without `overlap`, its
    compute and memory times add up instead of hiding one another."""
    c = row["compute_s"] * MATMUL_SUSTAINED / gemm_flops_per_s
    m = row["hbm_bytes"] / hbm_bytes_per_s
    return (max(c, m) if overlap else c + m) * 1e3


def scenarios(hbm_bytes_per_s: float, gemm_flops_per_s: float) -> dict:
    """(GEMM rate, bandwidth, overlap) of the bound and of the band's two ends."""
    cublas = CUBLAS_LM_HEAD_FRAC * PEAK_BF16
    return {"bound": (gemm_flops_per_s, hbm_bytes_per_s, True), "band_fast": (cublas, hbm_bytes_per_s, True),
            "band_slow": (TRITON_OF_CUBLAS * cublas, hbm_bytes_per_s, False)}


def op_band(rows, ops, hbm_bytes_per_s: float, gemm_flops_per_s: float) -> list[dict]:
    """Per op of `op_totals`: its time and useful fraction of peak in each scenario."""
    by_name = {r["kernel"]: r for r in rows}
    out = []
    for o in ops:
        d = dict(op=o["op"])
        for key, (g, b, overlap) in scenarios(hbm_bytes_per_s, gemm_flops_per_s).items():
            ms = sum(retime_ms(by_name[k], g, b, overlap) for k in o["kernels"])
            d[key] = (ms, o["useful_tflop"] * 1e12 / (ms / 1e3 * PEAK_BF16))
        out.append(d)
    return out


def distill_forward(N, V, order="launcher"):
    """The teacher-student forward over its 1-D grid (`fd.fwd_grid`) in the kernel's own
    program order (`fd.fwd_program_block`: splits fastest), or order="token-fastest", the
    order before it. Each program re-reads its token block's hidden rows with every
    vocabulary tile it computes, so the model steps the programs of a wave through their
    tiles together: per step every program reads its hidden rows and its split's weight
    tile (shared by the wave's programs of that split), through the L2 model."""
    c = fd._configs("fwd", Divergence.REVERSE_KL, False, True)[0].kwargs
    bn, bv = c["BLOCK_N"], c["BLOCK_V"]
    row_bytes = (STUDENT_H + TEACHER_H) * BF16
    splits, per = fd._split_plan(N, V, "cpu", row_bytes)
    n_tb = triton.cdiv(N, bn)
    (n_programs,) = fd.fwd_grid(N, splits, c)
    blocks = [fd.fwd_program_block.fn(pid, splits) if order == "launcher" else (pid % n_tb, pid // n_tb)
              for pid in range(n_programs)]
    cache, flops = L2(L2_BYTES, concurrent=1), 0
    for w0 in range(0, n_programs, CONCURRENT_PROGRAMS):
        wave = blocks[w0:w0 + CONCURRENT_PROGRAMS]
        for k in range(triton.cdiv(per, bv)):
            cache.program()  # one step of the whole wave: a tile read twice in it is shared
            for n, s in wave:
                v0 = s * per + k * bv
                cols = min(bv, V - v0, (s + 1) * per - v0)
                if cols <= 0:
                    continue
                rows = min(bn, N - n * bn)
                cache.read(("h", n), rows * row_bytes)
                cache.read(("w", s, k), cols * row_bytes)
                flops += 2 * rows * cols * (STUDENT_H + TEACHER_H)
    label = "fwd (KL, teacher)" if order == "launcher" else "fwd (KL, teacher, token blocks fastest: before)"
    return _row(label, flops, cache, f"{splits} splits, BLOCK_N={bn}, {order} order")


def _chunks(N, V, elem, chunk=None):
    # elem: the bytes per scratch element the launcher sizes its chunks by; chunk: a
    # launcher's own chunk rows instead
    chunk = min(default_token_chunk(N, V, elem), N) if chunk is None else chunk
    return [(c0, min(chunk, N - c0)) for c0 in range(0, N, chunk)], chunk


def distill_dlogits(N, V):
    c = fd._configs("dlogits", Divergence.REVERSE_KL, False, True)[0].kwargs
    bn, bv = c["BLOCK_N"], c["BLOCK_V"]
    chunks, chunk = _chunks(N, V, BF16)
    cache, flops = L2(L2_BYTES), 0
    for c0, n_rows in chunks:
        for v in range(triton.cdiv(V, bv)):
            cols = min(bv, V - v * bv)
            for n in range(triton.cdiv(n_rows, bn)):
                rows = min(bn, n_rows - n * bn)
                cache.program()
                cache.read(("hs", c0, n), rows * STUDENT_H * BF16)
                cache.read(("ht", c0, n), rows * TEACHER_H * BF16)
                cache.read(("ws", v), cols * STUDENT_H * BF16)
                cache.read(("wt", v), cols * TEACHER_H * BF16)
                cache.write(rows * bv * BF16)
                flops += 2 * rows * cols * (STUDENT_H + TEACHER_H)
    return _row("dlogits (KL, teacher)", flops, cache, f"{len(chunks)} chunks of {chunk} rows")


def gemm_dh(N, V, elem, H=STUDENT_H, label="dh", chunk_elem=None, split=False, chunk=None):
    """elem: bytes per scratch element; chunk_elem: what the launcher sizes its chunks by
    (default elem), or chunk: its chunk rows; split: the actor loss's vocabulary split
    (`dh_splits`, SMs = CONCURRENT_PROGRAMS), else the launcher's default, one share.
    Every dH program runs the whole K loop, so the compute time is divided by the grid's
    `wave_fill`."""
    g = GEMM_GPU
    chunks, chunk = _chunks(N, V, chunk_elem or elem, chunk)
    stride = scratch_row_stride(V)
    cache, flops, compute_s, fills, plans = L2(L2_BYTES), 0, 0.0, [], set()
    for c0, n_rows in chunks:
        n_m, n_h = triton.cdiv(n_rows, g["BLOCK_M"]), triton.cdiv(H, g["BLOCK_H"])
        splits = dh_splits(n_rows, H, V, g, CONCURRENT_PROGRAMS) if split else 1
        k_per = dh_split_width(V, splits, g) if splits > 1 else V
        plans.add(splits)
        chunk_flops = 0
        for sp in range(splits):  # grid axis 2
            cols = min(k_per, V - sp * k_per)
            for h in range(n_h):  # grid axis 1
                for m in range(n_m):  # grid axis 0 runs fastest
                    rows = min(g["BLOCK_M"], n_rows - m * g["BLOCK_M"])
                    cache.program()
                    cache.read(("g", c0, m, sp), rows * min(k_per, stride - sp * k_per) * elem)
                    cache.read(("w", h, sp), cols * g["BLOCK_H"] * BF16)
                    cache.write(rows * g["BLOCK_H"] * (FP32 if splits > 1 else BF16))
                    chunk_flops += 2 * rows * cols * g["BLOCK_H"]
        if splits > 1:  # dh_reduce_kernel: the fp32 shares in, dH out
            cache.requested += splits * n_rows * H * FP32
            cache.hbm += splits * n_rows * H * FP32
            cache.write(n_rows * H * BF16)
        fill = wave_fill(n_m * n_h * splits, CONCURRENT_PROGRAMS)
        fills.append(fill)
        flops += chunk_flops
        compute_s += chunk_flops / (MATMUL_SUSTAINED * fill)
    grid = f"{triton.cdiv(chunk, g['BLOCK_M'])}x{triton.cdiv(H, g['BLOCK_H'])}x{max(plans)} programs/chunk"
    r = _row(label, flops, cache, f"{len(chunks)} chunks of {chunk} rows, {grid}, SM fill {min(fills):.0%}-"
             f"{max(fills):.0%}, scratch stride {stride}", compute_s=compute_s)
    r["fill"] = min(fills)
    return r


def gemm_dw(N, V, elem, H=STUDENT_H, label="dw", order="launcher", chunk_elem=None, chunk=None):
    """order="launcher": the kernel's own map (`dw_program_tile`); "vocab-fastest": the
    order before it, for comparison. elem, chunk_elem, chunk: as in `gemm_dh`."""
    g = GEMM_GPU
    chunks, chunk = _chunks(N, V, chunk_elem or elem, chunk)
    n_v, n_h = triton.cdiv(V, g["BLOCK_M"]), triton.cdiv(H, g["BLOCK_H"])
    (n_programs,) = dw_grid(V, H, g)
    cache, flops = L2(L2_BYTES), 0
    for c0, n_rows in chunks:
        for pid in range(n_programs):
            if order == "launcher":
                v, h = dw_program_tile.fn(pid, n_h)
            else:
                v, h = pid % n_v, pid // n_v
            cols = min(g["BLOCK_M"], V - v * g["BLOCK_M"])
            cache.program()
            cache.read(("g", c0, v), n_rows * g["BLOCK_M"] * elem)
            cache.read(("h", c0, h), n_rows * g["BLOCK_H"] * BF16)
            cache.read(("dw", v, h, c0), cols * g["BLOCK_H"] * FP32)  # fp32 accumulator in, then out
            cache.write(cols * g["BLOCK_H"] * FP32)
            flops += 2 * n_rows * cols * g["BLOCK_H"]
    return _row(label, flops, cache, f"{len(chunks)} chunks, {n_programs} programs/chunk, {order} order")


def actor_logits(N, V, H, label, chunk=None):
    m = logits_meta(False)
    chunks, chunk = _chunks(N, V, FP32, chunk)
    stride = scratch_row_stride(V)
    cache, flops = L2(L2_BYTES), 0
    for c0, n_rows in chunks:
        for v in range(triton.cdiv(V, m["BLOCK_V"])):
            cols = min(m["BLOCK_V"], V - v * m["BLOCK_V"])
            for n in range(triton.cdiv(n_rows, m["BLOCK_N"])):
                rows = min(m["BLOCK_N"], n_rows - n * m["BLOCK_N"])
                cache.program()
                cache.read(("h", c0, n), rows * H * BF16)
                cache.read(("w", v), cols * H * BF16)
                cache.write(rows * min(m["BLOCK_V"], stride - v * m["BLOCK_V"]) * FP32)
                flops += 2 * rows * cols * H
    return _row(label, flops, cache, f"{len(chunks)} chunks of {chunk} rows")


def actor_rows(N, V, sweeps=None, grad_elem=None, label="actor rows (teacher)"):
    """One program per token streams its student and teacher rows `sweeps` times (default:
    the loops over the row in the kernel's source; the last one writes dL/dlogits, of
    grad_elem bytes: default what `grad_scratch_dtype` picks for a bf16 head without a
    bias). A row pair is ~1.2 MB, so the rows of the resident programs (>= one per SM)
    are several times L2: every sweep reads them from HBM again."""
    src = inspect.getsource(getattr(al._actor_rows_kernel, "fn", al._actor_rows_kernel))
    sweeps = sweeps or src.count("for v0 in range(")
    grad_elem = grad_elem or grad_scratch_dtype(torch.bfloat16, need_db=False).itemsize
    stride = scratch_row_stride(V)
    cache = L2(L2_BYTES)
    row = stride * FP32
    in_l2 = CONCURRENT_PROGRAMS * 2 * row <= L2_BYTES
    for _ in range(N):
        cache.program()
        for sweep in range(sweeps):
            if sweep and in_l2:
                cache.requested += 2 * row
            else:
                cache.requested += 2 * row
                cache.hbm += 2 * row
        cache.write(stride * grad_elem)
    return _row(label, 0, cache, f"BLOCK_V={al._rows_block(V)}, {sweeps} sweeps, dL/dlogits in {grad_elem} B")


# Programs of the distillation row kernel resident at once: its 8-warp programs need up
# to 80 registers a thread on sm_90a (tests/_aot.py), so 3 fit an SM's 64K registers.
ROWS_PROGRAMS_PER_SM = 3


def distill_rows(N, V, divergence, teacher=True):
    """`_distill_rows_kernel`, one program per token over the launcher's chunks
    (`dr.chunk_rows`): the (online) sums sweep reads the student and teacher rows, the JSD
    adds a sweep of both, and the gradient sweep reads both and writes dL/dlogits (in bf16
    for a bf16 head: `ChunkGradients`). A later sweep of a program finds its rows in L2 only if the rows of all
    resident programs fit there (at V=151,665 they are ~0.6 MB a head, ~480 MB over 396
    resident programs: they do not, so every sweep streams from HBM). The exponentials
    (a few per entry, on the SFUs) are taken to hide under the memory time."""
    stride = scratch_row_stride(V)
    row = stride * FP32
    grad_elem = grad_scratch_dtype(torch.bfloat16, need_db=False).itemsize  # `ChunkGradients` for a bf16 head
    heads = 2 if teacher else 1
    sweeps = 1 + (divergence == Divergence.JSD and teacher)  # reads before the gradient sweep
    resident = CONCURRENT_PROGRAMS * ROWS_PROGRAMS_PER_SM
    fits = resident * row * heads <= L2_BYTES
    chunks, chunk = _chunks(N, V, FP32, dr.chunk_rows(N, V))
    cache = L2(L2_BYTES)
    for _c0, n_rows in chunks:
        for _r in range(n_rows):  # grid (n_rows,)
            cache.program()
            reads = (sweeps + 1) * heads  # + the gradient sweep's reads
            first = heads
            cache.requested += reads * row
            cache.hbm += (first if fits else reads) * row
            cache.write(stride * grad_elem)
    name = Divergence(divergence).name.lower() if teacher else "no teacher"
    return _row(f"distill rows ({name})", 0, cache,
                f"BLOCK_V={dr.rows_block(V)}, {sweeps + 1} sweeps, {len(chunks)} chunks of {chunk} rows, "
                f"rows {'in' if fits else 'not in'} L2")


def distill_forward_grads_rows(N, V):
    """The kernel rows of the distillation op with its gradients in the forward: the
    launchers' own chunk (`dr.chunk_rows`), tiles (`logits_meta`, `gemm_meta`) and grids."""
    chunk = dr.chunk_rows(N, V)
    return [actor_logits(N, V, STUDENT_H, "distill fwd-grads logits (student)", chunk),
            actor_logits(N, V, TEACHER_H, "distill fwd-grads logits (teacher)", chunk),
            distill_rows(N, V, Divergence.REVERSE_KL), distill_rows(N, V, Divergence.JSD),
            distill_rows(N, V, Divergence.REVERSE_KL, teacher=False),
            gemm_dh(N, V, BF16, label="dh (distill fwd-grads)", chunk=chunk, split=True),
            gemm_dw(N, V, BF16, label="dw (distill fwd-grads)", chunk=chunk)]


def report(N, V, hbm_tbps=HBM_BYTES_PER_S / 1e12, gemm_tflops=MATMUL_SUSTAINED / 1e12):
    rows = [distill_forward(N, V), distill_forward(N, V, order="token-fastest"), distill_dlogits(N, V),
            gemm_dh(N, V, BF16, label="dh (distill)"),
            gemm_dw(N, V, BF16, label="dw (distill)"),
            gemm_dw(N, V, BF16, label="dw (distill, vocab tiles fastest: before)", order="vocab-fastest"),
            actor_logits(N, V, STUDENT_H, "actor logits (student)"),
            actor_logits(N, V, TEACHER_H, "actor logits (teacher)"),
            actor_rows(N, V),
            actor_rows(N, V, sweeps=3, grad_elem=FP32, label="actor rows (teacher, 3 sweeps, fp32 grads: before)"),
            gemm_dh(N, V, BF16, label="dh (actor)", chunk_elem=FP32, split=True),
            gemm_dh(N, V, FP32, label="dh (actor, fp32 scratch, unsplit: before)"),
            gemm_dw(N, V, BF16, label="dw (actor)", chunk_elem=FP32),
            gemm_dw(N, V, FP32, label="dw (actor, fp32 scratch)"),
            gemm_dw(N, V, FP32, label="dw (actor, fp32 scratch, vocab tiles fastest)", order="vocab-fastest")
            ] + distill_forward_grads_rows(N, V)
    print(f"N={N} tokens, V={V} (scratch row stride {scratch_row_stride(V)}), student H={STUDENT_H}, "
          f"teacher H={TEACHER_H}; peak {PEAK_BF16 / 1e12:.0f} TFLOP/s bf16, {MATMUL_SUSTAINED / 1e12:.0f} "
          f"sustained, {HBM_BYTES_PER_S / 1e12:.1f} TB/s, L2 {L2_BYTES >> 20} MiB")
    print("| kernel | TFLOP | requested GB | HBM GB (L2 model) | ms | of bf16 peak | of HBM BW | bound | grid |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['tflop']:.1f} | {r['requested_gb']:.1f} | {r['hbm_gb']:.1f} | {r['ms']:.2f} | "
              f"{r['peak']:.0%} | {r['hbm_util']:.0%} | {r['bound']} | {r['note']} |")
    ops = op_totals(rows)
    print()
    print("| op (one call, forward + backward) | kernels | useful TFLOP | computed TFLOP | ms | useful FLOPs of bf16 peak |")
    print("|---|---|---|---|---|---|")
    for o in ops:
        print(f"| {o['op']} | {' + '.join(o['kernels'])} | {o['useful_tflop']:.1f} | {o['tflop']:.1f} | {o['ms']:.1f} | "
              f"{o['peak']:.0%} |")
    print(f"\nbound and band at {hbm_tbps:.2f} TB/s: the bound at {gemm_tflops:.0f} TFLOP/s for every GEMM with "
          f"perfect overlap; the band from cuBLAS's lm-head rate ({CUBLAS_LM_HEAD_FRAC * PEAK_BF16 / 1e12:.0f} "
          f"TFLOP/s), overlapped, to {TRITON_OF_CUBLAS:.0%} of it with compute and memory added")
    print("| op | bound: ms, of bf16 peak | band: ms | band: of bf16 peak |")
    print("|---|---|---|---|")
    for b in op_band(rows, ops, hbm_tbps * 1e12, gemm_tflops * 1e12):
        print(f"| {b['op']} | {b['bound'][0]:.1f}, {b['bound'][1]:.0%} | {b['band_fast'][0]:.1f}-{b['band_slow'][0]:.1f} | "
              f"{b['band_slow'][1]:.0%}-{b['band_fast'][1]:.0%} |")
    by_op = {o["op"]: o for o in ops}
    old, new = by_op["fused distill (reverse KL, teacher)"], by_op["fused distill, gradients in the forward (reverse KL)"]
    print(f"\nfused distill, reverse KL: recompute {old['ms']:.1f} ms ({old['peak']:.0%} of peak, useful FLOPs) -> "
          f"gradients in the forward {new['ms']:.1f} ms ({new['peak']:.0%}): {old['ms'] / new['ms']:.2f}x")
    return rows, ops


# Per op: its kernels (by row name) and which of them do useful work. The distillation op's
# recomputing backward recomputes both logit tiles (`dlogits`), so its useful FLOPs are the
# forward's two logit GEMMs plus dH and dW; with the gradients in the forward (and in the
# actor loss) each GEMM runs once.
OPS = {
    "fused distill (reverse KL, teacher)": (
        ["fwd (KL, teacher)", "dlogits (KL, teacher)", "dh (distill)", "dw (distill)"],
        ["fwd (KL, teacher)", "dh (distill)", "dw (distill)"]),
    "fused distill, forward in the old order": (
        ["fwd (KL, teacher, token blocks fastest: before)", "dlogits (KL, teacher)", "dh (distill)", "dw (distill)"],
        ["fwd (KL, teacher, token blocks fastest: before)", "dh (distill)", "dw (distill)"]),
    "fused distill, dW in the old order": (
        ["fwd (KL, teacher)", "dlogits (KL, teacher)", "dh (distill)", "dw (distill, vocab tiles fastest: before)"],
        ["fwd (KL, teacher)", "dh (distill)", "dw (distill, vocab tiles fastest: before)"]),
    "fused distill, gradients in the forward (reverse KL)": (
        ["distill fwd-grads logits (student)", "distill fwd-grads logits (teacher)", "distill rows (reverse_kl)",
         "dh (distill fwd-grads)", "dw (distill fwd-grads)"], None),
    "fused distill, gradients in the forward (JSD)": (
        ["distill fwd-grads logits (student)", "distill fwd-grads logits (teacher)", "distill rows (jsd)",
         "dh (distill fwd-grads)", "dw (distill fwd-grads)"], None),
    "fused log-prob + entropy, gradients in the forward (no teacher)": (
        ["distill fwd-grads logits (student)", "distill rows (no teacher)", "dh (distill fwd-grads)",
         "dw (distill fwd-grads)"], None),
    "actor loss (teacher)": (
        ["actor logits (student)", "actor logits (teacher)", "actor rows (teacher)", "dh (actor)", "dw (actor)"], None),
    "actor loss, before (3 row sweeps, fp32 scratch, unsplit dH)": (
        ["actor logits (student)", "actor logits (teacher)", "actor rows (teacher, 3 sweeps, fp32 grads: before)",
         "dh (actor, fp32 scratch, unsplit: before)", "dw (actor, fp32 scratch)"], None),
}


def op_totals(rows):
    """Sum the kernel rows of each op in OPS: time, computed and useful FLOPs, and the
    useful FLOPs' fraction of peak over the op's whole time."""
    by_name = {r["kernel"]: r for r in rows}
    out = []
    for op, (kernels, useful) in OPS.items():
        ks = [by_name[k] for k in kernels]
        ms = sum(k["ms"] for k in ks)
        useful_tflop = sum(by_name[k]["tflop"] for k in (useful or kernels))
        out.append(dict(op=op, kernels=kernels, ms=ms, tflop=sum(k["tflop"] for k in ks), useful_tflop=useful_tflop,
                        peak=useful_tflop * 1e12 / (ms / 1e3 * PEAK_BF16)))
    return out


# --------------------------------------------------------------------------------------
# packed attention: the programs' work and their schedule on the SMs
# --------------------------------------------------------------------------------------
# What this part models. Each kernel's programs are replayed from the kernels' own range
# logic (`fwd_program_ranges`, `dkdv_program_ranges`) on the launchers' grids, tiles (the
# first pruned candidate: the fixed choice when autotuning is off) and, for dK/dV, the
# split plan (`dkdv_split_plan`, at the spec `dkdv_plan_spec` gives a GPU launch). A
# program's time is (tiles walked + PROGRAM_OVERHEAD_TILES) x a tile's FLOPs / one SM's
# share of MATMUL_SUSTAINED; an unused plan entry costs IDLE_PROGRAM_S. Programs start in
# launch order on ATTN_SMS SMs, one resident program per SM (the dK/dV and forward tiles
# at D=128 hold ~255 registers per thread), each on the SM that frees first (greedy list
# scheduling). The critical path is the last finish; the scheduling efficiency is the
# summed program time / (SMs x critical path). Walked tiles a program finds fully masked
# (it tests and skips them) count as work: an upper bound on the work, exact for the
# layouts below, which have no interleaved segments.
ATTN_SMS = 132
PROGRAM_OVERHEAD_TILES = 1.0  # k/v (or q) tile loads and the final stores of a program
IDLE_PROGRAM_S = 0.5e-6
ATTN_SHAPES = {  # name: (tokens, Hq, Hkv, D, layout)
    "16 calls, one 2k prefix": (16384, 16, 2, 128, ("prefix", 2048, 16)),
    "16 calls, one 1k prefix": (16384, 16, 2, 128, ("prefix", 1024, 16)),
    "16 calls, one 2k prefix, Hkv 8": (16384, 32, 8, 128, ("prefix", 2048, 16)),
    "4 prefixes x 4 calls": (16384, 16, 2, 128, ("many", 1024, 4)),
    "16 calls, no prefix": (16384, 16, 2, 128, ("prefix", 0, 16)),
}


def attention_meta(T, layout):
    """One row of T tokens: ("prefix", P, n) one prefix of P tokens read by n calls that
    share the rest equally (P=0: n independent calls); ("many", P, n) T / (P (1 + n))
    prefixes of P tokens, each read by n calls of P tokens."""
    from memopd.layout import AttentionMeta, SegmentKind

    kind, P, n = layout
    cu, links, kinds = [0], [], []

    def add(k, length, link=-1):
        cu.append(cu[-1] + length)
        kinds.append(k)
        links.append(link)

    if kind == "prefix":
        if P:
            add(SegmentKind.PREFIX, P)
        call = (T - P) // n
        for i in range(n):
            add(SegmentKind.CALL, call if i < n - 1 else T - cu[-1], 0 if P else -1)
    else:
        while cu[-1] + P * (1 + n) <= T:
            p = len(kinds)
            add(SegmentKind.PREFIX, P)
            for _ in range(n):
                add(SegmentKind.CALL, P, p)
        if cu[-1] < T:
            add(SegmentKind.PAD, T - cu[-1])
    return AttentionMeta.from_segments(cu, links, kinds)


def _first_config(configs, prune, D, group_p2=1):
    import torch

    c = prune(configs, {"HEAD_DIM": D, "Q": torch.empty(1, 1, D, dtype=torch.bfloat16), "GROUP_P2": group_p2})[0]
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]


def schedule(costs, sms=ATTN_SMS):
    """Greedy list scheduling of program times (launch order) on `sms` SMs: the critical path."""
    import heapq

    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def _sched_row(kernel, costs, live, tile_flops, note=""):
    total = sum(costs)
    crit = schedule(costs)
    live_costs = [c for c, ok in zip(costs, live) if ok]
    return dict(kernel=kernel, programs=len(live_costs), launched=len(costs), total_ms=total * 1e3,
                mean_us=total / max(1, len(live_costs)) * 1e6, max_us=max(live_costs, default=0.0) * 1e6,
                critical_ms=crit * 1e3, bound_ms=total / ATTN_SMS * 1e3,
                efficiency=total / (ATTN_SMS * crit) if crit else 1.0, tflop=tile_flops / 1e12, note=note)


def attention_dkdv(T, Hq, Hkv, D, layout, split=True, deterministic=False):
    """The dK/dV kernel's programs (all kv heads, launch order) and their schedule."""
    import torch

    import memopd.kernels.attention_plan as pa
    import memopd.kernels.attention_tuning as tuning

    meta = attention_meta(T, layout)
    group_p2 = triton.next_power_of_2(Hq // Hkv)
    bm, bn = _first_config(tuning.BWD_KV_CONFIGS, tuning.BWD_KV_PRUNE, D, group_p2)
    rows = bm // group_p2
    kqr = pa.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end)
    plan_n, align_m, _, spread = pa.dkdv_plan_spec(Hkv, ATTN_SMS, interpreted=False)
    plan = pa.dkdv_split_plan(kqr, plan_n, align_m, None if split else 0, spread)
    ranges = pa.dkdv_program_ranges(kqr, plan, bn, rows)
    trips = (ranges[:, 2] - ranges[:, 1]).clamp(min=0) + (ranges[:, 4] - ranges[:, 3]).clamp(min=0) + \
        (ranges[:, 6] - ranges[:, 5]).clamp(min=0)
    live = (ranges[:, 0] >= 0).repeat_interleave(Hkv)
    trips = trips.repeat_interleave(Hkv)  # kv heads fastest in the launch
    mm = 4 if deterministic else 5  # S^T, dP^T, dV, dK (+ dQ with atomics)
    tile_flops = mm * 2 * bn * bm * D
    per_sm = MATMUL_SUSTAINED / ATTN_SMS
    costs = torch.where(live, (trips.double() + PROGRAM_OVERHEAD_TILES) * tile_flops / per_sm,
                        torch.full_like(trips, IDLE_PROGRAM_S, dtype=torch.float64)).tolist()
    used = int((plan.reduce[1] > 0).sum()) if split else 0
    slots = int(plan.reduce[1].sum()) if split else 0
    note = f"BLOCK_M={bm} ({rows} rows x {group_p2} heads), BLOCK_N={bn}, plan {plan_n} keys"
    row = _sched_row("dK/dV" + (" (split)" if split else " (one program per key block: before)"), costs,
                     live.tolist(), float(trips.sum()) * tile_flops, note + (f", {used} split blocks" if split else ""))
    if split and slots:
        # the reduction: read every partial once, write dK and dV (memory bound)
        nbytes = slots * 2 * Hkv * plan_n * D * FP32 + used * 2 * Hkv * plan_n * D * BF16
        row["reduce_ms"] = nbytes / HBM_BYTES_PER_S * 1e3
        row["partials_mb"] = plan.n_slots * 2 * Hkv * plan_n * D * FP32 / 2**20
    return row


def attention_fwd(T, Hq, Hkv, D, layout, kernel="fwd"):
    """The forward (or deterministic dQ) kernel's programs: (query block, query head),
    query blocks fastest, so the heads follow one another."""

    import memopd.kernels.attention_plan as pa
    import memopd.kernels.attention_tuning as tuning

    meta = attention_meta(T, layout)
    configs, prune = (tuning.FWD_CONFIGS, tuning.FWD_PRUNE) if kernel == "fwd" else \
        (tuning.BWD_DQ_CONFIGS, tuning.BWD_DQ_PRUNE)
    bm, bn = _first_config(configs, prune, D)
    r = pa.fwd_program_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end, bm, bn)
    trips = (r[:, 1] - r[:, 0]).clamp(min=0) + (r[:, 3] - r[:, 2]).clamp(min=0) + (r[:, 5] - r[:, 4]).clamp(min=0)
    trips = trips.repeat(Hq)
    tile_flops = (2 if kernel == "fwd" else 3) * 2 * bm * bn * D
    costs = ((trips.double() + PROGRAM_OVERHEAD_TILES) * tile_flops / (MATMUL_SUSTAINED / ATTN_SMS)).tolist()
    name = "forward" if kernel == "fwd" else "dQ (deterministic)"
    return _sched_row(name, costs, [True] * len(costs), float(trips.sum()) * tile_flops, f"BLOCK_M={bm}, BLOCK_N={bn}")


def attention_report(shapes=None):
    """Per shape: forward, dK/dV before and after the split, the deterministic dQ."""
    out = {}
    print(f"packed attention, {ATTN_SMS} SMs, one program per SM, {MATMUL_SUSTAINED / 1e12:.0f} TFLOP/s sustained "
          f"shared evenly; program overhead {PROGRAM_OVERHEAD_TILES:g} tile, idle plan entry "
          f"{IDLE_PROGRAM_S * 1e6:g} us")
    print("| shape | kernel | programs (launched) | TFLOP | program time summed, SM-ms | mean / max us per program "
          "| critical path ms "
          "| total / SMs ms | critical / bound | scheduling efficiency | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in shapes or ATTN_SHAPES:
        T, Hq, Hkv, D, layout = ATTN_SHAPES[name]
        rows = [attention_fwd(T, Hq, Hkv, D, layout), attention_dkdv(T, Hq, Hkv, D, layout, split=False),
                attention_dkdv(T, Hq, Hkv, D, layout, split=True), attention_fwd(T, Hq, Hkv, D, layout, "dq")]
        out[name] = rows
        for r in rows:
            extra = f", reduce {r['reduce_ms'] * 1e3:.0f} us, partials <= {r['partials_mb']:.0f} MiB" \
                if "reduce_ms" in r else ""
            print(f"| {name} (T={T}, Hq/Hkv {Hq}/{Hkv}, D={D}) | {r['kernel']} | {r['programs']} ({r['launched']}) | "
                  f"{r['tflop']:.2f} | {r['total_ms']:.2f} | {r['mean_us']:.1f} / {r['max_us']:.1f} | "
                  f"{r['critical_ms']:.3f} | {r['bound_ms']:.3f} | {r['critical_ms'] / r['bound_ms']:.2f} | "
                  f"{r['efficiency']:.2f} | {r['note']}{extra} |")
    return out


def main(argv=None):
    global HBM_BYTES_PER_S, MATMUL_SUSTAINED  # the rates every row is timed at
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, action="append", help="default: 151,665 and 151,936")
    ap.add_argument("--json", help="append one JSON line per op and vocabulary here (benchmarks/gpu_bench.py's summary "
                                   "puts them beside the measured rows)")
    ap.add_argument("--hbm-tbps", type=float, default=HBM_BYTES_PER_S / 1e12,
                    help="the device's memory bandwidth, TB/s: its measured copy rate (default: H200's 4.3)")
    ap.add_argument("--gemm-tflops", type=float, default=MATMUL_SUSTAINED / 1e12,
                    help="the GEMM rate of the bound, TFLOP/s (default 790)")
    a = ap.parse_args(argv)
    if not (a.hbm_tbps > 0 and a.gemm_tflops > 0):
        ap.error("--hbm-tbps and --gemm-tflops must be > 0")
    HBM_BYTES_PER_S, MATMUL_SUSTAINED = a.hbm_tbps * 1e12, a.gemm_tflops * 1e12
    for V in a.vocab or [151665, HEAD_ROWS]:
        rows, ops = report(a.tokens, V, a.hbm_tbps, a.gemm_tflops)
        print()
        if a.json:
            bands = {b["op"]: b for b in op_band(rows, ops, HBM_BYTES_PER_S, MATMUL_SUSTAINED)}
            with open(a.json, "a") as f:
                for o in ops:
                    b = bands[o["op"]]
                    f.write(json.dumps(dict(op=o["op"], N=a.tokens, V=V, Hs=STUDENT_H, Ht=TEACHER_H, ms=round(o["ms"], 2),
                                            peak=round(o["peak"], 4), useful_tflop=round(o["useful_tflop"], 2),
                                            hbm_tbps=a.hbm_tbps, gemm_tflops=a.gemm_tflops,
                                            band_ms=[round(b["band_fast"][0], 2), round(b["band_slow"][0], 2)],
                                            band_peak=[round(b["band_slow"][1], 4), round(b["band_fast"][1], 4)])) + "\n")
    attention_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
