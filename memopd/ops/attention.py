"""Packed attention: the public op `packed_attention(q, k, v, meta)` and its backends.

Visibility is that of docs/design.md §3.1, read from the O(T) metadata of
`memopd.layout.AttentionMeta` (never from position ids): key j is visible to query i iff
`seg_start[i] <= j <= i` or `prefix_start[i] <= j < prefix_end[i]`; rows that see nothing
(padding) give zeros. q is `[T, Hq, D]`, k/v `[T, Hkv, D]` with Hq a multiple of Hkv (GQA).

Backends (`backend=`, chosen by `memopd.ops.dispatch.choose_backend`, so MEMOPD_BACKEND
applies and an explicit backend that cannot run is a `BackendError`):
  "auto"      "triton" on CUDA tensors whose dtype and head dim the kernels take, else "torch".
  "triton"    the kernels of `memopd.kernels.packed_attention` (on CPU tensors only under
              TRITON_INTERPRET=1 set before that module is imported: tests).
  "torch"     exact PyTorch on any device: runs of rows that share a key set are batched
              into padded `scaled_dot_product_attention` calls over keys [prefix, own segment].
  "reference" the dense [T, T]-mask oracle (`reference_packed_attention`), O(T^2), plain autograd.
What each backend does with NaN/inf inputs and how the torch path batches its runs: docs/design.md §6.1.

torch.compile: "torch" and "triton" both run inside one opaque custom op,
`memopd::packed_attention_fwd` (returns the output and what its backward needs), with a
fake implementation and an autograd formula whose backward is the custom op
`memopd::packed_attention_bwd`. The wrapper in front of it only reads shapes, dtypes, devices
and the "checked" mark of the metadata, so `torch.compile(fullgraph=True)` traces it without
a graph break. The torch path (its planning, cached on the metadata, and its two
backwards) is `memopd.ops.attention_torch`; the Triton backward's per-key query ranges
and its dK/dV split plan (`memopd.kernels.attention_plan`) are cached on the metadata the same way
(`memopd.layout.cached_on_metadata`); the argument checks are
`memopd.ops._validate.check_attention_inputs`. Second derivatives are not supported on
these two backends.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels.contract import TRITON_DTYPES, TRITON_HEAD_DIMS
from ..layout import AttentionMeta, cached_on_metadata
from ._validate import check_attention_inputs
from .attention_torch import lse_dtype, lse_shape, plan_runs, torch_backward, torch_forward
from .dispatch import choose_backend
from .reference_attention import reference_packed_attention

__all__ = ["packed_attention", "resolve_backend", "plan_runs", "BACKENDS", "TRITON_HEAD_DIMS", "TRITON_DTYPES"]

BACKENDS = ("auto", "torch", "triton", "reference")


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over k/v [T, Hkv, D] under the packed visibility of `meta`.

    softmax_scale defaults to 1/sqrt(D). `deterministic=True` makes the Triton backward free
    of atomics (bitwise reproducible); the other backends are deterministic anyway.
    Returns [T, Hq, D] in q's dtype; differentiable w.r.t. q, k, v on every backend.
    """
    if not isinstance(meta, AttentionMeta):
        raise TypeError(f"meta must be an AttentionMeta; got {type(meta).__name__}")
    check_attention_inputs(q, k, v, meta)
    backend = resolve_backend(q, backend)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if backend == "reference":
        return reference_packed_attention(q, k, v, meta, scale)
    if backend == "triton":
        # the kernels want rows contiguous: copy here (differentiably), so that the op saves
        # the copies for its backward instead of copying again there
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, _ = _fwd_op(q, k, v, meta.seg_start, meta.prefix_start, meta.prefix_end, scale, bool(deterministic), backend)
    return out


def resolve_backend(q: torch.Tensor, backend: str | None = "auto") -> str:
    """The backend that runs packed attention on inputs like q ("auto" and MEMOPD_BACKEND
    resolved); raises `BackendError` for a backend that cannot run them."""
    return choose_backend("packed_attention", backend, q.device, backends=BACKENDS, triton_refusal=_triton_refusal(q))


def _triton_refusal(q: torch.Tensor) -> str | None:
    if q.dtype not in TRITON_DTYPES:
        return f"{q.dtype} inputs (it takes float16, bfloat16 and float32)"
    if q.shape[-1] not in TRITON_HEAD_DIMS:
        return f"head dim {q.shape[-1]} (it takes head dims {TRITON_HEAD_DIMS})"
    return None


def _kernels():
    # imported lazily: importing memopd.ops must never import Triton
    from ..kernels import packed_attention as kern

    return kern


def _plan():
    # the backward's key ranges and dK/dV split plan (lazily, as `_kernels`)
    from ..kernels import attention_plan as plan

    return plan


# --------------------------------------------------------------------------------------
# custom ops + autograd (both "torch" and "triton")
# --------------------------------------------------------------------------------------
@torch.library.custom_op("memopd::packed_attention_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, seg_start: Tensor, prefix_start: Tensor, prefix_end: Tensor,
            scale: float, deterministic: bool, backend: str) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, D], lse): lse is the kernels' fp32 [Hq, T] log-sum-exp on "triton" and
    empty on "torch", whose backward recomputes the forward instead."""
    if backend == "triton":
        return _kernels().packed_attention_fwd(q, k, v, seg_start, prefix_start, prefix_end, scale)
    return torch_forward(q, k, v, seg_start, prefix_start, prefix_end, scale)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, seg_start, prefix_start, prefix_end, scale, deterministic, backend):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q), dtype=lse_dtype(q))


@torch.library.custom_op("memopd::packed_attention_bwd", mutates_args=())
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg_start: Tensor,
            prefix_start: Tensor, prefix_end: Tensor, scale: float, deterministic: bool,
            backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if backend == "triton":
        kern, host = _kernels(), _plan()
        # depend on the metadata only: computed by the first layer's backward, reused by the others
        ranges = cached_on_metadata(seg_start, prefix_start, prefix_end, "key_query_ranges", host.key_query_ranges)
        spec = host.dkdv_plan_spec(k.shape[1], host.sm_count(k.device))
        plan = cached_on_metadata(seg_start, prefix_start, prefix_end, "dkdv_plan_" + "_".join(map(str, spec)),
                                  lambda *_: host.dkdv_split_plan(ranges, *spec))
        return kern.packed_attention_bwd(dout, q, k, v, out, lse, seg_start, prefix_start, prefix_end,
                                         scale, deterministic, key_ranges=ranges, split_plan=plan)
    return torch_backward(dout, q, k, v, out, lse, seg_start, prefix_start, prefix_end, scale)


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, seg_start, prefix_start, prefix_end, scale, deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, seg_start, prefix_start, prefix_end, scale, deterministic, backend = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], seg_start, prefix_start, prefix_end)
    ctx.scalars = (scale, deterministic, backend)


def _backward(ctx, dout, _dlse):
    if not any(ctx.needs_input_grad[:3]):
        return (None,) * 9
    dq, dk, dv = _bwd_op(dout, *ctx.saved_tensors, *ctx.scalars)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * 6


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
