"""`scripts/install.sh` leaves the heavy packages compiled to bytecode.

Every process of a run (driver, Ray's agents and workers, engines, trainers) imports some of torch, vLLM,
Megatron, transformers and Ray. Where Python may not write its bytecode cache (PYTHONDONTWRITEBYTECODE, as on the
machines this suite runs on, or a read-only .venv) a package installed without it is compiled from source in every
one of those processes: measured, 2.2 s more per vLLM server start and 2.5 s more per Ray start, 30% of the suite.
Checked on the repository's own .venv only, which is what install.sh makes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "vllm", "megatron.core", "transformers", "ray")


@pytest.mark.skipif(Path(sys.prefix).resolve() != (REPO / ".venv").resolve(),
                    reason="checks the .venv that scripts/install.sh makes; this Python is another environment")
def test_the_heavy_packages_are_installed_as_bytecode():
    missing = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not installed: run scripts/install.sh"
        root = Path(spec.origin).parent
        sources = list(root.rglob("*.py"))
        uncached = [s for s in sources if not Path(importlib.util.cache_from_source(str(s))).is_file()]
        assert len(sources) > 50, f"{name}: only {len(sources)} source files under {root}"
        if len(uncached) > len(sources) // 100:  # a few files may fail to compile (templates, py2 leftovers)
            missing[name] = f"{len(uncached)} of {len(sources)} modules, e.g. {uncached[0].relative_to(root)}"
    assert not missing, (f"installed without bytecode: {missing}; every process would compile them from source. "
                         "Install with scripts/install.sh (uv pip install --compile-bytecode)")
