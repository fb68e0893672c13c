#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite (unit, integration, install consumer).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
ctest --test-dir build --output-on-failure --parallel 2 --timeout 900 "$@"
