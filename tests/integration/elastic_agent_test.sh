#!/usr/bin/env bash
# A torchrun restart with fewer ranks resumes by itself (issue 26). Two torchrun agents on this machine are the
# two "nodes" of one elastic job (`--nnodes 1:2`, one worker each, c10d rendezvous, `--local-addr` 127.0.0.1:
# group rank 0, 127.0.0.2: group rank 1). Once the 2-rank job has written its step-6 checkpoint, one node (its
# agent and its worker) is SIGKILLed and never comes back. The other node's worker must notice the lost rank and
# fail, its agent must re-rendezvous alone (world size 1, restart_count=1) and restart the worker, and that
# worker must resume by itself (no --resume) from the 2-rank checkpoint on 1 rank and finish at --max-steps with
# exit 0. With --global-batch-size and KAISA f = 1/2 the 24 logged losses must equal an uninterrupted 2-rank
# run's up to float reduction order, as in `elastic` (relative 1e-5 allowed; the drift grows with the steps
# done on 1 rank: about 2e-6 by step 24 here, 1e-5 by step 40).
#  1. rank 1's node is lost (torch's defaults otherwise);
#  2. rank 0's node is lost: the agents need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see run_case's callers).
#
# The rendezvous store runs in a process of its own (what a dedicated rendezvous host would hold), so that the
# node to be lost joins round 0 before the other starts: round 0 then has both nodes whatever the start-up
# times, and the survivor's last_call_timeout, which also bounds its lone re-rendezvous, can be short.
#
# Usage: elastic_agent_test.sh DKFAC [PYTHON]; PYTHON (default: the repository's .venv, else python3) is the
# interpreter whose torch dkfac was built against; its torchrun is used. Exits 77 when there is no torchrun.
set -euo pipefail
dkfac="$1"
here="$(cd "$(dirname "$0")" && pwd)"
python="${2:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$here/../../.venv/bin/python" ]]; then python="$here/../../.venv/bin/python"; else python=python3; fi
fi
source "$here/lib.sh"
torchrun="$(dirname "$(command -v "$python" || echo "$python")")/torchrun"
if [[ ! -x "$torchrun" ]]; then
  echo "SKIPPED: no torchrun next to $python"
  exit 77
fi

# Every process this test starts: its id and its descendants (torch's agents start workers in sessions of their
# own, so killing an agent's process group does not reach them).
tree() {
  local pid=$1 child
  echo "$pid"
  for child in $(ps -o pid= --ppid "$pid" 2> /dev/null); do tree "$child"; done
}
kill_tree() {
  local pids
  pids=$(tree "$1")
  # shellcheck disable=SC2086  # one id per word on purpose
  kill -KILL $pids 2> /dev/null || true
}
started=()
cleanup() { local p; for p in "${started[@]}"; do kill_tree "$p"; done; }
scratch_dir 'cleanup'
# A launcher variable inherited from the caller would change what dkfac and the agents see.
unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT LOCAL_RANK OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE SLURM_PROCID \
  SLURM_NTASKS SLURM_JOB_ID SLURM_JOB_NODELIST TORCHELASTIC_RESTART_COUNT TORCHELASTIC_RUN_ID \
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE 2> /dev/null || true

steps=24
train=(train --model cnn --global-batch-size 64 --eval-examples 200 --log-every 1 --threads 1 --seed 3
       --factor-update-steps 1 --inv-update-steps 4 --strategy kaisa --grad-worker-fraction 0.5 --max-steps "$steps"
       --timeout 10)

# Waits up to SECONDS for a line matching the extended regular expression in FILE; fails naming what it waited for.
wait_for() {
  local file=$1 pattern=$2 seconds=$3 i
  for ((i = 0; i < seconds * 10; i++)); do
    grep -qE -- "$pattern" "$file" 2> /dev/null && return 0
    sleep 0.1
  done
  cat "$file"
  fail "no line matching '$pattern' in $file within ${seconds}s"
}

t0=$SECONDS
echo "== reference: $steps steps on 2 ranks (dkfac train --nproc 2), uninterrupted"
timeout -s KILL 120 "$dkfac" "${train[@]}" --nproc 2 --metrics "$tmp/ref.jsonl" > "$tmp/ref.txt" 2>&1 \
  || { cat "$tmp/ref.txt"; fail "the reference run failed"; }

# The c10d rendezvous store both cases' agents use (each case is another run id).
port=$(free_port)
setsid timeout -s KILL 200 "$python" -c '
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, multi_tenant=True, wait_for_workers=False,
                 timeout=timedelta(seconds=60))
print("rendezvous store ready", flush=True)
time.sleep(190)
' "$port" > "$tmp/store.txt" 2>&1 &
started+=($!)
disown $!  # killed at the end: no job-control notice
wait_for "$tmp/store.txt" "rendezvous store ready" 60

# run_case NAME LOST_RANK [VAR=VALUE...]: one elastic job of two torchrun agents, each with one worker; the node
# whose worker is rank LOST_RANK (0 or 1) is SIGKILLed, agent and worker, after the job's step-6 checkpoint and
# never comes back; the other node must restart alone and finish. The variables go to both agents.
run_case() {
  local name=$1 lost=$2
  shift 2
  local dir=$tmp/$name
  mkdir "$dir"
  # Group ranks follow the nodes' sorted addresses: 127.0.0.1 is group rank 0, 127.0.0.2 group rank 1.
  local lost_addr=127.0.0.$((lost + 1)) kept_addr=127.0.0.$((2 - lost)) kept=$((1 - lost))
  echo "== $name: torchrun --nnodes 1:2, node of rank $lost killed after the step-6 checkpoint${1:+ ($*)}"
  # keep_alive_*: an agent that stops beating for 2 s has left the rendezvous (torch's default: 15 s).
  local rdzv=(--nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port"
              --rdzv-id "dkfac-$name-$$-$RANDOM" --max-restarts 2 --monitor-interval 0.5)
  local conf="is_host=0,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"
  local worker=(--no-python "$dkfac" "${train[@]}" --checkpoint-dir "$dir/ck" --checkpoint-every-steps 2
                --metrics "$dir/run.jsonl")
  # The node to be lost starts first and joins round 0 alone; its long last call never runs out, since the
  # other node's joining makes 2 = max nodes and completes the round.
  env "$@" LOGLEVEL=INFO setsid timeout -s KILL 120 "$torchrun" "${rdzv[@]}" --local-addr "$lost_addr" \
    --rdzv-conf "$conf,last_call_timeout=60" "${worker[@]}" > "$dir/lost.txt" 2>&1 &
  local lost_node=$!
  started+=("$lost_node")
  disown "$lost_node"  # killed on purpose: no job-control notice
  wait_for "$dir/lost.txt" "Rendezvous'ing worker group" 60
  # The surviving node: a 2 s last call, which is also what its re-rendezvous alone waits after the failure.
  env "$@" LOGLEVEL=INFO setsid timeout -s KILL 120 "$torchrun" "${rdzv[@]}" --local-addr "$kept_addr" \
    --rdzv-conf "$conf,last_call_timeout=2" "${worker[@]}" > "$dir/kept.txt" 2>&1 &
  local kept_node=$!
  started+=("$kept_node")
  local a=$dir/kept.txt rank0=$dir/kept.txt
  [[ $lost == 0 ]] && rank0=$dir/lost.txt

  wait_for "$rank0" "checkpoint: .*\(every 2 steps, in epoch 1, step 6\)" 90
  kill_tree "$lost_node"
  local killed_at=$SECONDS rc=0
  echo "node $lost_addr (agent and worker) killed, $((killed_at - t0)) s into the test"
  wait "$kept_node" || rc=$?
  echo "node $kept_addr's torchrun exited $rc, $((SECONDS - killed_at)) s after the kill"
  [[ $rc == 0 ]] || { cat "$a"; echo "-- the lost node:"; cat "$dir/lost.txt"; fail "torchrun exited $rc (137: timeout)"; }
  # Round 0 had both nodes: rank 0's worker logs the launch line of a 2-rank job.
  has "launch: 2 ranks from torch elastic agent" "$rank0"
  # The surviving worker failed because it lost the other node's rank, not for another reason.
  has "[rank $kept] dkfac: error: " "$a"
  has "lost rank $lost" "$a"
  # The restarted worker's launch line: one rank, restart 1, resuming.
  has "launch: 1 rank from torch elastic agent" "$a"
  grep -qE "^launch: 1 rank from torch elastic agent.*, restart 1: resuming" "$a" || { cat "$a"; fail "no restart launch line"; }
  # The agent's rounds: restart_count=0 with 2 nodes, then restart_count=1 alone (world size 1).
  python3 - "$a" <<'EOF' || { cat "$a"; fail "the agent did not restart its worker in a 1-node round"; }
import re, sys
rounds = re.findall(r"restart_count=(\d+).*?group_rank=(\d+).*?group_world_size=(\d+)", open(sys.argv[1]).read(), re.S)
assert [(r, n) for r, _, n in rounds] == [("0", "2"), ("1", "1")], f"agent rounds (restart_count, rank, nodes): {rounds}"
assert rounds[1][1] == "0", rounds
EOF
  # The restarted worker resumed by itself (no --resume was passed) from the 2-rank job's rank 0 file, on 1 rank.
  local resume pattern step
  resume=$(grep -E "^resume: " "$a" || true)
  [[ -n $resume && $(grep -c . <<< "$resume") == 1 ]] || { cat "$a"; fail "not exactly one resume line"; }
  echo "${resume:0:140} ..."
  pattern='/checkpoint-rank0\.pt \(step ([0-9]+), in epoch 1\); written by a 2-rank job, continued on 1 rank;'
  [[ $resume =~ $pattern ]] || { cat "$a"; fail "the resume line does not name a 2-rank checkpoint continued on 1 rank"; }
  step=${BASH_REMATCH[1]}
  ((step >= 6 && step < steps)) || fail "resumed at step $step, not between the kill's step 6 and $steps"
  has "K-FAC state of a 2-rank job re-placed for 1 rank" "$a"
  has "the run continues the 2-rank run's trajectory up to floating-point reduction order" "$a"
  has "stopped at --max-steps $steps" "$a"
  # The 2-rank job's files (each rank's checkpoint and .prev) go once the 1-rank job has written its own.
  grep -E "^checkpoint: removed [0-9]+ file\(s\) of the earlier job of another number of ranks" "$a" \
    || { cat "$a"; fail "the 2-rank job's files were not removed"; }
  if compgen -G "$dir/ck/checkpoint-rank*" > /dev/null; then ls "$dir/ck"; fail "stale 2-rank files left"; fi
  [[ -f $dir/ck/checkpoint.pt ]] || { ls "$dir/ck"; fail "no 1-rank checkpoint"; }
  # The same trajectory as the uninterrupted 2-rank run: the steps the 2-rank job did after its checkpoint were
  # logged twice, and the 1-rank job's values replace them.
  compare_runs "$tmp/ref.jsonl" "$dir/run.jsonl" --steps "$steps" --rtol 1e-5
}

# Rank 1's node lost: the survivor is group rank 0 and hosts the workers' store (TORCHELASTIC_USE_AGENT_STORE,
# torch's default).
run_case lost_rank1 1
# Rank 0's node lost: torch 2.11's agent keeps the workers' store address of its first round (rank 0's agent),
# so a survivor that was rank 1 fails its re-rendezvous (AssertionError in DynamicRendezvousHandler
# .next_rendezvous) unless the agents do not share their store: each round's rank 0 worker then hosts it.
run_case lost_rank0 0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "PASS ($((SECONDS - t0)) s)"
