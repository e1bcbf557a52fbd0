"""
The length bias of per-answer normalization (Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A
Critical Perspective", arXiv:2503.20783).

Paper GRPO averages each answer's token losses, then the answers (--agg seq-mean-token-mean), so each token of an
answer of |o| tokens carries A / |o|. A wrong answer (A < 0) is pushed down less per token the longer it is; a right
one (A > 0) is pushed up more per token the shorter it is. The paper's claim: under GRPO the wrong answers grow
longer while the right ones do not. Its fix, Dr. GRPO, divides the token sum by a constant (answers x max_len:
--agg seq-mean-token-sum-norm) and the advantage by nothing (--scale none). nanopost's default, token-mean (DAPO),
weights every token of the batch alike. Worked: a right answer of 10 tokens and a wrong one of 40, A = +1 and -1:
per-token weights +1/10 and -1/40 under GRPO (the wrong answer's tokens 4x lighter), +1/50 and -1/50 under
token-mean, and +1/(2 x 192) and -1/(2 x 192) under Dr. GRPO at --max-new-tokens 192.

Three runs of chat_rl.py from runs/cpu.sh's SFT checkpoint (sft/default), the same seed, prompts and steps, one flag
set apart, on 2 ranks, 16 prompts x 8 answers a step (the pipeline: 64):
    grpo        --agg seq-mean-token-mean                       paper GRPO (group std scaling, the default)
    token-mean  the defaults                                    DAPO's aggregation
    dr-grpo     --scale none --agg seq-mean-token-sum-norm      Dr. GRPO
first with the calculator offered, as the pipeline's RL runs, then without it (VARIANTS: with it, the calculator's
results lengthen the answers whatever the aggregation). Each step logs the mean length of its right and of its wrong
answers (length_correct, length_wrong; in tokens, the calculator's forced results included, as length_mean counts
them) and their accuracy; greedy held-out pass@1 at the start and the end. The figure draws the lengths and the
accuracy against steps, a row per variant.

    python lab/length_bias.py                  # ~16 min on 2 cores; docs/lab/length_bias.{json,png}
    python lab/length_bias.py --home /tmp/np   # another pipeline's checkpoints (runs/cpu.sh under NANOPOST_HOME)
"""
from labkit import RL_SMOKE, Lab, checkpoint, figure, moving_average, parser

CONFIGS = {  # run name -> chat_rl.py flags: the one setting each run changes
    "grpo": ["--agg", "seq-mean-token-mean"],
    "token-mean": [],
    "dr-grpo": ["--scale", "none", "--agg", "seq-mean-token-sum-norm"],
}
# the calculator offered, as the pipeline's RL runs; then without it, the one change of setting tried when the
# aggregations did not differ with it (the calculator's results lengthen the answers whatever the aggregation)
VARIANTS = {"tools": ["--tools"], "no-tools": []}
STEPS, PROMPTS, EVAL_PROBLEMS = 40, 16, 200


def last_fifth(rows, key):
    """The mean of `key` over the last fifth of the steps that logged it (at least one step)."""
    values = [r[key] for r in rows if key in r]
    part = values[-max(1, len(values) // 5):]
    return sum(part) / len(part) if part else None


def main():
    args = parser("length_bias", __doc__.strip().split("\n\n")[0]).parse_args()
    lab = Lab("length_bias", args)
    sft = checkpoint(args.home, "sft")
    common = ["--init", sft, "--seed", "0", "--pass-k", "0", "--save-every", "100000"]
    if args.smoke:
        common += RL_SMOKE + ["--eval-every", "2"]
    else:
        common += ["--steps", STEPS, "--prompts-per-step", PROMPTS, "--eval-problems", EVAL_PROBLEMS, "--eval-every", STEPS]
    # the smoke home's tiny model has no calculator (its tool prompt would overflow): the second half only
    variants = {"no-tools": []} if args.smoke else VARIANTS
    runs = {variant: {} for variant in variants}
    for variant, variant_flags in variants.items():
        for name, flags in CONFIGS.items():
            path = lab.run("chat_rl.py", *common, *variant_flags, *flags, stage="rl", nproc=1 if args.smoke else 2,
                           run_name=f"lab-length_bias-{name}" + ("" if variant_flags else "-no-tools"))
            rows = lab.metrics(path)
            steps = [r for r in rows if "accuracy" in r]
            evals = [r for r in rows if "eval/pass@1" in r]
            run = runs[variant][name] = {
                "flags": variant_flags + flags,
                "step": [r["step"] for r in steps],
                # a step with no right (or no wrong) answer has no such length: None in the lists, a gap in the plot
                **{key: [r.get(key) for r in steps] for key in ("length_correct", "length_wrong", "length_mean",
                                                                 "accuracy", "truncated_frac", "tool_use_rate")},
                # what the page quotes: the first step, and the last fifth of the run averaged
                "first_step": {k: steps[0].get(k) for k in ("length_correct", "length_wrong", "accuracy")},
                "end": {k: last_fifth(steps, k) for k in ("length_correct", "length_wrong", "accuracy")},
                "heldout_pass@1": {"start": evals[0]["eval/pass@1"], "end": evals[-1]["eval/pass@1"]},
                "seconds": lab.commands[-1]["seconds"],
            }
            print(f"[length_bias] {variant} {name}: length right {run['first_step']['length_correct']} -> "
                  f"{run['end']['length_correct']}, wrong {run['first_step']['length_wrong']} -> "
                  f"{run['end']['length_wrong']}, held-out pass@1 {run['heldout_pass@1']}", flush=True)

    fig, axes = figure(len(runs), 3, layout="constrained")
    panels = [("length_wrong", "wrong answers: mean length (tokens)"),
              ("length_correct", "right answers: mean length (tokens)"), ("accuracy", "accuracy of the step's answers")]
    for row, (variant, variant_runs) in enumerate(runs.items()):
        for ax, (key, title) in zip(axes[3 * row:], panels):
            for i, (name, run) in enumerate(variant_runs.items()):
                points = [(s, v) for s, v in zip(run["step"], run[key]) if v is not None]
                if not points:
                    continue
                xs, ys = zip(*points)
                ax.plot(xs, ys, color=f"C{i}", alpha=0.3, linewidth=0.8)
                ax.plot(xs, moving_average(ys), color=f"C{i}", label=f"{name} (5-step mean)")
            ax.set_title(f"{variant}: {title}", fontsize=10)
            ax.set_xlabel("step", fontsize=9)
            ax.grid(alpha=0.3)
        axes[3 * row].legend(fontsize=8)
    lab.save({"home": args.home, "init": sft, "smoke": args.smoke, "steps": 2 if args.smoke else STEPS,
              "prompts_per_step": 4 if args.smoke else PROMPTS, "group_size": 4 if args.smoke else 8,
              "ranks": 1 if args.smoke else 2, "runs": runs}, fig)


if __name__ == "__main__":
    main()
