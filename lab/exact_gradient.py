"""
Experiment 7 of the lab: the exact gradient. Which policy-gradient estimators of the GRPO family are biased,
and by how much; and which KL estimator a loss may use?

On the enumerable world (exact.py: the project's GPT over {a, b, end}, 15 possible answers of 1 to 3 tokens,
a fixed reward table) every expectation is a finite sum, so the gradient of expected reward, dJ, is exact. One
prompt; each batch is one group of G answers, sampled from the snapshot; each estimator is the gradient that
chat_rl.py hands the optimizer, minus d loss / d parameters, with chat_rl.group_advantages and
chat_rl.policy_loss called as the stage calls them, on the settings that chat_rl.py's own parser and
update_settings make of each variant's flags (VARIANTS). For each variant and group size:
  - its exact expectation over groups (exact_dynamics.expected_update: a sum over the ways the other G - 1
    answers of a group can fall, never a sample), compared with dJ: the cosine, and the norm ratio |E g| / |dJ|;
  - the average of BATCHES sampled estimates (the same groups for every variant), which must agree with the
    variant's own exact expectation to within sampling error (`agreement`: |mean - E g|^2 over its expected
    size, trace(Cov) / BATCHES, ~1);
  - its variance, relative: E|g - E g|^2 / |E g|^2.
Twice: with a fresh snapshot (the policy itself sampled: every ratio is 1, the variants differ only in
advantages and normalization), and with a stale one (the answers sampled by a perturbed copy, so that the
ratio's clip binds). Then the same enumeration against the exact KL(policy || reference) of whole answers,
for references ever further away: chat_rl's per-token KL estimators k1, k2, k3 summed over each answer's
tokens, their value's bias and spread, and the expectation of their gradient as a loss against dKL.

    python lab/exact_gradient.py           # about a minute on 2 cores; writes docs/lab/exact_gradient.{json,png}
    python lab/exact_gradient.py --smoke   # two group sizes, few batches: what the test runs

It needs no checkpoint and trains nothing (--home is unused). Page: docs/lab/exact_gradient.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import chat_rl  # noqa: E402
import exact  # noqa: E402
from exact_dynamics import expected_update, stage_settings  # noqa: E402
from labkit import Lab, figure, parser  # noqa: E402

VARIANTS = {  # name: chat_rl.py's flags (besides --group-size G and --max-new-tokens 3)
    "GRPO": ["--agg", "seq-mean-token-mean", "--eps-high", "0.2"],
    "GRPO, no std": ["--agg", "seq-mean-token-mean", "--eps-high", "0.2", "--scale", "none"],
    "RLOO": ["--estimator", "rloo", "--scale", "none", "--agg", "seq-mean-token-sum-norm"],
    "RLOO, no clip": ["--estimator", "rloo", "--scale", "none", "--agg", "seq-mean-token-sum-norm",
                      "--eps-low", "1e6", "--eps-high", "1e6"],  # the token ratios alone: what the clip adds
    "Dr. GRPO": ["--scale", "none", "--agg", "seq-mean-token-sum-norm"],
    "GSPO": ["--level", "sequence", "--agg", "seq-mean-token-mean"],
    "CISPO": ["--loss", "cispo"],
}
GROUP_SIZES, BATCHES = (2, 4, 8, 16), 4000
STALE_SCALE = 0.03  # the stale snapshot: every weight of the policy plus N(0, 0.03^2)
KL_SCALES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)  # references: the policy plus N(0, scale^2)
KL_KINDS = ("k1", "k2", "k3", "k2 of the answer")  # the last: k2 of the summed log-ratio, not what the stage does


def estimate(batch, logp, old_logp, settings):
    """One batch's estimate, as coefficients on each answer token's log-prob gradient (15, MAX_LEN):
    minus d loss / d logp of chat_rl's loss, added up per answer; times the Jacobian it is the gradient."""
    adv = chat_rl.group_advantages(batch.rewards, settings["group_size"], scale=settings["scale"],
                                   estimator=settings["estimator"])
    leaf = logp.clone().requires_grad_()
    loss, stats = chat_rl.policy_loss(leaf, old_logp, adv, batch.mask, **settings["loss_settings"])
    (d_logp,) = torch.autograd.grad(loss, leaf)
    return torch.zeros(len(exact.ANSWERS), exact.MAX_LEN, dtype=torch.float64).index_add_(
        0, batch.answers, -d_logp), stats["clip_frac"]


def cosine(u, v):
    return float(u @ v / (u.norm() * v.norm()).clamp(min=1e-30))


def estimator_table(policy, old, jac, dJ, group_sizes, batches, seed=0):
    """{variant: {per-G lists}} for answers sampled by `old`, trained at `policy`."""
    policy_logp, old_logp = exact.token_logprobs(policy).detach(), exact.token_logprobs(old).detach()
    table = {name: {k: [] for k in ("exact_cosine", "exact_norm_ratio", "sampled_cosine", "sampled_norm_ratio",
                                    "relative_variance", "agreement", "clip_frac")} for name in VARIANTS}
    for G in group_sizes:
        g = torch.Generator().manual_seed(seed + G)
        groups = [exact.sample(old_logp, G, g) for _ in range(batches)]  # the same groups for every variant
        for name, flags in VARIANTS.items():
            settings = stage_settings([*flags, "--group-size", str(G)])
            mean = expected_update(policy_logp, old_logp, rewards=exact.REWARDS, **settings)[0].view(-1) @ jac
            coefs, clips = zip(*(estimate(batch, policy_logp[batch.answers], old, settings)
                                 for batch, old in groups))
            samples = torch.stack(coefs).view(batches, -1) @ jac  # (batches, P)
            avg = samples.mean(0)
            spread = ((samples - avg) ** 2).sum(-1).mean()  # trace of the covariance
            row = table[name]
            row["exact_cosine"].append(cosine(mean, dJ))
            row["exact_norm_ratio"].append(float(mean.norm() / dJ.norm()))
            row["sampled_cosine"].append(cosine(avg, dJ))
            row["sampled_norm_ratio"].append(float(avg.norm() / dJ.norm()))
            row["relative_variance"].append(float(((samples - mean) ** 2).sum(-1).mean() / mean.norm() ** 2))
            row["agreement"].append(float(((avg - mean) ** 2).sum() / (spread / batches)))
            row["clip_frac"].append(sum(clips) / batches)
    return {name: {k: [round(x, 4) for x in v] for k, v in row.items()} for name, row in table.items()}


def kl_table(policy, jac, scales):
    """Per reference distance: the exact KL of whole answers, and for each estimator (summed over each
    answer's tokens) its value's bias and standard deviation per answer, and its gradient as a loss
    (samples held fixed): the expectation's cosine (None where it is 0) and norm ratio to dKL, its relative
    error |E - dKL| / |dKL|, and its relative variance E|g - E g|^2 / |dKL|^2."""
    p = exact.answer_probs(policy).detach()
    policy_logp = exact.token_logprobs(policy).detach()
    out = {"scales": list(scales), "kl": [], **{kind: {k: [] for k in (
        "value_bias", "value_std", "grad_cosine", "grad_norm_ratio", "grad_relative_error", "grad_relative_variance")}
        for kind in KL_KINDS}}
    for s in scales:
        ref = exact.perturbed(policy, s, seed=2)
        ref_logp = exact.token_logprobs(ref).detach()
        true_kl = exact.kl(policy, ref)
        dKL = exact.flat_grad(true_kl, policy)
        out["kl"].append(round(true_kl.item(), 5))
        for kind in KL_KINDS:
            leaf = policy_logp.clone().requires_grad_()
            if kind == "k2 of the answer":
                value = chat_rl.kl_penalty(leaf.sum(-1), ref_logp.sum(-1), "k2")
            else:
                value = (chat_rl.kl_penalty(leaf, ref_logp, kind) * exact.EVERY.mask).sum(-1)  # (15,)
            (d_logp,) = torch.autograd.grad(value.sum(), leaf)  # row y: d value(y) / d logp(y)
            grads = torch.einsum("yt,ytp->yp", d_logp * exact.EVERY.mask, jac.view(len(p), exact.MAX_LEN, -1))
            mean_value, mean_grad = (p * value.detach()).sum(), p @ grads
            row = out[kind]
            row["value_bias"].append(round(float(mean_value) - true_kl.item(), 5))
            row["value_std"].append(round(float((p * (value.detach() - mean_value) ** 2).sum().sqrt()), 5))
            zero = mean_grad.norm() < 1e-6 * dKL.norm()  # k1's: exactly 0, its direction float noise
            row["grad_cosine"].append(None if zero else round(cosine(mean_grad, dKL), 4))
            row["grad_norm_ratio"].append(round(float(mean_grad.norm() / dKL.norm()), 4))
            row["grad_relative_error"].append(round(float((mean_grad - dKL).norm() / dKL.norm()), 4))
            row["grad_relative_variance"].append(round(float(
                (p * ((grads - mean_grad) ** 2).sum(-1)).sum() / dKL.norm() ** 2), 4))
    return out


def draw(data):
    fig, axes = figure(3, 3, width=5.0, height=3.4)
    styles = {name: dict(color=f"C{i}", marker="osD^vPX"[i], linestyle=("-", "--", "-", ":", "-.", "--", "-")[i])
              for i, name in enumerate(VARIANTS)}  # lines that coincide (RLOO and Dr. GRPO's cosine) stay visible
    Gs = data["group_sizes"]
    for r, snapshot in enumerate(("fresh", "stale")):
        for c, (key, label) in enumerate((("cosine", "cosine of E[g] to dJ"), ("norm_ratio", "|E[g]| / |dJ|"),
                                          ("relative_variance", "E|g - E[g]|^2 / |E[g]|^2"))):
            ax = axes[3 * r + c]
            for name, row in data[snapshot].items():
                if key == "relative_variance":
                    ax.plot(Gs, row[key], label=name, **styles[name])
                else:
                    ax.plot(Gs, row[f"exact_{key}"], label=name, **styles[name])
                    ax.plot(Gs, row[f"sampled_{key}"], "x", color=styles[name]["color"], ms=7)
            ax.set_xscale("log", base=2)
            ax.set_xticks(Gs, [str(G) for G in Gs])
            ax.set_xlabel("group size G")
            ax.set_title(f"{snapshot} snapshot: {label}", fontsize=9)
            if key == "relative_variance":
                ax.set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(VARIANTS), fontsize=8, bbox_to_anchor=(0.5, 1.04),
               title=f"line: exact expectation; x: mean of {data['batches']} sampled batches", title_fontsize=8)
    kl = data["kl"]
    for c, (key, label) in enumerate((("value_bias", "KL value: E[estimate] - KL"), ("value_std", "KL value: std per answer"),
                                      ("grad_relative_error", "KL gradient as a loss: |E - dKL| / |dKL|"))):
        ax = axes[6 + c]
        for kind in KL_KINDS:
            ax.plot(kl["kl"], kl[kind][key], "s--" if kind == KL_KINDS[-1] else "o-", label=kind)
        ax.set_xscale("log")
        ax.set_xlabel("exact KL(policy || reference), nats per answer")
        ax.set_title(label, fontsize=9)
    axes[6].legend(fontsize=7)
    fig.tight_layout()
    return fig


def main():
    args = parser("exact_gradient", "which policy-gradient and KL estimators are biased, against exact sums").parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lab = Lab("exact_gradient", args)
    group_sizes, batches = ((2, 4), 40) if args.smoke else (GROUP_SIZES, BATCHES)
    policy = exact.tiny_policy()
    jac = exact.logprob_jacobian(policy).view(len(exact.ANSWERS) * exact.MAX_LEN, -1)
    dJ = exact.flat_grad(exact.expected_reward(policy), policy)
    stale = exact.perturbed(policy, STALE_SCALE)
    p = exact.answer_probs(policy).detach()
    data = {
        "world": {"answers": len(exact.ANSWERS), "parameters": jac.size(1), "J": round(float((p * exact.REWARDS).sum()), 4),
                  "mean_length": round(float((p * exact.LENGTHS).sum()), 4), "grad_norm": round(float(dJ.norm()), 5),
                  "stale_scale": STALE_SCALE, "kl_stale_to_policy": round(exact.kl(stale, policy).item(), 4),
                  "cosine_dJ_at_stale_to_dJ": round(cosine(exact.flat_grad(exact.expected_reward(stale), stale), dJ), 4)},
        "variants": {name: " ".join(flags) for name, flags in VARIANTS.items()},
        "group_sizes": list(group_sizes), "batches": batches,
        "fresh": estimator_table(policy, policy, jac, dJ, group_sizes, batches),
        "stale": estimator_table(policy, stale, jac, dJ, group_sizes, batches),
        "kl": kl_table(policy, jac, KL_SCALES[1::2] if args.smoke else KL_SCALES),
    }
    lab.save(data, draw(data))


if __name__ == "__main__":
    main()
