#!/usr/bin/env bash
# An OpenAI Agents SDK agent trained with GRPO on this machine's CPU: an `agents.Agent` with one function tool
# (`get_price`) answers "How much does milk cost?"; the SDK talks to the policy through vime's Responses API route.
#   1. install (.venv), build a tiny Qwen3 model and the data locally (no downloads);
#   2. a multi-turn SFT warm-up on whole episodes as the endpoint renders the SDK's requests (tool call, tool
#      output, answer) from a sloppy teacher that looks up the wrong item half the time, so the reward starts low;
#   3. GRPO: each episode is `Runner.run(agent, ...)` (examples/agents_sdk/agent.py); vime records the exact
#      tokens of every model turn and trains them.
# Results: outputs/agents_sdk/grpo/{metrics.jsonl,reward_curve.png,rollouts/}.
# Smaller: SKIP_INSTALL=1 SFT_ROLLOUTS=20 NUM_ROLLOUT=3 OUT=/tmp/asdk bash examples/agents_sdk/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
OUT=${OUT:-outputs/agents_sdk}
PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the Ray rollout process imports examples.agents_sdk.agent
export VIME_PROGRESS=${VIME_PROGRESS:-1}
SFT_ROLLOUTS=${SFT_ROLLOUTS:-100}
NUM_ROLLOUT=${NUM_ROLLOUT:-12}

[ -f "$OUT/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$OUT/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$OUT/data/sft.jsonl" ] || $PY -m examples.agents_sdk.make_data --out "$OUT/data"

if [ ! -f "$OUT/sft_hf/config.json" ]; then
  echo "== multi-turn SFT warm-up"
  $PY train.py --overwrite-output --hf-checkpoint "$OUT/model" --prompt-data "$OUT/data/sft.jsonl" --label-key label \
    --tool-key tools --apply-chat-template --rollout-shuffle --seed 1234 --micro-batch-size 32 --debug-train-only \
    --rollout-function-path vime.agents.multi_turn.sft_generate_rollout --loss-type sft_loss \
    --rollout-batch-size 32 --n-samples-per-prompt 1 --num-rollout "$SFT_ROLLOUTS" --lr 2e-3 \
    --output-dir "$OUT/sft" --save-hf "$OUT/sft_hf"
fi

echo "== GRPO, Agents SDK agent with a function tool"
# No --apply-chat-template: the agent receives the raw question; the endpoint renders the SDK's requests.
# --rollout-max-response-len caps each model call (one tool call or one answer).
$PY train.py --overwrite-output --hf-checkpoint "$OUT/sft_hf" --prompt-data "$OUT/data/train.jsonl" --label-key label \
  --rollout-shuffle --seed 1234 --micro-batch-size 32 \
  --custom-generate-function-path examples.agents_sdk.agent.generate \
  --custom-rm-path vime.agents.harness.agent_reward --router-policy consistent_hash \
  --rollout-batch-size 8 --n-samples-per-prompt 8 --num-rollout "$NUM_ROLLOUT" --rollout-max-response-len 40 \
  --advantage-estimator grpo --lr 1e-4 --rollout-num-gpus 1 --vllm-enforce-eager --vllm-dtype float32 \
  --vllm-max-model-len 640 --save-debug-rollout-data "$OUT/grpo/rollouts/{rollout_id}.jsonl" \
  --output-dir "$OUT/grpo" "$@"

echo "reward curve: $OUT/grpo/reward_curve.png; metrics: $OUT/grpo/metrics.jsonl"
