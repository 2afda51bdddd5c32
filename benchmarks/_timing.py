"""How the benchmarks time code: the clock, the thread count, interleaved rounds, and
the check of whether machine load made a round unreliable.

Defaults are the ones that hold on a busy machine. On CPU: one torch thread and the CPU
time of the process (user + system, `time.process_time`), which other jobs do not
inflate the way they inflate wall time; on CUDA: the wall clock after a device sync.
`MEMOPD_BENCH_CLOCK=wall` (or `process`) and `MEMOPD_BENCH_THREADS=N` choose otherwise.

Contenders are timed in rounds, each round running every contender once in a rotating
order, so load that comes and goes hits them alike. Every step is timed on both clocks;
a round is flagged when a contender's time in it is far from that contender's median
over the rounds, or, on the wall clock, when the process got much less CPU than the
threads it runs. The durations of the chosen clock are then handed to pytest-benchmark
(`record_durations`), so its table and `--benchmark-json` hold the interleaved numbers.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

CLOCKS = ("process", "wall")
# a round whose time for some contender is this far from the contender's median (either
# way, as a ratio) is flagged: the ratios of that round say more about the machine
OUTLIER_RATIO = 1.15
# on the wall clock: a step that got less than this share of its threads' CPU time waited
# for the CPU more than it computed
MIN_CPU_SHARE = 0.8


def bench_clock(cuda: bool | None = None) -> str:
    """The clock of this run: `MEMOPD_BENCH_CLOCK`, else `process` on CPU, `wall` on CUDA."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    raw = os.environ.get("MEMOPD_BENCH_CLOCK", "").strip()
    clock = raw or ("wall" if cuda else "process")
    if clock not in CLOCKS:
        raise ValueError(f"MEMOPD_BENCH_CLOCK={raw!r}: choose 'process' (CPU time, the CPU default) or 'wall'")
    if clock == "process" and cuda:
        raise ValueError("MEMOPD_BENCH_CLOCK=process measures CPU work; use the wall clock on CUDA")
    return clock


def bench_threads() -> int | None:
    """Torch CPU threads of this run: `MEMOPD_BENCH_THREADS`, else 1 (None: leave torch's own)."""
    raw = os.environ.get("MEMOPD_BENCH_THREADS", "").strip()
    if not raw:
        return 1
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"MEMOPD_BENCH_THREADS={raw!r}: expected a positive integer (0: torch's default)") from None
    if n < 0:
        raise ValueError(f"MEMOPD_BENCH_THREADS={raw!r}: expected a positive integer (0: torch's default)")
    return n or None


def apply_threads() -> int:
    """Set torch's CPU threads as `bench_threads` says; returns the count in effect."""
    n = bench_threads()
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


@dataclass
class Rounds:
    """The timed rounds of a set of contenders: per contender, the durations on the chosen
    clock (`times`), and per round the load average at its start and the smallest share
    of CPU any of its steps got (`loads`, `cpu_shares`)."""

    clock: str
    times: dict[str, list[float]] = field(default_factory=dict)
    loads: list[float | None] = field(default_factory=list)
    cpu_shares: list[float] = field(default_factory=list)

    def unreliable(self) -> list[str]:
        """One line per round that load made unreliable (see the module docstring)."""
        notes = []
        medians = {n: statistics.median(t) for n, t in self.times.items() if t}
        for r in range(len(self.loads)):
            why = []
            for name, ts in self.times.items():
                m = medians.get(name)
                if m and r < len(ts) and ts[r] > 0 and max(ts[r] / m, m / ts[r]) > OUTLIER_RATIO:
                    why.append(f"{name} {ts[r] / m:.2f}x its median")
            if self.clock == "wall" and self.cpu_shares[r] < MIN_CPU_SHARE:
                why.append(f"a step got {self.cpu_shares[r]:.0%} of its threads' CPU")
            if why:
                load = self.loads[r]
                notes.append(f"round {r + 1} (load {'?' if load is None else f'{load:.1f}'}): " + ", ".join(why))
        return notes

    def summary(self) -> dict:
        return {"clock": self.clock, "loadavg": self.loads, "min_cpu_share": [round(s, 3) for s in self.cpu_shares],
                "unreliable_rounds": self.unreliable()}


def interleaved(steps: dict, rounds: int, *, clock: str, before=None, sync=None) -> Rounds:
    """Time `steps` (name -> callable) over `rounds` rounds, each running every step once,
    the order rotating by one per round. `before(name)` runs untimed before each step
    (e.g. zeroing gradients), `sync()` before and after it (e.g. a CUDA sync)."""
    names = list(steps)
    out = Rounds(clock, {n: [] for n in names})
    threads = max(torch.get_num_threads(), 1)
    for r in range(rounds):
        out.loads.append(load_average())
        share = 1.0
        for name in names[r % len(names):] + names[: r % len(names)]:
            if before is not None:
                before(name)
            if sync is not None:
                sync()
            c0, w0 = time.process_time(), time.perf_counter()
            steps[name]()
            if sync is not None:
                sync()
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            out.times[name].append(cpu if clock == "process" else wall)
            if wall > 0:
                share = min(share, cpu / (wall * threads))
        out.cpu_shares.append(share)
    return out


class _ReplayClock:
    """A timer for pytest-benchmark that replays durations measured elsewhere: it advances
    by the next duration between each pair of reads."""

    __name__ = "interleaved_replay"

    def __init__(self, durations: list[float]):
        self._left = list(durations)
        self._now = 0.0
        self._started = False

    def __call__(self) -> float:
        if self._started:
            self._now += self._left.pop(0) if self._left else 0.0
        self._started = not self._started
        return self._now


def record_durations(benchmark, durations: list[float]) -> None:
    """Put `durations` into `benchmark`'s stats. Should a future pytest-benchmark drop its
    `_timer` attribute, the stats hold a no-op instead and `extra_info["times_s"]` (which
    callers write) remains the measurement; `extra_info["replayed"]` says which happened."""
    replay = hasattr(benchmark, "_timer") and bool(durations)
    benchmark.extra_info["replayed"] = replay
    if not replay:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        return
    saved = benchmark._timer
    benchmark._timer = _ReplayClock(durations)
    try:
        benchmark.pedantic(lambda: None, rounds=len(durations), iterations=1, warmup_rounds=0)
    finally:
        benchmark._timer = saved
