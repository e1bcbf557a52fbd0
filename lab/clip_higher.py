"""
Entropy collapse and clip-higher (DAPO: Yu et al. 2025, arXiv:2503.14476), and what RL does to pass@k (Yue et al.
2025, "Does Reinforcement Learning Really Incentivize Reasoning Capacity in LLMs Beyond the Base Model?",
arXiv:2504.13837).

PPO's clip keeps each token's ratio p / p_old inside [1 - eps_low, 1 + eps_high]. With a symmetric 0.2 a token the
policy found unlikely cannot grow much in one update: at p_old 0.01 its probability may reach 0.012, while a token
at 0.9 may reach 1.0. So the likely tokens gain, the rare ones do not, and the policy's entropy falls, which DAPO
calls entropy collapse; raising eps_high to 0.28 lets the rare tokens grow further (0.0128) and, in DAPO's runs, kept
the entropy up and the accuracy rising. Yue et al. then ask what RL buys: it raises pass@1, but at large k the model
it started from solves as many problems (pass@k of the base catches up), as if RL sharpened what the base already
samples rather than teaching it anything new.

Part 1: two runs of chat_rl.py from runs/cpu.sh's SFT checkpoint (sft/default), the same seed, prompts and steps,
`--eps-high 0.2` against 0.28 (the default), on 2 ranks with the calculator offered as the pipeline's RL runs, but
16 prompts x 8 answers a step (the pipeline: 64). Logged: the entropy of the sampling distribution on the step's
answer tokens, and every EVAL_EVERY steps greedy pass@1 and pass@1..16 at T=1 on EVAL_PROBLEMS held-out problems.
The same two runs again with --minibatches 8 (VARIANTS): with the defaults (one pass of 2 optimizer steps per batch)
the clip hardly ever binds, and eps_high has nothing to act on.
Part 2: pass@1..64 at T=1 on LARGE_K_PROBLEMS held-out problems, the same problems and sampling seeds for all, of the
SFT checkpoint and of each default run's last checkpoint (chat_eval.py --model M --samples 64 --temperature 1).

    python lab/clip_higher.py                  # ~20 min on 2 cores; docs/lab/clip_higher.{json,png}
    python lab/clip_higher.py --home /tmp/np   # another pipeline's checkpoints (runs/cpu.sh under NANOPOST_HOME)
"""
import json
import os

from labkit import RL_SMOKE, Lab, checkpoint, figure, parser

CONFIGS = {"eps-0.2": ["--eps-high", "0.2"], "eps-0.28": ["--eps-high", "0.28"]}  # run name -> chat_rl.py flags
STEPS, PROMPTS, EVAL_EVERY, EVAL_PROBLEMS, K = 30, 16, 10, 100, 16
LARGE_K, LARGE_K_PROBLEMS = 64, 100
# the defaults (1 pass of 2 optimizer steps per batch), then the one change tried when the clip hardly ever bound
# (clip_frac < 0.5%): 8 smaller optimizer steps per batch, the same tokens, so that the later ones move the policy
# further from the snapshot that sampled
VARIANTS = {"default": [], "minibatches-8": ["--minibatches", "8"]}


def pass_at_large_k(lab, model, out, *, samples, problems, smoke):
    """chat_eval.py's sampled pass@1..samples of `model` on `problems` held-out problems, run as a user would (on 2
    ranks unless smoke), its JSON written to `out`; returns {k: pass@k}."""
    flags = ["--model", model, "--samples", samples, "--temperature", "1.0", "--problems", problems, "--out", out]
    flags += ["--max-new-tokens", "24"] if smoke else ["--max-new-tokens", "192", "--tools"]
    if os.path.exists(out):
        os.remove(out)  # chat_eval --out adds to what the file holds: start empty
    lab.command("chat_eval.py", *flags, nproc=1 if smoke else 2)
    with open(out) as f:
        scores = json.load(f)
    return {k: scores[f"pass@{k}_t1"] for k in range(1, samples + 1)}


def main():
    args = parser("clip_higher", __doc__.strip().split("\n\n")[0]).parse_args()
    lab = Lab("clip_higher", args)
    sft = checkpoint(args.home, "sft")
    k, large_k = (2, 4) if args.smoke else (K, LARGE_K)
    common = ["--init", sft, "--seed", "0", "--pass-k", k, "--save-every", "100000"]
    if args.smoke:
        common += RL_SMOKE + ["--eval-every", "1"]
    else:
        common += ["--tools", "--steps", STEPS, "--prompts-per-step", PROMPTS, "--eval-problems", EVAL_PROBLEMS,
                   "--eval-every", EVAL_EVERY]

    # part 1: entropy and pass@1..k against steps, eps_high 0.2 against 0.28; then the same with the clip given
    # more to do (VARIANTS)
    runs, paths = {variant: {} for variant in VARIANTS}, {}
    for variant, variant_flags in VARIANTS.items():
        for name, flags in CONFIGS.items():
            path = lab.run("chat_rl.py", *common, *variant_flags, *flags, stage="rl", nproc=1 if args.smoke else 2,
                           run_name=f"lab-clip_higher-{name}" + (f"-{variant}" if variant_flags else ""))
            if not variant_flags:
                paths[name] = path
            rows = lab.metrics(path)
            steps = [r for r in rows if "entropy" in r]
            evals = [r for r in rows if "eval/pass@1" in r]
            r = runs[variant][name] = {
                "flags": variant_flags + flags,
                "step": [r["step"] for r in steps],
                "entropy": [r["entropy"] for r in steps],
                "clip_frac": [r["clip_frac"] for r in steps],
                "accuracy": [r["accuracy"] for r in steps],
                "eval_step": [r["step"] for r in evals],
                "greedy_pass@1": [r["eval/pass@1"] for r in evals],
                # pass@k at T=1, k = 1..K, at each evaluation: {k: [value at each eval_step]}
                "pass@k": {j: [r[f"eval/pass@{j}_t1"] for r in evals] for j in range(1, k + 1)},
                "seconds": lab.commands[-1]["seconds"],
            }
            print(f"[clip_higher] {variant} {name}: entropy {r['entropy'][0]:.3f} -> {r['entropy'][-1]:.3f}; clip_frac "
                  f"mean {sum(r['clip_frac']) / len(r['clip_frac']):.4f}; pass@1 (T=1) {r['pass@k'][1][0]:.3f} -> "
                  f"{r['pass@k'][1][-1]:.3f}; pass@{k} {r['pass@k'][k][0]:.3f} -> {r['pass@k'][k][-1]:.3f}", flush=True)

    # part 2: pass@1..64 of the SFT start against each default run's end, on the same problems with the same seeds
    problems = 8 if args.smoke else LARGE_K_PROBLEMS
    scores_dir = os.path.join(args.home, "rl", "lab-clip_higher-passk")
    os.makedirs(scores_dir, exist_ok=True)
    large = {name: pass_at_large_k(lab, model, os.path.join(scores_dir, f"{name}.json"), samples=large_k,
                                   problems=problems, smoke=args.smoke)
             for name, model in {"sft": sft, **paths}.items()}
    for name, scores in large.items():
        print(f"[clip_higher] {name}: " + "  ".join(f"pass@{j} {scores[j]:.3f}" for j in sorted({1, 4, 16, large_k})
                                                    if j <= large_k), flush=True)

    # a row per variant: entropy, pass@1 and pass@k against steps, pass@1..k at the start and the end; on the right
    # the clip fraction of every run, and part 2
    fig, axes = figure(len(VARIANTS), 4, layout="constrained")
    for row, (variant, variant_runs) in enumerate(runs.items()):
        ax = axes[4 * row:4 * row + 3]
        for i, (name, r) in enumerate(variant_runs.items()):
            ax[0].plot(r["step"], r["entropy"], color=f"C{i}", label=f"--eps-high {name[4:]}")
            ax[1].plot(r["eval_step"], r["pass@k"][1], color=f"C{i}", marker="o", label=f"pass@1, {name}")
            ax[1].plot(r["eval_step"], r["pass@k"][k], color=f"C{i}", marker="s", linestyle="--",
                       label=f"pass@{k}, {name}")
            for at, style in ((0, ":"), (-1, "-")):
                ax[2].plot(range(1, k + 1), [r["pass@k"][j][at] for j in range(1, k + 1)], color=f"C{i}",
                           linestyle=style, label=f"{name} at step {r['eval_step'][at]}")
            axes[7].plot(r["step"], r["clip_frac"], color=f"C{i}", linestyle="-" if row == 0 else "--",
                         label=f"{variant}, {name}")
        ax[2].set_xscale("log", base=2)
        titles = [f"{variant}: entropy (nats/token)", f"{variant}: held-out pass@1, pass@{k} at T=1",
                  f"{variant}: pass@k at T=1, start (dotted), end"]
        for a, title, xlabel in zip(ax, titles, ["step", "step", "k"]):
            a.set_title(title, fontsize=10)
            a.set_xlabel(xlabel, fontsize=9)
    for i, (name, scores) in enumerate(large.items()):
        axes[3].plot(list(scores), list(scores.values()), color="k" if name == "sft" else f"C{i - 1}",
                     label="SFT (the start)" if name == "sft" else f"RL {name}")
    axes[3].set_xscale("log", base=2)
    axes[3].set_title(f"pass@k at T=1, {problems} held-out problems", fontsize=10)
    axes[3].set_xlabel("k", fontsize=9)
    axes[7].set_title("clip_frac of the updates", fontsize=10)
    axes[7].set_xlabel("step", fontsize=9)
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    lab.save({"home": args.home, "init": sft, "smoke": args.smoke, "tools": not args.smoke,
              "steps": 2 if args.smoke else STEPS, "prompts_per_step": 4 if args.smoke else PROMPTS,
              "group_size": 4 if args.smoke else 8, "ranks": 1 if args.smoke else 2,
              "eval_problems": 4 if args.smoke else EVAL_PROBLEMS, "runs": runs,
              "large_k": {"problems": problems, "samples": large_k, "pass@k": large}}, fig)


if __name__ == "__main__":
    main()
