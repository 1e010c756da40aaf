#!/usr/bin/env bash
# The test suite in three parts (what `make test` runs after lint):
#   1. every test neither serial nor exclusive, on two worker processes (one per core; torch
#      runs one thread per process in tests), a test file per worker;
#   2. the serial tests (wall-clock behaviour: daemons, sockets with deadlines, the live
#      race; tests/conftest.py SERIAL_FILES), after the CPU-heavy part 1 so that no training
#      or evaluation run competes with them, two files at a time;
#   3. the exclusive tests (the netns testbed, and tight wall-clock margins: tests/conftest.py
#      EXCLUSIVE_FILES), one at a time, with the machine to themselves.
# Arguments go to every part (e.g. a test file: a part it does not belong to selects
# nothing, which is not a failure). KVT_TEST_WORKERS overrides the worker count of parts 1
# and 2.
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
echo "== tests, part 1 of 3: $workers worker processes"
run -m "not serial and not exclusive" -n "$workers" --dist loadfile "$@"
echo "== tests, part 2 of 3: wall-clock tests, $workers files at a time"
run -m "serial and not exclusive" -n "$workers" --dist loadfile "$@"
echo "== tests, part 3 of 3: netns testbed tests, one at a time"
run -m exclusive "$@"
exit $status
