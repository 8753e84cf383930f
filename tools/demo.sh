#!/usr/bin/env bash
# Run the wisv_ros demo: bash tools/demo.sh [args of python -m wisv_ros.cli.generate...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
# Convert the GGUF weights into the model cache once (seconds when already done).
python -m wisv_ros.cli.models prepare smollm2-135m-instruct qwen2.5-coder-1.5b-instruct
exec python -m wisv_ros.cli.generate "$@"
