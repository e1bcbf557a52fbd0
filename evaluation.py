"""
Held-out evaluation, the same in every stage: sample answers to held-out problems with the engine and grade
each with its row's verifier (on the answer: the text after the last </think>).

    pass@k       unbiased estimate from n samples per prompt (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)
    maj@n        majority voting (self-consistency, Wang et al. 2022): the answer most of the n samples give is right
    format_rate  completions with exactly one parseable final answer (`#### N` for the default world)
    stop_rate    completions that ended with <|im_end|> before the length limit
    mean_length  completion tokens

Under torchrun every rank evaluates its share of the problems and the counts are summed: no rank waits
alone inside a collective while another evaluates. chat_eval.py is the command line around these.
"""
import math
import time
from collections import Counter
from math import comb

import torch

from common import all_gather_objects, all_reduce_dict, dist_info, print0, unwrap
from engine import Engine
from verifiers import answer_text, final_answer, has_format, verify_batch
from tasks import CALCULATOR_SCHEMA, TOOLS


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn from n, of which c are correct) is correct.
    With p = c/n and n large this is 1 - (1 - p)^k: p = 0.3 -> 0.3000, 0.7599, 0.9424, 0.9967 for k = 1, 4, 8, 16."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(answers: list, scores: list) -> bool:
    """maj@k for one problem: whether the final answer most of its k samples give is right. answers: each sample's
    final answer (verifiers.final_answer; None: no answer, no vote); scores: each sample's grade. A tie goes to the
    answer drawn first. Examples: answers [12, 15, 12, None], scores [1, 0, 1, 0] -> 12 has 2 votes: True;
    answers [15, 12], scores [0, 1] -> a tie, 15 drawn first: False; answers [None, None] -> no vote: False."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    most = max(votes.values())
    winner = next(i for i, a in enumerate(answers) if a is not None and votes[a] == most)
    return scores[winner] == 1.0


@torch.no_grad()
def evaluate_chat(model, tok, rows, num_samples=1, max_new_tokens=256, temperature=0.0, top_k=None, top_p=None,
                  seed=0, use_tools=False, batch_size=64, per_prompt=False):
    """Sample and grade; returns metrics (pass@1..num_samples, maj@num_samples when it is above 1, format_rate,
    stop_rate, mean_length), and
    with per_prompt=True also the number of correct samples of each row (for paired comparisons).
    use_tools offers the calculator (its schema in the prompt, executed by the engine mid-rollout) and adds
    tool_use_rate (answers that called it) and tool_errors (its error results per answer).
    Under torchrun every rank evaluates its share of the rows (rows[rank::world]) and the counts are
    summed, so no rank waits alone inside a collective while another evaluates; every rank must call it."""
    info = dist_info()
    schemas = [CALCULATOR_SCHEMA] if use_tools else None
    engine = Engine(unwrap(model), tok, tools=TOOLS if use_tools else None)
    mine = list(range(info.rank, len(rows), info.world_size))
    correct_of, totals = {}, {"format": 0.0, "stop": 0.0, "length": 0.0, "tool_use": 0.0, "tool_errors": 0.0,
                              "majority": 0.0}
    with engine.prepared():  # the sampler's weights, gathered once (a collective under FSDP2)
        for i in range(0, len(mine), batch_size):
            chunk = [rows[j] for j in mine[i:i + batch_size]]
            prompts = [tok.render_for_completion(r["prompt"], tools=r.get("tools") or schemas) for r in chunk]
            outs = engine.generate(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + mine[i])
            answers = [answer_text(tok.decode(o.tokens)) for o in outs]
            row_of = [chunk[k // num_samples] for k in range(len(outs))]
            scores, _, _ = verify_batch([r["verifier"] for r in row_of], answers,  # code rows run in parallel
                                        [r["ground_truth"] for r in row_of])
            for j, row in enumerate(chunk):
                own = range(j * num_samples, (j + 1) * num_samples)  # this problem's samples
                correct_of[mine[i + j]] = sum(scores[k] == 1.0 for k in own)
                totals["majority"] += majority_correct([final_answer(row["verifier"], answers[k]) for k in own],
                                                       [scores[k] for k in own])
            for r, o, answer in zip(row_of, outs, answers):
                totals["format"] += has_format(r["verifier"], answer)
                totals["stop"] += o.finish_reason == "stop"
                totals["length"] += len(o.tokens)
                totals["tool_use"] += o.tool_calls > 0
                totals["tool_errors"] += o.tool_errors
    pass_sums = {f"pass@{k}": sum(pass_at_k(num_samples, c, k) for c in correct_of.values())
                 for k in range(1, num_samples + 1)}
    sums = all_reduce_dict({**pass_sums, **totals}, keys=[*pass_sums, *totals])
    n_total = len(rows) * num_samples
    metrics = {k: sums[k] / len(rows) for k in pass_sums}
    if num_samples > 1:
        metrics[f"maj@{num_samples}"] = sums["majority"] / len(rows)
    metrics.update(format_rate=sums["format"] / n_total, stop_rate=sums["stop"] / n_total,
                   mean_length=sums["length"] / n_total)
    if use_tools:  # answers that called the calculator, and its error results per answer
        metrics.update(tool_use_rate=sums["tool_use"] / n_total, tool_errors=sums["tool_errors"] / n_total)
    if not per_prompt:
        return metrics
    merged = {i: c for part in all_gather_objects(correct_of) for i, c in part.items()}  # every rank's rows
    return metrics, [merged[i] for i in range(len(rows))]


MIN_HELDOUT = 20  # below it a held-out rate's standard error passes ~0.1: the figure says little


def scores_line(scores: dict, n: int) -> str:
    """Held-out scores for a log line: each rate (pass@k, *_rate, *accuracy*) with its binomial standard error
    sqrt(p (1 - p) / n), then n, and a warning when n is below MIN_HELDOUT.
    Example: ({"pass@1": 0.475, "val_loss": 0.0886}, 200) -> "pass@1 0.475±0.035  val_loss 0.089  (n 200)"."""
    parts = []
    for k, v in scores.items():
        # a per-kind accuracy (accuracy/<kind>) has fewer rows than n: no error is given for it
        is_rate = ("pass@" in k or "maj@" in k or k.endswith("_rate") or "accuracy" in k) and "change" not in k \
            and "accuracy/" not in k
        if isinstance(v, float) and is_rate and 0 <= v <= 1 and n > 0:
            parts.append(f"{k} {v:.3f}±{math.sqrt(v * (1 - v) / n):.3f}")
        else:
            parts.append(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}")
    note = "" if n == 0 else f"  (n {n})" if n >= MIN_HELDOUT else \
        f"  (n {n}: too few for these figures to mean much; hold out {MIN_HELDOUT}+ rows with --eval-data)"
    return "  ".join(parts) + note


def heldout_scores(model, tok, rows, *, max_new_tokens, samples=4, temperature=1.0, top_k=None, top_p=None,
                   seed=0, use_tools=False, label=None) -> dict:
    """What a stage reports on held-out problems: greedy pass@1, format and stop rates, and pass@1..samples
    and maj@samples at `temperature` (keys suffixed _t1 at T=1); with use_tools, each one's tool-use rate
    (tool_use_rate, tool_use_rate_t1) and the greedy answers' tool errors. Every stage that samples reports the
    same keys the same way, so report.json compares them (SFT, RL and PPO with the calculator offered alike).
    label: print the scores on one line after it (e.g. "eval @ step 20"), with the seconds they took."""
    t0 = time.time()
    greedy = evaluate_chat(model, tok, rows, max_new_tokens=max_new_tokens, use_tools=use_tools)
    scores = {k: greedy[k] for k in ("pass@1", "format_rate", "stop_rate", "tool_use_rate", "tool_errors")
              if k in greedy}
    if samples:
        sampled = evaluate_chat(model, tok, rows, num_samples=samples, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, use_tools=use_tools)
        scores.update({f"{k}_t{temperature:g}": v for k, v in sampled.items()
                       if k.startswith(("pass@", "maj@")) or k == "tool_use_rate"})
    if label:
        print0(f"{label} ({time.time() - t0:.0f}s): " + scores_line(scores, len(rows)))
    return scores


def paired_change(before: list, after: list) -> tuple[float, float]:
    """Mean change of a per-problem score between two evaluations of the same problems, and its standard
    error. Pairing cancels the problems' own difficulty: on 500 problems where two models agree on most
    answers the error is ~0.01, where two independent pass@1 estimates would each carry ~0.022."""
    if len(before) != len(after) or len(before) < 2:
        raise ValueError("paired_change needs two equally long lists of at least 2 scores")
    d = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    return d.mean().item(), (d.std() / len(d) ** 0.5).item()
