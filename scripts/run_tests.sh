#!/usr/bin/env bash
# The test suite in two parts (what `make test` runs after lint):
#   1. every test not marked serial, on two worker processes (one per core; torch runs one
#      thread per process in tests), a test file per worker;
#   2. the serial tests (wall-clock behaviour: daemons, sockets with deadlines, netns, the
#      live race; tests/conftest.py SERIAL_FILES), one at a time, with the machine to
#      themselves.
# Arguments go to both parts (e.g. a test file: the part it does not belong to selects
# nothing, which is not a failure). KVT_TEST_WORKERS overrides the worker count.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
workers=${KVT_TEST_WORKERS:-2}
status=0
run() {
  "$PY" -m pytest "$@"
  rc=$?
  [ "$rc" -eq 5 ] && rc=0  # nothing selected in this part
  [ "$rc" -ne 0 ] && status=$rc
}
echo "== tests, part 1 of 2: $workers worker processes"
run -m "not serial" -n "$workers" --dist loadfile "$@"
echo "== tests, part 2 of 2: wall-clock tests, one at a time"
run -m serial "$@"
exit $status
