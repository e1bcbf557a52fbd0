"""
Clip-higher (DAPO: Yu et al. 2025, arXiv:2503.14476) at the exact level: a rare right answer under several
optimizer steps per batch, with --eps-high 0.2 against 0.28, followed exactly.

PPO's clip stops a token's gradient once its ratio p / p_old leaves [1 - eps_low, 1 + eps_high] on the side its
advantage pushes. A rare token (p_old 0.01) may then gain at most 0.002 per batch at eps_high 0.2, and 0.0028 at
0.28; a likely one is hardly held. DAPO's claim: with the symmetric clip the policy's entropy collapses, and
clip-higher (0.28) keeps it up by letting the rare tokens grow.

On exact.py's world (the project's GPT over {a, b, end}, 15 answers), in two reward tables:
    rare        only "a b end" is right (R = 1), at p = 0.0082 under the start (exact.tiny_policy)
    rare+common the same, and the start's most likely answer "end" (p = 0.424) half right (R = 0.5): a common
                answer that pulls the policy to itself while the rare right one waits
Each batch: the snapshot of the policy samples (in expectation: every group of G = 8 answers it can draw), and
K = 8 optimizer steps (AdamW, chat_rl's betas) follow chat_rl's update on that batch in expectation
(exact_dynamics.expected_update, chat_rl's loss at its defaults: token-mean, the group's std, eps_low 0.2). The
steps after the first see ratios away from 1, so the clip binds. Logged per batch: the rare answer's probability,
the entropy of the policy's answers (nats per answer), and the clip fraction (chat_rl.policy_loss's clip_frac, the
tokens where the clip binds, averaged over the K steps, as chat_rl logs it). The control: K = 1 step per batch,
where every ratio is 1 and eps_high cannot act (the JSON's `control`); and the pair at learning rates
LR_SWEEP, smaller and larger steps (the JSON's `sweep`: when the rare answer passes 0.5, the largest clip fraction).

    python lab/clip_higher_exact.py           # ~30 s on 2 cores; writes docs/lab/clip_higher_exact.{json,png}
    python lab/clip_higher_exact.py --smoke   # 3 batches: what tests/test_lab_clip_higher_exact.py runs

It needs no checkpoint (--home is unused). Page: docs/lab/clip_higher.md, its exact level.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import exact  # noqa: E402
from exact_dynamics import expected_update, stage_settings  # noqa: E402
from labkit import Lab, figure, parser  # noqa: E402

RARE, COMMON = "a b end", "end"
WORLDS = {"rare": {RARE: 1.0}, "rare+common": {RARE: 1.0, COMMON: 0.5}}  # the rewards (0 elsewhere)
BATCHES = {"rare": 30, "rare+common": 50}
EPS_HIGH = (0.2, 0.28)
GROUP_SIZE, STEPS_PER_BATCH, LR = 8, 8, 3e-4
LR_SWEEP = (1e-4, 1e-3)  # beside LR: smaller and larger steps, the clip binding less and more (the JSON's `sweep`)


def rewards_of(table):
    return torch.tensor([table.get(name, 0.0) for name in exact.NAMES], dtype=torch.float64)


def run(rewards, eps_high, batches, steps_per_batch, lr=LR):
    """Per batch: the rare answer's probability, the entropy and the clip fraction of the exact update."""
    settings = stage_settings(["--eps-high", str(eps_high), "--group-size", str(GROUP_SIZE)])
    policy = exact.tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    curves = {"p_rare": [], "p_common": [], "entropy": [], "clip_frac": []}
    for batch in range(batches + 1):
        old_logp = exact.token_logprobs(policy).detach()  # the snapshot that sampled this batch
        p = old_logp.sum(-1).exp()
        curves["p_rare"].append(float(p[exact.NAMES.index(RARE)]))
        curves["p_common"].append(float(p[exact.NAMES.index(COMMON)]))
        curves["entropy"].append(exact.entropy(p))
        if batch == batches:
            break
        clip = 0.0
        for _ in range(steps_per_batch):
            logp = exact.token_logprobs(policy).detach()
            coef, clip_frac = expected_update(logp, old_logp, rewards=rewards, **settings)
            exact.ascend(optimizer, policy, coef)
            clip += clip_frac / steps_per_batch
        curves["clip_frac"].append(clip)
    first_half = next((b for b, x in enumerate(curves["p_rare"]) if x > 0.5), None)
    lowest = curves["entropy"].index(min(curves["entropy"]))
    return {**curves, "batch_rare_passes_half": first_half, "max_clip_frac": max(curves["clip_frac"]),
            "min_entropy": min(curves["entropy"]), "max_entropy": max(curves["entropy"]),
            "min_entropy_batch": lowest, "max_entropy_after_min": max(curves["entropy"][lowest:]),
            "min_p_rare": min(curves["p_rare"]), "max_p_common": max(curves["p_common"])}


def main():
    args = parser("clip_higher_exact", "clip-higher at the exact level: a rare right answer").parse_args()
    torch.set_num_threads(args.threads or 1)  # a 4,768-weight model: one thread is fastest, and the same everywhere
    lab = Lab("clip_higher_exact", args, level="exact")
    batches = {world: 3 for world in WORLDS} if args.smoke else BATCHES
    runs, control, sweep = {}, {}, {}
    for world, table in WORLDS.items():
        for eps in EPS_HIGH:
            r = run(rewards_of(table), eps, batches[world], STEPS_PER_BATCH)
            runs.setdefault(world, {})[f"eps_high={eps}"] = r
            print(f"[clip_higher_exact] {world}, eps_high {eps}: p({RARE}) {r['p_rare'][0]:.4f} -> "
                  f"{r['p_rare'][-1]:.4f} (past 0.5 at batch {r['batch_rare_passes_half']}), entropy min "
                  f"{r['min_entropy']:.3f}, clip_frac max {r['max_clip_frac']:.3f}", flush=True)
        # the control: one step per batch, every ratio 1, nothing for eps_high to act on
        low, high = (run(rewards_of(table), eps, batches[world], 1) for eps in EPS_HIGH)
        control[world] = {"max_clip_frac": max(low["max_clip_frac"], high["max_clip_frac"]),
                          "max_p_rare_difference": max(abs(a - b) for a, b in zip(low["p_rare"], high["p_rare"]))}
        for lr in LR_SWEEP:  # the same pair at other learning rates: when the rare answer passes 0.5, and the clip
            for eps in EPS_HIGH:
                r = run(rewards_of(table), eps, batches[world], STEPS_PER_BATCH, lr=lr)
                sweep.setdefault(world, {}).setdefault(f"lr={lr:g}", {})[f"eps_high={eps}"] = {
                    k: r[k] for k in ("batch_rare_passes_half", "max_clip_frac", "min_entropy", "min_p_rare")}
    # what the page quotes: where the rare answer is furthest ahead at 0.28, against 0.2, and by how much
    compare = {}
    for world, r in runs.items():
        low, high = r["eps_high=0.2"]["p_rare"], r["eps_high=0.28"]["p_rare"]
        at = max(range(len(low)), key=lambda b: high[b] / low[b])
        compare[world] = {"batch": at, "p_rare_0.2": low[at], "p_rare_0.28": high[at], "ratio": high[at] / low[at]}

    fig, axes = figure(2, 3, width=4.4, height=3.3, layout="constrained")
    for row, (world, world_runs) in enumerate(runs.items()):
        ax = axes[3 * row:3 * row + 3]
        for i, (name, r) in enumerate(world_runs.items()):
            ax[0].plot(r["p_rare"], color=f"C{i}", marker=".", label=f"p({RARE}), --eps-high {name.split('=')[1]}")
            ax[1].plot(r["entropy"], color=f"C{i}", marker=".")
            ax[2].plot(range(1, len(r["clip_frac"]) + 1), r["clip_frac"], color=f"C{i}", marker=".")
        if world == "rare+common":
            ax[0].plot(world_runs["eps_high=0.2"]["p_common"], color="0.5", linestyle=":",
                       label=f"p({COMMON}), eps 0.2")
        ax[0].set(yscale="log", xlabel="batch", ylabel="probability of the answer",
                  title=f"{world}: the rare right answer")
        ax[1].set(xlabel="batch", ylabel="entropy of the answers (nats)", title=f"{world}: entropy")
        ax[2].set(xlabel="batch", ylabel="clip fraction (share of tokens)", title=f"{world}: where the clip binds")
        ax[0].legend(fontsize=7, **(dict(loc="lower right") if world == "rare" else  # clear of the curves
                                    dict(loc="upper left", bbox_to_anchor=(0.0, 0.82))))
    lab.save({"rare": RARE, "common": COMMON, "worlds": WORLDS, "group_size": GROUP_SIZE,
              "steps_per_batch": STEPS_PER_BATCH, "lr": LR, "batches": batches, "runs": runs, "control": control,
              "compare": compare, "sweep": sweep}, fig)


if __name__ == "__main__":
    main()
