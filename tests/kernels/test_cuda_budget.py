"""The device-memory budget of the GPU tests (tests/kernels/_cuda_budget.py), checked on CPU.

- Every GPU test of test_kernels_cuda.py has a modelled peak, and at the worker count
  benchmarks/gpu_check.sh derives for a 78 GiB H100 each fits its share (peak plus a CUDA
  context, times the workers, within the device less a reserve); no test needs more than
  ~10 GiB.
- The model's float64-reference term bounds what the blocked reference really allocates:
  measured on CPU with the profiler's allocation events at small shapes, for every op
  kind (the same code runs on the GPU; CUDA's extra temporaries are in the model's margin).
- The attention layouts' sums of rows x keys are the ones the model uses.
"""
from __future__ import annotations

import sys
from pathlib import Path

import _cuda_budget as B
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
H100 = 78 * B.GIB


@pytest.fixture(scope="module")
def peaks():
    return B.all_peaks()


def test_every_gpu_test_fits_its_share_of_an_h100(peaks):
    assert len(peaks) >= 70  # every collected GPU test has a model (peak_of raises otherwise)
    workers = B.workers_for(H100, list(peaks.values()))
    # gpu_check.sh sizes -n before collecting: its enumeration must cover every collected test
    assert max(peaks.values()) <= B.static_max_peak()
    assert workers == B.workers_for(H100, [B.static_max_peak()])
    assert workers >= 4, f"only {workers} workers fit 78 GiB: phase 1 would not fit its time"
    share = (H100 - B.RESERVE) / workers
    over = {k: v / B.GIB for k, v in peaks.items() if v + B.CONTEXT > share}
    assert not over, f"over the {share / B.GIB:.1f} GiB share at {workers} workers: {over}"
    assert max(peaks.values()) <= 10.5 * B.GIB
    assert B.workers_for(139 * B.GIB, list(peaks.values())) >= workers  # an H200 never gets fewer


def test_worker_count_follows_free_memory():
    top = B.static_max_peak()
    assert B.workers_for(B.RESERVE + 2 * (top + B.CONTEXT), [top]) == 2
    assert B.workers_for(1 * B.GIB, [top]) == 1  # never zero: one process, the tests then run in turn
    assert B.workers_for(1000 * B.GIB, [top], cpus=3) == 3
    assert B.workers_for(1000 * B.GIB, [top]) == B.MAX_WORKERS


def test_unknown_test_has_no_model():
    with pytest.raises(ValueError, match="no memory model"):
        B.peak_of("tests/kernels/test_kernels_cuda.py::test_something_new[bf16]")


def _live_peak(fn) -> int:
    """Peak of the bytes allocated and not yet freed while `fn` runs (CPU allocator
    events of the profiler, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("kind", sorted(B.REF_TEMPS))
@pytest.mark.parametrize("N,H,V,block", [(128, 8, 20000, 64), (128, 512, 2000, 64), (96, 256, 8000, 32)])
def test_reference_term_bounds_the_measured_allocation(kind, N, H, V, block):
    sys.path.insert(0, str(REPO / "tests"))
    import test_kernels_cuda as T

    from memopd.ops import reference_actor_loss, reference_linear_distill, reference_linear_logprob_entropy

    torch.set_num_threads(1)
    inp = T.lm_inputs(N, H, V, torch.float32, "cpu")
    keep = int(inp["mask"].sum())
    weights = dict(T.token_weights(N, "cpu"), loss=0.8)
    if kind == "lpe":
        weights = {k: weights[k] for k in ("logprobs", "entropy")}

        def fn(x, s, e):
            return reference_linear_logprob_entropy(x["hs"], x["ws"], x["y"], bias=x["bs"], mask=x["mask"])
    elif kind == "actor":
        g = torch.Generator().manual_seed(0)
        adv, old = torch.randn(N, generator=g, dtype=torch.float64), -5 * torch.rand(N, generator=g, dtype=torch.float64)
        weights = {"loss": 1.0}

        def fn(x, s, e):
            return reference_actor_loss(x["hs"], x["ws"], x["y"], adv[s:e], old[s:e], student_bias=x["bs"],
                                        mask=x["mask"], teacher_hidden=x["ht"], teacher_weight=x["wt"], clip_eps=0.2,
                                        dual_clip=3.0, entropy_coef=0.01, teacher_kl_coef=0.1, normalizer=keep,
                                        kl_normalizer=keep)
    else:
        def fn(x, s, e):
            return reference_linear_distill(x["hs"], x["ws"], x["ht"], x["wt"], x["y"], mask=x["mask"],
                                            student_bias=x["bs"], divergence=kind, beta=0.4, reduction="sum")
    measured = _live_peak(lambda: T.blocked_reference(fn, inp, weights, block=block, loss_divisor=keep))
    model = B.reference_extra(kind, N, H, V, block)
    assert measured <= model, f"{kind}: measured {measured / 2**20:.1f} MiB > model {model / 2**20:.1f} MiB"
    assert model <= 2.5 * measured, f"{kind}: model {model / 2**20:.1f} MiB, measured only {measured / 2**20:.1f} MiB"


def test_attention_layout_sums_are_the_models():
    sys.path.insert(0, str(REPO / "tests"))
    import test_kernels_cuda as T

    from memopd.ops.attention_torch import plan_runs

    def rows_keys(meta):
        return sum((r.stop - r.start) * ((r.prefix_end - r.prefix_start) + (r.stop - r.seg_start))
                   for r in plan_runs(meta) if not r.zero)

    # the seeds the attention tests use (0: production shape, 3: agree, 1-3: candidates)
    assert max(rows_keys(T.shared_prefix_meta(4096, s)) for s in range(4)) == B.SUM_ROWS_KEYS["shared-4096"]
    assert rows_keys(T._one_prefix_meta(8192, 2048, 16)) == B.SUM_ROWS_KEYS["one-prefix-8192"]
