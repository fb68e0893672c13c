#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite (unit, integration, install consumer), then a
# short fuzz run of the file parsers (DKFAC_FUZZ_SECONDS per target, default 30; 0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
ctest --test-dir build --output-on-failure --parallel 2 --timeout 900 "$@"
if (( ${DKFAC_FUZZ_SECONDS:-30} > 0 )); then ./scripts/fuzz.sh "${DKFAC_FUZZ_SECONDS:-30}"; fi
