# Helpers shared by the bash scripts a user or CI runs: scripts/demo, scripts/demo-client and
# scripts/check-demo. Sourced, not run; set SCRIPT_NAME first (it prefixes every message).
# The benchmark drivers (bench, bench-state, profile) are Python: scripts/sluicebench.
# shellcheck shell=bash

log() { echo "$SCRIPT_NAME: $*"; }
die() {
  echo "$SCRIPT_NAME: FAIL: $*" >&2
  exit 1
}

# missing_tools TOOL...: prints the tools that are not on PATH (nothing when all are).
missing_tools() {
  local tool absent=()
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || absent+=("$tool")
  done
  echo "${absent[*]}"
}

# now_ms: sets NOW_MS, the wall clock in milliseconds (bash 5's EPOCHREALTIME: no fork).
now_ms() {
  local t=${EPOCHREALTIME//[.,]/}
  # shellcheck disable=SC2034 # read by the sourcing script
  NOW_MS=$((10#$t / 1000))
}

# --- processes ---------------------------------------------------------------------------------
# Every background process a script starts goes into PIDS; stop_tracked stops them all by PID
# (never by name: other people's processes run on the same machine).
PIDS=()
# stop_tracked GRACE: SIGTERM to every tracked process, up to GRACE seconds for all of them to
# exit, then SIGKILL for what is left; reaps them and empties PIDS. Meant for the EXIT trap: it
# ignores SIGINT and SIGTERM from then on, so that a second Ctrl-C (or a TERM arriving while the
# script exits) cannot kill the script halfway through and leave processes behind.
stop_tracked() {
  local grace=$1 pid deadline
  trap '' INT TERM
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do kill -TERM "$pid" 2>/dev/null || true; done
  deadline=$((SECONDS + grace))
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}

# free_port: sets FREE_PORT to a port on 127.0.0.1 that nothing listens on now and that this
# script has not handed out already. The processes are then checked to have really started, so a
# port taken in between shows as a clear failure.
USED_PORTS=" "
free_port() {
  local port i
  for ((i = 0; i < 200; i++)); do
    port=$((20000 + RANDOM % 12000))
    case "$USED_PORTS" in *" $port "*) continue ;; esac
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      USED_PORTS+="$port "
      # shellcheck disable=SC2034 # read by the sourcing script
      FREE_PORT=$port
      return 0
    fi
  done
  die "no free port found on 127.0.0.1"
}
