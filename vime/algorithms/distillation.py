"""On-policy distillation (OPD): the student samples, a teacher scores the student's own tokens, and the student
is pulled toward the teacher by the per-token reverse KL, KL(student || teacher), estimated on those samples.

Two ways in, combinable with any advantage estimator (--opd-mode):
- reward: the per-token reward -coef * (log p_student(y_t) - log p_teacher(y_t)) is added to every trainable
  token's advantage after the estimator ran (not whitened, not discounted: each token is scored by the teacher);
- loss: coef * KL estimate (--opd-kl-type, k3 by default) of the current policy against the teacher is added to
  the loss, like the KL loss against a reference.

The student's log-probs in the reward are those it sampled with (the engine's rollout log-probs), so the reward
is the k1 estimate of the reverse KL, the quantity reported as train/opd_reverse_kl.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def opd_token_rewards(student_log_probs: Sequence[torch.Tensor], teacher_log_probs: Sequence[torch.Tensor],
                      loss_masks: Sequence[torch.Tensor], coef: float) -> list[torch.Tensor]:
    """coef * (log p_teacher - log p_student) on each trainable token (0 on masked ones): minus the k1 estimate
    of the reverse KL, scaled."""
    if not len(student_log_probs) == len(teacher_log_probs) == len(loss_masks):
        raise ValueError(f"opd: {len(student_log_probs)} student, {len(teacher_log_probs)} teacher log-prob "
                         f"sequences for {len(loss_masks)} loss masks")
    out = []
    for s, t, m in zip(student_log_probs, teacher_log_probs, loss_masks):
        if not len(s) == len(t) == len(m):
            raise ValueError(f"opd: a sequence has {len(s)} student, {len(t)} teacher log-probs and {len(m)} mask "
                             "entries")
        out.append(coef * (t.float() - s.float()) * m.float())
    return out
