#!/usr/bin/env bash
# Install what is needed (into .venv) and run the whole test suite on this machine. GPU-only tests skip
# without a GPU. Extra arguments go to one pytest run, e.g. `bash scripts/test.sh -m "not e2e"`.
#
# Without arguments the suite runs as two lanes side by side, because one lane leaves the CPUs idle a third of
# the time (a run's stack starts and stops on one core at a time):
# - serial: the end-to-end tests (each starts a whole stack: Ray, vLLM engines, Megatron) and the unit tests
#   that assert wall-clock bounds (marked `timing`), one at a time as before;
# - shared: every other test.
# Each lane's processes carry VIME_TEST_LANE, so a lane's checks for leftover engines and routers
# (tests/e2e/processes.py) never see the other lane's. The shared lane's report is printed after the serial
# lane's; the exit status is the first failing lane's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout 1800 --durations=25)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@" tests
fi

shared_log=$(mktemp)
trap 'rm -f "$shared_log"' EXIT
VIME_TEST_LANE=shared "${pytest[@]}" -m "not e2e and not timing" tests > "$shared_log" 2>&1 &
shared=$!
serial_status=0
VIME_TEST_LANE=serial "${pytest[@]}" -m "e2e or timing" tests || serial_status=$?
shared_status=0
wait "$shared" || shared_status=$?
echo
echo "=============================== the shared lane ==============================="
cat "$shared_log"
if [ "$serial_status" -ne 0 ]; then exit "$serial_status"; fi
exit "$shared_status"
