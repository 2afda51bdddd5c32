"""The exact PyTorch path of packed attention (`memopd.ops.packed_attention`,
backend="torch"), on any device.

Runs of rows that share a key set are batched into padded `scaled_dot_product_attention`
calls over keys [prefix, own segment]. The host-side work (splitting the stream into runs
and building the gather indices of each padded call) happens inside the op's custom op,
where a compiler never looks, and is cached on the metadata tensors themselves (keyed by
their version counters), so the layers of one forward and their backward plan a layout
once, and nothing of it is baked into a compiled graph as constants. On CPU tensors
planning reads host memory only; on CUDA tensors it costs one device-to-host copy per
metadata object. On CPU the forward calls the fused CPU attention kernels behind SDPA
directly, keeps their log-sum-exp, and the backward runs their fused backward per padded
call (re-gathering q/k/v instead of keeping padded copies alive); elsewhere (CUDA
tensors, non-finite inputs, malformed metadata) the backward replays the forward under
autograd (`_torch_recompute_vjp`). Second derivatives are not supported. What it does
with NaN/inf inputs: docs/design.md §6.1.

Entry points (called by the custom ops of `memopd.ops.attention`): `torch_forward` ->
(out, lse) and `torch_backward` -> (dq, dk, dv); `plan_runs` shows the runs of a layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout import AttentionMeta, cached_on_metadata

__all__ = ["torch_forward", "torch_backward", "plan_runs", "Run", "lse_shape", "lse_dtype"]

# SDPA grew `enable_gqa` in torch 2.5; older versions get K/V heads repeated by hand
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def torch_forward(q: Tensor, k: Tensor, v: Tensor, seg_start: Tensor, prefix_start: Tensor, prefix_end: Tensor,
                  scale: float) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, D], lse): lse is the fused CPU kernels' [Hq, T] log-sum-exp, or zeros
    when the backward will replay the forward instead."""
    plan = _plan_of(seg_start, prefix_start, prefix_end)
    if _fused_cpu_ok(q, k, v, plan):
        return _fused_cpu_forward(q, k, v, plan, scale)
    out = _torch_packed_attention(q, k, v, seg_start, prefix_start, prefix_end, scale)
    return out, q.new_zeros(lse_shape(q), dtype=lse_dtype(q))  # unused: that backward replays the forward


def torch_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg_start: Tensor,
                   prefix_start: Tensor, prefix_end: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `torch_forward`'s output for the incoming gradient `dout`."""
    plan = _plan_of(seg_start, prefix_start, prefix_end)
    if _fused_cpu_ok(q, k, v, plan):  # the forward's own decision: same saved inputs
        return _fused_cpu_backward(dout, q, k, v, out, lse, plan, scale)
    return tuple(g.contiguous() for g in _torch_recompute_vjp(dout, q, k, v, seg_start, prefix_start, prefix_end, scale))


def lse_shape(q: Tensor) -> tuple[int, int]:
    return (q.shape[1], q.shape[0])  # [Hq, T], as the Triton kernels store it


def lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# A custom op's kernel runs with the autograd dispatch key excluded: plain autograd records
# nothing there. This (private) guard lifts the exclusion, so the torch backward can replay
# the forward under ordinary autograd (the SDPA calls keep their fused CPU kernels);
# `torch.func.vjp` works without it but routes SDPA through slower code (~3x the backward).
_INCLUDE_AUTOGRAD = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)


def _torch_recompute_vjp(dout, q, k, v, seg_start, prefix_start, prefix_end, scale):
    """(dq, dk, dv) of the torch path, by running its forward again with autograd on."""
    def forward(q_, k_, v_):
        return _torch_packed_attention(q_, k_, v_, seg_start, prefix_start, prefix_end, scale)

    if _INCLUDE_AUTOGRAD is None:
        return torch.func.vjp(forward, q, k, v)[1](dout)
    with torch.enable_grad(), _INCLUDE_AUTOGRAD(torch._C.DispatchKey.AutogradFunctionality, False):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(forward(*leaves), leaves, dout)


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
    return _runs(meta.seg_start, meta.prefix_start, meta.prefix_end)


def _runs(seg_start: Tensor, prefix_start: Tensor, prefix_end: Tensor) -> list[Run]:
    ss = seg_start.detach().to("cpu", torch.int64)
    ps = prefix_start.detach().to("cpu", torch.int64)
    pe = prefix_end.detach().to("cpu", torch.int64)
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


@dataclass(frozen=True)
class _Batch:
    """One padded SDPA call over n runs: [n, H, Lq, Lk]."""

    n: int
    lq: int
    lk: int
    q_rows: Tensor  # [n * Lq] query token of each batched row (padding rows: token 0)
    k_rows: Tensor  # [n * Lk] key token of each batched key (padding keys: token 0)
    mask: Tensor  # [n, 1, Lq, Lk] bool
    keep: Tensor  # positions of the real query rows among the n * Lq outputs


@dataclass(frozen=True)
class _Overlap:
    """A run whose prefix interval intersects its own range: one SDPA call over keys [lo, hi)."""

    start: int
    stop: int
    lo: int
    hi: int
    mask: Tensor  # [stop - start, hi - lo] bool


@dataclass(frozen=True)
class _TorchPlan:
    batches: list[_Batch]
    overlaps: list[_Overlap]
    tokens: Tensor | None  # query token of each computed output row, in the order they are produced


def _build_plan(seg_start: Tensor, prefix_start: Tensor, prefix_end: Tensor) -> _TorchPlan:
    """Gather indices and masks of every SDPA call of the torch path, on the metadata's device.

    A bucket of n runs becomes one call over [n, H, Lq, Lk] (queries and keys gathered and
    padded) whose mask is the bottom-right-aligned causal mask of each run's keys
    [prefix, own]: row r sees all P prefix keys and its own keys up to itself, i.e. key c iff
    c <= r + Lk - Lq. Few large calls instead of one per segment: less Python and far fewer
    thread-pool rounds, which matters most when the CPU is shared."""
    dev = seg_start.device
    runs = _runs(seg_start, prefix_start, prefix_end)
    batches, overlaps, tokens = [], [], []
    for bucket in _buckets([r for r in runs if not r.zero and not r.overlap]):
        n = len(bucket)
        lq = [r.stop - r.start for r in bucket]
        keys = [[i for a, b in _key_ranges(r) for i in range(a, b)] for r in bucket]
        lk = [len(x) for x in keys]
        Lq, Lk = max(lq), max(lk)
        q_rows = torch.tensor([list(range(r.start, r.stop)) + [0] * (Lq - n_) for r, n_ in zip(bucket, lq)], device=dev)
        k_rows = torch.tensor([x + [0] * (Lk - len(x)) for x in keys], device=dev)
        lq_t = torch.tensor(lq, device=dev).view(n, 1, 1)
        lk_t = torch.tensor(lk, device=dev).view(n, 1, 1)
        p_t = torch.tensor([r.prefix_end - r.prefix_start for r in bucket], device=dev).view(n, 1, 1)
        rr = torch.arange(Lq, device=dev).view(1, Lq, 1)
        cc = torch.arange(Lk, device=dev).view(1, 1, Lk)
        # (the prefix term only matters for rows whose own range is empty); padded query
        # rows (r >= Lq_b) see every real key, so no row is fully masked
        mask = (cc < lk_t) & ((cc < p_t) | (cc <= rr + (lk_t - lq_t)))
        keep = (torch.arange(Lq, device=dev).view(1, Lq) < lq_t.view(n, 1)).flatten().nonzero().squeeze(1)
        batches.append(_Batch(n, Lq, Lk, q_rows.flatten(), k_rows.flatten(), mask.unsqueeze(1), keep))
        tokens.append(q_rows.flatten().index_select(0, keep))
    for r in runs:
        if r.overlap:
            # malformed but representable: each row's visible set is one interval; take the
            # merged key span and mask it
            lo, hi = min(r.prefix_start, r.seg_start), max(r.prefix_end, r.stop)
            j = torch.arange(lo, hi, device=dev)
            i = torch.arange(r.start, r.stop, device=dev).unsqueeze(1)
            mask = ((j >= r.prefix_start) & (j < r.prefix_end)) | ((j >= r.seg_start) & (j <= i))
            overlaps.append(_Overlap(r.start, r.stop, lo, hi, mask))
            tokens.append(torch.arange(r.start, r.stop, device=dev))
    return _TorchPlan(batches, overlaps, torch.cat(tokens) if tokens else None)


def _plan_of(seg_start: Tensor, prefix_start: Tensor, prefix_end: Tensor) -> _TorchPlan:
    """The plan of these metadata tensors, built on first use and kept on `seg_start` (it dies
    with the metadata; an in-place change of any of the three tensors invalidates it)."""
    return cached_on_metadata(seg_start, prefix_start, prefix_end, "attention_plan", _build_plan)


def _all_finite(*xs: torch.Tensor) -> bool:
    """One cheap reduction per tensor and one host read (a sync on CUDA, where "torch" is not
    the default): a sum is finite iff every element is (or, in float32 accumulation, the sum
    overflows: then the exact slow path runs anyway)."""
    sums = [x.detach().sum(dtype=torch.float32 if x.element_size() < 4 else None) for x in xs]
    return bool(torch.isfinite(torch.stack([t.to(sums[0].dtype) for t in sums])).all())


def _torch_packed_attention(q, k, v, seg_start, prefix_start, prefix_end, scale):
    """Exact PyTorch path with isolation of non-finite inputs.

    A dense product gives a masked key weight 0, and 0 * NaN = NaN: one NaN in a key or
    value row would reach every row batched with it (other trajectories included) and the
    rows of its own segment before it. So when q, k or v hold a non-finite value (checked
    with one reduction each), the attention runs on copies with those values zeroed, and
    then exactly the rows that see a non-finite key or value (or have a non-finite query)
    are set to NaN in the heads concerned; every other row is bitwise the clean result,
    and gets no gradient from the poisoned rows."""
    plan = _plan_of(seg_start, prefix_start, prefix_end)
    if _all_finite(q, k, v):
        return _torch_packed_attention_finite(q, k, v, plan, scale)
    qf, kf, vf = torch.isfinite(q), torch.isfinite(k), torch.isfinite(v)
    zero = q.new_zeros(())
    out = _torch_packed_attention_finite(
        torch.where(qf, q, zero), torch.where(kf, k, zero), torch.where(vf, v, zero), plan, scale
    )
    T, Hq, _ = q.shape
    rep = Hq // k.shape[1]
    bad_kv = ~(kf.all(-1) & vf.all(-1))  # [T, Hkv]: key j of kv head g is non-finite
    csum = torch.cat([bad_kv.new_zeros(1, bad_kv.shape[1], dtype=torch.long), bad_kv.long().cumsum(0)])
    i = torch.arange(T, device=q.device)
    ss, ps, pe = seg_start.long(), prefix_start.long(), prefix_end.long()
    own = ss <= i
    has_pre = pe > ps
    n_own = torch.where(own.unsqueeze(1), csum[i + 1] - csum[ss.clamp(0, T)], 0)
    n_pre = torch.where(has_pre.unsqueeze(1), csum[pe.clamp(0, T)] - csum[ps.clamp(0, T)], 0)
    sees_bad = ((n_own + n_pre) > 0).repeat_interleave(rep, dim=1)  # [T, Hq]
    poison = sees_bad | (~qf.all(-1) & (own | has_pre).unsqueeze(1))  # rows that see nothing stay 0
    return torch.where(poison.unsqueeze(-1), out.new_full((), float("nan")), out)


# The fused CPU attention kernels behind SDPA, called directly so that the forward keeps its
# log-sum-exp and the backward runs the fused CPU backward once per bucket (as SDPA's own
# autograd would) instead of replaying the forward. They take GQA natively. Absent in a
# torch build, or for CUDA tensors, non-finite inputs or malformed (overlapping) metadata,
# the torch path replays the forward under autograd instead.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _fused_cpu_ok(q: Tensor, k: Tensor, v: Tensor, plan: _TorchPlan) -> bool:
    return (q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BWD is not None
            and q.dtype in _CPU_FLASH_DTYPES and not plan.overlaps and _all_finite(q, k, v))


def _bucket_qkv(q: Tensor, k: Tensor, v: Tensor, b: _Batch):
    """q [n, Hq, Lq, D] and k, v [n, Hkv, Lk, D] of one padded call."""
    Hq, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    qb = q.index_select(0, b.q_rows).view(b.n, b.lq, Hq, D).transpose(1, 2)
    kb = k.index_select(0, b.k_rows).view(b.n, b.lk, Hkv, D).transpose(1, 2)
    vb = v.index_select(0, b.k_rows).view(b.n, b.lk, Hkv, D).transpose(1, 2)
    return qb, kb, vb


def _additive_mask(b: _Batch, like: Tensor) -> Tensor:
    """The call's visibility as the additive mask the fused CPU kernels take (0 / -inf)."""
    return torch.zeros(b.mask.shape, dtype=like.dtype, device=like.device).masked_fill_(~b.mask, float("-inf"))


def _bucket_tokens(plan: _TorchPlan):
    """(bucket, the token index of each of its real query rows), in `plan.tokens` order."""
    offset = 0
    for b in plan.batches:
        m = b.keep.numel()
        yield b, plan.tokens[offset : offset + m]
        offset += m


def _fused_cpu_forward(q, k, v, plan: _TorchPlan, scale):
    T, Hq, D = q.shape
    out = q.new_zeros(T, Hq, D)
    lse = q.new_zeros(T, Hq, dtype=lse_dtype(q))
    for b, tok in _bucket_tokens(plan):
        ob, lb = _CPU_FLASH(*_bucket_qkv(q, k, v, b), 0.0, False, attn_mask=_additive_mask(b, q), scale=scale)
        out.index_copy_(0, tok, ob.transpose(1, 2).reshape(b.n * b.lq, Hq, D).index_select(0, b.keep))
        lse.index_copy_(0, tok, lb.transpose(1, 2).reshape(b.n * b.lq, Hq).index_select(0, b.keep).to(lse.dtype))
    return out, lse.t().contiguous()


def _fused_cpu_backward(dout, q, k, v, out, lse, plan: _TorchPlan, scale):
    """Per bucket, the fused CPU backward on the saved output and log-sum-exp. Padding query
    rows get dout 0 and lse +inf: their attention weights are exactly 0, so they add nothing
    to dK/dV, as under SDPA's autograd (where their dout is 0)."""
    T, Hq, D = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse_rows = lse.t()
    dout = dout.to(q.dtype)
    for b, tok in _bucket_tokens(plan):
        def padded(x: Tensor, fill: float = 0.0, b=b, tok=tok) -> Tensor:
            rows = x.new_full((b.n * b.lq,) + tuple(x.shape[1:]), fill)
            return rows.index_copy_(0, b.keep, x.index_select(0, tok)).view(b.n, b.lq, *x.shape[1:]).transpose(1, 2)

        gq, gk, gv = _CPU_FLASH_BWD(padded(dout), *_bucket_qkv(q, k, v, b), padded(out), padded(lse_rows, float("inf")),
                                    0.0, False, attn_mask=_additive_mask(b, q), scale=scale)
        dq.index_copy_(0, tok, gq.transpose(1, 2).reshape(b.n * b.lq, Hq, D).index_select(0, b.keep))
        dk.index_add_(0, b.k_rows, gk.transpose(1, 2).reshape(b.n * b.lk, *k.shape[1:]))
        dv.index_add_(0, b.k_rows, gv.transpose(1, 2).reshape(b.n * b.lk, *v.shape[1:]))
    return dq, dk, dv


def _torch_packed_attention_finite(q, k, v, plan: _TorchPlan, scale):
    """The SDPA calls of `plan` on finite inputs; rows no call computes (they see nothing) are zeros."""
    T, Hq, D = q.shape
    values = []
    for b in plan.batches:
        ob = _sdpa(*_bucket_qkv(q, k, v, b), attn_mask=b.mask, scale=scale)
        values.append(ob.transpose(1, 2).reshape(b.n * b.lq, Hq, D).index_select(0, b.keep))
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    for o in plan.overlaps:
        ov = _sdpa(qh[:, o.start : o.stop], kh[:, o.lo : o.hi], vh[:, o.lo : o.hi], attn_mask=o.mask, scale=scale)
        values.append(ov.transpose(0, 1))
    out = q.new_zeros(T, Hq, D)
    if not values:
        return out
    return out.index_copy(0, plan.tokens, torch.cat(values))
