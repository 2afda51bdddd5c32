"""Device memory of each test in tests/kernels/test_kernels_cuda.py, and the pytest-xdist
worker count that fits a GPU: pure Python (no torch), so benchmarks/gpu_check.sh can size
`-n` before anything imports torch.

Every worker is a process with its own CUDA context and caching allocator; the lm-head
tests return the allocator's blocks after each test (`torch.cuda.empty_cache()` in their
fixture), so a worker holds at most its largest test's peak plus its context. The peak of
a test is an upper bound assembled from what it allocates (sizes in bytes):

- lm-head tests (N tokens, H hidden, V head rows, d bytes per input element, `a`
  [64, V] float64 temporaries of the reference's block, measured on CPU per op kind by
  tests/kernels/test_cuda_budget.py, plus 2 for CUDA's own temporaries):
  inputs  I = (N*H + V*H + V) * d, twice with a teacher;
  reference phase = I + 20 * V*H (the student head as a float64 leaf, the float32 sum
  of its gradient over blocks, and either the teacher head converted to float64 for one
  call, during a block's forward, or the block's float64 weight gradient, during its
  backward) + a * 64 * V * 8 + 4 * N*H * 8;
  op phase = I + 4 * V*H (the reference's float32 gradient, kept for the comparison)
  + V*H * d (the op's weight gradient) + 4 * V*H (an fp32 gradient accumulator) +
  1.25 GiB (two 512-MiB fp32 logits scratches and a half-size 16-bit one:
  kernels/distill_rows.py) + 4 * N*H * 4;
  peak = the larger phase, x 1.1 for the allocator's rounding and fragmentation.
- attention tests (T tokens, Hq query heads, D=128): 96 * T*Hq*D bytes of inputs,
  clones, outputs and gradients (bf16 and fp32 copies of several runs), plus the torch
  reference's score and probability matrices of every run, fp32, held together by its
  recomputing backward: 8 * Hq * sum over runs of rows * keys (SUM_ROWS_KEYS, from
  `memopd.ops.attention_torch.plan_runs` of the test's layouts; checked on CPU).

`python tests/kernels/_cuda_budget.py --workers FREE_MIB [--cpus N]` prints the worker
count for FREE_MIB of free device memory; `--table` prints every test's peak.
"""
from __future__ import annotations

import re
import sys

GIB = 2 ** 30
CONTEXT = 1.0 * GIB  # one process's CUDA context, kernels and torch/Triton state (upper estimate)
RESERVE = 2.0 * GIB  # left free on the device: the driver, other processes, rounding
REF_BLOCK = 64  # tests/kernels/test_kernels_cuda.py REF_BLOCK
H_LM, V_ROWS = 2048, 151936
REF_TEMPS = {"lpe": 4, "reverse_kl": 6, "forward_kl": 6, "jsd": 11, "actor": 5}  # measured on CPU (see above)
CUDA_EXTRA_TEMPS = 2
FRAGMENTATION = 1.1
SCRATCH = 1.25 * GIB
# sum over the runs of a layout of rows * keys (test_kernels_cuda.py layouts; test_cuda_budget checks them)
SUM_ROWS_KEYS = {"shared-4096": 4_019_892, "one-prefix-8192": 19_136_512}
MAX_WORKERS = 6  # compile contention beyond this costs more than it saves (16 cores, ~110 binaries)


def reference_extra(kind: str, N: int, H: int, V: int, block: int = REF_BLOCK, extra_temps: int = 0) -> float:
    """Bytes the blocked float64 reference allocates on top of the inputs (no rounding)."""
    return 20 * V * H + (REF_TEMPS[kind] + extra_temps) * block * V * 8 + 4 * N * H * 8


def lm_peak(kind: str, N: int, dtype_bytes: int, teacher: bool, H: int = H_LM, V: int = V_ROWS,
            block: int = REF_BLOCK) -> float:
    d = dtype_bytes
    inputs = (N * H + V * H + V) * d * (2 if teacher else 1)
    reference = inputs + reference_extra(kind, N, H, V, block, CUDA_EXTRA_TEMPS)
    op = inputs + 4 * V * H + V * H * d + 4 * V * H + SCRATCH + 4 * N * H * 4
    return FRAGMENTATION * max(reference, op)


def attention_peak(T: int, Hq: int, layout: str, D: int = 128) -> float:
    return FRAGMENTATION * (96 * T * Hq * D + 8 * Hq * SUM_ROWS_KEYS[layout])


def peak_of(nodeid: str) -> float:
    """Upper bound of the device memory (bytes) of one test of test_kernels_cuda.py, from
    its node id; ValueError for a test this table does not know (keep them in step)."""
    name, _, params = nodeid.split("::")[-1].partition("[")
    params = params.rstrip("]")
    if name.startswith("test_attention_"):
        if name == "test_attention_split_backward_at_production_shape":
            hq = int(params.split("-")[0])
            return attention_peak(8192, hq, "one-prefix-8192")
        if name == "test_attention_production_shape":
            return attention_peak(4096, int(params.split("-")[1]), "shared-4096")
        if name in ("test_attention_atomic_and_deterministic_agree_on_gpu", "test_attention_every_candidate"):
            return attention_peak(4096, 16, "shared-4096")
        raise ValueError(f"no memory model for {nodeid}")
    fp32 = "fp32" in name or "fp32" in params.split("-")
    d = 4 if fp32 else 2
    if name == "test_dh_split_matches_unsplit_on_gpu":  # 768 x V bf16 scratch, a bf16 head, fp32 results
        return FRAGMENTATION * (768 * V_ROWS * 2 + V_ROWS * H_LM * 2 + 768 * V_ROWS * 4 + 3 * 768 * H_LM * 4)
    if name == "test_actor_loss_bf16_grad_scratch_without_bias":
        return lm_peak("actor", 1024, 2, True)
    if name in ("test_actor_loss_production_shape", "test_actor_loss_each_term_fp32"):
        return lm_peak("actor", 1024, d, True)
    if name in ("test_fused_distill_production_shape", "test_fused_distill_gradient_paths_production_shape",
                "test_fused_distill_each_gradient_term_fp32"):
        kind = next((k for k in ("reverse_kl", "forward_kl", "jsd") if re.search(rf"(^|-){k}(-|$)", params)), "lpe")
        N = 2048 if "gradient_paths" in name else 1024
        return lm_peak(kind, N, d, kind != "lpe")
    raise ValueError(f"no memory model for {nodeid}")


def workers_for(free_bytes: float, peaks: list[float], cpus: int = 16) -> int:
    """pytest-xdist workers whose largest tests fit together: every worker may hold the
    largest peak at once (plus its context); at most MAX_WORKERS and the CPU count."""
    per = max(peaks) + CONTEXT
    return max(1, min(MAX_WORKERS, cpus, int((free_bytes - RESERVE) // per)))


def _collected_ids() -> list[str]:
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels/test_kernels_cuda.py", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-k", "not on_cpu"], capture_output=True, text=True, check=True,
                         cwd=root)
    return [line for line in out.stdout.splitlines() if "::" in line]


def all_peaks() -> dict[str, float]:
    """Every GPU test of test_kernels_cuda.py (collected by pytest) and its peak."""
    return {i: peak_of(i) for i in _collected_ids()}


def static_max_peak() -> float:
    """The largest peak of any test, without collecting (for gpu_check.sh, before pytest
    runs): the test kinds and shapes of peak_of, enumerated."""
    kinds = [("reverse_kl", 1024), ("forward_kl", 1024), ("jsd", 1024), ("lpe", 1024), ("actor", 1024),
             ("reverse_kl", 2048), ("forward_kl", 2048), ("jsd", 2048)]
    lm = [lm_peak(k, n, d, k != "lpe") for k, n in kinds for d in (2, 4)]
    att = [attention_peak(8192, 32, "one-prefix-8192"), attention_peak(4096, 32, "shared-4096")]
    return max(lm + att)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=float, metavar="FREE_MIB", help="print the worker count for this free memory")
    p.add_argument("--cpus", type=int, default=16)
    p.add_argument("--table", action="store_true", help="every test's peak (collects the tests: imports torch)")
    a = p.parse_args()
    if a.workers is not None:
        print(workers_for(a.workers * 2 ** 20, [static_max_peak()], a.cpus))
    if a.table:
        for nodeid, peak in all_peaks().items():
            print(f"{peak / GIB:6.2f} GiB  {nodeid.split('::')[-1]}")
