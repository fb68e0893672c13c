#!/usr/bin/env bash
# Soak run (a benchmark, not a CI test): 4 ranks train STEPS steps; a second job with the same options is
# killed CYCLES times (SIGKILL of a random rank at a random step, the survivors must stop on their own with
# a message naming it) and resumed from its step checkpoints each time. At the end every logged loss and
# the final parameters (CRC-32 of their bytes) must equal the uninterrupted run's.
#   ./scripts/soak.sh [STEPS=3000] [CYCLES=6] [SEED=1]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3000} cycles=${2:-6} seed=${3:-1}
dkfac=build/dkfac
tmp=$(mktemp -d)
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null || true; rm -rf "$tmp"' EXIT
RANDOM=$seed
common=(--model mlp --dataset synthetic --epochs 100000 --max-steps "$steps" --log-every 10 --timeout 20)

source tests/integration/lib.sh
last_step() { python3 - "$1" <<'PY'
import json, sys
step = 0
try:
    for line in open(sys.argv[1]):
        try:
            e = json.loads(line)
        except ValueError:
            break  # a line being written
        if e.get("event") == "step":
            step = e["step"]
except FileNotFoundError:
    pass
print(step)
PY
}

echo "soak: $steps steps, 4 ranks, $cycles kill-and-resume cycles, seed $seed ($(nproc) cores)"
start=$(date +%s)
"$dkfac" train --nproc 4 "${common[@]}" --metrics "$tmp/straight.jsonl" > "$tmp/straight.txt" 2>&1
echo "uninterrupted run: $(( $(date +%s) - start )) s"

start_job() {
  local port; port=$(free_port)
  pids=()
  for r in 0 1 2 3; do
    RANK=$r WORLD_SIZE=4 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$dkfac" train "${common[@]}" \
      --checkpoint-dir "$tmp/ckpt" --checkpoint-every-steps 50 --resume --metrics "$tmp/cut.jsonl" \
      >> "$tmp/cut.$r.txt" 2>&1 &
    pids+=($!)
  done
}

echo "| cycle | this start resumed from step | killed rank | at step | survivors stopped after (max) | message (one survivor) |"
echo "|---|---|---|---|---|---|"
start=$(date +%s)
for cycle in $(seq 1 "$cycles"); do
  begin=$(last_step "$tmp/cut.jsonl")
  target=$(( begin + 60 + RANDOM % (steps / cycles) ))
  (( target < steps - 20 )) || target=$(( steps - 20 ))
  victim=$(( RANDOM % 4 ))
  start_job
  while (( $(last_step "$tmp/cut.jsonl") < target )); do sleep 0.2; done
  at=$(last_step "$tmp/cut.jsonl")
  resumed=start
  if ((cycle > 1)); then resumed=$(grep -h 'resume:' "$tmp/cut.0.txt" | tail -1 | sed 's/.*step //' || true); fi
  killed=$(date +%s.%N)
  kill -9 "${pids[$victim]}"
  worst=0 message=""
  for r in 0 1 2 3; do
    [[ $r == "$victim" ]] && continue
    if wait "${pids[$r]}"; then echo "FAIL: rank $r exited 0 after rank $victim was killed"; exit 1; fi
    elapsed=$(python3 -c "import time; print(f'{time.time() - $killed:.1f}')")
    worst=$(python3 -c "print(max($worst, $elapsed))")
    line=$(grep -h 'error' "$tmp/cut.$r.txt" | tail -1)
    grep -q "rank $victim" <<< "$line" || { echo "FAIL: rank $r does not name rank $victim: $line"; exit 1; }
    message=${line:0:110}
  done
  echo "| $cycle | $resumed | $victim | $at | ${worst} s | \`$message\` |"
done
start_job
for r in 0 1 2 3; do wait "${pids[$r]}" || { echo "FAIL: final resumed rank $r"; tail "$tmp/cut.$r.txt"; exit 1; }; done
echo "interrupted run: $(( $(date +%s) - start )) s in $((cycles + 1)) starts"
echo -n "soak: "
compare_runs "$tmp/straight.jsonl" "$tmp/cut.jsonl" --same-parameters
