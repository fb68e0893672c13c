#!/usr/bin/env bash
# Worker loss under an external launcher (each survivor names the lost rank itself, within the timeout),
# and kill-and-resume: a 3-rank job killed mid-run and resumed from its step checkpoints ends on the same
# loss trajectory as a run that never failed.
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"
pids=()
scratch_dir 'kill -9 "${pids[@]}" 2>/dev/null || true'

# Starts 3 ranks the way torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); extra args go to train.
start_ranks() {
  local tag=$1; shift
  local port; port=$(free_port)
  pids=()
  for r in 0 1 2; do
    RANK=$r WORLD_SIZE=3 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$dkfac" train --model mlp --dataset synthetic --log-every 1 "$@" > "$tmp/$tag.$r.txt" 2>&1 &
    pids+=($!)
  done
}

wait_for() {  # file, progress text ("epoch 2/10 step 2/": step 2 of the second epoch)
  for _ in $(seq 1 240); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.25
  done
  echo "FAIL: never reached '$2'"; cat "$1"; exit 1
}

for victim in 2 0; do
  echo "== 3 ranks under an external launcher, rank $victim killed"
  start_ranks "lost$victim" --epochs 100 --timeout 15
  wait_for "$tmp/lost$victim.0.txt" "step 3/"
  start=$(date +%s)
  kill -9 "${pids[$victim]}"
  for r in 0 1 2; do
    [[ $r == "$victim" ]] && continue
    set +e; wait "${pids[$r]}"; rc=$?; set -e
    elapsed=$(( $(date +%s) - start ))
    tail -2 "$tmp/lost$victim.$r.txt"
    [[ $rc -ne 0 ]] || { echo "FAIL: rank $r exited 0"; exit 1; }
    grep -q "lost rank $victim" "$tmp/lost$victim.$r.txt" \
      || { tail -n 3 "$tmp/lost$victim".*.txt; echo "FAIL: rank $r does not name rank $victim"; exit 1; }
    (( elapsed <= 15 )) || { echo "FAIL: rank $r took ${elapsed}s"; exit 1; }
    echo "rank $r ended ${elapsed}s after the kill, exit $rc, naming rank $victim"
  done
done

echo "== kill and resume: same trajectory as an uninterrupted run"
steps=200
"$dkfac" train --nproc 3 --model mlp --dataset synthetic --epochs 10 --max-steps $steps --log-every 1 \
  --metrics "$tmp/straight.jsonl" > "$tmp/straight.txt" 2>&1 || { cat "$tmp/straight.txt"; exit 1; }
start_ranks cut --epochs 10 --max-steps $steps --checkpoint-dir "$tmp/ckpt" --checkpoint-every-steps 5 \
  --metrics "$tmp/cut.jsonl"
wait_for "$tmp/cut.0.txt" "epoch 2/10 step 2/"  # global step 23 of 21-step epochs
kill -9 "${pids[1]}"
for r in 0 2; do wait "${pids[$r]}" || true; done
ls "$tmp/ckpt"
start_ranks resumed --epochs 10 --max-steps $steps --checkpoint-dir "$tmp/ckpt" --checkpoint-every-steps 5 \
  --metrics "$tmp/cut.jsonl" --resume
for r in 0 1 2; do wait "${pids[$r]}" || { echo "FAIL: resumed rank $r"; cat "$tmp/resumed.$r.txt"; exit 1; }; done
grep 'resume:' "$tmp/resumed.0.txt"
echo -n "$steps steps, killed at step >= 23 and resumed from the last step checkpoint: "
compare_runs "$tmp/straight.jsonl" "$tmp/cut.jsonl" --steps $steps --same-parameters

echo "== resuming the 3-rank checkpoints on 2 ranks: re-placed, said once, and the run goes on"
"$dkfac" train --nproc 2 --model mlp --dataset synthetic --epochs 10 --max-steps $((steps + 4)) \
  --checkpoint-dir "$tmp/ckpt" --resume > "$tmp/world2.txt" 2>&1 || { echo "FAIL: 2 ranks did not resume"; cat "$tmp/world2.txt"; exit 1; }
[[ $(grep -c 'written by a 3-rank job, continued on 2 ranks' "$tmp/world2.txt") == 1 ]] \
  || { echo "FAIL: the resume line is not there once"; cat "$tmp/world2.txt"; exit 1; }
grep -q '^summary: ' "$tmp/world2.txt" || { echo "FAIL: the resumed run did not finish"; cat "$tmp/world2.txt"; exit 1; }
grep 'resume' "$tmp/world2.txt" | head -2

echo "== a rank pointed at a port that is not a rendezvous store: an error within --timeout"
port=$(free_port)
python3 -m http.server "$port" --bind 127.0.0.1 > /dev/null 2>&1 &
server=$!
for _ in $(seq 1 50); do python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null && break; sleep 0.1; done
start=$(date +%s)
set +e
RANK=1 WORLD_SIZE=2 MASTER_PORT=$port timeout 120 "$dkfac" train --model mlp --dataset synthetic --timeout 5 > "$tmp/garbage.txt" 2>&1
rc=$?
set -e
kill "$server"
elapsed=$(( $(date +%s) - start ))
cat "$tmp/garbage.txt"
[[ $rc -ne 0 && $rc -ne 124 ]] || { echo "FAIL: exit $rc (124: hung past 120 s)"; exit 1; }
grep -q 'did not complete within 5000 ms: no rendezvous store answered' "$tmp/garbage.txt" || { echo "FAIL: no reason"; exit 1; }
(( elapsed < 30 )) || { echo "FAIL: took ${elapsed}s with --timeout 5"; exit 1; }
