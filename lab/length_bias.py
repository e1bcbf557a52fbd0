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

Three configurations of chat_rl.py from runs/cpu.sh's SFT run, SEEDS seeds each, one flag set apart, on 2 ranks,
16 prompts x 8 answers a step (the pipeline: 64), STEPS steps, without the calculator (with it, the calculator's
results lengthen the answers whatever the aggregation: docs/lab/length_bias.md):
    grpo        --agg seq-mean-token-mean                       paper GRPO (group std scaling, the default)
    token-mean  the defaults                                    DAPO's aggregation
    dr-grpo     --scale none --agg seq-mean-token-sum-norm      Dr. GRPO
Each step logs the mean length of its right and of its wrong answers (length_correct, length_wrong, in tokens). At
the end EVAL_SAMPLES answers at T=1 to each of EVAL_PROBLEMS held-out problems (the same for every run) from each
run's end, problem by problem: the mean length of the wrong answers, of the right ones, the accuracy; and the spread
of lengths within a problem's answers (their coefficient of variation), which is how far GRPO's 1/|o| sets one
answer's tokens apart from another's: the size of the knob.

    python lab/length_bias.py                  # ~25 min on 2 cores; docs/lab/length_bias.{json,png}
    python lab/length_bias.py --home /tmp/np   # another pipeline's checkpoints (runs/cpu.sh under NANOPOST_HOME)
"""
import torch

import lmkit  # (puts the repository on the path)
from checkpoint import load_hf, resolve_model_path
from engine import Engine
from labkit import Lab, checkpoint, figure, parser
from rewards import Grader
from rollout import sample
from tokenizer import Tokenizer

CONFIGS = {  # run name -> chat_rl.py flags: the one setting each run changes
    "grpo": ["--agg", "seq-mean-token-mean"],
    "token-mean": [],
    "dr-grpo": ["--scale", "none", "--agg", "seq-mean-token-sum-norm"],
}
STEPS, PROMPTS, EVAL_PROBLEMS, EVAL_SAMPLES, MAX_NEW_TOKENS = 40, 16, 100, 8, 192
SMOKE = dict(steps=2, prompts=4, group=4, eval_problems=4, eval_samples=2, max_new_tokens=24)


@torch.no_grad()
def lengths(model_dir, rows, *, samples, max_new_tokens, seed):
    """`samples` answers at T=1 to each row: per problem the mean length of its wrong answers and of its right ones
    (None where it has none), its accuracy, and the coefficient of variation of its answers' lengths."""
    folder = resolve_model_path(model_dir)
    tok = Tokenizer.load(folder)
    r = sample(Engine(load_hf(folder), tok), rows, Grader("verifier", tok), samples_per_prompt=samples,
               max_new_tokens=max_new_tokens, seed=seed)
    per = {"wrong": [], "right": [], "accuracy": [], "cv": []}
    for i in range(len(rows)):
        n = [len(c.tokens) for c in r.completions[i * samples:(i + 1) * samples]]
        ok = (r.rewards[i * samples:(i + 1) * samples] >= 1).tolist()
        wrong, right = [x for x, k in zip(n, ok) if not k], [x for x, k in zip(n, ok) if k]
        per["wrong"].append(lmkit.mean(wrong) if wrong else None)
        per["right"].append(lmkit.mean(right) if right else None)
        per["accuracy"].append(lmkit.mean(ok))
        m = lmkit.mean(n)
        per["cv"].append((sum((x - m) ** 2 for x in n) / len(n)) ** 0.5 / m if m else 0.0)
    return per


def paired_present(a, b):
    """b - a over the problems where both have a value (the wrong answers' length needs a wrong answer)."""
    both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return lmkit.paired([x for x, _ in both], [y for _, y in both]) if len(both) > 1 else None


def main():
    p = parser("length_bias", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("length_bias", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(steps=STEPS, prompts=PROMPTS, group=8, eval_problems=EVAL_PROBLEMS,
                                         eval_samples=EVAL_SAMPLES, max_new_tokens=MAX_NEW_TOKENS)
    nproc, seeds = 1 if args.smoke else 2, lmkit.seeds(args)
    rows = lmkit.heldout(size["eval_problems"])
    measure = dict(samples=size["eval_samples"], max_new_tokens=size["max_new_tokens"], seed=5000)
    start = lengths(sft, rows, **measure)
    runs = {name: [] for name in CONFIGS}
    for seed in seeds:
        for name, flags in CONFIGS.items():
            run = lab.run("chat_rl.py", "--init", sft, "--seed", seed, *flags, "--steps", size["steps"],
                          "--prompts-per-step", size["prompts"], "--group-size", size["group"], "--max-new-tokens",
                          size["max_new_tokens"], "--eval-problems", 0, "--save-every", 100000, stage="rl",
                          run_name=f"lab-length_bias-{name}-s{seed}", nproc=nproc)
            steps = [r for r in lab.metrics(run) if "accuracy" in r]
            runs[name].append({"seed": seed, "step": [r["step"] for r in steps],
                               # a step with no right (or no wrong) answer has no such length: None, a gap in the plot
                               **{k: [r.get(k) for r in steps] for k in ("length_correct", "length_wrong",
                                                                         "length_mean", "accuracy")},
                               "end": lengths(run, rows, **measure), "seconds": lab.commands[-1]["seconds"]})
            e = runs[name][-1]["end"]
            print(f"[length_bias] {name} seed {seed}: wrong answers {lmkit.mean(e['wrong']):.1f} tokens, right "
                  f"{lmkit.mean(e['right']):.1f}, accuracy {lmkit.mean(e['accuracy']):.3f}", flush=True)

    def problems(name, key):  # per problem, over the seeds that have a value there
        return [lmkit.mean(col) if any(v is not None for v in col) else None
                for col in zip(*[r["end"][key] for r in runs[name]])]
    tail = max(1, size["steps"] // 5)
    summary = {"start": {k: lmkit.mean(start[k]) for k in start}}
    for name in CONFIGS:
        summary[name] = {**{k: lmkit.spread([lmkit.mean(r["end"][k]) for r in runs[name]]) for k in start},
                         "steps_wrong_last": lmkit.spread([lmkit.mean(r["length_wrong"][-tail:]) for r in runs[name]]),
                         "steps_right_last": lmkit.spread([lmkit.mean(r["length_correct"][-tail:])
                                                           for r in runs[name]]),
                         "wrong_minus_start": paired_present(start["wrong"], problems(name, "wrong")),
                         "minus_dr_grpo": {k: paired_present(problems("dr-grpo", k), problems(name, k))
                                           for k in ("wrong", "right", "accuracy")}}
    summary["steps_wrong_first"] = lmkit.spread([lmkit.mean(r["length_wrong"][:tail]) for rs in runs.values()
                                                 for r in rs])

    fig, axes = figure(1, 3, layout="constrained")
    panels = [("length_wrong", "wrong answers: mean length", "tokens"), ("length_correct", "right answers: mean length",
                                                                          "tokens"),
              ("accuracy", "accuracy of the step's answers", "share right")]
    for ax, (key, title, ylabel) in zip(axes, panels):
        for i, name in enumerate(CONFIGS):
            lmkit.draw_band(ax, runs[name][0]["step"], [r[key] for r in runs[name]], color=f"C{i}", label=name)
        ax.set(title=title, xlabel="RL step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("GRPO's aggregations from SFT, no calculator: the answers of each step", fontsize=10)
    lab.save({"question": "Do the wrong answers lengthen under GRPO's per-answer mean and not under token-mean or Dr. "
                          "GRPO?", "init": "sft/default", "tools": False, "seeds": seeds, **size, "ranks": nproc,
              "summary": summary, "start": start, "runs": runs}, fig)


if __name__ == "__main__":
    main()
