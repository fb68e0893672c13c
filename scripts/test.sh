#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite (unit, integration, install consumer) but the
# GPU tests (scripts/gpu_check.sh runs those on a GPU machine), then a short fuzz run of the file parsers
# (DKFAC_FUZZ_SECONDS per target, default 30; 0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
ctest --test-dir build --output-on-failure --parallel 2 --timeout 900 --label-exclude gpu "$@"
# The GPU tests (ctest -L gpu, pytest -m gpu) need a CUDA device: run here, they skip and say why.
ctest --test-dir build -L gpu -R 'OnCudaNccl' --verbose 2>&1 | grep -m1 'no CUDA device visible\|tests passed' || true
if (( ${DKFAC_FUZZ_SECONDS:-30} > 0 )); then ./scripts/fuzz.sh "${DKFAC_FUZZ_SECONDS:-30}"; fi
