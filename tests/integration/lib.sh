# shellcheck shell=bash
# Shared by the integration test scripts (sourced after `set -euo pipefail`): the prologue every script
# repeated (fail, a scratch directory, checks on a command's output) and the multi-process helpers.

# Ends the test with a message.
fail() { echo "FAIL: $*"; exit 1; }

# Makes the scratch directory $tmp, removed when the script exits; CLEANUP (a command, evaluated at exit,
# e.g. killing the processes the test started) runs first.
scratch_dir() {
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064  # $1 is expanded now on purpose: the command is fixed when the trap is set
  trap "${1:+$1; }"'rm -rf "$tmp"' EXIT
}

# has TEXT [FILE] / lacks TEXT [FILE]: FILE (default $tmp/out) holds TEXT / does not; on failure FILE is printed.
has() {
  local file=${2:-$tmp/out}
  grep -qF -- "$1" "$file" || { cat "$file"; fail "$file lacks: $1"; }
}
lacks() {
  local file=${2:-$tmp/out}
  if grep -qF -- "$1" "$file"; then cat "$file"; fail "$file has: $1"; fi
}

# refused [EXIT_CODE] FLAGS...: `$dkfac train FLAGS...` must fail, with EXIT_CODE when one is given (1: dkfac
# refused it, 105: CLI11 refused a flag); its output is in $tmp/out.
refused() {
  local expected=""
  if [[ ${1-} =~ ^[0-9]+$ ]]; then expected=$1; shift; fi
  local rc=0
  "$dkfac" train "$@" > "$tmp/out" 2>&1 || rc=$?
  if [[ $rc == 0 ]]; then cat "$tmp/out"; fail "dkfac train $* succeeded"; fi
  if [[ -n $expected && $rc != "$expected" ]]; then cat "$tmp/out"; fail "dkfac train $* exited $rc, not $expected"; fi
}

# A free TCP port on the loopback interface, for a rendezvous.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Compares the per-step losses (and optionally final parameters) of two metrics files; see compare_runs.py.
compare_runs() { python3 "$(dirname "${BASH_SOURCE[0]}")/compare_runs.py" "$@"; }

# The device `dkfac train --device auto` chooses on this machine ("cpu" or "cuda:0"): dkfac's own view of the GPUs.
auto_device() {
  "$1" train --device auto --dataset synthetic --model mlp --epochs 1 --max-steps 0 --no-kfac --eval-examples 1 2>&1 \
    | sed -n 's/^train: .*, device \([^ ]*\).*/\1/p'
}

# Ends a GPU test with ctest's skip code (77) and the reason, unless a CUDA device is visible to `dkfac`.
require_cuda() {
  local device
  device=$(auto_device "$1")
  if [[ "$device" != cuda* ]]; then
    echo "SKIPPED: no CUDA device visible (dkfac train --device auto chose '${device:-nothing}')"
    exit 77
  fi
}
