"""
KL in the reward against KL in the loss: which reaches the KL-regularized optimum? An experiment of the lab, at the
exact level only.

RLHF's PPO (InstructGPT, arXiv:2203.02155) puts the KL to the reference in the REWARD: each token is paid
-beta k1 = -beta (log p - log p_ref), and the policy gradient carries that reward back to the tokens before it,
like any other. GRPO (DeepSeekMath, arXiv:2402.03300) puts it in the LOSS: a per-token estimator of the KL (k3
there, k2 in chat_rl.py's --kl-kind default) added to the loss and differentiated as it stands. Both mean to
maximize E[R] - beta KL(pi || pi_ref), whose maximizer is known in closed form, pi*(y) ∝ pi_ref(y) exp(R(y) / beta)
(exact.regularized_optimum). Tang & Munos 2025 (arXiv:2506.09477) show that differentiating a KL estimate as a loss
gives the wrong gradient in general, and that per-token losses miss how a token moves the KL of the tokens after it.

On exact.py's world (the project's GPT over {a, b, end}, 15 answers, the reward table exact.REWARDS) each variant's
expected update is exact (`surrogate`: a sum over the answers, each weighted by its probability, the tokens held
fixed as sampled tokens are). Each starts at the reference (exact.tiny_policy) and runs STEPS optimizer steps:
    none               E[R] alone (REINFORCE)
    k1 in the reward   each token's weight R - beta * (k1 of that token and every token after it): the reward-to-go
                       of PPO's per-token reward, with gamma = lambda = 1 and no critic
    k1 in the loss     beta * k1 summed over the answer's tokens, added to the loss: its expected gradient is 0
    k2 in the loss     the same with k2 = (log p - log p_ref)^2 / 2 (chat_rl's --kl-kind k2)
    k3 in the loss     the same with k3 = p_ref / p - 1 - log(p_ref / p) (GRPO's)
    k2 of the answer   beta * k2 of the whole answer's log-ratio: its gradient is that of the KL of whole answers
Where each ends is measured against pi*: total variation and KL(pi || pi*). The per-token losses converge to where
their own expected update vanishes, which is known in closed form too, prefix by prefix (`fixed_point`): k2 makes
each next-token distribution ∝ pi_ref exp(Q / beta) with Q the expected REWARD after the token, leaving out the KL
the token leads to below it (pi* counts it); k3 makes it beta pi_ref / (lambda - Q) (its gradient is the reverse
KL's). The tiny GPT represents every distribution over the 15 answers (7 next-token distributions of 3 tokens, from
4,768 weights), and the runs reach their fixed points to ~1e-4: what separates the variants is their update, not
the policy's capacity.

    python lab/kl_placement.py           # ~40 s on 2 cores; writes docs/lab/kl_placement.{json,png}
    python lab/kl_placement.py --smoke   # 20 steps: what tests/test_lab_kl_placement.py runs

It needs no checkpoint and trains nothing else (--home is unused). Page: docs/lab/kl_placement.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import exact  # noqa: E402
from labkit import Lab, figure, parser  # noqa: E402
from rollout import kl_penalty  # noqa: E402

VARIANTS = {"none": "none", "k1_reward": "k1 in the reward", "k1_loss": "k1 in the loss", "k2_loss": "k2 in the loss",
            "k3_loss": "k3 in the loss", "k2_answer": "k2 of the answer, in the loss"}
BETA = 0.25  # pi* keeps 0.75 of its mass on the right answers (R = 1), the reference 0.11
STEPS, LR, EVERY_LOG, CHECK_EVERY = 600, 1e-2, 5, 50  # AdamW as chat_rl's (betas 0.9, 0.95), the rate falling to 0


def surrogate(logp, ref_logp, *, rewards, beta, kind):
    """A number whose gradient (through logp, every answer token's log-prob (15, MAX_LEN), 0 off the mask) is the
    expected update of `kind`, to ascend: the answers weighted by their probability p(y), held fixed (a sample's
    tokens are given; only their log-probs carry the gradient). In log-prob coordinates, token t of answer y gets
      none:             p(y) R(y)
      k1 in the reward: p(y) (R(y) - beta sum_{s >= t} k1_s)
      kX in the loss:   p(y) (R(y) - beta dkX_t / dlogp_t): k1 -> 1, k2 -> log p_t / p_ref_t, k3 -> 1 - p_ref_t / p_t
      k2 of the answer: p(y) (R(y) - beta log p(y) / p_ref(y))
    Example (tests/test_lab_kl_placement.py): "a end" at p(y) = 1/4, both tokens 1.5 times as likely as under the
    reference, R = 1, beta 0.5: k1 in the reward gives its tokens 0.1486 and 0.1993, k1 in the loss 0.125 each."""
    mask = exact.EVERY.mask
    logp = logp * mask
    p = logp.detach().sum(-1).exp()
    if kind == "k1_reward":  # the reward-to-go: a token's KL reward counts for it and the tokens before it
        k1 = kl_penalty(logp.detach(), ref_logp, "k1") * mask
        to_go = k1.flip(-1).cumsum(-1).flip(-1)
        return (p[:, None] * (rewards[:, None] - beta * to_go) * logp).sum()
    reinforce = (p * rewards * logp.sum(-1)).sum()  # its gradient is dJ exactly
    if kind == "none":
        return reinforce
    if kind == "k2_answer":
        kl = kl_penalty(logp.sum(-1), ref_logp.sum(-1), "k2")
    else:  # "k1_loss", "k2_loss", "k3_loss": chat_rl's per-token estimator, summed over the answer
        kl = (kl_penalty(logp, ref_logp, kind[:2]) * mask).sum(-1)
    return reinforce - beta * (p * kl).sum()


def fixed_point(ref_next_logp, rewards, beta, rule):
    """(15,) the answer distribution where an update's expectation vanishes, built prefix by prefix from the
    deepest: Q(prefix, token) is R of the answer the token ends, or else the value V of the prefix it leads to.
      "optimum" (pi*): next ∝ ref exp(Q / beta), V = beta log sum ref exp(Q / beta) (soft: V counts the KL below)
      "k2_loss":       next ∝ ref exp(Q / beta), V = sum next Q (the expected reward only)
      "k3_loss":       next = beta ref / (lam - Q), lam > max Q where they sum to 1, V = sum next Q
    ref_next_logp: (7, 3) the reference's next-token log-probs (exact.next_token_logprobs)."""
    next_logp = torch.zeros(len(exact.PREFIXES), len(exact.TOKENS), dtype=torch.float64)
    value = {}
    for i in sorted(range(len(exact.PREFIXES)), key=lambda i: -len(exact.PREFIXES[i])):
        prefix = exact.PREFIXES[i]
        ends = [x == exact.END or len(prefix) + 1 == exact.MAX_LEN for x in range(len(exact.TOKENS))]
        Q = torch.tensor([float(rewards[exact.ANSWERS.index(prefix + (x,))]) if ends[x] else value[prefix + (x,)]
                          for x in range(len(exact.TOKENS))], dtype=torch.float64)
        ref = ref_next_logp[i].double().exp()
        if rule in ("optimum", "k2_loss"):
            nxt = ref * (Q / beta).exp()
            value[prefix] = float(beta * nxt.sum().log()) if rule == "optimum" else float((nxt / nxt.sum() * Q).sum())
            nxt = nxt / nxt.sum()
        elif rule == "k3_loss":
            lo, hi = float(Q.max()), float(Q.max()) + beta  # sum beta ref / (lam - Q) falls from infinity to <= 1
            for _ in range(200):
                lam = (lo + hi) / 2
                lo, hi = (lam, hi) if float((beta * ref / (lam - Q)).sum()) > 1 else (lo, lam)
            nxt = beta * ref / (hi - Q)
            nxt = nxt / nxt.sum()
            value[prefix] = float((nxt * Q).sum())
        else:
            raise ValueError(f"unknown rule {rule!r}")
        next_logp[i] = nxt.log()
    return exact.answer_logprobs_from(next_logp).exp()


def kl_between(p, q):
    """KL(p || q) of two distributions over the answers, in nats (at least 0: rounding can make an equal pair's
    -1e-8)."""
    p, q = p.double(), q.double()
    return max(0.0, float((torch.xlogy(p, p) - torch.xlogy(p, q)).sum()))


def kl_terms(policy, ref_logp):
    """At `policy`: the norm of the KL term's expected gradient (the update less E[R]'s) over |dJ|, for k1 in the
    reward and k1 in the loss, and the cosine of the first to dJ. In the loss, k1 gives every token of y the
    coefficient -beta p(y), whose sum is -beta d(sum_y p(y)) = 0: only float32 rounding remains."""
    logp = exact.token_logprobs(policy)
    dJ = exact.flat_grad(exact.expected_reward(policy), policy)
    out = {}
    for kind in ("k1_reward", "k1_loss"):
        term = surrogate(logp, ref_logp, rewards=exact.REWARDS, beta=BETA, kind=kind) - \
            surrogate(logp, ref_logp, rewards=exact.REWARDS, beta=BETA, kind="none")
        g = exact.flat_grad(term, policy, retain_graph=True)
        out[kind] = float(g.norm() / dJ.norm())
        if kind == "k1_reward":
            out["k1_reward_cosine_to_dJ"] = float(g @ dJ / (g.norm() * dJ.norm()))
    return out


def run(kind, ref_logp, optimum, steps):
    """One variant from the reference: its curves every EVERY_LOG steps and where it ended; along k1 in the
    reward's path, every CHECK_EVERY steps, the two k1 terms' expected gradients at its policy (kl_terms)."""
    policy = exact.tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / steps)
    p_ref = ref_logp.sum(-1).exp()
    curves = {k: [] for k in ("step", "tv_to_optimum", "kl_to_reference", "J")}
    checks = {"step": [], "k1_reward": [], "k1_loss": [], "k1_reward_cosine_to_dJ": []}
    for step in range(steps + 1):
        logp = exact.token_logprobs(policy)
        p = logp.detach().sum(-1).exp()
        if step % EVERY_LOG == 0 or step == steps:
            curves["step"].append(step)
            curves["tv_to_optimum"].append(exact.total_variation(p, optimum))
            curves["kl_to_reference"].append(kl_between(p, p_ref))
            curves["J"].append(float((p * exact.REWARDS).sum()))
        if kind == "k1_reward" and step and (step % CHECK_EVERY == 0 or step == steps):
            checks["step"].append(step)  # (at step 0 the policy is the reference: every KL term is 0)
            for key, value in kl_terms(policy, ref_logp).items():
                checks[key].append(value)
        if step == steps:
            break
        optimizer.zero_grad()
        (-surrogate(logp, ref_logp, rewards=exact.REWARDS, beta=BETA, kind=kind)).backward()
        optimizer.step()
        schedule.step()
    return {"label": VARIANTS[kind], **curves, **({"kl_terms": checks} if checks["step"] else {}),
            "probs": p.tolist(),
            "end": {"tv_to_optimum": exact.total_variation(p, optimum), "kl_to_optimum": kl_between(p, optimum),
                    "kl_to_reference": kl_between(p, p_ref), "J": float((p * exact.REWARDS).sum())}}


def draw(data):
    fig, axes = figure(2, 2, width=5.4, height=3.8, layout="constrained")
    styles = {k: dict(color=f"C{i}", linestyle=("-", "-", "--", "-", "-", ":")[i]) for i, k in enumerate(VARIANTS)}
    for kind, r in data["variants"].items():
        axes[0].plot(r["step"], r["tv_to_optimum"], label=r["label"], **styles[kind])
        axes[1].plot(r["step"], r["kl_to_reference"], label=r["label"], **styles[kind])

    axes[0].set(yscale="log", xlabel="optimizer step", ylabel="total variation to π* (probability)",
                title="distance to the optimum π* ∝ π_ref exp(R / β)")
    axes[1].axhline(data["optimum"]["kl_to_reference"], color="k", linewidth=0.8, linestyle="--", label="π*")
    axes[1].set(xlabel="optimizer step", ylabel="KL(π || π_ref) (nats per answer)", title="distance from the reference")
    names, x = exact.NAMES, range(len(exact.NAMES))
    axes[2].plot(x, data["reference"]["probs"], "s", color="0.6", label="π_ref", ms=6)
    axes[2].plot(x, data["optimum"]["probs"], "o", mfc="none", color="k", ms=9, label="π*")
    for kind, marker in (("k1_reward", "x"), ("k2_loss", "+"), ("k3_loss", "1"), ("k1_loss", ".")):
        axes[2].plot(x, data["variants"][kind]["probs"], marker, color=styles[kind]["color"], ms=8,
                     label=f"{VARIANTS[kind]}, end")
    axes[2].set_xticks(list(x), names, rotation=70, fontsize=7)
    axes[2].set(yscale="log", ylim=(1e-5, 2), ylabel="probability of the answer", xlabel="answer",
                title="where each ends (R: 1 for a end, a b end; 0.5 for a a end, b b end)")
    checks = data["variants"]["k1_reward"]["kl_terms"]
    for kind in ("k1_reward", "k1_loss"):
        axes[3].plot(checks["step"], checks[kind], marker="o", label=f"{VARIANTS[kind]}'s KL term", **styles[kind])
    axes[3].set(yscale="log", xlabel="optimizer step (along k1 in the reward's path)",
                ylabel="|KL term's expected gradient| / |dJ|", title="k1 in the reward is not k1 in the loss")
    lines, labels = axes[1].get_legend_handles_labels()  # the variants (and pi*), for the top two panels
    fig.legend(lines, labels, loc="outside upper center", ncol=len(labels), fontsize=8)
    handles, labels = axes[2].get_legend_handles_labels()  # the bottom left's markers (below 1e-5: off the axis)
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8)
    axes[3].legend(fontsize=7, loc="center right")
    return fig


def main():
    args = parser("kl_placement", "KL in the reward against KL in the loss, against the optimum").parse_args()
    torch.set_num_threads(args.threads or 1)  # a 4,768-weight model: one thread is fastest, and the same everywhere
    lab = Lab("kl_placement", args, level="exact")
    steps = 20 if args.smoke else STEPS
    reference = exact.tiny_policy()
    ref_logp = exact.token_logprobs(reference).detach()
    ref_next = exact.next_token_logprobs(ref_logp)
    optimum = exact.regularized_optimum(ref_logp.sum(-1), exact.REWARDS, BETA)
    closed = {rule: fixed_point(ref_next, exact.REWARDS, BETA, rule) for rule in ("optimum", "k2_loss", "k3_loss")}
    variants = {kind: run(kind, ref_logp, optimum, steps) for kind in VARIANTS}
    for kind in ("k2_loss", "k3_loss"):  # the per-token losses reach their own fixed points, not pi*
        variants[kind]["end"]["tv_to_fixed_point"] = exact.total_variation(torch.tensor(variants[kind]["probs"]),
                                                                           closed[kind])
    none, k1_loss = variants["none"], variants["k1_loss"]
    p_ref = ref_logp.sum(-1).exp()
    data = {
        "beta": BETA, "steps": steps, "lr": LR, "rewards": dict(zip(exact.NAMES, exact.REWARDS.tolist())),
        "reference": {"probs": p_ref.tolist(), "J": float((p_ref * exact.REWARDS).sum()),
                      "tv_to_optimum": exact.total_variation(p_ref, optimum)},
        "optimum": {"probs": optimum.tolist(), "J": float((optimum * exact.REWARDS).sum()),
                    "kl_to_reference": kl_between(optimum, p_ref),
                    "tv_prefix_by_prefix": exact.total_variation(closed["optimum"], optimum)},
        "fixed_points": {kind: {"tv_to_optimum": exact.total_variation(closed[kind], optimum),
                                "kl_to_optimum": kl_between(closed[kind], optimum),
                                "J": float((closed[kind] * exact.REWARDS).sum()),
                                "kl_to_reference": kl_between(closed[kind], p_ref)} for kind in ("k2_loss", "k3_loss")},
        "variants": variants,
        # k1 in the loss moves nothing: its run is the run without KL, step for step
        "k1_loss_against_none": {
            "tv_between_ends": exact.total_variation(torch.tensor(none["probs"]), torch.tensor(k1_loss["probs"])),
            "max_tv_to_optimum_gap": max(abs(a - b) for a, b in zip(none["tv_to_optimum"], k1_loss["tv_to_optimum"])),
            "k1_loss_max_kl_term": max(variants["k1_reward"]["kl_terms"]["k1_loss"]),
            "k1_reward_end_kl_term": variants["k1_reward"]["kl_terms"]["k1_reward"][-1],
            "k1_reward_end_cosine_to_dJ": variants["k1_reward"]["kl_terms"]["k1_reward_cosine_to_dJ"][-1]},
    }
    for kind, r in variants.items():
        end = r["end"]
        print(f"[kl_placement] {r['label']:30s} TV to pi* {end['tv_to_optimum']:.4f}  KL to pi* "
              f"{end['kl_to_optimum']:.4f}  J {end['J']:.4f}" +
              (f"  TV to its fixed point {end['tv_to_fixed_point']:.5f}" if "tv_to_fixed_point" in end else ""))
    lab.save(data, draw(data))


if __name__ == "__main__":
    main()
