"""Packed-attention benchmarks (pytest-benchmark): `memopd.ops.attention`.

Layouts are what the aligned packer produces for group rollouts: a row holds a few prefix
segments (the task prompt q), each read in full by several call segments [x_t, a_t] of
ragged length, plus trailing padding.

CPU entry (`test_cpu_torch_path_vs_dense_reference`, fwd and fwd+bwd): the exact PyTorch
path (per-segment SDPA over [prefix, own segment] keys) against the dense [T, T]-mask
reference on T=4096 tokens (3 prefixes x 10 calls, 8 heads, D=64, fp32). The reference is
timed by hand (2 rounds, it takes seconds), the torch path by pytest-benchmark;
`extra_info` holds both medians, the speedup and the max |difference|.

GPU entries (`test_gpu_packed_attention`, skipped without CUDA): 16384 tokens (4 prefixes of
~1k tokens x 8 calls), 32 query heads / 8 kv heads, D=128, bf16, forward and
forward+backward, for
  triton        the Triton kernels of this project (prefix computed once, dK/dV of the
                prefix summed over its calls in-kernel),
  flash_varlen  flash-attn's `flash_attn_varlen_func` with the prefix K/V copied in front of
                every call segment (bottom-right causal); the gathers are timed too,
                since they are what that approach costs (skipped if flash-attn is missing),
  flex          FlexAttention with a block mask built from the same O(T) metadata
                (`create_block_mask`; its build time, a per-batch cost, is in extra_info).
`extra_info` holds the median ms, useful TFLOP/s (visible query-key pairs only, bwd
counted as 2.5x fwd) and the max |difference| to an fp32 per-segment SDPA result.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import pytest
import torch

from memopd.layout import AttentionMeta, SegmentKind
from memopd.ops.attention import packed_attention

GPU = torch.cuda.is_available()


def group_layout(tokens: int, groups: int, calls: int, prefix_len: tuple[int, int], seed: int) -> AttentionMeta:
    """`groups` x (prefix segment + `calls` call segments of ragged length), padded to `tokens`."""
    rng = random.Random(seed)
    budget = tokens - rng.randint(8, 64)  # leave some trailing padding
    per_group = budget // groups
    lens, links, kinds = [], [], []
    for _ in range(groups):
        p = len(lens)
        plen = rng.randint(*prefix_len)
        lens.append(plen)
        links.append(-1)
        kinds.append(SegmentKind.PREFIX)
        rest = per_group - plen
        cuts = sorted(rng.sample(range(1, rest), calls - 1))
        for a, b in zip([0] + cuts, cuts + [rest]):
            lens.append(b - a)
            links.append(p)
            kinds.append(SegmentKind.CALL)
    lens.append(tokens - sum(lens))
    links.append(-1)
    kinds.append(SegmentKind.PAD)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return AttentionMeta.from_segments(cu, links, kinds)


def visible_pairs(meta: AttentionMeta) -> int:
    i = torch.arange(meta.num_tokens)
    own = (i - meta.seg_start.long().cpu() + 1).clamp(min=0)
    pre = (meta.prefix_end.long() - meta.prefix_start.long()).cpu().clamp(min=0)
    return int((own + pre).sum())


def _median_s(benchmark) -> float | None:
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else stats.stats.median


# ------------------------------------------------------------------------------ CPU
@pytest.fixture
def one_thread():
    """Both paths on one intra-op thread: on a shared CPU (CI, other jobs) OpenMP thread
    pools stall on every parallel region and the timings say nothing; one thread keeps
    the comparison stable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_cpu_torch_path_vs_dense_reference(benchmark, mode, one_thread):
    T, H, D = 4096, 8, 64
    meta = group_layout(T, groups=3, calls=10, prefix_len=(256, 512), seed=0)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(T, H, D, generator=g) for _ in range(4))

    def step(backend):
        def fn():
            if mode == "fwd":
                with torch.no_grad():
                    return packed_attention(q, k, v, meta, backend=backend)
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = packed_attention(qq, kk, vv, meta, backend=backend)
            out.backward(do)
            return out.detach()

        return fn

    ref_fn, torch_fn = step("reference"), step("torch")
    ref_times = []
    for _ in range(2):
        t0 = time.perf_counter()
        ref_out = ref_fn()
        ref_times.append(time.perf_counter() - t0)
    out = benchmark.pedantic(torch_fn, rounds=5, iterations=1, warmup_rounds=1)
    torch_s = _median_s(benchmark)
    if torch_s is None:  # --benchmark-disable
        t0 = time.perf_counter()
        torch_fn()
        torch_s = time.perf_counter() - t0
    ref_s = statistics.median(ref_times)
    diff = (out - ref_out).abs().max().item()
    benchmark.extra_info.update(
        {
            "mode": mode,
            "tokens": T,
            "segments": meta.num_segments,
            "heads": H,
            "head_dim": D,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "torch_path_median_s": round(torch_s, 5),
            "dense_reference_median_s": round(ref_s, 5),
            "speedup_vs_reference": round(ref_s / torch_s, 2),
            "max_abs_diff": diff,
        }
    )
    assert diff < 1e-4


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def gpu_case():
    T, Hq, Hkv, D = 16384, 32, 8, 128
    dtype = torch.bfloat16
    meta = group_layout(T, groups=4, calls=8, prefix_len=(768, 1280), seed=1).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(T, Hkv, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(T, Hq, D, device="cuda", dtype=dtype, generator=g)
    # yardstick: the exact per-segment SDPA path in fp32 on the GPU
    with torch.no_grad():
        ref = packed_attention(q.float(), k.float(), v.float(), meta, backend="torch")
    return {"meta": meta, "q": q, "k": k, "v": v, "do": do, "ref": ref, "scale": 1.0 / math.sqrt(D)}


def _triton_fn(c, mode):
    q, k, v, do, meta = c["q"], c["k"], c["v"], c["do"], c["meta"]

    def fn():
        if mode == "fwd":
            with torch.no_grad():
                return packed_attention(q, k, v, meta, backend="triton")
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = packed_attention(qq, kk, vv, meta, backend="triton")
        out.backward(do)
        return out.detach()

    return fn, {}


def _flash_fn(c, mode):
    fa = pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    q, k, v, do, meta = c["q"], c["k"], c["v"], c["do"], c["meta"]
    # per call segment: keys [its prefix, itself]; prefix segments: themselves; padding: none
    cu = meta.cu_seqlens.tolist()
    q_idx, k_idx, cu_q, cu_k = [], [], [0], [0]
    for s, (kind, p) in enumerate(zip(meta.segment_kind.tolist(), meta.prefix_segment.tolist())):
        if kind == SegmentKind.PAD:
            continue
        own = list(range(cu[s], cu[s + 1]))
        keys = (list(range(cu[p], cu[p + 1])) if p >= 0 else []) + own
        q_idx += own
        k_idx += keys
        cu_q.append(cu_q[-1] + len(own))
        cu_k.append(cu_k[-1] + len(keys))
    dev = q.device
    q_idx_t = torch.tensor(q_idx, device=dev)
    k_idx_t = torch.tensor(k_idx, device=dev)
    cu_q_t = torch.tensor(cu_q, device=dev, dtype=torch.int32)
    cu_k_t = torch.tensor(cu_k, device=dev, dtype=torch.int32)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))

    def fn():
        grad = mode != "fwd"
        with torch.set_grad_enabled(grad):
            qq, kk, vv = (x.detach().requires_grad_(grad) for x in (q, k, v))
            # flash-attn's causal mask is bottom-right aligned when seqlen_k > seqlen_q
            oc = fa.flash_attn_varlen_func(
                qq.index_select(0, q_idx_t), kk.index_select(0, k_idx_t), vv.index_select(0, k_idx_t),
                cu_q_t, cu_k_t, max_q, max_k, causal=True, softmax_scale=c["scale"],
            )
            out = torch.zeros_like(q).index_copy(0, q_idx_t, oc)
            if grad:
                out.backward(do)
        return out.detach()

    return fn, {"kv_tokens_after_copy": len(k_idx), "kv_tokens_packed": q.shape[0]}


def _flex_fn(c, mode):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        pytest.skip("FlexAttention is not available in this torch")
    q, k, v, do, meta = c["q"], c["k"], c["v"], c["do"], c["meta"]
    T = q.shape[0]
    ss, ps, pe = meta.seg_start, meta.prefix_start, meta.prefix_end

    def mask_mod(b, h, q_idx, kv_idx):
        own = (kv_idx >= ss[q_idx]) & (kv_idx <= q_idx)
        pre = (kv_idx >= ps[q_idx]) & (kv_idx < pe[q_idx])
        return own | pre

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    flex = torch.compile(flex_attention, dynamic=False)
    qh, kh, vh, doh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do))

    def fn():
        grad = mode != "fwd"
        with torch.set_grad_enabled(grad):
            qq, kk, vv = (x.detach().requires_grad_(grad) for x in (qh, kh, vh))
            out = flex(qq, kk, vv, block_mask=block_mask, scale=c["scale"], enable_gqa=True)
            if grad:
                out.backward(doh)
        return out.detach()[0].transpose(0, 1)

    return fn, {"block_mask_build_ms (first call, incl. compile)": round(build_s * 1e3, 3)}


IMPLS = {"triton": _triton_fn, "flash_varlen": _flash_fn, "flex": _flex_fn}


@pytest.mark.skipif(not GPU, reason="GPU benchmark: needs CUDA (Triton kernel vs flash-attn varlen vs "
                    "FlexAttention at 16k tokens, 32/8 heads, D=128, bf16)")
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_gpu_packed_attention(benchmark, gpu_case, impl, mode):
    fn, info = IMPLS[impl](gpu_case, mode)

    def timed():
        out = fn()
        torch.cuda.synchronize()
        return out

    t0 = time.perf_counter()
    out = timed()  # compile / autotune happen here
    first_s = time.perf_counter() - t0
    out = benchmark.pedantic(timed, rounds=20, iterations=1, warmup_rounds=3)
    med = _median_s(benchmark)
    q, meta = gpu_case["q"], gpu_case["meta"]
    T, Hq, D = q.shape
    flops = 4.0 * visible_pairs(meta) * D * Hq * (1.0 if mode == "fwd" else 3.5)
    ref = gpu_case["ref"]
    diff = (out.float() - ref).abs().max().item()
    benchmark.extra_info.update(
        {
            "impl": impl,
            "mode": mode,
            "tokens": T,
            "q_heads": Hq,
            "kv_heads": gpu_case["k"].shape[1],
            "head_dim": D,
            "dtype": "bfloat16",
            "segments": meta.num_segments,
            "visible_pairs": visible_pairs(meta),
            "first_call_s": round(first_s, 3),
            "median_ms": None if med is None else round(med * 1e3, 4),
            "tflops": None if med is None else round(flops / med / 1e12, 2),
            "max_abs_diff_vs_fp32_sdpa": diff,
            "device": torch.cuda.get_device_name(),
            **info,
        }
    )
    # bf16 output vs an fp32 result: a few bf16 ulps of |out| <= ~4
    assert diff < 6e-2, f"{impl}: max |diff| {diff} to the fp32 per-segment SDPA result"
