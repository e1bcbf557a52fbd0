"""
Verifiers: ordinary code that checks an answer against a ground truth, with nothing of a model in it.

`verify(name, answer, truth)` by name: `gsm8k` (the one final "#### N" line; `gsm8k_any`, any such line, is the
lenient grader the lab hacks on purpose), `boxed` (the one \\boxed{...}),
`json` (a JSON object with the required keys), `code` (the answer's last fenced Python block, run against the
row's tests in the sandbox of sandbox.py). A verifier is one function and one entry of VERIFIERS. A malformed
ground truth raises ValueError (`check_ground_truth` checks rows up front, without running anything); an answer
never makes a verifier raise, and a sandbox that fails on its own raises SandboxError, so that it is counted
as a verifier error and never scored as a pass. `verify_batch` grades a whole batch, code answers in parallel;
`has_format` says whether an answer holds a final answer its verifier can read; `answer_text` is what a
verifier grades, the reply after any thinking, without the end-of-turn token.

This module imports only the sandbox: the data loaders (data.py) check ground truths with it without reaching
an engine or a checkpoint. The graders that run a model (reward models, the judge) live in rewards.py.
"""
import json
import re
from decimal import Decimal
from fractions import Fraction
from typing import Callable

import sandbox


def answer_text(text: str) -> str:
    """What the verifier grades: the final answer after any thinking, without the end-of-turn token."""
    text = text.split("</think>")[-1]
    for stop in ("<|im_end|>", "<|endoftext|>"):
        text = text.replace(stop, "")
    return text.strip()



_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 19, -3, 1,000, 2.5
_GSM8K_ANSWER = re.compile(rf"####[ \t]*({_NUMBER})\s*\Z")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number of the one final "#### N" line (commas removed); None if absent, repeated or not last."""
    if text.count("####") != 1:
        return None
    m = _GSM8K_ANSWER.search(text)
    return m.group(1).replace(",", "") if m else None


def _gsm8k(completion: str, ground_truth: str) -> float:
    truth = ground_truth.rsplit("####", 1)[-1].strip()  # also accept a whole GSM8K solution
    if not re.fullmatch(_NUMBER, truth):
        raise ValueError(f"gsm8k ground truth must be a number, got {ground_truth!r}")
    got = extract_gsm8k_answer(completion)
    return float(got is not None and Decimal(got) == Decimal(truth.replace(",", "")))


_GSM8K_LINE = re.compile(rf"^####[ \t]*({_NUMBER})[ \t]*$", re.M)


def _gsm8k_any(completion: str, ground_truth: str) -> float:
    """The lenient grader, to be hacked on purpose (lab/lenient_verifier.py): 1 when ANY line of the answer is
    "#### N" with N the truth, wherever it stands and however many others there are. A policy paid by it learns
    to write many such lines, the "answers with a hundred boxes" of a grader accepting any \\boxed{}; gsm8k
    reads only the one final line. Example, truth 19: "#### 20\n#### 19\n#### 21" -> 1 (gsm8k: 0)."""
    truth = ground_truth.rsplit("####", 1)[-1].strip()
    if not re.fullmatch(_NUMBER, truth):
        raise ValueError(f"gsm8k_any ground truth must be a number, got {ground_truth!r}")
    return float(any(Decimal(n.replace(",", "")) == Decimal(truth.replace(",", ""))
                     for n in _GSM8K_LINE.findall(completion)))


def extract_boxed(text: str) -> str | None:
    """The content of the one \\boxed{...} (nested braces allowed); None if absent, repeated or unclosed."""
    if text.count("\\boxed") != 1:
        return None
    m = re.search(r"\\boxed\s*\{", text)
    if not m:
        return None
    depth = 1
    for i in range(m.end(), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[m.end():i]
    return None


def _normalize_math(s: str) -> str:
    s = re.sub(r"\\left|\\right|\\!|\\,|\$|\s", "", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _math_number(s: str) -> Fraction | None:
    s = re.sub(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$", r"\1\2/\3", s)
    if re.fullmatch(_NUMBER, s):
        s = s.replace(",", "")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/-?\d+)?", s):  # no exponents: Fraction("1e999999999") never ends
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):  # 0 denominator, over 4300 digits
        return None


def _boxed(completion: str, ground_truth: str) -> float:
    truth = extract_boxed(ground_truth) if "\\boxed" in ground_truth else ground_truth
    if not truth or not _normalize_math(truth):
        raise ValueError(f"boxed ground truth must be a non-empty answer, got {ground_truth!r}")
    got = extract_boxed(completion)
    if got is None:
        return 0.0
    got, truth = _normalize_math(got), _normalize_math(truth)
    number = _math_number(got)
    return float(got == truth or (number is not None and number == _math_number(truth)))


def _json_object(text: str) -> dict | None:
    """The JSON object in a ```json fenced block (exactly one), or else between the first { and the last }."""
    fences = re.findall(r"```(?:json)?[ \t]*\n(.*?)```", text, re.S)
    if len(fences) > 1:
        return None
    candidate = fences[0] if fences else text[text.find("{"):text.rfind("}") + 1] if "{" in text else ""
    try:
        value = json.loads(candidate)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _json(completion: str, ground_truth: str) -> float:
    try:
        required = json.loads(ground_truth)
    except ValueError:
        required = None
    if not (isinstance(required, (list, dict)) and all(isinstance(k, str) for k in required)):
        raise ValueError(f"json ground truth must be a JSON list of required keys or a JSON object, got "
                         f"{ground_truth!r}")
    obj = _json_object(completion)
    return float(obj is not None and all(k in obj for k in required))


_FENCED_BLOCK = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.S)


def last_python_block(text: str) -> str | None:
    """The code of the last complete fenced block tagged python, py or python3, or untagged; None if none.

    >>> last_python_block("Try:\n```python\nx = 1\n```\nthen\n```py\ndef f(): return 2\n```")
    'def f(): return 2\n'
    """
    blocks = [code for tag, code in _FENCED_BLOCK.findall(text) if tag.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


# Per run of a program: seconds of wall clock and CPU (all the assert tests, or one stdin/stdout case), memory.
CODE_LIMITS = {"timeout": 5.0, "memory_mb": 1024}


def _code(completion: str, ground_truth: str) -> float:
    spec = sandbox.parse_ground_truth(ground_truth)  # ValueError for tests that do not parse
    code = last_python_block(completion)
    if code is None:
        return 0.0
    result = sandbox.run(code, spec, **CODE_LIMITS)
    if result["status"] == "error":
        raise sandbox.SandboxError(result["detail"])
    return float(result["status"] == "pass")


VERIFIERS: dict[str, Callable[[str, str], float]] = {"gsm8k": _gsm8k, "boxed": _boxed, "json": _json, "code": _code,
                                                    "gsm8k_any": _gsm8k_any}


def verify(name: str, completion: str, ground_truth: str) -> float:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; known: {', '.join(VERIFIERS)}")
    return VERIFIERS[name](completion, ground_truth)


def check_ground_truth(name: str, ground_truth: str) -> None:
    """Raise ValueError if verifier `name` cannot grade against `ground_truth`. Cheap (code tests are parsed,
    never run): the RL loader calls it on every row, so that a bad row stops the run before training."""
    verify(name, "", ground_truth)  # an empty answer: no code block, so the code verifier runs nothing


def verify_batch(verifiers: list[str], completions: list[str], ground_truths: list[str],
                 workers: int | None = None) -> tuple[list[float], list[str | None], dict]:
    """Grade a batch: answer i by verifiers[i] against ground_truths[i]. Code answers run in parallel sandboxes
    (`workers` at a time, default the cores per rank); the other verifiers inline. Returns
      scores  : one float per answer (0 where the verifier raised or the sandbox failed);
      errors  : per answer, None or the message of a verifier that raised / a sandbox that failed on its own;
      counts  : the code answers' outcomes, {"pass", "fail", "timeout", "no_code", "error"} -> count.
    """
    scores, errors = [0.0] * len(completions), [None] * len(completions)
    counts = {"pass": 0, "fail": 0, "timeout": 0, "no_code": 0, "error": 0}
    jobs, job_rows = [], []
    for i, (name, completion, truth) in enumerate(zip(verifiers, completions, ground_truths, strict=True)):
        try:
            if name != "code":
                scores[i] = verify(name, completion, truth)
                continue
            spec, code = sandbox.parse_ground_truth(truth), last_python_block(completion)
        except Exception as e:  # a verifier that raises scores 0 and is reported, never stops the batch
            errors[i] = f"{type(e).__name__}: {e}"
            counts["error"] += name == "code"
            continue
        if code is None:
            counts["no_code"] += 1
        else:
            jobs.append((code, spec))
            job_rows.append(i)
    for i, result in zip(job_rows, sandbox.run_batch(jobs, workers=workers, **CODE_LIMITS)):
        counts[result["status"]] += 1
        if result["status"] == "error":
            errors[i] = f"SandboxError: {result['detail']}"
        scores[i] = float(result["status"] == "pass")
    return scores, errors, counts


FORMATS: dict[str, Callable[[str], bool]] = {  # does the answer carry a final answer the verifier can read?
    "gsm8k": lambda text: extract_gsm8k_answer(text) is not None,
    "gsm8k_any": lambda text: bool(_GSM8K_LINE.search(text)),
    "boxed": lambda text: extract_boxed(text) is not None,
    "json": lambda text: _json_object(text) is not None,
    "code": lambda text: last_python_block(text) is not None,
}


def has_format(verifier: str, answer: str) -> bool:
    """Whether an answer is in the verifier's format (a verifier without a format check: always)."""
    check = FORMATS.get(verifier)
    return True if check is None else check(answer)


def _math_key(text: str):
    if (got := extract_boxed(text)) is None:
        return None
    number = _math_number(_normalize_math(got))
    return _normalize_math(got) if number is None else number


FINAL_ANSWERS: dict[str, Callable[[str], object]] = {  # what a majority vote counts: keys equal when the answers are
    "gsm8k": lambda text: None if (n := extract_gsm8k_answer(text)) is None else Decimal(n),  # 480 == 480.0
    "boxed": _math_key,  # \frac{1}{2} == 0.5
    "json": lambda text: None if (obj := _json_object(text)) is None else json.dumps(obj, sort_keys=True),
    "code": lambda text: None if (code := last_python_block(text)) is None else code.strip(),
}


def final_answer(verifier: str, answer: str):
    """The final answer a majority vote (maj@k) counts, as a hashable key: equal for answers the verifier reads as
    the same (a verifier without a reading: the stripped answer); None where there is no answer to count.
    Example: final_answer("gsm8k", "... so 12.\n#### 12.0") == final_answer("gsm8k", "#### 12") -> True."""
    read = FINAL_ANSWERS.get(verifier)
    return (answer.strip() or None) if read is None else read(answer)
