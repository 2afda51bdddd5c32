"""The summary of benchmarks/gpu_check.sh (benchmarks/gpu_bench.py --summary): the table
from the benchmark rows, one line per compile error out of hundreds of compiler lines,
failed tests named, and only the files that come back from a borrowed GPU."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_bench  # noqa: E402


def test_summary_from_a_work_dir(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "steps.jsonl").write_text(
        json.dumps(dict(step="env", status="ok", seconds=4, limit=60, note="")) + "\n"
        + json.dumps(dict(step="correctness", status="FAIL", seconds=80, limit=190, note="exit 1")) + "\n")
    row = dict(case="attn-fwd-32/8", op="attention fwd", shape="T=16384 Hq/Hkv=32/8 D=128", dtype="bfloat16",
               config="_fwd_kernel: BLOCK_M=128,BLOCK_N=64,w8,s3", first_call_s=21.5, median_ms=3.21,
               tflops=310.4, peak_mib=12, max_abs_diff=0.0039, device="H200")
    (work / "bench_rows.jsonl").write_text(json.dumps(row) + "\n")
    mlir = ["  %12 = tt.load %11 : tensor<128x64x!tt.ptr<bf16>>"] * 300
    (work / "correctness.log").write_text("\n".join(
        ["from triton.runtime.errors import PTXASError"] + mlir
        + ["/repo/kernels/packed_attention.py:718:0: error: failed to legalize unresolved materialization"] + mlir
        + ["E   RuntimeError: PassManager::run failed", "1 failed, 20 passed"]) + "\n")
    (work / "correctness.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_kernels_cuda" name="test_a" time="3.5"/>'
        '<testcase classname="tests.test_kernels_cuda" name="test_b" time="1.0">'
        '<failure message="AssertionError: dq: max error 1e-1 &gt; 2e-2">trace</failure></testcase>'
        '</testsuite></testsuites>')
    text = gpu_bench.summarize(str(work), str(out))
    assert sorted(os.listdir(out)) == ["results.json", "summary.md"]
    assert "| attention fwd | T=16384 Hq/Hkv=32/8 D=128 | bfloat16 | _fwd_kernel: BLOCK_M=128,BLOCK_N=64,w8,s3 | " \
           "21.5 | 3.21 | 310.4 | 12 | 0.0039 |" in text
    errors = [ln for ln in text.splitlines() if ln.startswith("- correctness:")]
    assert errors == ["- correctness: error: failed to legalize unresolved materialization",
                      "- correctness: E   RuntimeError: PassManager::run failed"]
    assert "1 passed, 1 failed, 0 skipped" in text
    assert "- FAILED tests.test_kernels_cuda::test_b: AssertionError: dq: max error 1e-1 > 2e-2" in text
    res = json.loads((out / "results.json").read_text())
    assert res["benchmarks"] == [row] and len(res["tests"]) == 2 and len(res["compile_errors"]) == 2


def test_bad_arguments_are_one_line_errors():
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--phase", "3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "gpu_check: --phase must be 1, 2, smoke or all, got '3'"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"), "no-such-case"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no-such-case" in r.stderr


def test_summary_puts_the_cost_model_beside_the_measured_row(tmp_path):
    # gpu_check.sh runs benchmarks/gpu_cost_model.py --json beside the cases; a row gets the
    # prediction of its own op and shape only (tokens, vocabulary, both hidden sizes)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    model = dict(op="actor loss (teacher)", N=16384, V=151665, Hs=2048, Ht=3584)
    rows = [dict(case="actor_loss-V151665", op="actor_loss", shape="N=16384 Hs/Ht=2048/3584 V=151665 (head rows 151936)",
                 dtype="bfloat16", config="-", first_call_s=30.0, median_ms=95.5, tflops=505.8, peak_frac=0.5114,
                 peak_mib=3000, max_abs_diff=0.01, device="H200", model=model),
            dict(case="actor_loss", op="actor_loss", shape="N=16384 Hs/Ht=2048/3584 V=151936", dtype="bfloat16",
                 config="-", first_call_s=30.0, median_ms=96.0, tflops=504.0, peak_frac=0.5096, peak_mib=3000,
                 max_abs_diff=0.01, device="H200", model=dict(model, V=151936))]
    (work / "bench_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preds = [dict(model, ms=83.5, peak=0.5851, useful_tflop=48.3, hbm_tbps=3.0, gemm_tflops=790.0,
                  band_ms=[87.4, 144.8], band_peak=[0.3373, 0.5589]),
             dict(model, Ht=2048, V=151936, ms=1.0, peak=0.9)]
    (work / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    text = gpu_bench.summarize(str(work), str(out))
    # the bound (every GEMM at the stated rate, perfect overlap) and the realistic band, at the measured bandwidth
    assert "| 95.5 | 505.8 | 3000 | 0.01 | 51.1% | 83.5, 59%; band 34%-56% at 3.00 TB/s |" in text
    assert "| 96.0 | 504.0 | 3000 | 0.01 | 51.0% | - |" in text  # the V=151,936 prediction is for another Ht
    assert json.loads((out / "results.json").read_text())["predictions"] == preds


def test_cost_model_gives_a_bound_and_a_band_at_the_measured_bandwidth(tmp_path):
    # the bound (every GEMM at the stated rate, compute and memory overlapped) is the fastest
    # case; the band runs from cuBLAS's lm-head rate, overlapped, to 80% of it without overlap;
    # a lower bandwidth never makes an op faster
    preds = {}
    for bw in ("3.0", "4.3"):
        out = tmp_path / f"p{bw}.jsonl"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_cost_model.py"), "--tokens", "2048",
                            "--vocab", "151665", "--hbm-tbps", bw, "--json", str(out)],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"bound and band at {float(bw):.2f} TB/s" in r.stdout
        preds[bw] = {p["op"]: p for p in map(json.loads, out.read_text().splitlines())}
    assert len(preds["3.0"]) >= 6
    for op, p in preds["3.0"].items():
        lo, hi = p["band_peak"]
        assert 0 < lo < hi <= p["peak"] and p["hbm_tbps"] == 3.0 and p["gemm_tflops"] == 790.0, op
        fast, slow = p["band_ms"]
        assert p["ms"] <= fast < slow, op
        assert p["peak"] <= preds["4.3"][op]["peak"] + 1e-9, op
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_cost_model.py"), "--hbm-tbps", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--hbm-tbps and --gemm-tflops must be > 0" in r.stderr


def test_the_summary_after_every_step_imports_no_torch(tmp_path):
    # gpu_check.sh rewrites the summary after every step, also for steps listed "not run":
    # importing torch there would cost 3-6 s of the borrowed GPU's time each time
    probe = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r}); import gpu_bench; "
             f"gpu_bench.main(['--summary', {str(tmp_path)!r}, {str(tmp_path / 'out')!r}]); "
             "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "out" / "summary.md").exists()
