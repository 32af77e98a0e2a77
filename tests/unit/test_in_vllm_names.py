"""vLLM reaches vime's code inside its processes by name only (pyproject.toml's entry points, the worker
extension's class path; nothing in vime imports `vime.engine.in_vllm`): each name must resolve there, and the installed
entry points must be pyproject's."""

from __future__ import annotations

import importlib
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

from vime.engine.protocol.names import PLUGIN_NAME, WORKER_EXTENSION

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
GROUPS = ("vllm.general_plugins", "vllm.endpoint_plugins")


def declared() -> dict[str, dict[str, str]]:
    """{group: {name: "module:attribute"}} of vime's vLLM entry points in pyproject.toml."""
    points = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    return {group: points[group] for group in GROUPS}


def test_each_name_vllm_is_given_resolves_inside_in_vllm():
    for group, names in declared().items():
        assert list(names) == [PLUGIN_NAME], group  # the name engine.plugin_allowlist adds to VLLM_PLUGINS
        module, attribute = names[PLUGIN_NAME].split(":")
        assert module.startswith("vime.engine.in_vllm.")
        assert callable(getattr(importlib.import_module(module), attribute))
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert module.startswith("vime.engine.in_vllm.")
    assert isinstance(getattr(importlib.import_module(module), name), type)


def test_the_installed_entry_points_are_pyprojects():
    """An editable install writes the entry points down when it is made: after pyproject.toml changes them, engines
    would load no vime plugin (and `VLLMEngine.start` refuses to serve) until the install is redone."""
    for group, names in declared().items():
        installed = {p.name: p.value for p in entry_points(group=group) if p.name == PLUGIN_NAME}
        assert installed == names, (f"{group}: installed {installed}, pyproject.toml {names}: rerun "
                                    "`bash scripts/install.sh` (the editable install's entry points are stale)")
