"""
Over-optimization, Goodhart's law (Gao, Schulman and Hilton 2022, "Scaling Laws for Reward Model
Overoptimization", https://arxiv.org/abs/2210.10760): push a policy against a learned reward model and the
proxy (the RM's score) keeps climbing, while the gold (what the RM stands for) first rises, then stalls or
falls. The paper plots both against sqrt(KL(policy || start)); a KL penalty (the leash) slows the walk.

Here the gold is the verifier, which is ground truth on the embedded world. GRPO (chat_rl.py) from the
pipeline's SFT run, rewarded by its reward model alone: --reward rm:RM+0*verifier (a term of weight 0 is
graded and logged, never rewarded), so the proxy (reward/rm:RM) and the gold (reward/verifier) are measured on
the same answers each step, and at the evaluations on held-out answers too (eval/reward/...). Every run logs
kl_to_start, the KL to the start summed over each answer's tokens and averaged over answers, as the paper's
x-axis. Three leashes: --kl-beta 0, 0.04 (the GRPO paper's) and 0.4; and a weaker proxy, the same recipe on an
eighth of the pairs (WEAK_PAIRS), unleashed.

Without --tools: the RM was trained on answers written out in words (chat_rm.py's pairs), never on a
calculator call or its result, so with the calculator the gold could fall for that reason alone.

    python lab/goodhart.py --home /work/runs_out/base0     # ~20 min on 2 cores; docs/lab/goodhart.{json,png}
    python lab/goodhart.py --smoke                          # tiny sizes, what tests/test_lab_goodhart.py runs

Then, what the policy learned: one answer to each of EXPLOIT_PROBLEMS held-out problems from the start and from
each unleashed run's end, each with the RM's score and the verifier's verdict.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from checkpoint import load_hf, resolve_model_path  # noqa: E402
from data import rl_rows  # noqa: E402
from engine import Engine  # noqa: E402
from labkit import Lab, checkpoint, figure, moving_average, parser  # noqa: E402
from rewards import Grader  # noqa: E402
from verifiers import answer_text  # noqa: E402
from rollout import sample  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

LEASHES = (0.0, 0.04, 0.4)  # --kl-beta: none, the GRPO paper's, ten times it
WEAK_PAIRS = 1500  # the weaker proxy: an RM trained on an eighth of the pipeline's 12,000 pairs
EXPLOIT_PROBLEMS = 64

p = parser("goodhart", __doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: 40; smoke: 2)")
args = p.parse_args()
lab = Lab("goodhart", args)
sft, rm = checkpoint(args.home, "sft"), checkpoint(args.home, "rm")
if args.smoke:  # the tiny home of tests/conftest.py: seconds
    steps, nproc, max_new_tokens, exploit_problems, weak_pairs = args.steps or 2, 1, 24, 4, 16
    size = ["--prompts-per-step", "4", "--group-size", "4", "--eval-problems", "4", "--eval-every", "1",
            "--num-prompts", "64"]
else:  # half the pipeline's prompts per step (32 x 8 answers), on 2 ranks as runs/cpu.sh runs RL
    steps, nproc, max_new_tokens, exploit_problems, weak_pairs = args.steps or 40, 2, 192, EXPLOIT_PROBLEMS, WEAK_PAIRS
    size = ["--prompts-per-step", "32", "--group-size", "8", "--eval-problems", "100", "--eval-every", "10"]
size += ["--max-new-tokens", max_new_tokens]
GOLD = "reward/verifier"


def rl_against(proxy, beta, run_name):
    """One RL run rewarded by the RM at `proxy` alone, at --kl-beta beta, the verifier logged beside it at weight 0:
    per step the proxy, the gold and sqrt(kl_to_start) on the training answers; at each evaluation the same on
    held-out answers (one per problem at T=1), and greedy pass@1."""
    path = lab.run("chat_rl.py", "--init", sft, "--reward", f"rm:{proxy}+0*verifier", "--kl-beta", beta, "--log-kl-to-start",
                   "--steps", steps, "--pass-k", "0", "--save-every", steps, *size, stage="rl", run_name=run_name,
                   nproc=nproc)
    rows = lab.metrics(path)
    train = [r for r in rows if "reward" in r]
    kl_of = {r["step"]: r["kl_to_start"] for r in train}
    # the weights evaluated at step s are the ones that sampled step s + 1: that step's KL is theirs (the last
    # evaluation's weights sampled nothing; it is placed at the last step's KL, one update earlier)
    heldout = [{"step": r["step"], "sqrt_kl": 0.0 if r["step"] == 0 else kl_of.get(r["step"] + 1, train[-1]["kl_to_start"]) ** 0.5,
                "proxy": r[f"eval/reward/rm:{proxy}"], "gold": r[f"eval/{GOLD}"], "pass@1": r["eval/pass@1"]}
               for r in rows if f"eval/{GOLD}" in r]
    return {"kl_beta": beta, "proxy": proxy, "run": path,
            "steps": [{"step": r["step"], "sqrt_kl": r["kl_to_start"] ** 0.5, "proxy": r[f"reward/rm:{proxy}"],
                       "gold": r[GOLD], "length": r["length_mean"]} for r in train],
            "heldout": heldout}


def summary(run):
    """The figures the page quotes: where the held-out gold peaked, and where each ended."""
    h = run["heldout"]
    peak = max(h, key=lambda e: e["gold"])
    return {"gold_start": h[0]["gold"], "gold_peak": peak["gold"], "gold_peak_step": peak["step"],
            "gold_peak_sqrt_kl": peak["sqrt_kl"], "gold_end": h[-1]["gold"], "proxy_start": h[0]["proxy"],
            "proxy_end": h[-1]["proxy"], "sqrt_kl_end": run["steps"][-1]["sqrt_kl"], "pass@1_start": h[0]["pass@1"],
            "pass@1_end": h[-1]["pass@1"]}


@torch.no_grad()
def answers_of(model_dir, rows, grader, proxy):
    """One answer at T=1 to each row from a checkpoint, with the RM's score and the verifier's verdict."""
    tok = Tokenizer.load(model_dir)
    r = sample(Engine(load_hf(model_dir), tok), rows, grader, samples_per_prompt=1, max_new_tokens=max_new_tokens,
               seed=1234)
    return [{"question": row["prompt"][0]["content"], "truth": row["ground_truth"],
             "answer": answer_text(tok.decode(c.tokens)), "tokens": len(c.tokens), "rm": round(float(score), 3),
             "verifier": float(ok)}
            for row, c, score, ok in zip(rows, r.completions, r.reward_parts[f"rm:{proxy}"], r.reward_parts["verifier"])]


def exploits(run):
    """The start's and an unleashed run's answers to the same held-out problems, graded by that run's RM and the
    verifier, and the run's answers the RM likes best among those the verifier fails (what the policy learned
    to exploit), each beside the start's answer to the same problem."""
    _, rows = rl_rows(None, None, eval_problems=exploit_problems, num_prompts=1, seed=7)  # seed 7: not the runs' eval
    grader = Grader(f"rm:{run['proxy']}+0*verifier", Tokenizer.load(resolve_model_path(sft)))
    before = answers_of(resolve_model_path(sft), rows, grader, run["proxy"])
    after = answers_of(resolve_model_path(run["run"]), rows, grader, run["proxy"])
    mean = lambda xs, k: round(sum(x[k] for x in xs) / max(1, len(xs)), 3)  # noqa: E731
    fooled = sorted((i for i, a in enumerate(after) if a["verifier"] == 0), key=lambda i: -after[i]["rm"])[:4]
    return {"problems": len(rows), "start": {k: mean(before, k) for k in ("rm", "verifier", "tokens")},
            "end": {k: mean(after, k) for k in ("rm", "verifier", "tokens")},
            # does the RM tell right from wrong among the policy's own answers, at the start and at the end?
            "start_rm_of_right": mean([a for a in before if a["verifier"] == 1], "rm"),
            "start_rm_of_wrong": mean([a for a in before if a["verifier"] == 0], "rm"),
            "end_rm_of_right": mean([a for a in after if a["verifier"] == 1], "rm"),
            "end_rm_of_wrong": mean([a for a in after if a["verifier"] == 0], "rm"),
            "examples": [{"end": after[i], "start": before[i]} for i in fooled]}


# the weaker proxy: the same recipe as the pipeline's RM (chat_rm.py's defaults), on fewer pairs
weak_rm = lab.run("chat_rm.py", "--num-train", weak_pairs,
                  *(["--num-val", "8", "--steps", "3", "--batch-size", "8", "--warmup-steps", "1"] if args.smoke else []),
                  stage="rm", run_name="lab-goodhart-weak-rm")
proxies = {"rm": {"path": rm, "pairs": "pipeline", **lab.eval_json(rm)},
           "weak-rm": {"path": weak_rm, "pairs": weak_pairs, **lab.eval_json(weak_rm)}}
runs = {f"beta={b:g}": rl_against(rm, b, f"lab-goodhart-beta{b:g}") for b in LEASHES}
runs["weak-rm, beta=0"] = rl_against(weak_rm, 0.0, "lab-goodhart-weak-rm-beta0")
samples = {name: exploits(runs[name]) for name in ("beta=0", "weak-rm, beta=0")}

fig, (ax_proxy, ax_gold, ax_heldout, ax_kl) = figure(2, 2, height=4.2, layout="constrained")
for (name, run), (color, style) in zip(runs.items(), (("C3", "-"), ("C0", "-"), ("C2", "-"), ("C3", ":"))):
    x = [s["sqrt_kl"] for s in run["steps"]]
    for ax, key in ((ax_proxy, "proxy"), (ax_gold, "gold")):  # each step a dot, their running mean a line
        y = [s[key] for s in run["steps"]]
        ax.plot(x, y, ".", color=color, alpha=0.3, markersize=4)
        ax.plot(moving_average(x), moving_average(y), style, color=color, label=name)  # one step's answers are noisy
    hx = [e["sqrt_kl"] for e in run["heldout"]]
    ax_heldout.plot(hx, [e["proxy"] for e in run["heldout"]], "o" + style, color=color, label=f"{name}: proxy (RM)")
    ax_heldout.plot(hx, [e["gold"] for e in run["heldout"]], "s--", color=color, mfc="none",
                    label=f"{name}: gold (verifier)")
    ax_kl.plot([s["step"] for s in run["steps"]], x, style, color=color, label=name)
ax_proxy.set(title="proxy on the training answers (weak-rm: its own RM)", xlabel="sqrt(KL to the start)",
             ylabel="RM score")
ax_gold.set(title="gold on the same answers (lines: 5-step means)", xlabel="sqrt(KL to the start)",
            ylabel="verifier accuracy")
ax_heldout.set(title="held-out answers (T=1), at the evaluations", xlabel="sqrt(KL to the start)",
               ylabel="RM score / accuracy")
ax_kl.set(title="the leash: distance from the start", xlabel="step", ylabel="sqrt(KL to the start)")
for ax in (ax_proxy, ax_gold, ax_kl):
    ax.legend(fontsize=8)
ax_heldout.legend(fontsize=6)
fig.suptitle("GRPO against a reward model, from the SFT run, no calculator", fontsize=10)

lab.save({"question": "Against a learned reward model, does the gold fall while the proxy climbs, and does a KL "
                      "penalty delay it?", "tools": False, "start": "sft/default", "reward": "rm:RM+0*verifier",
          "steps": steps, "leashes": list(LEASHES), "proxies": proxies,
          "summary": {name: summary(run) for name, run in runs.items()}, "runs": runs, "exploits": samples}, fig)
