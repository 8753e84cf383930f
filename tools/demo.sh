#!/usr/bin/env bash
# Run the wisv_ros demo: bash tools/demo.sh [args of python -m wisv_ros.cli.generate...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
exec python -m wisv_ros.cli.generate "$@"
