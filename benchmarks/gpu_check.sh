#!/usr/bin/env bash
# GPU check of memopd: build the C++ core offline, run the kernel correctness tests on CUDA
# (Triton compiled for the device, TRITON_INTERPRET unset), run the benchmark suite, and
# print a short results table last.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; runs in the repository root
#
# Installs nothing from the network. Logs and JSON go to $OUT when that is set (the
# device runner's output folder), else to benchmarks/results/gpu_check/. Every step runs
# under its own time limit (about 8 minutes in all on an H200); a failing step does not
# stop the next ones, and the script exits non-zero at the end if any step failed.
# Knobs (seconds): GPU_CHECK_TEST_TIMEOUT (150, shared by the kernel test files),
# GPU_CHECK_PACKING_TIMEOUT (150, bench_packing.py), GPU_CHECK_BENCH_TIMEOUT (110, the other
# benchmark files); PYTHON (default python3); the MEMOPD_BENCH_* variables of bench_packing.py.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR" || exit 2
rm -f "$OUT_DIR"/bench_packing.json "$OUT_DIR"/bench_ops.json "$OUT_DIR"/packing_summary.json  # no stale results
PACKING_TIMEOUT="${GPU_CHECK_PACKING_TIMEOUT:-150}"
BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-110}"
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-150}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MEMOPD_BENCH_RESULTS_DIR="$OUT_DIR"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET

FAILED=()
STATUS_LINES=()
T_START=$(date +%s)

# run_step NAME TIMEOUT_S CMD...: tee output to $OUT_DIR/NAME.log, remember failures.
# SIGINT first (pytest then still writes its JSON and summary), SIGKILL 20 s later.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local t0 rc
  t0=$(date +%s)
  echo
  echo "=== [$name] $* (limit ${limit}s)"
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then
    STATUS_LINES+=("ok    $name (${dt}s)")
  else
    [ "$rc" -eq 124 ] && echo "[$name] timed out after ${limit}s"
    STATUS_LINES+=("FAIL  $name (rc=$rc, ${dt}s)")
    FAILED+=("$name")
  fi
  return 0
}

note_failure() {  # note_failure NAME MESSAGE
  echo "[$1] $2" | tee -a "$OUT_DIR/$1.log"
  STATUS_LINES+=("FAIL  $1 ($2)")
  FAILED+=("$1")
}

# ---------------------------------------------------------------- 1. environment
run_step env 60 "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for mod in ("torch", "triton", "transformers", "pytest", "pytest_benchmark", "pybind11", "cmake"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:17s}", getattr(m, "__version__", "present"))
    except Exception as e:  # noqa: BLE001
        print(f"{mod:17s} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available   ", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device           ", p.name, f"{p.total_memory / 2**30:.0f} GiB", "capability", f"{p.major}.{p.minor}")
    print("torch cuda       ", torch.version.cuda)
else:
    sys.exit("no CUDA device visible: the kernel tests and GPU benchmarks below will not exercise a GPU")
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv \
  >"$OUT_DIR/nvidia-smi.csv" 2>&1

# ---------------------------------------------------------------- 2. C++ core, offline
build_core() {
  if "$PY" -c "import memopd._C" >/dev/null 2>&1; then
    echo "memopd._C already importable: $("$PY" -c 'import memopd._C as c; print(c.__file__)')"
    return 0
  fi
  if "$PY" -c "import pybind11" >/dev/null 2>&1; then
    if command -v cmake >/dev/null 2>&1 || "$PY" -c "import cmake" >/dev/null 2>&1; then
      echo "building memopd._C with setup.py build_ext --inplace (CMake, no network)"
      "$PY" setup.py build_ext --inplace && "$PY" -c "import memopd._C" && return 0
      echo "setup.py build_ext failed; trying a direct compiler call"
    fi
    local cxx="${CXX:-$(command -v c++ || command -v g++ || true)}"
    if [ -n "$cxx" ]; then
      local suffix incs
      suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
      incs=$("$PY" -m pybind11 --includes)
      echo "compiling csrc/planner.cpp with $cxx"
      # shellcheck disable=SC2086
      "$cxx" -O2 -std=c++17 -shared -fPIC $incs csrc/planner.cpp -o "memopd/_C$suffix" \
        && "$PY" -c "import memopd._C" && return 0
    fi
  fi
  echo "memopd._C is not importable and cannot be built here (needs pybind11 and cmake or a C++"
  echo "compiler). Carry a build of it for this Python version (memopd/_C*.so) along with the tree."
  return 1
}
export -f build_core
export PY
run_step build 120 bash -c build_core

# ---------------------------------------------------------------- 3. kernel tests on CUDA
# One pytest process per file, TRITON_INTERPRET unset: a file that turns the interpreter on
# for itself (the CPU fallback of some tests) cannot silently turn the compiled-kernel
# tests of another file into skips. The files share one time budget.
shopt -s nullglob
KERNEL_TESTS=(tests/test_packed_attention*.py tests/test_fused_distill*.py tests/test_actor_loss*.py)
shopt -u nullglob
if [ "${#KERNEL_TESTS[@]}" -eq 0 ]; then
  note_failure kernel-tests "no tests/test_packed_attention*.py or tests/test_fused_distill*.py found"
else
  TESTS_DEADLINE=$(( $(date +%s) + TEST_TIMEOUT ))
  for f in "${KERNEL_TESTS[@]}"; do
    left=$(( TESTS_DEADLINE - $(date +%s) ))
    name="tests-$(basename "$f" .py)"
    if [ "$left" -lt 10 ]; then
      note_failure "$name" "not run: the kernel-test budget (${TEST_TIMEOUT}s) is spent"
      continue
    fi
    run_step "$name" "$left" "$PY" -m pytest "$f" -q -p no:cacheprovider -rs --junitxml="$OUT_DIR/$name.xml"
  done
fi

# ---------------------------------------------------------------- 3b. trainer collectives
# Two trainer steps under torchrun with NCCL need two GPUs; with fewer, the CPU emulation
# (tests/test_real_scale.py: a default group that serves CUDA tensors only) is the test.
TRAINER_TIMEOUT="${GPU_CHECK_TRAINER_TIMEOUT:-120}"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
  run_step trainer-nccl "$TRAINER_TIMEOUT" env MEMOPD_TEST_DEVICE=cuda "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node 2 tests/_dist_worker_trainer.py "$OUT_DIR/trainer_nccl" exact plain
else
  echo
  echo "=== [trainer-nccl] skipped: $NGPU GPU(s); a two-rank NCCL step needs 2 (CPU emulation: tests/test_real_scale.py)"
  STATUS_LINES+=("skip  trainer-nccl (needs 2 GPUs, found $NGPU)")
fi

# ---------------------------------------------------------------- 4. benchmarks
# = `pytest benchmarks/ --benchmark-only`, in two processes so that the packing benchmark
# (the headline numbers) runs first and keeps its own time budget.
if "$PY" -c "import pytest_benchmark" >/dev/null 2>&1 \
   || "$PY" -m pip install --no-index --no-deps --quiet pytest-benchmark py-cpuinfo >/dev/null 2>&1; then
  run_step bench-packing "$PACKING_TIMEOUT" "$PY" -m pytest benchmarks/bench_packing.py --benchmark-only -q \
    -p no:cacheprovider --benchmark-json="$OUT_DIR/bench_packing.json" --benchmark-columns=min,median,max,rounds
  run_step bench-ops "$BENCH_TIMEOUT" "$PY" -m pytest benchmarks/ --ignore=benchmarks/bench_packing.py \
    --benchmark-only -q -p no:cacheprovider --benchmark-json="$OUT_DIR/bench_ops.json" \
    --benchmark-columns=min,median,max,rounds
else
  note_failure benchmarks "pytest-benchmark is not installed and no local wheel was found (no network install)"
fi

# ---------------------------------------------------------------- 5. table (last)
echo
echo "=== summary ($(( $(date +%s) - T_START ))s in all; logs and JSON in $OUT_DIR)"
for line in "${STATUS_LINES[@]}"; do echo "  $line"; done
"$PY" - "$OUT_DIR/packing_summary.json" "$OUT_DIR/bench_packing.json" "$OUT_DIR/bench_ops.json" <<'EOF'
import json, os, sys

summary_path, bench_paths = sys.argv[1], sys.argv[2:]
benches = []
for bench_path in bench_paths:
    if not os.path.exists(bench_path):
        continue
    try:
        benches += json.load(open(bench_path)).get("benchmarks", [])
    except (OSError, ValueError) as e:
        print(f"cannot read {bench_path}: {e}")
packing = {}
others = []
for b in benches:
    info = b.get("extra_info", {})
    if "config" in info and info.get("layout") in ("independent", "aligned", "aligned_shared"):
        packing.setdefault(info["config"], {})[info["layout"]] = (info, b["stats"]["median"])
    else:
        others.append((b.get("fullname", b.get("name")), b["stats"]["median"], b["stats"]["rounds"]))
if not packing and os.path.exists(summary_path):  # benchmark JSON missing (killed run): partial summary
    for row in json.load(open(summary_path)).get("configs", []):
        for lay in ("independent", "aligned", "aligned_shared"):
            if lay in row:
                packing.setdefault(row["config"], {})[lay] = (row[lay], row[lay]["median_s"])
    if packing:
        print("(packing rows from the partial packing_summary.json)")

def key(c):
    q, bs = c.split("-")
    return int(q[1:]), int(bs[1:])

if packing:
    print(f"{'config':<9}{'tok ind':>9}{'pad':>7}{'tok aln':>9}{'tok shr':>9}"
          f"{'ms ind':>10}{'ms aln':>10}{'ms shr':>10}{'ind/aln':>9}{'ind/shr':>9}")
    worst = None
    for cfg in sorted(packing, key=key):
        r = packing[cfg]
        g = lambda lay, i: r[lay][i] if lay in r else None
        ti, ta, ts = (g(l, 1) for l in ("independent", "aligned", "aligned_shared"))
        sa = ti / ta if ti and ta else None
        ss = ti / ts if ti and ts else None
        if ss is not None:
            worst = ss if worst is None else min(worst, ss)
        f = lambda v, fmt: "-" if v is None else format(v, fmt)
        print(f"{cfg:<9}{f(r.get('independent', ({},))[0].get('tokens'), 'd'):>9}"
              f"{f(r.get('independent', ({},))[0].get('padding_fraction'), '.3f'):>7}"
              f"{f(r.get('aligned', ({},))[0].get('tokens'), 'd'):>9}{f(r.get('aligned_shared', ({},))[0].get('tokens'), 'd'):>9}"
              f"{f(ti and ti * 1e3, '.1f'):>10}{f(ta and ta * 1e3, '.1f'):>10}{f(ts and ts * 1e3, '.1f'):>10}"
              f"{f(sa, '.2f'):>9}{f(ss, '.2f'):>9}")
    if worst is not None:
        print(f"lowest independent/aligned_shared speedup: {worst:.2f}x (target 1.63x)")
else:
    print("no packing benchmark results")
for name, med, rounds in others:
    print(f"  {name}: median {med * 1e3:.3f} ms over {rounds} rounds")
EOF

echo
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "gpu_check: FAILED steps: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
exit 0
