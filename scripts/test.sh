#!/usr/bin/env bash
# Builds and runs every test. GPU tests skip (with their reason) on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python package below compiles the library a second time, in its own build directory: with
# ccache on the machine (and no launcher chosen by the caller) that second compile reuses the first's.
if command -v ccache >/dev/null 2>&1 && [ -z "${CMAKE_CUDA_COMPILER_LAUNCHER:-}" ]; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR="$PWD"
fi
bash scripts/build.sh
ctest --preset default -j "$(nproc)" --timeout 600

# The Python package, installed the way users install it (pip install . from the repository root)
# into a venv that sees the packages setup.sh installed, then its pytest suite (numpy-only; the
# torch tier skips without torch, the GPU tests without a GPU).
python3 -m venv --system-site-packages build/venv
build/venv/bin/python -m pip install -q --no-build-isolation --no-deps .
rc=0
build/venv/bin/python -m pytest -q -p no:cacheprovider tests/python || rc=$?
if [ "$rc" -eq 5 ]; then rc=0; fi  # 5: no tests collected (every test file skipped at import)
exit "$rc"
