#!/usr/bin/env bash
# README.md's install section for C++ users, as written: the shell block after its `install:cpp` marker runs from a
# directory that stands for the repository root (`build` is this build directory, `tests/consumer` the source's),
# with this test's scratch prefix in place of /opt/dkfac and an environment that holds nothing but PATH, HOME and
# ccache's settings (so `cmake --install`'s dkfac starts with no environment set); the CMake block after the
# `install:cmake` marker must be tests/consumer/CMakeLists.txt, the project the shell block builds.
#   tests/integration/install_readme_test.sh SOURCE_DIR BINARY_DIR
set -euo pipefail
src="$1"
binary="$2"
source "$(dirname "$0")/lib.sh"
scratch_dir

# readme_block NAME: the fenced block after README.md's `<!-- NAME ... -->` marker line.
readme_block() {
  awk -v marker="<!-- $1 " 'index($0, marker) == 1 { found = 1; next }
    found && /^```/ { if (body) exit; body = 1; next }
    found && body { print }' "$src/README.md"
}

readme_block install:cmake > "$tmp/readme.cmake"
grep -v '^#' "$src/tests/consumer/CMakeLists.txt" > "$tmp/consumer.cmake"
diff "$tmp/readme.cmake" "$tmp/consumer.cmake" || fail "README.md's install:cmake block is not tests/consumer/CMakeLists.txt"

readme_block install:cpp > "$tmp/readme.sh"
grep -q "^cmake --install build --prefix /opt/dkfac" "$tmp/readme.sh" || { cat "$tmp/readme.sh"; fail "README.md's install:cpp block"; }
root="$tmp/root"
mkdir -p "$root/tests"
ln -s "$(cd "$binary" && pwd)" "$root/build"
ln -s "$src/tests/consumer" "$root/tests/consumer"
prefix="$root/prefix"
sed "s|/opt/dkfac|$prefix|g" "$tmp/readme.sh" > "$tmp/run.sh"
cat "$tmp/run.sh"
# ccache, where there is one, keys the consumer's compilation on paths relative to the scratch root: the same
# compilation hits from one run to the next.
launcher=()
if command -v ccache > /dev/null; then launcher=(CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR="$root"); fi
started=$(date +%s)
(cd "$root" && env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME" "${launcher[@]}" bash -ex "$tmp/run.sh") \
  > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "README.md's install:cpp block"; }
echo "ran in $(( $(date +%s) - started )) s"
has "plan: resnet50 on imagenet (3x224x224), 64 ranks"
has " consumer: loss "
grep -E "consumer: loss|^plan: " "$tmp/out"
echo "1 passed, 0 failed"
