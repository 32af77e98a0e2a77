#!/usr/bin/env bash
# Multi-agent RL on this machine's CPU: a solver and a checker (the same policy, two roles) cooperate on
# "repeat the number"; each role is trained on its own tokens with its own reward, as its own GRPO groups.
#   1. install (.venv), build a tiny Qwen3 model and the data locally (no downloads);
#   2. a short SFT warm-up (both roles' answer formats);
#   3. GRPO: the agent (examples/multi_agent/agent.py) chats with the policy through vime's OpenAI-compatible
#      endpoint with the `openai` client; vime records the exact tokens and trains both roles.
# Results: outputs/multi_agent/grpo/{metrics.jsonl,reward_curve.png,role_rewards.png,rollouts/}.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh
OUT=${OUT:-outputs/multi_agent}
PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the Ray rollout process imports examples.multi_agent.agent
export VIME_PROGRESS=${VIME_PROGRESS:-1}
SFT_ROLLOUTS=${SFT_ROLLOUTS:-120}
NUM_ROLLOUT=${NUM_ROLLOUT:-12}

[ -f "$OUT/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$OUT/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$OUT/data/sft.jsonl" ] || $PY -m examples.multi_agent.make_data --out "$OUT/data"

if [ ! -f "$OUT/sft_hf/config.json" ]; then
  echo "== SFT warm-up"
  $PY train.py --overwrite-output --hf-checkpoint "$OUT/model" --prompt-data "$OUT/data/sft.jsonl" --label-key label \
    --apply-chat-template --rollout-shuffle --seed 1234 --micro-batch-size 32 --debug-train-only \
    --rollout-function-path vime.rollout.sft_rollout.generate_rollout --loss-type sft_loss \
    --rollout-batch-size 32 --n-samples-per-prompt 1 --num-rollout "$SFT_ROLLOUTS" --lr 2e-3 \
    --output-dir "$OUT/sft" --save-hf "$OUT/sft_hf"
fi

echo "== GRPO, two agents"
# No --apply-chat-template: the agent receives the raw question and the endpoint applies the chat template.
$PY train.py --overwrite-output --hf-checkpoint "$OUT/sft_hf" --prompt-data "$OUT/data/train.jsonl" --label-key label \
  --rollout-shuffle --seed 1234 --micro-batch-size 32 \
  --custom-generate-function-path examples.multi_agent.agent.generate \
  --custom-rm-path vime.agents.harness.agent_reward \
  --rollout-function-path vime.agents.harness.generate_rollout \
  --router-policy consistent_hash \
  --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "$NUM_ROLLOUT" --rollout-max-response-len 24 \
  --advantage-estimator grpo --lr 5e-4 --rollout-num-gpus 1 --vllm-enforce-eager --vllm-dtype float32 \
  --vllm-max-model-len 256 --save-debug-rollout-data "$OUT/grpo/rollouts/{rollout_id}.jsonl" \
  --output-dir "$OUT/grpo" "$@"

$PY -m examples.multi_agent.role_rewards "$OUT/grpo"
