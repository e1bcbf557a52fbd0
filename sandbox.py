"""
The code sandbox: run a program against its tests in a child process, and decide pass or fail from the
harness's own record, so that the published reward hacks score 0.

    spec = parse_ground_truth("assert add(2, 3) == 5")                        # assert-style (MBPP, HumanEval)
    spec = parse_ground_truth('{"inputs": ["2 3\\n"], "outputs": ["5\\n"]}')  # stdin/stdout pairs (APPS, verl)
    result = run(code, spec, timeout=5.0)
    result["status"]  # "pass" | "fail" | "timeout" | "error" (an error of ours, never a verdict on the program)

One run: the parent writes the job to a private temporary directory and starts `python -I -S -B sandbox.py JOB`
(isolated mode: no site-packages, no PYTHON* variables, no script directory or cwd on sys.path, so a
sitecustomize.py, conftest.py or math.py the program writes is never imported) in a new session (setsid),
with a minimal environment, its cwd a fresh empty directory, stdin/stdout/stderr on /dev/null and one more
inherited file descriptor: the write end of a pipe, the channel. The child then
  1. enters new network and pid namespaces (unshare(CLONE_NEWNET | CLONE_NEWPID) through ctypes; a user who
     is not root adds CLONE_NEWUSER, where the kernel allows unprivileged user namespaces), and forks: the
     fork is pid 1 of the new pid namespace; when it exits, the kernel kills everything left inside;
  2. under root, drops to a fresh unprivileged uid/gid (a random one per run, so that one run's process
     limit never starves another's) and checks that it cannot get root back: root ignores RLIMIT_NPROC and
     may raise any limit, and could delete any file;
  3. sets the limits: processes, file size, open files, no core files; each program run also gets a CPU-time
     limit (soft = timeout, then SIGKILL one second later) and an address-space limit;
  4. writes a `ready` record on the channel, then runs the program in a forked child, once for assert-style
     tests or once per input for stdin/stdout pairs, each with a wall-clock timeout.
Every record on the channel starts with a random token the parent made for this run. The parent reads the
channel until the verdict is decided, the channel closes, or its deadline passes; then it kills the
whole process group and deletes the directory. It never looks at exit codes or at what the program
prints, except, for stdin/stdout pairs, the program's output, which the harness forwards and the parent
compares with the expected output that never leaves the parent.

Assert-style tests. Units: the program itself (unit 0), each top-level statement of the tests, and each
top-level `def test_*()` called with no argument. A run passes when the parent has received `ok` for every
unit in order, then `done` with at least one assert executed. `sys.exit(0)`, `os._exit(0)`, a raised
SystemExit, a crash, a kill or a timeout leave units unreported: fail. The program runs as module
`solution` (importable by the tests); the tests run as `__main__` in their own namespace, with a private
copy of the builtins taken before the program ran (patching `builtins` cannot change what the tests call).
Every assert of the tests is rewritten through the AST (StrictAsserts): `==`, `!=`, `in`, `<`... become a
deep comparison that demands exact types at every level, so an object whose `__eq__` always returns True,
or an int subclass doing so, compares unequal on either side of `==`, inside lists and dicts too.
The only exception: int and float compare by value, as Python does (neither can carry an `__eq__` of the
program's). A bare truth test (`assert f(x)`) accepts only values of built-in types.

Stdin/stdout pairs. Each input runs the program once, as `__main__`, its stdin a file holding the input;
the case fails on a non-zero exit, a kill or a timeout. Outputs are compared in the parent after one
normalization: "\\r\\n" becomes "\\n", trailing whitespace of every line and trailing empty lines are
dropped (leading whitespace, inner blank lines and the tokens themselves must match exactly).

What it defends against, and what remains:
- Root (as in CI and on these machines): the program runs under an unprivileged uid, so the limits hold,
  files outside its directory cannot be deleted, and other processes cannot be signalled; network and pid
  namespaces as above. Where namespaces are refused (a container without CAP_SYS_ADMIN), the run keeps the
  network (`run` reports it in result["isolation"] and says so once on stderr), and a process that leaves
  the process group (setsid) and sleeps outlives the run.
- Not root: the limits hold as designed (they are set hard, so they cannot be raised again), but the
  program runs as the user, so it can read and delete the user's files. Inside a user namespace (where the
  kernel allows one) it has no network and cannot signal the user's other processes; without one it can
  do both. Use a dedicated user or a container for untrusted models there.
- Under root too, the program can read whatever any user may read (world-readable files).
- Under root, if the unprivileged uid cannot read the Python installation (pyenv under a mode-700 /root),
  the harness imports the usual standard modules before it drops privileges (PRELOAD); others cannot be
  imported by the program.
- In-process limit: the program runs in the same interpreter as the harness that reports its tests. Code
  that inspects the interpreter (gc.get_objects(), sys._getframe(), sys.settrace, ctypes, /proc/self/fd)
  can find the token and the channel, or the comparison functions, and forge a pass; so can monkeypatching
  a stdlib function the tests call (math.isclose). The rewrites stop the published hacks, not an
  adversary who reads this file. Closing it takes a process boundary between the values and the verdict:
  the program's process gets only inputs, returns plain data (JSON), and a trusted process holding the
  expected values compares. That is how the stdin/stdout pairs work already (the expected output never
  enters the sandbox); for assert-style tests it needs tests written as (call, expected value) pairs.
- Linux only for the namespaces; other systems are untested.
"""
import ast
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
# When the unprivileged uid cannot read the standard library, the modules of this list that the program or
# the tests import are imported before privileges are dropped (modules that only compute: no I/O at import).
PRELOAD = {"__future__", "abc", "array", "bisect", "calendar", "cmath", "collections", "contextlib", "copy",
           "dataclasses", "datetime", "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "inspect",
           "io", "itertools", "json", "math", "mmap", "numbers", "operator", "pprint", "queue", "random", "re",
           "select", "socket", "statistics", "string", "struct", "textwrap", "threading", "time", "types",
           "typing", "unicodedata", "unittest", "warnings"}


class SandboxError(RuntimeError):
    """The sandbox itself failed (it could not start, or lost its own record): no verdict on the program."""


# ------------------------------------------------------------------------------------------------
# Ground truth: parsing, and the strict rewrite of asserts (the parent checks with these, the child runs them)

def parse_tests(tests: str) -> tuple[ast.Module, list[str]]:
    """The rewritten test module and the names of its top-level `test_*` functions. Raises ValueError
    naming the line when the tests do not compile or check nothing.

    >>> parse_tests("import math\\nassert f(2) == 4\\ndef test_g(): assert g() is None")[1]
    ['test_g']
    """
    try:
        tree = ast.parse(tests, "tests.py")
    except SyntaxError as e:
        raise ValueError(f"the tests do not parse: line {e.lineno}: {e.msg}") from None
    functions = [s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and s.name.startswith("test_")]
    for f in functions:
        a = f.args
        if isinstance(f, ast.AsyncFunctionDef) or a.posonlyargs or len(a.args) > len(a.defaults) or \
                any(d is None for d in a.kw_defaults):
            raise ValueError(f"the tests' {f.name} (line {f.lineno}) must be a plain function callable with no "
                             f"argument (pytest fixtures are not supported)")
    if not functions and not any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
        raise ValueError("the tests have no assert statement and no test_ function: they would check nothing")
    tree = ast.fix_missing_locations(StrictAsserts().visit(tree))
    try:
        for stmt in tree.body:
            compile(ast.Module([stmt], []), "tests.py", "exec", dont_inherit=True, optimize=0)
    except SyntaxError as e:
        raise ValueError(f"the tests do not compile: line {e.lineno}: {e.msg}") from None
    return tree, [f.name for f in functions]


def _io_text(value, field: str, i: int) -> str:
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"  # a case given as its lines
    if not isinstance(value, str):
        raise ValueError(f"{field}[{i}] must be a string (or a list of lines), got {type(value).__name__}")
    return value


def parse_ground_truth(ground_truth: str) -> dict:
    """A code row's ground truth as a run spec: {"tests": python_source, "units": n} (n: the program, each
    top-level statement and each test_ function, each of which must report) or {"inputs": [...],
    "outputs": [...]} (a JSON object; a case may be given as a list of lines). Raises ValueError saying what is wrong, without
    starting any process: the RL loader checks every row with it before training."""
    text = ground_truth.strip()
    if text.startswith("{"):
        try:
            pairs = json.loads(text)
        except ValueError as e:
            raise ValueError(f"the ground truth starts with '{{' but is not a JSON object ({e})") from None
        if "fn_name" in pairs:
            raise ValueError("call-based rows ('fn_name') are not supported: write them as assert tests")
        inputs, outputs = pairs.get("inputs"), pairs.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or len(inputs) != len(outputs):
            raise ValueError("input/output ground truth must be {\"inputs\": [...], \"outputs\": [...]}, two "
                             "non-empty lists of the same length")
        return {"inputs": [_io_text(x, "inputs", i) for i, x in enumerate(inputs)],
                "outputs": [_io_text(x, "outputs", i) for i, x in enumerate(outputs)]}
    tree, functions = parse_tests(ground_truth)
    return {"tests": ground_truth, "units": 1 + len(tree.body) + len(functions)}


def normalize_output(text: str) -> str:
    """The output as compared: CRLF as LF, trailing whitespace of each line and trailing empty lines dropped.

    >>> normalize_output("3 4  \\r\\n5\\n\\n")
    '3 4\\n5'
    """
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


_type_flags = type.__dict__["__flags__"].__get__  # not type(t).__flags__, which a metaclass could fake


def _is_c_type(t) -> bool:
    """A type written in C (int, list, re.Match, deque...), never one a `class` statement made."""
    return bool(_type_flags(t) & (1 << 8))  # Py_TPFLAGS_IMMUTABLETYPE


class StrictAsserts(ast.NodeTransformer):
    """Rewrites every `assert` so that no object of the program's can fake its truth:
        assert f(x) == [1, 2]       ->  assert __strict_assert__(__strict_compare__(("==",), f(x), [1, 2]))
        assert 0 < f(x) and g()     ->  assert __strict_assert__(__strict_compare__(("<",), 0, f(x)) and __strict_truth__(g()))
    Comparisons anywhere inside the assert (`all(f(x) == y for ...)`) are rewritten too; the helpers are
    made by strict_helpers(). Statements outside asserts are left as they are."""

    def visit_Assert(self, node):
        test = _CompareRewriter().visit(node.test)
        node.test = ast.Call(ast.Name("__strict_assert__", ast.Load()), [self._truth(test)], [])
        return node

    def _truth(self, e):
        if isinstance(e, ast.BoolOp):
            return ast.BoolOp(e.op, [self._truth(v) for v in e.values])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return ast.UnaryOp(e.op, self._truth(e.operand))
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "__strict_compare__":
            return e  # already an exact bool
        return ast.Call(ast.Name("__strict_truth__", ast.Load()), [e], [])


_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
        ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}


class _CompareRewriter(ast.NodeTransformer):
    def visit_Compare(self, node):
        node = self.generic_visit(node)
        ops = ast.Constant(tuple(_OPS[type(op)] for op in node.ops))
        return ast.Call(ast.Name("__strict_compare__", ast.Load()), [ops, node.left, *node.comparators], [])


def strict_helpers() -> tuple[dict, list]:
    """The functions the rewritten asserts call, and a one-element list counting the asserts that held.
    Everything they use is bound here, before the program runs, so patching builtins cannot reach them.

    exact types at every level:  [1, 2] vs [1, 2] -> equal;  [1, 2] vs (1, 2) -> not;  2 vs 2.0 -> equal;
    True vs 1 -> not;  E(3) vs 5, with E an int subclass whose __eq__ returns True -> not (either side);
    {"a": [AlwaysEqual()]} vs {"a": [5]} -> not.
    """
    import operator
    _type, _len, _zip, _all, _any, _iter, _bool, _id = type, len, zip, all, any, iter, bool, id
    _isinstance, _object_getattr, is_c_type = isinstance, object.__getattribute__, _is_c_type
    orderings = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
    # membership by identity: `t in (int, ...)` would ask a metaclass's __eq__
    scalars = {id(t) for t in (int, float, complex, bool, str, bytes, type(None))}
    numbers = {id(int), id(float)}
    bases = {dict: dict.copy, list: list.copy, tuple: lambda t: tuple.__getitem__(t, slice(None)),
             set: set.copy, frozenset: frozenset.copy, int: int.__int__, float: float.__float__,
             complex: complex.__complex__, str: str.__str__, bytes: bytes.__bytes__}
    passed = [0]

    def builtin(v):  # a value of a built-in type, containers checked all the way down
        t = _type(v)
        if _id(t) in scalars:
            return True
        if t is list or t is tuple or t is set or t is frozenset:
            return _all(builtin(x) for x in v)
        if t is dict:
            return _all(builtin(k) and builtin(x) for k, x in dict.items(v))
        return False

    def attributes(v):
        try:
            return _object_getattr(v, "__dict__")
        except AttributeError:
            return {}

    def equal(a, b):
        ta, tb = _type(a), _type(b)
        if ta is not tb:
            return _id(ta) in numbers and _id(tb) in numbers and a == b
        if _id(ta) in scalars:
            return a == b
        if ta is list or ta is tuple:
            return _len(a) == _len(b) and _all(equal(x, y) for x, y in _zip(a, b))
        if ta is dict:
            return (_len(a) == _len(b) and _all(builtin(k) for k in a) and _all(builtin(k) for k in b)
                    and a.keys() == b.keys() and _all(equal(a[k], b[k]) for k in a))
        if ta is set or ta is frozenset:
            return builtin(a) and builtin(b) and a == b
        # the same other type on both sides (a Counter, a namedtuple, a class of the program's): what it holds
        for base, plain in bases.items():
            if _isinstance(a, base):
                return equal(plain(a), plain(b)) and equal(attributes(a), attributes(b))
        if attributes(a) or attributes(b):
            return equal(attributes(a), attributes(b))
        return is_c_type(ta) and (a == b) is True  # a C type's own __eq__ (deque, Decimal)

    def contains(container, item):
        tc = _type(container)
        if tc is str or tc is bytes:
            return _type(item) is tc and item in container
        if tc is range:
            return _type(item) is int and item in container
        return _any(equal(item, x) for x in _iter(container))

    def order(op, a, b):  # <, <=, >, >= between built-in values only
        return builtin(a) and builtin(b) and orderings[op](a, b) is True

    def compare(ops, *operands):
        for op, a, b in _zip(ops, operands, operands[1:]):
            if op == "==":
                ok = equal(a, b)
            elif op == "!=":
                ok = not equal(a, b)
            elif op == "is":
                ok = a is b
            elif op == "is not":
                ok = a is not b
            elif op == "in":
                ok = contains(b, a)
            elif op == "not in":
                ok = not contains(b, a)
            else:
                ok = order(op, a, b)
            if not ok:
                return False
        return True

    def truth(v):
        if is_c_type(_type(v)):  # their __bool__ / __len__ are not the program's
            return _bool(v)
        raise AssertionError(f"assert on a value of type {_type(v).__name__!r}: compare it to an expected value")

    def strict_assert(ok):
        passed[0] += ok is True
        return ok

    return {"__strict_compare__": compare, "__strict_truth__": truth, "__strict_assert__": strict_assert}, passed


# ------------------------------------------------------------------------------------------------
# The child: harness, isolation, one forked run of the program per test run

def _isolate(root: bool) -> dict:
    """New network and pid namespaces where the kernel allows them (for a non-root user, inside a new user
    namespace). Returns what was obtained."""
    if not sys.platform.startswith("linux"):
        return {"network_namespace": False, "pid_namespace": False}
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    user = 0 if root else CLONE_NEWUSER
    if libc.unshare(user | CLONE_NEWNET | CLONE_NEWPID) == 0:
        return {"network_namespace": True, "pid_namespace": True}
    return {"network_namespace": libc.unshare(user | CLONE_NEWNET) == 0, "pid_namespace": False}


def _readable_by_anyone(directory: str) -> bool:
    """Whether a uid with no relation to the owners can list `directory` and reach it from /."""
    path = os.path.abspath(directory)
    if os.stat(path).st_mode & 0o005 != 0o005:
        return False
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def _tasks_of(uid: int) -> int:
    """Processes and threads running under `uid` (RLIMIT_NPROC counts them all)."""
    count = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count


def _imported_modules(source: str) -> list[str]:
    """The modules the `import` statements of source name (none when it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _drop_privileges(uid: int):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != uid:
        raise SandboxError(f"could not drop to uid {uid}")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise SandboxError("still able to become root after dropping privileges")


def _set_limit(which, value):
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))  # soft = hard: the program cannot raise it again


def _run_forked(target, timeout: float, limits: dict):
    """Run target() in a forked child with CPU-time and memory limits; wait at most `timeout` seconds.
    Returns the wait status, or None on timeout: the child was killed at the deadline, or the kernel
    killed it for its CPU time (SIGXCPU, then SIGKILL), which on a loaded machine can come first."""
    cpu = max(1, int(timeout + 0.999))
    pid = os.fork()
    if pid == 0:
        try:
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            cpu_limits = (cpu, cpu + 1) if hard == resource.RLIM_INFINITY else (min(cpu, hard), hard)
            resource.setrlimit(resource.RLIMIT_CPU, cpu_limits)  # SIGXCPU, then SIGKILL a second later
            _set_limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
            target()
        finally:
            os._exit(70)  # target() ends with os._exit; reaching here means the harness itself broke
    deadline, delay = time.monotonic() + timeout, 0.0005
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            out_of_cpu = os.WIFSIGNALED(status) and usage.ru_utime + usage.ru_stime >= cpu - 0.05
            return None if out_of_cpu else status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(delay)
        delay = min(2 * delay, 0.01)


def _describe(status) -> bytes:
    if status is None:
        return b"timeout"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}".encode()
    return f"exit code {os.WEXITSTATUS(status)}".encode()


def _exception_text(e) -> str:
    t = type(e)
    # str() of an exception of the program's own class would run its code: only the class name then
    return f"{t.__name__}: {e}"[:300] if _is_c_type(t) else f"{t.__name__} (raised by the program)"


def _assert_tests(code: str, tree: ast.Module, statements: list, functions: list[str], record):
    """The runner of assert-style tests (a forked child): each unit in order, one record each, then os._exit.
    Units: the program (0), each top-level statement of the tests, each test_ function."""
    import builtins
    _exit, _base_exception = os._exit, BaseException
    helpers, passed = strict_helpers()
    private_builtins = dict(builtins.__dict__)  # taken before the program runs
    solution = type(sys)("solution")
    sys.modules["solution"] = solution
    try:
        exec(compile(code, "solution.py", "exec", dont_inherit=True, optimize=0), solution.__dict__)
    except _base_exception as e:
        record("fail", 0, f"the program: {_exception_text(e)}".encode())
        _exit(0)
    record("ok", 0)
    namespace = {**solution.__dict__, "__name__": "__main__", "__builtins__": private_builtins, **helpers}
    units = [(f"tests.py line {stmt.lineno}", lambda c=compiled: exec(c, namespace))
             for stmt, compiled in zip(tree.body, statements)]
    units += [(name, lambda name=name: namespace[name]()) for name in functions]
    for index, (where, run_unit) in enumerate(units, 1):
        try:
            run_unit()
        except _base_exception as e:
            record("fail", index, f"{where}: {_exception_text(e)}".encode())
            _exit(0)
        record("ok", index)
    record("done", len(units) + 1, str(passed[0]).encode())
    _exit(0)


def _io_case(code_obj, stdin_fd: int, stdout_fd: int, channel_fd: int):
    """One stdin/stdout run of the program (a forked child): exit 0 if it ended normally. It never sees
    the channel: its output reaches the parent through pid 1, and the expected output never enters here."""
    import builtins
    os.close(channel_fd)
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    status = 0
    try:
        exec(code_obj, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        status = 0 if e.code is None or e.code == 0 else 1
    except BaseException:
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = 1
    os._exit(status)


def _anonymous_file() -> int:
    """An open file with no name left in the directory (the program cannot find or replace it)."""
    path = f".io-{os.urandom(8).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.unlink(path)
    return fd


def _child_main(job_path: str):
    """The harness: `python -I -S -B sandbox.py JOB`, started by run() in the program's empty directory."""
    with open(job_path, "rb") as f:
        job = json.loads(f.read())
    fd, token, limits, timeout = job["fd"], job["token"].encode(), job["limits"], job["timeout"]
    _write = os.write

    def record(kind: str, index: int = 0, payload: bytes = b""):
        data = b"%s %s %d %d\n" % (token, kind.encode(), index, len(payload)) + payload
        while data:
            data = data[_write(fd, data):]

    try:
        root = job["uid"] is not None
        isolation = {"uid": job["uid"] if root else os.getuid(), "dropped_privileges": root, "stdlib_preloaded": False}
        # RLIMIT_NPROC counts every process of the uid: a fresh uid under root, the user's own otherwise
        processes = limits["processes"] + (0 if root else _tasks_of(os.getuid()))
        isolation.update(_isolate(root))
        pid = os.fork()
        if pid:  # the supervisor, outside the pid namespace, waits: the parent's process group holds both
            os.close(fd)
            os.waitpid(pid, 0)
            os._exit(0)
        # pid 1 of the new namespace (or a plain child where there is none)
        if root:
            if not _readable_by_anyone(os.path.dirname(os.__file__)):
                for name in _imported_modules(job["code"] + "\n" + job.get("tests", "")):
                    if name.split(".")[0] in PRELOAD:
                        try:
                            __import__(name)
                        except ImportError:
                            pass
                isolation["stdlib_preloaded"] = True
            _drop_privileges(job["uid"])
        _set_limit(resource.RLIMIT_NPROC, processes)
        _set_limit(resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20)
        _set_limit(resource.RLIMIT_NOFILE, 256)
        _set_limit(resource.RLIMIT_CORE, 0)
        import builtins
        builtins.exit = builtins.quit = sys.exit  # what `site` would add (-S leaves them out); programs call exit()
        if "tests" in job:
            tree, functions = parse_tests(job["tests"])
            statements = [compile(ast.Module([s], []), "tests.py", "exec", dont_inherit=True, optimize=0)
                          for s in tree.body]
        else:
            stdin_fd, stdout_fd = _anonymous_file(), _anonymous_file()
            try:
                code_obj = compile(job["code"], "solution.py", "exec", dont_inherit=True, optimize=0)
            except (SyntaxError, ValueError):
                code_obj = None
    except BaseException as e:
        record("error", 0, f"sandbox setup: {type(e).__name__}: {e}".encode())
        os._exit(1)
    record("ready", 0, json.dumps(isolation).encode())

    if "tests" in job:
        status = _run_forked(lambda: _assert_tests(job["code"], tree, statements, functions, record), timeout, limits)
        if status is None or not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            record("timeout" if status is None else "crash", 0, _describe(status))
        os._exit(0)
    if code_obj is None:
        record("crash", 0, b"the program does not compile")
        os._exit(0)
    for i, text in enumerate(job["inputs"]):
        for f in (stdin_fd, stdout_fd):
            os.ftruncate(f, 0)
        os.pwrite(stdin_fd, text.encode(), 0)
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        os.lseek(stdout_fd, 0, os.SEEK_SET)
        status = _run_forked(lambda: _io_case(code_obj, stdin_fd, stdout_fd, fd), timeout, limits)
        if status is None or not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            record("timeout" if status is None else "crash", i, _describe(status))
        else:
            record("out", i, os.pread(stdout_fd, limits["file_size_mb"] << 20, 0))
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# The parent

def _records(fd: int, token: bytes, deadline: float, max_bytes: int):
    """Yield (kind, index, payload) from the channel; ("garbled", ...) for anything without this run's token
    or malformed; ("eof", ...) when every writer has closed it; ("deadline", ...) when time is up."""
    import select
    buf = bytearray()
    while True:
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            head = bytes(buf[:nl]).split(b" ")
            if len(head) != 4 or head[0] != token or not head[2].isdigit() or not head[3].isdigit() \
                    or int(head[3]) > max_bytes:
                yield "garbled", 0, bytes(buf[:200])
                return
            length = int(head[3])
            if len(buf) < nl + 1 + length:
                break
            payload = bytes(buf[nl + 1:nl + 1 + length])
            del buf[:nl + 1 + length]
            yield head[1].decode("ascii", "replace"), int(head[2]), payload
        if len(buf) > max_bytes + 200:
            yield "garbled", 0, b"record too long"
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            yield "deadline", 0, b""
            return
        if not select.select([fd], [], [], remaining)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            yield "eof", 0, b""
            return
        buf += chunk


def _verdict(spec: dict, records) -> dict:
    """Read the channel until the verdict is decided. Before `ready` nothing of the program has run, so
    whatever goes wrong is ours ("error"); after it, anything but the complete record of a pass is a fail."""
    for kind, index, payload in records:
        if kind == "ready":
            isolation = json.loads(payload)
            break
        if kind == "error":
            return {"status": "error", "detail": payload.decode("utf-8", "replace")}
        return {"status": "error", "detail": f"the sandbox ended before it was ready ({kind})"}
    else:
        return {"status": "error", "detail": "the sandbox ended before it was ready"}

    def verdict(status, detail):
        return {"status": status, "detail": detail, "isolation": isolation}

    io = "inputs" in spec
    owed = len(spec["inputs"]) if io else spec["units"]  # `out` records (one per case), or `ok` records (one per unit)
    reported = 0
    for kind, index, payload in records:
        text = payload.decode("utf-8", "replace")
        if kind in ("timeout", "deadline"):
            return verdict("timeout", f"run {index} timed out")
        if kind in ("fail", "crash"):
            return verdict("fail", f"run {index}: {text}" if kind == "crash" else text)
        if kind == "error":
            return verdict("error", text)
        if kind == "garbled":
            return verdict("fail", f"a garbled record on the channel: {text[:100]!r}")
        if kind == "eof":
            return verdict("fail", f"the program ended before the tests did ({reported} of {owed} reported)")
        if index != reported or kind != ("out" if io else "done" if reported == owed else "ok"):
            return verdict("fail", f"unexpected record {kind} {index} after {reported} of {owed}")
        if kind == "out" and normalize_output(text) != normalize_output(spec["outputs"][index]):
            return verdict("fail", f"case {index}: wrong output")
        if kind == "done":
            if not text.isdigit() or int(text) < 1:
                return verdict("fail", "the tests ran no assert (is check() called?)")
            return verdict("pass", f"{owed} units passed")
        reported += 1
        if io and reported == owed:
            return verdict("pass", f"{owed} cases passed")
    return verdict("fail", "the channel closed")


def _sandbox_uid(work: str) -> int | None:
    """Under root: a fresh uid for this run, made owner of its directory (nobody, 65534, where the user
    namespace maps no such uid, as in rootless containers). None when not root: no uid to drop to."""
    import secrets
    if os.geteuid() != 0:
        return None
    try:
        uid = 1_048_576 + secrets.randbelow(1 << 20)
        os.chown(work, uid, uid)
    except OSError:
        uid = 65534
        os.chown(work, uid, uid)
    return uid


_LOST = {"network_namespace": "programs under test can reach the network",
         "pid_namespace": "processes a program leaves behind can outlive its run"}
_warned = set()


def run(code: str, spec: dict, *, timeout: float = 5.0, memory_mb: int = 1024, file_size_mb: int = 16,
        processes: int = 32, startup_timeout: float = 30.0) -> dict:
    """Run `code` against a spec from parse_ground_truth in a fresh sandbox. `timeout` is in seconds of wall
    clock (and of CPU) per run of the program: the whole assert-style test file, or one input.
    Returns {"status": "pass"|"fail"|"timeout"|"error", "detail": str, "isolation": {...}}; "error" is a
    failure of the sandbox itself (it could not start, or ended before the program ran)."""
    import secrets
    import shutil
    import subprocess
    import tempfile
    token = secrets.token_hex(16)
    home = tempfile.mkdtemp(prefix="nanopost-sandbox-")  # mode 700: the job file is the parent's alone
    read_fd, write_fd = os.pipe()
    proc = None
    try:
        work = os.path.join(home, "work")
        os.mkdir(work, 0o700)
        limits = {"memory_mb": memory_mb, "file_size_mb": file_size_mb, "processes": processes}
        job = {"fd": write_fd, "token": token, "uid": _sandbox_uid(work), "timeout": timeout, "limits": limits,
               "code": code, **{k: v for k, v in spec.items() if k != "outputs"}}  # expected outputs stay here
        job_path = os.path.join(home, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work,
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), job_path],
                                cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        write_fd = None
        runs = 1 if "tests" in spec else len(spec["inputs"])
        deadline = time.monotonic() + startup_timeout + runs * (timeout + 1.0)
        result = _verdict(spec, _records(read_fd, token.encode(), deadline, (file_size_mb << 20) + 4096))
    except OSError as e:
        result = {"status": "error", "detail": f"the sandbox could not start: {e}"}
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole session: supervisor, pid 1, the program's own
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for fd in (read_fd, write_fd):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(home, ignore_errors=True)
    for key, consequence in _LOST.items():
        if result.get("isolation", {}).get(key) is False and key not in _warned:
            _warned.add(key)
            print(f"sandbox: the kernel refused a new {key.replace('_', ' ')} here: {consequence}", file=sys.stderr)
    return result


def run_batch(jobs: list[tuple[str, dict]], workers: int | None = None, **limits) -> list[dict]:
    """run() for many (code, spec) pairs at once. Each run is its own child process; `workers` threads keep
    that many running (default: the cores of this machine, shared among the ranks of a torchrun node), so
    one slow program holds one slot, never the batch. A run that raises becomes an "error" result."""
    from concurrent.futures import ThreadPoolExecutor
    if not jobs:
        return []
    if workers is None:
        workers = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def one(job):
        try:
            return run(*job, **limits)
        except Exception as e:  # a bug of ours: never a pass
            return {"status": "error", "detail": f"{type(e).__name__}: {e}"}

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


if __name__ == "__main__":
    _child_main(sys.argv[1])
