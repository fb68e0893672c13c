# Shared by the multi-process test scripts (sourced).

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
