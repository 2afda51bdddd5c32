"""Benchmark: fused linear reverse-KL + log-prob + entropy vs the naive materialising op,
and the teacher-less fused log-prob + entropy vs naive log_softmax + gather + entropy.

Run: `pytest benchmarks/bench_fused_distill.py --benchmark-only` (add `-s` to also see
the per-case lines; the summary table is written to the terminal either way).

What is measured (forward + backward of the actor-style loss
`loss + 0.1·Σ logprobs - 0.01·Σ entropy`, gradients to student hidden and weight):

* CPU, fp32, Hs = Ht = 512: N=4096 × V=32000, and N=256 × V=128000.
  - time: in this process, one torch thread and the process CPU-time clock by default
    (`benchmarks/_timing.py`; `MEMOPD_BENCH_CLOCK=wall` on request): the first test of a
    case times every variant of it in `MEMOPD_BENCH_ROUNDS` (3) interleaved rounds (each
    round runs each variant once, the order rotating), and each test hands its variant's
    durations to pytest-benchmark; the summary gives the median with min-max and names
    the rounds that machine load made unreliable.
  - peak memory: each variant runs once more in a fresh subprocess
    (`python bench_fused_distill.py --measure ...`), which builds its inputs, resets the
    kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs` resets VmHWM), and
    reports VmHWM minus the RSS right before the call. That is the peak *resident*
    memory the op adds on top of its inputs: every torch CPU allocation it touches,
    gradients included (plus whatever the allocator keeps mapped), not an estimate.
    Where clear_refs is unavailable it falls back to ru_maxrss (then the input
    construction peak is a lower bound of the reported number; flagged in the table).
* Teacher-less (`fused_linear_logprob_entropy` vs `reference_linear_logprob_entropy`,
  i.e. fp32 [N, V] logits -> log_softmax -> gather + entropy), CPU, fp32, N=1024,
  H=512, V=32000, same time / peak-memory method, two modes:
  - `lpe-train-*`: forward + backward of a PPO-style `-Σ adv·logprobs - 0.01·Σ entropy`
    (gradients to hidden and weight);
  - `lpe-score-*`: forward only under `torch.no_grad()` (rollout scoring).
  In train mode two more variants: `fused_loss`, `fused_linear_logprob_entropy`
  with the same loss declared (`logprob_weight=-adv, entropy_weight=-0.01`), which takes
  its gradients in the forward (3 lm-head matmuls against the recomputing op's 4), and
  `kl_self`, the workaround the teacher-less op replaces: the detached student passed as
  the "teacher" of `fused_linear_reverse_kl`. (Liger-Kernel's chunked losses have no
  teacher-less log-prob + entropy loss to set beside them: its chunked GRPO / PPO losses
  compute log-probs only, inside a clipped-ratio objective.)
  The whole `-k lpe` selection runs in well under a minute on 2 CPU cores.
* GPU (skipped without CUDA): bf16 at Qwen2.5-3B / 7B lm_head shapes (H = 2048 / 3584,
  V = 151936), N = 4096: ours, the naive op, and Liger's `LigerFusedLinearJSD`
  with jsd_beta=1 (= reverse KL; imported lazily, skipped if absent). Memory is
  `torch.cuda.max_memory_allocated` above the inputs; only the divergence is
  backpropagated there, since Liger computes nothing else. Teacher-less at the 7B
  shape (bf16, N=4096): the fused op vs the naive one, train and score modes, and
  `fused_loss` in train mode.

Every figure goes into `benchmark.extra_info`; a table with the memory ratio
(naive / fused) and the time ratio (fused / naive) is printed at the end.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from _fresh_process import measure_call
from _timing import bench_clock, interleaved, record_durations

from memopd.ops import (
    fused_linear_distill,
    fused_linear_logprob_entropy,
    fused_linear_reverse_kl,
    reference_linear_distill,
    reference_linear_logprob_entropy,
)

ROUNDS = int(os.environ.get("MEMOPD_BENCH_ROUNDS", "3"))
CLOCK = bench_clock()
CPU_CASES = {
    "N4096-H512-V32000": dict(N=4096, Hs=512, Ht=512, V=32000),
    "N256-H512-V128000": dict(N=256, Hs=512, Ht=512, V=128000),
}
GPU_CASES = {
    "qwen2.5-3b": dict(N=4096, Hs=2048, Ht=2048, V=151936),
    "qwen2.5-7b": dict(N=4096, Hs=3584, Ht=3584, V=151936),
    "3b-student-7b-teacher": dict(N=4096, Hs=2048, Ht=3584, V=151936),
}
IMPLS = {"fused": fused_linear_distill, "naive": reference_linear_distill}
# teacher-less: case -> shape and mode ("train": fwd+bwd, "score": forward under no_grad)
LPE_CPU_CASES = {
    "lpe-train-N1024-H512-V32000": dict(N=1024, H=512, V=32000, mode="train"),
    "lpe-score-N1024-H512-V32000": dict(N=1024, H=512, V=32000, mode="score"),
}
LPE_GPU_CASES = {
    "lpe-train-qwen2.5-7b": dict(N=4096, H=3584, V=151936, mode="train"),
    "lpe-score-qwen2.5-7b": dict(N=4096, H=3584, V=151936, mode="score"),
}


def _kl_self(h, w, y, mask):
    """The workaround the teacher-less op replaces: a detached copy of the student as the
    'teacher' of fused_linear_reverse_kl (twice the lm_head matmuls in the forward)."""
    return fused_linear_reverse_kl(h, w, h.detach(), w.detach(), y, mask=mask)


LPE_IMPLS = {"fused": fused_linear_logprob_entropy, "naive": reference_linear_logprob_entropy,
             "kl_self": _kl_self}
RESULTS: dict = {}
_TIMED: dict = {}  # case -> _timing.Rounds of all its CPU variants, measured by the case's first test


def make_inputs(N, Hs, Ht, V, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hs = torch.randn(N, Hs, generator=g, device=device, dtype=dtype).requires_grad_()
    ws = torch.randn(V, Hs, generator=g, device=device, dtype=dtype).mul_(Hs ** -0.5).requires_grad_()
    ht = torch.randn(N, Ht, generator=g, device=device, dtype=dtype)
    wt = torch.randn(V, Ht, generator=g, device=device, dtype=dtype).mul_(Ht ** -0.5)
    y = torch.randint(0, V, (N,), generator=g, device=device)
    mask = torch.ones(N, dtype=torch.bool, device=device)
    return hs, ws, ht, wt, y, mask


def actor_step(impl, hs, ws, ht, wt, y, mask):
    out = IMPLS[impl](hs, ws, ht, wt, y, mask=mask)
    loss = out.loss + 0.1 * out.logprobs.sum() - 0.01 * out.entropy.sum()
    return torch.autograd.grad(loss, [hs, ws])


def make_lpe_inputs(N, H, V, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(N, H, generator=g, device=device, dtype=dtype).requires_grad_()
    w = torch.randn(V, H, generator=g, device=device, dtype=dtype).mul_(H ** -0.5).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g, device=device)
    adv = torch.randn(N, generator=g, device=device)
    mask = torch.ones(N, dtype=torch.bool, device=device)
    return h, w, y, adv, mask


def lpe_step(impl, mode, h, w, y, adv, mask):
    """One PPO-style actor step (mode="train") or one no-grad scoring pass ("score")."""
    if impl == "fused_loss":  # the same loss, declared to the op (train mode only)
        out = fused_linear_logprob_entropy(h, w, y, logprob_weight=-adv, entropy_weight=-0.01, mask=mask)
        return torch.autograd.grad(out.loss, [h, w])
    if mode == "score":
        with torch.no_grad():
            return LPE_IMPLS[impl](h, w, y, mask=mask)
    out = LPE_IMPLS[impl](h, w, y, mask=mask)
    loss = -(adv * out.logprobs).sum() - 0.01 * out.entropy.sum()
    return torch.autograd.grad(loss, [h, w])


# ----------------------------------------------------------------------------------
# peak resident memory of one forward+backward, in a fresh process
# ----------------------------------------------------------------------------------
def _warm_up(impl, device="cpu", dtype=torch.float32, mode=None):
    # first-call costs (lazy imports, op registration, thread pools) are not the op's
    if mode is None:
        actor_step(impl, *make_inputs(8, 16, 16, 64, device=device, dtype=dtype))
    else:
        lpe_step(impl, mode, *make_lpe_inputs(8, 16, 64, device=device, dtype=dtype))


def _measure(impl, N, Hs, Ht, V, mode=None):
    """Peak RSS of one step above its inputs. mode=None: distillation actor step (Ht
    used); mode="train"/"score": teacher-less step with hidden size Hs."""
    _warm_up(impl, mode=mode)
    if mode is None:
        inputs, step = make_inputs(N, Hs, Ht, V), actor_step
    else:
        inputs, step = make_lpe_inputs(N, Hs, V), (lambda impl_, *a: lpe_step(impl_, mode, *a))
    grads, m = measure_call(lambda: step(impl, *inputs), require_exact=False)
    del grads
    return dict(peak_bytes=m["peak_kb"] * 1024, seconds=m["wall_s"], exact=m["exact"])


def measure_in_subprocess(impl, case):
    if case in LPE_CPU_CASES:
        c = LPE_CPU_CASES[case]
        c = dict(N=c["N"], Hs=c["H"], Ht=c["H"], V=c["V"], mode=c["mode"])
    else:
        c = CPU_CASES[case]
    cmd = [sys.executable, __file__, "--measure", impl, str(c["N"]), str(c["Hs"]), str(c["Ht"]), str(c["V"])]
    if c.get("mode"):
        cmd.append(c["mode"])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------
# summary table
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    if not RESULTS:
        return
    lines = ["", "fused linear distillation (lpe-*: teacher-less log-prob + entropy), fused vs naive",
             f"{'case':<30}{'impl':<12}{'time s':>9}{'(min-max)':>16}{'peak MiB':>11}{'mem ratio':>11}"
             f"{'time ratio':>12}"]
    for case in sorted({k[0] for k in RESULTS}):
        naive = RESULTS.get((case, "naive"))
        for impl in ("naive", "fused", "fused_loss", "liger", "fused_actor", "kl_self"):
            r = RESULTS.get((case, impl))
            if r is None:
                continue
            mr = tr = ""
            if naive and impl != "naive":
                mr = f"{naive['peak_bytes'] / max(r['peak_bytes'], 1):.1f}x"
                tr = f"{r['seconds'] / naive['seconds']:.2f}x"
            flag = "" if r.get("exact", True) else " (ru_maxrss)"
            spread = f"({r['min_s']:.3f}-{r['max_s']:.3f})" if r.get("min_s") is not None else ""
            lines.append(f"{case:<30}{impl:<12}{r['seconds']:>9.3f}{spread:>16}{r['peak_bytes'] / 2**20:>11.1f}"
                         f"{mr:>11}{tr:>12}{flag}")
    for case in sorted({k[0] for k in RESULTS}):
        old, new = RESULTS.get((case, "fused")), RESULTS.get((case, "fused_loss"))
        if old and new:
            lines.append(f"{case}: fused_loss / fused time {new['seconds'] / old['seconds']:.2f}x, "
                         f"peak {new['peak_bytes'] / max(old['peak_bytes'], 1):.2f}x")
    lines.append("mem ratio = naive peak / this peak; time ratio = this time / naive time; CPU cases: "
                 f"{CLOCK} clock, one thread, medians of {ROUNDS} interleaved rounds (min-max)")
    for case, timed in sorted(_TIMED.items()):
        for note in timed.unreliable():
            lines.append(f"  (!) {case}: {note}: load made this round unreliable")
    text = "\n".join(lines)
    # module teardown output is captured like a test's: print past the capture
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(text, flush=True)
    else:
        print(text)


def _record(benchmark, case, impl, mem, times=None):
    """`times`: the interleaved durations of this variant (CPU cases); else the stats of
    the benchmark's own rounds (GPU cases)."""
    if times:
        seconds, extra = statistics.median(times), dict(min_s=min(times), max_s=max(times))
    else:
        seconds, extra = (benchmark.stats.stats.mean if benchmark.stats else mem.get("seconds", float("nan"))), {}
    RESULTS[(case, impl)] = dict(seconds=seconds, peak_bytes=mem["peak_bytes"], exact=mem.get("exact", True), **extra)
    benchmark.extra_info.update(case=case, impl=impl, peak_bytes=mem["peak_bytes"],
                                peak_mib=round(mem["peak_bytes"] / 2**20, 1),
                                peak_measure=mem.get("how", "VmHWM delta in a fresh process"),
                                probe_seconds=mem.get("seconds"))
    other = RESULTS.get((case, "naive" if impl != "naive" else "fused"))
    if other is not None:
        naive, fused = (other, RESULTS[(case, impl)]) if impl != "naive" else (RESULTS[(case, impl)], other)
        ratios = dict(memory_ratio_naive_over_fused=naive["peak_bytes"] / max(fused["peak_bytes"], 1),
                      time_ratio_fused_over_naive=fused["seconds"] / naive["seconds"])
        benchmark.extra_info.update(ratios)
        print(f"{case}: memory ratio {ratios['memory_ratio_naive_over_fused']:.1f}x, "
              f"time ratio {ratios['time_ratio_fused_over_naive']:.2f}x")


# ----------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["naive", "fused"])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_forward_backward(benchmark, case, impl):
    mem = measure_in_subprocess(impl, case)
    timed = _timed_case(case, ["naive", "fused"], lambda: make_inputs(**CPU_CASES[case]), actor_step, mode=None)
    benchmark.group = f"cpu {case}"
    _replay(benchmark, timed, impl)
    _record(benchmark, case, impl, mem, timed.times[impl])


LPE_TRAIN_ONLY = ("fused_loss", "kl_self")


@pytest.mark.parametrize("impl", ["naive", "fused", *LPE_TRAIN_ONLY])
@pytest.mark.parametrize("case", list(LPE_CPU_CASES))
def test_cpu_lpe(benchmark, case, impl):
    """Teacher-less: naive log_softmax + gather + entropy vs fused_linear_logprob_entropy
    (and, training, the same loss declared to it: `logprob_weight=`, `entropy_weight=`)."""
    c = LPE_CPU_CASES[case]
    if impl in LPE_TRAIN_ONLY and c["mode"] != "train":
        pytest.skip(f"{impl} is only measured in train mode (a loss, or the workaround of one)")
    mem = measure_in_subprocess(impl, case)
    impls = ["naive", "fused", *LPE_TRAIN_ONLY] if c["mode"] == "train" else ["naive", "fused"]
    timed = _timed_case(case, impls, lambda: make_lpe_inputs(c["N"], c["H"], c["V"]),
                        lambda impl_, *a: lpe_step(impl_, c["mode"], *a), mode=c["mode"])
    benchmark.group = f"cpu {case}"
    _replay(benchmark, timed, impl)
    _record(benchmark, case, impl, mem, timed.times[impl])


def _timed_case(case, impls, make, step, mode):
    """All variants of a CPU case timed in interleaved rounds, once per case (the first
    of its tests measures; the others reuse)."""
    if case not in _TIMED:
        for impl in impls:
            _warm_up(impl, mode=mode)
        inputs = make()  # freed when this returns: the Rounds keep only durations
        _TIMED[case] = interleaved({impl: (lambda impl=impl: step(impl, *inputs)) for impl in impls}, ROUNDS,
                                   clock=CLOCK)
    return _TIMED[case]


def _replay(benchmark, timed, impl):
    record_durations(benchmark, timed.times[impl])
    benchmark.extra_info.update(times_s=[round(t, 6) for t in timed.times[impl]], interleaved=True, **timed.summary())


# ----------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------
def _liger_loss_fn():
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
    except Exception as e:  # noqa: BLE001 not installed, or a build that fails to import: skip, naming why
        pytest.skip(f"liger-kernel not available: {e}")
    try:
        mod = LigerFusedLinearJSD(jsd_beta=1.0, temperature=1.0)  # beta=1: reverse KL
    except (AssertionError, ValueError) as e:  # old versions only allow 0 < beta < 1
        pytest.skip(f"this liger-kernel does not support jsd_beta=1: {e}")

    def fn(hs, ws, ht, wt, y, mask):
        return mod(hs, ws, ht, wt, torch.where(mask, y, torch.full_like(y, -100)))

    return fn


def _gpu_step(impl):
    if impl == "liger":
        liger = _liger_loss_fn()
        return lambda hs, ws, ht, wt, y, mask: torch.autograd.grad(liger(hs, ws, ht, wt, y, mask), [hs, ws])

    def kl_only(hs, ws, ht, wt, y, mask):
        out = IMPLS["naive" if impl == "naive" else "fused"](hs, ws, ht, wt, y, mask=mask)
        if impl == "fused_actor":
            loss = out.loss + 0.1 * out.logprobs.sum() - 0.01 * out.entropy.sum()
        else:
            loss = out.loss
        return torch.autograd.grad(loss, [hs, ws])

    return kl_only


def _gpu_benchmark(benchmark, case, impl, step):
    """Warm up `step` (autotuning, compilation; skip on OOM), record its peak memory above
    the inputs, then time it."""
    torch.cuda.synchronize()
    try:
        step()  # warm-up: Triton autotuning / compilation
    except torch.cuda.OutOfMemoryError:
        pytest.skip(f"{impl} runs out of memory at {case}")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out

    def timed():
        step()
        torch.cuda.synchronize()

    benchmark.group = f"gpu {case}"
    benchmark.pedantic(timed, rounds=max(ROUNDS, 5), iterations=1, warmup_rounds=1)
    _record(benchmark, case, impl, dict(peak_bytes=peak, how="torch.cuda.max_memory_allocated above inputs"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU benchmark: needs a CUDA device")
@pytest.mark.parametrize("impl", ["naive", "fused", "fused_actor", "liger"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_forward_backward(benchmark, case, impl):
    step = _gpu_step(impl)
    inputs = make_inputs(**GPU_CASES[case], device="cuda", dtype=torch.bfloat16)
    _gpu_benchmark(benchmark, case, impl, lambda: step(*inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU benchmark: needs a CUDA device")
@pytest.mark.parametrize("impl", ["naive", "fused", "fused_loss"])
@pytest.mark.parametrize("case", list(LPE_GPU_CASES))
def test_gpu_lpe(benchmark, case, impl):
    c = LPE_GPU_CASES[case]
    if impl == "fused_loss" and c["mode"] != "train":
        pytest.skip("fused_loss is a training loss")
    inputs = make_lpe_inputs(c["N"], c["H"], c["V"], device="cuda", dtype=torch.bfloat16)
    _gpu_benchmark(benchmark, case, impl, lambda: lpe_step(impl, c["mode"], *inputs))


if __name__ == "__main__" and len(sys.argv) >= 7 and sys.argv[1] == "--measure":
    impl_, N_, Hs_, Ht_, V_ = sys.argv[2], *map(int, sys.argv[3:7])
    mode_ = sys.argv[7] if len(sys.argv) >= 8 else None
    print(json.dumps(_measure(impl_, N_, Hs_, Ht_, V_, mode_)))
