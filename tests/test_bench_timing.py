"""The benchmark measurement defaults (benchmarks/_timing.py): process CPU time and one
thread on CPU unless asked otherwise, interleaved rounds in a rotating order, and the
note that names a round the machine's load made unreliable. Seconds."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _timing  # noqa: E402


def test_defaults_and_requests(monkeypatch):
    monkeypatch.delenv("MEMOPD_BENCH_CLOCK", raising=False)
    monkeypatch.delenv("MEMOPD_BENCH_THREADS", raising=False)
    assert _timing.bench_clock(cuda=False) == "process" and _timing.bench_clock(cuda=True) == "wall"
    assert _timing.bench_threads() == 1
    monkeypatch.setenv("MEMOPD_BENCH_CLOCK", "wall")
    monkeypatch.setenv("MEMOPD_BENCH_THREADS", "0")
    assert _timing.bench_clock(cuda=False) == "wall" and _timing.bench_threads() is None
    monkeypatch.setenv("MEMOPD_BENCH_CLOCK", "process")
    with pytest.raises(ValueError, match="use the wall clock on CUDA"):
        _timing.bench_clock(cuda=True)
    monkeypatch.setenv("MEMOPD_BENCH_CLOCK", "cpu")
    with pytest.raises(ValueError, match="choose 'process'"):
        _timing.bench_clock(cuda=False)


def test_rounds_rotate_and_time_every_step():
    order = []
    steps = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    r = _timing.interleaved(steps, 3, clock="process")
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(t) == 3 for t in r.times.values()) and len(r.loads) == len(r.cpu_shares) == 3


def test_a_round_far_from_the_median_is_named():
    r = _timing.Rounds("process", {"independent": [1.0, 1.02, 1.6], "shared": [0.5, 0.51, 0.5]},
                       loads=[1.0, 1.2, 9.5], cpu_shares=[1.0, 1.0, 0.3])
    notes = r.unreliable()
    assert notes == ["round 3 (load 9.5): independent 1.57x its median"]
    wall = _timing.Rounds("wall", {"x": [1.0, 1.0, 1.0]}, loads=[2.0, 2.0, 2.0], cpu_shares=[0.95, 0.5, 0.9])
    assert wall.unreliable() == ["round 2 (load 2.0): a step got 50% of its threads' CPU"]


def test_packing_summary_table_says_which_rounds_were_unreliable():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "conftest.py"
    spec = importlib.util.spec_from_file_location("memopd_bench_conftest", path)  # not tests/conftest.py
    bench_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_conftest)
    rec = {"config": "Q2-b4", "calls": 15, "action_tokens": 169, "tokens": 100, "padding_fraction": 0.1,
           "median_s": 1.0, "min_s": 0.9, "max_s": 1.6, "times_s": [0.9, 1.0, 1.6], "micro_batches": 1, "prep_s": 0,
           "logprob_max_abs_diff": 0.0, "model": "m", "device": "cpu", "clock": "process", "threads": 1,
           "max_tokens": 4096, "rounds": {"loadavg": [1.0, 1.0, 9.0],
                                          "unreliable_rounds": ["round 3 (load 9.0): independent 1.60x its median"]}}
    recs = [{**rec, "layout": lay} for lay in ("independent", "aligned", "aligned_shared")]
    text = "\n".join(bench_conftest.format_table(bench_conftest.summarize(recs)))
    assert "(!)" in text and "Q2-b4: round 3 (load 9.0): independent 1.60x its median" in text
