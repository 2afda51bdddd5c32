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
`no_library_bars_in_logs()` (called by the `memopd` command line) turns off the bars of
Hugging Face libraries (e.g. "Writing model shards") when stderr is not a terminal.
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["progress_bar", "no_library_bars_in_logs"]


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
