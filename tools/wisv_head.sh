#!/usr/bin/env bash
# The WISV decision head for the default pair (Qwen2.5-Coder-0.5B drafting for 1.5B), end to end
# (resumable; CPU hours on a 2-core machine):
#   bash tools/wisv_head.sh [stage...]      stages: traces labels train tau eval (default: all)
# Environment: WISV_TRACES (trace folder, default data/traces/qwen in the checkout, so that labels
# paid for in CPU hours can be committed), WISV_MORE_TRACES (further labelled folders the train
# stage reads too, space-separated; default data/traces/qwen_s1 and qwen_s2, gsm_symbolic seeds 1
# and 2, where they exist), WISV_PROBLEMS (gsm_symbolic problems, default 400),
# WISV_THREADS (processes side by side for labelling and tau selection, default 2, one thread each),
# WISV_ROUND_S (compute time of one round that the CSI relabeling prices a repair against, default 0.1 s:
# a robot-class drafter and a GPU edge; on this CPU a round takes about 0.2 s and the link matters less).
# Traces and labels run on llama.cpp (the GGUF files, several times faster than torch on a CPU; labels
# must use the traces' engine). Every stage appends to / skips what exists, so an interrupted run
# continues where it stopped.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
cd "$ROOT"
TRACES="${WISV_TRACES:-data/traces/qwen}"  # relative: the sidecars record the command
PROBLEMS="${WISV_PROBLEMS:-400}"
THREADS="${WISV_THREADS:-2}"
ROUND_S="${WISV_ROUND_S:-0.1}"
HEADS=config/heads
MORE=()
for folder in ${WISV_MORE_TRACES-data/traces/qwen_s1 data/traces/qwen_s2}; do
  [[ -d "$folder" ]] && MORE+=(--traces "$folder")
done
stages=("$@")
((${#stages[@]})) || stages=(traces labels train tau eval)
python -m wisv_ros.cli.models prepare qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
for stage in "${stages[@]}"; do
  case "$stage" in
    traces) python -m wisv_ros.cli.traces collect --out "$TRACES" --problems "$PROBLEMS" --seed 0 --k 8 --threads 1 \
              --target-backend llama_cpp --drafter-backend llama_cpp ;;
    labels) pids=()
            for ((i = 0; i < THREADS; i++)); do
              python -m wisv_ros.cli.traces label --out "$TRACES" --batch-size 32 --threads 1 \
                --target-backend llama_cpp --shard "$i/$THREADS" & pids+=($!)
            done
            for pid in "${pids[@]}"; do wait "$pid"; done
            python -m wisv_ros.cli.traces summary --out "$TRACES" ;;
    train)  mkdir -p "$HEADS"  # the shipped heads' commands (their sidecars record them)
            H=(--hidden 64 --dropout 0.5 --lr 3e-4 --weight-decay 1e-2 --round-compute-s "$ROUND_S" --cv)
            python -m wisv_ros.cli.train_head --traces "$TRACES" "${MORE[@]}" --out "$HEADS/default.onnx" "${H[@]}"
            python -m wisv_ros.cli.train_head --traces "$TRACES" "${MORE[@]}" --out "$HEADS/default_no_csi.onnx" "${H[@]}" --no-csi ;;
    tau)    pids=()
            for ((i = 0; i < THREADS; i++)); do  # one process per core; the last to finish picks and writes tau
              python -m wisv_ros.cli.select_tau --head "$HEADS/default.onnx" --problems 60 --threads 1 \
                --target-backend llama_cpp --drafter-backend llama_cpp \
                --shard "$i/$THREADS" --write config/drafter.yaml --out runs/tau & pids+=($!)
            done
            for pid in "${pids[@]}"; do wait "$pid"; done ;;
    eval)   python -m wisv_ros.cli.system_bench --dataset gsm8k --limit 100 --max-new-tokens 320 \
              --target-backend llama_cpp --drafter-backend llama_cpp \
              --scenarios 20mbps_5ms,20mbps_50ms,500mbps_5ms,500mbps_50ms --configs greedy,fh,sh,adaptive \
              --k 8,16,32 --tau 0.02,0.1 --head "csi=$HEADS/default.onnx" \
              --head "no_csi=$HEADS/default_no_csi.onnx" --out runs/wisv_eval ;;
    *) echo "unknown stage '$stage' (traces labels train tau eval)" >&2; exit 2 ;;
  esac
done
