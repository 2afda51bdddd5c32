# Sourced by the .ci/*_stage.sh scripts: the venv a stage installs into and runs in, with
# the CPU torch wheel first and checked afterwards (an engine's pins must not replace it).
# stage_venv_open DIR    sets $venv to DIR (kept and reused) or, if DIR is empty, to a
#                        temporary venv removed on exit; creates it; installs torch 2.13.0.
# stage_venv_done NAME MODULE
#                        checks torch is still 2.13.0+cpu, prints MODULE's version and the
#                        install time; with STAGE_INSTALL_ONLY=1 stops there (.ci/run builds
#                        both venvs while the AOT matrix compiles, then runs each stage).
# stage_tests NAME CMD…  runs CMD and prints its time.

stage_venv_open() {
  if [ -n "${1:-}" ]; then
    venv="$1"
  else
    stage_tmp="$(mktemp -d)"
    trap 'rm -rf "$stage_tmp"' EXIT
    venv="$stage_tmp/venv"
  fi
  stage_start=$SECONDS
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install --quiet torch==2.13.0
}

stage_venv_done() {
  local name="$1" module="$2"
  "$venv/bin/python" -c "import torch, $module; v = torch.__version__; assert v == '2.13.0+cpu', f'$name replaced the CPU torch: {v}'; print('$name', $module.__version__)"
  echo "$name stage install: $((SECONDS - stage_start)) s"
  if [ "${STAGE_INSTALL_ONLY:-0}" = 1 ]; then exit 0; fi
}

stage_tests() {
  local name="$1"; shift
  local start=$SECONDS
  "$@"
  echo "$name stage tests: $((SECONDS - start)) s"
}
