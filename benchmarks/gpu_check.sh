#!/usr/bin/env bash
# GPU check of memopd, sized for a borrowed GPU: one command of at most 10 minutes, 8 files
# back, time left in a 15-minute lease for one rerun of a phase.
#
#   bash benchmarks/gpu_check.sh              # both phases (about 8 min at most)
#   bash benchmarks/gpu_check.sh --phase 1    # environment, core, compiled correctness
#   bash benchmarks/gpu_check.sh --phase 2    # GPU benchmarks only
#   bash benchmarks/gpu_check.sh --dry-run    # on CPU: walk every step, say what would run
#                                             # and what is missing (runs in CI)
#
# Phase 1 (at most GPU_CHECK_PHASE1_S = 210 s): versions and device; the C++ core
# (memopd._C imported, else built from pybind11 by benchmarks/build_core_for.sh); the
# compiled-correctness tests (tests/kernels/test_kernels_cuda.py: production shapes, autotune
# off, pytest-xdist when present, stopping at the first failure). No interpreter suites,
# no CPU benchmarks. Phase 2 (at most GPU_CHECK_PHASE2_S = 270 s): the cases of
# benchmarks/gpu_bench.py in BENCH_LIMITS order (the production shapes first: the actor
# loss and the distillation at Qwen2.5's odd vocabulary, attention at Hq/Hkv 16/2 with 16
# calls under one prefix, the dK/dV split on and off), one
# process and one time limit each; a case that no longer fits in the phase's budget is
# listed as not run. Beside them, on the CPU, benchmarks/gpu_cost_model.py writes its
# predictions for the same shapes, which the summary puts next to the measured rows.
#
# Output ($OUT when set, the device runner's folder; else benchmarks/results/gpu_check/):
# summary.md (the pasteable table), results.json (everything in it, machine-readable),
# logs.tar.gz (every step's full log, junit XML, benchmark rows). Both are rewritten
# after every step, so a killed run still leaves what it had. Installs nothing.
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
    -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (use --dry-run, --phase 1|2|all)" >&2; exit 2 ;;
  esac
  shift
done
case "$PHASE" in 1|2|all) ;; *) echo "gpu_check: --phase must be 1, 2 or all, got '$PHASE'" >&2; exit 2 ;; esac

OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR" || exit 2
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PHASE1_S="${GPU_CHECK_PHASE1_S:-210}"
PHASE2_S="${GPU_CHECK_PHASE2_S:-270}"
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

XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 6)
TESTS=(tests/kernels/test_kernels_cuda.py -k "not on_cpu")  # (its CPU harness check runs in CI)

phase1() {
  local end=$(( $(date +%s) + PHASE1_S ))
  step env 60 env_check || return 1
  step core $(( end - $(date +%s) < 90 ? end - $(date +%s) : 90 )) core_check || return 1
  # -x: stop at the first failure; -p no:randomly etc. are not assumed to exist
  step correctness $(( end - $(date +%s) )) "$PY" -m pytest "${TESTS[@]}" -x -q -p no:cacheprovider \
    "${XDIST[@]}" -rfE --junitxml="$WORK/correctness.xml"
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
start_cost_model() {
  CUDA_VISIBLE_DEVICES="" timeout 240 "$PY" "${COST_MODEL[@]}" > "$WORK/cost_model.log" 2>&1 &
  COST_PID=$!
}

phase2() {
  local end=$(( $(date +%s) + PHASE2_S )) item case limit left
  [ -z "$COST_PID" ] && start_cost_model
  for item in "${BENCH_LIMITS[@]}"; do
    case="${item%:*}"
    limit="${item##*:}"
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
  dry correctness "$PY -m pytest ${TESTS[*]} -x -q ${XDIST[*]:-(no pytest-xdist: one process)} (limit: the rest of ${PHASE1_S}s); here: collect only" \
    "$PY" -m pytest "${TESTS[@]}" --collect-only -q -p no:cacheprovider
  dry cost-model "CUDA_VISIBLE_DEVICES= $PY ${COST_MODEL[*]} beside phase 2; here: at 64 tokens" \
    "$PY" benchmarks/gpu_cost_model.py --tokens 64 --vocab 500 --json "$WORK/predictions.jsonl"
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
  [ "$PHASE" = all ] && start_cost_model  # done long before phase 2 needs it
  if [ "$PHASE" = 1 ] || [ "$PHASE" = all ]; then phase1; fi
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
