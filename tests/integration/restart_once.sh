#!/usr/bin/env bash
# An elastic-agent worker that fails once: on the first attempt it trains FIRST_STEPS steps and then
# rank 1 exits 3, so the agent restarts every worker (TORCHELASTIC_RESTART_COUNT=1); later attempts run
# the command with --max-steps FINAL_STEPS. Usage: restart_once.sh FIRST_STEPS FINAL_STEPS dkfac train ARGS...
set -u
first_steps="$1"
final_steps="$2"
shift 2
if [[ "${TORCHELASTIC_RESTART_COUNT:-0}" == 0 ]]; then
  "$@" --max-steps "$first_steps" || exit $?
  [[ "$RANK" == 1 ]] && { echo "[rank 1] restart_once.sh: failing on purpose after $first_steps steps"; exit 3; }
  exit 0
fi
exec "$@" --max-steps "$final_steps"
