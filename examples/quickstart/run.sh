#!/usr/bin/env bash
# Quickstart: install, build a tiny model and the arithmetic task locally, then run vime on them with real vLLM
# engines behind vllm-router under Ray. Everything lands in outputs/quickstart/.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh
OUT=${OUT:-outputs/quickstart}
PY=.venv/bin/python
[ -f "$OUT/model/config.json" ] || $PY -m vime.tools.tiny_model --arch qwen3 --out "$OUT/model"
[ -f "$OUT/data/train.jsonl" ] || $PY -m vime.tools.arithmetic_data --out "$OUT/data" --train 256 --eval 32
exec $PY train.py \
  --hf-checkpoint "$OUT/model" --prompt-data "$OUT/data/train.jsonl" --label-key label --apply-chat-template \
  --rm-type math --eval-prompt-data arithmetic "$OUT/data/eval.jsonl" --eval-interval 2 \
  --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 32 --num-rollout 4 \
  --rollout-num-gpus 2 --vllm-dtype float32 --vllm-max-model-len 512 \
  --debug-rollout-only --save-debug-rollout-data "$OUT/rollouts/rollout_{rollout_id}.jsonl" \
  --output-dir "$OUT/run" "$@"
