#!/usr/bin/env bash
# Tool use: a tiny model learns to call a calculator and box its answer, on this machine's CPU (~6 minutes).
#   1. build a tiny Qwen3 model and calculator tasks locally (no downloads);
#   2. multi-turn SFT warm-up on demonstrations (model turns trained, tool turns masked);
#   3. GRPO with multi-turn rollouts on a real vLLM engine: model turn -> calculator -> model turn, reward 1
#      for the right boxed number. Rollouts (tokens, loss masks, log-probs, turns) are saved as JSONL.
# Smaller runs: SFT_STEPS=10 SFT_BATCH=8 GRPO_STEPS=2 OUT=/tmp/x bash examples/tool_use/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
OUT=${OUT:-outputs/tool_use}
PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # so that examples.tool_use.agent imports everywhere

[ -f "$OUT/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$OUT/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$OUT/data/train.jsonl" ] || $PY examples/tool_use/make_data.py --out "$OUT/data" --seed 0

COMMON=(--label-key label --tool-key tools --apply-chat-template --rollout-shuffle --seed 1234 --micro-batch-size 32)

echo "== multi-turn SFT warm-up"
$PY train.py --overwrite-output "${COMMON[@]}" --hf-checkpoint "$OUT/model" --prompt-data "$OUT/data/train.jsonl" \
  --debug-train-only --rollout-function-path vime.agents.multi_turn.sft_generate_rollout --loss-type sft_loss \
  --rollout-batch-size "${SFT_BATCH:-32}" --micro-batch-size "${SFT_BATCH:-32}" --n-samples-per-prompt 1 --num-rollout "${SFT_STEPS:-200}" --lr 2e-3 \
  --output-dir "$OUT/sft" --save-hf "$OUT/sft_hf"

echo "== GRPO with multi-turn tool-calling rollouts"
$PY train.py --overwrite-output "${COMMON[@]}" --hf-checkpoint "$OUT/sft_hf" --prompt-data "$OUT/data/train.jsonl" \
  --custom-generate-function-path examples.tool_use.agent.generate --custom-rm-path examples.tool_use.agent.reward \
  --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${GRPO_STEPS:-8}" --rollout-max-response-len 160 \
  --advantage-estimator grpo --lr 2e-5 --rollout-num-gpus 1 --vllm-enforce-eager --vllm-dtype float32 \
  --vllm-max-model-len 512 --save-debug-rollout-data "$OUT/grpo/rollouts/rollout_{rollout_id}.jsonl" \
  --output-dir "$OUT/grpo" "$@"

echo "metrics: $OUT/grpo/metrics.jsonl; rollouts: $OUT/grpo/rollouts/"
