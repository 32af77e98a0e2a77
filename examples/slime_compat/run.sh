#!/usr/bin/env bash
# A slime-style launch script, run through vime's train.py unchanged: the MODEL_ARGS block of a Qwen3 model (here
# the tiny one this script builds) and the usual Megatron-LM training flags. 2 rollouts on this CPU.
#   --bf16 trains in float32 on CPU (with a warning); --attention-backend is accepted without effect.
# Results: outputs/slime_compat/{metrics.jsonl,config.yaml,reward_curve.png}.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -n "${SKIP_INSTALL:-}" ] || bash scripts/install.sh
OUT=${OUT:-outputs/slime_compat}
PY=${PY:-.venv/bin/python}

[ -f "$OUT/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$OUT/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$OUT/data/train.jsonl" ] || $PY -m vime.synthetic.arithmetic_data --out "$OUT/data" --task repeat \
  --train 64 --eval 16 --seed 0

# what slime's scripts/models/qwen3-*.sh hold, for the tiny model
MODEL_ARGS=(
  --swiglu
  --num-layers 4
  --hidden-size 256
  --ffn-hidden-size 768
  --num-attention-heads 4
  --group-query-attention
  --num-query-groups 2
  --kv-channels 64
  --use-rotary-position-embeddings
  --rotary-base 10000
  --disable-bias-linear
  --normalization RMSNorm
  --norm-epsilon 1e-6
  --qk-layernorm
  --vocab-size 512
  --untie-embeddings-and-output-weights
)

CKPT_ARGS=(
  --hf-checkpoint "$OUT/model"
  --save "$OUT/ckpt"
  --save-interval 2
)

ROLLOUT_ARGS=(
  --prompt-data "$OUT/data/train.jsonl"
  --input-key prompt
  --label-key label
  --apply-chat-template
  --rollout-shuffle
  --rm-type random  # the untrained tiny model scores 0 on the task: random rewards give the steps a gradient
  --num-rollout 2
  --rollout-batch-size 8
  --n-samples-per-prompt 4
  --rollout-max-response-len 24
  --rollout-temperature 1.0
  --global-batch-size 32
  --balance-data
)

PERF_ARGS=(
  --tensor-model-parallel-size 2
  --sequence-parallel
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --expert-model-parallel-size 1
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu 2048
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --use-kl-loss
  --kl-loss-coef 0.00
  --kl-loss-type low_var_kl
  --entropy-coef 0.00
  --eps-clip 0.2
  --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr 1e-6
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
)

MISC_ARGS=(
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
  --attention-backend flash
  --use-distributed-optimizer
  --bf16
)

$PY train.py \
  --actor-num-nodes 1 \
  --actor-num-gpus-per-node 2 \
  --rollout-num-gpus 1 \
  --vllm-max-model-len 256 \
  --overwrite-output \
  --output-dir "$OUT" \
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${MISC_ARGS[@]}" "$@"

echo "metrics: $OUT/metrics.jsonl; resolved flags: $OUT/config.yaml"
