#!/usr/bin/env bash
# The test suite: installs the test requirements into .venv (on a fresh machine) and runs pytest.
#   bash runs/test.sh            # the quick tier (about 2 min on 2 cores): every module, every planted mutant's catcher
#   bash runs/test.sh --all      # everything: also the multi-rank, kill -9, real-vocabulary and end-to-end tests (CI)
#   bash runs/test.sh tests/test_rl.py -k advantages    # any pytest arguments after
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q -r requirements-test.txt
tier=(-m "not slow")  # chosen here, not in pytest.ini: mutation_check.py runs node ids of either tier
if [ "${1:-}" = "--all" ]; then shift; tier=(); fi
# one pytest-xdist worker per core this process may use (most tests run on one thread: tests/conftest.py);
# the tests that share the lab's session fixture stay on one worker (--dist loadgroup)
cores=$(.venv/bin/python -c "import os; print(len(os.sched_getaffinity(0)))")
workers=(); if [ "$cores" -gt 1 ]; then workers=(-n "$cores" --dist loadgroup); fi
.venv/bin/python -m pytest "${tier[@]}" "${workers[@]}" "$@"
