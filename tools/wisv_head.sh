#!/usr/bin/env bash
# The WISV decision heads of the default pair (Qwen2.5-Coder-0.5B drafting for 1.5B) and their evaluation
# on the 100 GSM8K problems, end to end (resumable; CPU hours on a 2-core machine):
#   bash tools/wisv_head.sh [stage...]      stages: traces labels train eval report (default: these), search
# traces/labels: gsm_symbolic problems (generated offline; never the GSM8K test set), traced and labelled
#   on llama.cpp in the folders of WISV_FOLDERS (default the four committed ones; new problems are traced
#   into the last). train: the shipped heads config/heads/qwen.onnx (CSI relabeling) and qwen_no_csi.onnx
#   (the ablation), each with its tau per channel in its sidecar. eval: the GSM8K decodes of docs/wisv.md
#   (token-wise, docs/evaluation.md), two at a time, in the order of docs/wisv.md. report:
#   docs/results/wisv/ and its data (tools/wisv_results.sh).
# search (not in the default): labels along the path accepted tokens take (AutoJudge's search,
#   docs/wisv.md) into WISV_SEARCH_FOLDERS (default data/traces/qwen_aj_s6 and _s7, gsm_symbolic seeds 6 and
#   7, whose answers under way it replays from partial.jsonl), one process per folder, WISV_SEARCH_PROBLEMS
#   problems each (default 300), then the oracle and the shipped head on every searched folder's labels.
# Environment: WISV_FOLDERS, WISV_PROBLEMS (problems to trace into the last folder, default 60),
# WISV_JOBS (processes side by side, one thread each, default 2), WISV_ROUND_S (compute time of one round
# the CSI relabeling prices a repair against, default 0.1 s: a robot-class drafter and a GPU edge).
# Every stage appends to / skips what exists, so an interrupted run continues where it stopped.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
cd "$ROOT"
read -r -a FOLDERS <<<"${WISV_FOLDERS:-data/traces/qwen data/traces/qwen_s1 data/traces/qwen_s2 data/traces/qwen_s3}"
PROBLEMS="${WISV_PROBLEMS:-60}"
JOBS="${WISV_JOBS:-2}"
ROUND_S="${WISV_ROUND_S:-0.1}"
HEADS=config/heads
OUT=runs/wisv_eval
TRACES=()
for folder in "${FOLDERS[@]}"; do TRACES+=(--traces "$folder"); done
LAST="${FOLDERS[-1]}"
seed_of() { python -c "import json,sys; print(json.load(open(sys.argv[1] + '/meta.json'))['source'].split('seed ')[1])" "$1"; }
schedule() { python -c "import json,sys; print(json.load(open(sys.argv[1]))['tau_per_channel'])" "${1%.onnx}.json"; }

# Run the commands of a file (one per line) JOBS at a time; every command resumes by itself.
run_jobs() {
  local -a pids=()
  while IFS= read -r cmd; do
    [[ -z "$cmd" ]] && continue
    bash -c "$cmd" & pids+=($!)
    if ((${#pids[@]} >= JOBS)); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done <"$1"
  for pid in "${pids[@]}"; do wait "$pid"; done
}

stages=("$@")
((${#stages[@]})) || stages=(traces labels train eval report)
python -m wisv_ros.cli.models prepare qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
for stage in "${stages[@]}"; do
  case "$stage" in
    traces) python -m wisv_ros.cli.traces collect --out "$LAST" --problems "$PROBLEMS" --seed "$(seed_of "$LAST")" \
              --k 8 --max-new-tokens 512 --threads 1 --target-backend llama_cpp --drafter-backend llama_cpp ;;
    labels) for folder in "${FOLDERS[@]}"; do
              pids=()
              for ((i = 0; i < JOBS; i++)); do
                python -m wisv_ros.cli.traces label --out "$folder" --batch-size 32 --threads 1 \
                  --target-backend llama_cpp --shard "$i/$JOBS" & pids+=($!)
              done
              for pid in "${pids[@]}"; do wait "$pid"; done
            done
            python -m wisv_ros.cli.traces summary "${TRACES[@]/--traces/--out}" --fly ;;
    search) read -r -a SEARCH <<<"${WISV_SEARCH_FOLDERS:-data/traces/qwen_aj_s6 data/traces/qwen_aj_s7}"
            pids=()
            for folder in "${SEARCH[@]}"; do
              python -m wisv_ros.cli.traces search --out "$folder" --problems "${WISV_SEARCH_PROBLEMS:-300}" \
                --seed "${folder##*_s}" --k 32 --max-new-tokens 512 --slots 16 --threads 1 \
                --target-backend llama_cpp --drafter-backend llama_cpp & pids+=($!)
            done
            for pid in "${pids[@]}"; do wait "$pid"; done
            ALL=(data/traces/qwen_aj_s*)
            python -m wisv_ros.cli.traces oracle "${ALL[@]/#/--out=}" --head "$HEADS/qwen.onnx" ;;
    train)  # The shipped heads' commands (their sidecars record them): labels that say whether a right answer
            # turns wrong, four channel draws per answer, grouped 5-fold cross-validation and tau per channel.
            H=(--label harmful --hidden 64 --dropout 0.5 --lr 3e-4 --weight-decay 1e-2 --round-compute-s "$ROUND_S"
               --channels 4 --epochs 10 --channel-epochs 10 --cv --folds 5 --accuracy-budget 1)
            python -m wisv_ros.cli.train_head "${TRACES[@]}" --out "$HEADS/qwen.onnx" "${H[@]}" &
            python -m wisv_ros.cli.train_head "${TRACES[@]}" --out "$HEADS/qwen_no_csi.onnx" "${H[@]}" --no-csi &
            wait ;;
    eval)   mkdir -p runs
            TW="python -m wisv_ros.cli.evaluate tokenwise --dataset gsm8k --out $OUT"
            W="$TW --method wisv --k 32"
            {
              echo "$TW --method greedy"
              # The shipped schedules (each head's sidecar) and tau 0.05 (a lenient point: the CSI head's channel
              # response at a fixed tau), fly at its most permissive setting within the budget, K 16 and 8.
              CSI="$W --head $HEADS/qwen.onnx --tau-per-channel $(schedule $HEADS/qwen.onnx)"
              echo "$CSI --channel 20mbps_50ms"
              echo "$W --head $HEADS/qwen.onnx --tau 0.05 --channel 20mbps_50ms"
              echo "$W --head $HEADS/qwen_no_csi.onnx --tau-per-channel $(schedule $HEADS/qwen_no_csi.onnx) --channel 20mbps_50ms"
              echo "$TW --method fly --k 32 --fly-entropy 0.6 --fly-window 1"
              echo "$W --head $HEADS/qwen.onnx --tau 0.02 --channel 20mbps_50ms"
              echo "$W --head $HEADS/qwen_no_csi.onnx --tau 0.01 --channel 20mbps_50ms"  # the CSI head's tau, no CSI
              echo "$W --head $HEADS/qwen.onnx --tau 0.05 --channel 500mbps_5ms"
              for ch in 500mbps_50ms 500mbps_5ms 20mbps_5ms; do echo "$CSI --channel $ch"; done
              for ch in 500mbps_50ms 20mbps_5ms; do echo "$W --head $HEADS/qwen.onnx --tau 0.05 --channel $ch"; done
              for k in 16 8; do echo "$TW --method wisv --k $k --head $HEADS/qwen.onnx --tau 0.05 --channel 20mbps_50ms"; done
            } >"runs/wisv_eval.jobs"
            run_jobs runs/wisv_eval.jobs ;;
    report) python -m wisv_ros.cli.evaluate replay --dataset gsm8k --out "$OUT" --k 8 --k 16 --k 32 --copy off
            bash tools/wisv_results.sh ;;  # the report into docs/results/wisv/, the decoded data beside it
    *) echo "unknown stage '$stage' (traces labels train eval report)" >&2; exit 2 ;;
  esac
done
