#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs beyond torch into .gpu-bundle/ (ignored by git), for a GPU machine
# that has python3 with torch, cmake, ninja and the CUDA toolkit but none of the Debian packages and no network.
# Run it here, on the Debian 12 machine scripts/setup.sh prepared; the folder then travels with the working tree.
#
#   ./scripts/gpu_bundle.sh                      (re)makes .gpu-bundle (about 51 MiB)
#   ./scripts/gpu_bundle.sh --verify [BUILD_DIR] builds with the system's copies hidden (see below)
#
# What goes in, from which package:
#   include/CLI, share/cmake/CLI11                  libcli11-dev (header-only, its CMake package)
#   include/nlohmann, share/cmake/nlohmann_json     nlohmann-json3-dev (header-only, its CMake package)
#   include/gloo                                    libgloo-dev's headers (ProcessGroupGloo.hpp includes them;
#                                                   pip's torch has Gloo compiled in but ships no headers)
#   include/zlib.h, include/zconf.h, lib/libz.a     zlib1g-dev (position-independent static library)
#   src/googletest                                  googletest's sources (/usr/src/googletest, tests left out);
#                                                   gpu_check.sh builds them with the GPU machine's compiler, so
#                                                   no C++ library compiled here meets another libstdc++ there
#   fashion-mnist                                   dataset-fashion-mnist (the four .gz files)
#   kfac-pytorch                                    kfac_pytorch v0.4.2's `kfac` package (bench/python_step.py's
#                                                   reference), from a mirror of gpauloski/kfac-pytorch
#   wheels                                          transformers (this machine's version) and the modules it
#                                                   imports, for the GPU machine's Python (DKFAC_GPU_PYTHON_VERSION,
#                                                   3.12), from PyPI: bench/transformer_vs_adamw.py's models (issue
#                                                   45); not numpy (torch's machine has it) nor what only
#                                                   transformers' command line, tokenizers and the Hub's transfer
#                                                   client need. gpu_check.sh's transformer stage unpacks them
#   MANIFEST.txt                                    package versions, the kfac_pytorch commit, sizes
# spdlog and fmt are not bundled: nothing in dkfac includes them.
#
# kfac_pytorch comes from the git directory $KFAC_PYTORCH_GIT (default: the mirror the project's fetch tool
# makes, /work/.mirror/gpauloski+kfac-pytorch/repo); without it the bundle has no kfac-pytorch folder and the
# benchmark runs without the reference.
#
# --verify proves the bundle suffices: in a private mount namespace (root, or an unprivileged user namespace)
# it hides the system's copies of everything above (empty directories and files mounted over them), then runs
# `scripts/gpu_check.sh build` and `scripts/gpu_check.sh test` into BUILD_DIR (default /tmp/gpu-bundle-build)
# with DKFAC_GPU_PYTHON (default .venv/bin/python), and checks that CMake took every dependency from the bundle.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=${DKFAC_GPU_BUNDLE:-.gpu-bundle}
max_mib=${DKFAC_GPU_BUNDLE_MAX_MIB:-60}
kfac_git=${KFAC_PYTORCH_GIT:-/work/.mirror/gpauloski+kfac-pytorch/repo}
kfac_tag=v0.4.2
gpu_python_version=${DKFAC_GPU_PYTHON_VERSION:-3.12}
# transformers' requirements left out of the wheels: numpy is torch's machine's own; the others serve its command
# line (typer, rich), tokenizers and the Hub's downloads, none of which a model built from a config imports.
wheels_left_out='numpy|hf_xet|tokenizers|typer|rich|pygments|markdown_it_py|mdurl|shellingham|pydantic|pydantic_core'
wheels_left_out+='|annotated_types|annotated_doc|typing_inspection'
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libdir=/usr/lib/$multiarch

# The system paths bundled (and hidden by --verify): directories, then files.
system_dirs=(/usr/include/CLI /usr/include/nlohmann /usr/include/gloo /usr/include/gtest /usr/include/gmock
             /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json /usr/share/cmake/Gloo "$libdir/cmake/GTest"
             /usr/src/googletest /usr/share/datasets/fashion-mnist)
system_files=(/usr/include/zlib.h /usr/include/zconf.h "$libdir/libz.a" "$libdir/libgtest.a" "$libdir/libgtest_main.a"
              "$libdir/libgmock.a" "$libdir/libgmock_main.a")

die() { echo "gpu_bundle: $*" >&2; exit 1; }

need() {  # need PATH PACKAGE
  [[ -e $1 ]] || die "$1 is missing: install Debian's $2 (./scripts/setup.sh installs every package needed)"
}

make_bundle() {
  need /usr/include/CLI/CLI.hpp libcli11-dev
  need /usr/share/cmake/CLI11/CLI11Config.cmake libcli11-dev
  need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
  need /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake nlohmann-json3-dev
  need /usr/include/gloo/algorithm.h libgloo-dev
  need /usr/include/zlib.h zlib1g-dev
  need "$libdir/libz.a" zlib1g-dev
  need /usr/src/googletest/CMakeLists.txt googletest
  need /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz dataset-fashion-mnist

  rm -rf "$bundle"
  mkdir -p "$bundle"/{include,lib,share/cmake,src,fashion-mnist}
  cp -rL /usr/include/CLI /usr/include/nlohmann /usr/include/gloo /usr/include/zlib.h /usr/include/zconf.h \
    "$bundle/include/"
  cp -rL /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$bundle/share/cmake/"
  cp -L "$libdir/libz.a" "$bundle/lib/"
  # googletest without its own test suites (2 MB of the 3.8 MB); its CMakeLists build them only on request.
  tar -C /usr/src -cf - --exclude=googletest/googletest/test --exclude=googletest/googlemock/test \
    --exclude=googletest/docs googletest | tar -C "$bundle/src" -xf -
  cp -L /usr/share/datasets/fashion-mnist/*.gz "$bundle/fashion-mnist/"

  local kfac_commit="not bundled (no git directory at $kfac_git)"
  if git --git-dir "$kfac_git" rev-parse -q --verify "$kfac_tag^{commit}" >/dev/null 2>&1; then
    kfac_commit=$(git --git-dir "$kfac_git" rev-parse "$kfac_tag^{commit}")
    mkdir -p "$bundle/kfac-pytorch"
    git --git-dir "$kfac_git" archive "$kfac_commit" kfac LICENSE | tar -C "$bundle/kfac-pytorch" -xf -
    # Imported from its source tree, kfac_pytorch cannot ask the installed metadata for its version.
    sed -i "s/^__version__ = importlib_metadata.version('kfac-pytorch')$/__version__ = '${kfac_tag#v}'/" \
      "$bundle/kfac-pytorch/kfac/__init__.py"
    grep -q "^__version__ = '${kfac_tag#v}'$" "$bundle/kfac-pytorch/kfac/__init__.py" ||
      die "kfac_pytorch's __version__ line was not where expected in $kfac_tag"
  else
    echo "gpu_bundle: no kfac_pytorch $kfac_tag in $kfac_git (KFAC_PYTORCH_GIT); the benchmark will run without it" >&2
  fi

  local transformers_version wheels_note="not bundled"
  transformers_version=$(.venv/bin/python -c "import transformers; print(transformers.__version__)" 2>/dev/null || true)
  if [[ -n $transformers_version ]] &&
    .venv/bin/python -m pip download --quiet --disable-pip-version-check -d "$bundle/wheels" \
      --python-version "$gpu_python_version" --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "transformers==$transformers_version"; then
    local wheel
    for wheel in "$bundle"/wheels/*.whl; do
      if [[ $(basename "$wheel") =~ ^($wheels_left_out)- ]]; then rm -f "$wheel"; fi
    done
    wheels_note="transformers $transformers_version for Python $gpu_python_version"
    wheels_note+=", $(ls "$bundle/wheels" | wc -l) wheels"
  else
    rm -rf "$bundle/wheels"
    echo "gpu_bundle: no wheels of transformers (none in .venv, or PyPI out of reach); gpu_check.sh's transformer" \
      "stage will need it on the GPU machine" >&2
  fi

  {
    echo "# .gpu-bundle: made by scripts/gpu_bundle.sh on $(date -u +%Y-%m-%dT%H:%MZ) from" \
      "$(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"')"
    echo "# What scripts/gpu_check.sh needs beyond torch (docs/GPU.md)."
    dpkg-query -W -f '${Package} ${Version}\n' libcli11-dev nlohmann-json3-dev libgloo-dev zlib1g-dev googletest \
      dataset-fashion-mnist 2>/dev/null || true
    echo "kfac_pytorch $kfac_tag $kfac_commit"
    echo "wheels: $wheels_note"
    [[ -d $bundle/wheels ]] && ls "$bundle/wheels" | sed 's/^/  /'
    echo
    du -sk "$bundle"/* | sort -k2 | awk '{printf "%8.1f MiB  %s\n", $1 / 1024, $2}'
  } >"$bundle/MANIFEST.txt"

  local kib
  kib=$(du -sk "$bundle" | cut -f1)
  cat "$bundle/MANIFEST.txt"
  echo "gpu_bundle: $bundle holds $((kib / 1024)) MiB"
  ((kib <= max_mib * 1024)) || die "$bundle is larger than $max_mib MiB (the GPU machine's tree carries at most 64 MiB)"
}

# Runs in the private mount namespace: hides the system's copies, then builds and tests from the bundle.
verify_inside() {
  local build=$1 out=$2 empty_file path
  empty_file=$(mktemp)
  for path in "${system_dirs[@]}"; do
    if [[ -d $path ]]; then mount -t tmpfs -o ro,size=4k tmpfs "$path"; fi
  done
  for path in "${system_files[@]}"; do
    if [[ -f $path && ! -L $path ]]; then mount --bind "$empty_file" "$path"; fi
  done
  echo "gpu_bundle: hidden: ${system_dirs[*]} ${system_files[*]}"
  [[ ! -e /usr/include/gloo/algorithm.h && ! -s /usr/include/zlib.h ]] || die "the system's copies are still visible"
  # The env step fails here (no GPU) and makes gpu_check.sh exit 1: judge by the steps that must pass.
  local status=0 step
  rm -rf "$out/status"
  DKFAC_GPU_BUILD_DIR=$build ./scripts/gpu_check.sh build "$out" || true
  if ! grep -q $'\tPASS\t' "$out/status/build.tsv" 2>/dev/null; then
    echo "gpu_bundle: the build from the bundle failed: $out/build.log" >&2
    return 1
  fi
  # Every dependency CMake found must be the bundle's (or the googletest gpu_check.sh built from it).
  local abs_bundle entry value
  abs_bundle=$(realpath "$bundle")
  for entry in CLI11_DIR nlohmann_json_DIR GTest_DIR DKFAC_GLOO_INCLUDE_DIR ZLIB_INCLUDE_DIR ZLIB_LIBRARY; do
    value=$(sed -n "s/^$entry:[A-Z]*=//p" "$build/CMakeCache.txt")
    echo "gpu_bundle: $entry = $value"
    case $value in
      "$abs_bundle"/* | "$(realpath "$build")"/_deps/*) ;;
      *) echo "gpu_bundle: $entry does not come from the bundle" >&2; status=1 ;;
    esac
  done
  DKFAC_GPU_BUILD_DIR=$build ./scripts/gpu_check.sh test "$out" || true
  for step in ctest-gpu pytest-gpu; do
    grep -q $'\tPASS\t' "$out/status/$step.tsv" 2>/dev/null || status=1
  done
  echo "gpu_bundle: verify $( ((status == 0)) && echo passed || echo FAILED) (results in $out)"
  return $status
}

if [[ ${1:-} == --verify-inside ]]; then
  verify_inside "$2" "$3"
  exit
fi

if [[ ${1:-} == --verify ]]; then
  [[ -f $bundle/MANIFEST.txt ]] || make_bundle
  build=${2:-/tmp/gpu-bundle-build}
  out=${DKFAC_GPU_VERIFY_OUT:-$build/results}
  export DKFAC_GPU_PYTHON=${DKFAC_GPU_PYTHON:-$PWD/.venv/bin/python}
  export DKFAC_GPU_BUNDLE=$bundle
  # No compiler cache: every object must be compiled against the bundle's headers.
  export CCACHE_DISABLE=1
  unshare_flags=(--mount)
  if [[ $(id -u) -ne 0 ]]; then unshare_flags=(--user --map-root-user --mount); fi
  exec unshare "${unshare_flags[@]}" --propagation private "$0" --verify-inside "$build" "$out"
fi

(($# == 0)) || die "usage: $0 [--verify [BUILD_DIR]]"
make_bundle
