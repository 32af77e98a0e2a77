#!/usr/bin/env bash
# A tiny model learns a reasoning-gym task on this machine's CPU, from nothing (no downloads):
#   1. install (.venv with the envs extra), build a tiny Qwen3 model and SFT data from reasoning-gym's DATASET at
#      the config TASK (`make_data.py`, another seed than the RL run's entries). The default is basic_arithmetic at
#      its first rung, one term of 3 to 5 digits ("Calculate 4719." -> 4719): what a 4-layer model learns in minutes
#      (it did not learn one-digit sums, nor copy a number out of chain_sum's longer question, in that time);
#   2. a short SFT warm-up (--loss-type sft_loss) so the model answers in <answer>...</answer>, reasoning-gym's format;
#   3. GRPO on `--environment reasoning_gym:$DATASET`: prompts and exact scores from reasoning-gym, its eval set
#      (the 64 entries after the training ones) scored every EVAL_INTERVAL rollouts.
# Results: $OUT/grpo/{metrics.jsonl,reward_curve.png}; eval/$DATASET/reward_mean is the eval reward.
# Shorter: SKIP_INSTALL=1 SFT_STEPS=20 NUM_ROLLOUT=10 OUT=/tmp/rg bash examples/reasoning_gym/run.sh
# Another task: DATASET=chain_sum TASK='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}' ...
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
OUT=${OUT:-outputs/reasoning_gym}
PY=${PY:-.venv/bin/python}
export VIME_PROGRESS=${VIME_PROGRESS:-1}
DATASET=${DATASET:-basic_arithmetic}
TASK=${TASK:-'{"min_terms": 1, "max_terms": 1, "min_digits": 3, "max_digits": 5, "operators": ["+"], "allow_parentheses": false}'}

[ -f "$OUT/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$OUT/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$OUT/data/sft.jsonl" ] || $PY examples/reasoning_gym/make_data.py --out "$OUT/data" --dataset "$DATASET" \
  --config "$TASK" --n 2048

echo "== SFT warm-up"
$PY train.py --overwrite-output --hf-checkpoint "$OUT/model" --prompt-data "$OUT/data/sft.jsonl" --label-key label \
  --apply-chat-template --rollout-shuffle --seed 1234 --micro-batch-size 32 \
  --debug-train-only --rollout-function-path vime.rollout.sft_rollout.generate_rollout --loss-type sft_loss \
  --rollout-batch-size 32 --n-samples-per-prompt 1 --num-rollout "${SFT_STEPS:-120}" --lr 2e-3 \
  --output-dir "$OUT/sft" --save-hf "$OUT/sft_hf"

echo "== GRPO on --environment reasoning_gym:$DATASET"
$PY train.py --overwrite-output --hf-checkpoint "$OUT/sft_hf" --apply-chat-template --rollout-shuffle --seed 1234 \
  --environment "reasoning_gym:$DATASET" --environment-args "{\"$DATASET\": $TASK}" \
  --reasoning-gym-size 1000 --reasoning-gym-system-prompt none --environment-eval-size 64 \
  --eval-interval "${EVAL_INTERVAL:-5}" --n-samples-per-eval-prompt 2 \
  --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout "${NUM_ROLLOUT:-60}" --rollout-max-response-len 16 \
  --micro-batch-size 32 --advantage-estimator grpo --lr 5e-4 --rollout-num-gpus 2 --vllm-dtype float32 \
  --vllm-max-model-len 256 --vllm-enforce-eager --output-dir "$OUT/grpo" "$@"

$PY - "$OUT/grpo/metrics.jsonl" "eval/$DATASET/reward_mean" <<'PY'
import json, sys
key = sys.argv[2]
evals = [r for r in map(json.loads, open(sys.argv[1])) if key in r]
print("eval reward by rollout:", [(r["rollout_id"], round(r[key], 3)) for r in evals])
print(f"eval reward {evals[0][key]:.3f} -> {evals[-1][key]:.3f}")
PY
echo "reward curve: $OUT/grpo/reward_curve.png; metrics: $OUT/grpo/metrics.jsonl"
