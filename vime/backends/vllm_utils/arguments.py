"""vLLM engine flags (`--vllm-*`) and vllm-router flags (`--router-*`), generated from their own parsers.

We do not re-declare vLLM's ~250 engine options by hand: each option of vLLM's `AsyncEngineArgs` parser is
mirrored under a `--vllm-` prefix. The mirrored option records the raw command-line tokens it was given, so an
engine is started with exactly what the user typed, and vLLM's own parser validates them (`validate_vllm_args`).
vllm-router's Python `RouterArgs` already knows how to add itself with a `router-` prefix.
"""

from __future__ import annotations

import argparse
import functools

from vime.utils.device import training_dtype

# Options vime sets itself when it starts an engine; a user-given value would be silently overridden.
VIME_MANAGED_VLLM_OPTIONS = {"--model", "--host", "--port", "--served-model-name"}
VLLM_RAW_DEST = "vllm_raw_cli"  # namespace attribute holding the forwarded tokens


@functools.cache
def _vllm_engine_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


class _ForwardToVllm(argparse.Action):
    """Store the value under `vllm_<dest>` and remember the original tokens for the engine's command line."""

    def __init__(self, option_strings, dest, original_option, **kwargs):
        self.original_option = original_option
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string and option_string.startswith("--no-vllm-"):
            original, value = "--no-" + self.original_option[2:], False
        else:
            original, value = self.original_option, values if self.nargs != 0 else True
        tokens = [original] + ([] if self.nargs == 0 else values if isinstance(values, list) else [values])
        forwarded = dict(getattr(namespace, VLLM_RAW_DEST, None) or {})
        forwarded[self.dest] = tokens  # a repeated flag replaces the earlier one, as in argparse
        setattr(namespace, VLLM_RAW_DEST, forwarded)
        setattr(namespace, self.dest, value)


def add_vllm_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM engine", "Every vLLM engine option, prefixed with --vllm- (e.g. --vllm-max-model-len 2048)."
    )
    for action in _vllm_engine_parser()._actions:
        long_options = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not long_options or long_options[0] in VIME_MANAGED_VLLM_OPTIONS or action.dest == "help":
            continue
        original = long_options[0]
        options = ["--vllm-" + original[2:]]
        nargs = action.nargs
        if isinstance(action, argparse.BooleanOptionalAction):
            options.append("--no-vllm-" + original[2:])
            nargs = 0
        elif action.nargs == 0:  # store_true / store_const style
            nargs = 0
        help_text = (action.help or "").replace("%", "%%")
        group.add_argument(
            *options,
            dest="vllm_" + action.dest,
            action=_ForwardToVllm,
            original_option=original,
            nargs=nargs,
            default=None,
            choices=action.choices if nargs != 0 else None,
            metavar=action.metavar,
            help=f"vLLM: {help_text}"[:400],
        )
    parser.set_defaults(**{VLLM_RAW_DEST: {}})


def vllm_cli_tokens(args) -> list[str]:
    """The engine command-line options the user gave, in vLLM's own spelling."""
    return [tok for tokens in (getattr(args, VLLM_RAW_DEST, None) or {}).values() for tok in tokens]


def validate_vllm_args(args) -> argparse.Namespace:
    """Parse the forwarded options with vLLM's own parser so mistakes surface before any engine starts."""
    tokens = vllm_cli_tokens(args)
    try:
        return _vllm_engine_parser().parse_args(tokens)
    except SystemExit as e:
        raise ValueError(f"invalid --vllm-* option(s) {tokens}: see vLLM's message above") from e


_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def engine_dtype(args) -> str:
    """The dtype the engines compute in: --vllm-dtype when given, else the trainer's. (vLLM's own default,
    "auto", turns a float32 checkpoint into bfloat16 on CPU and float16 on GPU: the engines would then sample from
    another policy than the one trained, and on CPUs without bf16 units generate several times slower.)"""
    given = getattr(args, "vllm_dtype", None)
    return _DTYPE_ALIASES.get(given, given) if given else training_dtype(args)


def engine_dtype_warning(args) -> str | None:
    """What a --vllm-dtype other than the trainer's dtype costs, or None when they agree."""
    engine, trainer = engine_dtype(args), training_dtype(args)
    if engine == trainer:
        return None
    return (f"--vllm-dtype {args.vllm_dtype}: the engines sample in {engine} but the trainer computes in {trainer}, "
            "so rollout log-probs differ from the trainer's (train_rollout_logprob_abs_diff grows, and the "
            "importance ratios of the first optimizer step are no longer 1); drop --vllm-dtype to use the trainer's")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    from vllm_router.router_args import RouterArgs

    group = parser.add_argument_group("vllm-router", "vllm-router options, prefixed with --router-.")
    group.add_argument("--vllm-router-ip", default=None,
                       help="Address of an already running vllm-router; vime starts one when unset (default: None).")
    group.add_argument("--vllm-router-port", type=int, default=None,
                       help="Port of the router (started or external); a free port when unset (default: None).")
    sub = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(sub, use_router_prefix=True, exclude_host_port=True)
    for action in sub._actions:
        if action.dest in {"router_worker_urls"}:
            continue  # vime registers its engines itself
        help_text = (action.help or f"vllm-router's --{action.option_strings[0][len('--router-'):]}").replace("%", "%%")
        kwargs = dict(dest=action.dest, default=action.default, help=f"{help_text} (default: {action.default})")
        if isinstance(action, argparse._StoreTrueAction):
            kwargs["action"] = "store_true"
        elif isinstance(action, argparse._StoreAction):
            kwargs.update(type=action.type, nargs=action.nargs, choices=action.choices, metavar=action.metavar)
        else:
            kwargs["action"] = type(action)
            if action.nargs is not None:
                kwargs["nargs"] = action.nargs
        group.add_argument(*action.option_strings, **kwargs)
    # Round robin spreads load evenly, which is what a rollout (many independent requests) wants.
    parser.set_defaults(router_policy="round_robin")


def router_args_from(args, host: str, port: int, worker_urls: list[str]):
    """Build vllm-router's `RouterArgs` from vime's namespace."""
    from vllm_router.router_args import RouterArgs

    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k.startswith("router_")})
    ns.router_host, ns.router_port, ns.router_worker_urls = host, port, list(worker_urls)
    return RouterArgs.from_cli_args(ns, use_router_prefix=True)
