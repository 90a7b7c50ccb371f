#!/usr/bin/env bash
# Installs missing dependencies, configures (preset `default`, build/) and builds everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
