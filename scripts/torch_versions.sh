#!/usr/bin/env bash
# Builds dkfac against other torch versions from PyPI and runs the test suite on each, one virtual
# environment (.venv-torch-VERSION) and one build directory (build-torch-VERSION) per version. The
# default suite of scripts/test.sh runs on the pinned version (scripts/requirements.txt); this one checks
# the rest of the supported range.
#   ./scripts/torch_versions.sh [VERSION ...]      (default: the newest torch on PyPI)
#   extra ctest arguments through CTEST_ARGS, e.g. CTEST_ARGS="-L unit"
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
versions=("$@")
if ((${#versions[@]} == 0)); then
  newest=$(.venv/bin/python -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')
  [[ -n $newest ]] || { echo "torch_versions: could not ask PyPI for the newest torch" >&2; exit 1; }
  versions=("$newest")
fi
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
status=0
for version in "${versions[@]}"; do
  venv=.venv-torch-$version
  build=build-torch-$version
  if ! "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$version'" 2>/dev/null; then
    echo "torch_versions: creating $venv with torch $version"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version" torchvision pytest
  fi
  echo "torch_versions: building $build against $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  if [[ ! -f $build/CMakeCache.txt ]]; then
    cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDKFAC_PYTHON="$PWD/$venv/bin/python"
  fi
  cmake --build "$build" --parallel "$(nproc)"
  # shellcheck disable=SC2086
  if ctest --test-dir "$build" --output-on-failure --parallel 2 --timeout 900 ${CTEST_ARGS:-}; then
    echo "torch_versions: torch $version passed"
  else
    echo "torch_versions: torch $version FAILED"
    status=1
  fi
done
exit $status
