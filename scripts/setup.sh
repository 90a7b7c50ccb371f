#!/usr/bin/env bash
# Installs what megamoe builds against and a fresh Debian machine may lack. Idempotent: installs
# only what is missing. Needs root (or sudo) for apt-get; pip installs into the active python3.
set -euo pipefail

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

# The Python package (pip install .) builds with scikit-build-core + nanobind; its tests need numpy,
# ml_dtypes (bf16 / e4m3 numpy dtypes) and pytest. torch is optional (megamoe.torch, the adapters).
# matplotlib: the plots of `megamoe bench --plot`, `megamoe tune --plot` and `megamoe plot`.
PY_MODULES=(nanobind scikit_build_core numpy ml_dtypes pytest matplotlib)
PY_PACKAGES=(nanobind scikit-build-core numpy ml_dtypes pytest matplotlib)
py_missing=()
for i in "${!PY_MODULES[@]}"; do
  python3 -c "import ${PY_MODULES[$i]}" >/dev/null 2>&1 || py_missing+=("${PY_PACKAGES[$i]}")
done
if [ "${#py_missing[@]}" -gt 0 ]; then
  echo "setup: installing Python packages: ${py_missing[*]}"
  python3 -m pip install -q "${py_missing[@]}"
fi

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no nvcc found. megamoe needs the CUDA toolkit (>= 12.8; 13.0 tested) with NCCL >= 2.28." >&2
  echo "       Install it from NVIDIA's packages, then re-run." >&2
  exit 1
fi
