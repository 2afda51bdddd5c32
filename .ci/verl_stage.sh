#!/usr/bin/env bash
# The verl stage of CI: tests/with_verl in a venv of its own. verl 0.9.1 pins
# transformers >=5.5.3,<5.11 and tensordict <=0.10.0, which the test extra's newest
# transformers conflicts with; its agent loop imports cachetools, uvicorn and fastapi
# without declaring them, and its TransferQueue trainer (trainer/ppo/v1) imports
# transferqueue. torch is installed first (the CPU wheel) and must stay 2.13.0+cpu.
# The tests import the checkout's memopd (C++ core built in place by `pip install -e`) from
# the repository root; the served-teacher tests start `memopd serve-teacher` (uvicorn +
# starlette) in this venv. Prints the install and test times. VERL_VENV=DIR reuses (or keeps) a
# venv there instead of a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."

source .ci/stage_venv.sh
stage_venv_open "${VERL_VENV:-}"
"$venv/bin/pip" install --quiet "verl==0.9.1" "transformers>=5.5.3,<5.11" "tensordict<=0.10.0" "ray[default]" \
  cachetools uvicorn fastapi "starlette>=0.37" "hydra-core>=1.3" "omegaconf>=2.3,<3" "safetensors>=0.4" "numpy>=1.24" \
  "tokenizers>=0.20" "bm25s>=0.2" "tqdm>=4.60" "pyyaml>=6.0" "pytest>=8" "transferqueue==0.1.11"
stage_venv_done verl verl
OMP_NUM_THREADS=1 RAY_DEDUP_LOGS=0 stage_tests verl "$venv/bin/python" -m pytest tests/with_verl -q -p no:cacheprovider
