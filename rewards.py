"""
Graders: who decides what an answer is worth. One home for every reward a sampling stage uses.

- Verifiers: ordinary code that checks an answer against a ground truth (`verify(name, answer, truth)`):
  `gsm8k` (the one final "#### N" line), `boxed` (the one \\boxed{...}), `json` (a JSON object with the
  required keys). A malformed ground truth raises ValueError (the RL loader relies on that to check rows
  up front); an answer never makes a verifier raise.
- `answer_text`: what a verifier grades, the reply after any thinking, without the end-of-turn token.
- Reward models: `load_reward_model` (frozen, in the compute dtype) and `score`, the value of the scalar
  head at each answer's last token (trained by chat_rm.py).
- `Grader`: what `--reward` means in the sampling stages, a weighted sum of those graders, e.g.
  `verifier` (the default), `verifier+0.1*format`, `rm:PATH`, `0.5*verifier+0.5*rm:PATH`. It grades a
  whole batch in one call and returns every component too, so each can be logged on its own.
"""
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Callable

import torch

from common import UserError, autocast, compute_dtype, pack_sequences, resolve_model_path


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


FORMATS: dict[str, Callable[[str], bool]] = {  # does the answer carry a final answer the verifier can read?
    "gsm8k": lambda text: extract_gsm8k_answer(text) is not None,
    "boxed": lambda text: extract_boxed(text) is not None,
    "json": lambda text: _json_object(text) is not None,
}


def has_format(verifier: str, answer: str) -> bool:
    """Whether an answer is in the verifier's format (a verifier without a format check: always)."""
    check = FORMATS.get(verifier)
    return True if check is None else check(answer)


# -----------------------------------------------------------------------------
# Reward models: the scalar head's value at the last token of the answer (trained by chat_rm.py)

def last_token_values(model, seqs, pad_id, layout="right", capacity=None):
    """Scalar-head value at the last token of each sequence, (N,) float32, in one batch: right, left or
    packed (common.pack_sequences), all giving the same values. The position read is where each
    sequence ends by its own length, never a search for the first pad or eos (pad may equal eos: trl#2778)."""
    ids, docs, _, ends = pack_sequences(seqs, pad_id, layout, capacity)
    dev = model.device
    with autocast(dev):
        values = model(ids.to(dev), doc_ids=None if layout == "right" else docs.to(dev))
    return values[ends[0].to(dev), ends[1].to(dev)]


def load_reward_model(path, device="cpu"):
    """The reward model of a model folder or an rm run directory (its latest checkpoint): frozen, in eval
    mode, in the compute dtype (a frozen model needs no float32 master weights)."""
    from model import GPT
    path = resolve_model_path(path)
    model = GPT.from_hf(path, device=device, dtype=compute_dtype(device))
    if model.config.head != "scalar":
        raise UserError(f"{path} is a language model, not a reward model (config.json is not "
                        f"*ForSequenceClassification); train one with chat_rm.py")
    return model.eval().requires_grad_(False)


@torch.no_grad()
def score(model, sequences, batch_size=32, layout="right"):
    """Rewards of token sequences (prompt + completion, each ending at the completion's <|im_end|>), as
    floats. A completion cut at the length limit has no <|im_end|> and is read at its last token anyway:
    penalize those separately. A score does not depend on batch size, padding side or batch mates."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(sequences), batch_size):
        out += last_token_values(model, sequences[i:i + batch_size], 0, layout).tolist()  # pad id 0: never read
    model.train(was_training)
    return out


# -----------------------------------------------------------------------------
# --reward: a weighted sum of graders, graded a batch at a time

_TERM = re.compile(r"^(?:([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*\*\s*)?(verifier|format|rm:.+)$")


def parse_reward(spec: str) -> list[tuple[float, str]]:
    """'verifier+0.1*format' -> [(1.0, 'verifier'), (0.1, 'format')]. Terms are joined by '+', each an
    optional weight and '*' before a grader: `verifier` (the row's verifier, 0 or 1), `format` (1 when the
    answer is in the verifier's format), `rm:PATH` (a reward model's score). A negative weight penalizes."""
    terms = []
    for part in spec.split("+"):
        m = _TERM.match(part.strip())
        if not m:
            raise UserError(f"--reward {spec!r}: cannot read {part.strip()!r}; terms are [WEIGHT*]GRADER joined by "
                            f"'+', a grader being verifier, format or rm:PATH (e.g. verifier+0.1*format)")
        terms.append((float(m.group(1)) if m.group(1) else 1.0, m.group(2)))
    names = [name for _, name in terms]
    if len(set(names)) != len(names):
        raise UserError(f"--reward {spec!r} names a grader twice")
    return terms


@dataclass
class Grades:
    total: torch.Tensor                                 # (N,) the weighted sum: the reward
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # (N,) each grader's own score
    errors: list[str] = field(default_factory=list)     # verifiers that raised (scored 0, never a crash)


class Grader:
    """Grades a batch of answers with the --reward spec. Reward models are loaded once, frozen."""

    def __init__(self, spec: str, tokenizer, device="cpu"):
        self.terms = parse_reward(spec)
        self.tok = tokenizer
        self.models = {name: load_reward_model(name[3:], device) for _, name in self.terms if name.startswith("rm:")}

    def __call__(self, rows, prompts, completions) -> Grades:
        """rows[i], prompts[i] (token ids) and completions[i] (engine.Completion) describe answer i."""
        texts = [answer_text(self.tok.decode(c.tokens)) for c in completions]
        grades = Grades(total=torch.zeros(len(completions)))
        for weight, name in self.terms:
            if name == "verifier":
                part = [self._verify(row, text, grades.errors) for row, text in zip(rows, texts)]
            elif name == "format":
                part = [float(has_format(row["verifier"], text)) for row, text in zip(rows, texts)]
            else:  # one batched pass of the reward model over prompt + answer
                part = score(self.models[name], [p + c.tokens for p, c in zip(prompts, completions)])
            grades.parts[name] = torch.tensor(part, dtype=torch.float32)
            grades.total += weight * grades.parts[name]
        return grades

    @staticmethod
    def _verify(row, text, errors):
        try:
            return verify(row["verifier"], text, row["ground_truth"])
        except Exception as e:  # a verifier that raises scores 0, is counted, and never stops the run
            errors.append(f"{row['verifier']}: {type(e).__name__}: {e}")
            return 0.0
