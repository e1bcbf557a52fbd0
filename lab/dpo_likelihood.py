"""
Experiment 3 of the lab: DPO's falling chosen likelihood. DPO's loss sees only the margin between the chosen
and the rejected answer's log-ratios to the reference, so it may grow the margin while the chosen answer's own
log-probability falls: likelihood displacement (Razin et al. 2024, https://arxiv.org/abs/2410.08847), most
of all when chosen and rejected are alike. RPO adds the chosen answer's NLL to the loss (Pang et al. 2024,
https://arxiv.org/abs/2404.19733, --rpo-alpha), which should hold the chosen likelihood up. Does the margin grow
while the chosen likelihood falls here, and does RPO's NLL term hold it? And what does each do to held-out
pass@1?

Two runs of chat_dpo.py from runs/cpu.sh's SFT run (sft/default), as a user runs it, the same in all but the
loss: `--loss sigmoid` and `--loss sigmoid --rpo-alpha 1`, each STEPS steps of 32 pairs of the embedded world's
600 training pairs (about 3 epochs; runs/cpu.sh's DPO takes 1), with the calculator offered at evaluation as
runs/cpu.sh's DPO does (--tools). What the stage logs is all this needs: on the 300 held-out pairs every
EVAL_EVERY steps val/logps/chosen and val/logps/rejected (the policy's mean summed log-probs) and
val/rewards/chosen and val/rewards/rejected (beta times their change from the reference, so the reference's
mean is logps - rewards / beta); the same on each step's training pairs; and greedy pass@1 on 500 held-out
problems before and after, with its paired change, in eval.json. At the end, the same held-out pairs by kind
(a wrong step, a missing final answer, rambling), the change of each side's log-prob from the SFT model.

    python lab/dpo_likelihood.py                       # from ./out/cpu (runs/cpu.sh); writes docs/lab/dpo_likelihood.{json,png}
    python lab/dpo_likelihood.py --home /work/np       # another pipeline's home; the runs go to dpo/lab-dpo_likelihood-*
    python lab/dpo_likelihood.py --smoke               # tiny sizes (tests/test_lab_dpo_likelihood.py)

Page: docs/lab/dpo_likelihood.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from checkpoint import load_model, resolve_model_path  # noqa: E402
from labkit import Lab, checkpoint, figure, parser  # noqa: E402
from preferences import completion_logps, pair_items  # noqa: E402
from tasks import PREFERENCE_KINDS, preference_pairs  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

CONFIGS = {"sigmoid": ["--loss", "sigmoid"], "rpo": ["--loss", "sigmoid", "--rpo-alpha", "1"]}
LABELS = {"sigmoid": "DPO (--loss sigmoid)", "rpo": "RPO (--rpo-alpha 1)"}
BETA, STEPS, EVAL_EVERY, NUM_VAL, MAX_LEN = 0.1, 60, 4, 300, 512
SMOKE = ["--num-train", "32", "--num-val", "8", "--steps", "3", "--batch-size", "8", "--warmup-steps", "1",
         "--eval-problems", "8", "--max-new-tokens", "24", "--eval-every", "1"]  # tests/test_pipeline.py's sizes


@torch.no_grad()
def logps_by_kind(model_dir, tok, items):
    """{kind: (mean chosen log-prob, mean rejected log-prob)} of the held-out pairs under a model folder."""
    model = load_model(resolve_model_path(model_dir)).eval()
    examples = [e for chosen, rejected, _ in items for e in (chosen, rejected)]
    logps = torch.cat([completion_logps(model, examples[s:s + 64], tok.pad_id, "packed", MAX_LEN)[0]
                       for s in range(0, len(examples), 64)]).view(-1, 2).cpu()
    kinds = [kind for _, _, kind in items]
    return {kind: [round(float(logps[[k == kind for k in kinds], side].mean()), 3) for side in (0, 1)]
            for kind in PREFERENCE_KINDS if kind in kinds}


def curves(rows):
    """Per step, from metrics.jsonl: the change of each side's log-prob from the reference (rewards / beta), on
    the training pairs of that step (measured before its update) and on the held-out pairs when evaluated
    (after it), and the held-out pair accuracy, overall and by kind. Step 0 is the SFT model, the reference itself: every change 0."""
    train = [r for r in rows if "rewards/chosen" in r]
    val = [{"step": 0, "val/rewards/chosen": 0.0, "val/rewards/rejected": 0.0, "val/rewards/margins": 0.0,
            "val/pair_accuracy": 0.0, "val/logps/chosen": None, "val/logps/rejected": None}] + \
        [r for r in rows if "val/rewards/chosen" in r]
    return {"train_steps": [r["step"] for r in train],
            "train_delta_chosen": [round(r["rewards/chosen"] / BETA, 4) for r in train],
            "train_delta_rejected": [round(r["rewards/rejected"] / BETA, 4) for r in train],
            "val_steps": [r["step"] for r in val],
            "val_logps_chosen": [r["val/logps/chosen"] for r in val],
            "val_logps_rejected": [r["val/logps/rejected"] for r in val],
            "val_delta_chosen": [round(r["val/rewards/chosen"] / BETA, 4) for r in val],
            "val_delta_rejected": [round(r["val/rewards/rejected"] / BETA, 4) for r in val],
            "val_margin": [round(r["val/rewards/margins"] / BETA, 4) for r in val],
            "val_pair_accuracy": [r["val/pair_accuracy"] for r in val],
            "val_accuracy_by_kind": {kind: [r.get(f"val/accuracy/{kind}", 0.0) for r in val] for kind in PREFERENCE_KINDS}}


def draw(data):
    fig, axes = figure(2, 2, width=5.2, height=3.6)
    for name, run in data["runs"].items():
        c, label = ("C0" if name == "sigmoid" else "C3"), LABELS[name]
        axes[0].plot(run["val_steps"], run["val_delta_chosen"], "o-", color=c, label=f"{label}, held-out")
        axes[0].plot(run["train_steps"], run["train_delta_chosen"], "-", color=c, alpha=0.3, lw=1,
                     label=f"{label}, each step's training pairs")
        axes[1].plot(run["val_steps"], run["val_delta_rejected"], "o-", color=c, label=label)
        axes[2].plot(run["val_steps"], run["val_margin"], "o-", color=c, label=f"{label}: margin (nats)")
    axes[0].axhline(0, color="k", lw=0.5)
    axes[0].set_title("chosen answers: log p - log p_SFT (nats per answer)", fontsize=9)
    axes[1].set_title("rejected answers: log p - log p_SFT (nats per answer)", fontsize=9)
    axes[2].set_title("held-out margin: change of chosen - change of rejected", fontsize=9)
    for ax in axes[:3]:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    ax, kinds = axes[3], list(data["by_kind"]["sft"])
    for i, name in enumerate(data["runs"]):
        deltas = [data["by_kind"][name][k][0] - data["by_kind"]["sft"][k][0] for k in kinds]
        ax.bar([j + 0.4 * i for j in range(len(kinds))], deltas, width=0.4, color="C0" if name == "sigmoid" else "C3",
               label=f"{LABELS[name]}: pass@1 {data['runs'][name]['start/pass@1']:.3f} -> {data['runs'][name]['pass@1']:.3f}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks([j + 0.2 for j in range(len(kinds))], kinds)
    ax.set_title("held-out chosen answers by kind, at the end: log p - log p_SFT", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def main():
    args = parser("dpo_likelihood", "DPO's chosen likelihood against RPO's, from the SFT run").parse_args()
    lab = Lab("dpo_likelihood", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else ["--steps", STEPS, "--eval-every", EVAL_EVERY, "--tools"]
    num_val = 8 if args.smoke else NUM_VAL
    data = {"init": "sft/default", "beta": BETA, "steps": 3 if args.smoke else STEPS, "runs": {}, "by_kind": {}}
    tok = Tokenizer.load(resolve_model_path(sft))
    items, _ = pair_items(tok, preference_pairs("test", num_val, seed=0), MAX_LEN)  # chat_dpo.py's held-out pairs
    data["by_kind"]["sft"] = logps_by_kind(sft, tok, items)
    for name, flags in CONFIGS.items():
        run = lab.run("chat_dpo.py", "--init", sft, *flags, "--beta", BETA, *size, stage="dpo",
                      run_name=f"lab-dpo_likelihood-{name}")
        ev = lab.eval_json(run)
        data["runs"][name] = {**curves(lab.metrics(run)), "seconds": lab.commands[-1]["seconds"],
                              **{k: ev.get(k) for k in ("pass@1", "start/pass@1", "pass@1_change", "pass@1_change_se",
                                                        "tool_use_rate", "start/tool_use_rate", "pair_accuracy",
                                                        "accuracy/wrong_step", "logps/chosen",
                                                        "logps/rejected", "rewards/chosen", "rewards/rejected")}}
        data["by_kind"][name] = logps_by_kind(run, tok, items)
    lab.save(data, draw(data))


if __name__ == "__main__":
    main()
