"""One progress display for every long loop (SFT steps, rollouts, training steps).

`progress_bar(total, desc)` returns an object with tqdm's `update`, `set_postfix`,
`set_description`, `refresh` and `close` (and `n`, `total`; usable as a context manager):

- on a terminal: a tqdm bar (`position` keeps parallel bars on their own lines);
- otherwise (stderr to a file, a pipe, CI): no bars and no carriage returns, but one short
  line per interval, e.g. ``sft[student]: 120/300 step (40%), 1m05s, ~1m38s left, loss=0.412``,
  printed when another `every` fraction of `total` is done (default 10%) or, between those,
  at most every `min_interval_s` seconds (default 60), plus one line at `close`. A job of
  any length writes at most about 1/every + its duration / min_interval_s lines.

`enabled=False` gives an object that does nothing, so callers need no `if bar is not None`.

Parallel jobs in worker processes (the SFT roles) must not draw their own bars: each
process's tqdm knows nothing of the other's, so two bars overwrite each other's line.
`BarRelay` instead draws one bar per job in the parent: the parent opens it, hands its
`queue` to each worker, and the worker calls `relay_to(queue)` once; from then on every
`progress_bar` of that process sends its updates to the parent, which owns the terminal
(or, in a log, prints each job's lines whole).
`no_library_bars_in_logs()` (called by the `memopd` command line) turns off the bars of
Hugging Face libraries (e.g. "Writing model shards") when stderr is not a terminal.
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["progress_bar", "no_library_bars_in_logs", "BarRelay", "relay_to"]

_RELAY = None  # this worker's queue to the parent's BarRelay (set by relay_to)


def progress_bar(
    total: int | None,
    desc: str = "",
    *,
    unit: str = "it",
    initial: int = 0,
    position: int | None = None,
    enabled: bool = True,
    stream: TextIO | None = None,
    every: float = 0.1,
    min_interval_s: float = 60.0,
):
    """A tqdm bar on a terminal, periodic one-line reports otherwise (see the module doc)."""
    if not enabled:
        return _Silent(total, initial)
    if _RELAY is not None and stream is None:
        return _Relayed(_RELAY, total, desc, unit=unit, initial=initial)
    stream = sys.stderr if stream is None else stream
    if _is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, position=position, file=stream,
                    dynamic_ncols=True)
    return _Lines(total, desc, unit=unit, initial=initial, stream=stream, every=every, min_interval_s=min_interval_s)


def no_library_bars_in_logs(stream: TextIO | None = None) -> None:
    """When `stream` (stderr) is not a terminal, disable huggingface_hub / transformers
    progress bars, in this process and (through the environment) in the worker processes
    it starts. An explicit HF_HUB_DISABLE_PROGRESS_BARS setting is respected."""
    import os

    if _is_terminal(sys.stderr if stream is None else stream) or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when the libraries are imported
    if "transformers" in sys.modules:  # already imported: switch its bars off directly
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # noqa: BLE001 - cosmetic only
            pass


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Silent:
    """`enabled=False`: counts, prints nothing."""

    def __init__(self, total: int | None = None, initial: int = 0) -> None:
        self.total, self.n = total, initial

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _Lines(_Silent):
    """Progress as plain lines: for logs, where a bar's carriage returns become megabytes."""

    def __init__(self, total, desc, *, unit, initial, stream, every, min_interval_s) -> None:
        super().__init__(total, initial)
        self.desc, self.unit, self.stream = desc, unit, stream
        self.every, self.min_interval_s = every, min_interval_s
        self.postfix = ""
        self._start_n = initial
        self._t0 = self._last_t = time.monotonic()
        self._last_n = initial
        self._step = max(1, int(total * every)) if total and every > 0 else None
        self._next_n = self._next_mark(initial)
        self._closed = False

    def _next_mark(self, n: int) -> int | None:
        return None if self._step is None else (n // self._step + 1) * self._step

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_emit()

    def refresh(self) -> None:
        self._maybe_emit()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def _maybe_emit(self) -> None:
        if self._closed or self.n == self._last_n:
            return
        now = time.monotonic()
        due = self._next_n is not None and self.n >= self._next_n
        if due or now - self._last_t >= self.min_interval_s:
            self._emit(now)

    def _emit(self, now: float) -> None:
        elapsed = now - self._t0
        parts = [f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n // self.total}%)"
        parts.append(_duration(elapsed))
        done = self.n - self._start_n
        if self.total and 0 < done and self.n < self.total:
            parts.append(f"~{_duration(elapsed / done * (self.total - self.n))} left")
        if self.postfix:
            parts.append(self.postfix)
        line = (f"{self.desc}: " if self.desc else "") + ", ".join(parts) + "\n"
        try:
            self.stream.write(line)  # one write per line: parallel jobs' lines do not interleave
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken log stream must not stop the job
            pass
        self._last_t, self._last_n = now, self.n
        self._next_n = self._next_mark(self.n)

    def close(self) -> None:
        if self._closed:
            return
        if self.n != self._last_n:
            self._emit(time.monotonic())
        self._closed = True


def relay_to(queue) -> None:
    """In a worker process: send every later `progress_bar` of this process to the
    parent's `BarRelay` whose `queue` this is."""
    global _RELAY
    _RELAY = queue


class _Relayed(_Silent):
    """A worker's bar: its state goes to the parent, which draws it."""

    def __init__(self, queue, total, desc, *, unit, initial) -> None:
        import os
        import uuid

        super().__init__(total, initial)
        self.queue, self.key = queue, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._send(("open", self.key, total, desc, unit, initial))

    def _send(self, msg) -> None:
        try:
            self.queue.put(msg)
        except Exception:  # noqa: BLE001 - the parent went away: progress is cosmetic
            pass

    def update(self, n: int = 1) -> None:
        self.n += n
        self._send(("update", self.key, n))

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self._send(("postfix", self.key, {**(ordered_dict or {}), **kwargs}))

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self._send(("desc", self.key, desc or ""))

    def close(self) -> None:
        self._send(("close", self.key))


class BarRelay:
    """Draws the bars of worker processes in this (the parent) process, one line per job,
    in the order the jobs open them. Use as a context manager around the workers' run;
    `queue` goes to each worker (see `relay_to`)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        import multiprocessing

        self._manager = multiprocessing.Manager()
        self.queue = self._manager.Queue()
        self.stream = stream
        self._bars: dict = {}
        self._thread = None

    def _serve(self) -> None:
        while True:
            msg = self.queue.get()
            if msg is None:
                return
            kind, key, *rest = msg
            if kind == "open":
                total, desc, unit, initial = rest
                self._bars[key] = progress_bar(total, desc, unit=unit, initial=initial, position=len(self._bars),
                                               stream=self.stream if self.stream is not None else sys.stderr)
                continue
            bar = self._bars.get(key)
            if bar is None:
                continue
            if kind == "update":
                bar.update(rest[0])
            elif kind == "postfix":
                bar.set_postfix(rest[0])
            elif kind == "desc":
                bar.set_description(rest[0])
            elif kind == "close":
                bar.close()

    def __enter__(self) -> "BarRelay":
        import threading

        self._thread = threading.Thread(target=self._serve, name="memopd-bar-relay", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.queue.put(None)
            self._thread.join(timeout=10)
        finally:
            for bar in self._bars.values():
                bar.close()
            self._manager.shutdown()
