#!/usr/bin/env bash
# Diagnoses what scripts/gpu_check.sh found failing on the GPU machine (issue 32, docs/GPU.md): builds like
# gpu_check.sh's build stage, then reruns the failing cases under narrower conditions and gathers backtraces
# (cuda-gdb, which also debugs host code, reading core files), each with its own timeout. One device-tool call:
#
#   DKFAC_GPU_DEADLINE_S=200 scripts/gpu_diagnose.sh $OUT/diag      (carry .gpu-bundle; about 4 minutes)
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${1:-gpu-diagnose}
mkdir -p "$out"
export DKFAC_GPU_DEADLINE_S=${DKFAC_GPU_DEADLINE_S:-200}
scripts/gpu_check.sh build "$out/check" >"$out/build.txt" 2>&1
build=${DKFAC_GPU_BUILD_DIR:-build-gpu}
py=${DKFAC_GPU_PYTHON:-python3}
t=$build/tests/dkfac_tests
section() { echo; echo "===== $*"; }
{
  section "python import"
  timeout 60 env PYTHONPATH="$build/python" "$py" -c "import torch, dkfac; print('import ok', dkfac.__file__)" 2>&1 | tail -3

  section "thread-rank equivalence on CUDA: one case, as is / CUDA_LAUNCH_BLOCKING=1 / on the CPU"
  f='Grid/KaisaEquivalence.MatchesSingleProcessReference/P2MemOptEigenFull'
  for env in "DKFAC_TEST_DEVICE=cuda" "DKFAC_TEST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1" "DKFAC_TEST_DEVICE=cpu"; do
    echo "-- $env"
    # shellcheck disable=SC2086 # the words of $env are separate assignments
    timeout 60 env $env "$t" --gtest_filter="$f" 2>&1 | grep -E "^\[ *(OK|FAILED) *\]|relative error" | head -3
  done
  section "every 2-rank case of the data-parallel test alone, one at a time (did -j 4 matter?)"
  DKFAC_TEST_DEVICE=cuda timeout 90 "$t" --gtest_filter='Methods/DpEquivalence.*' 2>&1 | grep -E "^\[ *(OK|FAILED) *\]" | head -8

  section "bfloat16 eigen storage: each step's error against float64, CPU and CUDA"
  timeout 90 env PYTHONPATH="$build/python:tests/python" "$py" - <<'PY' 2>&1 | tail -12
import torch
from test_gpu import train
reference = train('cpu', torch.float64)
for device in ('cpu', 'cuda'):
    got = train(device, torch.float32, factor_dtype=torch.bfloat16, inv_dtype=torch.bfloat16)
    errors = [max(((a - b).norm() / b.norm()).item() for a, b in zip(g, e)) for g, e in zip(got, reference)]
    print(device, 'bfloat16 storage, largest relative error per step:', ' '.join(f'{x:.4f}' for x in errors))
PY

  section "dkfac train --nproc 2 --device cpu with core dumps (the rank-1 segfault)"
  ulimit -c unlimited
  cores=$(realpath "$out")/cores
  mkdir -p "$cores"
  echo "$cores/core.%e.%p" >/proc/sys/kernel/core_pattern 2>/dev/null || echo "core_pattern not writable"
  timeout 60 "$build/dkfac" train --nproc 2 --device cpu --dataset synthetic --model cnn --epochs 1 --max-steps 20 \
    --factor-update-steps 2 --inv-update-steps 8 >"$out/train.txt" 2>&1
  echo "exit $?"; tail -2 "$out/train.txt"
  for core in "$cores"/core.*; do
    [[ -f $core ]] || continue
    echo "-- $core"
    timeout 90 cuda-gdb -q -batch -ex "thread apply all bt 12" "$build/dkfac" "$core" 2>&1 | grep -E "^#|^Thread" | head -80
  done
  rm -f "$cores"/core.*
} >"$out/diagnose.txt" 2>&1
cat "$out/diagnose.txt"
