"""
Can the trunk do the arithmetic? The share of single solution steps a model computes right itself: each
held-out problem's clean solution is fed up to a step's "a op b = ", the model writes the result greedily
(digits until the first token that is not one), and the step counts as right when that spells the result.

Why: the reward model's hard pairs (chat_rm.py's wrong_step kind) differ from the clean answer by one step's
result, off by 1 or 2 and carried to the end. Telling them apart takes that step's arithmetic, so this is a
first look at how much of it a trunk has.

    python benchmarks/step_accuracy.py                                   # the pipeline's base and SFT runs
    python benchmarks/step_accuracy.py --chat out/cpu/sft/other --problems 500
"""
import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import load_hf, resolve_model_path  # noqa: E402
from common import nanopost_home  # noqa: E402
from tasks import generate_problems  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


@torch.no_grad()
def step_accuracy(path, problems, chat, max_digits_tokens=6):
    """(share right over every step, {op: share right}) of the model at `path`, asked as it was trained: the
    base the plain document "question\\n...", a chat model the chat prompt and its answer so far."""
    model, tok = load_hf(path).eval(), Tokenizer.load(path)
    right, per_op = [], {}
    for p in problems:
        prompt = tok.render_for_completion([{"role": "user", "content": p.question}]) if chat else \
            tok.encode(p.question + "\n")
        written = ""
        for line, (a, op, b, c) in zip(p.solution.split("\n"), p.steps):
            ids = prompt + tok.encode(written + line[:line.index(f"{a} {op} {b} = ") + len(f"{a} {op} {b} = ")])
            out = ""
            for _ in range(max_digits_tokens):
                nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
                piece = tok.decode([nxt])
                if not re.match(r"\d", piece):
                    break
                out, ids = out + piece, ids + [nxt]
            ok = re.match(r"\d+", out) is not None and int(re.match(r"\d+", out).group()) == c
            right.append(ok)
            per_op.setdefault(op, []).append(ok)
            written += line + "\n"
    return sum(right) / len(right), {op: round(sum(v) / len(v), 3) for op, v in sorted(per_op.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=os.path.join(nanopost_home(), "base", "default"))
    ap.add_argument("--chat", action="append", default=None, help="chat models (default: the SFT run)")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems (2-4 steps each)")
    args = ap.parse_args()
    problems = generate_problems("test", args.problems)
    n_steps = sum(len(p.steps) for p in problems)
    for path, chat in [(args.base, False)] + [(c, True) for c in args.chat or [os.path.join(nanopost_home(), "sft", "default")]]:
        share, per_op = step_accuracy(resolve_model_path(path), problems, chat)
        print(f"{path}: {share:.3f} of {n_steps} steps right; by operation {per_op}")


if __name__ == "__main__":
    main()
