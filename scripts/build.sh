#!/usr/bin/env bash
# Configures and builds dkfac (Release) into ./build. Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
if [[ ! -f build/CMakeCache.txt ]]; then
  cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
elif (($# > 0)); then
  cmake -S . -B build "$@"
fi
cmake --build build --parallel "$(nproc)"
