"""
Stale samplers (chat_rl.py --staleness, --off-policy, --correction): what does it cost to train on answers sampled
by the weights of k steps back, and does the sampler correction win it back? The second half of
docs/lab/sampler_trainer.md: there the sampler differs from the trainer by its temperature, here by its age.

Five configurations of chat_rl.py from runs/cpu.sh's SFT run, SEEDS seeds each, the same prompts and steps, one
process each, the calculator offered as the pipeline's RL runs, 16 prompts x 8 answers a step (the pipeline: 64):
    k0-tis          synchronous (on-policy), --correction token-tis (the default)
    k1-tis          --staleness 1: every batch sampled by the weights one step back
    offpolicy-tis   --off-policy: the next batch sampled in a thread, from a snapshot, while this one trains; one
                    step behind too, the same weights, prompts and seeds as k1-tis: the same answers
    k4-none, k4-tis --staleness 4, without and with the correction
Per run: the mean reward over the second half of the steps; the ratio statistics averaged over the steps whose batch
was stale: logprob_mismatch (mean |log p_trainer - log p_sampler| per token), correction_mean, clip_frac; and at the
end greedy pass@1 on EVAL_PROBLEMS held-out problems (the same for every run), problem by problem, paired with the
synchronous run of the same seed.

    python lab/staleness.py                    # ~30 min on 2 cores; docs/lab/staleness.{json,png}
    python lab/staleness.py --home /tmp/np     # another pipeline's checkpoints (runs/cpu.sh under NANOPOST_HOME)
"""
import collections

import lmkit  # (puts the repository on the path)
from labkit import Lab, checkpoint, figure, parser

CONFIGS = {  # run name -> chat_rl.py flags
    "k0-tis": ["--staleness", "0", "--correction", "token-tis"],
    "k1-tis": ["--staleness", "1", "--correction", "token-tis"],
    "offpolicy-tis": ["--off-policy", "--correction", "token-tis"],
    "k4-none": ["--staleness", "4", "--correction", "none"],
    "k4-tis": ["--staleness", "4", "--correction", "token-tis"],
}
STEPS, PROMPTS, EVAL_PROBLEMS, MAX_NEW_TOKENS = 16, 16, 100, 192
SMOKE = dict(steps=3, prompts=4, group=4, eval_problems=4, max_new_tokens=24)  # the test home's tiny model


def stale_mean(steps, key):
    """The mean of `key` over the steps whose batch was stale (over all of them in a synchronous run)."""
    stale = [r for r in steps if r["staleness"] > 0] or steps
    return lmkit.mean([r[key] for r in stale])


def main():
    p = parser("staleness", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("staleness", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(steps=STEPS, prompts=PROMPTS, group=8, eval_problems=EVAL_PROBLEMS,
                                         max_new_tokens=MAX_NEW_TOKENS)
    tools = [] if args.smoke else ["--tools"]  # the smoke home's tiny vocabulary cannot hold the tools block
    seeds = lmkit.seeds(args)
    rows = lmkit.heldout(size["eval_problems"])
    runs = {name: [] for name in CONFIGS}
    for seed in seeds:
        for name, flags in CONFIGS.items():
            run = lab.run("chat_rl.py", "--init", sft, "--seed", seed, *flags, *tools, "--steps", size["steps"],
                          "--prompts-per-step", size["prompts"], "--group-size", size["group"], "--max-new-tokens",
                          size["max_new_tokens"], "--eval-problems", 0, "--save-every", 100000, stage="rl",
                          run_name=f"lab-staleness-{name}-s{seed}")
            steps = [r for r in lab.metrics(run) if "reward" in r]
            ev = lmkit.per_problem(run, rows, max_new_tokens=size["max_new_tokens"], tools=bool(tools))
            runs[name].append({"seed": seed, **{k: [r[k] for r in steps] for k in ("step", "reward", "logprob_mismatch",
                                                                                  "staleness", "correction_mean")},
                               "reward_2nd_half": lmkit.mean([r["reward"] for r in steps[len(steps) // 2:]]),
                               "stale_mean": {k: stale_mean(steps, k) for k in ("logprob_mismatch", "correction_mean",
                                                                                "clip_frac")},
                               "staleness_steps": dict(sorted(collections.Counter(r["staleness"]
                                                                                  for r in steps).items())),
                               "pass@1": ev["pass@1"], "per_problem": ev["score"],
                               "seconds": lab.commands[-1]["seconds"]})
            r = runs[name][-1]
            print(f"[staleness] {name} seed {seed}: reward (2nd half) {r['reward_2nd_half']:.3f}, mismatch "
                  f"{r['stale_mean']['logprob_mismatch']:.4f}, held-out pass@1 {r['pass@1']:.3f}", flush=True)
    start = lmkit.per_problem(sft, rows, max_new_tokens=size["max_new_tokens"], tools=bool(tools))

    reference = lmkit.seed_mean([r["per_problem"] for r in runs["k0-tis"]])
    summary = {name: {**{k: lmkit.spread([r[k] for r in rs]) for k in ("reward_2nd_half", "pass@1")},
                      **{k: lmkit.spread([r["stale_mean"][k] for r in rs]) for k in ("logprob_mismatch",
                                                                                     "correction_mean", "clip_frac")},
                      "minus_k0": lmkit.paired(reference, lmkit.seed_mean([r["per_problem"] for r in rs]))}
               for name, rs in runs.items()}
    summary["start_pass@1"] = start["pass@1"]
    # --off-policy and --staleness 1 sample the same answers with the same weights: their gaps, step by step
    summary["offpolicy_vs_k1_mismatch"] = [{"step": s, "k1": a, "offpolicy": b} for s, a, b in
                                           zip(runs["k1-tis"][0]["step"], runs["k1-tis"][0]["logprob_mismatch"],
                                               runs["offpolicy-tis"][0]["logprob_mismatch"])][:3]
    summary["k4_tis_minus_none"] = lmkit.paired(lmkit.seed_mean([r["per_problem"] for r in runs["k4-none"]]),
                                                lmkit.seed_mean([r["per_problem"] for r in runs["k4-tis"]]))

    fig, axes = figure(1, 3, layout="constrained")
    for i, (name, rs) in enumerate(runs.items()):
        style = dict(color=f"C{i}", linestyle="--" if name.endswith("none") else "-", label=name)
        lmkit.draw_band(axes[0], rs[0]["step"], [r["reward"] for r in rs], **style)
        lmkit.draw_band(axes[1], rs[0]["step"], [[max(m, 1e-9) for m in r["logprob_mismatch"]] for r in rs], **style)
        axes[2].bar(i, summary[name]["pass@1"]["mean"], color=f"C{i}", alpha=0.5)
        axes[2].plot([i] * len(rs), [r["pass@1"] for r in rs], "k.", markersize=5)
    axes[2].axhline(start["pass@1"], color="k", lw=0.5, linestyle=":")
    axes[2].set_xticks(range(len(runs)), list(runs), rotation=30, fontsize=7)
    axes[1].set_yscale("log")
    axes[0].set(title="reward of each step's answers", xlabel="RL step", ylabel="mean reward")
    axes[1].set(title="logprob_mismatch (1e-9 floor)", xlabel="RL step", ylabel="nats per token (mean)")
    axes[2].set(title="held-out greedy pass@1 at the end (dots: seeds; dotted: SFT)", ylabel="pass@1")
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    lab.save({"question": "Trained on answers sampled by weights k steps old, does RL learn less, and does token-tis "
                          "win "
                          "it back?", "init": "sft/default", "tools": bool(tools), "seeds": seeds, **size, "ranks": 1,
              "summary": summary, "runs": runs}, fig)


if __name__ == "__main__":
    main()
