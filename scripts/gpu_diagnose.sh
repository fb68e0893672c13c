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
  section "thread-rank equivalence on CUDA: two cases under each DKFAC_TEST_DIAG switch (tests/test_util.h)"
  f='Grid/KaisaEquivalence.MatchesSingleProcessReference/P2MemOptEigenFull:Grid/KaisaEquivalence.MatchesSingleProcessReference/P2CommOptEigenFull'
  for env in "" "CUDA_LAUNCH_BLOCKING=1" "DKFAC_TEST_DIAG=serial_backward" "DKFAC_TEST_DIAG=rank_stream" \
             "DKFAC_TEST_DIAG=sync" "DKFAC_TEST_DIAG=in_step" "DKFAC_TEST_DIAG=in_step,serial_backward" \
             "DKFAC_TEST_DIAG=serial_backward,rank_stream"; do
    echo "-- ${env:-as is}"
    # shellcheck disable=SC2086 # the words of $env are separate assignments
    timeout 60 env DKFAC_TEST_DEVICE=cuda $env "$t" --gtest_filter="$f" >"$out/case.txt" 2>&1
    grep -E "^\[ *(OK|FAILED) *\]" "$out/case.txt" | head -2
    grep -E -A1 "relative error" "$out/case.txt" | grep -E "^rank|relative" | head -6
  done
  section "bfloat16 storage: which operation differs between CPU and CUDA (errors against float64)"
  timeout 90 "$py" - <<'PY' 2>&1 | tail -20
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
gen = torch.Generator().manual_seed(0)
bf = torch.bfloat16
x = torch.randn(256, 76, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, 76, dtype=torch.float64)
y = torch.randn(256, 6, generator=gen, dtype=torch.float64)
grad = torch.randn(6, 76, generator=gen, dtype=torch.float64)
damping = 0.01
def factor(t, dtype, dev):
    t = t.to(dtype).to(dev)
    return (t.t() @ t / t.size(0)).double().cpu()
def precondition(a, g, dtype, eig_dev, mm_dev, store=bf):
    la, qa = torch.linalg.eigh(a.to(eig_dev)); lg, qg = torch.linalg.eigh(g.to(eig_dev))
    qa, la, qg, lg = [v.to(store).to(mm_dev) for v in (qa, la.clamp_min(0), qg, lg.clamp_min(0))]
    den = torch.outer(lg, la).add_(damping).reciprocal_()
    r = torch.mm(torch.mm(qg.t(), grad.to(store).to(mm_dev)), qa)
    r.mul_(den)
    return torch.mm(torch.mm(qg, r), qa.t()).double().cpu()
rel = lambda u, v: ((u - v).norm() / v.norm()).item()
A, G = factor(x, torch.float64, 'cpu'), factor(y, torch.float64, 'cpu')
exact = precondition(A, G, torch.float64, 'cpu', 'cpu', store=torch.float64)
for dev in ('cpu', 'cuda'):
    print(f'bf16 factor on {dev}: A {rel(factor(x, bf, dev), A):.2e}, G {rel(factor(y, bf, dev), G):.2e}')
for eig_dev in ('cpu', 'cuda'):
    for mm_dev in ('cpu', 'cuda'):
        got = precondition(A, G, torch.float64, eig_dev, mm_dev)
        print(f'eigh float64 on {eig_dev}, bf16 state and products on {mm_dev}: {rel(got, exact):.4f}')
for dev in ('cpu', 'cuda'):
    a = torch.randn(64, 64, generator=gen).to(bf); b = torch.randn(64, 64, generator=gen).to(bf)
    e = a.double() @ b.double()
    print(f'bf16 mm on {dev}: {rel((a.to(dev) @ b.to(dev)).double().cpu(), e):.2e}',
          f'elementwise mul: {rel((a.to(dev) * b.to(dev)).double().cpu(), a.double() * b.double()):.2e}')
PY
  section "bfloat16 eigen storage through dkfac: each step's error against float64, CPU and CUDA"
  timeout 90 env PYTHONPATH="$build/python:tests/python" "$py" - <<'PY' 2>&1 | tail -12
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
from test_gpu import train
reference = train('cpu', torch.float64)
for kw in ({'factor_dtype': torch.bfloat16, 'inv_dtype': torch.bfloat16}, {'inv_dtype': torch.bfloat16},
           {'factor_dtype': torch.bfloat16}):
    for device in ('cpu', 'cuda'):
        got = train(device, torch.float32, **kw)
        errors = [max(((a - b).norm() / b.norm()).item() for a, b in zip(g, e)) for g, e in zip(got, reference)]
        print(device, sorted(k for k in kw), 'largest relative error per step:', ' '.join(f'{x:.4f}' for x in errors))
PY

  section "dkfac train --nproc 2 --device cpu (the rank-1 segfault): as is, GPU hidden, one OpenMP thread; core dumps"
  ulimit -c unlimited
  cores=$(realpath "$out")/cores
  mkdir -p "$cores"
  echo "$cores/core.%e.%p" >/proc/sys/kernel/core_pattern 2>/dev/null || echo "core_pattern not writable"
  for env in "" "CUDA_VISIBLE_DEVICES=" "OMP_NUM_THREADS=1"; do
    # shellcheck disable=SC2086 # the words of $env are separate assignments
    timeout 40 env $env "$build/dkfac" train --nproc 2 --device cpu --dataset synthetic --model cnn --epochs 1 \
      --max-steps 20 --factor-update-steps 2 --inv-update-steps 8 >"$out/train.txt" 2>&1
    echo "-- ${env:-as is}: exit $?: $(tail -1 "$out/train.txt" | cut -c1-200)"
  done
  for core in $(ls "$cores"/core.* 2>/dev/null | head -1); do
    [[ -f $core ]] || continue
    echo "-- $core"
    timeout 40 cuda-gdb -q -batch -ex "thread apply all bt 12" "$build/dkfac" "$core" 2>&1 | grep -E "^#|^Thread" | head -80
  done
  rm -f "$cores"/core.*
} >"$out/diagnose.txt" 2>&1
cat "$out/diagnose.txt"
