#!/usr/bin/env bash
# `dkfac train --device cuda` with each backend (issue 24; ctest -L gpu), on one visible GPU
# (CUDA_VISIBLE_DEVICES=0): --nproc 2 refused without --backend gloo, naming 2 ranks and 1 GPU; a one-rank NCCL
# job and two ranks sharing the GPU through Gloo, each against the same job on the CPU; checkpoints moving
# between the CPU and the GPU; a CUDA out-of-memory error naming the phase and the memory asked for, the
# checkpoint written before it kept. Skipped (exit 77, with the reason) without a CUDA device.
set -euo pipefail
dkfac="$1"
# One GPU, so that two ranks share it: the first visible one (an empty CUDA_VISIBLE_DEVICES stays empty: skipped).
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-0}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES%%,*}"

source "$(dirname "$0")/lib.sh"  # fail, scratch_dir, has, require_cuda
scratch_dir
require_cuda "$dkfac"

# CPU and GPU round differently (MKL against cuDNN/cuBLAS, float32): the first step's loss (same weights, same
# batch) agrees closely, the next ones drift apart slowly.
first_rtol=1e-4
rtol=1e-2
short=(--dataset synthetic --model cnn --epochs 1 --log-every 1 --factor-update-steps 2 --inv-update-steps 8)
train() {  # train NAME FLAGS...: runs dkfac train, metrics in $tmp/NAME.jsonl, output in $tmp/NAME.txt
  local name=$1; shift
  "$dkfac" train "$@" --metrics "$tmp/$name.jsonl" > "$tmp/$name.txt" 2>&1 || { cat "$tmp/$name.txt"; fail "$name run"; }
}
# check_gpu_summary FILE BACKEND RANKS: the run event names the backend; every rank's GPU peak is in the summary.
check_gpu_summary() {
  python3 - "$@" <<'PY' || fail "metrics of $1"
import json, sys
path, backend, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
events = [json.loads(line) for line in open(path)]
assert events[0]['cuda_backend'] == backend, events[0]
summary = events[-1]
assert summary['gpu_max_memory_allocated_bytes'] > 0, summary
assert [r['rank'] for r in summary['ranks']] == list(range(ranks)), summary['ranks']
for rank in summary['ranks']:
    assert rank['gpu_max_memory_allocated_bytes'] > 0, rank
    assert rank['comm_bytes']['data_parallel'] > 0, rank  # the gradients went through the group
print(f"{path.rsplit('/', 1)[-1]}: {backend}, GPU peaks "
      + ", ".join(f"rank {r['rank']} {r['gpu_max_memory_allocated_bytes'] / 2**20:.1f} MiB" for r in summary['ranks']))
PY
}

echo "== --nproc 2 --device cuda on one GPU: refused, naming 2 ranks and 1 GPU, unless --backend gloo"
set +e
"$dkfac" train --nproc 2 --device cuda "${short[@]}" --max-steps 2 > "$tmp/refused.txt" 2>&1
rc=$?
set -e
[[ $rc == 1 ]] || { cat "$tmp/refused.txt"; fail "exit $rc, not 1"; }
has "--nproc 2 --device cuda needs 2 GPUs (one per rank), but this machine has 1 visible CUDA device" "$tmp/refused.txt"
has "--backend gloo" "$tmp/refused.txt"

echo "== one rank over NCCL against one CPU process"
train cpu1 --device cpu "${short[@]}" --max-steps 40
train nccl --device cuda --backend nccl "${short[@]}" --max-steps 40
has ", device cuda:0 (CUDA collectives: nccl)" "$tmp/nccl.txt"
compare_runs "$tmp/cpu1.jsonl" "$tmp/nccl.jsonl" --steps 40 --first-rtol $first_rtol --rtol $rtol
check_gpu_summary "$tmp/nccl.jsonl" nccl 1

echo "== two ranks sharing one GPU through Gloo against two CPU ranks"
# Two ranks split the synthetic epoch: 32 steps each, so 30 of them.
train cpu2 --nproc 2 --device cpu "${short[@]}" --max-steps 30
train gloo --nproc 2 --device cuda --backend gloo "${short[@]}" --max-steps 30
has ", device cuda:0 (CUDA collectives: gloo)" "$tmp/gloo.txt"
compare_runs "$tmp/cpu2.jsonl" "$tmp/gloo.jsonl" --steps 30 --first-rtol $first_rtol --rtol $rtol
check_gpu_summary "$tmp/gloo.jsonl" gloo 2

echo "== a CPU checkpoint resumes on the GPU, a GPU checkpoint on the CPU"
train straight --device cpu "${short[@]}" --max-steps 40
for path in cpu-cuda cuda-cpu; do
  first=${path%-*} second=${path#*-}
  "$dkfac" train --device $first "${short[@]}" --max-steps 20 --checkpoint-dir "$tmp/$path" \
    --metrics "$tmp/$path.jsonl" > "$tmp/$path.txt" 2>&1 || { cat "$tmp/$path.txt"; fail "$path: first half"; }
  "$dkfac" train --device $second "${short[@]}" --max-steps 40 --checkpoint-dir "$tmp/$path" --resume \
    --metrics "$tmp/$path.jsonl" > "$tmp/$path.txt" 2>&1 || { cat "$tmp/$path.txt"; fail "$path: second half"; }
  has "resume: $tmp/$path/checkpoint.pt (step 20" "$tmp/$path.txt"
  echo -n "$first -> $second: "
  compare_runs "$tmp/straight.jsonl" "$tmp/$path.jsonl" --steps 40 --first-rtol $first_rtol --rtol $rtol
done

echo "== CUDA out of memory: the phase and the memory asked for, exit 1, the checkpoint kept"
big=(--dataset synthetic --model cnn --epochs 1 --batch-size 2048 --log-every 1)
"$dkfac" train --device cuda "${big[@]}" --max-steps 2 --checkpoint-dir "$tmp/oom" > "$tmp/oom.txt" 2>&1 \
  || { cat "$tmp/oom.txt"; fail "the uncapped run"; }
# About 80 MiB allowed on an 80 GB GPU; the first convolution's output alone is 2048 x 32 x 28 x 28 x 4 B = 196 MiB.
set +e
PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:0.001 "$dkfac" train --device cuda "${big[@]}" --max-steps 4 \
  --checkpoint-dir "$tmp/oom" --resume > "$tmp/oom.txt" 2>&1
rc=$?
set -e
cat "$tmp/oom.txt"
[[ $rc == 1 ]] || fail "exit $rc after running out of memory, not 1"
has "dkfac: error: the forward and backward pass of step 3 (epoch 1), micro-batch 1 of 1 (2048 examples on cuda:0) ran out of device memory: " "$tmp/oom.txt"
has "Tried to allocate" "$tmp/oom.txt"
"$dkfac" train --device cuda "${big[@]}" --max-steps 4 --checkpoint-dir "$tmp/oom" --resume > "$tmp/oom.txt" 2>&1 \
  || { cat "$tmp/oom.txt"; fail "resuming after the out-of-memory error"; }
has "resume: $tmp/oom/checkpoint.pt (step 2" "$tmp/oom.txt"
echo "5 passed, 0 failed"
