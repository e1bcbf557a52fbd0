"""
Graders: who decides what an answer is worth. One home for every reward a sampling stage uses.

- Verifiers: ordinary code that checks an answer against a ground truth (`verify(name, answer, truth)`):
  `gsm8k` (the one final "#### N" line), `boxed` (the one \\boxed{...}), `json` (a JSON object with the
  required keys). A malformed ground truth raises ValueError (the RL loader relies on that to check rows
  up front); an answer never makes a verifier raise.
- `answer_text`: what a verifier grades, the reply after any thinking, without the end-of-turn token.
"""
import json
import re
from decimal import Decimal
from fractions import Fraction
from typing import Callable


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


def format_ok(text: str) -> bool:
    return extract_gsm8k_answer(text) is not None


def _gsm8k(completion: str, ground_truth: str) -> float:
    truth = ground_truth.rsplit("####", 1)[-1].strip()  # also accept a whole GSM8K solution
    if not re.fullmatch(_NUMBER, truth):
        raise ValueError(f"gsm8k ground truth must be a number, got {ground_truth!r}")
    got = extract_gsm8k_answer(completion)
    return float(got is not None and Decimal(got) == Decimal(truth.replace(",", "")))


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
        raise ValueError(f"json ground truth must be a JSON list of required keys or a JSON object, got {ground_truth!r}")
    obj = _json_object(completion)
    return float(obj is not None and all(k in obj for k in required))


VERIFIERS: dict[str, Callable[[str, str], float]] = {"gsm8k": _gsm8k, "boxed": _boxed, "json": _json}


def verify(name: str, completion: str, ground_truth: str) -> float:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; known: {', '.join(VERIFIERS)}")
    return VERIFIERS[name](completion, ground_truth)
