#!/usr/bin/env bash
# Run the test suite: bash tools/test.sh [pytest args...] (default: test/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
# Convert the GGUF weights into the model cache once (seconds when already done).
python -m wisv_ros.cli.models prepare smollm2-135m-instruct gemma3-270m qwen2.5-coder-0.5b-instruct
# A domain of its own (1..101, from the PID) so parallel runs do not see each other's topics.
export ROS_DOMAIN_ID="${WISV_TEST_DOMAIN_ID:-$(($$ % 101 + 1))}"
# Fast DDS over UDP only. The tests kill nodes on purpose (SIGKILL); a process killed while it holds
# a Fast DDS shared-memory segment leaves it half made in /dev/shm, and every participant created
# later on the machine may then hang in its constructor (docs/running.md). Discovery range LOCALHOST
# always adds the shared-memory transport, so the suite discovers on the subnet, in a domain of its own.
export ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET
export FASTDDS_BUILTIN_TRANSPORTS=UDPv4
cd "$ROOT"
# Default to test/ unless a path (file, folder or file::test) is given.
has_path=0
for arg in "$@"; do [[ -e "${arg%%::*}" ]] && has_path=1; done
((has_path)) || set -- test/ "$@"
# The 15 slowest tests at the end: the suite must stay under 20 minutes on a 2-core CI machine.
exec python -m pytest -q --durations=15 "$@"
