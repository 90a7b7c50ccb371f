#!/usr/bin/env bash
# Installs what megamoe builds against and a fresh Debian machine may lack. Idempotent: installs
# only what is missing. Needs root (or sudo) for apt-get; pip installs into the active python3.
set -euo pipefail

CUTLASS_PIN="4.2.0.0"   # keep in sync with cmake/MegamoeDependencies.cmake
APT_PACKAGES=(cmake g++ make python3 python3-pip nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev)

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
# python3/pip may come from elsewhere (pyenv); only ask apt for them when no python3 is on PATH.
if command -v python3 >/dev/null 2>&1; then
  tmp=(); for p in "${missing[@]}"; do [[ "$p" == python3* ]] || tmp+=("$p"); done; missing=("${tmp[@]+"${tmp[@]}"}")
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

have_cutlass=$(python3 - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    print(m.version("nvidia-cutlass"))
except Exception:
    print("")
PY
)
if [ "$have_cutlass" != "$CUTLASS_PIN" ]; then
  echo "setup: installing CUTLASS/CuTe headers (nvidia-cutlass==$CUTLASS_PIN, found '${have_cutlass:-none}')"
  python3 -m pip install -q --no-deps "nvidia-cutlass==$CUTLASS_PIN"
fi

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no nvcc found. megamoe needs the CUDA toolkit (>= 12.8; 13.0 tested) with NCCL >= 2.28." >&2
  echo "       Install it from NVIDIA's packages, then re-run." >&2
  exit 1
fi
