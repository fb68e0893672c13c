#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, AddressSanitizer + UBSan) into build-fuzz/ and fuzzes each for
# SECONDS seconds (default 60) starting from the corpus in fuzz/corpus/. New inputs go to build-fuzz/corpus-*,
# crashes to build-fuzz/artifacts/. Exit status is non-zero on any crash, sanitizer report or leak.
#   ./scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
if [[ ! -f build-fuzz/CMakeCache.txt ]]; then
  cmake -S fuzz -B build-fuzz "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++
fi
cmake --build build-fuzz --parallel "$(nproc)"
mkdir -p build-fuzz/artifacts
# LibTorch's own allocations at exit are not ours to report; everything else is.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
# LibTorch's leaks in its own code paths (fuzz/lsan.supp says which and why); a leak of dkfac's is still reported.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/fuzz/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for target in datasets checkpoint; do
  mkdir -p "build-fuzz/corpus-$target"
  echo "fuzz: $target for ${seconds}s"
  "build-fuzz/fuzz_$target" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
    -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1 \
    "build-fuzz/corpus-$target" "fuzz/corpus/$target"
done
echo "fuzz: no crash, sanitizer report or leak"
