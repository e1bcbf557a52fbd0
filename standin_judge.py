"""
A judge that is a program. It stands in for a judge model where none is at hand: offline, and nanopost's tiny models
cannot follow a rubric. It reads the judge's conversation exactly as a model would (rewards.judge_messages and
pairwise_messages: the rubric, the question, the answer or the two answers) and replies as a model must, a sentence
and then the verdict line, so that all that surrounds a judge (the prompts, the strict parsing, asking both orders,
the counts) runs as it would for a real one. Everywhere it is used it says what it is: --reward
judge:standin:arithmetic logs reward/judge:standin:arithmetic, and loading it prints that it is a program.

Its one rubric is rubrics/arithmetic.txt, the program below written out in words, and it refuses any other (a
stand-in that silently graded by another rubric than the one passed would be a setting that does not reach its
grade). Like a judge, and unlike a verifier, it has no answer key: a chain of steps computed right from a number
misread from the question passes. Compared two at a time, it prefers the higher score and, on a tie, the answer
shown first: a position bias, as LLM judges have, which asking in both orders cancels (rewards.judge_pairs).

    python chat_rl.py --reward judge:standin:arithmetic --rubric rubrics/arithmetic.txt
    python chat_sample.py --samples 4 --pairs-out p.jsonl --pairs-judge standin:arithmetic \
        --rubric rubrics/arithmetic.txt
"""
import os
import re

from common import UserError

REPO = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)")
# a calculator call and the result it gave, before the next call (the turns as the judge reads an answer's text)
CALL = re.compile(r'"expression": "(-?\d+) ([-+*/]) (-?\d+)"\}\}\s*</tool_call>(?:(?!<tool_call>).)*?'
                  r"<tool_response>\s*(-?\d+)\s*</tool_response>", re.S)
ANSWER_LINE = re.compile(r"(?m)^#### (-?\d+)\s*$")


def arithmetic_score(answer: str) -> tuple[int, str]:
    """rubrics/arithmetic.txt as a program: 0 to 10, and why. A step is a sentence's "a op b = c", or a calculator
    call "a op b" and the result it gave. No "#### N" line: 0. No step shown: 3. Else 10, less 3 for each step whose
    arithmetic is wrong and 4 when N is not the last step's result, at least 0.
    Example: "Mia has 12 + 17 = 29 apples.\\nMia has 29 - 4 = 26 apples.\\n#### 26" -> 7 (the second step is
    wrong, 29 - 4 is 25; the answer line follows from it); with "#### 25" it would be 3."""
    finals = ANSWER_LINE.findall(answer)
    if not finals:
        return 0, "There is no '#### N' answer line."
    found = [(m.start(), m.groups()) for pattern in (STEP, CALL) for m in pattern.finditer(answer)]
    steps = [groups for _, groups in sorted(found)]
    if not steps:
        return 3, "The answer line is there, but no step shows its work."
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b if b else None}
    wrong = sum(ops[op](int(a), int(b)) != int(c) for a, op, b, c in steps)
    follows = int(finals[-1]) == int(steps[-1][3])
    score = max(0, 10 - 3 * wrong - (0 if follows else 4))
    return score, (f"{len(steps) - wrong} of {len(steps)} steps are computed right, and the answer line "
                   f"{'gives' if follows else 'does not give'} the last step's result.")


STANDINS = {"arithmetic": (arithmetic_score, os.path.join(REPO, "rubrics", "arithmetic.txt"))}


class StandInJudge:
    """rewards.judge_replies asks it as it would ask a model: reply(conversation) -> the reply's text."""

    def __init__(self, name: str):
        if name not in STANDINS:
            raise ValueError(f"no stand-in judge {name!r}; there is: {', '.join(STANDINS)}")
        self.name = name
        self.score, self.rubric_path = STANDINS[name]
        with open(self.rubric_path, encoding="utf-8") as f:
            self.rubric_text = f.read().strip()

    @staticmethod
    def _tag(text: str, tag: str) -> str | None:
        m = re.search(rf"<{tag}>\n(.*?)\n</{tag}>", text, re.S)
        return m.group(1) if m else None

    def reply(self, conversation: list[dict]) -> str:
        text = conversation[-1]["content"]
        if self._tag(text, "rubric") != self.rubric_text:
            raise UserError(f"the stand-in judge {self.name!r} grades by {self.rubric_path} only: pass it as --rubric")
        answer = self._tag(text, "answer")
        if answer is not None:  # one answer: a score
            score, why = self.score(answer)
            return f"{why}\nVERDICT: {score}"
        first, second = (self.score(self._tag(text, f"answer_{i}") or "")[0] for i in (1, 2))
        return (f"Answer 1 scores {first} of 10 and answer 2 {second}.\n"
                f"VERDICT: {1 if first >= second else 2}")  # a tie goes to the first shown: a position bias
