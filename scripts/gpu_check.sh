#!/usr/bin/env bash
# Everything the GPU machine runs: builds dkfac against its python3's torch with the dependencies from
# .gpu-bundle (scripts/gpu_bundle.sh makes it on the Debian machine), runs the GPU tests and the GPU
# benchmark, and leaves every log, JSON and table in one folder with a summary (docs/GPU.md).
#
#   ./scripts/gpu_check.sh [STAGE] [OUT_DIR]      (defaults: call1, ./gpu-results)
#
# The device tool lends one GPU for 15 minutes of device time in all (its start included), at most 10 minutes
# per command, and a machine left idle for 30 s goes back bare. So the check is two calls, each one command:
#   call1           from a cold machine: env, build (only what the checks need), ctest -L gpu and pytest -m gpu
#                   side by side, then bench/step_kinds.py (each kind of step alone, both models, composed into
#                   (1,10) and (10,100)) if at least DKFAC_GPU_KINDS_MIN_S (120) seconds remain, then
#                   bench/kernel_probe.py if at least DKFAC_GPU_PROBE_MIN_S (60) remain
#   call2           from a cold machine, if at least 4 minutes of device time remain: env, build
#                   (DKFAC_GPU_TARGETS), pytest -m gpu (DKFAC_GPU_PYTEST_ARGS narrows it), bench-kinds
#                   (DKFAC_GPU_KINDS_MODELS, DKFAC_GPU_BENCH_ARGS: e.g. variants; unset, cuda_graphs against
#                   eager, one block per kind, kfac_pytorch left to call1: '--keep-gradients --variant
#                   graphs:cuda_graphs=true --blocks 1 --no-kfac-pytorch-run'), then launches, compile-step,
#                   fast-error (DKFAC_GPU_FAST_ARGS) and lag-step (DKFAC_GPU_LAG_ARGS), each if at least
#                   DKFAC_GPU_FAST_MIN_S (60) seconds remain, then transformer if DKFAC_GPU_TRANSFORMER_MIN_S (150) do
# One deadline (DKFAC_GPU_DEADLINE_S seconds from the script's start; 540 for call1 and call2, none otherwise)
# bounds every step: each step's timeout is what is left of it, less DKFAC_GPU_EXPORT_RESERVE_S (15) for the
# last export. After every step, summary.md and OUT_DIR packed as gpu-results.tar.gz are copied to
# DKFAC_GPU_EXPORT (the device tool's $OUT), so a call cut short still brings back all that ran.
#
# Single stages (each records the environment first):
#   build           googletest from the bundle's sources, configure (Release, Ninja), build DKFAC_GPU_TARGETS
#   ctest           ctest -L gpu (the GPU-labelled GoogleTest and integration tests)
#   pytest          pytest -m gpu tests/python against the built extension
#   test            ctest and pytest side by side
#   bench-kinds     bench/step_kinds.py --device cuda --models DKFAC_GPU_KINDS_MODELS (resnet50,bert)
#   kernel-probe    bench/kernel_probe.py: eigh through cuSOLVER and MAGMA, on streams, batched; GEMM widths
#   fast-error      bench/fast_mode_error.py: each fast mode's preconditioned gradient and trained loss against exact
#   compile-step    bench/compile_step.py: torch.compile against eager, with and without dkfac (DKFAC_GPU_COMPILE_ARGS)
#   lag-step        bench/second_order_lag.py: training steps with second_order_lag against exact, in lockstep
#   launches        bench/step_launches.py: the ATen operations and CUDA kernels of a step without updates, eager
#                   and with cuda_graphs, and its host and device time (DKFAC_GPU_LAUNCH_ARGS)
#   transformer     bench/transformer_vs_adamw.py --device cuda: eigen_adam against AdamW on a GPT-2 trained on the
#                   standard library's sources (issue 45), DKFAC_GPU_TRANSFORMER_ARGS; transformers from the
#                   bundle's wheels where the machine's python3 lacks it
#   bench-resnet50  bench/python_step.py --device cuda --models resnet50 (SGD, dkfac, kfac_pytorch)
#   bench-bert      the same for the BERT-Large-shaped encoder
#   bench           both benchmarks
#   all             build, test, bench (no deadline: for a machine without the tool's limits)
#   summary         only rewrites OUT_DIR/summary.md from the steps recorded so far
#
# Settings (environment):
#   DKFAC_GPU_PYTHON        interpreter with torch (python3)
#   DKFAC_GPU_BUILD_DIR     build directory (build-gpu, ignored by git)
#   DKFAC_GPU_BUNDLE        the bundle (.gpu-bundle)
#   DKFAC_GPU_JOBS          build parallelism (nproc)
#   DKFAC_GPU_TARGETS       what the build step builds ("dkfac_tests dkfac_cli dkfac_python"; "all" for all)
#   DKFAC_GPU_DEADLINE_S    seconds from the start that every step must finish within (above)
#   DKFAC_GPU_EXPORT_RESERVE_S  seconds kept back from the deadline for the last export (15)
#   DKFAC_GPU_STEP_TIMEOUT  the most seconds one step may take, deadline or not (540)
#   DKFAC_GPU_BENCH_MIN_S   seconds that must remain for call1's benchmark to start (180)
#   DKFAC_GPU_CTEST_JOBS    ctest -j (4); DKFAC_GPU_PYTEST_JOBS: pytest-xdist's -n where installed (4)
#   DKFAC_GPU_CTEST_ARGS    more ctest arguments (e.g. "-R Cuda" or "-E train")
#   DKFAC_GPU_PYTEST_ARGS   more pytest arguments (e.g. "-k autocast" or "-x")
#   DKFAC_GPU_BENCH_DEVICE  the benchmark's --device (cuda; cpu runs the stage's plumbing without a GPU)
#   DKFAC_GPU_BENCH_ARGS    more arguments for the benchmarks: bench/python_step.py (bench-resnet50, bench-bert)
#                           and bench/step_kinds.py (bench-kinds), e.g. "--quick" or "--bert-layers 12"; the
#                           step_kinds-only ones (--variant, --blocks, --no-kfac-pytorch-run) with bench-kinds,
#                           call1 or call2 alone
#   DKFAC_GPU_KINDS_MODELS  the models bench-kinds measures (resnet50,bert); DKFAC_GPU_KINDS_MIN_S: seconds that
#                           must remain for it to start (120)
#   DKFAC_GPU_PROBE_MIN_S   seconds that must remain for kernel-probe to start (60)
#   DKFAC_GPU_FAST_MIN_S    seconds that must remain for fast-error to start (60)
#   DKFAC_GPU_FAST_ARGS     bench/fast_mode_error.py's arguments for fast-error ("--models bert --bert-layers 4
#                           --mode tf32:precondition_dtype=tf32 --mode bf16:inv_dtype=bfloat16")
#   DKFAC_GPU_COMPILE_ARGS  bench/compile_step.py's arguments ("--layers 4 --hidden 1024 --heads 16 --ffn 4096
#                           --seq-len 128 --batch 16 --factor-update-steps 10 --inv-update-steps 100 --steps 30")
#   DKFAC_GPU_LAG_ARGS      bench/second_order_lag.py's arguments ("--models bert --bert-layers 8 --intervals 10,100
#                           --lag 1 --lag 10 --cycles 3 --warmup-cycles 1")
#   DKFAC_GPU_TRANSFORMER_ARGS  bench/transformer_vs_adamw.py's arguments for transformer (a 4.8M-parameter GPT-2,
#                           n_embd 256, 6 layers, 1200 steps: AdamW at 2 lrs and eigen_adam on seed 0, then 2 seeds)
#   DKFAC_GPU_TRANSFORMER_MIN_S seconds that must remain for transformer to start (150)
#   DKFAC_GPU_EXPORT        a folder that gets summary.md and gpu-results.tar.gz after every step
set -uo pipefail
cd "$(dirname "$0")/.." || exit
repo=$PWD

stage=${1:-call1}
out=${2:-gpu-results}
python=${DKFAC_GPU_PYTHON:-python3}
build=${DKFAC_GPU_BUILD_DIR:-build-gpu}
bundle=${DKFAC_GPU_BUNDLE:-.gpu-bundle}
jobs=${DKFAC_GPU_JOBS:-$(nproc)}
step_timeout=${DKFAC_GPU_STEP_TIMEOUT:-540}
targets=${DKFAC_GPU_TARGETS:-dkfac_tests dkfac_cli dkfac_python}
export_reserve=${DKFAC_GPU_EXPORT_RESERVE_S:-15}
bench_min=${DKFAC_GPU_BENCH_MIN_S:-180}
ctest_jobs=${DKFAC_GPU_CTEST_JOBS:-4}
pytest_jobs=${DKFAC_GPU_PYTEST_JOBS:-4}
read -r -a fast_args <<<"${DKFAC_GPU_FAST_ARGS:---models bert --bert-layers 4 --mode tf32:precondition_dtype=tf32 --mode bf16:inv_dtype=bfloat16}"
fast_min=${DKFAC_GPU_FAST_MIN_S:-60}
read -r -a lag_args <<<"${DKFAC_GPU_LAG_ARGS:---models bert --bert-layers 8 --intervals 10,100 --lag 1 --lag 10 --cycles 3 --warmup-cycles 1}"
read -r -a launch_args <<<"${DKFAC_GPU_LAUNCH_ARGS:---models resnet50,bert --bert-layers 8}"
read -r -a compile_args <<<"${DKFAC_GPU_COMPILE_ARGS:---layers 4 --hidden 1024 --heads 16 --ffn 4096 --seq-len 128 --batch 16 --factor-update-steps 10 --inv-update-steps 100 --steps 30}"
transformer_default="--n-embd 256 --n-layer 6 --n-head 8 --steps 1200 --adamw-lrs 2e-3 4e-3 --kfac-configs"
transformer_default+=" --kfac-eigen-adam-configs 4e-3:10:50::0.8 --headline-from kfac-eigenadam --seeds 2 --threads 4"
read -r -a transformer_args <<<"${DKFAC_GPU_TRANSFORMER_ARGS:-$transformer_default}"
transformer_min=${DKFAC_GPU_TRANSFORMER_MIN_S:-150}
kinds_models=${DKFAC_GPU_KINDS_MODELS:-resnet50,bert}
kinds_min=${DKFAC_GPU_KINDS_MIN_S:-120}
probe_min=${DKFAC_GPU_PROBE_MIN_S:-60}
case $stage in
  call1 | call2) deadline=${DKFAC_GPU_DEADLINE_S:-540} ;;
  *) deadline=${DKFAC_GPU_DEADLINE_S:-} ;;
esac
bench_device=${DKFAC_GPU_BENCH_DEVICE:-cuda}
# call2's bench-kinds measures, by default, the step replayed from CUDA graphs against the eager one (cuda_graphs:
# its gradients must keep their memory from step to step, so every method zeroes them in place).
call2_bench_default='--keep-gradients --variant graphs:cuda_graphs=true --blocks 1 --no-kfac-pytorch-run'
[[ $stage == call2 ]] || call2_bench_default=
read -r -a bench_args <<<"${DKFAC_GPU_BENCH_ARGS-$call2_bench_default}"
read -r -a ctest_args <<<"${DKFAC_GPU_CTEST_ARGS:-}"
read -r -a pytest_args <<<"${DKFAC_GPU_PYTEST_ARGS:-}"

# The steps, in the order the summary lists them.
steps=(env googletest configure build ctest-gpu pytest-gpu bench-kinds launches kernel-probe compile-step fast-error
  lag-step transformer bench-resnet50 bench-bert)

mkdir -p "$out/status" "$build"
out=$(realpath "$out")
build=$(realpath "$build")
[[ -d $bundle ]] && bundle=$(realpath "$bundle")

log() { echo "gpu_check: $*" >&2; }

# --- one clock: the deadline every step's timeout comes from ----------------------------------------------
# remaining: seconds left before the deadline, less the export reserve (a large number without a deadline).
remaining() {
  if [[ -z $deadline ]]; then echo 999999; else echo $((deadline - SECONDS - export_reserve)); fi
}

# budget: the timeout for the next step: the smaller of the step timeout and what remains of the deadline.
budget() {
  local left
  left=$(remaining)
  echo $((left < step_timeout ? left : step_timeout))
}

# record STEP RESULT DETAIL: RESULT is PASS, FAIL, TIMEOUT or SKIP; then exports what there is.
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$out/status/$1.tsv"
  log "$1: $2${3:+ ($3)} [${SECONDS} s${deadline:+ of $deadline}]"
  export_results
}

# export_results: summary.md and the packed results to DKFAC_GPU_EXPORT, after every step (steps that run side
# by side take turns through a lock), so a call stopped at its limit still brings back every finished step.
export_results() {
  [[ -n ${DKFAC_GPU_EXPORT:-} ]] || return 0
  mkdir -p "$DKFAC_GPU_EXPORT"
  (
    flock 9
    write_summary >/dev/null
    cp "$out/summary.md" "$DKFAC_GPU_EXPORT/summary.md.tmp" && mv "$DKFAC_GPU_EXPORT/summary.md.tmp" "$DKFAC_GPU_EXPORT/summary.md"
    tar -C "$(dirname "$out")" -czf "$DKFAC_GPU_EXPORT/gpu-results.tar.gz.tmp" --exclude=.export.lock "$(basename "$out")" &&
      mv "$DKFAC_GPU_EXPORT/gpu-results.tar.gz.tmp" "$DKFAC_GPU_EXPORT/gpu-results.tar.gz"
  ) 9>"$out/.export.lock"
}

# no_time STEP [MIN [RESULT]]: if fewer than MIN seconds (20) remain before the deadline, records STEP as not
# started with RESULT (TIMEOUT; the benchmark's optional runs say SKIP) and returns 0.
no_time() {
  local left
  left=$(remaining)
  if ((left < ${2:-20})); then
    record "$1" "${3:-TIMEOUT}" "not started: $left s left before the deadline (${deadline} s), ${2:-20} s needed"
    return 0
  fi
  return 1
}

# run_logged LOG COMMAND...: runs COMMAND under the step's budget with its output appended to LOG; returns
# its status (124 or 137 when stopped at the budget).
run_logged() {
  local logfile=$1 limit
  shift
  limit=$(budget)
  echo "+ [timeout ${limit} s] $*" >>"$logfile"
  timeout --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1
}

# result_of STATUS: the result word for a command's exit status.
result_of() {
  case $1 in
    0) echo PASS ;;
    124 | 137) echo TIMEOUT ;;
    *) echo FAIL ;;
  esac
}

# --- env: the machine, the GPU and the versions -------------------------------------------------------
step_env() {
  {
    echo "== date: $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname), $(uname -srm)"
    echo "== commit: $(git -C "$repo" rev-parse HEAD 2>/dev/null || echo 'no git directory')"
    echo "== nvidia-smi"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || true
    echo "== nvcc"
    nvcc --version 2>&1 || /usr/local/cuda/bin/nvcc --version 2>&1 || echo "nvcc: not found"
    echo "== tools"
    cmake --version 2>&1 | head -1
    echo "ninja $(ninja --version 2>&1)"
    c++ --version 2>&1 | head -1
    echo "cores: $(nproc), memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
    echo "bundle: $bundle"
    head -12 "$bundle/MANIFEST.txt" 2>/dev/null ||
      echo "no $bundle/MANIFEST.txt: run scripts/gpu_bundle.sh on the Debian machine"
  } >"$out/environment.txt" 2>&1
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  DKFAC_DRIVER=$driver "$python" - >"$out/environment.json" 2>>"$out/environment.txt" <<'EOF'
import json, os, platform, sys
info = {'python': platform.python_version(), 'platform': platform.platform(), 'cores': os.cpu_count(),
        'driver': os.environ.get('DKFAC_DRIVER') or None}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                threads=torch.get_num_threads())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, device_count=torch.cuda.device_count(), capability=f'{p.major}.{p.minor}',
                    device_memory_gib=round(p.total_memory / 2**30, 1),
                    nccl='.'.join(map(str, torch.cuda.nccl.version())))
    else:
        info['device'] = None
except Exception as error:  # reported, not raised: the summary says what is missing
    info['torch_error'] = repr(error)
try:
    import torchvision
    info['torchvision'] = torchvision.__version__
except Exception as error:
    info['torchvision_error'] = repr(error)
json.dump(info, sys.stdout, indent=1, sort_keys=True)
EOF
  cat "$out/environment.json" >>"$out/environment.txt"
  local device
  device=$("$python" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('device') or '')" \
    "$out/environment.json" 2>/dev/null)
  if [[ -n $device ]]; then
    record env PASS "$device, driver ${driver:-unknown}"
  elif ! "$python" -c "import torch" 2>/dev/null; then
    record env FAIL "$python cannot import torch"
  else
    local smi="no nvidia-smi"
    if command -v nvidia-smi >/dev/null; then smi="nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -1)"; fi
    record env FAIL "torch.cuda.is_available() is False; $smi"
  fi
}

# --- build: googletest from the bundle's sources, then dkfac --------------------------------------------
step_googletest() {
  local prefix=$build/_deps/prefix
  if [[ -f $prefix/lib/cmake/GTest/GTestConfig.cmake ]]; then
    record googletest PASS "built earlier, $prefix"
    return
  fi
  if [[ ! -f $bundle/src/googletest/CMakeLists.txt ]]; then
    record googletest FAIL "no $bundle/src/googletest: run scripts/gpu_bundle.sh and carry .gpu-bundle"
    return 1
  fi
  local rc=0 gtest_build=$build/_deps/googletest-build
  : >"$out/googletest.log"
  run_logged "$out/googletest.log" cmake -S "$bundle/src/googletest" -B "$gtest_build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_CXX_STANDARD=17 -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_GMOCK=ON -DINSTALL_GTEST=ON &&
    run_logged "$out/googletest.log" cmake --build "$gtest_build" --parallel "$jobs" &&
    run_logged "$out/googletest.log" cmake --install "$gtest_build" || rc=$?
  record googletest "$(result_of $rc)" "googletest $(sed -n 's/^set(GOOGLETEST_VERSION \(.*\))$/\1/p' \
    "$bundle/src/googletest/CMakeLists.txt") into $prefix; log googletest.log"
  return $rc
}

step_configure() {
  if [[ -f $build/CMakeCache.txt && -f $build/build.ninja ]]; then
    record configure PASS "configured earlier, $build (the build re-runs CMake when a CMakeLists changes)"
    return
  fi
  # The CUDA toolkit: cmake/torch.cmake takes /usr/local/cuda; else nvcc on PATH, else pip's cuda-toolkit.
  local extra=() notes=() nvcc_path=""
  if [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
    nvcc_path=$(command -v nvcc || "$python" -c "import glob, site
print(next(iter(sorted(glob.glob(site.getsitepackages()[0] + '/nvidia/*/bin/nvcc'))), ''))" 2>/dev/null)
    if [[ -n $nvcc_path ]]; then extra+=(-DCUDAToolkit_ROOT="$(dirname "$(dirname "$(realpath "$nvcc_path")")")"); fi
  fi
  # The extension needs Python's headers; without them the C++ library, tools and tests still build.
  if ! "$python" -c "import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" 2>/dev/null; then
    extra+=(-DDKFAC_BUILD_PYTHON=OFF)
    notes+=("no Python.h for $python: built without the Python extension (pytest-gpu and the benchmark cannot"
      "run dkfac)")
  fi
  # The compiler: DKFAC_GPU_CXX, else the system's c++. The GPU machine's image also has a GCC in /opt/gcc
  # (found first by CMake) that links libstdc++ statically: an extension built with it holds its own copy of
  # iostreams and locales beside torch's shared libstdc++, and crashed in its first std::ostringstream.
  local cxx=${DKFAC_GPU_CXX:-$(command -v c++ || command -v g++)}
  if [[ -n $cxx ]]; then extra+=(-DCMAKE_CXX_COMPILER="$cxx"); fi
  local rc=0
  : >"$out/configure.log"
  run_logged "$out/configure.log" cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDKFAC_PYTHON="$(command -v "$python")" \
    -DCMAKE_PREFIX_PATH="$bundle;$build/_deps/prefix" \
    -DDKFAC_GLOO_INCLUDE_DIR="$bundle/include" \
    -DZLIB_INCLUDE_DIR="$bundle/include" -DZLIB_LIBRARY="$bundle/lib/libz.a" \
    "${extra[@]}" || rc=$?
  local detail
  detail=$(grep -o -E 'dkfac: (torch|NCCL|no NCCL).*' "$out/configure.log" | sed 's/^dkfac: //' | paste -sd ';' -)
  if ((rc != 0)); then
    rm -f "$build/CMakeCache.txt"  # configure again next time
    detail="$(grep -m1 -A2 'CMake Error' "$out/configure.log" | tr '\n' ' ' | cut -c1-300)"
  fi
  record configure "$(result_of $rc)" "${detail:-no details}${notes[*]:+; ${notes[*]}}; log configure.log"
  return $rc
}

step_build() {
  no_time build 60 && return 1
  local rc=0 start=$SECONDS target_args=()
  read -r -a target_list <<<"$targets"
  if [[ $targets != all ]]; then target_args=(--target "${target_list[@]}"); fi
  : >"$out/build.log"
  run_logged "$out/build.log" cmake --build "$build" --parallel "$jobs" "${target_args[@]}" || rc=$?
  local detail="$((SECONDS - start)) s with $jobs jobs, targets: $targets; log build.log"
  if ((rc == 124 || rc == 137)); then
    detail="stopped after $((SECONDS - start)) s by the deadline: run the build stage again to continue"
  fi
  if ((rc != 0 && rc != 124 && rc != 137)); then
    detail="$(grep -m1 -E 'error|FAILED' "$out/build.log" | cut -c1-200); log build.log"
  fi
  record build "$(result_of $rc)" "$detail"
  return $rc
}

# --- test: GPU-labelled ctest tests and pytest's gpu marker ------------------------------------------------
# Summarises a JUnit file (ctest's or pytest's) into TESTS_FILE: one line per test, skip reasons included.
summarise_junit() {
  "$python" - "$1" "$2" <<'EOF'
import sys
import xml.etree.ElementTree as ET
junit, listing = sys.argv[1], sys.argv[2]
counts = {'passed': 0, 'failed': 0, 'skipped': 0}
lines = []
for case in ET.parse(junit).getroot().iter('testcase'):
    name = case.get('name')
    if case.get('classname') and case.get('classname') != name:
        name = f"{case.get('classname')}::{name}"
    output = (case.findtext('system-out') or '').strip().splitlines()
    skipped = case.find('skipped')
    if case.find('failure') is not None or case.find('error') is not None or case.get('status') == 'fail':
        result, reason = 'failed', (output[-1] if output else '')
    elif skipped is not None or case.get('status') == 'notrun' or any('[  SKIPPED ]' in l for l in output):
        # GoogleTest: "file:line: Skipped" then the reason; scripts and pytest: a line that says skip.
        said = [output[i + 1] for i, l in enumerate(output[:-1]) if l.rstrip().endswith(': Skipped')]
        said = said or [l for l in output if 'skip' in l.lower() and '[  SKIPPED ]' not in l and l.strip()]
        message = (skipped.get('message') if skipped is not None else '') or ''
        result, reason = 'skipped', said[-1] if said else message
    else:
        result, reason = 'passed', ''
    counts[result] += 1
    lines.append(f'{result:8} {name}' + (f'  -- {reason.strip()}' if reason else ''))
with open(listing, 'w') as f:
    f.write('\n'.join(lines) + '\n')
print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
EOF
}

step_ctest() {
  if [[ ! -f $build/CTestTestfile.cmake ]]; then
    record ctest-gpu FAIL "no build in $build: run the build stage first"
    return 1
  fi
  no_time ctest-gpu 30 && return 1
  local rc=0 counts
  rm -f "$out/ctest-gpu.xml"
  : >"$out/ctest-gpu.log"
  # Each test's own limit is what remains of the step's, so that ctest itself writes the JUnit file.
  DKFAC_FASHION_MNIST="$bundle/fashion-mnist" run_logged "$out/ctest-gpu.log" \
    ctest --test-dir "$build" -L gpu --output-on-failure --no-tests=error -j "$ctest_jobs" \
    --timeout "$(($(budget) - 10 > 30 ? $(budget) - 10 : 30))" \
    --output-junit "$out/ctest-gpu.xml" "${ctest_args[@]}" || rc=$?
  counts=$([[ -f $out/ctest-gpu.xml ]] && summarise_junit "$out/ctest-gpu.xml" "$out/ctest-gpu-tests.txt")
  if grep -q "No tests were found" "$out/ctest-gpu.log"; then counts="no test has the label gpu"; fi
  record ctest-gpu "$(result_of $rc)" "${counts:-no JUnit file}; every test in ctest-gpu-tests.txt, log ctest-gpu.log"
  return $rc
}

step_pytest() {
  if [[ ! -d $build/python/dkfac ]]; then
    record pytest-gpu FAIL "no $build/python/dkfac: run the build stage first"
    return 1
  fi
  no_time pytest-gpu 30 && return 1
  local rc=0 counts detail parallel=()
  if ((pytest_jobs > 1)) && "$python" -c "import xdist" 2>/dev/null; then parallel=(-n "$pytest_jobs"); fi
  rm -f "$out/pytest-gpu.xml"
  : >"$out/pytest-gpu.log"
  DKFAC_BUILD_PYTHON="$build/python" PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
    DKFAC_CPP_REFERENCE="$build/tests/dkfac_cpp_reference" DKFAC_FASHION_MNIST="$bundle/fashion-mnist" \
    run_logged "$out/pytest-gpu.log" "$python" -m pytest -m gpu -v -rs -p no:cacheprovider "${parallel[@]}" \
    --junitxml="$out/pytest-gpu.xml" "${pytest_args[@]}" tests/python || rc=$?
  counts=$([[ -f $out/pytest-gpu.xml ]] && summarise_junit "$out/pytest-gpu.xml" "$out/pytest-gpu-tests.txt")
  detail="${counts:-no JUnit file}; every test in pytest-gpu-tests.txt, log pytest-gpu.log"
  if ((rc == 5)); then detail="no test is marked gpu; log pytest-gpu.log"; fi
  record pytest-gpu "$(result_of $rc)" "$detail"
  return $rc
}

# --- the benchmarks' common start ----------------------------------------------------------------------
# bench_ready STEP MIN_S [extension]: 0 when STEP can start; else records why not and returns 2 (SKIP: no CUDA
# device, fewer than MIN_S seconds left) or 1 (FAIL: no built extension, where the step needs one).
bench_ready() {
  if [[ $bench_device == cuda ]] &&
    ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    record "$1" SKIP "no CUDA device (DKFAC_GPU_BENCH_DEVICE=cpu runs it on the CPU)"
    return 2
  fi
  if [[ ${3:-} == extension ]] && ! compgen -G "$build/python/dkfac/_C*.so" >/dev/null; then
    record "$1" FAIL "no extension in $build/python/dkfac: run the build stage first"
    return 1
  fi
  no_time "$1" "$2" SKIP && return 2
  return 0
}

# kfac_pytorch_source STEP: sets `reference` to the bundle's kfac_pytorch (--kfac-pytorch-src), empty without it.
kfac_pytorch_source() {
  reference=()
  if [[ -d $bundle/kfac-pytorch/kfac ]]; then
    reference=(--kfac-pytorch-src "$bundle/kfac-pytorch")
  else
    log "$1: no $bundle/kfac-pytorch: kfac_pytorch is left out"
  fi
}

# --- bench: bench/python_step.py on the GPU ------------------------------------------------------------
step_bench() {  # step_bench MODEL [MORE ARGUMENTS]: MORE go after DKFAC_GPU_BENCH_ARGS
  local model=$1 name=bench-$1 ready=0
  shift
  bench_ready "$name" "$bench_min" extension || ready=$?
  ((ready == 0)) || return $((ready == 1))
  local reference rc=0 limit
  limit=$(budget)
  kfac_pytorch_source "$name"
  echo "+ [timeout $limit s] bench/python_step.py --device $bench_device --models $model ${bench_args[*]} $*" \
    >"$out/$name.log"
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$limit" \
    "$python" bench/python_step.py --device "$bench_device" --models "$model" "${reference[@]}" \
    --json "$out/$name.json" --markdown "$out/$name.md" "${bench_args[@]}" "$@" \
    >"$out/$name.txt" 2>>"$out/$name.log" || rc=$?
  local verdicts
  verdicts=$(sed -n 's/^verdict: //p' "$out/$name.txt" | awk 'NR > 1 {printf " / "} {printf "%s", $0}')
  if ((rc != 0)) && [[ -z $verdicts ]]; then verdicts=$(grep -v -i warn "$out/$name.log" | tail -1 | cut -c1-200); fi
  record "$name" "$(result_of $rc)" "${verdicts:-no verdict}; table $name.md, log $name.log"
  return $rc
}

# --- bench-kinds: bench/step_kinds.py, each kind of step alone, both models, composed into both intervals ----
step_kinds() {  # step_kinds [MORE ARGUMENTS]: MORE go after DKFAC_GPU_BENCH_ARGS
  local name=bench-kinds ready=0
  bench_ready "$name" "$kinds_min" extension || ready=$?
  ((ready == 0)) || return $((ready == 1))
  local reference rc=0 limit
  limit=$(budget)
  kfac_pytorch_source "$name"
  echo "+ [timeout $limit s] bench/step_kinds.py --device $bench_device --models $kinds_models ${bench_args[*]} $*" \
    >"$out/$name.log"
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$limit" \
    "$python" bench/step_kinds.py --device "$bench_device" --models "$kinds_models" "${reference[@]}" \
    --json "$out/$name.json" --markdown "$out/$name.md" "${bench_args[@]}" "$@" \
    >"$out/$name.txt" 2>>"$out/$name.log" || rc=$?
  local ratios
  ratios=$(sed -n -E 's/^  ([a-z0-9]+) \(([0-9]+,[0-9]+)\):.*overhead ratio dkfac \/ kfac_pytorch ([0-9.]+).*/\1 (\2) overhead ratio \3/p' \
    "$out/$name.txt" | paste -sd ';' -)
  if ((rc != 0)) && [[ -z $ratios ]]; then ratios=$(grep -v -i warn "$out/$name.log" | tail -1 | cut -c1-200); fi
  record "$name" "$(result_of $rc)" "${ratios:-no ratio}; report $name.txt, table $name.md, log $name.log"
  return $rc
}

# --- kernel-probe: bench/kernel_probe.py, the step's kernels alone (GEMM widths, eigh against its refresh,
# eigh backends and streams; the refresh through the built extension) ---
step_probe() {
  local name=kernel-probe ready=0
  bench_ready "$name" "$probe_min" || ready=$?
  ((ready == 0)) || return $((ready == 1))
  local rc=0 limit
  limit=$(budget)
  echo "+ [timeout $limit s] bench/kernel_probe.py --device $bench_device --budget-s $((limit - 30))" >"$out/$name.log"
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$limit" \
    "$python" bench/kernel_probe.py --device "$bench_device" --budget-s "$((limit - 30))" --json "$out/$name.json" >"$out/$name.txt" 2>>"$out/$name.log" || rc=$?
  record "$name" "$(result_of $rc)" "$(grep -c . "$out/$name.txt") lines; report $name.txt, $name.json"
  return $rc
}

# run_bench_script NAME SCRIPT ARG...: bench/SCRIPT against the built extension, its report as NAME.txt and .json.
run_bench_script() {
  local name=$1 script=$2 ready=0
  shift 2
  bench_ready "$name" "$fast_min" extension || ready=$?
  ((ready == 0)) || return $((ready == 1))
  local rc=0 limit
  limit=$(budget)
  echo "+ [timeout $limit s] bench/$script --device $bench_device $*" >"$out/$name.log"
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$limit" \
    "$python" "bench/$script" --device "$bench_device" "$@" --json "$out/$name.json" \
    >"$out/$name.txt" 2>>"$out/$name.log" || rc=$?
  record "$name" "$(result_of $rc)" "$(grep -c . "$out/$name.txt") lines; report $name.txt, $name.json"
  return $rc
}

# --- fast-error: bench/fast_mode_error.py, each fast mode's error against the exact mode ----------------------
step_fast() { run_bench_script fast-error fast_mode_error.py "${fast_args[@]}"; }

# --- lag-step: bench/second_order_lag.py, training steps with second_order_lag against exact ------------------
step_lag() { run_bench_script lag-step second_order_lag.py "${lag_args[@]}"; }

# --- launches: bench/step_launches.py, what a step without updates launches, eager and with cuda_graphs ---------
step_launches() { run_bench_script launches step_launches.py "${launch_args[@]}"; }

# --- compile-step: bench/compile_step.py, torch.compile against eager, with and without dkfac ------------------
step_compile() { run_bench_script compile-step compile_step.py "${compile_args[@]}"; }

# --- transformer: bench/transformer_vs_adamw.py on the GPU, eigen_adam against AdamW (issue 45) ---------------
# The GPU machine's python3 has torch and numpy; transformers and the modules it imports come as wheels in the
# bundle (scripts/gpu_bundle.sh), unpacked here into the build directory where python3 cannot import it.
step_transformer() {
  local ready=0
  bench_ready transformer "$transformer_min" extension || ready=$?
  ((ready == 0)) || return $((ready == 1))
  local site=$build/bundle-site
  if "$python" -c "import transformers" 2>/dev/null; then
    site=
  elif compgen -G "$bundle/wheels/*.whl" >/dev/null; then
    "$python" - "$site" "$bundle"/wheels/*.whl <<'EOF' >>"$out/transformer.log" 2>&1
import sys, zipfile
for wheel in sys.argv[2:]:  # a wheel is a zip of its files as installed: unpacked, its folder is importable
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
    if ! PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 "$python" -c "import transformers" \
      >>"$out/transformer.log" 2>&1; then
      record transformer FAIL "transformers from $bundle/wheels does not import: transformer.log"
      return 1
    fi
  else
    record transformer SKIP "$python has no transformers and $bundle has no wheels (scripts/gpu_bundle.sh)"
    return 0
  fi
  local rc=0 limit
  limit=$(budget)
  echo "+ [timeout $limit s] bench/transformer_vs_adamw.py --device $bench_device ${transformer_args[*]}" \
    >>"$out/transformer.log"
  PYTHONPATH="$build/python${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 \
    timeout --kill-after=10 "$limit" "$python" bench/transformer_vs_adamw.py --device "$bench_device" \
    "${transformer_args[@]}" --out "$out/transformer" >"$out/transformer.txt" 2>>"$out/transformer.log" || rc=$?
  record transformer "$(result_of $rc)" \
    "$(grep -c . "$out/transformer.txt") lines; report transformer.txt, folder transformer/"
  return $rc
}

# --- summary -------------------------------------------------------------------------------------------
write_summary() {
  local file=$out/summary.md
  {
    echo "# dkfac GPU check"
    echo
    "$python" - "$out/environment.json" <<'EOF' 2>/dev/null || echo "(no environment.json)"
import json, sys
e = json.load(open(sys.argv[1]))
print(f"- device: {e.get('device') or 'no CUDA device'} ({e.get('device_count', 0)} visible, "
      f"capability {e.get('capability', '-')}, {e.get('device_memory_gib', '-')} GiB)")
print(f"- torch {e.get('torch', '-')}, CUDA {e.get('cuda', '-')}, driver {e.get('driver') or '-'}, "
      f"cuDNN {e.get('cudnn', '-')}, NCCL {e.get('nccl', '-')}, torchvision {e.get('torchvision', '-')}")
print(f"- Python {e.get('python')}, {e.get('cores')} cores, {e.get('platform')}")
EOF
    local changed
    changed=$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null | wc -l)
    echo "- commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
      "(the working tree differs from it in $changed tracked files); build: $build; bundle: $bundle"
    echo
    echo "| step | result | detail | at (UTC) |"
    echo "|---|---|---|---|"
    local step
    for step in "${steps[@]}"; do
      if [[ -f $out/status/$step.tsv ]]; then
        local name result detail at
        IFS=$'\t' read -r name result detail at <"$out/status/$step.tsv"
        echo "| $name | $result | ${detail//|/\\|} | $at |"
      else
        echo "| $step | not run | | |"
      fi
    done
  } >"$file"
  local tables=("$out"/bench-resnet50.md "$out"/bench-bert.md) present=()
  local t
  for t in "${tables[@]}"; do [[ -f $t ]] && present+=("$t"); done
  if ((${#present[@]} > 0)); then cat "${present[@]}" >"$out/bench-gpu.md"; fi
  cat "$file"
}

run_build() { step_googletest && step_configure && step_build; }
# ctest and pytest side by side (one GPU, 139 GiB: the tests are small); each records its own row.
run_test() {
  step_ctest &
  local ctest_pid=$!
  step_pytest &
  local pytest_pid=$!
  wait "$ctest_pid"
  wait "$pytest_pid"
}
run_bench() { step_bench resnet50 "$@"; step_bench bert "$@"; }

case $stage in
  build | ctest | pytest | test | bench-kinds | launches | kernel-probe | compile-step | fast-error | lag-step | \
    transformer | \
    bench-resnet50 | bench-bert | bench | all | call1 | call2) step_env ;;
  summary) ;;
  *) echo "usage: $0 [call1|call2|build|ctest|pytest|test|bench-kinds|launches|kernel-probe|compile-step|" \
       "fast-error|lag-step|" \
       "transformer|" \
       "bench-resnet50|bench-bert|bench|all|summary]" \
       "[OUT_DIR]" >&2
     exit 2 ;;
esac
log "stage $stage${deadline:+, deadline $deadline s}, results in $out"
case $stage in
  build) run_build ;;
  ctest) step_ctest ;;
  pytest) step_pytest ;;
  test) run_test ;;
  bench-kinds) step_kinds ;;
  kernel-probe) step_probe ;;
  fast-error) step_fast ;;
  compile-step) step_compile ;;
  lag-step) step_lag ;;
  launches) step_launches ;;
  transformer) step_transformer ;;
  bench-resnet50) step_bench resnet50 ;;
  bench-bert) step_bench bert ;;
  bench) run_bench ;;
  all) run_build && run_test; step_kinds; run_bench ;;
  call1) run_build && { run_test; step_kinds; step_probe; } ;;
  call2)
    run_build && { step_pytest; step_kinds; step_launches; step_compile; step_fast; step_lag; step_transformer; } ;;
esac
write_summary
export_results
log "results in $out${DKFAC_GPU_EXPORT:+; summary.md and gpu-results.tar.gz in $DKFAC_GPU_EXPORT}"
# The exit status: 1 if any step recorded FAIL or TIMEOUT (steps run side by side record in their own shells).
! grep -q -E $'\t(FAIL|TIMEOUT)\t' "$out"/status/*.tsv 2>/dev/null
