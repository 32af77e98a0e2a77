#!/usr/bin/env bash
# On-policy distillation on the quickstart task, on this machine's CPU (~3 minutes after the quickstart's SFT).
#   1. the quickstart's SFT model (made here if outputs/quickstart has none) is the student;
#   2. the teacher is the same model at temperature TEACHER_TEMPERATURE (no training needed:
#      vime.synthetic.tempered_model): 0.5 by default, a sharper, more decisive teacher;
#   3. GRPO on the task's reward plus the teacher's per-token reward -(log p_student - log p_teacher) on the
#      student's own samples (--opd-mode reward; --opd-mode loss adds the KL to the loss instead), real vLLM
#      engines and Megatron-core. train/opd_reverse_kl (the k1 estimate of KL(student || teacher)) falls.
# Measured here (10 rollouts): T=0.5: reverse KL 0.170 -> 0.058, task reward 0.25 -> 0.71; T=2 (a warmer, flatter
# teacher): reverse KL 0.698 -> 0.283 while the task reward falls 0.25 -> 0.0, the student following a teacher
# that answers worse: distillation pulls toward the teacher whatever it is worth (--opd-coef weighs the two).
# Results: $OUT/opd/metrics.jsonl; the reverse KL at the first and last rollout is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install.sh
QS=${QS:-outputs/quickstart}
OUT=${OUT:-outputs/opd}
PY=.venv/bin/python

[ -f "$QS/model/config.json" ] || $PY -m vime.synthetic.tiny_model --arch qwen3 --out "$QS/model" --seed 0 \
  --hidden-size 256 --num-layers 4 --num-heads 4 --num-kv-heads 2 --intermediate-size 768
[ -f "$QS/data/train.jsonl" ] || $PY -m vime.synthetic.arithmetic_data --out "$QS/data" --task repeat \
  --train 512 --eval 64 --seed 0
COMMON=(--label-key label --apply-chat-template --rollout-shuffle --seed 1234 --micro-batch-size 32)
if [ ! -f "$QS/sft_hf/config.json" ]; then
  echo "== SFT warm-up (the quickstart's)"
  $PY train.py --overwrite-output "${COMMON[@]}" --hf-checkpoint "$QS/model" --prompt-data "$QS/data/train.jsonl" \
    --debug-train-only --rollout-function-path vime.rollout.sft_rollout.generate_rollout --loss-type sft_loss \
    --rollout-batch-size 32 --n-samples-per-prompt 1 --num-rollout 40 --lr 2e-3 \
    --output-dir "$QS/sft" --save-hf "$QS/sft_hf"
fi

echo "== the teacher: the student at temperature ${TEACHER_TEMPERATURE:-0.5}"
$PY -m vime.synthetic.tempered_model --src "$QS/sft_hf" --out "$OUT/teacher" --temperature "${TEACHER_TEMPERATURE:-0.5}"

echo "== GRPO + on-policy distillation"
$PY train.py --overwrite-output "${COMMON[@]}" --hf-checkpoint "$QS/sft_hf" --prompt-data "$QS/data/train.jsonl" \
  --rm-type math --opd-teacher-checkpoint "$OUT/teacher" --opd-mode "${OPD_MODE:-reward}" \
  --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout "${NUM_ROLLOUT:-10}" --rollout-max-response-len 24 \
  --advantage-estimator grpo --lr 5e-4 --rollout-num-gpus 2 --vllm-max-model-len 256 --vllm-enforce-eager \
  --output-dir "$OUT/opd" "$@"

$PY - "$OUT/opd/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
kl = [(r["rollout_id"], r["train/opd_reverse_kl"]) for r in rows if "train/opd_reverse_kl" in r]
print(f"reverse KL to the teacher: rollout {kl[0][0]} {kl[0][1]:.4f} -> rollout {kl[-1][0]} {kl[-1][1]:.4f}")
PYEOF
