"""The package's layers, bottom up: every `vime` import (at module level or inside a function) goes to the
importer's own layer or one below it, so no two packages import each other. Read from the source (AST), so an
import that runs only on some path is checked too.

The code that runs inside vLLM's processes (`vime/engine/in_vllm`) has a rule of its own, on top of its layer: it
imports only `vime.utils`, the protocol it shares with vime (`vime/engine/protocol`) and itself, and nothing else in
vime imports it (vLLM loads it by the names in pyproject.toml's entry points and `engine.protocol.names`). Neither
package keeps state in module globals: what a patch needs lives on the vLLM object it serves."""

from __future__ import annotations

import ast
from pathlib import Path

VIME = Path(__file__).resolve().parents[2] / "vime"

# bottom up; a module imports only from its own layer or below. The folders are the processes (docs/architecture.md):
# driver/ (train.py's process), rollout/ with rollout/manager/ (the rollout manager actor), engine/ (vLLM's servers and
# the code that runs inside them), trainer/ (the training ranks), transport/ (rollouts and weights between them)
LAYERS = [
    "config",  # the run's typed config sections: imports nothing of vime
    "data",  # Sample (the central type every role passes), prompt datasets, the data source, the sample codec
    "utils",
    "engine.protocol",  # names and wire formats shared by vime and its code inside vLLM
    "engine.in_vllm",  # runs inside vLLM's processes: see IN_VLLM_IMPORTS
    "algorithms",
    "transport.rollouts",  # the data buffer: the manager writes rollouts, the training ranks read them
    "engine.control",  # vLLM engine processes, vllm-router, control calls, --vllm-*/--router-* flags
    "transport.weights",  # trainer -> engine weight updates, each a driver.py and a rank.py beside the protocol
    "trainer.megatron",  # Megatron-core model layer: model, conversion, checkpoints, CPU compatibility
    "trainer",  # the RL trainer on a training rank and its Ray actor (TrainActor)
    "rollout",  # the rollout function library: default rollout, rewards, filters, the rollout context
    "agents",
    "environments",  # --environment: reasoning-gym, verifiers, OpenEnv (over rollout and agents)
    "arguments",  # vime/arguments.py: every package's flags in one parser (the driver parses them)
    "plan",  # python -m vime.plan: each role's memory and the step's FLOPs from the flags (the driver checks it)
    "rollout_manager",  # the rollout manager actor and its engine fleet (start, health, recovery)
    "driver",  # train.py's process: placement, the loop's session, the training group's handle, weight sync
    "synthetic",  # builders of tiny models and task data (tests, examples, benches): nothing in vime imports them
    "inspect",  # python -m vime.inspect: reads what a run saved; nothing in vime imports it
    "docs_flags",  # python -m vime.docs_flags: the flag reference, from the parser
]
IN_VLLM = "engine.in_vllm"
IN_VLLM_IMPORTS = ("utils", "engine.protocol", IN_VLLM)  # all that code inside vLLM's processes may import
STATELESS = ("engine.protocol", IN_VLLM)  # packages whose module globals are constants only
CONSTANT_CALLS = {"frozenset", "tuple", "re.compile", "logging.getLogger"}  # calls that make such a constant
# import paths kept for plugins written against slime's layout, each only handing on the names of the module that
# now holds them: `from slime.utils.types import Sample` becomes vime.utils.types
RE_EXPORTS = {"vime.utils.types": "vime.data.sample"}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under vime ("vime.engine.control.engine" -> "engine.control"); a folder
    that only holds layers (vime.engine, vime.transport) is in its lowest."""
    parts = module.split(".")[1:]
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        if name in LAYERS:
            return name
    holder = [layer for layer in LAYERS if layer.startswith(f"{parts[0]}.")] if parts else []
    if holder and parts[1:] in ([], ["__init__"]):
        return holder[0]
    raise AssertionError(f"{module} is in no layer; add its package to LAYERS in {__file__}")


def vime_imports(path: Path, package: str = "") -> list[tuple[int, str]]:
    """(line, module) of every `vime.` import in a source file; relative ones resolved against `package` (the
    dotted package the file is in)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join([*base, *([node.module] if node.module else [])])))
    return [(line, m) for line, m in found if m == "vime" or m.startswith("vime.")]


def every_import():
    """(file, line, importer's layer, imported module) of every `vime` import under vime/."""
    for path in sorted(VIME.rglob("*.py")):
        relative = path.relative_to(VIME.parent).with_suffix("")
        if relative.parts[-1] == "__init__" and len(relative.parts) <= 2:
            continue  # vime/__init__.py
        here = layer_of(".".join(relative.parts))
        for line, module in vime_imports(path, ".".join(relative.parts[:-1])):
            yield f"{relative}.py", line, here, module


def upward_imports() -> list[str]:
    problems = []
    for where, line, here, module in every_import():
        if module == "vime":
            problems.append(f"{where}:{line} imports the vime package itself")
            continue
        there = layer_of(module)
        if LAYERS.index(there) > LAYERS.index(here):
            problems.append(f"{where}:{line} ({here}) imports {module} ({there}, a higher layer)")
    return problems


def in_vllm_crossing(here: str, module: str) -> str | None:
    """Why an import by a module of layer `here` breaks the in-vLLM rule; None when it keeps it."""
    there = layer_of(module)
    if here == IN_VLLM and there not in IN_VLLM_IMPORTS:
        return f"runs inside vLLM and imports {module} ({there}): it may import only {', '.join(IN_VLLM_IMPORTS)}"
    if here != IN_VLLM and there == IN_VLLM:
        return (f"imports {module}, which runs inside vLLM: vLLM loads it by name; share what both sides need "
                f"through vime.engine.protocol")
    return None


def in_vllm_crossings() -> list[str]:
    return [f"{where}:{line} {why}" for where, line, here, module in every_import() if module != "vime"
            and (why := in_vllm_crossing(here, module))]


def module_state(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each `global` statement in a source file, and of each module-level name bound to a mutable
    value (a dict, list or set, or what a call other than CONSTANT_CALLS returns)."""
    tree = ast.parse(path.read_text(), str(path))
    found = [(node.lineno, f"global {', '.join(node.names)}") for node in ast.walk(tree)
             if isinstance(node, ast.Global)]
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or \
                isinstance(value, ast.Call) and ast.unparse(value.func) not in CONSTANT_CALLS:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.append((node.lineno, " = ".join(map(ast.unparse, targets))))
    return found


def test_layer_of_names_the_deepest_listed_package():
    assert layer_of("vime.engine.control.engine") == "engine.control"
    assert layer_of("vime.engine") == "engine.protocol" and layer_of("vime.transport.__init__") == "transport.rollouts"
    assert layer_of("vime.rollout_manager.engine_fleet") == "rollout_manager"
    assert layer_of("vime.rollout.rm_hub.math") == "rollout"
    assert layer_of("vime.arguments") == "arguments"


def test_an_upward_import_is_found(tmp_path):
    """The walk sees imports inside functions, and would report one that runs up."""
    source = tmp_path / "x.py"
    source.write_text("import os\n\ndef f():\n    from vime.driver.placement import Placement\n"
                      "    import vime.utils.misc\n")
    assert vime_imports(source) == [(4, "vime.driver.placement"), (5, "vime.utils.misc")]
    source.write_text("from .math import f\nfrom .. import metrics\n")
    assert vime_imports(source, "vime.rollout.rm_hub") == [(1, "vime.rollout.rm_hub.math"), (2, "vime.rollout")]
    assert LAYERS.index(layer_of("vime.driver.placement")) > LAYERS.index(layer_of("vime.engine.control.x"))


def test_no_module_imports_from_a_higher_layer():
    assert not upward_imports(), "\n".join(upward_imports())


def test_a_crossing_into_or_out_of_vllm_is_found(tmp_path):
    """The in-vLLM rule would report code inside vLLM reaching into the rest of vime, and any module outside it
    importing what runs inside vLLM: a downward import, which layering alone lets pass."""
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from vime.engine.control.client import http\n"
                      "    from vime.utils.auth import serving_key\n    from . import route_auth\n"
                      "    from vime.engine.protocol.names import UPDATE_ROUTE\n")
    imports = vime_imports(source, "vime.engine.in_vllm")
    assert [in_vllm_crossing(IN_VLLM, m) is None for _, m in imports] == [False, True, True, True]
    source.write_text("from vime.engine.in_vllm.endpoint_plugin import run_update\n"
                      "from vime.engine.protocol.names import UPDATE_ROUTE\n")
    (_, inward), (_, shared) = vime_imports(source, "vime.driver")
    assert LAYERS.index(layer_of(inward)) < LAYERS.index("driver")  # not upward: the layers would let it pass
    assert "runs inside vLLM" in in_vllm_crossing("driver", inward) and in_vllm_crossing("driver", shared) is None


def test_kept_import_paths_only_hand_the_names_on():
    """A kept path (RE_EXPORTS) holds a docstring, imports from the module that now holds its names and `__all__`,
    nothing else, and every name it hands on is that module's own object."""
    import importlib

    for old, new in RE_EXPORTS.items():
        tree = ast.parse((VIME.parent / f"{old.replace('.', '/')}.py").read_text())
        kinds = [type(node).__name__ if not isinstance(node, ast.ImportFrom) else f"from {node.module}"
                 for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert kinds == [f"from {new}", "Assign"], f"{old} should only hand on {new}'s names: {kinds}"
        kept, home = importlib.import_module(old), importlib.import_module(new)
        assert kept.__all__ and all(getattr(kept, name) is getattr(home, name) for name in kept.__all__)


def test_code_inside_vllm_imports_only_utils_and_the_shared_protocol():
    assert not in_vllm_crossings(), "\n".join(in_vllm_crossings())


def test_module_state_is_found(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import re\n_CAPTURE = None\n_STORE = RoutingStore()\nSEEN = {}\nNAME = re.compile('x')\n"
                      "PATHS = frozenset({'/health'})\n\ndef capture():\n    global _CAPTURE\n")
    assert sorted(module_state(source)) == [(3, "_STORE"), (4, "SEEN"), (9, "global _CAPTURE")]


def test_code_inside_vllm_and_its_protocol_keep_no_module_state():
    paths = [path for package in STATELESS for path in sorted((VIME / package.replace(".", "/")).rglob("*.py"))]
    found = [f"{path.relative_to(VIME.parent)}:{line} {what}" for path in paths for line, what in module_state(path)]
    assert not found, "module-level state (hold it on the object that uses it):\n" + "\n".join(found)


MAX_MODULE_LINES = 400  # past this a module is doing more than one job: split it by concern (STYLE.md)


def long_modules(root: Path = VIME, limit: int = MAX_MODULE_LINES) -> list[str]:
    """Every module under `root` longer than `limit` lines, with its length."""
    found = [(len(path.read_text().splitlines()), path) for path in sorted(root.rglob("*.py"))]
    return [f"{path.relative_to(root.parent)}: {n} lines" for n, path in found if n > limit]


def test_a_long_module_is_found(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(tmp_path) == [f"{tmp_path.name}/pkg/long.py: {MAX_MODULE_LINES + 1} lines"]


def test_no_module_is_over_400_lines():
    assert not long_modules(), "split by concern:\n" + "\n".join(long_modules())
