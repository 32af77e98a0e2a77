"""Every flag is read through the typed section that defines it (vime/config), so a grep of a flag's name finds its
field and its readers, and no reader repeats a default: no `args.<flag>`, `self.args.<flag>`, `getattr(args,
"<flag>")` of a section's flag anywhere in vime/, and no `getattr(args, name, default)` at all. Read from the source
(AST); vime/config itself, which builds the sections from a namespace, is the one exception."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from vime.config import RunConfig

VIME = Path(__file__).resolve().parents[2] / "vime"
ENTRY_POINTS = [VIME.parent / "train.py", VIME.parent / "train_async.py"]  # the loops: they read flags too
# where a flag is read by a name computed at run time: the modules that forward a library's flags as they are
PASS_THROUGH_READERS = {
    "trainer/megatron/megatron_flags.py": "megatron-core's generated flags, by the names of its dataclasses",
    "engine/control/arguments.py": "vLLM's mirrored flags and the raw tokens given for them",
}
SECTION_FIELDS = {f.name for cls in RunConfig.sections().values() for f in dataclasses.fields(cls)}


def _is_namespace(node: ast.AST) -> bool:
    """`args`, or `<name>.args` (self.args, run.args, state.args): the names the run's namespace goes by."""
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute)
                                                                 and node.attr == "args")


def namespace_reads(source: str, pass_through: bool = False) -> list[tuple[int, str]]:
    """(line, what) of each read of a section's flag off a namespace, of each getattr with a default on one, and
    (unless the module forwards a library's flags: `pass_through`) of each getattr by a computed name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SECTION_FIELDS and _is_namespace(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and _is_namespace(node.args[0]):
            name = node.args[1]
            computed = not isinstance(name, ast.Constant)
            if len(node.args) == 3 or (computed and not pass_through) or getattr(name, "value", None) in SECTION_FIELDS:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_each_kind_of_namespace_read():
    source = ("def f(args, self):\n"
              "    a = args.rollout_batch_size\n"
              "    b = self.args.seed\n"
              "    c = getattr(args, 'rm_timeout')\n"
              "    d = getattr(args, name, None)\n"
              "    h = getattr(args, name)\n"
              "    e = args.vllm_max_model_len\n"  # a pass-through flag: forwarded, not a section's
              "    g = rollout.rollout_batch_size\n")
    assert [line for line, _ in namespace_reads(source)] == [2, 3, 4, 5, 6]
    assert [line for line, _ in namespace_reads(source, pass_through=True)] == [2, 3, 4, 5]


def test_no_flag_is_read_off_the_namespace_and_no_getattr_repeats_a_default():
    problems = []
    for path in sorted(VIME.rglob("*.py")):
        if path.relative_to(VIME).parts[0] == "config":
            continue
        relative = path.relative_to(VIME).as_posix()
        reads = namespace_reads(path.read_text(), pass_through=relative in PASS_THROUGH_READERS)
        problems += [f"vime/{relative}:{line}: {what}" for line, what in reads]
    for path in ENTRY_POINTS:
        problems += [f"{path.name}:{line}: {what}" for line, what in namespace_reads(path.read_text())]
    assert not problems, ("read each flag through its section (e.g. RolloutConfig.of(args).rollout_batch_size), "
                          "whose field holds the default:\n" + "\n".join(problems))
