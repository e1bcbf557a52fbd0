#!/usr/bin/env bash
# The test suite: installs the test requirements into .venv (on a fresh machine) and runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q -r requirements-test.txt
.venv/bin/python -m pytest "$@"
