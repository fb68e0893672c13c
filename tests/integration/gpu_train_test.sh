#!/usr/bin/env bash
# `dkfac train --device cuda` on Fashion-MNIST (issue 24; ctest -L gpu): one epoch of the cnn on the GPU reaches
# the accuracy of the same run on the CPU within 1 percentage point, and its metrics and summary carry the GPU
# memory (absent from the CPU run's). Skipped (exit 77, with the reason) without a CUDA device or the dataset;
# the dataset directory is $DKFAC_FASHION_MNIST (default /usr/share/datasets/fashion-mnist).
set -euo pipefail
dkfac="$1"
data="${DKFAC_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}"
source "$(dirname "$0")/lib.sh"  # fail, scratch_dir, require_cuda
scratch_dir
require_cuda "$dkfac"
if ! compgen -G "$data/train-images-idx3-ubyte*" > /dev/null; then
  echo "SKIPPED: Fashion-MNIST not found in $data (set DKFAC_FASHION_MNIST to its directory)"
  exit 77
fi

# The README's recipe (cnn, K-FAC, batch 128), one epoch.
run=(--model cnn --dataset fashion-mnist --data-dir "$data" --epochs 1 --log-every 50)
for device in cpu cuda; do
  echo "== one epoch of the cnn on $device"
  "$dkfac" train --device $device "${run[@]}" --metrics "$tmp/$device.jsonl" > "$tmp/$device.txt" 2>&1 \
    || { cat "$tmp/$device.txt"; fail "--device $device run"; }
  grep -E '^(train|epoch 1/1:|summary):' "$tmp/$device.txt"
done
grep -q ', device cuda:0' "$tmp/cuda.txt" || fail "the train line does not name cuda:0"
grep -q '^summary: .*, GPU memory peak [0-9.]* [KMG]iB on cuda:0$' "$tmp/cuda.txt" || fail "no GPU memory in the summary line"
! grep -q 'GPU memory' "$tmp/cpu.txt" || fail "GPU memory in the CPU run's summary"

python3 - "$tmp/cpu.jsonl" "$tmp/cuda.jsonl" <<'PY' || fail "accuracy or metrics"
import json, sys
cpu, cuda = ([json.loads(line) for line in open(path)] for path in sys.argv[1:])
tolerance = 0.01  # 1 percentage point: float32 rounding of cuDNN/cuBLAS against MKL, over 468 steps
a, b = cpu[-1]['final_test_accuracy'], cuda[-1]['final_test_accuracy']
print(f"final test accuracy: cpu {100 * a:.2f}%, cuda {100 * b:.2f}% (difference {100 * abs(a - b):.2f} points, "
      f"allowed {100 * tolerance:.0f})")
assert abs(a - b) <= tolerance, (a, b)
assert b > 0.8, f"the cuda run learned too little: {b}"
run = cuda[0]
assert run['device'] == 'cuda:0' and run['options']['device'] == 'cuda', run
assert run['machine']['cuda_devices'] >= 1, run['machine']
fields = ('gpu_memory_allocated_bytes', 'gpu_max_memory_allocated_bytes', 'gpu_memory_reserved_bytes')
kinds = {'step': 0, 'epoch': 0, 'summary': 0}
for event in cuda:
    if event['event'] not in kinds:
        continue
    kinds[event['event']] += 1
    allocated, peak, reserved = (event[f] for f in fields)
    assert 0 < allocated <= peak and allocated <= reserved, event
assert all(kinds.values()), kinds
print(f"GPU memory in {kinds}: peak {cuda[-1]['gpu_max_memory_allocated_bytes'] / 2**20:.1f} MiB")
for event in cpu:
    assert not any(key.startswith('gpu_') for key in event), event
PY
echo "1 passed, 0 failed"
