# Shared by the multi-process test scripts (sourced).

# A free TCP port on the loopback interface, for a rendezvous.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Compares the per-step losses (and optionally final parameters) of two metrics files; see compare_runs.py.
compare_runs() { python3 "$(dirname "${BASH_SOURCE[0]}")/compare_runs.py" "$@"; }
