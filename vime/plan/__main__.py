"""python -m vime.plan <train.py flags> [--gpu-memory-gib 80] [--json] [--plan-device cpu]

Prints, per device of each role (a trainer rank, PPO's critic, an engine), what it holds and its predicted peak,
whether that fits, and the step's counted FLOPs and tokens. The flags are train.py's, checked as train.py checks
them (the model's config is read from --hf-checkpoint; nothing is loaded). Exit code 1 when a role does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_GPU_GIB = 80.0  # an H100, where --gpu-memory-gib is not given

def _own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m vime.plan", add_help=False, allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plan-device", choices=["cuda", "cpu"], default="cuda",
                        help="plan for GPUs (default) or this CPU trainer's float32 (as validated here)")
    return parser.parse_known_args(argv)


def render(plan) -> str:
    lines = [f"memory plan for devices of {plan.gpu_memory_gib:g} GiB; layout {plan.layout}"]
    for role, r in plan.roles.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_gib"].items() if v)
        extra = f", KV cache for {r['kv_cache_tokens']:,} tokens" if "kv_cache_tokens" in r else ""
        beside = f" + {r['beside_gib']:.1f} GiB of the resident engine" if r.get("beside_gib") else ""
        lines.append(f"  {role:8s} peak {r['peak_gib']:8.2f} GiB{beside}  {'fits' if r['fits'] else 'DOES NOT FIT'}"
                     f"  ({parts}{extra})")
    lines.append(f"  step: {plan.flops_per_step / 1e12:,.1f} TFLOP (counted, useful) over {plan.tokens_per_step:,} "
                 "tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vime.arguments import parse_args
    from vime.config.run import PlacementConfig
    from vime.plan.run_plan import how_to_fit, plan_run

    own, rest = _own_flags(list(sys.argv[1:] if argv is None else argv))
    args = parse_args(rest)
    plan = plan_run(args, PlacementConfig.of(args).gpu_memory_gib or DEFAULT_GPU_GIB, device=own.plan_device)
    print(json.dumps(plan.as_json(), indent=1) if own.json else render(plan))
    if plan.unfit():
        print(f"does not fit: {how_to_fit(plan)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
