"""
Over-optimization, Goodhart's law (Gao, Schulman and Hilton 2022, "Scaling Laws for Reward Model Overoptimization",
https://arxiv.org/abs/2210.10760): optimize against a learned reward model and the proxy (its score) keeps climbing,
while the gold (what it stands for) rises, then falls. The paper plots both against d = sqrt(KL(policy || start)),
for best-of-n sampling (KL_bon = log n - (n - 1) / n) and for RL, where a KL penalty (the leash) acts like stopping
early. Here the gold is the verifier, exact on the embedded world.

The proxy is a reward model trained on the policy's own answers, labelled by the verifier, so that near the start it
agrees with the gold where the policy samples (an RM trained on other answers may rank the policy's own backwards:
docs/lab/goodhart.md). Per seed, from runs/cpu.sh's SFT run, without the calculator (answers written out in words):
  1. chat_sample.py --samples 8 --pairs-out on PAIR_PROMPTS training problems: per problem a right answer against a
     wrong one, where the verifier told them apart;
  2. chat_rm.py --data on those pairs, from the SFT run (the pipeline's RM recipe), 1 epoch;
  3. best-of-n: BON_SAMPLES answers at T=1 to each of BON_PROBLEMS held-out problems (the same for every seed), graded
     by the RM and the verifier; for n = 1, 2, 4, ..., BON_SAMPLES the expected gold and proxy of the answer the RM
     ranks first among n, computed exactly over the subsets of the samples (Gao et al.'s unbiased estimator), with a
     bootstrap interval over the problems;
  4. GRPO against the RM alone (--reward rm:RM+0*verifier: the verifier graded at weight 0, logged, never rewarded)
     at each --kl-beta of LEASHES, --log-kl-to-start, STEPS steps of 16 prompts x 8 answers on 2 ranks.

    python lab/goodhart.py                   # from runs/cpu.sh's checkpoints in ./out/cpu; docs/lab/goodhart.{json,png}
    python lab/goodhart.py --home /tmp/np    # another pipeline's $NANOPOST_HOME
    python lab/goodhart.py --smoke           # tiny sizes (tests/test_lab_goodhart.py)
"""
import math
import os

import torch

import lmkit  # (puts the repository on the path)
from checkpoint import load_hf, resolve_model_path
from engine import Engine
from labkit import Lab, checkpoint, figure, moving_average, parser
from rewards import Grader
from rollout import sample
from tokenizer import Tokenizer
from verifiers import answer_text

LEASHES = (0.0, 0.04, 0.4)  # --kl-beta: none, the GRPO paper's, ten times it
PAIR_PROMPTS, BON_PROBLEMS, BON_SAMPLES, STEPS, EVAL_EVERY, MAX_NEW_TOKENS, EXAMPLES = 1500, 100, 64, 30, 10, 192, 3
SMOKE = dict(pair_prompts=16, bon_problems=6, bon_samples=8, steps=2, eval_every=1, max_new_tokens=24, prompts=4,
             group=4)


def kl_bon(n: int) -> float:
    """KL(best-of-n || start) = log n - (n - 1) / n (Stiennon et al. 2020; Gao et al. 2022). n = 1: 0; n = 64: 3.17."""
    return math.log(n) - (n - 1) / n


def best_of(proxy: list, gold: list, n: int) -> tuple:
    """The expected (gold, proxy) of the answer with the highest proxy among n drawn without replacement from these N
    samples, exactly: sorted by proxy, the i-th smallest (1-based) is the best of a random n-subset with probability
    C(i - 1, n - 1) / C(N, n) (Gao et al. 2022's unbiased estimator; ties broken by sampling order).
    Example: proxy [0.1, 0.9, 0.5], gold [1, 0, 1], n 2: the best of {1,2} or {2,3} is the 0.9 (gold 0), of {1,3} the
    0.5 (gold 1): gold 1/3, proxy (0.9 + 0.9 + 0.5) / 3 = 0.7667."""
    N = len(proxy)
    order = sorted(range(N), key=lambda i: (proxy[i], -i))
    weights = [math.comb(rank, n - 1) / math.comb(N, n) for rank in range(N)]  # rank = i - 1
    return (sum(w * gold[j] for w, j in zip(weights, order)), sum(w * proxy[j] for w, j in zip(weights, order)))


@torch.no_grad()
def answers(sft, rm, rows, *, samples, max_new_tokens, seed):
    """`samples` answers at T=1 to each row from the SFT model, each with the RM's score and the verifier's verdict."""
    folder = resolve_model_path(sft)
    tok = Tokenizer.load(folder)
    engine, grader = Engine(load_hf(folder), tok), Grader(f"rm:{rm}+0*verifier", tok)
    out = []
    for i in range(0, len(rows), 8):  # 8 problems x `samples` answers an engine call
        r = sample(engine, rows[i:i + 8], grader, samples_per_prompt=samples,
                   max_new_tokens=max_new_tokens, seed=seed + i)
        proxy, gold = r.reward_parts[f"rm:{rm}"].tolist(), r.reward_parts["verifier"].tolist()
        for j, row in enumerate(rows[i:i + 8]):
            span = slice(j * samples, (j + 1) * samples)
            out.append({"question": row["prompt"][0]["content"], "truth": row["ground_truth"], "proxy": proxy[span],
                        "gold": gold[span], "texts": [answer_text(tok.decode(c.tokens)) for c in r.completions[span]]})
    return out


def main():
    p = parser("goodhart", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("goodhart", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(pair_prompts=PAIR_PROMPTS, bon_problems=BON_PROBLEMS, bon_samples=BON_SAMPLES,
                                         steps=STEPS, eval_every=EVAL_EVERY, max_new_tokens=MAX_NEW_TOKENS, prompts=16,
                                         group=8)
    nproc, seeds = 1 if args.smoke else 2, lmkit.seeds(args)
    # the smoke home's tiny model gets nothing right, so the verifier cannot tell its answers apart: its pairs are
    # labelled by the pipeline's RM instead (the plumbing, not the method)
    label = f"rm:{checkpoint(args.home, 'rm')}" if args.smoke else "verifier"
    rows = lmkit.heldout(size["bon_problems"])
    data_file = lmkit.write_rows(rows, os.path.join(args.home, "data", "lab-goodhart-heldout.jsonl"))
    ns = [2 ** i for i in range(int(math.log2(size["bon_samples"])) + 1)]

    seeds_data = []
    for seed in seeds:
        pairs = os.path.join(args.home, "data", f"lab-goodhart-pairs-s{seed}.jsonl")
        lab.command("chat_sample.py", "--init", sft, "--num-prompts", size["pair_prompts"], "--samples", 8,
                    "--reward", label, "--max-new-tokens", size["max_new_tokens"], "--seed", seed,
                    "--pairs-out", pairs, nproc=nproc)
        with open(pairs) as f:
            n_pairs = sum(1 for line in f if line.strip())
        rm = lab.run("chat_rm.py", "--init", sft, "--data", pairs, "--seed", seed,
                     *(["--steps", "3", "--batch-size", "4"] if args.smoke else []), stage="rm",
                     run_name=f"lab-goodhart-rm-s{seed}")
        bon = answers(sft, rm, rows, samples=size["bon_samples"], max_new_tokens=size["max_new_tokens"],
                      seed=3000 + seed)
        curves = {"gold": [], "proxy": [], "gold_interval": [], "per_problem_gold": []}
        for n in ns:
            per = [best_of(a["proxy"], a["gold"], n) for a in bon]
            gold = [g for g, _ in per]
            curves["gold"].append(lmkit.mean(gold))
            curves["proxy"].append(lmkit.mean([x for _, x in per]))
            curves["gold_interval"].append(lmkit.bootstrap(gold, seed=seed))
            curves["per_problem_gold"].append(gold)
        # the RM's favourite answers that the verifier fails: what best-of-n over-optimizes onto
        fooled = sorted((a for a in bon if a["gold"][max(range(len(a["proxy"])), key=a["proxy"].__getitem__)] == 0),
                        key=lambda a: -max(a["proxy"]))[:EXAMPLES]
        examples = [{"question": a["question"], "truth": a["truth"], "rm": max(a["proxy"]),
                     "answer": a["texts"][max(range(len(a["proxy"])), key=a["proxy"].__getitem__)]} for a in fooled]
        # the RM's AUC on the start's own answers, within a problem (what best-of-n asks of it): the chance it scores
        # a right answer above a wrong one to the same question, over the problems that have both
        aucs = [lmkit.mean([float(x > y) + 0.5 * float(x == y) for x, g in zip(a["proxy"], a["gold"]) if g == 1
                            for y, h in zip(a["proxy"], a["gold"]) if h == 0])
                for a in bon if 0 < sum(a["gold"]) < len(a["gold"])]
        auc = lmkit.mean(aucs) if aucs else None
        rl = {}
        for beta in LEASHES:
            run = lab.run("chat_rl.py", "--init", sft, "--reward", f"rm:{rm}+0*verifier", "--kl-beta", beta,
                          "--log-kl-to-start", "--seed", seed, "--steps", size["steps"], "--prompts-per-step",
                          size["prompts"], "--group-size", size["group"], "--max-new-tokens", size["max_new_tokens"],
                          "--eval-data", data_file, "--eval-problems", size["bon_problems"], "--eval-every",
                          size["eval_every"], "--pass-k", 0, "--save-every", 100000, stage="rl",
                          run_name=f"lab-goodhart-beta{beta:g}-s{seed}", nproc=nproc)
            rows_ = lab.metrics(run)
            train = [r for r in rows_ if "reward" in r]
            kl_of = {r["step"]: r["kl_to_start"] for r in train}
            rl[f"beta={beta:g}"] = {
                "step": [r["step"] for r in train], "sqrt_kl": [r["kl_to_start"] ** 0.5 for r in train],
                "proxy": [r[f"reward/rm:{rm}"] for r in train], "gold": [r["reward/verifier"] for r in train],
                # held out: the weights evaluated at step s sampled step s + 1, whose KL is theirs (the last, one
                # update past the last step's, is placed at it)
                "heldout": [{"step": r["step"], "proxy": r[f"eval/reward/rm:{rm}"], "gold": r["eval/reward/verifier"],
                             "sqrt_kl": kl_of.get(r["step"] + 1, train[-1]["kl_to_start"]) ** 0.5 if r["step"] else 0.0}
                            for r in rows_ if "eval/reward/verifier" in r]}
        seeds_data.append({"seed": seed, "pairs": n_pairs, "rm": rm, "rm_auc": auc, "bon": curves, "examples": examples,
                           "rl": rl, "rm_eval": lab.eval_json(rm)})
        print(f"[goodhart] seed {seed}: {n_pairs} pairs, RM AUC on the start's answers {auc}; best-of-n gold "
              + " ".join(f"{n}:{g:.3f}" for n, g in zip(ns, curves["gold"])), flush=True)

    # best-of-n over seeds: per n the gold, problem by problem, seed-averaged; its peak against n = 1 and the largest n
    per_problem = [lmkit.seed_mean([s["bon"]["per_problem_gold"][i] for s in seeds_data]) for i in range(len(ns))]
    golds = [lmkit.mean(g) for g in per_problem]
    peak = max(range(len(ns)), key=golds.__getitem__)
    summary = {"bon": {"n": ns, "sqrt_kl": [kl_bon(n) ** 0.5 for n in ns], "gold": golds,
                       "gold_interval": [lmkit.bootstrap(g) for g in per_problem],
                       "proxy": [lmkit.mean([s["bon"]["proxy"][i] for s in seeds_data]) for i in range(len(ns))],
                       "peak_n": ns[peak], "peak_gold": golds[peak], "peak_sqrt_kl": kl_bon(ns[peak]) ** 0.5,
                       "peak_minus_n1": lmkit.paired(per_problem[0], per_problem[peak]),
                       "last_minus_peak": lmkit.paired(per_problem[peak], per_problem[-1])},
               "rm_auc": lmkit.spread([s["rm_auc"] for s in seeds_data]),
               "pairs": lmkit.spread([s["pairs"] for s in seeds_data])}
    tail = max(1, size["steps"] // 5)
    for name in seeds_data[0]["rl"]:
        runs = [s["rl"][name] for s in seeds_data]
        golds_ = [[h["gold"] for h in r["heldout"]] for r in runs]
        summary[name] = {"heldout_gold_start": lmkit.spread([g[0] for g in golds_]),
                         "heldout_gold_peak": lmkit.spread([max(g) for g in golds_]),
                         "heldout_gold_end": lmkit.spread([g[-1] for g in golds_]),
                         "heldout_proxy_end": lmkit.spread([r["heldout"][-1]["proxy"] for r in runs]),
                         "sqrt_kl_end": lmkit.spread([r["sqrt_kl"][-1] for r in runs]),
                         "train_gold_first": lmkit.spread([lmkit.mean(r["gold"][:tail]) for r in runs]),
                         "train_gold_last": lmkit.spread([lmkit.mean(r["gold"][-tail:]) for r in runs]),
                         "train_proxy_first": lmkit.spread([lmkit.mean(r["proxy"][:tail]) for r in runs]),
                         "train_proxy_last": lmkit.spread([lmkit.mean(r["proxy"][-tail:]) for r in runs])}

    fig, axes = figure(2, 2, layout="constrained")
    x = summary["bon"]["sqrt_kl"]
    lo, hi = zip(*summary["bon"]["gold_interval"])
    axes[0].fill_between(x, lo, hi, color="C2", alpha=0.2, lw=0)
    axes[0].plot(x, golds, "o-", color="C2", label=f"gold, {len(seeds)} seeds' RMs (95% bootstrap over problems)")
    lmkit.draw_band(axes[1], x, [s["bon"]["proxy"] for s in seeds_data], color="C1", label="proxy", marker="o")
    for ax, what in ((axes[0], "gold: verifier accuracy"), (axes[1], "proxy: RM score")):
        for n, xi in zip(ns, x):
            ax.annotate(f"{n}", (xi, ax.get_ylim()[0]), fontsize=6, ha="center", va="bottom")
        ax.set(title=f"best-of-n on {size['bon_problems']} held-out problems (n marked)", xlabel="sqrt(KL_bon), "
               "KL_bon = log n - (n-1)/n (nats)", ylabel=what)
    for i, name in enumerate(seeds_data[0]["rl"]):
        runs = [s["rl"][name] for s in seeds_data]
        x = [lmkit.mean(col) for col in zip(*[r["sqrt_kl"] for r in runs])]  # the seeds' mean distance per step
        for ax, key in ((axes[2], "gold"), (axes[3], "proxy")):
            lmkit.draw_band(ax, x, [moving_average(r[key]) for r in runs], color=f"C{i}", label=f"GRPO, {name}")
    axes[2].set(title="GRPO against the RM: gold of each step's answers (5-step means)", xlabel="sqrt(KL to the start)"
                " (nats^0.5)", ylabel="verifier accuracy")
    axes[3].set(title="GRPO against the RM: proxy of each step's answers", xlabel="sqrt(KL to the start) (nats^0.5)",
                ylabel="RM score")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Goodhart against an RM trained on the SFT model's own verifier-labelled answers (no calculator)",
                 fontsize=10)
    lab.save({"question": "Against an RM trained on the policy's own verifier-labelled answers, does the gold rise and "
                          "then fall while the proxy climbs, for best-of-n and for RL, and does a KL leash hold it?",
              "init": "sft/default", "tools": False, "label": label, "seeds": seeds, **size, "leashes": list(LEASHES),
              "ranks": nproc, "summary": summary, "seeds_data": seeds_data}, fig)


if __name__ == "__main__":
    main()
