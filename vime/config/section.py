"""The machinery of the run's typed config: a section is a frozen dataclass of the flags one component owns.

Its fields are the destinations of its flags, spelled as slime-style `args` carries them (`rollout_batch_size`
for `--rollout-batch-size`), so a grep of a flag's name finds its field and every reader. A flag is written once,
as its field: the type annotation, the default and the help (`flag()`), from which `add_flags` declares it on the
command line (`train.py --help`, YAML `--config`); the package's `*arguments.py` only places sections in groups and
keeps the validation that ties sections together.

- `RunConfig.build` (vime/config/run_config.py) makes every section once, at the entry point, and checks each
  value against its field's type (`check_types`).
- A component reads its flags through its section: `RolloutConfig.of(args)` takes the run's namespace, or a
  partial one a slime-style caller built, whose missing flags take their defaults, instead of a
  `getattr(args, name, default)` repeating a default at each reader.
- Fields that no flag sets but validation derives (`use_critic`) are declared with `derived()`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Literal, TypeVar, Union

S = TypeVar("S", bound="Section")
DERIVED = "derived"  # field metadata key: validation fills the value; no flag sets it
FLAG = "flag"  # field metadata key: how its flag reads on the command line (`flag()`)
_ABSENT = object()


def derived(default: Any = None) -> Any:
    """A field validation derives from other flags (no flag of its own); `default` before validation ran."""
    return dataclasses.field(default=default, metadata={DERIVED: True})


def flag(default: Any = None, help: str = "", *, choices: tuple | None = None, metavar: str | None = None,
         nargs: str | None = None, action: Any = None, parse: Callable[[str], Any] | None = None,
         part: str | None = None) -> Any:
    """A field set by the flag `--<field-name-with-dashes>`: its default and its `--help` text (argparse's
    `%(default)s` works), and what the type annotation does not say (`add_flags` reads the rest from it): `choices`
    (else a Literal's values), `metavar`, `nargs` or `action` (else a bool is a switch, a list takes one or more
    values; a list with its own `parse` takes one value, which `parse` makes the list), `parse` (argparse's `type=`,
    else the annotation's int or float). `part`: the `--help` group of a section whose flags show in several
    (`add_flags(group, Section, part=...)`). A list default is copied per use."""
    spec = {"help": help, "choices": choices, "metavar": metavar, "nargs": nargs, "action": action, "parse": parse,
            "part": part}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={FLAG: spec})
    return dataclasses.field(default=default, metadata={FLAG: spec})


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of a config section; subclasses are `@dataclasses.dataclass(frozen=True)`."""

    @classmethod
    def of(cls: type[S], args: Any) -> S:
        """This section of `args` (the run's namespace, a partial one a slime-style caller built, or None): each
        field from `args`, or its flag's default where `args` has no such attribute."""
        values = {}
        for name, default, factory in _defaults(cls):
            value = getattr(args, name, _ABSENT)
            values[name] = value if value is not _ABSENT else default() if factory else default
        return cls(**values)

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        """The destinations of this section's flags (derived fields left out)."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get(DERIVED))

    def check(self) -> None:
        """Refuse values of this section's flags that are wrong on their own, with a ValueError naming the flag
        and how to fix it. Rules that tie flags of several sections together stay with the validation of the
        package that owns the flags (`vime/*/arguments.py`)."""

    def named(self, *fields: str) -> list[tuple[str, Any]]:
        """(--flag-name, value) of each of `fields`, for a check that loops over several flags."""
        return [("--" + name.replace("_", "-"), getattr(self, name)) for name in fields]


def section_defaults(cls: type[Section]) -> dict[str, Any]:
    """{field: default} of a section (a fresh copy of each list a field's default factory makes)."""
    return {name: default() if factory else default for name, default, factory in _defaults(cls)}


@functools.cache
def _defaults(cls: type[Section]) -> tuple[tuple[str, Any, bool], ...]:
    """(field, default or default factory, whether it is a factory) of each field of `cls`."""
    return tuple((f.name, f.default_factory, True) if f.default is dataclasses.MISSING else (f.name, f.default, False)
                 for f in dataclasses.fields(cls))


def add_flags(group: argparse._ActionsContainer, *sections: type[Section], part: str | None = None) -> None:
    """Declare on `group` (a parser or an argument group) the flag of each `flag()` field of `sections` (those of
    `part` only, for a section shown in several groups), in field order, with the field's default, help and the
    argparse settings its annotation implies."""
    for cls in sections:
        defaults = section_defaults(cls)
        for f in dataclasses.fields(cls):
            if FLAG in f.metadata and f.metadata[FLAG]["part"] == part:
                group.add_argument("--" + f.name.replace("_", "-"), default=defaults[f.name],
                                   **_argparse_settings(_hints(cls)[f.name], f.metadata[FLAG]))


def _argparse_settings(hint: Any, spec: dict) -> dict[str, Any]:
    """add_argument's keywords for a field of type `hint` declared by `flag()`'s `spec`."""
    settings: dict[str, Any] = {"help": spec["help"]}
    if spec["metavar"] is not None:
        settings["metavar"] = spec["metavar"]
    action, nargs, hint = spec["action"], spec["nargs"], _without_none(hint)
    if hint is bool:  # a switch: store_true, or the action given (--x / --no-x), which takes no parser
        return {**settings, "action": action or "store_true"}
    if action is not None:
        settings["action"] = action
    if typing.get_origin(hint) in (list, tuple):  # values of the item type: one or more, or one per use
        one_value = action in ("append", "extend") or spec["parse"] is not None
        nargs = nargs or (None if one_value else "+")
        hint = _without_none(typing.get_args(hint)[0]) if typing.get_args(hint) else str
    if nargs is not None:
        settings["nargs"] = nargs
    choices = spec["choices"] or (typing.get_args(hint) if typing.get_origin(hint) is Literal else None)
    if choices is not None:
        settings["choices"] = choices
        hint = type(choices[0])
    parse = spec["parse"] or (hint if hint in (int, float) else None)
    if parse is not None:
        settings["type"] = parse
    return settings


def _without_none(hint: Any) -> Any:
    """`X` of `X | None` (and of `Optional[X]`); any other hint as it is."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        rest = [h for h in typing.get_args(hint) if h is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def apply_defaults(parser: argparse.ArgumentParser, *sections: type[Section]) -> None:
    """Give every flag of `parser` that a section owns the section's default; a flag a section names but the
    parser lacks is a mistake in one of them."""
    actions = {a.dest: a for a in parser._actions}
    for cls in sections:
        defaults = section_defaults(cls)
        for name in cls.flag_names():
            if name not in actions:
                raise TypeError(f"{cls.__name__}.{name}: no flag has that destination; declare the flag, or mark "
                                "the field derived()")
            actions[name].default = defaults[name]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(section: Section) -> None:
    """Raise TypeError naming each field whose value does not have the field's declared type."""
    wrong = [f"{name}={getattr(section, name)!r} is not {_name(hint)}"
             for name, hint in _hints(type(section)).items() if not _is(getattr(section, name), hint)]
    if wrong:
        raise TypeError(f"{type(section).__name__}: " + "; ".join(wrong))


def _is(value: Any, hint: Any) -> bool:
    """Whether `value` has type `hint`: the subset of typing the sections use (unions, Literal, list, tuple, dict,
    Any); an int is a float, a bool is no int."""
    if hint is Any:
        return True
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_is(value, p) for p in params)
    if origin is Literal:
        return value in params
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        item = params[0] if params and (origin is list or params[-1] is Ellipsis) else None
        return item is None or all(_is(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, origin or hint)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
