"""
The length bias of per-answer normalization (Dr. GRPO: Liu et al. 2025, arXiv:2503.20783), at the exact level:
the expected length of the wrong answers under each of chat_rl.py's aggregations, followed exactly.

Paper GRPO averages each answer's token losses, then the answers (--agg seq-mean-token-mean): a token of an answer
of |y| tokens carries A / |y|, so a wrong answer (A < 0) is pushed down the less the longer it is. The paper's
claim: under GRPO the wrong answers grow longer, and dividing by a constant instead (Dr. GRPO, --agg
seq-mean-token-sum-norm) stops it. chat_rl's default, token-mean (DAPO), divides by the tokens of the whole batch.

On exact.py's world (the project's GPT over {a, b, end}, 15 answers of 1 to 3 tokens): the right answers are the
two that exact.REWARDS pays 1.0, "a end" and "a b end" (reward 1); the other 13, of 1, 2 and 3 tokens, are wrong
(reward 0). Each step is one optimizer step (AdamW, chat_rl's betas) along chat_rl's update in expectation over
every group of G = 8 answers the policy can sample (exact_dynamics.expected_update: chat_rl's group_advantages and
policy_loss, a sum over the ways a group can fall, no sample). On-policy, so every ratio is 1 and the clip never
binds: the runs differ in the aggregation alone. Advantages are not divided by the group's std (--scale none), so
that seq-mean-token-sum-norm is Dr. GRPO exactly and its expected update is the policy gradient dJ itself
(lab/exact_gradient.py: cosine 1.0000): the curve the wrong answers would follow without any bias. The same
three again with the std (--scale group, chat_rl's default): their ends are in the JSON.

Logged every step: E[|y| | wrong] and E[|y| | right], in tokens (exact sums over the answers), and P(right).

    python lab/length_bias_exact.py           # ~30 s on 2 cores; writes docs/lab/length_bias_exact.{json,png}
    python lab/length_bias_exact.py --smoke   # 10 steps: what tests/test_lab_length_bias_exact.py runs

It needs no checkpoint (--home is unused). Page: docs/lab/length_bias.md, its exact level.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import exact  # noqa: E402
from exact_dynamics import expected_update, stage_settings  # noqa: E402
from labkit import Lab, figure, parser  # noqa: E402

AGGREGATIONS = {  # run name -> (chat_rl.py's --agg, the figure's label)
    "grpo": ("seq-mean-token-mean", "GRPO (seq-mean-token-mean)"),
    "token_mean": ("token-mean", "token-mean (DAPO, chat_rl's default)"),
    "dr_grpo": ("seq-mean-token-sum-norm", "Dr. GRPO (seq-mean-token-sum-norm)"),
}
SCALES = ("none", "group")  # the figure: none; the JSON: both
RIGHT = (exact.REWARDS == 1.0).double()  # "a end", "a b end"
GROUP_SIZE, STEPS, LR = 8, 400, 2e-4


def lengths(p):
    """E[|y| | wrong], E[|y| | right] (tokens) and P(right) of a distribution over the answers."""
    L, wrong = exact.LENGTHS.double(), 1 - RIGHT
    return {"length_wrong": float((p * wrong * L).sum() / (p * wrong).sum()),
            "length_right": float((p * RIGHT * L).sum() / (p * RIGHT).sum()), "accuracy": float((p * RIGHT).sum())}


def run(settings, steps):
    """The policy's lengths and accuracy at every step of the exact expected update."""
    policy = exact.tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    curves = {"length_wrong": [], "length_right": [], "accuracy": []}
    for step in range(steps + 1):
        logp = exact.token_logprobs(policy).detach()
        for key, value in lengths(logp.sum(-1).exp()).items():
            curves[key].append(value)
        if step < steps:
            coef, _ = expected_update(logp, logp, rewards=RIGHT, **settings)  # on-policy: the snapshot is the policy
            exact.ascend(optimizer, policy, coef)
    return curves


def main():
    args = parser("length_bias_exact", "GRPO's length bias at the exact level").parse_args()
    torch.set_num_threads(args.threads or 1)  # a 4,768-weight model: one thread is fastest, and the same everywhere
    lab = Lab("length_bias_exact", args, level="exact")
    steps = 10 if args.smoke else STEPS
    runs = {}
    for scale in SCALES:
        for name, (agg, label) in AGGREGATIONS.items():
            flags = ["--agg", agg, "--scale", scale, "--group-size", str(GROUP_SIZE)]
            curves = run(stage_settings(flags), steps)
            longest = max(range(steps + 1), key=lambda s: curves["length_wrong"][s])
            runs.setdefault(f"scale-{scale}", {})[name] = {
                "label": label, "flags": " ".join(flags),
                **(curves if scale == "none" else {}),  # the figure's curves: --scale none
                "end": {k: v[-1] for k, v in curves.items()},
                "longest_wrong": {"step": longest, "length_wrong": curves["length_wrong"][longest],
                                  "accuracy": curves["accuracy"][longest]}}
            print(f"[length_bias_exact] --scale {scale} {label}: wrong answers {curves['length_wrong'][0]:.3f} -> "
                  f"{curves['length_wrong'][-1]:.3f} tokens, right {curves['length_right'][0]:.3f} -> "
                  f"{curves['length_right'][-1]:.3f}, P(right) {curves['accuracy'][0]:.3f} -> "
                  f"{curves['accuracy'][-1]:.3f}")
    main_runs = runs["scale-none"]
    # what the page quotes: GRPO's and token-mean's wrong answers against Dr. GRPO's (the unbiased update's), where
    # they are furthest apart and at the end; and how little the std scaling moves the ends
    summary = {}
    for name in ("grpo", "token_mean"):
        gaps = [a - b for a, b in zip(main_runs[name]["length_wrong"], main_runs["dr_grpo"]["length_wrong"])]
        s = gaps.index(max(gaps))
        summary[name] = {"widest_gap": gaps[s], "widest_gap_step": s,
                         "length_wrong_there": main_runs[name]["length_wrong"][s],
                         "dr_grpo_length_wrong_there": main_runs["dr_grpo"]["length_wrong"][s],
                         "accuracy_there": main_runs[name]["accuracy"][s], "end_gap": gaps[-1]}
    summary["dr_grpo_lowest_wrong"] = min(main_runs["dr_grpo"]["length_wrong"])  # before it turns up
    summary["std_scaling_largest_end_change"] = max(abs(runs["scale-group"][n]["end"][k] - main_runs[n]["end"][k])
                                                    for n in AGGREGATIONS for k in ("length_wrong", "length_right"))

    fig, axes = figure(1, 3, width=4.6, height=3.6, layout="constrained")
    for i, (name, (_, label)) in enumerate(AGGREGATIONS.items()):
        for ax, key in zip(axes, ("length_wrong", "length_right", "accuracy")):
            ax.plot(range(steps + 1), main_runs[name][key], color=f"C{i}", label=label)
    axes[0].set(xlabel="optimizer step", ylabel="E[length | wrong] (tokens)", title="the wrong answers' length")
    axes[1].set(xlabel="optimizer step", ylabel="E[length | right] (tokens)", title="the right answers' length")
    axes[2].set(xlabel="optimizer step", ylabel="P(right answer)", title="accuracy")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=3, fontsize=8,
               title=f"expected update over groups of G = {GROUP_SIZE}, advantages R - mean (--scale none)",
               title_fontsize=8)
    lab.save({"right_answers": [n for n, r in zip(exact.NAMES, RIGHT) if r], "group_size": GROUP_SIZE, "steps": steps,
              "lr": LR, "start": lengths(exact.answer_probs(exact.tiny_policy()).detach()),
              "summary": summary, "runs": runs}, fig)


if __name__ == "__main__":
    main()
