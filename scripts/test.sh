#!/usr/bin/env bash
# Builds and runs every test. GPU tests skip (with their reason) on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --preset default -j "$(nproc)" --timeout 600
