"""
Entropy collapse and clip-higher (DAPO: Yu et al. 2025, arXiv:2503.14476), and what RL does to pass@k (Yue et al.
2025, "Does Reinforcement Learning Really Incentivize Reasoning Capacity in LLMs Beyond the Base Model?",
arXiv:2504.13837).

PPO's clip keeps each token's ratio p / p_old inside [1 - eps_low, 1 + eps_high]. With a symmetric 0.2 a token the
policy found unlikely cannot grow much in one update: at p_old 0.01 its probability may reach 0.012, while a token
at 0.9 may reach 1.0. So the likely tokens gain, the rare ones do not, and the policy's entropy falls, which DAPO
calls entropy collapse; raising eps_high to 0.28 lets the rare tokens grow further (0.0128) and, in DAPO's runs, kept
the entropy up and the accuracy rising. Yue et al. then ask what RL buys: it raises pass@1, but at large k the model
it started from solves as many problems (its pass@k catches up), as if RL sharpened what it already samples.

The clip can only act where it binds: with chat_rl.py's defaults (one pass of 2 optimizer steps a batch) it bound on
~0.1% of the tokens, and --eps-high had nothing to act on (docs/lab/clip_higher.md). So each batch here is trained
on for UPDATES optimizer steps (--ppo-epochs x --minibatches), the later ones far enough from the snapshot that
sampled for the clip to bind; clip_frac ("the clip binds": verl's definition, what chat_rl logs) says how often.
Two configurations of chat_rl.py from runs/cpu.sh's SFT run, SEEDS seeds each, --eps-high 0.2 against 0.28, on 2
ranks with the calculator offered as the pipeline's RL runs, 16 prompts x 8 answers a step, STEPS steps. Logged each
step: the entropy of the sampling distribution on the answer tokens, clip_frac, accuracy. At the end, pass@1..K at
T=1 on EVAL_PROBLEMS held-out problems (the same problems and sampling seeds for all), problem by problem, of the SFT
start and of every run's end.

    python lab/clip_higher.py                  # ~35 min on 2 cores; docs/lab/clip_higher.{json,png}
    python lab/clip_higher.py --home /tmp/np   # another pipeline's checkpoints (runs/cpu.sh under NANOPOST_HOME)
"""
import lmkit  # (puts the repository on the path)
from evaluation import pass_at_k
from labkit import Lab, checkpoint, figure, parser

CONFIGS = {"eps-0.2": ["--eps-high", "0.2"], "eps-0.28": ["--eps-high", "0.28"]}  # run name -> chat_rl.py flags
UPDATES = ["--ppo-epochs", "2", "--minibatches", "8"]  # 16 optimizer steps a batch (the default: 1 x 2)
STEPS, PROMPTS, EVAL_PROBLEMS, K, MAX_NEW_TOKENS = 30, 16, 100, 16, 192
SMOKE = dict(steps=2, prompts=4, group=4, eval_problems=4, k=2, max_new_tokens=24)


def pass_curves(correct, samples):
    """Per k = 1..samples, per problem: the unbiased pass@k of its correct count (evaluation.pass_at_k)."""
    return [[pass_at_k(samples, c, k) for c in correct] for k in range(1, samples + 1)]


def main():
    p = parser("clip_higher", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("clip_higher", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(steps=STEPS, prompts=PROMPTS, group=8, eval_problems=EVAL_PROBLEMS, k=K,
                                         max_new_tokens=MAX_NEW_TOKENS)
    tools = [] if args.smoke else ["--tools"]  # the smoke home's tiny vocabulary cannot hold the tools block
    nproc, seeds = 1 if args.smoke else 2, lmkit.seeds(args)
    rows = lmkit.heldout(size["eval_problems"])
    sampled = dict(samples=size["k"], temperature=1.0, seed=7, max_new_tokens=size["max_new_tokens"], tools=bool(tools))
    start = pass_curves(lmkit.per_problem(sft, rows, **sampled)["correct"], size["k"])
    runs = {name: [] for name in CONFIGS}
    for seed in seeds:
        for name, flags in CONFIGS.items():
            run = lab.run("chat_rl.py", "--init", sft, "--seed", seed, *flags, *UPDATES, *tools, "--steps",
                          size["steps"], "--prompts-per-step", size["prompts"], "--group-size", size["group"],
                          "--max-new-tokens", size["max_new_tokens"], "--eval-problems", 0, "--save-every", 100000,
                          stage="rl", run_name=f"lab-clip_higher-{name}-s{seed}", nproc=nproc)
            steps = [r for r in lab.metrics(run) if "entropy" in r]
            ev = lmkit.per_problem(run, rows, **sampled)
            runs[name].append({"seed": seed, "step": [r["step"] for r in steps],
                               **{k: [r[k] for r in steps] for k in ("entropy", "clip_frac", "accuracy", "approx_kl")},
                               "pass@k": [lmkit.mean(c) for c in pass_curves(ev["correct"], size["k"])],
                               "correct": ev["correct"], "seconds": lab.commands[-1]["seconds"]})
            r = runs[name][-1]
            print(f"[clip_higher] {name} seed {seed}: entropy {r['entropy'][0]:.3f} -> {r['entropy'][-1]:.3f}; "
                  f"clip_frac mean {lmkit.mean(r['clip_frac']):.4f}; pass@1 {r['pass@k'][0]:.3f}, "
                  f"pass@{size['k']} {r['pass@k'][-1]:.3f}", flush=True)

    tail = max(1, size["steps"] // 5)
    ks = list(range(1, size["k"] + 1))
    summary = {"start": {"pass@1": lmkit.mean(start[0]), f"pass@{size['k']}": lmkit.mean(start[-1])}}
    for name in CONFIGS:
        curves = [pass_curves(r["correct"], size["k"]) for r in runs[name]]  # seed x k x problem
        per_k = [lmkit.seed_mean([c[k] for c in curves]) for k in range(size["k"])]  # k x problem, seed-averaged
        minus_start = [lmkit.paired(start[k], per_k[k]) for k in range(size["k"])]
        summary[name] = {"entropy_first": lmkit.spread([lmkit.mean(r["entropy"][:tail]) for r in runs[name]]),
                         "entropy_last": lmkit.spread([lmkit.mean(r["entropy"][-tail:]) for r in runs[name]]),
                         "clip_frac": lmkit.spread([lmkit.mean(r["clip_frac"]) for r in runs[name]]),
                         "clip_frac_first": lmkit.spread([lmkit.mean(r["clip_frac"][:tail]) for r in runs[name]]),
                         "accuracy_last": lmkit.spread([lmkit.mean(r["accuracy"][-tail:]) for r in runs[name]]),
                         "pass@1": lmkit.spread([r["pass@k"][0] for r in runs[name]]),
                         f"pass@{size['k']}": lmkit.spread([r["pass@k"][-1] for r in runs[name]]),
                         "minus_start": {"pass@1": minus_start[0], f"pass@{size['k']}": minus_start[-1]},
                         # the smallest k where the start is within one standard error of RL, or above it
                         "start_catches_up_at_k": next((k for k, d in zip(ks, minus_start) if d["diff"] <= d["se"]),
                                                       None)}
    # the same seed draws the same first batch in both: the entropy's difference seed by seed, over the seeds
    summary["entropy_last_0.28_minus_0.2"] = lmkit.mean_se(
        [lmkit.mean(b["entropy"][-tail:]) - lmkit.mean(a["entropy"][-tail:]) for a, b in zip(runs["eps-0.2"],
                                                                                              runs["eps-0.28"])])
    for key in ("pass@1", f"pass@{size['k']}"):
        k = 0 if key == "pass@1" else size["k"] - 1
        per = {n: lmkit.seed_mean([pass_curves(r["correct"], size["k"])[k] for r in runs[n]]) for n in CONFIGS}
        summary[f"{key}_0.28_minus_0.2"] = lmkit.paired(per["eps-0.2"], per["eps-0.28"])

    fig, axes = figure(2, 2, layout="constrained")
    for i, name in enumerate(CONFIGS):
        x = runs[name][0]["step"]
        for ax, key in zip(axes[:3], ("entropy", "clip_frac", "accuracy")):
            lmkit.draw_band(ax, x, [r[key] for r in runs[name]], color=f"C{i}", label=f"--eps-high {name[4:]}")
        lmkit.draw_band(axes[3], ks, [r["pass@k"] for r in runs[name]], color=f"C{i}",
                        label=f"RL, --eps-high {name[4:]}")
    axes[3].plot(ks, [lmkit.mean(c) for c in start], "k:", label="SFT (the start)")
    axes[3].set_xscale("log", base=2)
    titles = [("entropy of the sampling distribution", "nats per token"),
              ("clip_frac: the clip binds", "share of tokens"), ("accuracy of each step's answers", "share right")]
    for ax, (title, ylabel) in zip(axes[:3], titles):
        ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    axes[3].set(title=f"pass@k at T=1 at the end, {size['eval_problems']} held-out problems", xlabel="k",
                ylabel="pass@k")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GRPO from SFT with the calculator, {' '.join(UPDATES)}: eps-high 0.2 against 0.28", fontsize=10)
    lab.save({"question": "Where the clip binds, does eps-high 0.28 keep the entropy up against 0.2, and does the "
                          "start's "
                          "pass@k catch up with RL's at large k?", "init": "sft/default", "tools": bool(tools),
              "updates": UPDATES, "seeds": seeds, **size, "ranks": nproc, "summary": summary,
              "start": {"pass@k": [lmkit.mean(c) for c in start]}, "runs": runs}, fig)


if __name__ == "__main__":
    main()
