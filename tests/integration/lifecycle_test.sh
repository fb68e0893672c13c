#!/usr/bin/env bash
# The `dkfac train --nproc N` launcher's process lifecycle:
#  0. each worker is the program started afresh (fork and exec), not a forked copy of the launcher (a copy
#     inherits libraries in the state fork() leaves them: on a 16-core machine one died in OpenMP's
#     gomp_team_start): its command line lacks --nproc and its environment has RANK, as torchrun's workers;
#  1. SIGTERM (and SIGINT) to the launcher only, as a supervisor or subprocess.terminate() sends it: every
#     worker stops, the launcher exits 128+signal saying so, and no process is left;
#  2. a hung worker (SIGSTOP): rank 0 reports the lost rank, the launcher kills the stopped worker after its
#     grace period and exits non-zero naming the first failure, well within bounds;
#  3. the launcher killed with SIGKILL: its workers die with it.
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"
launcher=""
scratch_dir '[[ -n "$launcher" ]] && kill -9 "$launcher" 2>/dev/null'
wait_for() {  # file, text
  for _ in $(seq 1 240); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.25; done
  cat "$1"; fail "never reached '$2'"
}
all_gone() {  # pids...
  for _ in $(seq 1 40); do
    local alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && [[ "$(ps -o stat= -p "$p" 2>/dev/null)" != Z* ]] && alive=1; done
    (( alive == 0 )) && return 0
    sleep 0.25
  done
  ps -o pid,stat,cmd -p "$@" || true
  return 1
}
train=(train --nproc 2 --model mlp --dataset synthetic --epochs 1000 --log-every 1 --batch-size 64)

for sig in TERM INT; do
  echo "== SIG$sig to the launcher"
  "$dkfac" "${train[@]}" --checkpoint-dir "$tmp/ck$sig" > "$tmp/$sig.txt" 2>&1 &
  launcher=$!
  wait_for "$tmp/$sig.txt" "step 3/"
  workers=($(pgrep -P "$launcher"))
  (( ${#workers[@]} == 2 )) || fail "expected 2 workers, found ${#workers[@]}"
  for w in "${workers[@]}"; do
    command=$(tr '\0' ' ' < "/proc/$w/cmdline")
    [[ $command == *" train "* && $command != *--nproc* ]] || fail "worker $w runs '$command': not a fresh program"
    tr '\0' '\n' < "/proc/$w/environ" | grep -q -E '^RANK=[01]$' || fail "worker $w has no RANK in its environment"
  done
  start=$(date +%s)
  kill -"$sig" "$launcher"
  set +e; wait "$launcher"; rc=$?; set -e
  launcher=""
  elapsed=$(( $(date +%s) - start ))
  tail -2 "$tmp/$sig.txt"
  expected=$(( 128 + $(kill -l "$sig") ))
  [[ $rc -eq $expected ]] || fail "launcher exit $rc, expected $expected"
  grep -q "dkfac: stopped by signal $(kill -l "$sig")" "$tmp/$sig.txt" || fail "no message"
  all_gone "${workers[@]}" || fail "workers left behind after SIG$sig"
  (( elapsed <= 10 )) || fail "took ${elapsed}s"
  echo "launcher exit $rc after ${elapsed}s, both workers gone"
done

echo "== a hung worker (SIGSTOP to rank 1)"
"$dkfac" "${train[@]}" --timeout 5 > "$tmp/hung.txt" 2>&1 &
launcher=$!
wait_for "$tmp/hung.txt" "step 3/"
workers=($(pgrep -P "$launcher"))
start=$(date +%s)
kill -STOP "${workers[1]}"
set +e; wait "$launcher"; rc=$?; set -e
launcher=""
elapsed=$(( $(date +%s) - start ))
tail -3 "$tmp/hung.txt"
[[ $rc -ne 0 ]] || fail "exit 0 with a hung worker"
grep -q "lost rank 1" "$tmp/hung.txt" || fail "rank 0 did not name rank 1"
grep -q "dkfac: error: rank 1 stopped responding (rank 0 reported: .*lost rank 1" "$tmp/hung.txt" \
  || fail "launcher did not name the hung rank as the root cause"
all_gone "${workers[@]}" || fail "the stopped worker was left behind"
(( elapsed <= 30 )) || fail "took ${elapsed}s with --timeout 5"
echo "launcher exit $rc after ${elapsed}s, stopped worker killed"

echo "== SIGKILL to the launcher: workers die with it"
"$dkfac" "${train[@]}" > "$tmp/kill.txt" 2>&1 &
launcher=$!
wait_for "$tmp/kill.txt" "step 3/"
workers=($(pgrep -P "$launcher"))
kill -9 "$launcher"
wait "$launcher" 2>/dev/null || true
launcher=""
all_gone "${workers[@]}" || fail "workers outlived a killed launcher"
echo "both workers gone"
echo "4 passed, 0 failed"
