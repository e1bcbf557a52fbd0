"""
Does SFT keep what the base knew? Greedy pass@1 of the base and of an SFT run on the same held-out
problems, each asked the way it was trained (the base: the plain document "question\\n"; the SFT model: a
chat prompt), and the paired change SFT - base with its standard error.

    python benchmarks/sft_vs_base.py [--base out/cpu/base/default] [--sft out/cpu/sft/default] [--problems 500]

`--sft` may be given several times (SFT runs with other settings) to compare each against the same base.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from evaluation import paired_change  # noqa: E402
from checkpoint import load_hf, resolve_model_path  # noqa: E402
from common import nanopost_home
from engine import Engine  # noqa: E402
from model import GPT  # noqa: E402
from verifiers import answer_text, verify  # noqa: E402
from tasks import generate_problems  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def greedy_correct(path, problems, chat, max_new_tokens=192):
    model, tok = load_hf(path), Tokenizer.load(path)
    if chat:
        prompts = [tok.render_for_completion([{"role": "user", "content": p.question}]) for p in problems]
    else:
        prompts = [tok.encode(p.question + "\n") for p in problems]
    outs = Engine(model, tok).generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
    texts = [tok.decode([t for t in o.tokens if t not in tok.stop_ids]) for o in outs]
    return [float(verify("gsm8k", answer_text(t) if chat else t, str(p.answer))) for t, p in zip(texts, problems)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=os.path.join(nanopost_home(), "base", "default"))
    ap.add_argument("--sft", action="append", default=None)
    ap.add_argument("--problems", type=int, default=500)
    args = ap.parse_args()
    torch.manual_seed(0)
    problems = generate_problems("test", args.problems)
    base = greedy_correct(resolve_model_path(args.base), problems, chat=False)
    print(f"base {args.base}: greedy pass@1 {sum(base) / len(base):.3f} on {len(base)} problems")
    for sft in args.sft or [os.path.join(nanopost_home(), "sft", "default")]:
        after = greedy_correct(resolve_model_path(sft), problems, chat=True)
        change, se = paired_change(base, after)
        print(f"sft  {sft}: greedy pass@1 {sum(after) / len(after):.3f}; SFT - base {change:+.3f} +- {se:.3f} "
              f"({change / se if se else 0:+.1f} SE)")


if __name__ == "__main__":
    main()
