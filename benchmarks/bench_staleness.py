"""
The staleness experiment (chat_rl.py --staleness, --correction, --off-policy): how much does it cost to
train on answers sampled by weights K steps old, and does the sampler correction win it back?

Runs chat_rl.py from one SFT checkpoint once per configuration, each one process with the same number of
steps (or, with --time-budget, the same seconds of training: off-policy's case is speed), one at a time
(each under `flock LOCK` when --lock is given, so other heavy jobs can interleave), then prints one table
row per run from its metrics.jsonl:

    staleness K in {0, 1, 4} x --correction {token-tis, none}, synchronous
    --off-policy (the next batch sampled in a thread while this one trains) vs synchronous, token-tis

Columns: steps and steps per minute of training; the mean reward over the run's second half; held-out
pass@1 at the end (greedy, and at T=1 from --pass-k samples); and the ratio statistics that explain a
(non-)difference, averaged over the steps whose batch really was stale: logprob_mismatch (mean
|log p_trainer - log p_sampler| per token), correction_mean (the correction's mean weight), clip_frac and
ratio_mean of the updates; the staleness histogram (steps at each staleness).

    python benchmarks/bench_staleness.py --init /work/pipe/sft/default --steps 40 --lock /tmp/nanopost-heavy.lock
    OVERWRITE=1 python benchmarks/bench_staleness.py ...    # replace the runs of an earlier call
    python benchmarks/bench_staleness.py --table-only       # print the table of the runs already there

Runs are written under $NANOPOST_HOME/rl/stale-<name>/ (named in the first column).
"""
import argparse
import collections
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import nanopost_home  # noqa: E402

CONFIGS = {  # run name -> chat_rl.py flags
    "k0-tis": ["--staleness", "0", "--correction", "token-tis"],
    "k0-none": ["--staleness", "0", "--correction", "none"],
    "k1-tis": ["--staleness", "1", "--correction", "token-tis"],
    "k1-none": ["--staleness", "1", "--correction", "none"],
    "k4-tis": ["--staleness", "4", "--correction", "token-tis"],
    "k4-none": ["--staleness", "4", "--correction", "none"],
    "offpolicy-tis": ["--off-policy", "--correction", "token-tis"],
}


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(path):
    """One row of the table from a run's metrics.jsonl."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    stale = [r for r in steps if r["staleness"] > 0] or steps
    last = evals[-1] if evals else {}
    t1 = next((k for k in last if k.startswith("eval/pass@1_t")), None)
    seconds = steps[-1]["train_seconds"] if steps else 0.0
    return {
        "steps": len(steps),
        "steps_per_min": 60 * len(steps) / max(seconds, 1e-9),
        "reward_2nd_half": mean(r["reward"] for r in steps[len(steps) // 2:]),
        "pass@1": last.get("eval/pass@1", float("nan")),
        "pass@1_t1": last.get(t1, float("nan")) if t1 else float("nan"),
        "logprob_mismatch": mean(r["logprob_mismatch"] for r in stale),
        "correction_mean": mean(r["correction_mean"] for r in stale),
        "clip_frac": mean(r["clip_frac"] for r in stale),
        "ratio_mean": mean(r["ratio_mean"] for r in stale),
        "staleness": dict(sorted(collections.Counter(r["staleness"] for r in steps).items())),
    }


def print_table(names):
    cols = ["steps", "steps_per_min", "reward_2nd_half", "pass@1", "pass@1_t1", "logprob_mismatch",
            "correction_mean", "clip_frac", "ratio_mean"]
    print("| run | " + " | ".join(cols) + " | staleness: steps |")
    print("|---" * (len(cols) + 2) + "|")
    for name in names:
        path = os.path.join(nanopost_home(), "rl", f"stale-{name}", "metrics.jsonl")
        if not os.path.exists(path):
            continue
        s = summarize(path)
        cells = [f"{s[c]}" if c == "steps" else f"{s[c]:.1f}" if c == "steps_per_min" else f"{s[c]:.4f}"
                 if c in ("logprob_mismatch", "clip_frac") else f"{s[c]:.3f}" for c in cols]
        hist = ", ".join(f"{k}: {v}" for k, v in s["staleness"].items())
        print(f"| {name} | " + " | ".join(cells) + f" | {hist} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", default=None, help="the SFT model folder or run dir (default: chat_rl.py's)")
    ap.add_argument("--steps", type=int, default=40, help="steps per run (the same on any machine)")
    ap.add_argument("--time-budget", type=float, default=0, help="seconds of training per run instead (0: off)")
    ap.add_argument("--prompts-per-step", type=int, default=16, help="small steps, so a short run has many")
    ap.add_argument("--runs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--lock", default=None, help="run each training under `flock LOCK`")
    ap.add_argument("--table-only", action="store_true", help="print the table of the runs already there")
    args, extra = ap.parse_known_args()  # anything else goes to chat_rl.py
    names = args.runs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown run(s) {unknown}; one of {list(CONFIGS)}")
    if not args.table_only:
        for name in names:
            cmd = [sys.executable, os.path.join(REPO, "chat_rl.py"), "--run-name", f"stale-{name}",
                   "--steps", str(1000 if args.time_budget else args.steps), "--time-budget", str(args.time_budget),
                   *(["--overwrite"] if os.environ.get("OVERWRITE") == "1" else []), "--prompts-per-step",
                   str(args.prompts_per_step), "--eval-every", "100000", "--save-every", "100000",
                   *(["--init", args.init] if args.init else []), *CONFIGS[name], *extra]
            if args.lock:
                cmd = ["flock", args.lock, *cmd]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
    print_table(names)


if __name__ == "__main__":
    main()
