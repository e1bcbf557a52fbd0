"""The `code` verifier and its sandbox: honest programs score 1, every published reward hack scores 0, a
failure of the sandbox itself is an error and never a pass, rows whose tests do not parse stop the loader.

Where a hack would fool the obvious harness (run the program and the tests in one `python` process and
read its exit code), `naive_passes` shows it does, so that each of those tests can fail."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import verifiers
import sandbox
from common import UserError
from verifiers import check_ground_truth, last_python_block, verify, verify_batch
from data import _verifier_for, load_rl

ROOT = os.geteuid() == 0

TESTS = """
import math
assert add(2, 3) == 5
assert 5 == add(2, 3)
assert [add(1, 1), add(2, 2)] == [2, 4]
assert {"sum": add(10, 5)} == {"sum": 15}
assert all(add(i, i) == 2 * i for i in range(5))
assert sorted([add(3, 0), add(1, 0)]) == [1, 3]
assert math.isclose(add(0.5, 0.25), 0.75) and abs(add(0.5, 0.25) - 0.75) < 1e-9

def test_negative():
    assert add(-1, 1) == 0
"""
HONEST = "def add(a, b):\n    return a + b\n"
IO = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6"]})


@pytest.fixture(autouse=True)
def short_limits(monkeypatch):
    monkeypatch.setitem(verifiers.CODE_LIMITS, "timeout", 1.0)
    monkeypatch.setitem(verifiers.CODE_LIMITS, "memory_mb", 512)


def answer(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code}```\n"


def naive_passes(code: str, tests: str) -> bool:
    """The obvious harness: program and tests in one process, pass = exit code 0."""
    return subprocess.run([sys.executable, "-c", code + "\n" + tests], capture_output=True, timeout=20).returncode == 0


# ------------------------------------------------------------------------------------------------
# Honest programs

@pytest.mark.parametrize("tests", [
    TESTS,
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-2, 2) == 0\n\ncheck(add)\n",  # HumanEval
    "from solution import add as plus\nassert plus(1, 2) == 3.0\n",  # int and float compare by value
])
def test_honest_assert_style_scores_1(tests):
    assert verify("code", answer(HONEST), tests) == 1.0
    assert verify("code", answer("def add(a, b):\n    return a - b\n"), tests) == 0.0


@pytest.mark.parametrize("program", [
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "import sys\na, b = map(int, sys.stdin.buffer.readline().split())\nsys.stdout.write(f'{a + b}   \\n\\n')\nexit()\n",
    "a, b = map(int, open(0).read().split())\nprint(a + b)\nimport sys\nsys.exit(0)\n",
])
def test_honest_stdin_stdout_scores_1(program):
    assert verify("code", answer(program), IO) == 1.0


def test_stdin_stdout_wrong_or_crashing_scores_0():
    assert verify("code", answer("a, b = map(int, input().split())\nprint(a * b)\n"), IO) == 0.0
    assert verify("code", answer("a, b = map(int, input().split())\nprint(' ', a + b)\n"), IO) == 0.0  # leading space
    assert verify("code", answer("a, b = map(int, input().split())\nprint(a + b)\nraise ValueError\n"), IO) == 0.0
    assert verify("code", answer("import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(3)\n"), IO) == 0.0


def test_output_normalization():
    assert sandbox.normalize_output("5  \r\n6\t\n\n\n") == "5\n6"
    assert sandbox.normalize_output(" 5\n\n6") == " 5\n\n6"  # leading spaces and inner blank lines count


def test_last_python_block():
    assert last_python_block("no code") is None
    assert last_python_block("```bash\nls\n```") is None
    assert last_python_block("```python\na = 1\n```\n```\nb = 2\n```\n```js\nc\n```") == "b = 2\n"
    assert last_python_block("```python\na = 1\n```\n```python\nunclosed") == "a = 1\n"
    assert verify("code", "def add(a, b): return a + b", TESTS) == 0.0  # no fenced block: nothing to run


# ------------------------------------------------------------------------------------------------
# Hacks: each one scores 0

SIMPLE = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
CONTAINERS = "assert [add(2, 3)] == [5]\nassert {'s': add(2, 3)} == {'s': 5}\nassert (7, [add(1, 1)]) == (7, [2])\n"
ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __hash__(self): return 0
def add(a, b):
    return AlwaysEqual()
"""
INT_SUBCLASS = """
class E(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
def add(a, b):
    return E(3)
"""
BUILTINS_PATCH = """
import builtins
builtins.all = lambda iterable: True
builtins.sorted = lambda iterable, **kw: [1, 3]
builtins.abs = lambda x: 0
def add(a, b):
    return 0
"""
BUILTINS_TESTS = ("assert all(add(i, i) == 2 * i for i in range(5))\nassert sorted([add(3, 0), add(1, 0)]) == [1, 3]\n"
                  "assert abs(add(0.5, 0.25) - 0.75) < 1e-9\n")

HACKS = {  # name: (program, tests, fools the naive harness)
    "sys.exit(0)": ("import sys\nsys.exit(0)\n", SIMPLE, True),
    "os._exit(0)": ("import os\nos._exit(0)\n", SIMPLE, True),
    "SystemExit in a test": ("def add(a, b):\n    raise SystemExit(0)\n", SIMPLE, True),
    "AlwaysEqual": (ALWAYS_EQUAL, SIMPLE + CONTAINERS + "assert 5 == add(2, 3)\n", True),
    "int subclass, left of ==": (INT_SUBCLASS, SIMPLE, True),
    "int subclass, right of ==": (INT_SUBCLASS, "assert 5 == add(2, 3)\nassert 0 == add(-1, 1)\n", True),
    "int subclass in containers": (INT_SUBCLASS, CONTAINERS, True),
    "truthy object": ("class T:\n    def __bool__(self): return True\ndef is_even(n):\n    return T()\n",
                      "assert is_even(4)\nassert not is_even(3) or True\n", True),
    "patching builtins": (BUILTINS_PATCH, BUILTINS_TESTS, True),
    "fake 'all tests passed'": ("print('test_add PASSED\\n==== 2 passed in 0.01s ====\\nAll tests passed!')\n"
                                "def add(a, b):\n    return 0\n", SIMPLE, False),
    "conftest.py": ("open('conftest.py', 'w').write('import pytest\\n@pytest.hookimpl(hookwrapper=True)\\n"
                    "def pytest_runtest_makereport(item, call):\\n    (yield).get_result().outcome = \"passed\"\\n')\n"
                    "def add(a, b):\n    return 0\n", SIMPLE, False),
    "sitecustomize.py": ("open('sitecustomize.py', 'w').write('import sys; sys.exit(0)')\n"
                         "open('usercustomize.py', 'w').write('import sys; sys.exit(0)')\n"
                         "open('math.py', 'w').write('import sys; sys.exit(0)')\ndef add(a, b):\n    return 0\n",
                         "import math\n" + SIMPLE, False),
    "forged records without the token": ("import os\nfor fd in range(3, 64):\n    try:\n"
                                         "        os.write(fd, b'ok 0 0\\nok 1 0\\nok 2 0\\ndone 3 1\\n')\n"
                                         "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n", SIMPLE, False),
    "signals against the parent": ("import os, signal\ndef add(a, b):\n"
                                   "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
                                   "        for pid in (os.getppid(), 1):\n"
                                   "            try:\n                os.kill(pid, sig)\n"
                                   "            except OSError:\n                pass\n    return 0\n", SIMPLE, False),
    "raising the limits, then 10 GB": ("import resource\nfor r in (resource.RLIMIT_AS, resource.RLIMIT_DATA):\n"
                                       "    try:\n        resource.setrlimit(r, (resource.RLIM_INFINITY,) * 2)\n"
                                       "    except (ValueError, OSError):\n        pass\n"
                                       "import mmap\ndef add(a, b):\n    memory = mmap.mmap(-1, 10 * 2**30)\n    return a + b\n",
                                       SIMPLE, False),
    "infinite loop": ("def add(a, b):\n    while True:\n        pass\n", SIMPLE, False),
}


@pytest.mark.parametrize("name", list(HACKS))
def test_hack_scores_0(name):
    program, tests, fools_naive = HACKS[name]
    if fools_naive:
        assert naive_passes(program, tests), "the hack should fool a harness that reads the exit code"
    start = time.time()
    assert verify("code", answer(program), tests) == 0.0
    assert time.time() - start < 10


def test_10gb_would_pass_without_the_memory_limit():
    # an anonymous mapping is lazy (no page is touched), so only the address-space limit makes it fail
    program = "import mmap\ndef add(a, b):\n    memory = mmap.mmap(-1, 10 * 2**30)\n    return a + b\n"
    assert verify("code", answer(program), SIMPLE) == 0.0
    assert verifiers.sandbox.run(program, sandbox.parse_ground_truth(SIMPLE), timeout=5.0, memory_mb=16 << 10)["status"] == "pass"


def test_stdin_stdout_hacks_score_0():
    assert verify("code", answer("print('All tests passed')\n"), IO) == 0.0
    assert verify("code", answer("import os\nos._exit(0)\n"), IO) == 0.0
    assert verify("code", answer("while True:\n    pass\n"), IO) == 0.0


def tasks_of_uid(uid):
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                alive.append(pid)
        except OSError:
            pass
    return alive


@pytest.mark.skipif(not ROOT, reason="the fork bomb's processes are found by the run's own uid, which only root gets")
def test_fork_bomb_scores_0_and_leaves_no_process():
    program = ("import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n"
               "        except OSError:\n            pass\n")
    start = time.time()
    result = sandbox.run(program, sandbox.parse_ground_truth(SIMPLE), timeout=1.0, memory_mb=512)
    assert result["status"] in ("timeout", "fail") and time.time() - start < 10
    uid = result["isolation"]["uid"]
    deadline = time.time() + 5
    while tasks_of_uid(uid) and time.time() < deadline:
        time.sleep(0.05)
    assert tasks_of_uid(uid) == []


@pytest.mark.skipif(not ROOT, reason="as a user (no uid drop) the program may delete the user's files: see sandbox.py")
def test_deleting_and_writing_outside_its_directory_fails():
    outside = tempfile.mkdtemp(prefix="nanopost-outside-")
    try:
        os.chmod(outside, 0o755)  # visible to the sandbox's uid, not writable by it
        sentinel = os.path.join(outside, "keep.txt")
        with open(sentinel, "w") as f:
            f.write("still here")
        program = (f"import os\nfor remove, path in ((os.remove, {sentinel!r}), (os.rmdir, {outside!r}),"
                   f" (os.remove, '../job.json')):\n    try:\n        remove(path)\n    except OSError:\n        pass\n"
                   f"try:\n    open(os.path.join({outside!r}, 'sitecustomize.py'), 'w').write('x')\n"
                   f"except OSError:\n    pass\ndef add(a, b):\n    return 0\n")
        assert verify("code", answer(program), SIMPLE) == 0.0
        with open(sentinel) as f:
            assert f.read() == "still here"
        assert os.listdir(outside) == ["keep.txt"]
    finally:
        shutil.rmtree(outside)


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n" + HONEST)
    try:
        result = sandbox.run(program, sandbox.parse_ground_truth(SIMPLE), timeout=3.0)
        if not result["isolation"]["network_namespace"]:
            pytest.skip("no network namespace on this kernel: docs/graders.md says what remains")
        assert result["status"] == "fail"
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    # the same program without the connection passes: the socket module is there, the network is not
    assert sandbox.run("import socket\nsocket.socket().close()\n" + HONEST, sandbox.parse_ground_truth(SIMPLE))["status"] == "pass"


# ------------------------------------------------------------------------------------------------
# The strict comparison, against Python's own == where it is trustworthy

def test_strict_equality_table():
    helpers, passed = sandbox.strict_helpers()
    compare = helpers["__strict_compare__"]
    from collections import Counter, OrderedDict, namedtuple

    class E(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

    class Meta(type):  # a type that claims to be int when asked with ==
        def __eq__(cls, other):
            return True
        def __hash__(cls):
            return hash(int)

    class M(metaclass=Meta):
        def __eq__(self, other):
            return True

    Point = namedtuple("Point", "x y")
    same = [(1, 1), (2, 2.0), ([1, (2, "a")], [1, (2, "a")]), ({"a": {1, 2}}, {"a": {2, 1}}), (None, None),
            (Counter("aab"), Counter("aba")), (Point(1, 2), Point(1, 2)), (OrderedDict(a=1), OrderedDict(a=1)),
            (float("inf"), float("inf"))]
    different = [(1, True), ([1], (1,)), ({"a": 1}, {"a": 1, "b": 2}), (E(3), 5), (5, E(3)), ([E(3)], [5]),
                 ({"k": E(3)}, {"k": 5}), ({E(3): 1}, {5: 1}), (Counter("aab"), {"a": 2, "b": 1}),
                 (Point(1, 2), (1, 2)), (float("nan"), float("nan")), (M(), 5), ([M()], [5])]
    for a, b in same:
        assert a == b and compare(("==",), a, b) and compare(("==",), b, a) and not compare(("!=",), a, b)
    for a, b in different:
        assert not compare(("==",), a, b) and not compare(("==",), b, a) and compare(("!=",), a, b)
    assert compare(("<", "<="), 1, 2, 2.0) and not compare(("<",), E(3), 5) and not compare(("<",), 1, E(3))
    assert compare(("in",), 2, [1, 2]) and not compare(("in",), 5, [E(3)]) and compare(("in",), "b", "abc")
    assert compare(("not in",), 5, {E(5): 0}) and compare(("in",), 3, range(10**12))
    assert helpers["__strict_truth__"]([0]) is True and helpers["__strict_truth__"](0) is False
    with pytest.raises(AssertionError):
        helpers["__strict_truth__"](E(3))


# ------------------------------------------------------------------------------------------------
# Our own failures, rows and loaders

def test_tests_that_run_no_assert_pass_nothing():
    never_called = "def check(candidate):\n    assert candidate(2, 3) == 5\n"  # HumanEval's test without check(add)
    assert verify("code", answer(HONEST), never_called) == 0.0
    assert verify("code", answer(HONEST), never_called + "check(add)\n") == 1.0


def test_a_sandbox_failure_is_an_error_never_a_pass(monkeypatch):
    for broken in ("/nonexistent/python", shutil.which("false")):
        monkeypatch.setattr(sandbox.sys, "executable", broken)
        with pytest.raises(sandbox.SandboxError):
            verify("code", answer(HONEST), SIMPLE)
        scores, errors, counts = verify_batch(["code", "gsm8k"], [answer(HONEST), "#### 4"], [SIMPLE, "4"])
        assert scores == [0.0, 1.0] and errors[0].startswith("SandboxError") and errors[1] is None
        assert counts == {"pass": 0, "fail": 0, "timeout": 0, "no_code": 0, "error": 1}


def test_batch_runs_in_parallel_and_counts():
    loop = answer("def add(a, b):\n    while True:\n        pass\n")
    completions = [answer(HONEST), loop, "no code", answer(HONEST), loop, answer("def add(a, b): return 0\n")]
    start = time.time()
    scores, errors, counts = verify_batch(["code"] * 6, completions, [SIMPLE] * 6, workers=3)
    elapsed = time.time() - start
    assert scores == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0] and errors == [None] * 6
    assert counts == {"pass": 2, "fail": 1, "timeout": 2, "no_code": 1, "error": 0}
    assert elapsed < 2 * 1.0 + 1.5  # the two 1 s timeouts ran side by side, not one after the other plus the rest


@pytest.mark.parametrize("truth,message", [
    ("assert add(2, 3) == 5\nassert add(2,, 3) == 5\n", "line 2"),
    ("x = add(2, 3)\n", "no assert statement"),
    ("def test_a(tmp_path):\n    assert True\n", "no argument"),
    ("assert f() == 1\nreturn 3\n", "do not compile: line 2"),
    ('{"inputs": ["1"], "outputs": []}', "same length"),
    ('{"inputs": ["1"], "outputs": [1]}', r"outputs\[0\] must be a string"),
    ('{"fn_name": "f", "inputs": [[1]], "outputs": [[1]]}', "fn_name"),
])
def test_ground_truth_check_names_the_problem(truth, message):
    with pytest.raises(ValueError, match=message):
        check_ground_truth("code", truth)


def test_rl_loader_checks_code_rows_before_training(tmp_path):
    rows = [
        {"prompt": "Write add.", "verifier": "code", "ground_truth": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
        {"prompt": "Sum two numbers.", "data_source": "codeparrot/apps",
         "reward_model": {"ground_truth": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}},
        {"prompt": "Write add.", "data_source": "mbpp", "reward_model": {"ground_truth": "assert add(1, 2) == 3"}},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.time()
    loaded = load_rl(str(path))
    assert time.time() - start < 1  # parsed, not run
    assert [r["verifier"] for r in loaded] == ["code"] * 3
    assert verify("code", answer(HONEST), loaded[0]["ground_truth"]) == 1.0
    assert verify("code", answer("print(sum(map(int, input().split())))\n"), loaded[1]["ground_truth"]) == 1.0
    rows.append({"prompt": "Write add.", "verifier": "code", "ground_truth": "assert add(1, 2) == 3\nassert add(1,, 2)\n"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"code\.jsonl:4: .*line 2"):
        load_rl(str(path))


@pytest.mark.parametrize("source,verifier", [
    ("codeparrot/apps", "code"), ("BAAI/TACO", "code"), ("deepmind/code_contests", "code"), ("mbpp", "code"),
    ("openai_humaneval", "code"), ("livecodebench", "code"), ("PrimeIntellect/verifiable-coding-problems", "code"),
    ("openai/gsm8k", "gsm8k"), ("lighteval/MATH", "boxed"), ("aime2025", "boxed"), ("codecontests", "code"),
])
def test_code_data_sources_map_to_the_code_verifier(source, verifier):
    assert _verifier_for(source) == verifier
