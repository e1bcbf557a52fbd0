"""
DPO's falling chosen likelihood. DPO's loss sees only the margin between the chosen and the rejected answer's
log-ratios to the reference, so it may grow the margin while the chosen answer's own log-probability falls: likelihood
displacement (Razin et al. 2024, https://arxiv.org/abs/2410.08847), strongest when the two answers are alike (their
CHES score; here the token edit distance). Does the chosen likelihood fall here, most for the most similar pairs, and
where does its probability go?

Four kinds of pairs, each its own chat_dpo.py run from runs/cpu.sh's SFT run (--data: TRAIN_PAIRS pairs of that kind
only), SEEDS seeds each, the stage's defaults otherwise (--loss sigmoid, --beta 0.1, lr 2e-5), STEPS steps of 32 pairs:
    minimal_edit    the same solution, only the final number wrong (#### N+1, say): the most alike
    wrong_step      one step's result off by 1 or 2, carried to the end (tasks.preference_pairs)
    missing_answer  the chosen answer without its final "#### N" line
    rambling        the right answer three times as long
On VAL_PAIRS held-out pairs of each kind (the same for every seed), the SFT model and each run's end score both
answers; per pair: the change of the chosen and of the rejected answer's log-prob from SFT (nats per answer), and
the pair's similarity, 1 - token edit distance / the longer answer's tokens. And where the mass went: at the first
token where the two answers part (a minimal edit's final number), the probability of the chosen token, of the
rejected one and of every other token, before and after.

    python lab/dpo_likelihood.py                   # from ./out/cpu (runs/cpu.sh); docs/lab/dpo_likelihood.{json,png}
    python lab/dpo_likelihood.py --home /work/np   # another pipeline's home
    python lab/dpo_likelihood.py --smoke           # tiny sizes (tests/test_lab_dpo_likelihood.py)
"""
import os
import random

import torch

import lmkit  # (puts the repository on the path)
from checkpoint import load_model, resolve_model_path
from labkit import Lab, checkpoint, figure, parser
from packing import IGNORE
from preferences import completion_logps, pair_items
from tasks import preference_pairs
from tokenizer import Tokenizer

KINDS = ("minimal_edit", "wrong_step", "missing_answer", "rambling")
BETA, STEPS, EVAL_EVERY, TRAIN_PAIRS, VAL_PAIRS, MAX_LEN = 0.1, 60, 10, 600, 100, 512
SMOKE = dict(steps=2, eval_every=1, train_pairs=16, val_pairs=4)
SMOKE_FLAGS = ["--batch-size", "8", "--warmup-steps", "1", "--max-new-tokens", "24"]


def minimal_edit(row: dict, rng: random.Random) -> dict:
    """The pair's chosen solution against itself with only the final number changed, by 1, 2 or 10 either way (kept
    non-negative). Example: "... = 480 dollars.\\n#### 480" against "... = 480 dollars.\\n#### 481"."""
    chosen = row["chosen"][0]["content"]
    body, last = chosen.rsplit("\n", 1)
    n = int(last.removeprefix("#### "))
    wrong = n + rng.choice([d for d in (-10, -2, -1, 1, 2, 10) if n + d >= 0])
    return {**row, "rejected": [{"role": "assistant", "content": f"{body}\n#### {wrong}"}], "kind": "minimal_edit"}


def pairs_of(kind: str, split: str, n: int) -> list:
    """n pairs of one kind: tasks.preference_pairs's, or for minimal_edit its wrong_step pairs' chosen side edited."""
    rows = preference_pairs(split, n, seed=0, kinds=(kind if kind != "minimal_edit" else "wrong_step",))
    rng = random.Random(f"minimal-edit/{split}")
    return [minimal_edit(r, rng) for r in rows] if kind == "minimal_edit" else rows


def similarity(a: list, b: list) -> float:
    """1 - (token edit distance) / (the longer sequence's length): 1 for the same tokens, near 0 for unrelated ones.
    Example: [1, 2, 3, 4] against [1, 2, 3, 5]: one substitution, 1 - 1/4 = 0.75."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return 1 - prev[-1] / max(len(a), len(b), 1)


def completion(example) -> list:
    return [t for t in example[1] if t != IGNORE]


@torch.no_grad()
def scored(model_dir, tok, items) -> dict:
    """Under a checkpoint, per pair: the chosen and the rejected answer's summed log-probs, and at the first token
    where the two part, the probabilities of the chosen token, of the rejected token, and of all the others."""
    model = load_model(resolve_model_path(model_dir)).eval()
    examples = [e for chosen, rejected, _ in items for e in (chosen, rejected)]
    logps = torch.cat([completion_logps(model, examples[s:s + 64], tok.pad_id, "packed", MAX_LEN)[0]
                       for s in range(0, len(examples), 64)]).view(-1, 2)
    split = []
    for (x, y_chosen), (_, y_rejected), _ in items:
        i = next(i for i, (a, b) in enumerate(zip(y_chosen, y_rejected)) if a != b)  # the first target that differs
        probs = torch.softmax(model(torch.tensor([x[:i + 1]]))[0, -1].float(), -1)
        p_chosen = float(probs[y_chosen[i]]) if y_chosen[i] != IGNORE else 0.0
        p_rejected = float(probs[y_rejected[i]]) if y_rejected[i] != IGNORE else 0.0
        split.append({"chosen": p_chosen, "rejected": p_rejected, "other": 1 - p_chosen - p_rejected})
    return {"chosen": logps[:, 0].tolist(), "rejected": logps[:, 1].tolist(), "at_split": split}


def main():
    p = parser("dpo_likelihood", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("dpo_likelihood", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(steps=STEPS, eval_every=EVAL_EVERY, train_pairs=TRAIN_PAIRS,
                                         val_pairs=VAL_PAIRS)
    seeds = lmkit.seeds(args)
    tok = Tokenizer.load(resolve_model_path(sft))
    data, val_items = {}, {}
    for kind in KINDS:
        data[kind] = [lmkit.write_rows(pairs_of(kind, split, n), os.path.join(args.home, "data", f"lab-dpo_likelihood-"
                                                                              f"{kind}-{split}.jsonl"))
                      for split, n in (("train", size["train_pairs"]), ("test", size["val_pairs"]))]
        val_items[kind] = pair_items(tok, pairs_of(kind, "test", size["val_pairs"]), MAX_LEN)[0]
    sim = {kind: [similarity(completion(c), completion(r)) for c, r, _ in items] for kind, items in val_items.items()}
    start = {kind: scored(sft, tok, items) for kind, items in val_items.items()}

    runs = {kind: [] for kind in KINDS}
    for kind in KINDS:
        for seed in seeds:
            run = lab.run("chat_dpo.py", "--init", sft, "--data", data[kind][0], "--eval-data", data[kind][1], "--seed",
                          seed, "--beta", BETA, "--steps", size["steps"], "--eval-every", size["eval_every"],
                          *(SMOKE_FLAGS if args.smoke else []), stage="dpo",
                          run_name=f"lab-dpo_likelihood-{kind}-s{seed}")
            rows = [r for r in lab.metrics(run) if "val/rewards/chosen" in r]
            end = scored(run, tok, val_items[kind])
            runs[kind].append({
                "seed": seed, "run": run, "eval_step": [0] + [r["step"] for r in rows],
                # the held-out means the stage logs, as changes from the reference (rewards / beta), nats per answer
                "val_delta_chosen": [0.0] + [r["val/rewards/chosen"] / BETA for r in rows],
                "val_delta_rejected": [0.0] + [r["val/rewards/rejected"] / BETA for r in rows],
                "val_pair_accuracy": [r["val/pair_accuracy"] for r in rows],
                "delta_chosen": [a - b for a, b in zip(end["chosen"], start[kind]["chosen"])],
                "delta_rejected": [a - b for a, b in zip(end["rejected"], start[kind]["rejected"])],
                "at_split": {side: lmkit.mean([s[side] for s in end["at_split"]]) for side in ("chosen", "rejected",
                                                                                               "other")}})
            r = runs[kind][-1]
            print(f"[dpo_likelihood] {kind} seed {seed}: chosen {lmkit.mean(r['delta_chosen']):+.3f} nats, rejected "
                  f"{lmkit.mean(r['delta_rejected']):+.3f}; at the split {r['at_split']}", flush=True)

    summary = {}
    for kind in KINDS:
        chosen = lmkit.seed_mean([r["delta_chosen"] for r in runs[kind]])  # per pair, seed-averaged
        summary[kind] = {"similarity": lmkit.mean(sim[kind]), "delta_chosen": lmkit.mean_se(chosen),
                         "delta_chosen_seeds": lmkit.spread([lmkit.mean(r["delta_chosen"]) for r in runs[kind]]),
                         "delta_rejected": lmkit.mean_se(lmkit.seed_mean([r["delta_rejected"] for r in runs[kind]])),
                         "pair_accuracy_end": lmkit.spread([r["val_pair_accuracy"][-1] for r in runs[kind]]),
                         "fell": lmkit.mean([d < 0 for d in chosen]),
                         "at_split_start": {side: lmkit.mean([s[side] for s in start[kind]["at_split"]])
                                            for side in ("chosen", "rejected", "other")},
                         "at_split_end": {side: lmkit.spread([r["at_split"][side] for r in runs[kind]])
                                          for side in ("chosen", "rejected", "other")}}
    # the scatter's trend: the chosen change against the similarity over every held-out pair of every kind
    xs = [s for kind in KINDS for s in sim[kind]]
    ys = [d for kind in KINDS for d in lmkit.seed_mean([r["delta_chosen"] for r in runs[kind]])]
    mx, my = lmkit.mean(xs), lmkit.mean(ys)
    sxx, sxy = sum((x - mx) ** 2 for x in xs), sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    summary["trend"] = {"slope": sxy / sxx if sxx else None,
                        "pearson_r": sxy / (sxx * syy) ** 0.5 if sxx and syy else None,
                        "pairs": len(xs)}

    fig, axes = figure(1, 3, layout="constrained")
    for i, kind in enumerate(KINDS):
        lmkit.draw_band(axes[0], runs[kind][0]["eval_step"], [r["val_delta_chosen"] for r in runs[kind]],
                        color=f"C{i}", label=kind)
        axes[1].scatter(sim[kind], lmkit.seed_mean([r["delta_chosen"] for r in runs[kind]]), s=8, color=f"C{i}",
                        alpha=0.6, label=kind)
    axes[0].axhline(0, color="k", lw=0.5)
    axes[0].set(title="held-out chosen answers", xlabel="DPO step", ylabel="log p - log p_SFT (nats per answer)")
    axes[1].axhline(0, color="k", lw=0.5)
    axes[1].set(title="each held-out pair at the end (seed mean)",
                xlabel="similarity: 1 - token edit distance / length",
                ylabel="chosen: log p - log p_SFT (nats)")
    sides, width = ("chosen", "rejected", "other"), 0.2
    for j, side in enumerate(sides):  # at the first token where the two answers part: before (hatched) and after
        before = [summary[k]["at_split_start"][side] for k in KINDS]
        after = [summary[k]["at_split_end"][side]["mean"] for k in KINDS]
        xs_ = [i + (j - 1) * width for i in range(len(KINDS))]
        axes[2].bar(xs_, before, width=width * 0.9, color=f"C{j + 4}", alpha=0.35, hatch="//")
        axes[2].scatter(xs_, after, color=f"C{j + 4}", marker="_", s=200, linewidths=3, label=f"{side} token")
    axes[2].set_xticks(range(len(KINDS)), KINDS, fontsize=7)
    axes[2].set(title="where the answers part: bar SFT, dash the end", ylabel="probability", xlabel="kind of pair")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    lab.save({"question": "Does DPO lower the chosen answers' likelihood, most for the most similar pairs, and where "
                          "does "
                          "the probability go?", "init": "sft/default", "beta": BETA, "seeds": seeds, **size,
              "kinds": list(KINDS), "summary": summary, "similarity": sim,
              "start": {k: {"chosen": v["chosen"], "rejected": v["rejected"]} for k, v in start.items()},
              "runs": runs}, fig)


if __name__ == "__main__":
    main()
