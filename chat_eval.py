"""
Evaluate a chat checkpoint on held-out problems, and gather the pipeline's report.

Each held-out RL row (a prompt, its ground truth and its verifier) is rendered as the prompt RL samples
from, completed by the engine, and graded by the row's verifier on the answer (the text after the
last </think>). Metrics:
    pass@k       unbiased estimate from n samples per prompt (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)
    format_rate  completions with exactly one parseable final answer (`#### N` for the default world)
    stop_rate    completions that ended with <|im_end|> before the length limit
    mean_length  completion tokens

    python chat_eval.py --model out/sft/default                  # greedy pass@1 on 200 held-out problems
    python chat_eval.py --model PATH --num-samples 8 --temperature 1.0   # pass@1..8
    python chat_eval.py --report                                 # every stage's eval.json -> report.json
"""
import argparse
import json
import os
from math import comb

import torch

from common import (all_gather_objects, all_reduce_dict, dist_info, init_dist, nanopost_home, print0,
                    resolve_model_path, unwrap)
from engine import Engine
from rewards import answer_text, has_format, verify
from tasks import CALCULATOR_SCHEMA, TOOLS, rl_prompts

STAGES = ("base", "sft", "rm", "dpo", "rl", "ppo")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn from n, of which c are correct) is correct.
    With p = c/n and n large this is the seed's 1 - (1 - p)^k: p = 0.3 -> 0.3000, 0.7599, 0.9424, 0.9967."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@torch.no_grad()
def evaluate_chat(model, tok, rows, num_samples=1, max_new_tokens=256, temperature=0.0, top_k=None, top_p=None,
                  seed=0, use_tools=False, batch_size=64, per_prompt=False):
    """Sample and grade; returns metrics (pass@1..num_samples, format_rate, stop_rate, mean_length), and
    with per_prompt=True also the number of correct samples of each row (for paired comparisons).
    use_tools offers the calculator (its schema in the prompt, executed by the engine mid-rollout).
    Under torchrun every rank evaluates its share of the rows (rows[rank::world]) and the counts are
    summed, so no rank waits alone inside a collective while another evaluates; every rank must call it."""
    info = dist_info()
    schemas = [CALCULATOR_SCHEMA] if use_tools else None
    engine = Engine(unwrap(model), tok, tools=TOOLS if use_tools else None)
    mine = list(range(info.rank, len(rows), info.world_size))
    correct_of, totals = {}, {"format": 0.0, "stop": 0.0, "length": 0.0}
    with engine.prepared():  # the sampler's weights, gathered once (a collective under FSDP2)
        for i in range(0, len(mine), batch_size):
            chunk = [rows[j] for j in mine[i:i + batch_size]]
            prompts = [tok.render_for_completion(r["prompt"], tools=r.get("tools") or schemas) for r in chunk]
            outs = engine.generate(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + mine[i])
            for j, r in enumerate(chunk):
                correct = 0
                for o in outs[j * num_samples:(j + 1) * num_samples]:
                    answer = answer_text(tok.decode(o.tokens))
                    correct += verify(r["verifier"], answer, r["ground_truth"]) == 1.0
                    totals["format"] += has_format(r["verifier"], answer)
                    totals["stop"] += o.finish_reason == "stop"
                    totals["length"] += len(o.tokens)
                correct_of[mine[i + j]] = correct
    pass_sums = {f"pass@{k}": sum(pass_at_k(num_samples, c, k) for c in correct_of.values())
                 for k in range(1, num_samples + 1)}
    sums = all_reduce_dict({**pass_sums, **totals}, keys=[*pass_sums, *totals])
    n_total = len(rows) * num_samples
    metrics = {k: sums[k] / len(rows) for k in pass_sums}
    metrics.update(format_rate=sums["format"] / n_total, stop_rate=sums["stop"] / n_total,
                   mean_length=sums["length"] / n_total)
    if not per_prompt:
        return metrics
    return metrics, _in_row_order(correct_of, len(rows))


def _in_row_order(correct_of, n):
    """Every rank's {row index: correct count} merged into one list in row order."""
    merged = {}
    for part in all_gather_objects(correct_of):
        merged.update(part)
    return [merged[i] for i in range(n)]


def paired_change(before: list, after: list) -> tuple[float, float]:
    """Mean change of a per-problem score between two evaluations of the same problems, and its standard
    error. Pairing cancels the problems' own difficulty: on 500 problems where two models agree on most
    answers the error is ~0.01, where two independent pass@1 estimates would each carry ~0.022."""
    if len(before) != len(after) or len(before) < 2:
        raise ValueError("paired_change needs two equally long lists of at least 2 scores")
    d = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    return d.mean().item(), (d.std() / len(d) ** 0.5).item()


def report(run: str = "default") -> dict:
    """Gather $NANOPOST_HOME/<stage>/<run>/eval.json into $NANOPOST_HOME/report.json and print a table."""
    rep = {}
    for stage in STAGES:
        path = os.path.join(nanopost_home(), stage, run, "eval.json")
        if os.path.isfile(path):
            with open(path) as f:
                rep[stage] = json.load(f)
    out = os.path.join(nanopost_home(), "report.json")
    with open(out, "w") as f:
        json.dump(rep, f, indent=2)
    cols = ["pass@1", "pass@1_t1", "format_rate", "stop_rate", "pair_accuracy"]
    print(f"{'stage':8s}" + "".join(f"{c:>15s}" for c in cols))
    for stage, m in rep.items():
        print(f"{stage:8s}" + "".join(f"{m[c]:15.3f}" if c in m else f"{'-':>15s}" for c in cols))
    print(f"report -> {out}")
    return rep


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="evaluate a chat checkpoint on held-out problems")
    ap.add_argument("--model", help="model folder or run directory (its latest checkpoint)")
    ap.add_argument("--report", action="store_true", help="gather every stage's eval.json into report.json")
    ap.add_argument("--run-name", default="default", help="run name, with --report")
    ap.add_argument("--n", type=int, default=200, help="held-out problems")
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tools", action="store_true", help="offer the calculator tool")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if args.report:
        report(args.run_name)
    elif not args.model:
        ap.error("pass --model PATH or --report")
    else:
        from model import GPT
        from tokenizer import Tokenizer
        dist = init_dist(args.device)
        path = resolve_model_path(args.model)
        model, tok = GPT.from_hf(path, device=dist.device), Tokenizer.load(path)
        rows = rl_prompts("test", args.n)
        m = evaluate_chat(model, tok, rows, args.num_samples, args.max_new_tokens, args.temperature, args.top_k,
                          args.top_p, use_tools=args.tools)
        print0(json.dumps({k: round(v, 4) for k, v in m.items()}, indent=2))
