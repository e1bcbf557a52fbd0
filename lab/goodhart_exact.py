"""
Over-optimization of a proxy reward (Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization",
arXiv:2210.10760), at the exact level: a proxy that agrees with the gold on the common answers and errs on the rare
ones, optimized exactly, with and without a KL penalty.

Gao et al. optimize a policy against a proxy reward model and score it with a gold one: against sqrt(KL to the
start) the proxy keeps rising while the gold rises, peaks and falls (for RL, gold = d (alpha - beta log d) with
d = sqrt(KL)). A KL penalty, they find, does not raise the gold-against-KL curve: it stops the walk earlier, like
early stopping.

On exact.py's world (the project's GPT over {a, b, end}, 15 answers): the gold is exact.REWARDS (1 for "a end" and
"a b end", 0.5 for "a a end" and "b b end", 0 elsewhere). The proxy is the gold on every answer the start
(exact.tiny_policy) gives at least RARE = 0.005, the answers a reward model would have seen, and PROXY_ON_RARE = 1.25
on the two it gives less ("a b b" 0.0012, "b a b" 0.0016; both wrong): an error where its data were thin. Each run
follows the exact gradient of E_pi[proxy] - beta KL(pi || start) (exact.expected_reward, exact.kl: sums over the
15 answers, the expectation of REINFORCE with k1 in the reward; lab/kl_placement.py) for STEPS optimizer steps, at
each beta of BETAS; beta 0 is no penalty. The closed form beside them: the maximizer of E[proxy] - beta KL at
every beta, pi*_beta ∝ start exp(proxy / beta) (exact.regularized_optimum), the end of a run at beta.

    python lab/goodhart_exact.py           # ~30 s on 2 cores; writes docs/lab/goodhart_exact.{json,png}
    python lab/goodhart_exact.py --smoke   # 20 steps: what tests/test_lab_goodhart_exact.py runs

It needs no checkpoint (--home is unused). Page: docs/lab/goodhart.md, its exact level.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import exact  # noqa: E402
from labkit import Lab, figure, parser  # noqa: E402

RARE, PROXY_ON_RARE = 0.005, 1.25
BETAS = (0.0, 0.1, 0.2, 0.4)
STEPS, LR = 800, 5e-4
GOLD = exact.REWARDS
START_PROBS = exact.answer_probs(exact.tiny_policy()).detach().double()
PROXY = torch.where(START_PROBS < RARE, torch.full_like(GOLD, PROXY_ON_RARE), GOLD)


def objective(logp, start_logp, beta):
    """E_pi[proxy] - beta KL(pi || start) from the answers' log-probs (15,), exactly (exact.expected_reward and
    exact.kl, the start's log-probs computed once): its gradient is the expected update of REINFORCE on the proxy
    with k1 in the reward (the reward-to-go of -beta log pi / pi_start)."""
    p = logp.exp()
    return (p * PROXY).sum() - beta * (p * (logp - start_logp)).sum()


def scores(p, start_p):
    """sqrt(KL(pi || start)) (sqrt nats), the gold and the proxy of a distribution over the answers."""
    kl = float((torch.xlogy(p, p) - torch.xlogy(p, start_p)).sum())
    return {"sqrt_kl": math.sqrt(max(kl, 0.0)), "gold": float((p * GOLD).sum()), "proxy": float((p * PROXY).sum())}


def run(beta, steps):
    policy = exact.tiny_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    curves = {"step": [], "sqrt_kl": [], "gold": [], "proxy": []}
    for step in range(steps + 1):
        logp = exact.answer_logprobs(policy)
        if step % 4 == 0 or step == steps:
            curves["step"].append(step)
            for key, value in scores(logp.detach().exp(), START_PROBS).items():
                curves[key].append(value)
        if step < steps:
            optimizer.zero_grad()
            (-objective(logp, START_PROBS.log(), beta)).backward()
            optimizer.step()
    return curves


def gold_on_path(path, sqrt_kl):
    """The gold of the unpenalized run where it first reached this sqrt(KL) (linear between logged steps)."""
    for i in range(1, len(path["sqrt_kl"])):
        a, b = path["sqrt_kl"][i - 1], path["sqrt_kl"][i]
        if a <= sqrt_kl <= b:
            w = (sqrt_kl - a) / (b - a) if b > a else 0.0
            return path["gold"][i - 1] + w * (path["gold"][i] - path["gold"][i - 1])
    return None


def main():
    args = parser("goodhart_exact", "over-optimization of a proxy reward at the exact level").parse_args()
    torch.set_num_threads(args.threads or 1)  # a 4,768-weight model: one thread is fastest, and the same everywhere
    lab = Lab("goodhart_exact", args, level="exact")
    steps = 20 if args.smoke else STEPS
    runs = {f"beta={b:g}": {"beta": b, **run(b, steps)} for b in BETAS}
    free = runs["beta=0"]
    peak = max(range(len(free["gold"])), key=lambda i: free["gold"][i])
    summary = {"beta=0": {"gold_start": free["gold"][0], "gold_peak": free["gold"][peak],
                          "gold_peak_sqrt_kl": free["sqrt_kl"][peak], "gold_peak_step": free["step"][peak],
                          "gold_end": free["gold"][-1], "proxy_start": free["proxy"][0],
                          "proxy_at_gold_peak": free["proxy"][peak], "proxy_end": free["proxy"][-1],
                          "sqrt_kl_end": free["sqrt_kl"][-1]}}
    for name, r in list(runs.items())[1:]:
        summary[name] = {"gold_end": r["gold"][-1], "proxy_end": r["proxy"][-1], "sqrt_kl_end": r["sqrt_kl"][-1],
                         "gold_max": max(r["gold"]),
                         "unpenalized_gold_at_this_sqrt_kl": gold_on_path(free, r["sqrt_kl"][-1])}
    summary["largest_gold_gap_to_unpenalized"] = max((abs(s["gold_end"] - s["unpenalized_gold_at_this_sqrt_kl"])
                                                      for s in list(summary.values())[1:]
                                                      if s["unpenalized_gold_at_this_sqrt_kl"] is not None), default=None)
    # the closed form: where a run at each beta ends, pi*_beta ∝ start exp(proxy / beta), over a grid of beta
    grid = [0.02 * 1.1 ** k for k in range(60)]
    optimum = [{"beta": b, **scores(exact.regularized_optimum(START_PROBS.log(), PROXY, b), START_PROBS)} for b in grid]
    for name, r in list(runs.items())[1:]:  # where the closed form says each run ends
        end = scores(exact.regularized_optimum(START_PROBS.log(), PROXY, r["beta"]), START_PROBS)
        summary[name]["closed_form_gold"], summary[name]["closed_form_sqrt_kl"] = end["gold"], end["sqrt_kl"]
    s = summary["beta=0"]
    print(f"[goodhart_exact] beta 0: gold {s['gold_start']:.3f} -> peak {s['gold_peak']:.3f} at sqrt(KL) "
          f"{s['gold_peak_sqrt_kl']:.2f} -> {s['gold_end']:.3f}; proxy {s['proxy_start']:.3f} -> {s['proxy_end']:.3f}")
    for name, s in list(summary.items())[1:len(BETAS)]:
        print(f"[goodhart_exact] {name}: ends at sqrt(KL) {s['sqrt_kl_end']:.2f}, gold {s['gold_end']:.3f} (closed "
              f"form {s['closed_form_gold']:.3f}); the unpenalized run's gold there: "
              f"{s['unpenalized_gold_at_this_sqrt_kl']:.3f}")

    fig, axes = figure(1, 3, width=4.6, height=3.8, layout="constrained")
    for i, (name, r) in enumerate(runs.items()):
        style = dict(color="k" if r["beta"] == 0 else f"C{i - 1}",
                     label=f"β = {r['beta']:g}" + (" (no penalty)" if r["beta"] == 0 else ""))
        axes[0].plot(r["sqrt_kl"], r["gold"], **style)
        axes[1].plot(r["sqrt_kl"], r["proxy"], **style)
        axes[2].plot(r["step"], r["sqrt_kl"], **style)
        if r["beta"]:
            for ax, key in ((axes[0], "gold"), (axes[1], "proxy")):
                ax.plot(r["sqrt_kl"][-1], r[key][-1], "o", color=style["color"], ms=6)
    for ax, key in ((axes[0], "gold"), (axes[1], "proxy")):
        ax.plot([o["sqrt_kl"] for o in optimum], [o[key] for o in optimum], ":", color="0.4", linewidth=1.5,
                label="π*_β ∝ start·exp(proxy/β), every β")
    axes[0].set(xlabel="sqrt(KL(π || start)) (sqrt nats)", ylabel="gold reward (expected)", title="the gold")
    axes[1].set(xlabel="sqrt(KL(π || start)) (sqrt nats)", ylabel="proxy reward (expected)", title="the proxy")
    axes[2].set(xlabel="optimizer step", ylabel="sqrt(KL(π || start)) (sqrt nats)", title="the leash")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(labels), fontsize=8,
               title="exact gradient of E[proxy] − β KL; dots: where each penalized run ends", title_fontsize=8)
    lab.save({"rare_below": RARE, "proxy_on_rare": PROXY_ON_RARE,
              "gold": dict(zip(exact.NAMES, GOLD.tolist())), "proxy": dict(zip(exact.NAMES, PROXY.tolist())),
              "start_probs": dict(zip(exact.NAMES, START_PROBS.tolist())), "betas": list(BETAS), "steps": steps,
              "lr": LR, "summary": summary, "runs": runs, "optimum": optimum}, fig)


if __name__ == "__main__":
    main()
