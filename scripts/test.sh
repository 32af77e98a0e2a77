#!/usr/bin/env bash
# Install what is needed (into .venv) and run the whole test suite on this machine. GPU-only tests skip
# without a GPU. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 1800 --durations=25 "$@" tests
