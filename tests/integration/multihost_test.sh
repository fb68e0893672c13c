#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces A and B joined by a veth pair, ranks 0-1 in A and ranks
# 2-3 in B, rendezvous over the veth addresses (torchrun-style environment, Gloo bound to the veth).
#  1. 4 ranks across the two namespaces train with every step's loss equal to `--nproc 4` on one host;
#  2. bringing the link down ends every rank non-zero, within the timeout, with a message.
# Needs root (ip netns); skipped with a message (ctest exit code 77) when namespaces cannot be created.
set -euo pipefail
dkfac="$1"
source "$(dirname "$0")/lib.sh"
id=$$
ns_a="dkfac_a_$id" ns_b="dkfac_b_$id" veth_a="dka$((id % 100000))" veth_b="dkb$((id % 100000))"
subnet="10.213.$((id % 250)).0"
addr_a="${subnet%.0}.1" addr_b="${subnet%.0}.2"
tmp=$(mktemp -d)
pids=()
cleanup() {
  kill -9 "${pids[@]}" 2>/dev/null || true
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

setup_network() {
  command -v ip >/dev/null &&
    ip netns add "$ns_a" && ip netns add "$ns_b" &&
    ip link add "$veth_a" type veth peer name "$veth_b" &&
    ip link set "$veth_a" netns "$ns_a" && ip link set "$veth_b" netns "$ns_b" &&
    ip -n "$ns_a" addr add "$addr_a/24" dev "$veth_a" && ip -n "$ns_b" addr add "$addr_b/24" dev "$veth_b" &&
    ip -n "$ns_a" link set lo up && ip -n "$ns_b" link set lo up &&
    ip -n "$ns_a" link set "$veth_a" up && ip -n "$ns_b" link set "$veth_b" up
}
if ! setup_network 2> "$tmp/network.txt"; then
  echo "SKIP: cannot set up two network namespaces joined by a veth pair here (needs root and iproute2): $(cat "$tmp/network.txt")"
  exit 77
fi
echo "namespaces $ns_a ($addr_a) and $ns_b ($addr_b) joined by $veth_a-$veth_b"

port=29411
# Ranks 0-1 in A, 2-3 in B; extra args go to train.
start_ranks() {
  local tag=$1; shift
  pids=()
  for r in 0 1 2 3; do
    local ns=$ns_a ifname=$veth_a
    if ((r >= 2)); then ns=$ns_b ifname=$veth_b; fi
    ip netns exec "$ns" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) MASTER_ADDR="$addr_a" MASTER_PORT=$port \
      DKFAC_GLOO_IFNAME="$ifname" "$dkfac" train --model mlp --dataset synthetic --log-every 1 "$@" \
      > "$tmp/$tag.$r.txt" 2>&1 &
    pids+=($!)
  done
}

echo "== 4 ranks over the veth pair vs 4 local processes"
steps=40
"$dkfac" train --nproc 4 --model mlp --dataset synthetic --epochs 3 --max-steps $steps --log-every 1 \
  --metrics "$tmp/local.jsonl" > "$tmp/local.txt" 2>&1 || { cat "$tmp/local.txt"; exit 1; }
start_ranks veth --epochs 3 --max-steps $steps --metrics "$tmp/veth.jsonl"
for r in 0 1 2 3; do wait "${pids[$r]}" || { echo "FAIL: rank $r"; cat "$tmp/veth.$r.txt"; exit 1; }; done
echo -n "$steps steps across two namespaces against one host: "
compare_runs "$tmp/local.jsonl" "$tmp/veth.jsonl" --steps $steps --rtol 1e-6

echo "== link cut: every rank ends non-zero within the timeout"
timeout_s=15
start_ranks cut --epochs 100 --timeout $timeout_s
for _ in $(seq 1 240); do grep -q "step 3/" "$tmp/cut.0.txt" 2>/dev/null && break; sleep 0.25; done
grep -q "step 3/" "$tmp/cut.0.txt" || { echo "FAIL: never reached step 3"; cat "$tmp/cut.0.txt"; exit 1; }
start=$(date +%s)
ip -n "$ns_a" link set "$veth_a" down
for r in 0 1 2 3; do
  set +e; wait "${pids[$r]}"; rc=$?; set -e
  elapsed=$(( $(date +%s) - start ))
  echo "rank $r: exit $rc after ${elapsed}s: $(grep -m1 'error' "$tmp/cut.$r.txt" | cut -c1-240)"
  [[ $rc -ne 0 ]] || { echo "FAIL: rank $r exited 0"; cat "$tmp/cut.$r.txt"; exit 1; }
  grep -qi "error" "$tmp/cut.$r.txt" || { echo "FAIL: rank $r gave no message"; cat "$tmp/cut.$r.txt"; exit 1; }
  (( elapsed <= timeout_s + 10 )) || { echo "FAIL: rank $r took ${elapsed}s"; exit 1; }
done
echo "every rank stopped with a message after the link went down"
