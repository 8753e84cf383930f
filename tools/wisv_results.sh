#!/usr/bin/env bash
# Publish the WISV evaluation of runs/wisv_eval: the report into docs/results/wisv/ and the decoded data
# (answers, round logs, the target alone's traces; gzip) into docs/results/wisv/runs/, from which
#   bash tools/wisv_results.sh --restore
# then `python -m wisv_ros.cli.evaluate replay --dataset gsm8k --out runs/wisv_eval --k 8 --k 16 --k 32 --copy off`
# prices everything again without decoding (report as below). Idempotent. The report keeps the
# published row of a system whose raw data is not in runs/wisv_eval (`evaluate report --keep-published`):
# the runs before 2026-12-05 were published as tables only, their raw data never reached the repository.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/tools/env.sh"
cd "$ROOT"
RUN=runs/wisv_eval/gsm8k
PUB=docs/results/wisv/runs
if [[ "${1:-}" == "--restore" ]]; then
  mkdir -p "$RUN/rounds" "$RUN/answers"
  cp "$PUB"/problems.csv "$PUB"/config.json "$PUB"/live_*.csv "$RUN/"
  gunzip -c "$PUB/traces.jsonl.gz" >"$RUN/traces.jsonl"
  for f in "$PUB"/rounds/*.jsonl.gz; do gunzip -c "$f" >"$RUN/rounds/$(basename "${f%.gz}")"; done
  for f in "$PUB"/answers/*.jsonl.gz; do gunzip -c "$f" >"$RUN/answers/$(basename "${f%.gz}")"; done
  exit 0
fi
python -m wisv_ros.cli.evaluate report --dataset gsm8k --out runs/wisv_eval --results docs/results/wisv --readme "" --keep-published
mkdir -p "$PUB/rounds" "$PUB/answers"
cp "$RUN"/problems.csv "$RUN"/config.json "$RUN"/live_*.csv "$PUB/"
gzip -9nc "$RUN/traces.jsonl" >"$PUB/traces.jsonl.gz"
for f in "$RUN"/rounds/*.jsonl; do
  case "$(basename "$f")" in greedy_k*|target_only*) continue ;; esac  # replayed from the traces
  gzip -9nc "$f" >"$PUB/rounds/$(basename "$f").gz"
done
for f in "$RUN"/answers/*.jsonl; do gzip -9nc "$f" >"$PUB/answers/$(basename "$f").gz"; done
