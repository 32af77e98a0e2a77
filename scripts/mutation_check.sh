#!/usr/bin/env bash
# Do the tests catch broken RL math? Applies each named mutation to a scratch copy of the checkout, runs the tests
# that should catch it there, and reports which tests failed (caught it). Exit code 1 when a mutation survives.
#
#   bash scripts/mutation_check.sh [NAME ...]      # all mutations, or the named ones; JSON report on stdout's last line
#   bash scripts/mutation_check.sh --targets       # only check each mutation's code is still there (CI runs this)
#
# The scratch copy is the checkout's tracked and unignored files (its .venv is used as it is); the mutated package is
# imported from the copy (PYTHONPATH), which the check verifies before it counts a run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${VIME_PYTHON:-$repo/.venv/bin/python}"
export VIME_PYTHON="$py"  # the scratch copy has no .venv: a test that runs this script again there uses this one
if [ "${1:-}" = "--targets" ]; then
  cd "$repo"  # reads only
else
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/vime-mutation.XXXXXX")"
  trap 'rm -rf "$scratch"' EXIT
  (cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$scratch" 2>/dev/null || true)
  cd "$scratch"
fi
exec "$py" - "$@" <<'PY'
"""Each mutation: a file, the exact text it replaces (which must occur exactly once), its replacement, and the
tests that should fail with it."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

OFF_POLICY = "tests/unit/test_policy_math_off_policy.py"
MUTATIONS = {
    "gspo_ratio_per_token": ("vime/algorithms/losses.py",
                             "ratio = torch.exp(_seq_sum(log_ratio, seq_ids, len(log_probs)) / n_tokens)[seq_ids]",
                             "ratio = torch.exp(log_ratio)", [OFF_POLICY]),
    "cispo_clip_removed": ("vime/algorithms/losses.py",
                           "weight = ratio.clamp(min=low, max=1.0 + eps_clip_high)", "weight = ratio", [OFF_POLICY]),
    "reinforce_pp_discount_one": ("vime/algorithms/advantages.py",
                                  "returns = _discounted_sum(_token_rewards(rewards, loss_masks, kl, kl_coef), "
                                  "loss_masks, gamma)",
                                  "returns = _discounted_sum(_token_rewards(rewards, loss_masks, kl, kl_coef), "
                                  "loss_masks, 1.0)", [OFF_POLICY]),
    "reinforce_pp_kl_reward_dropped": ("vime/algorithms/advantages.py",
                                       "_token_rewards(rewards, loss_masks, kl, kl_coef), loss_masks, gamma)",
                                       "_token_rewards(rewards, loss_masks, None, 0.0), loss_masks, gamma)",
                                       [OFF_POLICY]),
    "tis_weights_ignored": ("vime/trainer/micro_batch_loss.py",
                            "pg = [p * w for p, w in zip(pg, weights)]\n                metrics[\"tis_weight_mean\"]",
                            "pg = list(pg)\n                metrics[\"tis_weight_mean\"]", [OFF_POLICY]),
    "mis_rejection_ignored": ("vime/algorithms/rollout_correction.py",
                              "keep = ((weights >= low) & (weights <= high)) | ~mask", "keep = mask | ~mask",
                              [OFF_POLICY]),
    "group_normalisation_dropped": ("vime/algorithms/advantages.py", "centred = centred / (std + eps)",
                                    "centred = centred", [OFF_POLICY]),
    "clip_higher_ignored": ("vime/algorithms/losses.py",
                            "eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high\n"
                            "    unclipped",
                            "eps_clip_high = eps_clip\n    unclipped", [OFF_POLICY]),
    "dual_clip_removed": ("vime/algorithms/losses.py", "loss = torch.where(dual, cap, loss)", "pass", [OFF_POLICY]),
    "kl_loss_dropped": ("vime/trainer/micro_batch_loss.py", "loss = loss + algorithm.kl_loss_coef * kl",
                        "loss = loss", [OFF_POLICY]),
    "loss_input_device_move_removed": ("vime/trainer/micro_batch_loss.py",
                                       "mb = batch.select(indices, log_probs[0].device)",
                                       "mb = batch.select(indices)",
                                       ["tests/unit/test_device_placement.py::"
                                        "test_policy_loss_takes_the_batch_on_the_models_device"]),
    # the loss takes this rollout's entropy coefficient (--entropy-coef-schedule), not the flag's starting value
    "entropy_schedule_ignored": ("vime/trainer/micro_batch_loss.py", "loss = loss - entropy_coef * agg(entropy, masks)",
                                 "loss = loss - algorithm.entropy_coef * agg(entropy, masks)",
                                 ["tests/unit/test_rollout_correction.py::"
                                  "test_the_loss_takes_the_rollouts_entropy_coefficient"]),
    # Gated DeltaNet reads a packed micro-batch as one sequence: each sample starts from the state of the one before
    "recurrent_state_across_packed_sequences": ("vime/trainer/megatron/linear_attention.py",
                                                "        if packed_seq_params is not None:\n",
                                                "        if False:\n",
                                                ["tests/unit/test_packed_training.py::"
                                                 "test_recurrent_layers_keep_packed_sequences_apart"]),
    # the chunked gated delta rule forgets the decay inside a chunk
    "delta_rule_without_decay": ("vime/trainer/megatron/gated_delta_rule.py",
                                 "        outs.append(decay_c[..., None] * (q_c @ state) + qk_c @ u)",
                                 "        outs.append(q_c @ state + qk_c @ u)",
                                 ["tests/unit/test_gated_delta_rule.py"]),
}


def apply(path: str, old: str, new: str) -> str:
    text = Path(path).read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutation target not found exactly once in {path} (the code moved: update "
                         f"scripts/mutation_check.sh): {old!r}")
    Path(path).write_text(text.replace(old, new))
    return text


def run_tests(tests: list[str]) -> tuple[list[str], str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    check = subprocess.run([sys.executable, "-c", "import vime; print(vime.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not check.startswith(os.getcwd()):
        raise SystemExit(f"the scratch copy's vime is not the one imported ({check}); cannot judge mutations")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests], env=env,
                          capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    return failed, proc.stdout[-2000:] if proc.returncode not in (0, 1) else ""


def check_targets() -> int:
    for name, (path, old, _, _) in MUTATIONS.items():
        if Path(path).read_text().count(old) != 1:
            print(f"{name}: its target is not found exactly once in {path}; update scripts/mutation_check.sh")
            return 1
    print(f"{len(MUTATIONS)} mutation targets found")
    return 0


def main(names: list[str]) -> int:
    if names == ["--targets"]:
        return check_targets()
    unknown = set(names) - set(MUTATIONS)
    if unknown:
        raise SystemExit(f"unknown mutations {sorted(unknown)}; known: {sorted(MUTATIONS)}")
    start, report = time.time(), {}
    failed, trouble = run_tests(sorted({t for *_, tests in MUTATIONS.values() for t in tests}))
    if failed or trouble:
        raise SystemExit(f"the tests fail without any mutation, so they cannot judge one: {failed} {trouble}")
    for name in names or list(MUTATIONS):
        path, old, new, tests = MUTATIONS[name]
        original = apply(path, old, new)
        try:
            t0 = time.time()
            failed, trouble = run_tests(tests)
        finally:
            Path(path).write_text(original)
        report[name] = {"caught": bool(failed), "caught_by": failed, "seconds": round(time.time() - t0, 1)}
        if trouble:
            report[name]["error"] = trouble
        print(f"{name:34s} {'caught by ' + ', '.join(failed) if failed else 'SURVIVED'}", flush=True)
    survived = [n for n, r in report.items() if not r["caught"]]
    print(f"{len(report) - len(survived)}/{len(report)} mutations caught in {time.time() - start:.0f} s"
          + (f"; survived: {survived}" if survived else ""))
    print(json.dumps(report))
    return 1 if survived else 0


sys.exit(main(sys.argv[1:]))
PY
