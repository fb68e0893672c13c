#!/usr/bin/env bash
# `dkfac train` under the launchers users run, each against `dkfac train --nproc 2` (same final parameters):
#  1. the environment's `torchrun` command, and torch's elastic agent API it wraps (examples/launch.py) with the
#     static rendezvous (the agent hosts the store) and c10d;
#  2. an agent restart: the job resumes from its checkpoint and ends where an uninterrupted run ends;
#     without --checkpoint-dir a restart is refused with a message;
#  3. Open MPI's mpirun (skipped, exit 77, where it is not installed);
#  4. the environment Slurm's srun sets (no MASTER_ADDR/MASTER_PORT: derived from the node list and job id).
set -euo pipefail
dkfac="$1"
python="${2:-python3}"  # the interpreter whose torch dkfac was built against (DKFAC_PYTHON)
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
launch="$here/../../examples/launch.py"
torchrun="$(dirname "$python")/torchrun"
scratch_dir
# A launcher variable inherited from the caller would change which launcher dkfac sees.
unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT LOCAL_RANK OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE SLURM_PROCID \
  SLURM_NTASKS SLURM_JOB_ID SLURM_JOB_NODELIST TORCHELASTIC_RESTART_COUNT TORCHELASTIC_RUN_ID 2>/dev/null || true
train=(train --model mlp --dataset synthetic --epochs 1 --log-every 4 --timeout 30)
crc() { "$python" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["parameters_crc32"])' "$1"; }
passed=0

"$dkfac" "${train[@]}" --nproc 2 --max-steps 8 --metrics "$tmp/ref.jsonl" > "$tmp/ref.txt" 2>&1 || { cat "$tmp/ref.txt"; fail "reference run"; }
reference=$(crc "$tmp/ref.jsonl")
echo "reference (--nproc 2, 8 steps): parameters crc32 $reference"

for backend in static c10d; do
  echo "== elastic agent, $backend rendezvous"
  "$python" "$launch" --no-python --rdzv-backend "$backend" --nproc-per-node 2 "$dkfac" "${train[@]}" --max-steps 8 \
    --metrics "$tmp/$backend.jsonl" > "$tmp/$backend.txt" 2>&1 || { cat "$tmp/$backend.txt"; fail "elastic $backend"; }
  grep -q 'launch: 2 ranks from torch elastic agent' "$tmp/$backend.txt" || { cat "$tmp/$backend.txt"; fail "no launch line"; }
  if [[ $backend == static ]]; then grep -q "(the agent's store)" "$tmp/$backend.txt" || fail "static: not the agent's store"; fi
  [[ $(crc "$tmp/$backend.jsonl") == "$reference" ]] || fail "elastic $backend ended with other parameters"
  passed=$((passed + 1))
done

echo "== torchrun --standalone"
"$torchrun" --standalone --nproc-per-node 2 --no-python "$dkfac" "${train[@]}" --max-steps 8 \
  --metrics "$tmp/torchrun.jsonl" > "$tmp/torchrun.txt" 2>&1 || { cat "$tmp/torchrun.txt"; fail "torchrun"; }
grep -q 'launch: 2 ranks from torch elastic agent' "$tmp/torchrun.txt" || { cat "$tmp/torchrun.txt"; fail "torchrun: no launch line"; }
[[ $(crc "$tmp/torchrun.jsonl") == "$reference" ]] || fail "torchrun ended with other parameters"
passed=$((passed + 1))

echo "== elastic agent restarts a failed worker: the job resumes from its checkpoint"
"$python" "$launch" --no-python --nproc-per-node 2 --max-restarts 1 "$here/restart_once.sh" 4 8 "$dkfac" "${train[@]}" \
  --checkpoint-dir "$tmp/ck" --metrics "$tmp/restart.jsonl" > "$tmp/restart.txt" 2>&1 \
  || { cat "$tmp/restart.txt"; fail "restarted job"; }
grep -q 'failing on purpose after 4 steps' "$tmp/restart.txt" || { cat "$tmp/restart.txt"; fail "no failure"; }
grep -q 'launch: 2 ranks from torch elastic agent.*restart 1: resuming' "$tmp/restart.txt" || { cat "$tmp/restart.txt"; fail "no restart line"; }
grep -q 'resume: .*step 4' "$tmp/restart.txt" || { cat "$tmp/restart.txt"; fail "did not resume at step 4"; }
[[ $(crc "$tmp/restart.jsonl") == "$reference" ]] || { cat "$tmp/restart.txt"; fail "restarted job ended with other parameters"; }
passed=$((passed + 1))

echo "== elastic agent restart without --checkpoint-dir is refused"
set +e
"$python" "$launch" --no-python --nproc-per-node 2 --max-restarts 1 "$here/restart_once.sh" 2 8 "$dkfac" "${train[@]}" \
  > "$tmp/nock.txt" 2>&1
rc=$?
set -e
[[ $rc -ne 0 ]] || { cat "$tmp/nock.txt"; fail "a restart without checkpoints exited 0"; }
grep -q 'restarted this job (restart 1) but it has no --checkpoint-dir' "$tmp/nock.txt" || { cat "$tmp/nock.txt"; fail "no reason given"; }
passed=$((passed + 1))

echo "== mpirun"
if command -v mpirun > /dev/null; then
  # As root Open MPI needs --allow-run-as-root; more ranks than cores need --oversubscribe.
  mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT="$(free_port)" "$dkfac" "${train[@]}" --max-steps 8 \
    --metrics "$tmp/mpi.jsonl" > "$tmp/mpi.txt" 2>&1 || { cat "$tmp/mpi.txt"; fail "mpirun"; }
  grep -q 'launch: 2 ranks from mpirun' "$tmp/mpi.txt" || { cat "$tmp/mpi.txt"; fail "no mpirun launch line"; }
  [[ $(crc "$tmp/mpi.jsonl") == "$reference" ]] || fail "mpirun ended with other parameters"
  # A bad flag: every rank refuses it, rank 0 alone says why.
  if mpirun --allow-run-as-root --oversubscribe -np 2 "$dkfac" train --damping 0 > "$tmp/mpibad.txt" 2>&1; then
    cat "$tmp/mpibad.txt"; fail "mpirun with a bad flag exited 0"
  fi
  [[ $(grep -c -- '--damping must be finite and > 0' "$tmp/mpibad.txt") == 1 ]] || { cat "$tmp/mpibad.txt"; fail "the bad flag not reported once"; }
  passed=$((passed + 1))
else
  echo "skipped: mpirun is not installed (scripts/setup.sh installs openmpi-bin)"
  mpi_missing=1
fi

echo "== Slurm's environment (srun -n 2 on one node): address and port derived"
# The port Slurm's job id maps to (20000 + id mod 10000) must be free here.
job_id=""
for _ in $(seq 1 50); do
  candidate=$((100000 + RANDOM))
  if "$python" -c 'import socket,sys; s=socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' \
      $((20000 + candidate % 10000)) 2>/dev/null; then job_id=$candidate; break; fi
done
[[ -n "$job_id" ]] || fail "no free port for a Slurm job id"
pids=()
for rank in 0 1; do
  SLURM_PROCID=$rank SLURM_NTASKS=2 SLURM_LOCALID=$rank SLURM_NODEID=0 SLURM_JOB_ID=$job_id \
    SLURM_JOB_NODELIST='localhost,node[02-04]' "$dkfac" "${train[@]}" --max-steps 8 --metrics "$tmp/slurm$rank.jsonl" \
    > "$tmp/slurm$rank.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { cat "$tmp"/slurm*.txt; fail "Slurm rank"; }; done
grep -q "launch: 2 ranks from Slurm, rendezvous at localhost:$((20000 + job_id % 10000))" "$tmp/slurm0.txt" \
  || { cat "$tmp/slurm0.txt"; fail "Slurm: address or port not derived"; }
[[ $(crc "$tmp/slurm0.jsonl") == "$reference" ]] || fail "Slurm ended with other parameters"
passed=$((passed + 1))

echo "$passed passed, 0 failed"
[[ -z "${mpi_missing:-}" ]] || exit 77
