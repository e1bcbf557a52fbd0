"""
Stale samplers (chat_rl.py --staleness, --off-policy, --correction): what does it cost to train on answers sampled
by the weights of k steps back, and does the sampler correction win it back? The second half of
docs/lab/sampler_trainer.md: there the sampler differs from the trainer by its numerics, here by its age.

Seven runs of chat_rl.py from runs/cpu.sh's SFT checkpoint (sft/default), the same seed, prompts and steps, one
process each, the calculator offered as the pipeline's RL runs, 16 prompts x 8 answers a step (the pipeline: 64):
    k0-tis, k0-none      synchronous (on-policy), --correction token-tis (the default) or none
    k1-tis, k1-none      --staleness 1: every batch sampled by the weights one step back
    k4-tis, k4-none      --staleness 4
    offpolicy-tis        --off-policy: the next batch sampled in a thread, from a snapshot, while this one trains
One table row per run: steps per minute of training; the mean reward over the run's second half; held-out pass@1
at the end, greedy and at T=1; and the ratio statistics that explain a (non-)difference, averaged over the steps
whose batch really was stale: logprob_mismatch (mean |log p_trainer - log p_sampler| per token), correction_mean
(the correction's mean weight), clip_frac and ratio_mean of the updates; and how many steps ran at each staleness.

    python lab/staleness.py                    # ~20 min on 2 cores; docs/lab/staleness.{json,png}
    python lab/staleness.py --home /tmp/np     # another pipeline's checkpoints (runs/cpu.sh under NANOPOST_HOME)

It moved here from benchmarks/bench_staleness.py, which ran on a time budget (--time-budget 90); the lab runs a
fixed number of steps, so that every machine runs the same ones (each rerun replaces the lab-staleness-* runs).
"""
import collections

from labkit import Lab, checkpoint, figure, parser

CONFIGS = {  # run name -> chat_rl.py flags
    "k0-tis": ["--staleness", "0", "--correction", "token-tis"],
    "k0-none": ["--staleness", "0", "--correction", "none"],
    "k1-tis": ["--staleness", "1", "--correction", "token-tis"],
    "k1-none": ["--staleness", "1", "--correction", "none"],
    "k4-tis": ["--staleness", "4", "--correction", "token-tis"],
    "k4-none": ["--staleness", "4", "--correction", "none"],
    "offpolicy-tis": ["--off-policy", "--correction", "token-tis"],
}
STEPS, PROMPTS, EVAL_PROBLEMS = 16, 16, 200
SMOKE = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--num-prompts", "16",
         "--eval-problems", "4", "--pass-k", "2", "--max-resample", "1"]  # the test home's tiny model, no calculator
COLUMNS = ["steps", "steps_per_min", "reward_2nd_half", "pass@1", "pass@1_t1", "logprob_mismatch", "correction_mean",
           "clip_frac", "ratio_mean"]


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows):
    """One row of the table from a run's metrics.jsonl rows."""
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


def table(summaries: dict) -> str:
    """The markdown table docs/lab/sampler_trainer.md shows."""
    lines = ["| run | " + " | ".join(COLUMNS) + " | staleness: steps |", "|---" * (len(COLUMNS) + 2) + "|"]
    for name, s in summaries.items():
        cells = [f"{s[c]}" if c == "steps" else f"{s[c]:.1f}" if c == "steps_per_min" else f"{s[c]:.4f}"
                 if c in ("logprob_mismatch", "clip_frac") else f"{s[c]:.3f}" for c in COLUMNS]
        hist = ", ".join(f"{k}: {v}" for k, v in s["staleness"].items())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {hist} |")
    return "\n".join(lines)


def main():
    args = parser("staleness", __doc__.strip().split("\n\n")[0]).parse_args()
    lab = Lab("staleness", args)
    sft = checkpoint(args.home, "sft")
    common = ["--init", sft, "--seed", "0", "--save-every", "100000"]
    if args.smoke:
        common += SMOKE + ["--eval-every", "3"]
    else:
        common += ["--tools", "--steps", STEPS, "--prompts-per-step", PROMPTS, "--eval-problems", EVAL_PROBLEMS,
                   "--eval-every", STEPS]
    summaries, curves, start = {}, {}, None
    for name, flags in CONFIGS.items():
        rows = lab.metrics(lab.run("chat_rl.py", *common, *flags, stage="rl", run_name=f"lab-staleness-{name}"))
        summaries[name] = {"flags": flags, **summarize(rows), "seconds": lab.commands[-1]["seconds"]}
        steps = [r for r in rows if "reward" in r]
        curves[name] = {key: [r[key] for r in steps] for key in ("step", "reward", "logprob_mismatch", "staleness")}
        start = start or next(({k[5:]: v for k, v in r.items() if k.startswith("eval/")}
                               for r in rows if r["step"] == 0), None)
    print(table(summaries), flush=True)

    fig, axes = figure(1, 3, layout="constrained")
    for i, (name, c) in enumerate(curves.items()):
        style = {"color": f"C{i // 2}", "linestyle": "--" if name.endswith("none") else "-"}
        axes[0].plot(c["step"], c["reward"], label=name, **style)
        axes[1].plot(c["step"], [max(m, 1e-9) for m in c["logprob_mismatch"]], label=name, **style)
    names = list(summaries)
    for offset, (key, label) in enumerate((("pass@1", "greedy"), ("pass@1_t1", "T=1"))):
        axes[2].bar([i + 0.4 * offset for i in range(len(names))], [summaries[n][key] for n in names], width=0.4,
                    label=label)
    axes[2].set_xticks([i + 0.2 for i in range(len(names))], names, rotation=45, fontsize=7)
    axes[1].set_yscale("log")
    for ax, title in zip(axes, ["reward of the step's answers", "logprob_mismatch (nats/token; 1e-9 floor)",
                                "held-out pass@1 at the end"]):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[:2]:
        ax.set_xlabel("step", fontsize=9)
    lab.save({"home": args.home, "init": sft, "smoke": args.smoke, "tools": not args.smoke,
              "steps": 3 if args.smoke else STEPS, "prompts_per_step": 4 if args.smoke else PROMPTS,
              "group_size": 4 if args.smoke else 8, "ranks": 1, "start": start, "runs": summaries, "curves": curves,
              "table": table(summaries)}, fig)


if __name__ == "__main__":
    main()
