#!/usr/bin/env bash
# dkfac installed as a Python user installs it, with gloo's headers hidden (pip's torch ships none; hidden where a
# private mount namespace can be made, as root or in an unprivileged user namespace), in fresh venvs that hold only
# this environment's torch (linked in, with what pip installs with it):
#  1. The README's Python install block (the one after its `install:python` marker), run as written in a fresh
#     venv, activated, from the repository root: `pip install .` with pip's build isolation, which pulls no torch (torch
#     is no build requirement; CMake asks the venv's interpreter for its torch); its build log says it found no
#     gloo headers and built the `dkfac` command; then the block's import and `dkfac plan`.
#  2. `pip wheel --no-build-isolation .` (the README's variant for builds without a package index) in a venv that
#     has torch and scikit-build-core (linked from this environment): the wheel holds the Python package and the
#     command, nothing of the C++ library, and names the torch and CUDA it was built for in its version
#     (+pt211cu130).
#  3. That wheel, `pip install`ed into a second fresh venv (its dependency, torch, found there: nothing else is
#     installed), imports from the venv, preconditions a step, reports itself (python -m dkfac.env), and passes
#     the Python suite (tests/python, DKFAC_TEST_INSTALLED: the build tree is off sys.path and conftest.py stops
#     unless dkfac comes from the venv): everything but the multi-process files (test_distributed.py,
#     test_tensor_parallel.py, test_pipeline.py, test_example.py) and the repeated framework runs (test_compile.py,
#     test_optim.py's distributed checkpoints), plus one case of each kind from them;
#     DKFAC_PIP_INSTALL_FULL_SUITE=1 runs all of tests/python (docs/STATUS.md has a run). Its `dkfac` command
#     runs `plan` and a two-step `train` with no LD_LIBRARY_PATH, refuses --nproc 2 naming the gloo headers it
#     was built without, and still starts once the venv is moved (its run path to torch is relative).
# The test dependencies (pytest, torchvision, transformers, accelerate, pytorch-lightning, with what they need)
# are not installed into the venv: they are linked from this environment into a directory of their own that only
# the pytest run has on PYTHONPATH, as torch is linked into the venvs (no download, no second copy).
#   tests/integration/pip_install_test.sh SOURCE_DIR PYTHON      (DKFAC_CPP_REFERENCE: the C++ API's reference
#   binary from the build tree, for tests/python/test_cpp_api.py)
set -euo pipefail

# Inside the private mount namespace: gloo's headers hidden, then the command.
if [[ ${1:-} == --hidden ]]; then
  shift
  [[ -d /usr/include/gloo ]] && mount -t tmpfs -o ro,size=4k tmpfs /usr/include/gloo
  [[ ! -e /usr/include/gloo/algorithm.h ]] || { echo "gloo's headers are still visible" >&2; exit 1; }
  echo "gloo's headers hidden (/usr/include/gloo is empty)"
  exec "$@"
fi

src="$1"
python="$2"
source "$(dirname "$0")/lib.sh"
started_test=$(date +%s)
# The wheels' compilations go through ccache as those of build/ do (CMakeLists.txt sets it up; pip passes the
# environment through), and they are the same compilations when they are spelled the same: the same compiler
# name (ccache hashes it; CMake picks `c++` where CXX is unset, scikit-build-core Python's `g++`) and a build
# directory beside build/ in the source tree (ccache 4.7 rewrites -I<source> relative, "..", for a build
# directory inside the source; the build directory's own paths are relative in both), given to scikit-build-core
# through its environment (SKBUILD_BUILD_DIR), so that the commands stay the README's. Where the source tree is
# read-only, pip's temporary directory, which hits only earlier wheel builds.
if [[ -z ${CXX:-} ]] && command -v c++ > /dev/null; then export CXX=c++; fi
build_dirs=()
for _ in 1 2; do
  if dir=$(mktemp -d "$src/build-pip.XXXXXX" 2> /dev/null); then build_dirs+=("$dir"); fi
done
cleanup=""
if ((${#build_dirs[@]})); then cleanup="rm -rf$(printf ' %q' "${build_dirs[@]}")"; fi
scratch_dir "$cleanup"

# hidden COMMAND...: runs COMMAND with gloo's headers hidden where a private mount namespace can be made and a
# file system mounted in it (a container may refuse); else as the system is. Sets $hidden.
unshare_flags=(--mount)
if [[ $(id -u) -ne 0 ]]; then unshare_flags=(--user --map-root-user --mount); fi
hidden=0
if command -v unshare > /dev/null && [[ -d /usr/include/gloo ]] &&
  unshare "${unshare_flags[@]}" --propagation private mount -t tmpfs -o ro,size=4k tmpfs /usr/include/gloo 2> /dev/null; then
  hidden=1
fi
hide() {
  if ((hidden)); then
    unshare "${unshare_flags[@]}" --propagation private "$0" --hidden "$@"
  else
    "$@"
  fi
}
# build_checks LOG: what every wheel build of this test must show.
build_checks() {
  if ((hidden)); then
    grep -q "dkfac: no gloo headers" "$1" || { grep -n "gloo" "$1" | head; fail "the build still found gloo's headers"; }
    grep -q "dkfac: the wheel has the dkfac command, without gloo's headers" "$1" ||
      { grep -n -A3 "dkfac: the wheel" "$1"; fail "the wheel's build left the dkfac command out"; }
  fi
  if grep -Ei 'Collecting torch|Downloading torch|Installing collected packages:.*torch' "$1"; then
    fail "the build pulled a torch"
  fi
}
# ccache's counts for one build, from CCACHE_STATSLOG.
ccache_counts() {
  if [[ -s $CCACHE_STATSLOG ]]; then
    ccache --show-log-stats 2> /dev/null | grep -E '^ *(Hits|Misses):' | tr -s ' ' | tr '\n' ' ' || true
    echo
  fi
}

# fresh_venv DIR: a new venv holding only this environment's torch and what pip installs with it (linked).
fresh_venv() {
  "$python" -m venv "$1" > /dev/null
  link_dists "$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')" torch
}
# link_dists TARGET DIST...: links the named distributions of this environment and those they require (their
# markers and extras evaluated), each with its dist-info, into the directory TARGET, leaving out those TARGET
# (and LINK_DISTS_HAVE, a site-packages directory) already hold; pip then sees them as installed.
link_dists() {
  "$python" - "$@" <<'PY'
import importlib.metadata as md, os, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
target, *roots = sys.argv[1:]
have = [target] + ([os.environ['LINK_DISTS_HAVE']] if os.environ.get('LINK_DISTS_HAVE') else [])
present = {canonicalize_name(d.metadata['Name']) for d in md.distributions(path=have)}
todo, seen, linked, missing = [(name, frozenset()) for name in roots], {}, [], set()
while todo:
    name, extras = todo.pop()
    key = canonicalize_name(name)
    if key in seen and extras <= seen[key]:
        continue
    seen[key] = seen.get(key, frozenset()) | extras
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        missing.add(name)
        continue
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({'extra': e}) for e in ('', *extras)):
            todo.append((req.name, frozenset(req.extras)))
    if key in present:
        continue
    present.add(key)
    for top in {f.parts[0] for f in dist.files or []} - {'..', '__pycache__'}:
        if not os.path.lexists(os.path.join(target, top)):
            os.symlink(dist.locate_file(top), os.path.join(target, top))
    linked.append(f"{dist.metadata['Name']}=={dist.version}")
print(f'{len(linked)} distributions linked into {target}:', ' '.join(sorted(linked, key=str.lower)))
if missing:
    print('not in this environment (so not linked):', ' '.join(sorted(missing)))
PY
}
# readme_block NAME: the fenced block after README.md's `<!-- NAME ... -->` marker line.
readme_block() {
  awk -v marker="<!-- $1 " 'index($0, marker) == 1 { found = 1; next }
    found && /^```/ { if (body) exit; body = 1; next }
    found && body { print }' "$src/README.md"
}

echo "== 1. the README's Python install block, as written, in a fresh venv that holds only torch (gloo's headers hidden: $hidden)"
# The venv's torch is a link to this environment's, whose real path cmake/torch.cmake compiles against: the
# compilations are those of build/ (the same header paths, ccache's keys), and hit from a cold cache too, as in CI
# (2026-11-28: 124 of 126 hits; the whole test 146 s, where CI's first run of it without them took 1490 s). The
# venv lies inside the build directory all the same, so that a torch installed into it (not linked) would hit
# from one run to the next.
user="${build_dirs[0]:-$tmp/user-build}/venv"
fresh_venv "$user" > "$tmp/link.log"
cat "$tmp/link.log"
readme_block install:python > "$tmp/readme-python.sh"
grep -q "^pip install \.\( \|$\)" "$tmp/readme-python.sh" || { cat "$tmp/readme-python.sh"; fail "README.md's install:python block has no 'pip install .'"; }
cat "$tmp/readme-python.sh"
# Activated as the block's user has it; PIP_VERBOSE shows CMake's messages checked below; the build directory
# beside build/ (for ccache, above) through scikit-build-core's environment.
started=$(date +%s)
export CCACHE_STATSLOG="$tmp/ccache-1.log"
(
  source "$user/bin/activate"
  cd "$src"
  export PIP_VERBOSE=1
  if [[ -n ${build_dirs[0]:-} ]]; then export SKBUILD_BUILD_DIR=${build_dirs[0]}; fi
  hide bash -ex "$tmp/readme-python.sh"
) > "$tmp/readme-python.log" 2>&1 || { tail -60 "$tmp/readme-python.log"; fail "README.md's Python install block"; }
echo "ran in $(( $(date +%s) - started )) s; ccache: $(ccache_counts)"
build_checks "$tmp/readme-python.log"
# Disk: the build directory (pip's temporary one for a user; the venv inside it left out) and what was installed.
if [[ -n ${build_dirs[0]:-} ]]; then
  echo "build directory: $(du -sm --exclude=venv "${build_dirs[0]}" | cut -f1) MiB"
fi
user_site=$("$user/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
echo "installed: $(du -smc "$user_site"/dkfac "$user_site"/dkfac-*.dist-info "$user/bin/dkfac" | tail -1 | cut -f1) MiB"
grep -E "^Successfully installed" "$tmp/readme-python.log"
grep -qE "^Successfully installed dkfac-[^ ]+$" "$tmp/readme-python.log" ||
  fail "pip install . installed more than dkfac into a venv that has torch"
grep -E "^[0-9]+\.[0-9]+\.[0-9]+$" "$tmp/readme-python.log" || { tail -20 "$tmp/readme-python.log"; fail "the block's import printed no version"; }
grep -q "^plan: resnet50 on imagenet (3x224x224), 64 ranks" "$tmp/readme-python.log" ||
  { tail -20 "$tmp/readme-python.log"; fail "the block's dkfac plan printed no plan"; }

echo "== 2. pip wheel --no-build-isolation . (the README's way without a package index; gloo's headers hidden: $hidden)"
grep -qF "pip wheel --no-build-isolation" "$src/README.md" || fail "README.md no longer names pip wheel --no-build-isolation"
# In a venv that has torch and scikit-build-core (what the flag needs), inside this build's directory as above:
# its compilations are those of the first build, spelled alike, and hit.
builder="${build_dirs[1]:-$tmp/wheel-build}/venv"
fresh_venv "$builder" > /dev/null
link_dists "$("$builder/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')" scikit-build-core
started=$(date +%s)
export CCACHE_STATSLOG="$tmp/ccache-2.log"
(
  cd "$src"
  # shellcheck disable=SC2031 # each build sets its own, in its subshell
  if [[ -n ${build_dirs[1]:-} ]]; then export SKBUILD_BUILD_DIR=${build_dirs[1]}; fi
  hide "$builder/bin/python" -m pip wheel --no-build-isolation -v --no-deps -w "$tmp/wheels" .
) > "$tmp/wheel.log" 2>&1 || { tail -40 "$tmp/wheel.log"; fail "pip wheel --no-build-isolation"; }
echo "built in $(( $(date +%s) - started )) s; ccache: $(ccache_counts)"
unset CCACHE_STATSLOG
build_checks "$tmp/wheel.log"
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
print('wheel version', version, f'({os.path.getsize(sys.argv[1]) / 2**20:.1f} MiB)')
PY

echo "== 3. the wheel in a second fresh venv that holds only torch"
venv="$tmp/venv"
fresh_venv "$venv" > /dev/null
"$venv/bin/python" -m pip install "$wheel" > "$tmp/venv-install.log" 2>&1 ||
  { cat "$tmp/venv-install.log"; fail "pip install of the wheel into a fresh venv"; }
grep -E "^Successfully installed" "$tmp/venv-install.log"
grep -qE "^Successfully installed dkfac-[^ ]+$" "$tmp/venv-install.log" || fail "pip installed more than dkfac"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
(cd "$tmp" && env -u PYTHONPATH "$venv/bin/python" - "$venv" <<'PY') || fail "the installed package"
import os, sys
import torch
import dkfac
from dkfac import _build_info
assert os.path.realpath(dkfac.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep), dkfac.__file__
assert _build_info.torch_version == torch.__version__, (_build_info.torch_version, torch.__version__)
import importlib.metadata
assert '+pt' in importlib.metadata.version('dkfac'), importlib.metadata.version('dkfac')
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
preconditioner = dkfac.KFACPreconditioner(model)
model(torch.randn(8, 4)).sum().backward()
plain = model[0].weight.grad.clone()
preconditioner.step()
assert not torch.equal(plain, model[0].weight.grad), 'the gradient was not preconditioned'
print('installed dkfac', dkfac.__version__, 'from', os.path.dirname(dkfac.__file__), 'built against torch',
      _build_info.torch_version)
PY
(cd "$tmp" && env -u PYTHONPATH "$venv/bin/python" -m dkfac.env) > "$tmp/env.txt" 2>&1 || { cat "$tmp/env.txt"; fail "python -m dkfac.env"; }
grep -E "^(dkfac|dkfac built against torch|process-group backends): " "$tmp/env.txt"
grep -q "^dkfac: .*$site" "$tmp/env.txt" || fail "dkfac.env did not report the installed package"

echo "== the Python suite against the venv's dkfac"
mkdir "$tmp/testdeps"
LINK_DISTS_HAVE="$site" link_dists "$tmp/testdeps" pytest torchvision transformers accelerate pytorch-lightning
py="$src/tests/python"
# The multi-process tests that `python` and `python_distributed` run against the build tree run here once per kind:
# two KAISA-subgroup runs, one tensor-parallel and one pipeline case, and the single-process example. So do the
# framework runs of `python_transformers` that repeat one kind many times (torch.compile's backends and shapes, the
# Trainer's and Lightning's distributed checkpoints: the package's same Python files, 2-11 s each): one case each.
once="(test_equals_single_process_reference and (4-kaisa-0.5 or 2-kaisa-0.5-inverse))"
once+=" or test_one_tensor_parallel_rank_is_the_model_itself"
once+=" or (test_pipeline_stages_equal_the_whole_model_in_one_process and 1f1b-1-mlp) or test_single_process_with_dkfac"
once+=" or test_a_compiled_model_trains_to_the_eager_models_kfac_gradients[inductor]"
once+=" or test_kfac_trainer_checkpoints_under_ddp_resume_exactly[dp]"
once+=" or test_lightning_model_parallel_strategy_checkpoints_resume_exactly[dp-owner-sharded]"
repeated="test_distributed.py or test_tensor_parallel.py or test_pipeline.py or test_example.py or test_compile.py"
repeated+=" or test_kfac_trainer_checkpoints_under or test_lightning_model_parallel_strategy"
suite=("$py" -k "not ($repeated) or $once")
if [[ ${DKFAC_PIP_INSTALL_FULL_SUITE:-0} == 1 ]]; then suite=("$py"); echo "(DKFAC_PIP_INSTALL_FULL_SUITE=1: all of tests/python)"; fi
started=$(date +%s)
rc=0
(cd "$tmp" && env -u DKFAC_BUILD_PYTHON PYTHONPATH="$tmp/testdeps" DKFAC_TEST_INSTALLED="$venv" \
  "$venv/bin/python" -m pytest -rfEs -p no:cacheprovider "${suite[@]}") > "$tmp/pytest.log" 2>&1 || rc=$?
grep -E "^dkfac .* from " "$tmp/pytest.log" || true
grep -E "^SKIPPED" "$tmp/pytest.log" || true
tail -1 "$tmp/pytest.log"
echo "the suite ran in $(( $(date +%s) - started )) s"
[[ $rc == 0 ]] || { grep -E "^(FAILED|ERROR)" "$tmp/pytest.log"; tail -150 "$tmp/pytest.log"; fail "the Python suite against the installed wheel (exit $rc)"; }
grep -qE "^dkfac .* from $site/dkfac$" "$tmp/pytest.log" || fail "the suite did not report the venv's dkfac"
# The test dependencies came along: no test skipped for a missing module.
if grep -E "^SKIPPED" "$tmp/pytest.log" | grep -Ei "not importable|not installed|No module named|could not import"; then
  fail "tests skipped for a missing dependency"
fi

echo "== the wheel's dkfac command (no LD_LIBRARY_PATH)"
# torch and the nvidia-* libraries its own run path reaches ($ORIGIN/../../nvidia/...) are linked in, not copied
# (gigabytes); the command's run path goes through the venv's site-packages to them.
dkfac="$venv/bin/dkfac"
[[ -x $dkfac ]] || fail "the wheel installed no $dkfac"
runpath=$(readelf -d "$dkfac" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
echo "run path: $runpath"
# shellcheck disable=SC2016 # a literal $ORIGIN
[[ $runpath == '$ORIGIN/'* && $runpath != *:/* ]] || fail "the command's run path is not relative to it: $runpath"
env -u LD_LIBRARY_PATH "$dkfac" plan --model resnet50 --nproc 64 > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "dkfac plan"; }
has "plan: resnet50 on imagenet (3x224x224), 64 ranks"
has "== kaisa f=1 (W=64)  [KAISA comm-opt, P=64, W=64]"
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
mv "$venv" "$tmp/moved"
env -u LD_LIBRARY_PATH "$tmp/moved/bin/dkfac" --help > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "dkfac --help from the moved venv"; }
has "Subcommands:"
env -u LD_LIBRARY_PATH "$tmp/moved/bin/dkfac" plan --model resnet50 --nproc 64 > "$tmp/out" 2>&1 ||
  { cat "$tmp/out"; fail "dkfac plan from the moved venv"; }
echo "the moved venv's dkfac starts and plans"
echo "pip_install took $(( $(date +%s) - started_test )) s"
echo "1 passed, 0 failed"
