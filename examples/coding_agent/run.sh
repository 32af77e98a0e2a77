#!/usr/bin/env bash
# Coding agent: a tiny model learns to write f(x), run it with the python tool (sandboxed), and answer with the code, on this machine's CPU (~9 minutes).
#   1. build a tiny Qwen3 model and coding tasks locally (no downloads);
#   2. multi-turn SFT warm-up on demonstrations (model turns trained, tool turns masked);
#   3. GRPO with multi-turn rollouts on a real vLLM engine: model turn -> python tool -> model turn; the final code is run against hidden tests in the sandbox, reward 1
#      when all pass. Rollouts (tokens, loss masks, log-probs, turns) are saved as JSONL.
# Smaller runs: SFT_STEPS=10 SFT_BATCH=8 GRPO_STEPS=2 OUT=/tmp/x bash examples/coding_agent/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
OUT=${OUT:-outputs/coding_agent}
PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # so that examples.coding_agent.agent imports everywhere

[ -f "$OUT/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$OUT/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$OUT/data/train.jsonl" ] || $PY examples/coding_agent/make_data.py --out "$OUT/data" --seed 0

COMMON=(--label-key label --tool-key tools --apply-chat-template --rollout-shuffle --seed 1234 --micro-batch-size 32)

echo "== multi-turn SFT warm-up"
$PY train.py --overwrite-output "${COMMON[@]}" --hf-checkpoint "$OUT/model" --prompt-data "$OUT/data/train.jsonl" \
  --debug-train-only --rollout-function-path vime.agents.multi_turn.sft_generate_rollout --loss-type sft_loss \
  --rollout-batch-size "${SFT_BATCH:-32}" --micro-batch-size "${SFT_BATCH:-32}" --n-samples-per-prompt 1 --num-rollout "${SFT_STEPS:-150}" --lr 2e-3 \
  --output-dir "$OUT/sft" --save-hf "$OUT/sft_hf"

echo "== GRPO with multi-turn tool-calling rollouts"
$PY train.py --overwrite-output "${COMMON[@]}" --hf-checkpoint "$OUT/sft_hf" --prompt-data "$OUT/data/train.jsonl" \
  --custom-generate-function-path examples.coding_agent.agent.generate --custom-rm-path examples.coding_agent.agent.reward \
  --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${GRPO_STEPS:-8}" --rollout-max-response-len 224 \
  --advantage-estimator grpo --lr 2e-5 --rollout-num-gpus 1 --vllm-enforce-eager --vllm-dtype float32 \
  --vllm-max-model-len 512 --save-debug-rollout-data "$OUT/grpo/rollouts/rollout_{rollout_id}.jsonl" \
  --output-dir "$OUT/grpo" "$@"

echo "metrics: $OUT/grpo/metrics.jsonl; rollouts: $OUT/grpo/rollouts/"
