"""
RL from the base, no SFT (DeepSeek-R1-Zero, DeepSeek-AI 2025, https://arxiv.org/abs/2501.12948): GRPO straight on a
pretrained base with a rule-based reward, accuracy plus format, against the usual cold start (SFT, then the same GRPO).
R1-Zero's accuracy rose from the base alone, and its answers grew long.

A base can only be reinforced where it is sometimes right. So the problems are chosen by the base itself: it answers
each of SELECT_TRAIN training and SELECT_HELDOUT held-out problems SELECT_K times at T=1 (plain prompt, as it read its
documents), and the problems it solves sometimes (1 to SELECT_K - 1 right: a group there is not flat) are kept. The
held-out accuracy is then measured on fresh answers (other seeds), never on the answers that chose the problems:
a problem chosen because the base got it right by luck would otherwise fall back at the next draw, and look like a
fall (regression to the mean). Both starts without the calculator, on the same chosen problems, SEEDS seeds each:
    base   the pipeline's base, prompted plain ("question\\n", chat_rl.py --prompt-format plain): R1-Zero
    sft    the pipeline's SFT run, in ChatML: the cold start
chat_rl.py --reward verifier+0.1*format (1 for a right answer, 0.1 for a final "#### N" line the verifier can read),
--no-dynamic-sampling (R1-Zero's GRPO), 16 prompts x 8 answers a step on 2 ranks, STEPS steps. Logged each step: the
accuracy, the format rate and the length of the step's answers; every EVAL_EVERY steps one answer at T=1 to each
chosen held-out problem (--eval-data). At the start and the end, EVAL_K answers at T=1 to each, problem by problem.

    python lab/r1_zero.py                   # from runs/cpu.sh's checkpoints in ./out/cpu; docs/lab/r1_zero.{json,png}
    python lab/r1_zero.py --home /tmp/np    # another pipeline's $NANOPOST_HOME
    python lab/r1_zero.py --smoke           # tiny sizes (tests/test_lab_r1_zero.py)
"""
import os

import lmkit  # (puts the repository on the path)
from labkit import Lab, checkpoint, figure, parser
from tasks import rl_prompts

REWARD = "verifier+0.1*format"
STARTS = {"base": ("base", "plain", "base, plain prompt (R1-Zero)"), "sft": ("sft", "chat", "SFT, then GRPO")}
SELECT_TRAIN, SELECT_HELDOUT, SELECT_K, STEPS, EVAL_EVERY, EVAL_K, MAX_NEW_TOKENS = 800, 400, 8, 40, 10, 8, 192
SMOKE = dict(select_train=16, select_heldout=8, select_k=4, steps=2, eval_every=1, eval_k=2, max_new_tokens=24,
             prompts=4, group=4)
PER_STEP = dict(prompts=16, group=8)


def chosen(home, rows, *, k, max_new_tokens, seed, smoke):
    """The rows the base solves sometimes, judged on k answers each at T=1 (plain prompt): 1 to k - 1 right; and how
    many of the rows had each count. The smoke home's tiny base solves none: there every row is kept."""
    ev = lmkit.per_problem(os.path.join(home, "base", "default"), rows, samples=k, temperature=1.0,
                           max_new_tokens=max_new_tokens, seed=seed, prompt_format="plain")
    keep = [row for row, c in zip(rows, ev["correct"]) if smoke or 0 < c < k]
    return keep, {str(c): ev["correct"].count(c) for c in range(k + 1)}


def main():
    p = parser("r1_zero", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("r1_zero", args)
    starts = {name: checkpoint(args.home, stage) for name, (stage, _, _) in STARTS.items()}
    size = SMOKE if args.smoke else dict(select_train=SELECT_TRAIN, select_heldout=SELECT_HELDOUT, select_k=SELECT_K,
                                         steps=STEPS, eval_every=EVAL_EVERY, eval_k=EVAL_K,
                                         max_new_tokens=MAX_NEW_TOKENS, **PER_STEP)
    nproc, seeds = 1 if args.smoke else 2, lmkit.seeds(args)
    pick = dict(k=size["select_k"], max_new_tokens=size["max_new_tokens"], seed=12345, smoke=args.smoke)
    train, train_counts = chosen(args.home, rl_prompts("train", size["select_train"], seed=0), **pick)
    heldout, heldout_counts = chosen(args.home, lmkit.heldout(size["select_heldout"]), **pick)
    data = os.path.join(args.home, "data")
    train_file = lmkit.write_rows(train, os.path.join(data, "lab-r1_zero-train.jsonl"))
    heldout_file = lmkit.write_rows(heldout, os.path.join(data, "lab-r1_zero-heldout.jsonl"))
    print(f"[r1_zero] the base solves sometimes {len(train)} of {size['select_train']} training problems and "
          f"{len(heldout)} of {size['select_heldout']} held-out ones", flush=True)

    def measured(model, prompt_format, seed):  # fresh answers: seeds apart from the selection's 12345
        ev = lmkit.per_problem(model, heldout, samples=size["eval_k"], temperature=1.0, seed=seed,
                               max_new_tokens=size["max_new_tokens"], prompt_format=prompt_format)
        return {k: ev[k] for k in ("score", "format_rate", "stop_rate", "mean_length")}

    runs = {name: [] for name in STARTS}
    for name, (_, prompt_format, _) in STARTS.items():
        for seed in seeds:
            run = lab.run("chat_rl.py", "--init", starts[name], "--prompt-format", prompt_format, "--data", train_file,
                          "--eval-data", heldout_file, "--eval-problems", len(heldout), "--reward", REWARD,
                          "--no-dynamic-sampling", "--seed", seed, "--steps", size["steps"], "--prompts-per-step",
                          size["prompts"], "--group-size", size["group"], "--max-new-tokens", size["max_new_tokens"],
                          "--eval-every", size["eval_every"], "--pass-k", 0, "--save-every", 100000, stage="rl",
                          run_name=f"lab-r1_zero-{name}-s{seed}", nproc=nproc)
            rows = lab.metrics(run)
            steps = [r for r in rows if "reward" in r]
            evals = [r for r in rows if "eval/reward/verifier" in r]
            runs[name].append({
                "seed": seed, "run": run, "step": [r["step"] for r in steps],
                **{key: [r[src] for r in steps] for key, src in (
                    ("accuracy", "accuracy"), ("format_rate", "reward/format"), ("length", "length_mean"),
                    ("flat_groups", "flat_group_frac"))},
                "eval_step": [r["step"] for r in evals],
                "heldout_accuracy_t1": [r["eval/reward/verifier"] for r in evals],
                "heldout_format_t1": [r["eval/reward/format"] for r in evals],
                "start": measured(starts[name], prompt_format, 2000 + seed),
                "end": measured(run, prompt_format, 2000 + seed)})
            r = runs[name][-1]
            print(f"[r1_zero] {name} seed {seed}: held-out accuracy {lmkit.mean(r['start']['score']):.3f} -> "
                  f"{lmkit.mean(r['end']['score']):.3f}; step accuracy {r['accuracy'][0]:.3f} -> "
                  f"{r['accuracy'][-1]:.3f}",
                  flush=True)

    summary = {}
    for name in STARTS:
        before = lmkit.seed_mean([r["start"]["score"] for r in runs[name]])
        after = lmkit.seed_mean([r["end"]["score"] for r in runs[name]])
        tail = max(1, size["steps"] // 5)  # the first and the last fifth of the steps, averaged, per seed
        summary[name] = {"heldout_accuracy": {"start": lmkit.mean(before), "end": lmkit.mean(after),
                                              "change": lmkit.paired(before, after),
                                              "end_seeds": lmkit.spread([lmkit.mean(r["end"]["score"])
                                                                         for r in runs[name]])},
                         **{key: {"start": lmkit.spread([r["start"][key] for r in runs[name]]),
                                  "end": lmkit.spread([r["end"][key] for r in runs[name]])}
                            for key in ("format_rate", "stop_rate", "mean_length")},
                         **{f"steps_{key}": {"first": lmkit.spread([lmkit.mean(r[key][:tail]) for r in runs[name]]),
                                             "last": lmkit.spread([lmkit.mean(r[key][-tail:]) for r in runs[name]])}
                            for key in ("accuracy", "format_rate", "length", "flat_groups")}}

    fig, axes = figure(2, 2, layout="constrained")
    panels = [("accuracy", "accuracy of each step's answers (T=1)", "share right"),
              ("format_rate", "format rate of each step's answers", "share with a final '#### N'"),
              ("length", "answer length", "tokens"), ("heldout_accuracy_t1", "held-out accuracy, one answer at T=1",
                                                      "share right")]
    for ax, (key, title, ylabel) in zip(axes, panels):
        for i, (name, (_, _, label)) in enumerate(STARTS.items()):
            x = runs[name][0]["eval_step" if key.startswith("heldout") else "step"]
            lmkit.draw_band(ax, x, [r[key] for r in runs[name]], color=("C3", "C0")[i], label=label,
                            marker="o" if key.startswith("heldout") else None)
        ax.set(title=title, xlabel="RL step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GRPO with {REWARD}, no calculator, on the {len(train)} training problems the base solves sometimes",
                 fontsize=10)
    lab.save({"question": "On problems the base solves sometimes, does GRPO from the base alone (accuracy and format "
                          "rewards) raise its accuracy, as SFT-then-GRPO does?", "reward": REWARD, "tools": False,
              "seeds": seeds, **size, "ranks": nproc,
              "selection": {"train": {"problems": size["select_train"], "kept": len(train), "right_of_k": train_counts},
                            "heldout": {"problems": size["select_heldout"], "kept": len(heldout),
                                        "right_of_k": heldout_counts}},
              "summary": summary, "runs": runs}, fig)


if __name__ == "__main__":
    main()
