"""No module-level mutable state in `vime/`: a run's state is an object its owner holds (the rollout context, the
engine fleet, the trainer), so two runs in one process (tests) never share it and a reader can see who owns what.

What the walk (AST, every module) reports: a module-level name rebound with `global`, and a module-level
container (a dict, list or set literal or comprehension; `dict()`, `defaultdict()`, `deque()`, ...) that the
module changes (an item assigned or deleted, `.append`, `.add`, `.update`, `.pop`, ...). What stays, named here
with why: registries that decorators fill as their module is imported (fixed once imports are done), and state
that is by nature the process's. `functools.cache` on a function is the way to write a per-process cache.
"""

from __future__ import annotations

import ast
from pathlib import Path

VIME = Path(__file__).resolve().parents[2] / "vime"

MUTATORS = {"append", "extend", "add", "update", "pop", "clear", "setdefault", "remove", "discard", "insert",
            "popitem", "appendleft"}
CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakValueDictionary",
                   "WeakKeyDictionary"}

ALLOWED = {
    # registries: filled by @register_* as their module is imported; fixed once imports are done
    ("agents/tools.py", "TOOLS"): "the tool registry (@register_tool)",
    ("algorithms/advantages.py", "ADVANTAGE_ESTIMATORS"): "the estimator registry",
    ("algorithms/losses.py", "POLICY_LOSSES"): "the policy-loss registry",
    ("rollout/rm_hub/registry.py", "RM_REGISTRY"): "the --rm-type registry",
    # the process's own
    ("driver/ray_auth.py", "_held_locks"): "the flock this process holds on its Ray token directory while it lives",
    ("utils/rendezvous.py", "_reserved"): "listening sockets this process bound for a group whose store it will "
                                          "serve, until that store takes them",
}


def _module_bindings(tree: ast.Module) -> dict[str, ast.expr]:
    bound = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            bound.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            bound[node.target.id] = node.value
    return bound


def _is_container(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in CONTAINER_CALLS
    return False


def _local_names(tree: ast.Module) -> set[str]:
    """Names some function binds itself (a parameter or an assignment), which may shadow a module-level one."""
    names = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
        names.update(a.arg for a in [*fn.args.args, *fn.args.kwonlyargs, *fn.args.posonlyargs])
        for node in ast.walk(fn) if not isinstance(fn, ast.Lambda) else ():
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def module_state(source: str) -> dict[str, str]:
    """{name: how it changes} of the module-level mutable state in a module's source."""
    tree = ast.parse(source)
    bound, found = _module_bindings(tree), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update({name: "rebound with `global`" for name in node.names})
    containers = {name for name, value in bound.items() if _is_container(value)} - _local_names(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(node.value, ast.Name) and node.value.id in containers):
            found.setdefault(node.value.id, "an item assigned or deleted")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in containers):
            found.setdefault(node.func.value.id, f".{node.func.attr}()")
    return found


def test_the_walk_finds_each_kind_of_module_state():
    source = ("_cache = {}\n_items: list = []\n_seen = set()\n_loop = None\nCONSTANT = {'a': 1}\n"
              "def f(x):\n    global _loop\n    _loop = x\n    _cache[x] = 1\n    _items.append(x)\n"
              "    _seen.add(x)\n    return CONSTANT['a']\n"
              "def g():\n    local = {}\n    local['k'] = 1\n")
    assert module_state(source) == {"_loop": "rebound with `global`", "_cache": "an item assigned or deleted",
                                    "_items": ".append()", "_seen": ".add()"}
    shadowed = "_cache = {}\ndef f(_cache):\n    _cache['k'] = 1\n"  # a parameter of the same name: not the module's
    assert module_state(shadowed) == {}


def test_no_module_level_mutable_state():
    found = []
    for path in sorted(VIME.rglob("*.py")):
        relative = path.relative_to(VIME).as_posix()
        for name, how in module_state(path.read_text()).items():
            if (relative, name) not in ALLOWED:
                found.append(f"vime/{relative}: {name} ({how})")
    assert not found, ("module-level mutable state; give it an owner (an object the run holds, the rollout "
                       "context) or make it a functools.cache:\n" + "\n".join(found))


def test_every_allowed_name_still_exists():
    """An entry whose state is gone is removed from ALLOWED, so the list never hides a new one of the same name."""
    stale = [f"{path}: {name}" for path, name in ALLOWED
             if name not in module_state((VIME / path).read_text())]
    assert not stale, stale
