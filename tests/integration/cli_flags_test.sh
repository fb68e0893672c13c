#!/usr/bin/env bash
# `dkfac train`'s command line as a user meets it (issue 17): --help groups and defaults, errors that name the
# flag typed, kfac_pytorch aliases, a skip-layers pattern that matches nothing, images of the wrong size.
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"  # fail, scratch_dir, refused, has, lacks
scratch_dir

echo "== --help: groups, and which half of a switch pair is the default"
"$dkfac" train --help > "$tmp/out"
for group in "Data:" "Model:" "Optimizer:" "K-FAC:" "Distributed:" "Checkpoints:" "Output:"; do has "$group"; done
has "precondition with K-FAC (default: on)"
has "--kfac-strategy"
lacks "{false}"

echo "== numeric flags are refused under the name typed, before anything starts"
refused --factor-decay 2
has "--factor-decay must be finite and in [0, 1], got 2"
lacks "factor_decay"
refused --kfac-factor-decay 2
has "--kfac-factor-decay must be finite and in [0, 1], got 2"
refused --damping 0
has "--damping must be finite and > 0, got 0"
refused --timeout 0
has "--timeout: Value 0 not in range 1 to 3600"
refused --nproc 2 --kl-clip -1
has "--kl-clip must be finite and >= 0, got -1"

echo "== a flag with a fixed set of choices refuses another value, naming the flag and the choices"
refused --model nosuch
has "--model must be one of mlp, cnn, resnet20, autoencoder, got 'nosuch'"
refused --nproc 2 --strategy hogwild
has "--strategy must be one of kaisa, spd, dp, auto, got 'hogwild'"

echo "== an alias and its flag that disagree are named together"
refused --kfac-damping 0.003 --damping 0.3
has "--kfac-damping 0.003 and --damping 0.3 disagree"

echo "== --kfac-inv-update-steps 0 is training without K-FAC"
"$dkfac" train --dataset synthetic --model mlp --kfac-inv-update-steps 0 --max-steps 2 --epochs 1 > "$tmp/out" 2>&1
has "train: model mlp, dataset synthetic"
lacks "K-FAC +"

echo "== a --skip-layers pattern that matches nothing is warned about, naming the layers"
"$dkfac" train --dataset synthetic --model mlp --skip-layers '^fc$' --max-steps 1 --epochs 1 > "$tmp/out" 2>&1
has "skip_layers pattern '^fc\$' matches no layer"
has "'1' (Linear)"

echo "== images of another size than the dataset's name the file and both sizes"
python3 - "$tmp/mnist32" <<'PY'
import os, struct, sys
d = sys.argv[1]
os.makedirs(d)
for prefix, n in (('train', 256), ('t10k', 64)):
    open(f'{d}/{prefix}-images-idx3-ubyte', 'wb').write(struct.pack('>IIII', 0x803, n, 32, 32) + bytes(n * 1024))
    open(f'{d}/{prefix}-labels-idx1-ubyte', 'wb').write(struct.pack('>II', 0x801, n) + bytes(n))
PY
refused --dataset mnist --data-dir "$tmp/mnist32" --max-steps 1
has "dataset file '$tmp/mnist32/train-images-idx3-ubyte' holds 32 x 32 images, but --dataset mnist has 28 x 28"
lacks "mat1 and mat2"

echo "== --print-plan: the step plan of a single process, one line per K-FAC layer; nothing without K-FAC"
"$dkfac" train --model mlp --dataset synthetic --epochs 1 --max-steps 1 --print-plan > "$tmp/out" 2>&1 \
  || { cat "$tmp/out"; fail "--print-plan run failed"; }
has "step plan: single process"
layers=$(grep -c '^  [^ ]* \[a=[0-9]*, g=[0-9]*\]: factors on every rank; A on rank 0, G on rank 0; grad workers {0}$' "$tmp/out" || true)
header=$(grep '^K-FAC layers' "$tmp/out" | tr ',' '\n' | wc -l)
[[ $layers -ge 1 && $layers == "$header" ]] || { cat "$tmp/out"; fail "$layers plan lines for $header layers"; }
"$dkfac" train --model mlp --dataset synthetic --epochs 1 --max-steps 1 > "$tmp/out" 2>&1
lacks "step plan"
"$dkfac" train --model mlp --dataset synthetic --epochs 1 --max-steps 1 --no-kfac --print-plan > "$tmp/out" 2>&1
has "step plan: none (--no-kfac"
echo "== dkfac bench checks every argument before it runs anything"
bench_refused() {
  local rc=0
  "$dkfac" bench --no-steps "$@" > "$tmp/out" 2>&1 || rc=$?
  if [[ $rc == 0 ]]; then cat "$tmp/out"; fail "dkfac bench $* succeeded"; fi
  lacks "bench: {"  # refused before the benchmark's first line
}
bench_refused --kernel-repeats 0
has "--kernel-repeats must be >= 1, got 0"
bench_refused --kernel-dims 64 -4
has "--kernel-dims must be >= 1, got -4"
bench_refused --kernel-rows 0
has "--kernel-rows must be >= 1, got 0"
bench_refused --methods eigen foo
has "--methods takes eigen, inverse, got 'foo'"
bench_refused --json "$tmp/no/such/dir/out.json"
has "cannot write --json file"
echo "== dkfac plan refuses a flag that needs another"
rc=0
"$dkfac" plan --model gpt-1.3b --nproc 2 --tp-exact-factors > "$tmp/out" 2>&1 || rc=$?
[[ $rc != 0 ]] || { cat "$tmp/out"; fail "--tp-exact-factors without --tp succeeded"; }
has "--tp-exact-factors goes with --tp T > 1"
rc=0
"$dkfac" plan --model gpt-1.3b --nproc 3 --tp 3 > "$tmp/out" 2>&1 || rc=$?
[[ $rc != 0 ]] || { cat "$tmp/out"; fail "--tp 3 on gpt-1.3b's 2048-wide rows succeeded"; }
has "inputs do not split evenly (torch's DTensor fails on an uneven row-parallel split)"

echo "PASS"
