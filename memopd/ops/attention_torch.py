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
directly, with each row's keys split in two: its own keys (causal calls, no mask) and
its prefix (one unmasked call per prefix interval), merged by their log-sum-exps
(`_CpuPlan`); it keeps the merged log-sum-exp, and the backward runs the fused backward
of every call on it (re-gathering q/k/v instead of keeping padded copies alive).
Elsewhere (CUDA tensors, non-finite inputs, malformed metadata) the backward replays the
forward under autograd (`_torch_recompute_vjp`). Second derivatives are not supported. What it does
with NaN/inf inputs: docs/design.md §6.1.

Entry points (called by the custom ops of `memopd.ops.attention`): `torch_forward` ->
(out, lse) and `torch_backward` -> (dq, dk, dv); `plan_runs` shows the runs of a layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


# The cost of one padded SDPA call over n runs, in units of one (query, key) pair: a fixed
# part per call (kernel dispatch, the gathers and scatters around it) plus, per padded query
# row, its keys and a per-row part (softmax bookkeeping, the row's gathers and copies in the
# forward and the backward). Measured on the fused CPU kernels' forward + backward (one
# thread, fp32, 8 / 2 heads of 32, process clock): a call costs ~50 us even when nearly
# empty, a row ~5 us, a pair ~0.15 us. A CUDA launch costs more, relative to a pair.
_CALL_PAIRS = {"cpu": 700, "cuda": 1 << 15}
_ROW_PAIRS = 40
# most runs in one call: bounds the planning at O(runs x this); past a few dozen runs a
# call's fixed cost is a small share of its work anyway
_MAX_BUCKET_RUNS = 64


def _key_ranges(r: Run) -> list[tuple[int, int]]:
    """Key token ranges of a regular run, in SDPA key order: [prefix, own]."""
    own_hi = max(r.stop, r.seg_start)
    return [(r.prefix_start, r.prefix_end), (r.seg_start, own_hi)]


def _own_key_ranges(r: Run) -> list[tuple[int, int]]:
    """The own keys of a run alone (its prefix is attended to in a call of its own)."""
    return [(r.seg_start, max(r.stop, r.seg_start))]


def _buckets(runs: list[Run], key_ranges=_key_ranges, device_type: str = "cpu") -> list[list[Run]]:
    """Group runs into padded, batched SDPA calls of least total cost (see `_CALL_PAIRS`).

    Runs sorted by key length, longest first; the cheapest cut of that order into
    contiguous groups, by dynamic programming over the cut points: a group of n runs costs
    one call plus n * Lq * (Lk + row cost), Lq / Lk its longest query / key lengths. Few
    wide calls where the runs are alike (one call per segment would be all dispatch), tight
    ones where lengths spread (one call padded to the longest would be mostly padding)."""
    call = _CALL_PAIRS.get(device_type, _CALL_PAIRS["cuda"])
    klen = [sum(b - a for a, b in key_ranges(r)) for r in runs]
    order = sorted(range(len(runs)), key=lambda i: (klen[i], runs[i].stop - runs[i].start), reverse=True)
    lk = [klen[i] for i in order]
    lq = [runs[i].stop - runs[i].start for i in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest grouping of the first j runs
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        qmax = 0
        for i in range(j - 1, max(0, j - _MAX_BUCKET_RUNS) - 1, -1):  # last group: runs i..j-1, Lk lk[i]
            qmax = max(qmax, lq[i])
            c = call + (j - i) * qmax * (lk[i] + _ROW_PAIRS)
            if c >= best[j]:
                break  # an earlier start only adds runs (and padding) to this group
            if best[i] + c < best[j]:
                best[j], cut[j] = best[i] + c, i
    out, j = [], n
    while j > 0:
        out.append([runs[order[x]] for x in range(cut[j], j)])
        j = cut[j]
    return out[::-1]


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
    tokens: Tensor  # the token of each real query row, in `keep` order
    # every run sees only its own keys, which are its own query rows: the mask is then the
    # kernels' top-left causal mask on each run's rows (padding rows, which see padding
    # keys too, are dropped in the forward and weigh 0 in the backward)
    causal: bool
    lse_rows: Tensor  # q_rows with padding rows pointing at the extra row T (the backward's +inf lse row,
    # and the row the forward's and backward's outputs dump padding rows into)
    # (start, stop) when the call's query / key rows are one contiguous range of tokens (one
    # run, no padding): the operands are then views, not gathered copies
    q_span: tuple[int, int] | None = None
    k_span: tuple[int, int] | None = None
    additive: dict = field(default_factory=dict, compare=False)  # dtype -> the mask as 0 / -inf, built once


@dataclass(frozen=True)
class _Overlap:
    """A run whose prefix interval intersects its own range: one SDPA call over keys [lo, hi)."""

    start: int
    stop: int
    lo: int
    hi: int
    mask: Tensor  # [stop - start, hi - lo] bool


@dataclass(frozen=True)
class _Prefix:
    """Every query row that reads the prefix keys [lo, hi): one unmasked call (fused CPU path)."""

    lo: int
    hi: int
    rows: Tensor  # [M] their tokens, ascending
    first: int | None  # rows[0] when the rows are one contiguous range (then q is sliced, not gathered)


@dataclass(frozen=True)
class _CpuPlan:
    """The fused CPU path's calls. A row's keys split in two: its own keys (the `batches`,
    causal where the run starts its segment) and its prefix (one `_Prefix` call per prefix
    interval, over the rows of every run that reads it); the two partial softmaxes merge by
    their log-sum-exps, and the backward runs each call on the merged output and lse, which
    makes each one's gradients exactly its keys' share. Computing the prefix once per
    interval instead of inside every padded call, and the own keys causally, is ~1.7x fewer
    (query, key) pairs on shared-prefix layouts."""

    batches: list[_Batch]
    prefixes: list[_Prefix]
    pre_tokens: Tensor | None  # concatenated rows of `prefixes`
    blind: Tensor | None  # tokens no batch computes (they see nothing): their rows are zero
    tokens: int  # T


@dataclass(frozen=True)
class _TorchPlan:
    batches: list[_Batch]
    overlaps: list[_Overlap]
    tokens: Tensor | None  # query token of each computed output row, in the order they are produced
    cpu: _CpuPlan | None  # None with overlaps (the fused CPU path then steps aside)


def _make_batches(runs: list[Run], key_ranges, T: int, dev) -> list[_Batch]:
    """Gather indices and masks of the padded calls over `runs` with keys `key_ranges(run)`.

    A bucket of n runs becomes one call over [n, H, Lq, Lk] (queries and keys gathered and
    padded) whose mask is the bottom-right-aligned causal mask of each run's keys
    [prefix, own]: row r sees all P prefix keys and its own keys up to itself, i.e. key c iff
    c <= r + Lk - Lq. Few large calls instead of one per segment: less Python and far fewer
    thread-pool rounds, which matters most when the CPU is shared."""
    batches = []
    for bucket in _buckets(runs, key_ranges, torch.device(dev).type):
        n = len(bucket)
        lq = [r.stop - r.start for r in bucket]
        keys = [[i for a, b in key_ranges(r) for i in range(a, b)] for r in bucket]
        lk = [len(x) for x in keys]
        Lq, Lk = max(lq), max(lk)
        q_rows = torch.tensor([list(range(r.start, r.stop)) + [0] * (Lq - n_) for r, n_ in zip(bucket, lq)], device=dev)
        k_rows = torch.tensor([x + [0] * (Lk - len(x)) for x in keys], device=dev)
        lq_t = torch.tensor(lq, device=dev).view(n, 1, 1)
        lk_t = torch.tensor(lk, device=dev).view(n, 1, 1)
        p_t = torch.tensor([lk_ - (max(r.stop, r.seg_start) - r.seg_start) for r, lk_ in zip(bucket, lk)],
                           device=dev).view(n, 1, 1)  # keys before the own ones
        rr = torch.arange(Lq, device=dev).view(1, Lq, 1)
        cc = torch.arange(Lk, device=dev).view(1, 1, Lk)
        # (the prefix term only matters for rows whose own range is empty); padded query
        # rows (r >= Lq_b) see every real key, so no row is fully masked
        mask = (cc < lk_t) & ((cc < p_t) | (cc <= rr + (lk_t - lq_t)))
        real = (torch.arange(Lq, device=dev).view(1, Lq) < lq_t.view(n, 1)).flatten()
        keep = real.nonzero().squeeze(1)
        causal = all(lk_ == lq_ and r.seg_start == r.start for r, lk_, lq_ in zip(bucket, lk, lq))
        q_span = k_span = None
        if n == 1:
            q_span = (bucket[0].start, bucket[0].stop)
            if Lk and keys[0] == list(range(keys[0][0], keys[0][0] + Lk)):
                k_span = (keys[0][0], keys[0][0] + Lk)
        batches.append(_Batch(n, Lq, Lk, q_rows.flatten(), k_rows.flatten(), mask.unsqueeze(1), keep,
                              q_rows.flatten().index_select(0, keep), causal, torch.where(real, q_rows.flatten(), T),
                              q_span, k_span))
    return batches


def _cpu_plan(runs: list[Run], T: int, dev) -> _CpuPlan:
    """Runs that start their segment (every run of a `from_segments` layout) split into own
    keys and prefix; any other run keeps one masked call over [prefix, own]."""
    split = [r for r in runs if r.seg_start == r.start]
    whole = [r for r in runs if r.seg_start != r.start]
    batches = _make_batches(split, _own_key_ranges, T, dev) + _make_batches(whole, _key_ranges, T, dev)
    groups: dict[tuple[int, int], list[Run]] = {}
    for r in split:
        if r.prefix_end > r.prefix_start:
            groups.setdefault((r.prefix_start, r.prefix_end), []).append(r)
    prefixes = []
    for (lo, hi), rs in groups.items():
        rows = [i for r in sorted(rs, key=lambda r: r.start) for i in range(r.start, r.stop)]
        first = rows[0] if rows[-1] - rows[0] + 1 == len(rows) else None
        prefixes.append(_Prefix(lo, hi, torch.tensor(rows, device=dev), first))
    seen = torch.zeros(T, dtype=torch.bool, device=dev)
    for b in batches:
        seen[b.tokens] = True
    blind = (~seen).nonzero().squeeze(1)
    return _CpuPlan(batches, prefixes, torch.cat([p.rows for p in prefixes]) if prefixes else None,
                    blind if blind.numel() else None, T)


def _build_plan(seg_start: Tensor, prefix_start: Tensor, prefix_end: Tensor) -> _TorchPlan:
    """Gather indices and masks of every SDPA call of the torch path, on the metadata's
    device: the padded calls over [prefix, own] keys (`_make_batches`) that the replaying
    path runs, and the fused CPU path's split calls (`_CpuPlan`)."""
    dev = seg_start.device
    T = seg_start.shape[0]
    runs = _runs(seg_start, prefix_start, prefix_end)
    regular = [r for r in runs if not r.zero and not r.overlap]
    batches = _make_batches(regular, _key_ranges, T, dev)
    overlaps = []
    tokens = [b.tokens for b in batches]
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
    cpu = None if overlaps else _cpu_plan(regular, T, dev)
    return _TorchPlan(batches, overlaps, torch.cat(tokens) if tokens else None, cpu)


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
    clean = torch.where(qf, q, zero), torch.where(kf, k, zero), torch.where(vf, v, zero)
    if _fused_cpu_kernels_take(q, plan):
        # the fused CPU path's own calls on the cleaned copies, so that every clean row is
        # bitwise what the fused path gives on clean inputs
        out = _FusedCpuAttention.apply(*clean, plan, scale)[0]
    else:
        out = _torch_packed_attention_finite(*clean, plan, scale)
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


def _fused_cpu_kernels_take(q: Tensor, plan: _TorchPlan) -> bool:
    return (q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BWD is not None
            and q.dtype in _CPU_FLASH_DTYPES and plan.cpu is not None)


def _fused_cpu_ok(q: Tensor, k: Tensor, v: Tensor, plan: _TorchPlan) -> bool:
    return _fused_cpu_kernels_take(q, plan) and _all_finite(q, k, v)


def _bucket_qkv(q: Tensor, k: Tensor, v: Tensor, b: _Batch):
    """q [n, Hq, Lq, D] and k, v [n, Hkv, Lk, D] of one padded call."""
    return (_padded(q, b.q_rows, b.n, b.lq, b.q_span), _padded(k, b.k_rows, b.n, b.lk, b.k_span),
            _padded(v, b.k_rows, b.n, b.lk, b.k_span))


def _padded(x: Tensor, rows: Tensor, n: int, length: int, span: tuple[int, int] | None = None) -> Tensor:
    """The rows `rows` of x [T, H, ...] as [n, H, length, ...] (the memory layout the fused
    CPU kernels use for their own outputs: [n, length, H, ...]); a view of x where the rows
    are the contiguous `span`."""
    if span is not None:
        return x[span[0] : span[1]].unsqueeze(0).transpose(1, 2)
    return x.index_select(0, rows).view(n, length, *x.shape[1:]).transpose(1, 2)


def _kernel_mask(b: _Batch, like: Tensor) -> dict:
    """The call's visibility as the fused CPU kernels take it: `is_causal` where that is the
    mask (no mask to build or add), else the additive mask (0 / -inf), built once per plan
    and dtype."""
    if b.causal:
        return dict(is_causal=True, attn_mask=None)
    mask = b.additive.get(like.dtype)
    if mask is None:
        mask = b.additive[like.dtype] = torch.zeros(b.mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
            ~b.mask, float("-inf"))
    return dict(is_causal=False, attn_mask=mask)


def _scatter_rows(plan: _CpuPlan, parts: list[Tensor]) -> Tensor:
    """Token rows [T, ...] from the batches' padded rows (each [n * Lq, ...], in plan order):
    one copy of each, every padding row dumped into an extra row T that the result (a view
    of the first T rows) leaves out; rows no batch computes are zero."""
    T = plan.tokens
    out = parts[0].new_empty((T + 1, *parts[0].shape[1:]))
    if plan.blind is not None:
        out.index_fill_(0, plan.blind, 0)
    for b, part in zip(plan.batches, parts):
        out.index_copy_(0, b.lse_rows, part)
    return out[:T]


def _prefix_rows(x: Tensor, p: _Prefix) -> Tensor:
    """x's rows of the prefix call `p` as [1, H, M, ...] (a view when they are contiguous)."""
    rows = x[p.first : p.first + p.rows.numel()] if p.first is not None else x.index_select(0, p.rows)
    return rows.unsqueeze(0).transpose(1, 2)


def _prefix_keys(x: Tensor, p: _Prefix) -> Tensor:
    return x[p.lo : p.hi].unsqueeze(0).transpose(1, 2)


def _fused_cpu_forward(q, k, v, plan: _TorchPlan, scale):
    T, Hq, D = q.shape
    cp = plan.cpu
    if not cp.batches:
        return q.new_zeros(T, Hq, D), q.new_zeros(Hq, T, dtype=lse_dtype(q))
    outs, lses = [], []
    for b in cp.batches:
        ob, lb = _CPU_FLASH(*_bucket_qkv(q, k, v, b), 0.0, **_kernel_mask(b, q), scale=scale)
        # both come in the memory layout [n, Lq, H(, D)]: these reshapes are views
        outs.append(ob.transpose(1, 2).reshape(b.n * b.lq, Hq, D))
        lses.append(lb.transpose(1, 2).reshape(b.n * b.lq, Hq))
    out, lse = _scatter_rows(cp, outs), _scatter_rows(cp, lses).to(lse_dtype(q))
    if cp.prefixes:
        o_pre, l_pre = [], []
        for p in cp.prefixes:
            op, lp = _CPU_FLASH(_prefix_rows(q, p), _prefix_keys(k, p), _prefix_keys(v, p), 0.0, False, scale=scale)
            o_pre.append(op[0].transpose(0, 1))
            l_pre.append(lp[0].t())
        rows = cp.pre_tokens
        # the weights exp(l_part - l_all) from the two lses in float64 ([rows, H], cheap): in
        # fp32 the logaddexp and the exps of the differences add a few ulps of the lses'
        # magnitude to each weight, ~1.2x the op's error against float64 on prefix readers
        l_own, l_p = lse.index_select(0, rows).double(), torch.cat(l_pre).double()
        l_all = torch.logaddexp(l_own, l_p)
        w_own, w_p = ((l - l_all).exp_().to(lse.dtype).unsqueeze(-1) for l in (l_own, l_p))
        # (no in-place op on a tensor autograd keeps: the replaying path differentiates this)
        merged = (out.index_select(0, rows).to(lse.dtype) * w_own).addcmul_(torch.cat(o_pre).to(lse.dtype), w_p)
        out.index_copy_(0, rows, merged.to(out.dtype))
        lse.index_copy_(0, rows, l_all.to(lse.dtype))
    return out, lse.t().contiguous()


def _fused_cpu_backward(dout, q, k, v, out, lse, plan: _TorchPlan, scale):
    """Per call, the fused CPU backward on the saved (merged) output and log-sum-exp. Padding
    query rows get lse +inf: their attention weights are exactly 0, so whatever (finite)
    dout and output rows they carry, they add nothing to dK/dV, as under SDPA's autograd."""
    T, Hq, D = q.shape
    cp = plan.cpu
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if not cp.batches:
        return torch.zeros_like(q), dk, dv
    # lse rows [T + 1, Hq], the last one +inf for the padding rows
    lse_rows = torch.cat([lse.t(), lse.new_full((1, Hq), float("inf"))])
    dout = dout.to(q.dtype)
    dqs = []
    for b in cp.batches:
        lb = lse_rows.index_select(0, b.lse_rows).view(b.n, b.lq, Hq).transpose(1, 2)
        gq, gk, gv = _CPU_FLASH_BWD(_padded(dout, b.q_rows, b.n, b.lq, b.q_span), *_bucket_qkv(q, k, v, b),
                                    _padded(out, b.q_rows, b.n, b.lq, b.q_span), lb, 0.0, **_kernel_mask(b, q),
                                    scale=scale)
        dqs.append(gq.transpose(1, 2).reshape(b.n * b.lq, Hq, D))
        gk, gv = gk.transpose(1, 2).reshape(b.n * b.lk, *k.shape[1:]), gv.transpose(1, 2).reshape(b.n * b.lk, *v.shape[1:])
        if b.k_span is not None:
            dk[b.k_span[0] : b.k_span[1]] += gk
            dv[b.k_span[0] : b.k_span[1]] += gv
        else:
            dk.index_add_(0, b.k_rows, gk)
            dv.index_add_(0, b.k_rows, gv)
    dq = _scatter_rows(cp, dqs)
    if cp.prefixes:
        dq_pre = []
        for p in cp.prefixes:
            gq, gk, gv = _CPU_FLASH_BWD(_prefix_rows(dout, p), _prefix_rows(q, p), _prefix_keys(k, p),
                                        _prefix_keys(v, p), _prefix_rows(out, p), _prefix_rows(lse_rows, p),
                                        0.0, False, scale=scale)
            dq_pre.append(gq[0].transpose(0, 1))
            dk[p.lo : p.hi] += gk[0].transpose(0, 1)
            dv[p.lo : p.hi] += gv[0].transpose(0, 1)
        dq.index_add_(0, cp.pre_tokens, torch.cat(dq_pre))
    return dq, dk, dv


class _FusedCpuAttention(torch.autograd.Function):
    """The fused CPU forward and backward as one differentiable function (their log-sum-exp
    merge cannot go through the kernels' own autograd formulas, which drop the lse's
    gradient); for the non-finite inputs' path, which differentiates by replaying."""

    @staticmethod
    def forward(q, k, v, plan, scale):
        return _fused_cpu_forward(q, k, v, plan, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, plan, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.plan, ctx.scale = plan, scale
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return _fused_cpu_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale) + (None, None)


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
