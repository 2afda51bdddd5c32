#!/usr/bin/env bash
# Build the C++ core memopd._C for another Python (e.g. the GPU machine's 3.12) without
# CMake or a network: one c++ call on csrc/*.cpp with pybind11's headers. libstdc++ stays
# dynamic: linked statically it pulls newer glibc symbols (arc4random, _dl_find_object:
# glibc 2.35-2.36 with g++ 12) than the dynamic build needs (glibc 2.32, GLIBCXX_3.4.29).
#
#   bash benchmarks/build_core_for.sh                      # for $PYTHON (default python3)
#   bash benchmarks/build_core_for.sh --python python3.12  # writes memopd/_C.cpython-312-*.so
#   bash benchmarks/build_core_for.sh --check              # say what would be used, build nothing
#
# Headers: the target Python's own include directory (python3.X-dev, or a pyenv build);
# pybind11 from the target Python, else from PYBIND11_INCLUDE (a directory holding
# pybind11/pybind11.h, e.g. from `pip install --target DIR pybind11`), else from the
# python3 running this script. The symbol versions the .so needs are printed at the end:
# it loads where glibc and libstdc++ are at least that new.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
TARGET="${PYTHON:-python3}"
CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) TARGET="${2:-}"; shift ;;
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "build_core_for: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

fail() { echo "build_core_for: $*" >&2; exit 1; }

command -v "$TARGET" >/dev/null 2>&1 || fail "no Python '$TARGET' on PATH"
read -r PY_INC EXT_SUFFIX PY_VER < <("$TARGET" -c \
  "import sysconfig, platform; print(sysconfig.get_paths()['include'], sysconfig.get_config_var('EXT_SUFFIX'), platform.python_version())")
[ -f "$PY_INC/Python.h" ] || fail "no Python.h for $TARGET ($PY_VER) in $PY_INC: install python${PY_VER%.*}-dev or use a pyenv build"

pybind_include() {
  local inc
  for py in "$TARGET" python3; do
    inc=$("$py" -c "import pybind11; print(pybind11.get_include())" 2>/dev/null) && [ -f "$inc/pybind11/pybind11.h" ] \
      && { echo "$inc"; return 0; }
  done
  if [ -n "${PYBIND11_INCLUDE:-}" ] && [ -f "$PYBIND11_INCLUDE/pybind11/pybind11.h" ]; then
    echo "$PYBIND11_INCLUDE"
    return 0
  fi
  return 1
}
PB_INC="$(pybind_include)" || fail "pybind11 headers not found (pip install pybind11, or set PYBIND11_INCLUDE)"
CXX="${CXX:-$(command -v c++ || command -v g++ || true)}"
[ -n "$CXX" ] || fail "no C++ compiler (c++ or g++)"
OUT_SO="memopd/_C$EXT_SUFFIX"

echo "target   $TARGET (Python $PY_VER, $EXT_SUFFIX), headers $PY_INC"
echo "pybind11 $PB_INC"
echo "compiler $CXX ($("$CXX" -dumpversion))"
if [ "$CHECK" = 1 ]; then
  echo "would build $OUT_SO from $(ls csrc/*.cpp | tr '\n' ' ')"
  exit 0
fi
t0=$(date +%s)
"$CXX" -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -Wall -Wextra \
  -I"$PY_INC" -I"$PB_INC" csrc/*.cpp -o "$OUT_SO" || fail "compilation failed"
needs() { objdump -T "$OUT_SO" 2>/dev/null | grep -oE "$1_[0-9.]+" | sort -u -V | tail -n 1; }
echo "built $OUT_SO in $(( $(date +%s) - t0 ))s ($(du -k "$OUT_SO" | cut -f1) KiB; needs $(needs GLIBC) and $(needs GLIBCXX))"
