#!/usr/bin/env bash
# Elastic resume: a checkpoint written by P ranks resumes on Q != P ranks.
#  1. KAISA (grad-worker fraction 1/2) on the cnn with --global-batch-size: a 2-rank run checkpointed at
#     step 6 and resumed on 1 rank logs the uninterrupted 2-rank run's losses to float round-off, and the
#     resume line says what was re-placed; resumed back on 2 ranks it goes on the same way.
#  2. DP-KFAC: a 2-rank checkpoint resumes on 1 rank, goes on, and the resume line says why its trajectory
#     differs (factors from the owner's batch).
#  3. --global-batch-size that the ranks cannot share is refused.
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"
scratch_dir

common=(--model cnn --global-batch-size 64 --eval-examples 200 --log-every 1 --threads 1 --seed 3
        --factor-update-steps 1 --inv-update-steps 4)
kaisa=(--strategy kaisa --grad-worker-fraction 0.5)

echo "== KAISA f = 1/2: 12 steps on 2 ranks, uninterrupted"
"$dkfac" train --nproc 2 "${common[@]}" "${kaisa[@]}" --max-steps 12 --metrics "$tmp/straight.jsonl" \
  > "$tmp/straight.txt" 2>&1 || { cat "$tmp/straight.txt"; fail "the uninterrupted run failed"; }

echo "== the same run stopped at step 6 (2 ranks), resumed to step 9 on 1 rank, then to 12 on 2 ranks"
"$dkfac" train --nproc 2 "${common[@]}" "${kaisa[@]}" --max-steps 6 --checkpoint-dir "$tmp/ck" \
  --metrics "$tmp/run.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "the first part failed"; }
"$dkfac" train --nproc 1 "${common[@]}" "${kaisa[@]}" --max-steps 9 --checkpoint-dir "$tmp/ck" --resume \
  --metrics "$tmp/run.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "the resume on 1 rank failed"; }
has "written by a 2-rank job, continued on 1 rank"
has "K-FAC state of a 2-rank job re-placed for 1 rank"
has "the run continues the 2-rank run's trajectory up to floating-point reduction order"
# The 2-rank job's files are gone once the 1-rank job has written its own.
[[ -f $tmp/ck/checkpoint.pt && ! -e $tmp/ck/checkpoint-rank1.pt ]] || { ls "$tmp/ck"; fail "stale 2-rank files left"; }
"$dkfac" train --nproc 2 "${common[@]}" "${kaisa[@]}" --max-steps 12 --checkpoint-dir "$tmp/ck" --resume \
  --metrics "$tmp/run.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "the resume on 2 ranks failed"; }
has "written by a 1-rank job, continued on 2 ranks"
# Float round-off only: the ranks' halves of a batch are summed in another order than one rank's batch.
compare_runs "$tmp/straight.jsonl" "$tmp/run.jsonl" --steps 12 --rtol 1e-5

echo "== DP-KFAC: a 2-rank checkpoint resumes on 1 rank and says how its trajectory differs"
"$dkfac" train --nproc 2 "${common[@]}" --strategy dp --max-steps 4 --checkpoint-dir "$tmp/dp" \
  --metrics "$tmp/dp.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "the DP-KFAC run failed"; }
"$dkfac" train --nproc 1 "${common[@]}" --strategy dp --max-steps 7 --checkpoint-dir "$tmp/dp" --resume \
  --metrics "$tmp/dp.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "the DP-KFAC resume failed"; }
has "written by a 2-rank job, continued on 1 rank"
has "the trajectory differs from the 2-rank run's: DP-KFAC builds each layer's factors from its owner's own batch, now 64 examples instead of 32"
has "stopped at --max-steps 7"
python3 - "$tmp/dp.jsonl" <<'EOF'
import json, math, sys
steps = {e["step"]: e["loss"] for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "step"}
assert sorted(steps) == list(range(1, 8)), sorted(steps)
assert all(math.isfinite(v) for v in steps.values()), steps
EOF

echo "== a global batch the ranks cannot share"
refused 1 --nproc 2 --model mlp --dataset synthetic --global-batch-size 63 --max-steps 1
has "--global-batch-size 63 cannot be split over 2 ranks (63 is not a multiple of 2)"
echo "PASS"
