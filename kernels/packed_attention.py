"""The launchers of the packed-attention Triton kernels: `packed_attention_fwd` and
`packed_attention_bwd`, which check the inputs, pick each launch's tiles (fixed, or an
autotuner per kernel and size class of T) and launch every kernel twice, the plain launch
and the SAFE relaunch of the blocks that met a NaN/inf.

The op (`memopd.ops.attention`) calls these with the key ranges and the dK/dV split plan it
keeps on the metadata (`memopd.kernels.attention_plan`). The kernels and what they compute,
the non-finite handling included: `memopd.kernels.attention_kernels`; their tile candidates:
`memopd.kernels.attention_tuning`; interpreter, autotuning and dot-precision policy:
`memopd.kernels.runtime`.
"""
from __future__ import annotations

import math

import torch
import triton

from .attention_kernels import bwd_dkdv_kernel, bwd_dq_kernel, bwd_kv_reduce_kernel, fwd_kernel
from .attention_plan import DkdvPlan, dkdv_plan_spec, dkdv_split_plan, key_query_ranges, sm_count
from .attention_tuning import (
    BWD_DQ_CONFIGS,
    BWD_DQ_PRUNE,
    BWD_KV_CONFIGS,
    BWD_KV_PRUNE,
    FIXED,
    FWD_CONFIGS,
    FWD_PRUNE,
    INTERP_BLOCK,
)
from .contract import TRITON_DTYPES as _SUPPORTED_DTYPES
from .contract import TRITON_HEAD_DIMS as SUPPORTED_HEAD_DIMS
from .runtime import INTERPRET, LOG2E, USE_AUTOTUNE, autotuned, dot_precision, tuning_bucket, upcast

__all__ = [
    "INTERPRET",
    "SUPPORTED_HEAD_DIMS",
    "AUTOTUNE",
    "packed_attention_fwd",
    "packed_attention_bwd",
    "check_triton_inputs",
]

# --------------------------------------------------------------------------------------
# which configuration each launch runs
# --------------------------------------------------------------------------------------
# Autotuning (GPU only; it needs a driver) can be switched off with
# MEMOPD_TRITON_AUTOTUNE=0 or by setting this flag: the first surviving candidate is used.
AUTOTUNE = USE_AUTOTUNE

# per kernel: (kernel, candidates, pruner, the tuner's key, what its trial runs must
# re-zero: DQ is accumulated with atomics)
_TUNED_KERNELS = {
    "fwd": (fwd_kernel, FWD_CONFIGS, FWD_PRUNE, ["HEAD_DIM", "GROUP", "PREC"], None),
    "dkdv": (bwd_dkdv_kernel, BWD_KV_CONFIGS, BWD_KV_PRUNE, ["HEAD_DIM", "GROUP", "GROUP_P2", "PREC", "ATOMIC_DQ"],
             ["DQ"]),
    "dq": (bwd_dq_kernel, BWD_DQ_CONFIGS, BWD_DQ_PRUNE, ["HEAD_DIM", "GROUP", "PREC"], None),
}
_TUNERS: dict = {}


def _tuner(kind: str, T: int):
    """The autotuner of kernel `kind` for a stream of T tokens, or None where nothing is
    tuned (interpreter, AUTOTUNE off, parameters forced through FIXED). One autotuner per
    kernel and size class of T (`tuning_bucket`), since the tuners' own keys name the
    model's sizes only: the first call's T must not decide the tiles for every later one."""
    if INTERPRET or not AUTOTUNE or FIXED:
        return None
    bucket = tuning_bucket(T)
    if (kind, bucket) not in _TUNERS:
        fn, configs, prune, key, reset = _TUNED_KERNELS[kind]
        _TUNERS[kind, bucket] = autotuned(fn, configs, key, name=f"{fn.__name__}[T<={bucket}]", prune=prune,
                                          reset_to_zero=reset)
    return _TUNERS[kind, bucket]


def _pick(raw, tuned, configs, prune, q, group_p2=1):
    """(kernel, launch kwargs) for one launch: the autotuner `tuned` (`_tuner`'s answer), or
    where that is None (interpreter, AUTOTUNE off, or forced through FIXED) the raw kernel
    with fixed parameters. group_p2: the smallest BLOCK_M the kernel accepts (dK/dV tiles
    stack the GQA group's heads)."""
    if INTERPRET:
        return raw, {"BLOCK_M": max(FIXED.get("BLOCK_M", INTERP_BLOCK), group_p2),
                     "BLOCK_N": FIXED.get("BLOCK_N", INTERP_BLOCK)}
    if tuned is not None:
        return tuned, {}
    c = prune(configs, {"HEAD_DIM": q.shape[-1], "Q": q, "GROUP_P2": group_p2})[0]
    params = {"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_N": c.kwargs["BLOCK_N"],
              "num_warps": c.num_warps, "num_stages": c.num_stages}
    params.update(FIXED)
    params["BLOCK_M"] = max(params["BLOCK_M"], group_p2)
    return raw, params


def _grid(T, heads, block_key):
    return lambda meta: (triton.cdiv(T, meta[block_key]), heads)


def _launch_with_rerun(raw, kernel, params, T, heads, block_key, args, consts, grid=None, n_flags=None):
    """The plain launch, then the SAFE launch of the same kernel over the same programs
    (same configuration, autotuned or not), which redoes exactly the blocks the plain launch
    flagged as having met a NaN/inf ("Non-finite inputs" in `attention_kernels`). `args`:
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
# inputs
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


# --------------------------------------------------------------------------------------
# the entry points
# --------------------------------------------------------------------------------------
def _reduce_partials(part, dk, dv, plan, T, Hkv, D, sm_scale):
    """Sum the split key blocks' fp32 partials into dK/dV (`bwd_kv_reduce_kernel`)."""
    block_r = min(32, plan.block_n)
    grid = (triton.cdiv(T, block_r), Hkv, 2)
    bwd_kv_reduce_kernel[grid](part, dk, dv, plan.reduce, T, Hkv, plan.reduce.shape[1], plan.block_n,
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
    kernel, params = _pick(fwd_kernel, _tuner("fwd", T), FWD_CONFIGS, FWD_PRUNE, q)
    _launch_with_rerun(
        fwd_kernel, kernel, params, T, Hq, "BLOCK_M",
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
    kernel, params = _pick(bwd_dkdv_kernel, _tuner("dkdv", T), BWD_KV_CONFIGS, BWD_KV_PRUNE, q, group_p2)
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
        bwd_dkdv_kernel, kernel, params, T, Hkv, "BLOCK_N",
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
        kernel, params = _pick(bwd_dq_kernel, _tuner("dq", T), BWD_DQ_CONFIGS, BWD_DQ_PRUNE, q)
        _launch_with_rerun(
            bwd_dq_kernel, kernel, params, T, Hq, "BLOCK_M",
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
