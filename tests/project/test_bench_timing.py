"""The benchmark measurement defaults (benchmarks/_timing.py): process CPU time and one
thread on CPU unless asked otherwise, interleaved rounds in a rotating order, and the
note that names a round the machine's load made unreliable. Seconds. Also the packing
benchmark's shape knobs (prefix length, calls per trajectory) and its model whose
lm-head share is Qwen2.5-3B's."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "conftest.py"
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


def _bench_packing():
    import bench_packing

    return bench_packing


def test_the_3b_ratio_model_has_the_lm_head_share_of_qwen2_5_3b():
    bp = _bench_packing()
    qwen = bp.head_share(**bp.QWEN2_5_3B)
    assert abs(qwen - 0.11215) < 1e-4  # 311.2M head / 2774.5M layer weights per token
    tiny = dict(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=512)
    assert abs(bp.head_share(**tiny, vocab_size=bp.TINY_3B_RATIO_VOCAB) / qwen - 1) < 1e-3
    assert bp.head_share(**tiny, vocab_size=4096) > 8 * qwen  # the default tiny model: head-heavy


def test_shape_knobs_set_the_prefix_and_calls_and_nothing_else():
    bp = _bench_packing()
    short = bp.qa_shaped_trajectories(8, 8, vocab_size=488, seed=8, prefix_len=32, calls=5)
    long = bp.qa_shaped_trajectories(8, 8, vocab_size=488, seed=8, prefix_len=300, calls=5)
    for a, b in zip(short, long):
        assert len(a) == len(b) == 5
        assert len(a.prefix_ids) == 32 and len(b.prefix_ids) == 300
        assert [list(i.context_ids) for i in a.invocations] == [list(i.context_ids) for i in b.invocations]
        assert [list(i.action_ids) for i in a.invocations] == [list(i.action_ids) for i in b.invocations]
    # rollouts of one group still share their prefix; groups differ
    assert short[0].prefix_ids == short[3].prefix_ids and short[0].prefix_ids != short[4].prefix_ids
    expert = bp.qa_shaped_trajectories(8, 8, vocab_size=488, seed=8)
    assert [len(t.prefix_ids) for t in expert] != [32] * 8 and len({len(t) for t in expert}) > 1


def test_knob_configurations_are_named_and_ordered():
    import importlib.util

    bp = _bench_packing()
    assert bp.config_name(8, 4) == "Q8-b4" and bp.config_name(8, 4, 512, 24) == "Q8-b4-p512-c24"
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "conftest.py"
    spec = importlib.util.spec_from_file_location("memopd_bench_conftest", path)
    bench_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_conftest)
    names = ["Q8-b4-p512-c4", "Q16-b4", "Q8-b4-p32-c24", "Q8-b4-p32-c4", "Q2-b16", "Q2-b4"]
    assert sorted(names, key=bench_conftest._config_key) == [
        "Q2-b4", "Q2-b16", "Q8-b4-p32-c4", "Q8-b4-p32-c24", "Q8-b4-p512-c4", "Q16-b4"]
