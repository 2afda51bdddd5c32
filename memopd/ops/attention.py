"""Packed attention: the public op `packed_attention(q, k, v, meta)` and its backends.

Visibility is that of docs/design.md §3.1, read from the O(T) metadata of
`memopd.layout.AttentionMeta` (never from position ids): key j is visible to query i iff
`seg_start[i] <= j <= i` or `prefix_start[i] <= j < prefix_end[i]`; rows that see nothing
(padding) give zeros. q is `[T, Hq, D]`, k/v `[T, Hkv, D]` with Hq a multiple of Hkv (GQA).

Backends (keyword `backend`):
  "auto"      Triton on CUDA tensors (when dtype/head dim are supported), "torch" otherwise.
  "triton"    the Triton kernels of `memopd.kernels.packed_attention` (forward + backward,
              through a `torch.autograd.Function`). On CPU tensors this works only when
              TRITON_INTERPRET=1 was set before that module was imported (tests).
  "torch"     exact PyTorch: rows are split into runs that share their key set (in a packed
              layout: one run per segment); runs of similar shape are batched into one
              padded `scaled_dot_product_attention` call over keys [prefix, own segment]
              with each run's bottom-right-aligned causal mask; padding rows are zeros.
              Differentiable by autograd (prefix dK/dV summed over its calls by the
              gather's backward); works on any device.
  "reference" the dense [T, T]-mask oracle (`reference_packed_attention`), O(T^2).

Non-finite inputs stay where they belong on the "torch" and "reference" backends: a NaN or
inf in a key or value row reaches exactly the rows that can see it (as NaN in the heads
concerned), never a masked row, another segment or another trajectory. The metadata is
checked once per object at entry (`AttentionMeta.validate`): a contradiction (e.g.
prefix_end > T, a negative seg_start) is a ValueError naming the field.

On a CPU shape of T=4096 tokens (3 prefixes x 10 calls + padding, 34 segments), 8 heads,
D=64, fp32, one thread, the torch path measured ~22x faster than the dense reference
forward (0.12 s vs 2.7 s) and ~13x for forward+backward (0.38 s vs 4.8 s); with 4 x 14 calls
(61 segments): 0.10 s vs 2.3 s and 0.31 s vs 5.0 s. So it is the CPU default
(`benchmarks/bench_packed_attention.py` repeats the comparison).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layout import AttentionMeta
from .reference_attention import check_attention_inputs, reference_packed_attention

__all__ = ["packed_attention", "select_backend", "plan_runs", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch", "reference")
_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# SDPA grew `enable_gqa` in torch 2.5; older versions get K/V heads repeated by hand
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if not isinstance(meta, AttentionMeta):
        raise TypeError(f"meta must be an AttentionMeta; got {type(meta).__name__}")
    check_attention_inputs(q, k, v, meta)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "auto":
        backend = select_backend(q)
    if backend == "reference":
        return reference_packed_attention(q, k, v, meta, softmax_scale)
    if backend == "torch":
        return _torch_packed_attention(q, k, v, meta, softmax_scale)
    return _TritonPackedAttention.apply(
        q, k, v, meta.seg_start, meta.prefix_start, meta.prefix_end, float(softmax_scale), bool(deterministic)
    )


def select_backend(q: torch.Tensor) -> str:
    """The backend "auto" resolves to for these inputs."""
    if q.is_cuda and q.shape[-1] in _TRITON_HEAD_DIMS and q.dtype in _TRITON_DTYPES:
        return "triton"
    return "torch"


# --------------------------------------------------------------------------------------
# Triton backend
# --------------------------------------------------------------------------------------
def _kernels():
    # imported lazily: importing memopd.ops must never import Triton
    from ..kernels import packed_attention as kern

    return kern


class _TritonPackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg_start, prefix_start, prefix_end, scale, deterministic):
        kern = _kernels()
        # the kernels want [T, H, D] rows contiguous; copy once here and keep the copies
        # for the backward instead of copying again there
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = kern.packed_attention_fwd(q, k, v, seg_start, prefix_start, prefix_end, scale)
        ctx.save_for_backward(q, k, v, out, lse, seg_start, prefix_start, prefix_end)
        ctx.scale = scale
        ctx.deterministic = deterministic
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, seg_start, prefix_start, prefix_end = ctx.saved_tensors
        dq, dk, dv = _kernels().packed_attention_bwd(
            dout, q, k, v, out, lse, seg_start, prefix_start, prefix_end, ctx.scale, ctx.deterministic
        )
        return dq, dk, dv, None, None, None, None, None


# --------------------------------------------------------------------------------------
# PyTorch backend
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Query rows [start, stop) that share one key set shape.

    Row i of the run sees the prefix keys [prefix_start, prefix_end) (may be empty) and the
    own keys [seg_start, i]. `zero` runs see nothing. `overlap` marks the (malformed but
    representable) case where the prefix interval intersects the own range.
    """

    start: int
    stop: int
    seg_start: int
    prefix_start: int
    prefix_end: int
    zero: bool
    overlap: bool


def plan_runs(meta: AttentionMeta) -> list[Run]:
    """Split the token stream into maximal runs of rows with the same seg_start and prefix
    interval (padding rows that see nothing are merged into zero runs). For a layout built
    by `AttentionMeta.from_segments` the runs are exactly the non-padding segments. O(T)."""
    ss = meta.seg_start.detach().to("cpu", torch.int64)
    ps = meta.prefix_start.detach().to("cpu", torch.int64)
    pe = meta.prefix_end.detach().to("cpu", torch.int64)
    T = ss.shape[0]
    if T == 0:
        return []
    idx = torch.arange(T)
    has_pre = pe > ps
    zero = ~has_pre & (ss > idx)
    ps = torch.where(has_pre, ps, 0)
    pe = torch.where(has_pre, pe, 0)
    change = torch.ones(T, dtype=torch.bool)
    change[1:] = (zero[1:] != zero[:-1]) | (
        ~zero[1:] & ((ss[1:] != ss[:-1]) | (ps[1:] != ps[:-1]) | (pe[1:] != pe[:-1]))
    )
    starts = idx[change].tolist()
    stops = starts[1:] + [T]
    s_l, p_l, e_l, z_l = ss[change].tolist(), ps[change].tolist(), pe[change].tolist(), zero[change].tolist()
    runs = []
    for a, b, s, p0, p1, z in zip(starts, stops, s_l, p_l, e_l, z_l):
        # the own keys of the run are [s, b); they collide with the prefix if they intersect
        overlap = (not z) and p1 > p0 and p0 < b and s < p1 and s < b
        runs.append(Run(a, b, s, p0, p1, bool(z), bool(overlap)))
    return runs


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """SDPA on [..., H, L, D] operands, with GQA (k/v may have fewer heads than q)."""
    rep = q.shape[-3] // k.shape[-3]
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)  # pragma: no cover - torch < 2.5
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


# Padding a bucket of runs to its longest query/key lengths may cost at most this factor
# over the exact work, plus this many free (query, key) pairs per bucket (small runs are
# batched even when relatively wasteful: a kernel launch costs more than a few MACs).
_BUCKET_SLACK = 1.5
_BUCKET_FREE_PAIRS = 1 << 15


def _key_ranges(r: Run) -> list[tuple[int, int]]:
    """Key token ranges of a regular run, in SDPA key order: [prefix, own]."""
    own_hi = max(r.stop, r.seg_start)
    return [(r.prefix_start, r.prefix_end), (r.seg_start, own_hi)]


def _buckets(runs: list[Run]) -> list[list[Run]]:
    """Group runs of similar shape so that each group is one padded, batched SDPA call."""
    def klen(r):
        return sum(b - a for a, b in _key_ranges(r))

    items = sorted(runs, key=lambda r: (klen(r), r.stop - r.start), reverse=True)
    out, cur, exact, qmax, kmax = [], [], 0, 0, 0
    for r in items:
        lq, lk = r.stop - r.start, klen(r)
        nq, nk = max(qmax, lq), max(kmax, lk)
        if cur and (len(cur) + 1) * nq * nk > _BUCKET_SLACK * (exact + lq * lk) + _BUCKET_FREE_PAIRS:
            out.append(cur)
            cur, exact, nq, nk = [], 0, lq, lk
        cur.append(r)
        exact += lq * lk
        qmax, kmax = nq, nk
    if cur:
        out.append(cur)
    return out


def _all_finite(*xs: torch.Tensor) -> bool:
    """One cheap reduction per tensor and one host sync: a sum is finite iff every element is
    (or, in float32 accumulation, the sum overflows: then the exact slow path runs anyway)."""
    sums = [x.detach().sum(dtype=torch.float32 if x.element_size() < 4 else None) for x in xs]
    return bool(torch.isfinite(torch.stack([t.to(sums[0].dtype) for t in sums])).all())


def _torch_packed_attention(q, k, v, meta, scale):
    """Exact PyTorch path with isolation of non-finite inputs.

    A dense product gives a masked key weight 0, and 0 * NaN = NaN: one NaN in a key or
    value row would reach every row batched with it (other trajectories included) and the
    rows of its own segment before it. So when q, k or v hold a non-finite value (checked
    with one reduction each), the attention runs on copies with those values zeroed, and
    then exactly the rows that see a non-finite key or value (or have a non-finite query)
    are set to NaN in the heads concerned; every other row is bitwise the clean result,
    and gets no gradient from the poisoned rows."""
    if _all_finite(q, k, v):
        return _torch_packed_attention_finite(q, k, v, meta, scale)
    qf, kf, vf = torch.isfinite(q), torch.isfinite(k), torch.isfinite(v)
    zero = q.new_zeros(())
    out = _torch_packed_attention_finite(
        torch.where(qf, q, zero), torch.where(kf, k, zero), torch.where(vf, v, zero), meta, scale
    )
    T, Hq, _ = q.shape
    rep = Hq // k.shape[1]
    dev = q.device
    bad_kv = ~(kf.all(-1) & vf.all(-1))  # [T, Hkv]: key j of kv head g is non-finite
    csum = torch.cat([bad_kv.new_zeros(1, bad_kv.shape[1], dtype=torch.long), bad_kv.long().cumsum(0)])
    i = torch.arange(T, device=dev)
    ss, ps, pe = meta.seg_start.long(), meta.prefix_start.long(), meta.prefix_end.long()
    own = ss <= i
    has_pre = pe > ps
    n_own = torch.where(own.unsqueeze(1), csum[i + 1] - csum[ss.clamp(0, T)], 0)
    n_pre = torch.where(has_pre.unsqueeze(1), csum[pe.clamp(0, T)] - csum[ps.clamp(0, T)], 0)
    sees_bad = ((n_own + n_pre) > 0).repeat_interleave(rep, dim=1)  # [T, Hq]
    poison = sees_bad | (~qf.all(-1) & (own | has_pre).unsqueeze(1))  # rows that see nothing stay 0
    return torch.where(poison.unsqueeze(-1), out.new_full((), float("nan")), out)


def _torch_packed_attention_finite(q, k, v, meta, scale):
    """Exact PyTorch path (finite inputs). Runs of rows with the same key set shape are batched: a bucket of
    n runs becomes one SDPA call over [n, H, Lq, Lk] (queries and keys gathered and padded),
    whose mask is the bottom-right-aligned causal mask of each run's keys [prefix, own]:
    row i sees all P prefix keys and its own keys up to i, i.e. key c iff c <= r + Lk - Lq.
    Few large calls instead of one per segment: less Python and far fewer thread-pool
    rounds, which matters most when the CPU is shared."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    dev = q.device
    runs = plan_runs(meta)
    regular = [r for r in runs if not r.zero and not r.overlap]
    tokens, values = [], []
    for bucket in _buckets(regular):
        n = len(bucket)
        lq = [r.stop - r.start for r in bucket]
        keys = [[i for a, b in _key_ranges(r) for i in range(a, b)] for r in bucket]
        lk = [len(x) for x in keys]
        Lq, Lk = max(lq), max(lk)
        q_idx = torch.tensor([list(range(r.start, r.stop)) + [0] * (Lq - n_) for r, n_ in zip(bucket, lq)], device=dev)
        k_idx = torch.tensor([x + [0] * (Lk - len(x)) for x in keys], device=dev)
        lq_t = torch.tensor(lq, device=dev).view(n, 1, 1)
        lk_t = torch.tensor(lk, device=dev).view(n, 1, 1)
        p_t = torch.tensor([r.prefix_end - r.prefix_start for r in bucket], device=dev).view(n, 1, 1)
        rr = torch.arange(Lq, device=dev).view(1, Lq, 1)
        cc = torch.arange(Lk, device=dev).view(1, 1, Lk)
        # (the prefix term only matters for rows whose own range is empty); padded query
        # rows (r >= Lq_b) see every real key, so no row is fully masked
        mask = (cc < lk_t) & ((cc < p_t) | (cc <= rr + (lk_t - lq_t)))
        qb = q.index_select(0, q_idx.flatten()).view(n, Lq, Hq, D).transpose(1, 2)
        kb = k.index_select(0, k_idx.flatten()).view(n, Lk, Hkv, D).transpose(1, 2)
        vb = v.index_select(0, k_idx.flatten()).view(n, Lk, Hkv, D).transpose(1, 2)
        ob = _sdpa(qb, kb, vb, attn_mask=mask.unsqueeze(1), scale=scale)
        keep = (torch.arange(Lq, device=dev).view(1, Lq) < lq_t.view(n, 1)).flatten().nonzero().squeeze(1)
        values.append(ob.transpose(1, 2).reshape(n * Lq, Hq, D).index_select(0, keep))
        tokens.append(q_idx.flatten().index_select(0, keep))
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    for r in runs:
        if r.overlap:
            # the prefix interval intersects the own range (malformed, but representable):
            # each row's visible set is one interval; take the merged key span and mask it
            lo, hi = min(r.prefix_start, r.seg_start), max(r.prefix_end, r.stop)
            j = torch.arange(lo, hi, device=dev)
            i = torch.arange(r.start, r.stop, device=dev).unsqueeze(1)
            mask = ((j >= r.prefix_start) & (j < r.prefix_end)) | ((j >= r.seg_start) & (j <= i))
            o = _sdpa(qh[:, r.start : r.stop], kh[:, lo:hi], vh[:, lo:hi], attn_mask=mask, scale=scale)
            values.append(o.transpose(0, 1))
            tokens.append(torch.arange(r.start, r.stop, device=dev))
    out = q.new_zeros(T, Hq, D)  # rows that see nothing stay zero
    if not values:
        return out
    return out.index_copy(0, torch.cat(tokens), torch.cat(values))
