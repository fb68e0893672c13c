#!/usr/bin/env bash
# Diagnoses crashes and wrong numbers seen by scripts/gpu_check.sh on the GPU machine (issue 32): builds like
# gpu_check.sh's build stage, then gathers backtraces (cuda-gdb, which also debugs host code) and reruns failing
# tests under narrower conditions, each with its own timeout; output in OUT_DIR (default gpu-diagnose).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${1:-gpu-diagnose}
mkdir -p "$out"
export DKFAC_GPU_DEADLINE_S=${DKFAC_GPU_DEADLINE_S:-200}
scripts/gpu_check.sh build "$out/check" >"$out/build.txt" 2>&1
build=${DKFAC_GPU_BUILD_DIR:-build-gpu}
py=${DKFAC_GPU_PYTHON:-python3}
section() { echo; echo "===== $*"; }
{
  section "python import"
  timeout 60 env PYTHONPATH="$build/python" "$py" -X faulthandler -c "import torch, dkfac; print('import ok', dkfac.__file__)" 2>&1 | tail -5
  section "python import with the system libstdc++ preloaded"
  lib=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  echo "libstdc++: $lib; g++'s: $(g++ -print-file-name=libstdc++.so.6)"
  timeout 60 env LD_PRELOAD="$lib" PYTHONPATH="$build/python" "$py" -c "import torch, dkfac; print('import ok')" 2>&1 | tail -3
  section "ldd of the extension"
  ldd "$build"/python/dkfac/_C*.so | head -20
  section "cuda-gdb backtrace of the import"
  timeout 120 env PYTHONPATH="$build/python" cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args "$py" -c "import torch, dkfac" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | head -80
  section "one failing equivalence test, as is / 2 cores / 1 thread"
  t=$build/tests/dkfac_tests
  f='Grid/KaisaEquivalence.MatchesSingleProcessReference/P2MemOptEigenFull'
  DKFAC_TEST_DEVICE=cuda timeout 60 "$t" --gtest_filter="$f" 2>&1 | grep -E "OK|FAILED|relative error" | head -4
  DKFAC_TEST_DEVICE=cuda timeout 60 taskset -c 0,1 "$t" --gtest_filter="$f" 2>&1 | grep -E "OK|FAILED|relative error" | head -4
  DKFAC_TEST_DEVICE=cuda OMP_NUM_THREADS=1 timeout 60 "$t" --gtest_filter="$f" 2>&1 | grep -E "OK|FAILED|relative error" | head -4
  DKFAC_TEST_DEVICE=cpu timeout 60 "$t" --gtest_filter="$f" 2>&1 | grep -E "OK|FAILED|relative error" | head -4
  section "dkfac train --nproc 2 --device cpu (the crash of gpu_backends' cpu2 run), 3 tries"
  for i in 1 2 3; do
    timeout 60 "$build/dkfac" train --nproc 2 --device cpu --dataset synthetic --model cnn --epochs 1 --max-steps 20 \
      --factor-update-steps 2 --inv-update-steps 8 >"$out/train$i.txt" 2>&1; echo "try $i: exit $?"; tail -2 "$out/train$i.txt"
  done
  section "rank 1 of the same job under cuda-gdb (rank 0 plain)"
  port=29877
  common=(train --device cpu --dataset synthetic --model cnn --epochs 1 --max-steps 20 --factor-update-steps 2 --inv-update-steps 8)
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 90 "$build/dkfac" "${common[@]}" >"$out/rank0.txt" 2>&1 &
  RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 90 cuda-gdb -q -batch -ex run -ex bt \
    --args "$build/dkfac" "${common[@]}" 2>&1 | grep -v "^\[New Thread\|^\[Thread\|^\[Detaching" | tail -60
  wait
  tail -3 "$out/rank0.txt"
} >"$out/diagnose.txt" 2>&1
cat "$out/diagnose.txt"
