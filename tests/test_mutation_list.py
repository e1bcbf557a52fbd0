"""The mutation check's list stays applicable: every planted bug's snippet occurs exactly once in its file, and
every test meant to catch it exists. (Running the mutants is tests/mutation_check.py; this is the cheap part.)"""
import os
import re
import subprocess
import sys

import pytest

from mutation_check import MUTANTS, REPO, stale


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_snippet_occurs_once_and_its_tests_exist(mutant):
    assert stale(mutant) is None, f"{mutant.name}: {stale(mutant)}; update tests/mutation_check.py"
    assert mutant.replacement != mutant.snippet and mutant.tests and mutant.why
    for node in mutant.tests:
        path, _, name = node.partition("::")
        func, _, param = name.partition("[")
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            source = f.read()
        assert re.search(rf"^def {re.escape(func)}\(", source, re.M), f"{node}: no such test"


def test_mutant_names_are_unique_and_the_list_is_not_trivial():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)) and len(names) >= 20


def test_every_mutant_is_caught_in_the_quick_tier():
    # runs/test.sh without --all deselects the slow marker: each planted bug needs a catcher that still runs there
    nodes = sorted({t for m in MUTANTS for t in m.tests})
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "--collect-only", "-q", "-m", "not slow", *nodes],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    quick = {line.strip() for line in r.stdout.splitlines() if "::" in line}
    def runs_quick(node):  # a node without [params] stands for all its parametrizations
        return any(q == node or q.startswith(node + "[") for q in quick)
    only_slow = [m.name for m in MUTANTS if not any(runs_quick(t) for t in m.tests)]
    assert not only_slow, f"caught only by slow-marked tests: {only_slow}"
