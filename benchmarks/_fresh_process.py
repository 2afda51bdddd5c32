"""Peak resident memory and time of one call, measured inside a fresh benchmark process.

Shared by the benchmarks that run every contender in its own subprocess
(`bench_fused_distill.py`, `bench_actor_loss.py`, `bench_integrations.py`): the peak-RSS
counter is reset right before the call (`/proc/self/clear_refs`), so the figure is the
memory the call adds above what the process already holds (its inputs included).
"""
from __future__ import annotations

import resource
import time


def status_kb(field: str) -> int | None:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM, ...); None if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def measure_call(fn, *, require_exact: bool = True):
    """Run `fn()` once: (its result, {"cpu_s", "wall_s", "peak_kb", "exact"}).

    `peak_kb` is the peak RSS during the call minus the RSS right before it. Where the peak
    counter cannot be reset, `require_exact=False` falls back to the process's lifetime
    peak (`ru_maxrss`, marked `exact: False`); otherwise that is an error.
    """
    exact = True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        if require_exact:
            raise
        exact = False
    before = status_kb("VmRSS")
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    peak = status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out, {"cpu_s": cpu, "wall_s": wall, "peak_kb": peak - before, "exact": exact}
