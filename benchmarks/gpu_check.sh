#!/usr/bin/env bash
# GPU check of memopd, sized for a borrowed GPU: one command of at most 540 s, 8 files back;
# what to send next within the 15-minute lease, for each way it can end: benchmarks/README.md.
#
#   bash benchmarks/gpu_check.sh              # both phases and the training smoke (510 s at most)
#   bash benchmarks/gpu_check.sh --phase 1    # environment, core, compiled correctness
#   bash benchmarks/gpu_check.sh --phase 2    # GPU benchmarks only
#   bash benchmarks/gpu_check.sh --phase smoke  # the training smoke only
#   bash benchmarks/gpu_check.sh --dry-run    # on CPU: walk every step, say what would run
#                                             # and what is missing (runs in CI)
#
# Phase 1 (at most GPU_CHECK_PHASE1_S = 210 s): versions, device, its free memory and
# measured copy rate; the C++ core (memopd._C imported, else built from pybind11 by
# benchmarks/build_core_for.sh); the compiled-correctness tests
# (tests/kernels/test_kernels_cuda.py: production shapes, autotune off), with as many
# pytest-xdist workers as fit the free memory (tests/kernels/_cuda_budget.py: 6 on an
# H100), -v (every test's name in the log), --timeout per test, --maxfail=5. No
# interpreter suites, no CPU benchmarks. Then the training smoke (at most
# GPU_CHECK_SMOKE_S = 60 s, benchmarks/gpu_train_smoke.py): memopd train on the GPU in bf16
# with the Triton back ends, and memopd audit --random with --attention-backend triton.
# Phase 2 (at most GPU_CHECK_PHASE2_S = 240 s; GPU_CHECK_CASES="CASE ..." picks some): the cases of
# benchmarks/gpu_bench.py in BENCH_LIMITS order (the production shapes first: the actor
# loss and the distillation at Qwen2.5's odd vocabulary, attention at Hq/Hkv 16/2 with 16
# calls under one prefix, the dK/dV split on and off), one
# process and one time limit each; a case that no longer fits in the phase's budget is
# listed as not run; the first lm-head case gets 45 s more when the correctness step did not
# pass in this call (its compiles are then cold). Beside them, on the CPU,
# benchmarks/gpu_cost_model.py writes its bound and band at the measured copy rate for the
# same shapes, which the summary puts next to the measured rows.
#
# Output ($OUT when set, the device runner's folder; else benchmarks/results/gpu_check/):
# summary.md (the pasteable table), results.json (everything in it, machine-readable),
# logs.tar.gz (every step's full log, junit XML, benchmark rows). Both are rewritten
# after every step (without importing torch), so a killed run still leaves what it had.
# Installs nothing.
# PYTHON (default python3); MEMOPD_TRITON_AUTOTUNE is left alone (on: the benchmarks tune).
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
PHASE=all
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --phase) PHASE="${2:-}"; shift ;;
    --phase=*) PHASE="${1#--phase=}" ;;
    -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (use --dry-run, --phase 1|2|smoke|all)" >&2; exit 2 ;;
  esac
  shift
done
case "$PHASE" in 1|2|smoke|all) ;; *) echo "gpu_check: --phase must be 1, 2, smoke or all, got '$PHASE'" >&2; exit 2 ;; esac

OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR" || exit 2
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PHASE1_S="${GPU_CHECK_PHASE1_S:-210}"
SMOKE_S="${GPU_CHECK_SMOKE_S:-60}"
PHASE2_S="${GPU_CHECK_PHASE2_S:-240}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET
FAILED=0

finish() {  # rewrite summary.md, results.json and logs.tar.gz from what is there so far
  "$PY" benchmarks/gpu_bench.py --summary "$WORK" "$OUT_DIR" > "$WORK/summary.txt" 2>"$WORK/summary.err" \
    || echo "gpu_check: the summary failed: $(tail -1 "$WORK/summary.err")"
  tar -czf "$OUT_DIR/logs.tar.gz.tmp" -C "$WORK" --exclude=summary.txt . 2>/dev/null \
    && mv "$OUT_DIR/logs.tar.gz.tmp" "$OUT_DIR/logs.tar.gz"
}

record() {  # record STEP STATUS SECONDS LIMIT NOTE
  "$PY" -c 'import json, sys; print(json.dumps(dict(step=sys.argv[1], status=sys.argv[2], seconds=int(sys.argv[3]),
limit=int(sys.argv[4]), note=sys.argv[5])))' "$@" >> "$WORK/steps.jsonl"
}

# step NAME LIMIT CMD...: full output to $WORK/NAME.log, its last lines to the console
step() {
  local name="$1" limit="$2"
  shift 2
  echo
  echo "=== [$name] $* (limit ${limit}s)"
  if [ "$limit" -lt 5 ]; then
    echo "[$name] not run: its phase's time budget is spent"
    record "$name" "not run" 0 "$limit" "phase budget spent"
    FAILED=1
    finish
    return 1
  fi
  local t0 rc dt note=""
  t0=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a process
    timeout -s INT -k 15 "$limit" bash -c '"$@"' _ "$@" > "$WORK/$name.log" 2>&1
  else
    timeout -s INT -k 15 "$limit" "$@" > "$WORK/$name.log" 2>&1
  fi
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  tail -n 15 "$WORK/$name.log" | cut -c1-300
  if [ "$rc" -eq 0 ]; then
    record "$name" ok "$dt" "$limit" ""
  else
    [ "$rc" -eq 124 ] && note="timed out"
    [ -z "$note" ] && note="exit $rc: $(grep -v '^\s*$' "$WORK/$name.log" | tail -n 1 | cut -c1-150)"
    record "$name" FAIL "$dt" "$limit" "$note"
    FAILED=1
  fi
  finish
  return "$rc"
}

# dry-run counterpart of a step: run a check of its prerequisites on CPU, report it
dry() {  # dry NAME "WHAT WOULD RUN" CHECK-CMD...
  local name="$1" what="$2"
  shift 2
  echo
  echo "=== [$name] would run: $what"
  local t0 rc
  t0=$(date +%s)
  "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  sed 's/^/    /' "$WORK/$name.log" | tail -n 12 | cut -c1-300
  if [ "$rc" -eq 0 ]; then
    record "$name" "dry-run ok" $(( $(date +%s) - t0 )) 0 "$what"
  else
    record "$name" "dry-run FAIL" $(( $(date +%s) - t0 )) 0 "$(tail -n 1 "$WORK/$name.log" | cut -c1-150)"
    FAILED=1
  fi
  finish
}

# ----------------------------------------------------------------------------- the steps
env_check() {  # versions and device, one JSON line into env.jsonl; fails without CUDA unless dry
  "$PY" - "$WORK/env.jsonl" "$DRY" <<'EOF'
import importlib, json, platform, sys
info = {"python": platform.python_version()}
for mod in ("torch", "triton", "pytest", "xdist", "pybind11"):
    try:
        info[mod] = getattr(importlib.import_module(mod), "__version__", "present")
    except Exception as e:  # noqa: BLE001
        info[mod] = "missing"
import torch
info["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["device"] = f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor})"
    info["free_mib"] = torch.cuda.mem_get_info()[0] // 2**20
    # the copy rate: 1 GiB device-to-device, read + written, best of 5 after a warm-up
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); y.copy_(x); b.record(); b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    info["copy_tbps"] = round(2 * 2**30 / best / 1e12, 2)
    del x, y
else:
    info["device"] = "none"
print(json.dumps(info))
open(sys.argv[1], "a").write(json.dumps(info) + "\n")
if info["device"] == "none":
    print("missing: a CUDA device" + (" (expected in a dry run)" if sys.argv[2] == "1" else ""))
    sys.exit(0 if sys.argv[2] == "1" else 1)
EOF
}

core_check() {  # memopd._C importable, or buildable here
  if "$PY" -c "import memopd._C" 2>/dev/null; then
    echo "memopd._C imports: $("$PY" -c 'import memopd._C as c; print(c.__file__)')"
    return 0
  fi
  if [ "$DRY" = 1 ]; then
    bash benchmarks/build_core_for.sh --check
  else
    bash benchmarks/build_core_for.sh && "$PY" -c "import memopd._C"
  fi
}

export -f env_check core_check
export PY WORK DRY

TESTS=(tests/kernels/test_kernels_cuda.py -k "not on_cpu")  # (its CPU harness check runs in CI)
TEST_TIMEOUT=150  # s per test: the slowest (N=2048 gradient paths, cold compiles) take ~30 s

env_value() {  # env_value KEY: a value of the device line env_check wrote (no torch import)
  "$PY" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(rows[-1].get(sys.argv[2], "") if rows else "")' "$WORK/env.jsonl" "$1" 2>/dev/null
}

# pytest arguments of the correctness step: workers from the free device memory (each
# may hold its largest test's modelled peak plus a CUDA context at once), a time limit
# per test, every test's name in the log (-v), at most five failures before it stops
pytest_args() {  # pytest_args FREE_MIB
  local workers=1
  if "$PY" -c "import xdist" 2>/dev/null; then
    workers=$("$PY" tests/kernels/_cuda_budget.py --workers "${1:-0}" --cpus "$(nproc)")
  fi
  ARGS=("${TESTS[@]}" -v -p no:cacheprovider --maxfail=5 -rfE --junitxml="$WORK/correctness.xml")
  [ "$workers" -gt 1 ] && ARGS+=(-n "$workers")
  "$PY" -c "import pytest_timeout" 2>/dev/null && ARGS+=(--timeout "$TEST_TIMEOUT")
}

CORRECT_OK=0
phase1() {
  local end=$(( $(date +%s) + PHASE1_S ))
  step env 60 env_check || return 1
  # beside the other steps, at the measured copy rate (only when phase 2 follows and waits for it)
  [ -z "$COST_PID" ] && [ "$PHASE" = all ] && start_cost_model
  step core $(( end - $(date +%s) < 90 ? end - $(date +%s) : 90 )) core_check || return 1
  pytest_args "$(env_value free_mib)"
  step correctness $(( end - $(date +%s) )) "$PY" -m pytest "${ARGS[@]}" && CORRECT_OK=1
  return 0
}

smoke() {  # memopd train (bf16) and memopd audit on the GPU, Triton back ends
  step train-smoke "$SMOKE_S" "$PY" benchmarks/gpu_train_smoke.py "$WORK/train_smoke" --device cuda --backend triton
  return 0
}

BENCH_LIMITS=(  # case:limit seconds, in the order they run: the first five fit the phase's 270 s
  "actor_loss-V151665:45" "distill-reverse_kl-V151665:60" "attn-fwd_bwd-16/2-shared:60"
  "attn-fwd_bwd-16/2-shared-nosplit:45" "attn-fwd_bwd-32/8:60" "attn-fwd-32/8:40" "attn-fwd_bwd-16/2:60"
  "attn-fwd_bwd_det-32/8:60" "actor_loss:45" "distill-reverse_kl:60" "distill-jsd:45" "logprob_entropy:45"
)

# the cost model's predictions for the benchmarked lm-head shapes (16k tokens, both
# vocabularies), on one CPU core beside the GPU steps (and away from the GPU)
COST_MODEL=(benchmarks/gpu_cost_model.py --tokens 16384 --vocab 151665 --vocab 151936 --json "$WORK/predictions.jsonl")
COST_PID=""
start_cost_model() {  # at the copy rate env_check measured (else the model's default, H200's 4.3 TB/s)
  local bw
  bw=$(env_value copy_tbps)
  CUDA_VISIBLE_DEVICES="" timeout 240 "$PY" "${COST_MODEL[@]}" ${bw:+--hbm-tbps "$bw"} > "$WORK/cost_model.log" 2>&1 &
  COST_PID=$!
}

phase2() {
  local end=$(( $(date +%s) + PHASE2_S )) item case limit left warm="$CORRECT_OK"
  [ -z "$COST_PID" ] && start_cost_model
  for item in "${BENCH_LIMITS[@]}"; do
    case="${item%:*}"
    limit="${item##*:}"
    # GPU_CHECK_CASES="CASE ...": only these (a follow-up call measures what the first left out)
    if [ -n "${GPU_CHECK_CASES:-}" ] && [[ " $GPU_CHECK_CASES " != *" $case "* ]]; then continue; fi
    case "$case" in
      actor_loss*|distill*|logprob*)  # the first lm-head case compiles cold unless phase 1 passed here
        [ "$warm" = 0 ] && limit=$(( limit + 45 ))
        warm=1 ;;
    esac
    left=$(( end - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit="$left"
    step "bench-${case//\//_}" "$limit" "$PY" benchmarks/gpu_bench.py "$case" --json "$WORK/bench_rows.jsonl"
  done
  wait "$COST_PID" 2>/dev/null || echo "gpu_check: the cost model failed: $(tail -1 "$WORK/cost_model.log")"
  return 0
}

dry_run() {
  dry env "versions and device (limit 60s)" env_check
  dry core "import memopd._C, else bash benchmarks/build_core_for.sh (limit 90s)" core_check
  pytest_args $(( 78 * 1024 ))  # an idle H100's free memory
  dry workers "pytest-xdist workers for the free memory env_check measures (tests/kernels/_cuda_budget.py); here: 78 GiB, 16 CPUs" \
    "$PY" tests/kernels/_cuda_budget.py --workers $(( 78 * 1024 )) --cpus 16
  dry correctness "$PY -m pytest ${ARGS[*]} (on a free H100; limit: the rest of ${PHASE1_S}s); here: collect only" \
    "$PY" -m pytest "${TESTS[@]}" --collect-only -q -p no:cacheprovider
  dry train-smoke "$PY benchmarks/gpu_train_smoke.py WORK --device cuda --backend triton (limit ${SMOKE_S}s); here: on CPU, torch back ends" \
    "$PY" benchmarks/gpu_train_smoke.py "$WORK/train_smoke" --device cpu --backend torch
  dry cost-model "CUDA_VISIBLE_DEVICES= $PY ${COST_MODEL[*]} --hbm-tbps MEASURED beside the steps; here: at 64 tokens, 3.0 TB/s" \
    "$PY" benchmarks/gpu_cost_model.py --tokens 64 --vocab 500 --hbm-tbps 3.0 --json "$WORK/predictions.jsonl"
  local item cases=()
  for item in "${BENCH_LIMITS[@]}"; do cases+=("${item%:*}"); done
  dry bench "$PY benchmarks/gpu_bench.py CASE, one process each: ${BENCH_LIMITS[*]} (phase limit ${PHASE2_S}s); here: the smoke run on CPU" \
    "$PY" benchmarks/gpu_bench.py --smoke "${cases[@]}" --json "$WORK/bench_rows.jsonl"
  local n
  n=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
  echo
  echo "=== [outputs] $n file(s) in $OUT_DIR: $(cd "$OUT_DIR" && ls | tr '\n' ' ')"
  if [ "$n" -gt 8 ]; then echo "more than 8 output files"; FAILED=1; fi
}

T0=$(date +%s)
rm -f "$OUT_DIR/summary.md" "$OUT_DIR/results.json" "$OUT_DIR/logs.tar.gz"
if [ "$DRY" = 1 ]; then
  dry_run
else
  if [ "$PHASE" = 1 ] || [ "$PHASE" = all ]; then phase1; fi
  if [ "$PHASE" = smoke ] || [ "$PHASE" = all ]; then smoke; fi
  if [ "$PHASE" = 2 ] || [ "$PHASE" = all ]; then
    if [ "$PHASE" = 2 ] && ! env_check >/dev/null 2>&1; then
      echo "gpu_check: no CUDA device"; FAILED=1
    else
      phase2
    fi
  fi
fi
finish

echo
echo "=== gpu_check: $(( $(date +%s) - T0 ))s in all; summary.md, results.json, logs.tar.gz in $OUT_DIR"
cat "$WORK/summary.txt" 2>/dev/null
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check: FAILED (see the step table above)"
  exit 1
fi
echo "gpu_check: all steps passed"
exit 0
