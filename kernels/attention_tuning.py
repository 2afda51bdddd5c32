"""The launch configurations of the packed-attention kernels (`memopd.kernels.attention_kernels`):
the H100/H200 tile candidates of each kernel in order of preference, the pruner that drops
the candidates a launch cannot use (shared memory, registers, Hopper's warp-group MMA, and
the candidates measured to spill with each Triton release), the interpreter's block size,
and the test hook that forces launch parameters.

Read by the launchers (`memopd.kernels.packed_attention`: the fixed choice, or the
autotuner's candidates) and by the dK/dV split plan (`memopd.kernels.attention_plan`: its
blocks are the largest candidate tile); the AOT matrix (tests/_aot.py) compiles every
candidate the pruners keep.
"""
from __future__ import annotations

import triton

__all__ = ["FWD_CONFIGS", "BWD_KV_CONFIGS", "BWD_DQ_CONFIGS", "FWD_PRUNE", "BWD_KV_PRUNE", "BWD_DQ_PRUNE",
           "SPILLS_MEASURED", "SPILLS_FP32", "FP32_ONLY", "INTERP_BLOCK", "FIXED"]

# Interpreter block sizes: tl.dot needs every dimension >= 16.
INTERP_BLOCK = 16
# Test hook: launch parameters (BLOCK_M, BLOCK_N, num_warps, num_stages) forced on every
# launch, which also bypasses autotuning. In the interpreter only the block sizes matter.
FIXED: dict = {}


def _make_prune(resident: str, n_acc: int, smem_factor: float = 1.0, spills=None, spills32=None):
    """Config pruner for one kernel. `resident` names the tile that stays put for the whole
    program ("M": queries, "N": keys); the other one streams through `num_stages` buffers.
    `n_acc` fp32 [resident, D] accumulators live in registers. `spills` / `spills32`:
    {head dim: set of (BLOCK_M, BLOCK_N, num_warps, num_stages)} measured to spill with
    16-bit / fp32 inputs. Candidates in `FP32_ONLY` are offered to fp32 inputs only."""

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
            other_dtype = elt != 4 and launch in FP32_ONLY
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
# SPILLS_MEASURED); dQ 128x32/8 warps: 187-202). Timings on a real H100/H200 are still to
# be taken; the autotuner picks among the survivors there. The lists are short on
# purpose: every candidate costs a compile on first use.
FWD_CONFIGS = _cfgs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2),
                      (32, 32, 4, 2), (16, 16, 4, 2)])
BWD_KV_CONFIGS = _cfgs([(32, 64, 8, 2), (32, 64, 8, 1), (16, 64, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2),
                         (32, 64, 4, 3), (16, 32, 4, 2), (16, 16, 8, 1), (16, 16, 4, 2)])
BWD_DQ_CONFIGS = _cfgs([(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2),
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
SPILLS_MEASURED = {
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
FP32_ONLY = {(16, 16, 8, 1)}
SPILLS_FP32 = {"fwd": {}, "dkdv": {64: {(16, 16, 4, 2)}, 128: {(16, 16, 4, 2)}}, "dq": {}}


def _spills_for_this_triton():
    """The measured table of the Triton in use; for an unmeasured release, that of the
    nearest measured one not newer than it (the oldest measured below that)."""
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        version = max(SPILLS_MEASURED)
    known = sorted(SPILLS_MEASURED)
    older = [v for v in known if v <= version]
    return SPILLS_MEASURED[older[-1] if older else known[0]]


_SPILLS = _spills_for_this_triton()
FWD_PRUNE = _make_prune("M", 1, spills=_SPILLS["fwd"], spills32=SPILLS_FP32["fwd"])
BWD_KV_PRUNE = _make_prune("N", 2, smem_factor=1.5, spills=_SPILLS["dkdv"], spills32=SPILLS_FP32["dkdv"])
BWD_DQ_PRUNE = _make_prune("M", 1, spills=_SPILLS["dq"], spills32=SPILLS_FP32["dq"])
