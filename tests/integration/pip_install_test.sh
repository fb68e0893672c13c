#!/usr/bin/env bash
# `pip wheel .` and `pip install` of the wheel, as a user runs them in an environment that has torch: the build
# (PEP 517, scikit-build-core, with pip's build isolation) uses that torch and installs no second one, and needs
# no gloo headers (pip's torch ships none: the build runs with the system's hidden where a private mount
# namespace can be made, as root or in an unprivileged user namespace); the wheel holds the Python package and
# the `dkfac` command, nothing of the C++ library; the installed package imports, preconditions a step, names the
# torch it was built against, reports itself (python -m dkfac.env), carries the torch and CUDA it was built for as
# its version's local label (+pt211cu130), and trains under torch.distributed with KAISA subgroups against the
# single-process reference (tests/python/test_distributed.py, run against the installed wheel, not the build
# tree). Installed into a fresh venv that holds only this environment's torch, the wheel's `dkfac` runs `plan` and
# a two-step `train` with no LD_LIBRARY_PATH, refuses --nproc 2 naming the gloo headers it was built without,
# and still starts once the venv is moved (its run path to torch is relative).
#   tests/integration/pip_install_test.sh SOURCE_DIR PYTHON
set -euo pipefail
src="$1"
python="$2"

# Inside the private mount namespace: gloo's headers hidden, then the wheel build.
if [[ ${1:-} == --build-hidden ]]; then
  shift
  [[ -d /usr/include/gloo ]] && mount -t tmpfs -o ro,size=4k tmpfs /usr/include/gloo
  [[ ! -e /usr/include/gloo/algorithm.h ]] || { echo "gloo's headers are still visible" >&2; exit 1; }
  echo "gloo's headers hidden (/usr/include/gloo is empty)"
  exec "$2" -m pip wheel -v "$1" --no-deps -w "$3" "${@:4}"
fi

source "$(dirname "$0")/lib.sh"
# The wheel's compilations go through ccache as those of build/ do (CMakeLists.txt sets it up; pip passes the
# environment through), and they are the same compilations when they are spelled the same: the same compiler
# name (ccache hashes it; CMake picks `c++` where CXX is unset, scikit-build-core Python's `g++`) and a build
# directory beside build/ in the source tree (ccache 4.7 rewrites -I<source> relative, "..", for a build
# directory inside the source; the build directory's own paths are relative in both). Where the source tree
# is read-only, pip's temporary directory, which hits only earlier wheel builds.
if [[ -z ${CXX:-} ]] && command -v c++ > /dev/null; then export CXX=c++; fi
wheel_build=$(mktemp -d "$src/build-pip.XXXXXX" 2> /dev/null) || wheel_build=""
scratch_dir "${wheel_build:+rm -rf $(printf %q "$wheel_build")}"
build_dir=()
if [[ -n $wheel_build ]]; then build_dir=(-C "build-dir=$wheel_build"); fi

echo "== pip wheel (build isolation on)"
started=$(date +%s)
# ccache's counts for this build alone, printed below.
export CCACHE_STATSLOG="$tmp/ccache-stats.log"
unshare_flags=(--mount)
if [[ $(id -u) -ne 0 ]]; then unshare_flags=(--user --map-root-user --mount); fi
hidden=0
# Hidden where a private mount namespace can be made and a file system mounted in it (a container may refuse).
if command -v unshare > /dev/null && [[ -d /usr/include/gloo ]] &&
  unshare "${unshare_flags[@]}" --propagation private mount -t tmpfs -o ro,size=4k tmpfs /usr/include/gloo 2> /dev/null; then
  hidden=1
  unshare "${unshare_flags[@]}" --propagation private "$0" --build-hidden "$src" "$python" "$tmp/wheels" "${build_dir[@]}" \
    > "$tmp/wheel.log" 2>&1 || { tail -40 "$tmp/wheel.log"; fail "pip wheel with gloo's headers hidden"; }
  grep -q "dkfac: no gloo headers" "$tmp/wheel.log" || { grep -n "gloo" "$tmp/wheel.log" | head; fail "the build still found gloo's headers"; }
  grep -q "dkfac: the wheel has the dkfac command, without gloo's headers" "$tmp/wheel.log" ||
    { grep -n -A3 "dkfac: the wheel" "$tmp/wheel.log"; fail "the wheel's build left the dkfac command out"; }
else
  echo "(gloo's headers are absent, or no private mount namespace can hide them here: the wheel is built as the system is)"
  "$python" -m pip wheel "$src" --no-deps -w "$tmp/wheels" "${build_dir[@]}" > "$tmp/wheel.log" 2>&1 || { tail -40 "$tmp/wheel.log"; fail "pip wheel"; }
fi
echo "built in $(( $(date +%s) - started )) s$( ((hidden)) && echo ", gloo's headers hidden")"
if [[ -s $CCACHE_STATSLOG ]]; then
  ccache --show-log-stats 2> /dev/null | grep -E '^ *(Cacheable calls|Hits|Misses):' || true
fi
unset CCACHE_STATSLOG
if grep -Ei 'Collecting torch|Downloading torch|Installing collected packages:.*torch' "$tmp/wheel.log"; then
  fail "the isolated build pulled a torch"
fi
wheel=$(ls "$tmp"/wheels/dkfac-*.whl)
"$python" - "$wheel" <<'PY' || fail "wheel contents"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
print('\n'.join(sorted(names)))
assert any(n.startswith('dkfac/_C') and n.endswith('.so') for n in names), 'no extension'
for module in ('__init__.py', '_build_info.py', 'preconditioner.py', 'base_preconditioner.py'):
    assert f'dkfac/{module}' in names, module
# The command, in the wheel's scripts (installed into the environment's bin/), and nothing else of the C++ side.
import os, re, torch
data = [n for n in names if '.data/' in n]
assert data, 'no dkfac command in the wheel (CLI11, nlohmann_json or zlib missing? the build log says which)'
assert all(re.fullmatch(r'dkfac-[^/]+\.data/scripts/dkfac', n) for n in data), data
assert not any(n.startswith(('include/', 'lib/', 'bin/')) for n in names), 'C++ files in the wheel'
# The version names the torch and CUDA the wheel is built against (scripts/packaging/dkfac_version.py).
major, minor = torch.__version__.split('.')[:2]
label = f'pt{major}{minor}' + ('cu' + torch.version.cuda.replace('.', '') if torch.version.cuda else 'cpu')
version = re.match(r'dkfac-([^-]+)-', os.path.basename(sys.argv[1])).group(1)
assert version.endswith('+' + label), (version, label)
print('wheel version', version)
PY

echo "== pip install of the wheel, then import and one step"
"$python" -m pip install --no-deps --target "$tmp/site" "$wheel" > "$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "pip install"; }
PYTHONPATH="$tmp/site" "$python" - "$tmp/site" <<'PY' || fail "the installed package"
import sys
import torch
import dkfac
from dkfac import _build_info
assert dkfac.__file__.startswith(sys.argv[1]), dkfac.__file__
assert _build_info.torch_version == torch.__version__, (_build_info.torch_version, torch.__version__)
import importlib.metadata
assert '+pt' in importlib.metadata.version('dkfac'), importlib.metadata.version('dkfac')
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
preconditioner = dkfac.KFACPreconditioner(model)
model(torch.randn(8, 4)).sum().backward()
plain = model[0].weight.grad.clone()
preconditioner.step()
assert not torch.equal(plain, model[0].weight.grad), 'the gradient was not preconditioned'
print('installed dkfac', dkfac.__version__, 'built against torch', _build_info.torch_version)
PY

echo "== python -m dkfac.env from the installed package"
PYTHONPATH="$tmp/site" "$python" -m dkfac.env > "$tmp/env.txt" 2>&1 || { cat "$tmp/env.txt"; fail "python -m dkfac.env"; }
grep -E "^(dkfac|dkfac built against torch|process-group backends): " "$tmp/env.txt"
grep -q "^dkfac: .*$tmp/site" "$tmp/env.txt" || fail "dkfac.env did not report the installed package"

echo "== the installed package under torch.distributed: KAISA subgroups (Gloo backends from torch.distributed)"
DKFAC_BUILD_PYTHON="$tmp/no-build-tree" PYTHONPATH="$tmp/site" "$python" -m pytest -q -p no:cacheprovider \
  "$src/tests/python/test_distributed.py" -k "test_equals_single_process_reference and (4-kaisa-0.5 or 2-kaisa-0.5-inverse)" \
  > "$tmp/pytest.log" 2>&1 || { tail -30 "$tmp/pytest.log"; fail "test_distributed against the installed wheel"; }
tail -1 "$tmp/pytest.log"
grep -q "2 passed" "$tmp/pytest.log" || fail "expected 2 distributed tests to run"

echo "== the wheel's dkfac command in a fresh venv that holds only this environment's torch (no LD_LIBRARY_PATH)"
# torch and the nvidia-* libraries its own run path reaches ($ORIGIN/../../nvidia/...) are linked in, not copied
# (gigabytes); the command's run path goes through the new venv's site-packages to them.
"$python" -m venv "$tmp/venv" > /dev/null
site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
torch_site=$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
for entry in "$torch_site"/torch "$torch_site"/torch-*.dist-info "$torch_site"/nvidia "$torch_site"/nvidia_*.dist-info; do
  if [[ -e $entry ]]; then ln -s "$entry" "$site/"; fi
done
"$tmp/venv/bin/python" -m pip install --no-deps "$wheel" > "$tmp/venv-install.log" 2>&1 ||
  { cat "$tmp/venv-install.log"; fail "pip install of the wheel into a fresh venv"; }
dkfac="$tmp/venv/bin/dkfac"
[[ -x $dkfac ]] || fail "the wheel installed no $dkfac"
runpath=$(readelf -d "$dkfac" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
echo "run path: $runpath"
# shellcheck disable=SC2016 # a literal $ORIGIN
[[ $runpath == '$ORIGIN/'* && $runpath != *:/* ]] || fail "the command's run path is not relative to it: $runpath"
env -u LD_LIBRARY_PATH "$dkfac" plan --model resnet50 --nproc 64 > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "dkfac plan"; }
has "plan: resnet50 on imagenet (3x224x224), 64 ranks"
has "== dkfac (kaisa f=1, comm-opt)"
head -2 "$tmp/out"
# Fashion-MNIST where the integration tests read it (the .gz files go through zlib), else synthetic data.
data="${DKFAC_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}"
dataset=(--dataset synthetic --model mlp)
if [[ -e $data/train-images-idx3-ubyte.gz ]]; then dataset=(--dataset fashion-mnist --data-dir "$data"); fi
(cd "$tmp" && env -u LD_LIBRARY_PATH "$dkfac" train "${dataset[@]}" --epochs 1 --max-steps 2 --metrics "$tmp/train.jsonl") \
  > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "dkfac train, 2 steps"; }
has "stopped at --max-steps 2"
grep -E "^(train|summary): " "$tmp/out"
[[ -s $tmp/train.jsonl ]] || fail "dkfac train wrote no metrics"
if ((hidden)); then
  # Built without gloo's headers: one process only, said before any worker starts.
  rc=0
  env -u LD_LIBRARY_PATH "$dkfac" train --dataset synthetic --model mlp --max-steps 1 --nproc 2 > "$tmp/out" 2>&1 || rc=$?
  [[ $rc == 1 ]] || { cat "$tmp/out"; fail "dkfac train --nproc 2 without gloo's headers exited $rc, not 1"; }
  has "--nproc 2 needs process groups, and this dkfac command was built without gloo's headers"
  echo "--nproc 2 refused: built without gloo's headers"
fi
# Moved, the venv's command still finds torch (through the links, which stay absolute).
mv "$tmp/venv" "$tmp/moved"
env -u LD_LIBRARY_PATH "$tmp/moved/bin/dkfac" --help > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "dkfac --help from the moved venv"; }
has "Subcommands:"
env -u LD_LIBRARY_PATH "$tmp/moved/bin/dkfac" plan --model resnet50 --nproc 64 > "$tmp/out" 2>&1 ||
  { cat "$tmp/out"; fail "dkfac plan from the moved venv"; }
echo "the moved venv's dkfac starts and plans"
echo "1 passed, 0 failed"
