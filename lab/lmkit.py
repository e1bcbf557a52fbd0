"""
What the lab's language-model level shares (lab.md): several seeds per configuration, held-out problems graded one
by one so that two configurations compare on the same problems (a paired difference and its standard error), and
curves drawn as the seed mean with a band. Nothing of any method: each experiment's runs are its own script's.

    seeds = lmkit.seeds(args)                              # --seeds (default 3; --smoke 2)
    rows = lmkit.heldout(200)                              # the same held-out problems for every seed and run
    ev = lmkit.per_problem(run_dir, rows, samples=4, temperature=1.0, max_new_tokens=192, tools=True, seed=0)
    d = lmkit.paired(ev_a["score"], ev_b["score"])         # {"diff": b - a, "se": ..., "n": ...}
    lmkit.draw_band(ax, steps, [curve_seed0, curve_seed1, curve_seed2], color="C0", label="GRPO")

A per-problem score is the share of a problem's samples the verifier passed (greedy: 0 or 1). Averaged over seeds
problem by problem first, it pairs two configurations on the problems they share: the standard error of the mean
difference then holds the problems' spread and, through the seed mean, the seeds'.
"""
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import load_hf, resolve_model_path  # noqa: E402
from evaluation import evaluate_chat  # noqa: E402
from tasks import rl_prompts  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

SEEDS, SMOKE_SEEDS = 3, 1  # lab.md: >= 3 seeds per configuration; a smoke test runs 1 (test_lab_lmkit.py: the bands)
HELDOUT_SEED = 0  # the embedded world's held-out problems every experiment evaluates on (chat_rl's at --seed 0)


def add_seed_flag(p):
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds per configuration (default {SEEDS}; smoke {SMOKE_SEEDS})")


def seeds(args) -> list:
    """The seeds every configuration runs: 0 .. --seeds - 1."""
    return list(range(args.seeds or (SMOKE_SEEDS if args.smoke else SEEDS)))


def heldout(n: int) -> list:
    """The first n of the embedded world's held-out problems (the test split), the same for every seed and run."""
    return rl_prompts("test", n, seed=HELDOUT_SEED)


def write_rows(rows: list, path: str) -> str:
    """rows as JSONL at path (a --data or --eval-data file for a stage); returns path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


@torch.no_grad()
def per_problem(model_dir: str, rows: list, *, samples: int = 1, temperature: float = 0.0, max_new_tokens: int,
                tools: bool = False, seed: int = 0, prompt_format: str = "chat") -> dict:
    """A checkpoint (a model folder or a run's latest) on `rows`, problem by problem: "score", per problem the share
    of its `samples` answers the verifier passed (greedy at temperature 0: one answer, 0 or 1), "correct" the counts,
    and evaluation.evaluate_chat's means (pass@1..samples, format_rate, stop_rate, mean_length)."""
    folder = resolve_model_path(model_dir)
    tok = Tokenizer.load(folder).with_prompt_format(prompt_format)
    metrics, correct = evaluate_chat(load_hf(folder), tok, rows, num_samples=samples, max_new_tokens=max_new_tokens,
                                     temperature=temperature, seed=seed, use_tools=tools, per_prompt=True)
    return {**metrics, "correct": correct, "score": [c / samples for c in correct]}


# ------------------------------------------------------------------------------------------------
# Statistics

def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def mean_se(xs) -> dict:
    """The mean of xs and its standard error (sample std / sqrt(n)). Example: [1, 0, 1, 1] -> 0.75, 0.25."""
    xs = [float(x) for x in xs if x is not None]
    n = len(xs)
    m = sum(xs) / n
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else None  # one value: no spread to see
    return {"mean": m, "se": se, "n": n}


def seed_mean(per_seed: list) -> list:
    """Per-problem scores averaged over seeds: per_seed[s][i] is seed s's score on problem i."""
    return [sum(col) / len(col) for col in zip(*per_seed)]


def paired(a: list, b: list) -> dict:
    """b - a on the same problems: the mean difference, its standard error and n (paired: each problem's own
    difficulty cancels). Example: a [1, 0, 0, 1], b [1, 1, 0, 1] -> diff 0.25, se 0.25, n 4."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("paired needs two equally long lists of at least 2 scores")
    d = mean_se([y - x for x, y in zip(a, b)])
    return {"diff": d["mean"], "se": d["se"], "n": d["n"]}


def bootstrap(values: list, stat=None, *, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> list:
    """A percentile bootstrap interval [lo, hi] of stat(values) (default the mean), resampling values with
    replacement (the problems, when values are per problem). stat takes a list of the resampled values."""
    stat = stat or mean
    rng = random.Random(seed)
    n = len(values)
    draws = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1 - level) / 2
    return [draws[int(tail * (resamples - 1))], draws[int((1 - tail) * (resamples - 1))]]


def band(curves: list) -> dict:
    """Curves of several seeds, point by point (None where a seed has no value): the mean and the min-max."""
    points = [[v for v in col if v is not None] for col in zip(*curves)]
    return {"mean": [mean(p) if p else None for p in points], "lo": [min(p) if p else None for p in points],
            "hi": [max(p) if p else None for p in points]}


def spread(values: list) -> dict:
    """One figure over seeds: its mean, min and max (what a page quotes as "0.41 (0.38-0.44)")."""
    values = [v for v in values if v is not None]
    if not values:  # e.g. an accuracy among answers none of which was right
        return {"mean": None, "min": None, "max": None, "seeds": 0}
    return {"mean": mean(values), "min": min(values), "max": max(values), "seeds": len(values)}


def draw_band(ax, x: list, curves: list, *, color: str, label: str, linestyle: str = "-", marker=None):
    """The seeds' mean as a line, their min-max as a shaded band around it (lab.md: seeds drawn as a band)."""
    b = band(curves)
    keep = [i for i, m in enumerate(b["mean"]) if m is not None]
    xs = [x[i] for i in keep]
    ax.fill_between(xs, [b["lo"][i] for i in keep], [b["hi"][i] for i in keep], color=color, alpha=0.2, lw=0)
    ax.plot(xs, [b["mean"][i] for i in keep], color=color, linestyle=linestyle, marker=marker, markersize=3,
            label=f"{label} ({len(curves)} seed{'s' if len(curves) > 1 else ''}, min-max)")
