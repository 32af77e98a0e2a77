"""vLLM engine flags (`--vllm-*`) and vllm-router flags (`--router-*`), generated from their own parsers.

We do not re-declare vLLM's ~250 engine options by hand: each option of vLLM's `AsyncEngineArgs` parser is
mirrored under a `--vllm-` prefix. The mirrored option records the raw command-line tokens it was given, so an
engine is started with exactly what the user typed, and vLLM's own parser validates them (`validate_vllm_args`).
vllm-router's Python `RouterArgs` already knows how to add itself with a `router-` prefix.

Importing vLLM's parser takes about 6 s (most of a driver's start-up), so the mirrored options are kept as plain
data in a JSON cache keyed by the installed vLLM's source (`VIME_CACHE_DIR`, default ~/.cache/vime): vLLM is
imported once per installation. The table also says which values it can check alone (strings, plain numbers);
vLLM's parser is imported to validate only a value the table cannot judge (a JSON, a dataclass, "1k", ...).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from pathlib import Path

from vime.config.router import RouterConfig
from vime.config.train import WeightSyncConfig
from vime.config.section import add_flags, apply_defaults
from vime.engine.control.speculative import check_speculative
from vime.utils.device import training_dtype, use_gpu
from vime.utils.option_cache import cache_path, cached_table

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


_OPTION_TABLE_FORMAT = 2  # part of the cache key: bump when the table's fields change


def vllm_option_table() -> list[dict]:
    """vLLM's engine options as plain data, one dict per option ("option", "dest", "nargs", "boolean", "choices",
    "value", "metavar", "help"): from the cache when it holds the installed vLLM's, else from vLLM's parser (then
    cached). "value" says how vLLM reads a value (`_value_kind`)."""
    return cached_table(_option_table_cache(), _build_option_table)


def _build_option_table() -> list[dict]:
    table = []
    for action in _vllm_engine_parser()._actions:
        long_options = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not long_options or long_options[0] in VIME_MANAGED_VLLM_OPTIONS or action.dest == "help":
            continue
        boolean = isinstance(action, argparse.BooleanOptionalAction)
        nargs = 0 if boolean or action.nargs == 0 else action.nargs  # store_true / store_const: no value
        table.append({"option": long_options[0], "dest": action.dest, "nargs": nargs, "boolean": boolean,
                      # the forwarded values are the raw tokens, so choices compare as strings
                      "choices": [str(c) for c in action.choices] if action.choices and nargs != 0 else None,
                      "value": _value_kind(action.type), "metavar": _plain(action.metavar), "help": action.help or ""})
    return table


# vLLM's converters that take every plain integer (and more: "1k", "auto"): a plain integer needs no vLLM to check
_INTEGER_CONVERTERS = {"human_readable_int", "human_readable_int_or_auto"}


def _value_kind(convert) -> str | None:
    """"str", "int" or "float" when every such value is one vLLM accepts (a string, a number that int() / float()
    reads), None when only vLLM's own converter can judge a value (JSON, dataclass fields, ...)."""
    if convert is None or convert is str:
        return "str"
    if convert in (int, float):
        return convert.__name__
    name = getattr(convert, "__name__", "")
    if name in _INTEGER_CONVERTERS:
        return "int"
    if name == "_optional_type" and convert.__closure__:  # vLLM's optional_type(int): the wrapped type
        inner = convert.__closure__[0].cell_contents
        return inner.__name__ if inner in (str, int, float) else None
    return None


def _plain(metavar):
    """A metavar as JSON keeps it: None, a string, or a list of strings (vLLM lists the choices so)."""
    if metavar is None or isinstance(metavar, str):
        return metavar
    if isinstance(metavar, list):
        return [str(m) for m in metavar]
    return str(metavar)


def _option_table_cache() -> Path | None:
    """The cache file for the installed vLLM: named by its engine-arguments source, found without importing vLLM.
    None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    return cache_path("vllm-engine-options", [source], _OPTION_TABLE_FORMAT)


def add_vllm_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM engine", "Every vLLM engine option, prefixed with --vllm- (e.g. --vllm-max-model-len 2048)."
    )
    for option in vllm_option_table():
        original = option["option"]
        options = ["--vllm-" + original[2:]] + (["--no-vllm-" + original[2:]] if option["boolean"] else [])
        help_text = option["help"].replace("%", "%%")
        group.add_argument(
            *options,
            dest="vllm_" + option["dest"],
            action=_ForwardToVllm,
            original_option=original,
            nargs=option["nargs"],
            default=None,
            choices=option["choices"],
            metavar=option["metavar"],
            help=f"vLLM: {help_text}"[:400],
        )
    parser.set_defaults(**{VLLM_RAW_DEST: {}})


def vllm_cli_tokens(args) -> list[str]:
    """The engine command-line options the user gave, in vLLM's own spelling."""
    return [tok for tokens in given_vllm_tokens(args).values() for tok in tokens]


def given_vllm_tokens(args) -> dict[str, list[str]]:
    """{dest: the tokens given} of the --vllm-* flags; none on a namespace built without vLLM's flags (a test's, a
    slime-style script's), which starts engines with vLLM's defaults."""
    return vars(args).get(VLLM_RAW_DEST) or {}


def validate_vllm_args(args) -> None:
    """Check the forwarded options before any engine starts: from the option table when it can judge every value
    (names and choices argparse already checked), else with vLLM's own parser. Raises ValueError naming them."""
    given = given_vllm_tokens(args)
    kinds = {"vllm_" + o["dest"]: o["value"] for o in vllm_option_table()}
    if all(_plainly_valid(kinds.get(dest), tokens[1:]) for dest, tokens in given.items()):
        return
    parse_with_vllm(args)


def parse_with_vllm(args) -> argparse.Namespace:
    """The forwarded options as vLLM's own parser reads them (imports vLLM: about 6 s)."""
    tokens = vllm_cli_tokens(args)
    try:
        return _vllm_engine_parser().parse_args(tokens)
    except SystemExit as e:
        raise ValueError(f"invalid --vllm-* option(s) {tokens}: see vLLM's message above") from e


def _plainly_valid(kind: str | None, values: list[str]) -> bool:
    """Whether vLLM surely accepts these values of an option whose values are read as `kind`."""
    if kind is None:
        return not values  # a flag without a value; otherwise only vLLM can tell
    convert = {"str": str, "int": int, "float": float}[kind]
    try:
        for value in values:
            convert(value)
    except ValueError:
        return False  # vLLM may still read it ("1k"); its parser decides and names the mistake
    return True


_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def engine_dtype(args) -> str:
    """The dtype the engines compute in: --vllm-dtype when given, else the trainer's. (vLLM's own default,
    "auto", turns a float32 checkpoint into bfloat16 on CPU and float16 on GPU: the engines would then sample from
    another policy than the one trained, and on CPUs without bf16 units generate several times slower.)"""
    return given_engine_dtype(args) or training_dtype(args)


def given_engine_dtype(args) -> str | None:
    """--vllm-dtype in torch's spelling, or None when not given (the engines follow the trainer)."""
    given = args.vllm_dtype
    return _DTYPE_ALIASES.get(given, given) if given else None


def check_engines_can_serve(args, hf_config: dict) -> None:
    """Refuse, before anything starts, a checkpoint the engines of this install cannot serve as asked: an MTP
    speculative config it cannot draft with (`speculative.check_speculative`); vLLM's
    Qwen3.5 model code imports torchvision (absent from a CPU install where scripts/torchvision_cpu.py could not make
    it import), and vLLM's CPU Gated DeltaNet kernel (Qwen3-Next's linear attention) computes in bfloat16 only, which
    it asserts at the first forward."""
    if hf_config.get("model_type", "").startswith("qwen3_5") and importlib.util.find_spec("torchvision") is None:
        raise ValueError(f"{hf_config['model_type']}: vLLM's Qwen3.5 model code imports torchvision, which this "
                         "install lacks (scripts/install.sh removes it where scripts/torchvision_cpu.py cannot make "
                         "it import; run that script to see why); serve it from another install, or train from "
                         "saved rollouts (--debug-train-only)")
    check_speculative(args, hf_config)
    linear = "linear_attention" in (hf_config.get("layer_types") or [])
    check = WeightSyncConfig.of(args).check_weight_update_equal
    if linear and engine_dtype(args) != training_dtype(args) and check:
        raise ValueError(f"--check-weight-update-equal on {hf_config.get('model_type')} with {engine_dtype(args)} "
                         f"engines and a {training_dtype(args)} trainer: the rounding through its Gated DeltaNet "
                         "layers alone moves the check's probe by more than its 16-bit tolerance (0.109 against "
                         "5e-2 on a tiny model's own weights), so the check would report a mismatch on correct "
                         "weights; drop it (train_rollout_logprob_abs_diff, logged every rollout, shows an update "
                         "an engine missed)")
    if linear and not use_gpu() and engine_dtype(args) != "bfloat16":
        raise ValueError(f"{hf_config.get('model_type')} has Gated DeltaNet (linear-attention) layers, which vLLM's "
                         f"CPU engines compute in bfloat16 only, but the engines would run {engine_dtype(args)}: pass "
                         "--vllm-dtype bfloat16 (the trainer keeps its float32; train_rollout_logprob_abs_diff then "
                         "shows the engine's bfloat16 rounding)")


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
    add_flags(group, RouterConfig)
    sub = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(sub, use_router_prefix=True, exclude_host_port=True)
    vime_owned = set(RouterConfig.flag_names())
    for action in sub._actions:
        if action.dest in {"router_worker_urls", "router_api_key"}:
            continue  # vime registers its engines itself, and gives the router the run's serving key
        help_text = (action.help or f"vllm-router's --{action.option_strings[0][len('--router-'):]}").replace("%", "%%")
        if action.dest in vime_owned:  # vime's default, from its section, not vllm-router's
            kwargs = dict(dest=action.dest, help=f"{help_text} (default: %(default)s)")
        else:
            kwargs = dict(dest=action.dest, default=action.default, help=f"{help_text} (default: {action.default})")
        if isinstance(action, argparse._StoreTrueAction):
            kwargs["action"] = "store_true"
        elif isinstance(action, argparse._StoreAction):
            kwargs.update(type=action.type, nargs=action.nargs, choices=action.choices, metavar=action.metavar)
        else:
            kwargs["action"] = type(action)
            if action.nargs is not None:
                kwargs["nargs"] = action.nargs
        group.add_argument(*action.option_strings, **kwargs)  # vime's own defaults: vime.config.router
    apply_defaults(parser, RouterConfig)  # defaults: vime/config


def router_args_from(args, host: str, port: int, worker_urls: list[str], api_key: str | None = None):
    """Build vllm-router's `RouterArgs` from vime's namespace. `api_key`: what the router sends to the engines
    (the run's serving key), in place of any --router-api-key."""
    from vllm_router.router_args import RouterArgs

    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k.startswith("router_")})
    ns.router_host, ns.router_port, ns.router_worker_urls = host, port, list(worker_urls)
    if ns.router_prometheus_port is None:  # vllm-router serves one whatever it is told: a free loopback port
        from vime.utils.misc import find_free_port

        ns.router_prometheus_port = find_free_port()
        ns.router_prometheus_host = "127.0.0.1"
    if api_key is not None:
        ns.router_api_key = api_key
    return RouterArgs.from_cli_args(ns, use_router_prefix=True)
