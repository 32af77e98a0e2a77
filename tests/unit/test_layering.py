"""The package's layers, bottom up: every `vime` import (at module level or inside a function) goes to the
importer's own layer or one below it, so no two packages import each other. Read from the source (AST), so an
import that runs only on some path is checked too."""

from __future__ import annotations

import ast
from pathlib import Path

VIME = Path(__file__).resolve().parents[2] / "vime"

# bottom up; a module imports only from its own layer or below
LAYERS = [
    "utils",
    "algorithms",
    "data",
    "backends.vllm_utils",
    "backends.weight_transport",
    "backends.megatron_utils",
    "trainer",  # the RL trainer on a training rank, over megatron_utils (model, conversion, checkpoints)
    "rollout",
    "agents",
    "environments",  # --environment: reasoning-gym, verifiers, OpenEnv (over rollout and agents)
    "arguments",  # vime/arguments.py: every package's flags in one parser (the ray layer's session parses them)
    "ray",
    "synthetic",  # builders of tiny models and task data (tests, examples, benches): nothing in vime imports them
    "inspect",  # python -m vime.inspect: reads what a run saved; nothing in vime imports it
    "docs_flags",  # python -m vime.docs_flags: the flag reference, from the parser
]


def layer_of(module: str) -> str:
    """The layer of a dotted module name under vime ("vime.backends.vllm_utils.engine" -> "backends.vllm_utils")."""
    parts = module.split(".")[1:]
    if parts[:1] == ["backends"] and parts[1:] in ([], ["__init__"]):
        return LAYERS[3]  # the backends package itself: the lowest of its layers
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        if name in LAYERS:
            return name
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


def upward_imports() -> list[str]:
    problems = []
    for path in sorted(VIME.rglob("*.py")):
        relative = path.relative_to(VIME.parent).with_suffix("")
        if relative.parts[-1] == "__init__" and len(relative.parts) <= 2:
            continue  # vime/__init__.py
        here = layer_of(".".join(relative.parts))
        for line, module in vime_imports(path, ".".join(relative.parts[:-1])):
            if module == "vime":
                problems.append(f"{relative}.py:{line} imports the vime package itself")
                continue
            there = layer_of(module)
            if LAYERS.index(there) > LAYERS.index(here):
                problems.append(f"{relative}.py:{line} ({here}) imports {module} ({there}, a higher layer)")
    return problems


def test_layer_of_names_the_deepest_listed_package():
    assert layer_of("vime.backends.vllm_utils.engine") == "backends.vllm_utils"
    assert layer_of("vime.rollout.rm_hub.math") == "rollout"
    assert layer_of("vime.arguments") == "arguments"


def test_an_upward_import_is_found(tmp_path):
    """The walk sees imports inside functions, and would report one that runs up."""
    source = tmp_path / "x.py"
    source.write_text("import os\n\ndef f():\n    from vime.ray.placement import Placement\n    import vime.utils.misc\n")
    assert vime_imports(source) == [(4, "vime.ray.placement"), (5, "vime.utils.misc")]
    source.write_text("from .math import f\nfrom .. import metrics\n")
    assert vime_imports(source, "vime.rollout.rm_hub") == [(1, "vime.rollout.rm_hub.math"), (2, "vime.rollout")]
    assert LAYERS.index(layer_of("vime.ray.placement")) > LAYERS.index(layer_of("vime.backends.vllm_utils.x"))


def test_no_module_imports_from_a_higher_layer():
    assert not upward_imports(), "\n".join(upward_imports())


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
