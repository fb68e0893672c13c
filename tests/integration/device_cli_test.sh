#!/usr/bin/env bash
# `dkfac train --device` and `--backend` where they can be checked without a GPU (issue 24): the choices and
# their refusals, --device cuda and --nproc 2 --device cuda refused with a message and a non-zero exit on a
# machine without one, --device auto training exactly as --device cpu there, and a CPU checkpoint resumed under
# --device auto. tests/integration/gpu_*_test.sh check the same flags on a GPU (ctest -L gpu).
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"  # fail, scratch_dir, refused, has, lacks, auto_device
scratch_dir
short=(--dataset synthetic --model mlp --epochs 1 --log-every 1 --factor-update-steps 2 --inv-update-steps 4)

echo "== --device and --backend take their choices, name the flag otherwise"
refused 105 --device gpu
has "--device must be one of cpu, cuda, auto, got 'gpu'"
refused 105 --backend mpi
has "--backend must be one of auto, nccl, gloo, got 'mpi'"
refused 105 --backend nccl --max-steps 1
has "--backend nccl carries CUDA tensors, but --device cpu trains on the CPU"
"$dkfac" train --help > "$tmp/out"
has "--device TEXT=cpu"
has "--backend TEXT=auto"

device=$(auto_device "$dkfac")
echo "dkfac train --device auto chooses '$device' here"
[[ "$device" == cpu || "$device" == cuda* ]] || fail "--device auto chose '$device'"
if [[ "$device" == cuda* ]]; then
  echo "a CUDA device is visible: the GPU-less checks below are skipped (ctest -L gpu runs the GPU tests)"
  echo "1 passed, 0 failed"
  exit 0
fi

echo "== --device cuda without a GPU: a message and exit 1, nothing trained"
refused 1 --device cuda "${short[@]}" --max-steps 2 --metrics "$tmp/never.jsonl"
has "dkfac: error: --device cuda was asked for, but LibTorch sees no CUDA device"
lacks "train: model"
[[ ! -e "$tmp/never.jsonl" ]] || fail "a metrics file was written"
refused 1 --device auto --backend nccl "${short[@]}" --max-steps 2
has "--backend nccl carries CUDA tensors, but --device auto found no CUDA device"

echo "== --nproc 2 --device cuda without a GPU: refused by the launcher before any worker starts"
start=$(date +%s)
refused 1 --nproc 2 --device cuda "${short[@]}" --max-steps 2
has "dkfac: error: --nproc 2 --device cuda: LibTorch sees no CUDA device on this machine"
lacks "rank 0"
refused 1 --nproc 2 --device cuda --backend gloo "${short[@]}" --max-steps 2
has "--nproc 2 --device cuda: LibTorch sees no CUDA device"
(( $(date +%s) - start < 30 )) || fail "the refusals took $(( $(date +%s) - start )) s"

echo "== --device auto without a GPU trains exactly as --device cpu (1 and 2 processes)"
for nproc in 1 2; do
  "$dkfac" train --nproc $nproc "${short[@]}" --max-steps 12 --metrics "$tmp/cpu$nproc.jsonl" > "$tmp/out" 2>&1 \
    || { cat "$tmp/out"; fail "--device cpu run"; }
  has ", device cpu"
  "$dkfac" train --nproc $nproc --device auto "${short[@]}" --max-steps 12 --metrics "$tmp/auto$nproc.jsonl" \
    > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "--device auto run"; }
  has ", device cpu"
  lacks "GPU memory"
  echo -n "--nproc $nproc: "
  compare_runs "$tmp/cpu$nproc.jsonl" "$tmp/auto$nproc.jsonl" --steps 12 --same-parameters
done
python3 - "$tmp/auto2.jsonl" <<'PY' || fail "GPU fields or a wrong device in a CPU run's metrics"
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
run = events[0]
assert run['device'] == 'cpu' and run['options']['device'] == 'auto', run
assert 'cuda_backend' not in run, run
for event in events:
    for key in event:
        assert not key.startswith('gpu_'), (key, event)
for rank in events[-1]['ranks']:
    assert not any(key.startswith('gpu_') for key in rank), rank
PY

echo "== a --device cpu checkpoint resumes under --device auto on the same trajectory"
"$dkfac" train "${short[@]}" --max-steps 12 --metrics "$tmp/straight.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "straight run"; }
"$dkfac" train --device cpu "${short[@]}" --max-steps 6 --checkpoint-dir "$tmp/ck" --metrics "$tmp/resumed.jsonl" \
  > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "first half"; }
"$dkfac" train --device auto "${short[@]}" --max-steps 12 --checkpoint-dir "$tmp/ck" --resume \
  --metrics "$tmp/resumed.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "resumed half"; }
has "resume: $tmp/ck/checkpoint.pt (step 6"
compare_runs "$tmp/straight.jsonl" "$tmp/resumed.jsonl" --steps 12 --same-parameters
echo "6 passed, 0 failed"
