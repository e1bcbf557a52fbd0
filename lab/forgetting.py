"""
Forgetting, and the mixture that keeps the old skill. Fine-tune a model on a new skill alone and it may lose an old
one: catastrophic forgetting. The seeds' defence is the data mixture, some of the old data kept in the new training
(Tulu 3's SFT mixture, open-instruct's dataset mixer; nanopost's --data new.jsonl:0.7,old.jsonl:0.3). Here the old
skill is the pipeline's SFT model's own, arithmetic word problems answered in words or with the calculator; the new
skill is the same arithmetic written as a Python function (tasks.code_conversations, graded by running it in the
sandbox: the `code` verifier), a form of answer the old data never shows. From sft/default, two configurations of
chat_sft.py, SEEDS seeds each, the same epochs, learning rate and batch:
    new only   --data code.jsonl                          NEW_ROWS code conversations
    mixed      --data code.jsonl:0.7,old.jsonl:0.3        the same code rows, and 30% of the mixture from the world's
                                                          SFT conversations (the data sft/default was trained on)
The start and each run are graded on the old skill (EVAL_PROBLEMS held-out arithmetic problems, greedy, the
calculator offered as the pipeline offers it) and on the new (EVAL_PROBLEMS held-out code problems, greedy), problem
by problem, so that each run pairs with the start and the two configurations pair with each other.

    python lab/forgetting.py                  # from ./out/cpu (runs/cpu.sh); writes docs/lab/forgetting.{json,png}
    python lab/forgetting.py --home /tmp/np   # another pipeline's $NANOPOST_HOME
    python lab/forgetting.py --smoke          # tiny sizes (tests/test_lab_forgetting.py)
"""
import os

import lmkit  # (puts the repository on the path)
from labkit import Lab, checkpoint, figure, parser
from tasks import code_problems, code_conversations, sft_conversations

NEW_SHARE = 0.7  # the mixture: 70% new skill, 30% old data
NEW_ROWS, OLD_ROWS, EPOCHS, EVAL_PROBLEMS, MAX_NEW_TOKENS = 3000, 6000, 3, 200, 192
SMOKE = dict(new_rows=24, old_rows=200, epochs=1, eval_problems=4, max_new_tokens=16)
CONFIGS = ("new only", "mixed")


def main():
    p = parser("forgetting", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("forgetting", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(new_rows=NEW_ROWS, old_rows=OLD_ROWS, epochs=EPOCHS,
                                         eval_problems=EVAL_PROBLEMS, max_new_tokens=MAX_NEW_TOKENS)
    seeds = lmkit.seeds(args)
    data_dir = os.path.join(args.home, "data", "lab-forgetting")  # the file names are the sources: code, old
    new = lmkit.write_rows(code_conversations("train", size["new_rows"]), os.path.join(data_dir, "code.jsonl"))
    old = lmkit.write_rows(sft_conversations("train", size["old_rows"]), os.path.join(data_dir, "old.jsonl"))
    mixtures = {"new only": new, "mixed": f"{new}:{NEW_SHARE},{old}:{1 - NEW_SHARE:.1f}"}
    skills = {"old": lmkit.heldout(size["eval_problems"]), "new": code_problems("test", size["eval_problems"])}

    def graded(model):  # greedy, problem by problem; the calculator offered on the old skill, as the pipeline does
        return {skill: lmkit.per_problem(model, rows, max_new_tokens=size["max_new_tokens"], tools=skill == "old")
                for skill, rows in skills.items()}

    start = graded(sft)
    runs = {name: [] for name in CONFIGS}
    for seed in seeds:
        for name in CONFIGS:
            run = lab.run("chat_sft.py", "--init", sft, "--data", mixtures[name], "--epochs", size["epochs"],
                          "--seed", seed, "--eval-problems", 0,
                          *(["--batch-size", "4", "--device-batch-size", "4"] if args.smoke else []),
                          stage="sft", run_name=f"lab-forgetting-{name.replace(' ', '_')}-s{seed}")
            ev = graded(run)
            losses = [r for r in lab.metrics(run) if "val_loss" in r and "loss" in r]
            runs[name].append({"seed": seed, "run": run, "evals": ev, "step": [r["step"] for r in losses],
                               **{key: [r.get(key) for r in losses] for key in ("val_loss", "val_loss/code",
                                                                                 "val_loss/old")}})
            print(f"[forgetting] {name} seed {seed}: old skill {start['old']['pass@1']:.3f} -> "
                  f"{ev['old']['pass@1']:.3f}, new skill {start['new']['pass@1']:.3f} -> {ev['new']['pass@1']:.3f}",
                  flush=True)

    # the figures the page quotes: each configuration's pass@1 on each skill, seed-averaged problem by problem, its
    # paired change from the start, and mixed minus new only
    def scores(name, skill):
        return lmkit.seed_mean([r["evals"][skill]["score"] for r in runs[name]])
    summary = {"start": {skill: lmkit.mean(start[skill]["score"]) for skill in skills},
               "start_tool_use": start["old"].get("tool_use_rate")}
    for name in CONFIGS:
        summary[name] = {skill: {"end": lmkit.mean(scores(name, skill)),
                                 "change": lmkit.paired(start[skill]["score"], scores(name, skill)),
                                 "end_seeds": lmkit.spread([r["evals"][skill]["pass@1"] for r in runs[name]])}
                         for skill in skills}
        summary[name]["tool_use"] = lmkit.mean([r["evals"]["old"].get("tool_use_rate") for r in runs[name]])
    summary["mixed_minus_new_only"] = {skill: lmkit.paired(scores("new only", skill), scores("mixed", skill))
                                       for skill in skills}

    fig, axes = figure(1, 2, width=5.0, layout="constrained")
    for ax, (skill, title) in zip(axes, (("old", "old skill: arithmetic, held-out pass@1"),
                                         ("new", "new skill: the same as code, held-out pass@1"))):
        names = ["start"] + list(CONFIGS)
        values = [summary["start"][skill]] + [summary[n][skill]["end"] for n in CONFIGS]
        errors = [0.0] + [summary[n][skill]["change"]["se"] or 0.0 for n in CONFIGS]
        ax.bar(names, values, yerr=errors, capsize=4, color=["0.6", "C3", "C0"])
        for i, v in enumerate(values):
            ax.text(i, v + 0.02, f"{v:.3f}", ha="center", fontsize=8)
        ax.set(title=title, ylabel="pass@1 (greedy)", ylim=(0, 1.1))
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"SFT on a new skill from sft/default, alone and mixed {NEW_SHARE:.0%} / {1 - NEW_SHARE:.0%} with "
                 f"the old data; {len(seeds)} seed(s), {size['eval_problems']} held-out problems each, error bars: "
                 "the paired SE of the change from the start", fontsize=9)
    lab.save({"question": "Does SFT on a new skill alone lose the old one, and does keeping 30% of the old data in "
                          "the mixture keep it?", "init": "sft/default", "new_share": NEW_SHARE, "seeds": seeds,
              **size, "mixtures": mixtures, "summary": summary, "start": start, "runs": runs}, fig)


if __name__ == "__main__":
    main()
