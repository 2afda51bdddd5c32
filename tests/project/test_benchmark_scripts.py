"""Every benchmark and analysis script in `benchmarks/` runs as a user runs it: each in a
subprocess with its smallest settings, asserting exit code 0 and the facts its output
must hold (token counts in the right order, log-prob equality, finite times, the
layouts' statistics agreeing). The figures themselves are for benchmarks/README.md; here
only that the scripts still run against today's code (a keyword renamed in the trainer
once broke `served_teacher.py` for a session without any test noticing).

Not run here: the pytest-benchmark files (`bench_packing.py`'s tests,
`bench_fused_distill.py`, `bench_packed_attention.py`: `pytest benchmarks/
--benchmark-only`, a `.ci/run` stage; only the fresh-process memory probe of
`bench_fused_distill.py` runs here), `gpu_check.sh` (a GPU; its summary has its own
test), `vllm_rollouts.py` (vLLM's venv: `--help` only here), `sft_curve.py` (it reads the
resume states a long `memopd sft` run writes about once a minute: `--help` only here;
tests/env/test_sft_curve.py checks its state-to-checkpoint step) and `gpu_cost_model.py`
(`--help` here; tests/project/test_gpu_check.py runs it with `--json`)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ROOT = BENCH.parent


def _run(script: str, *args, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, f"{script} {' '.join(map(str, args))}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("script", ["vllm_rollouts.py", "analysis/sft_curve.py", "analysis/infogap_gap_tokens.py",
                                    "gpu_train_smoke.py", "gpu_bench.py", "gpu_cost_model.py"])
def test_help(script):
    assert "usage:" in _run(script, "--help")


def test_pack_speed(tmp_path):
    _run("bench_pack_speed.py", "--calls", 200, "--repeats", 1, "--layouts", "trie,aligned", "--json", tmp_path / "r.json")
    rows = {r["config"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert set(rows) == {"trie", "aligned"}
    assert rows["trie"]["tokens"] < rows["aligned"]["tokens"]  # the trie shares more
    assert rows["aligned"]["same_batch"] is True  # the core's batch equals the Python packer's
    assert all(_finite_positive(r["us_per_call"]["new"]) and r["peak_over_out"]["new"] >= 1.0 for r in rows.values())


def test_trie_curve(tmp_path):
    _run("trie_curve.py", "--batch", 4, "--groups", "1,2", "--contexts", "0,64", "--time-batch", 2, "--time-groups", 2,
         "--time-contexts", 0, "--rounds", 1, "--out", tmp_path / "tc")
    d = json.loads((tmp_path / "tc.json").read_text())
    assert len(d["tokens"]) == 4 and all(r["trie"] <= r["shared"] < r["unpadded"] for r in d["tokens"])
    (t,) = d["timed"]
    assert t["independent"]["logprob_max_abs_diff"] == 0.0
    assert t["trie"]["logprob_max_abs_diff"] < 1e-5 and t["aligned_shared"]["logprob_max_abs_diff"] < 1e-5
    assert t["trie"]["tokens"] < t["aligned_shared"]["tokens"] < t["independent"]["tokens"]
    assert (tmp_path / "tc.md").read_text().count("|") > 10


def test_packing_curve(tmp_path):
    _run("bench_packing.py", "--curve", "--prefix", 32, "--calls", 4, "--rounds", 1, "--batch", 4, "--k", 2,
         "--json", tmp_path / "c.json")
    (row,) = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert row["aligned_shared"]["tokens"] < row["aligned"]["tokens"] < row["independent"]["tokens"]
    assert row["aligned_shared"]["logprob_max_abs_diff"] < 1e-5
    assert all(_finite_positive(row[k]["median_s"]) for k in ("independent", "aligned", "aligned_shared"))


def test_actor_loss(tmp_path):
    _run("bench_actor_loss.py", "--shapes", "tiny", "--rounds", 1, "--contenders", "gemm_floor", "gemm_floor3",
         "fused_rkl", "fused_lpe", "--out", tmp_path / "a.json")
    rows = {r["contender"]: r for r in json.loads((tmp_path / "a.json").read_text())["rows"]}
    assert set(rows) == {"gemm_floor", "gemm_floor3", "fused_rkl", "fused_lpe"}
    assert rows["fused_rkl"]["floor"] == "gemm_floor" and rows["fused_lpe"]["floor"] == "gemm_floor3"
    assert all(_finite_positive(r["cpu_s"]) for r in rows.values())


def test_topk_vs_full(tmp_path):
    _run("bench_topk_vs_full.py", "--n", 64, "--v", 512, "--hs", 32, "--ht", 48, "--ks", "4,8", "--rounds", 1,
         "--out", tmp_path / "tk")
    d = json.loads((tmp_path / "tk.json").read_text())
    assert d["shapes"]["V"] == 512 and d["shapes"]["ks"] == [4, 8]
    assert "bytes_per_token" in d and (tmp_path / "tk.md").exists()


def test_integrations_verl_pair():
    out = _run("bench_integrations.py", "--pairs", "verl", "--rounds", 1)
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("verl ")]
    assert {r[1] for r in rows} == {"verl_naive", "memopd_verl"} and all(float(r[2]) > 0 for r in rows)


def test_served_teacher(sft_dirs, tmp_path):
    student, teacher = sft_dirs
    _run("served_teacher.py", "--student", student, "--teacher", teacher, "--steps", 1, "--topk", 8,
         "--json", tmp_path / "s.json")
    d = json.loads((tmp_path / "s.json").read_text())
    assert set(d) == {"in-process", "served fp32 hidden", "served bf16 hidden", "served top-8"}
    kl = {k: v[0]["kl_teacher"] for k, v in d.items()}
    assert kl["served fp32 hidden"] == pytest.approx(kl["in-process"], rel=1e-5)  # the same teacher signal
    assert all(_finite_positive(v[0]["trainer_cpu_s"]) for v in d.values())


def test_trainer_layout(sft_dirs, tmp_path):
    student, teacher = sft_dirs
    _run("trainer_layout.py", "--student", student, "--teacher", teacher, "--cache", tmp_path / "cache", "--steps", 1,
         "--rounds", 1, "--json", tmp_path / "t.json")
    d = json.loads((tmp_path / "t.json").read_text())
    assert d["tokens"]["trie"][0] < d["tokens"]["aligned"][0]
    assert max(d["stat_max_rel_diff"].values()) < 1e-3  # the two layouts train the same loss
    assert not (tmp_path / "cache").exists()  # the given models were used, nothing SFT'd


def test_rce_split():
    out = _run("analysis/rce_split.py", "--seeds", 1, "--policies", "suffix")
    assert "trie" in out and "split" in out and "one softmax" in out


def test_expert_departures(sft_dirs):
    out = _run("analysis/expert_departures.py", sft_dirs[0], "--n", 2)
    assert "em_mean" in out


def test_infogap_gap_tokens(sft_dirs):
    out = _run("analysis/infogap_gap_tokens.py", *sft_dirs, "--tasks", 1, "--group", 1, "--show", 1)
    m = re.search(r"^(\d+) information-gap calls, (\d+) action tokens; the teacher's top-1 differs at (\d+) ", out, re.M)
    assert m, out[-2000:]
    calls, tokens, differ = map(int, m.groups())
    assert calls >= 1 and tokens >= calls and 0 <= differ <= tokens
    assert "the rule's step after the memory span" in out


@pytest.mark.parametrize("args", [("fused", 64, 32, 48, 512), ("fused", 64, 32, 32, 512, "train")], ids=["distill", "lpe-train"])
def test_fused_distill_memory_probe(args):
    # the fresh-process memory probe that bench_fused_distill.py's memory benchmarks start
    (line,) = [ln for ln in _run("bench_fused_distill.py", "--measure", *args).splitlines() if ln.startswith("{")][-1:]
    d = json.loads(line)
    assert _finite_positive(d["peak_bytes"]) and _finite_positive(d["seconds"]) and d["exact"] is True


def test_gpu_bench_smoke():
    rows = [json.loads(ln) for ln in _run("gpu_bench.py", "--smoke", "logprob_entropy", "attn-fwd-32/8").splitlines()
            if ln.startswith("{")]
    assert [r["case"] for r in rows] == ["logprob_entropy", "attn-fwd-32/8"]
    assert all(r["device"] == "cpu (smoke)" and r["max_abs_diff"] <= 1e-5 for r in rows)


def test_gpu_train_smoke_on_cpu(tmp_path):
    out = _run("gpu_train_smoke.py", tmp_path / "w", "--device", "cpu", "--backend", "torch")
    assert "train smoke:" in out and "audit smoke:" in out and "PASS" in out
