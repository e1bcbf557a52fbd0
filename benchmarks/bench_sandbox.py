"""
The code verifier's throughput: answers graded per second by verifiers.verify_batch (each answer in its own
sandbox, `--workers` at a time), for batches of honest assert-style answers, honest stdin/stdout answers
(several cases each), and assert-style batches where one answer in 8 loops forever and runs into the
timeout. The kinds alternate round by round so machine noise hits all of them.

    python benchmarks/bench_sandbox.py [--answers 32] [--rounds 3] [--timeout 2] [--workers N]
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import verifiers  # noqa: E402

TESTS = """
assert sum_digits(0) == 0
assert sum_digits(7) == 7
assert sum_digits(1234) == 10
assert [sum_digits(n) for n in (19, 99, 1000)] == [10, 18, 1]
def test_large():
    assert sum_digits(10 ** 18 - 1) == 162
"""
HONEST = "```python\ndef sum_digits(n):\n    return sum(int(d) for d in str(n))\n```"
LOOPING = "```python\ndef sum_digits(n):\n    while True:\n        pass\n```"
IO = json.dumps({"inputs": [f"{a} {b}\n" for a, b in [(1, 2), (10, 20), (-5, 5), (123, 456), (0, 0)]],
                 "outputs": [f"{a + b}\n" for a, b in [(1, 2), (10, 20), (-5, 5), (123, 456), (0, 0)]]})
IO_HONEST = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", type=int, default=32, help="answers per batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds per run of a program")
    ap.add_argument("--workers", type=int, default=None, help="sandboxes at once (default: the cores)")
    args = ap.parse_args()
    verifiers.CODE_LIMITS["timeout"] = args.timeout
    n = args.answers
    kinds = {
        "honest, asserts": ([HONEST] * n, [TESTS] * n),
        "honest, stdin/stdout (5 cases)": ([IO_HONEST] * n, [IO] * n),
        "asserts, 1 in 8 times out": ([LOOPING if i % 8 == 0 else HONEST for i in range(n)], [TESTS] * n),
    }
    rates = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, (completions, truths) in kinds.items():
            start = time.perf_counter()
            scores, errors, counts = verifiers.verify_batch(["code"] * n, completions, truths, workers=args.workers)
            rates[kind].append(n / (time.perf_counter() - start))
            expected = sum(c != LOOPING for c in completions)
            assert sum(scores) == expected and not any(errors), (kind, counts, errors)
    workers = args.workers or os.cpu_count()
    print(f"{n} answers per batch, {workers} workers, timeout {args.timeout:g} s, {args.rounds} rounds (median)")
    print(f"{'batch':34s} {'answers/s':>10s}")
    for kind, r in rates.items():
        print(f"{kind:34s} {statistics.median(r):10.1f}")
