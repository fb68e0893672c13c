#!/usr/bin/env bash
# `dkfac train --nproc N`: a 2-rank job finishes, rank 0 alone reporting its progress and summary, and
# killing one of 3 ranks ends the job quickly with a message naming the lost rank.
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"
scratch_dir

echo "== 2 ranks, KAISA hybrid, triangles"
"$dkfac" train --nproc 2 --model mlp --dataset synthetic --epochs 1 --max-steps 12 --log-every 4 \
  --grad-worker-fraction 0.5 --symmetric-comm --metrics "$tmp/m.jsonl" > "$tmp/out.txt" 2>&1 || { cat "$tmp/out.txt"; exit 1; }
cat "$tmp/out.txt"
grep -q '"world_size":2' "$tmp/m.jsonl" || { echo "FAIL: no world_size 2 in the summary"; exit 1; }
grep -q '"factors":' "$tmp/m.jsonl" || { echo "FAIL: no factor traffic in the summary"; exit 1; }
grep -q '"ranks":\[{"comm_bytes"' "$tmp/m.jsonl" || { echo "FAIL: no per-rank table in the summary"; exit 1; }
python3 - "$tmp/m.jsonl" <<'PY' || { echo "FAIL: kfac_time_s is not format 3's per-phase object with its total"; exit 1; }
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
assert events[0]['event'] == 'run' and events[0]['format_version'] == 3, events[0]
phases = ['apply', 'communication', 'factors', 'precondition', 'second_order']
def check(t, where):
    assert sorted(t) == sorted(phases + ['total']), (where, t)
    assert abs(t['total'] - sum(t[p] for p in phases)) <= 1e-9 * max(1.0, t['total']), (where, t)
steps = [e for e in events if e['event'] == 'step']
summary = events[-1]
assert len(steps) == 3 and summary['event'] == 'summary', [e['event'] for e in events]
for e in steps + [summary]:
    check(e['kfac_time_s'], e['event'])
assert [r['rank'] for r in summary['ranks']] == [0, 1], summary['ranks']
for r in summary['ranks']:
    check(r['kfac_time_s'], 'rank %d' % r['rank'])
    assert r['kfac_time_s']['total'] > 0, r
# Rank 0's row is what rank 0's summary says.
assert summary['ranks'][0]['kfac_time_s'] == summary['kfac_time_s'], summary
PY
[[ $(grep -c '^summary: ' "$tmp/out.txt") == 1 ]] || { echo "FAIL: not exactly one summary line"; exit 1; }
[[ $(grep -c '^stopped at --max-steps' "$tmp/out.txt") == 1 ]] || { echo "FAIL: not exactly one stop line"; exit 1; }
[[ $(grep -c '^K-FAC layers' "$tmp/out.txt") == 1 ]] || { echo "FAIL: not exactly one header"; exit 1; }
! grep -q '^\[rank 1\]' "$tmp/out.txt" || { echo "FAIL: rank 1 printed progress"; exit 1; }

grep -q 'step plan: KAISA (kaisa), P=2 W=1 (2 columns)' "$tmp/out.txt" || { echo "FAIL: no plan header"; exit 1; }
! grep -q 'grad workers {' "$tmp/out.txt" || { echo "FAIL: per-layer plan lines without --print-plan"; exit 1; }

echo "== 2 ranks, SC20 layer-wise, separate factors, memory balance; --print-plan: each layer once, from rank 0"
"$dkfac" train --nproc 2 --model mlp --dataset synthetic --epochs 1 --max-steps 6 --log-every 3 \
  --strategy kaisa --grad-worker-fraction 0 --no-colocate-factors --balance memory --print-plan > "$tmp/lw.txt" 2>&1 || { cat "$tmp/lw.txt"; exit 1; }
grep -q '^summary: ' "$tmp/lw.txt" || { echo "FAIL: dkfac-lw run did not finish"; cat "$tmp/lw.txt"; exit 1; }
layers=$(grep -c '^  [^ ]* \[a=[0-9]*, g=[0-9]*\]: factors on every rank; A on rank [01], G on rank [01]; grad workers {[01]}$' "$tmp/lw.txt" || true)
header=$(grep '^K-FAC layers' "$tmp/lw.txt" | tr ',' '\n' | wc -l)
[[ $layers -ge 1 && $layers == "$header" ]] || { cat "$tmp/lw.txt"; echo "FAIL: $layers plan lines for $header layers"; exit 1; }

echo "== 2 ranks, SPD-KFAC: measured placement, fusion chosen after profiling and logged"
"$dkfac" train --nproc 2 --model mlp --dataset synthetic --epochs 1 --max-steps 8 --log-every 4 \
  --strategy spd --factor-update-steps 1 --inv-update-steps 2 > "$tmp/spd.txt" 2>&1 || { cat "$tmp/spd.txt"; exit 1; }
grep -q 'step plan: SPD-KFAC (spd), P=2' "$tmp/spd.txt" || { echo "FAIL: no SPD-KFAC step plan logged"; cat "$tmp/spd.txt"; exit 1; }
grep -q 'SPD-KFAC factor fusion .*collectives for 6 factors' "$tmp/spd.txt" \
  || { echo "FAIL: no fusion grouping logged"; cat "$tmp/spd.txt"; exit 1; }

echo "== 2 ranks, DP-KFAC: no factor or second-order traffic"
"$dkfac" train --nproc 2 --model mlp --dataset synthetic --epochs 1 --max-steps 6 --log-every 3 \
  --strategy dp --metrics "$tmp/dp.jsonl" > "$tmp/dp.txt" 2>&1 || { cat "$tmp/dp.txt"; exit 1; }
python3 - "$tmp/dp.jsonl" <<'PY' || { echo "FAIL: DP-KFAC moved factors or second-order state"; tail -1 "$tmp/dp.jsonl"; exit 1; }
import json, sys
summary = json.loads(open(sys.argv[1]).read().splitlines()[-1])
for rank in summary['ranks']:
    b = rank['comm_bytes']
    assert b['factors'] == 0 and b['second_order'] == 0 and b['gradients'] > 0, b
    # Every phase is listed; the ranks' agreement on a finite loss is one float per step.
    assert sorted(b) == sorted(['data_parallel', 'factors', 'second_order', 'gradients', 'calibration', 'setup',
                                'finite-check', 'control']), b
    assert b['finite-check'] == 6 * 4, b
PY

echo "== --accumulation-steps 4 (micro-batches of 16) equals batch 64, K-FAC and plain SGD"
source "$(dirname "$0")/lib.sh"
for kfac in --kfac --no-kfac; do
  for k in 1 4; do
    "$dkfac" train --nproc 2 --model cnn --dataset synthetic --max-steps 12 --batch-size 64 --log-every 1 $kfac \
      --factor-update-steps 1 --inv-update-steps 3 --accumulation-steps $k --metrics "$tmp/acc$k$kfac.jsonl" > "$tmp/acc$k.txt" 2>&1 \
      || { cat "$tmp/acc$k.txt"; exit 1; }
  done
  echo -n "$kfac: "
  compare_runs "$tmp/acc1$kfac.jsonl" "$tmp/acc4$kfac.jsonl" --steps 12 --rtol 1e-4
done

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
grep -q 'rank 1 failed (killed by signal 9 (Killed)' "$tmp/kill.txt" || { echo "FAIL: lost rank not named"; exit 1; }
(( elapsed < 60 )) || { echo "FAIL: took ${elapsed}s"; exit 1; }
echo "job ended ${elapsed}s after the kill, exit $rc"

echo "== ranks started with different options"
port=$(( 20000 + RANDOM % 20000 ))
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$dkfac" train --model mlp --dataset synthetic \
  --max-steps 2 --lr 0.05 --timeout 20 > "$tmp/r0.txt" 2>&1 &
r0=$!
set +e
RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$dkfac" train --model mlp --dataset synthetic \
  --max-steps 2 --lr 0.1 --timeout 20 > "$tmp/r1.txt" 2>&1
rc1=$?
wait "$r0"
rc0=$?
set -e
cat "$tmp/r0.txt" "$tmp/r1.txt"
[[ $rc0 -ne 0 && $rc1 -ne 0 ]] || { echo "FAIL: mismatched ranks must both fail ($rc0, $rc1)"; exit 1; }
for r in 0 1; do  # every rank says the same: the option, on which rank, and both values
  grep -q -- "rank 1 has '--lr 0.1' where rank 0 has '--lr 0.05'" "$tmp/r$r.txt" \
    || { echo "FAIL: rank $r does not name --lr on ranks 1 and 0"; exit 1; }
done
echo "== --strategy auto: rank 0's pick from the rates, run as that strategy would run"
"$dkfac" plan --measure-rates "$tmp/rates.json" --nproc 2 --compute-method inverse > "$tmp/out" 2>&1 \
  || { cat "$tmp/out"; fail "dkfac plan --measure-rates"; }
auto_run=(train --nproc 2 --model cnn --dataset synthetic --max-steps 6 --batch-size 32 --log-every 1 --threads 1
          --factor-update-steps 1 --inv-update-steps 3 --compute-method inverse)
"$dkfac" "${auto_run[@]}" --strategy auto --kfac-rates "$tmp/rates.json" --metrics "$tmp/auto.jsonl" > "$tmp/out" 2>&1 \
  || { cat "$tmp/out"; fail "--strategy auto"; }
has "step plan: strategy auto chooses it at the first step, from the rates in $tmp/rates.json"
has "strategy auto: 6 candidates"
has "batch 32 samples per rank per step, rates given"
# The pick as flags: "picked kaisa f=1/2 (W=1) triangles: ...", "picked spd: ...", "picked dp: ...".
picked=$(grep -o 'picked [^:]*' "$tmp/out" | head -1 | cut -d' ' -f2-)
flags=(--strategy "${picked%% *}")
if [[ $picked == kaisa* ]]; then
  w=$(sed -E 's/.*\(W=([0-9]+)\).*/\1/' <<< "$picked")
  flags+=(--grad-worker-fraction "$(python3 -c "print($w / 2)")")
  [[ $picked == *triangles ]] && flags+=(--symmetric-comm)
elif [[ $picked == spd ]]; then
  # The threshold auto predicted with (from the rates), as the plan after the choice prints it.
  flags+=(--spd-redundant-dim "$(grep -o 'factors of dim <= [0-9]*' "$tmp/out" | head -1 | grep -o '[0-9]*$')")
fi
echo "picked: $picked -> ${flags[*]}"
has "step plan: $(case ${picked%% *} in kaisa) echo KAISA;; spd) echo SPD-KFAC;; dp) echo DP-KFAC;; esac) (${picked%% *}), P=2"
"$dkfac" "${auto_run[@]}" "${flags[@]}" --metrics "$tmp/picked.jsonl" > "$tmp/picked.txt" 2>&1 \
  || { cat "$tmp/picked.txt"; fail "the picked strategy's run"; }
compare_runs "$tmp/auto.jsonl" "$tmp/picked.jsonl" --steps 6 --rtol 1e-5
# The re-check: after 2 profiled steps the measured phases are set against the prediction, and what it found
# and decided is printed (the rates were measured on this machine a moment ago: kept or chosen again alike).
"$dkfac" "${auto_run[@]}" --strategy auto --kfac-rates "$tmp/rates.json" --auto-recheck-steps 2 \
  --metrics "$tmp/recheck.jsonl" > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "--auto-recheck-steps 2"; }
has "strategy auto re-checked after 2 profiled steps (1 to 2): measured / predicted factors x"
refused --model mlp --dataset synthetic --strategy kaisa --kfac-rates "$tmp/rates.json"
has "--kfac-rates are for --strategy auto, but --strategy is kaisa"
refused --model mlp --dataset synthetic --kfac-memory-budget 1000
has "memory_budget applies to strategy auto only"

echo "6 passed, 0 failed"
