#!/usr/bin/env bash
# The wisv_ros demo: the whole system as separate processes, one prompt through the Generate action.
#
#   bash tools/demo.sh [launch arguments name:=value] [--set node.param:=value] [ask options]
#   bash tools/demo.sh --max-new-tokens 48
#   bash tools/demo.sh scenario:=500mbps_5ms --set drafter.k:=4 --prompt "Explain odometry drift."
#
# 1. tools/setup.sh (idempotent) and the model conversion (seconds once done);
# 2. `python -m wisv_ros.cli.launch system`: drafter_node + link monitor in /robot, verifier_node +
#    link monitor in /edge, link_emulator_node in between (20 Mbit/s, 50 ms by default), each a
#    process of its own; their log goes to runs/demo/launch.log;
# 3. `python -m wisv_ros.cli.ask`: waits until both models are loaded, sends the prompt, streams
#    the text, prints the stats table;
# 4. stops the graph (SIGTERM to the launcher, which stops every node) also on Ctrl-C or error.
# The in-process version (both models in one process, with a target-only comparison) is
# `python -m wisv_ros.cli.generate`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

launch_args=()
ask_args=()
while (($#)); do
  case "$1" in
    -h|--help)
      sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      echo; echo "Launch arguments (name:=value) of the system configuration:"
      # shellcheck disable=SC1091
      source "$ROOT/tools/env.sh" && python -m wisv_ros.cli.launch system --show-args
      echo; python -m wisv_ros.cli.ask --help
      exit 0 ;;
    --set) (($# >= 2)) || { echo "demo.sh: --set needs node.param:=value" >&2; exit 2; }
      launch_args+=("$1" "$2"); shift 2 ;;
    --set=*) launch_args+=("--set" "${1#--set=}"); shift ;;
    -*) ask_args+=("$1"); shift
      # an option's value (anything that is not itself an option)
      if (($#)) && [[ "$1" != -* && "$1" != *:=* ]]; then ask_args+=("$1"); shift; fi ;;
    *:=*) launch_args+=("$1"); shift ;;
    *) echo "demo.sh: unexpected argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

bash "$ROOT/tools/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
# Convert the GGUF weights into the model cache once (seconds when already done).
python -m wisv_ros.cli.models prepare --gguf-only qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

LOG_DIR="$ROOT/runs/demo"
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/launch.log"
python -m wisv_ros.cli.launch system "${launch_args[@]}" >"$LOG" 2>&1 &
LAUNCHER=$!
stop_graph() {
  if kill -0 "$LAUNCHER" 2>/dev/null; then
    echo "demo: stopping the graph" >&2
    kill -TERM "$LAUNCHER" 2>/dev/null || true
    wait "$LAUNCHER" 2>/dev/null || true
  fi
}
trap stop_graph EXIT
trap 'exit 130' INT TERM
echo "demo: started the system graph (launcher pid $LAUNCHER; node log: ${LOG#"$ROOT"/})" >&2

set +e
python -m wisv_ros.cli.ask --launcher-pid "$LAUNCHER" "${ask_args[@]}"
rc=$?
set -e
if ((rc != 0)); then
  echo "demo: ask failed (exit $rc); last lines of ${LOG#"$ROOT"/}:" >&2
  tail -n 20 "$LOG" | sed 's/^/    /' >&2
fi
stop_graph
grep -E '^\[launch\] ' "$LOG" | tail -n 5 | sed 's/^/demo: /' >&2
exit "$rc"
