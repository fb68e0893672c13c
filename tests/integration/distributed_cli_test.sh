#!/usr/bin/env bash
# `dkfac train --nproc N`: a 2-rank job finishes with identical results on every rank, and killing
# one of 3 ranks ends the job quickly with a message naming the lost rank.
set -euo pipefail
dkfac="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== 2 ranks, KAISA hybrid, triangles"
"$dkfac" train --nproc 2 --model mlp --dataset synthetic --epochs 1 --max-steps 12 --log-every 4 \
  --grad-worker-fraction 0.5 --symmetric-comm --metrics "$tmp/m.jsonl" > "$tmp/out.txt" 2>&1 || { cat "$tmp/out.txt"; exit 1; }
cat "$tmp/out.txt"
grep -q '"world_size":2' "$tmp/m.jsonl" || { echo "FAIL: no world_size 2 in the summary"; exit 1; }
grep -q '"factors":' "$tmp/m.jsonl" || { echo "FAIL: no factor traffic in the summary"; exit 1; }
acc0=$(grep '^\[rank 0\] summary' "$tmp/out.txt" | sed 's/.*best test accuracy \([0-9.]*\)%.*/\1/')
acc1=$(grep '^\[rank 1\] summary' "$tmp/out.txt" | sed 's/.*best test accuracy \([0-9.]*\)%.*/\1/')
[[ -n "$acc0" && "$acc0" == "$acc1" ]] || { echo "FAIL: ranks disagree: '$acc0' vs '$acc1'"; exit 1; }

echo "== 3 ranks, one killed"
"$dkfac" train --nproc 3 --model mlp --dataset synthetic --epochs 100 --log-every 1 --timeout 20 \
  > "$tmp/kill.txt" 2>&1 &
launcher=$!
for _ in $(seq 1 120); do
  grep -q 'step 3/' "$tmp/kill.txt" 2>/dev/null && break
  sleep 0.5
done
victim=$(pgrep -P "$launcher" | sed -n 2p)
[[ -n "$victim" ]] || { echo "FAIL: no worker to kill"; cat "$tmp/kill.txt"; exit 1; }
start=$(date +%s)
kill -9 "$victim"
set +e
wait "$launcher"
rc=$?
set -e
elapsed=$(( $(date +%s) - start ))
cat "$tmp/kill.txt" | tail -5
[[ $rc -ne 0 ]] || { echo "FAIL: job exited 0 after a worker was killed"; exit 1; }
grep -q 'rank 1 failed (killed by signal 9)' "$tmp/kill.txt" || { echo "FAIL: lost rank not named"; exit 1; }
(( elapsed < 60 )) || { echo "FAIL: took ${elapsed}s"; exit 1; }
echo "job ended ${elapsed}s after the kill, exit $rc"
echo "2 passed, 0 failed"
