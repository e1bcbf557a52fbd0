"""
The seed's grid of methods, runnable. The second seed explains every post-training method by two questions: who
grades an answer (people's taste written down as a reward model; an AI with a rulebook, a judge; an answer key, a
verifier), and what the grade is compared with (a forecaster, PPO's critic; the group's average, GRPO; nothing, when
the answers come in pairs, DPO). Nine cells, one nanopost command each, all from the same SFT start (sft/default,
with the calculator offered):

                 PPO (a forecaster)            GRPO (the group's average)     DPO (pairs: nothing needed)
    reward model chat_ppo --reward rm:RM       chat_rl --reward rm:RM         chat_sample --reward rm:RM, chat_dpo
    judge        chat_ppo --reward judge:J     chat_rl --reward judge:J       chat_sample --pairs-judge J, chat_dpo
    verifier     chat_ppo                      chat_rl                        chat_sample, chat_dpo

RM is the pipeline's reward model (rm/default: the world's preference pairs). The judge J is a program standing in
for a judge model (standin_judge.py, rubrics/arithmetic.txt: each step's arithmetic and the answer line following,
no answer key), as no model here can follow a rubric; a real one takes its place by its path. PPO and GRPO log the
verifier beside their reward at weight 0 (`+0*verifier`); DPO's pairs are each prompt's best and worst of SAMPLES
answers by the row's grader (the judge: its first two different answers, asked in both orders). Every cell ends
graded the same way, by the verifier as the gold: greedy pass@1 on EVAL_PROBLEMS held-out problems, paired problem
by problem with the SFT start; and its seconds on 2 cores.

    python lab/grid.py                  # from ./out/cpu (runs/cpu.sh); writes docs/lab/grid.{json,png}
    python lab/grid.py --home /tmp/np   # another pipeline's $NANOPOST_HOME
    python lab/grid.py --smoke          # every cell at tiny sizes (tests/test_lab_grid.py)
"""
import os

import lmkit  # (puts the repository on the path)
from labkit import REPO, Lab, checkpoint, figure, parser

GRADERS = ("reward model", "judge", "verifier")
METHODS = ("PPO", "GRPO", "DPO")
RUBRIC = os.path.join(REPO, "rubrics", "arithmetic.txt")
JUDGE = "standin:arithmetic"
PPO_STEPS, RL_STEPS, SAMPLE_PROMPTS, SAMPLES, EVAL_PROBLEMS, MAX_NEW_TOKENS = 24, 6, 800, 4, 200, 192
SMOKE = dict(ppo_steps=1, rl_steps=1, sample_prompts=4, eval_problems=4, max_new_tokens=16)
SMOKE_FLAGS = ["--prompts-per-step", "2", "--max-new-tokens", "16", "--num-prompts", "8"]


def main():
    p = parser("grid", __doc__.strip().split("\n\n")[0])
    args = p.parse_args()
    lab = Lab("grid", args)
    sft, rm = checkpoint(args.home, "sft"), checkpoint(args.home, "rm")
    size = SMOKE if args.smoke else dict(ppo_steps=PPO_STEPS, rl_steps=RL_STEPS, sample_prompts=SAMPLE_PROMPTS,
                                         eval_problems=EVAL_PROBLEMS, max_new_tokens=MAX_NEW_TOKENS)
    nproc = 1 if args.smoke else 2
    small = SMOKE_FLAGS if args.smoke else []
    tools = [] if args.smoke else ["--tools"]  # (the smoke home's 400-token vocabulary has no room for the tool prompt)
    rewards = {"reward model": f"rm:{rm}+0*verifier", "judge": f"judge:{JUDGE}+0*verifier", "verifier": "verifier"}
    rubric = {"judge": ["--rubric", RUBRIC]}
    rows = lmkit.heldout(size["eval_problems"])

    def graded(model):  # the gold: the verifier, greedy, problem by problem, the calculator offered
        return lmkit.per_problem(model, rows, max_new_tokens=size["max_new_tokens"], tools=bool(tools))

    start = graded(sft)
    cells = {}
    for grader in GRADERS:
        for method in METHODS:
            name = f"lab-grid-{grader.replace(' ', '_')}-{method.lower()}"
            seconds = sum(c["seconds"] for c in lab.commands)
            start_flags = ["--init", sft, *tools, "--eval-problems", 0, "--save-every", 1000]
            pairs_kept = None
            if method == "PPO":
                run = lab.run("chat_ppo.py", *start_flags, "--reward", rewards[grader], *rubric.get(grader, []),
                              "--steps", size["ppo_steps"], *small, stage="ppo", run_name=name, nproc=nproc)
            elif method == "GRPO":
                run = lab.run("chat_rl.py", *start_flags, "--reward", rewards[grader], *rubric.get(grader, []),
                              "--steps", size["rl_steps"], *small, stage="rl", run_name=name, nproc=nproc)
            else:  # pairs sampled from the start and labelled by the row's grader, then DPO on them
                pairs = os.path.join(args.home, "data", f"{name}.jsonl")
                label = (["--pairs-judge", JUDGE, "--rubric", RUBRIC] if grader == "judge" else
                         ["--reward", rewards[grader].split("+")[0]])
                lab.command("chat_sample.py", "--init", sft, *tools, "--num-prompts", size["sample_prompts"],
                            "--samples", SAMPLES, "--pairs-out", pairs, *label,
                            *(["--max-new-tokens", "16"] if args.smoke else []), nproc=nproc)
                with open(pairs) as f:
                    pairs_kept = sum(1 for line in f if line.strip())
                # a grader that tells no two answers apart gives DPO nothing to learn: the start stands for the cell
                run = lab.run("chat_dpo.py", "--init", sft, "--data", pairs, *tools, "--eval-problems", 0,
                              "--save-every", 1000, *(["--batch-size", "2"] if args.smoke else []), stage="dpo",
                              run_name=name) if pairs_kept else sft
            ev = graded(run)
            trained = [r for r in lab.metrics(run) if "reward" in r]  # PPO's and GRPO's training batches
            cells[f"{grader} x {method}"] = {
                "grader": grader, "method": method, "run": run, "pass@1": ev["pass@1"], "pairs": pairs_kept,
                "tool_use_rate": ev.get("tool_use_rate"), "score": ev["score"],
                "change": lmkit.paired(start["score"], ev["score"]),
                "seconds": round(sum(c["seconds"] for c in lab.commands) - seconds, 1),
                **({"reward_first": trained[0]["reward"], "reward_last": trained[-1]["reward"],
                    "gold_first": trained[0].get("reward/verifier"), "gold_last": trained[-1].get("reward/verifier")}
                   if trained else {})}
            c = cells[f"{grader} x {method}"]
            print(f"[grid] {grader} x {method}: pass@1 {start['pass@1']:.3f} -> {c['pass@1']:.3f} "
                  f"({c['change']['diff']:+.3f} +- {c['change']['se']:.3f}), {c['seconds']:.0f} s", flush=True)

    fig, (ax,) = figure(1, 1, width=6.0, height=4.0)
    width = 0.26
    for i, grader in enumerate(GRADERS):
        changes = [cells[f"{grader} x {m}"]["change"] for m in METHODS]
        ax.bar([j + (i - 1) * width for j in range(len(METHODS))], [c["diff"] for c in changes], width,
               yerr=[c["se"] or 0.0 for c in changes], capsize=3, label=f"graded by the {grader}", color=f"C{i}")
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xticks(range(len(METHODS)), [f"{m}\n({w})" for m, w in zip(METHODS, ("a forecaster", "the group's average",
                                                                              "pairs: nothing"))])
    ax.set(ylabel="held-out pass@1 (verifier), change from SFT",
           title=f"The seed's grid from sft/default: {size['eval_problems']} held-out problems, greedy, paired SE")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    lab.save({"question": "Who grades and what the grade is compared with, nine cells from one SFT start: what does "
                          "each gain on the verifier's held-out pass@1?", "init": "sft/default", "rm": "rm/default",
              "judge": JUDGE, "rubric": "rubrics/arithmetic.txt", "tools": bool(tools), "ranks": nproc, **size,
              "samples": SAMPLES, "start": {"pass@1": start["pass@1"], "tool_use_rate": start.get("tool_use_rate"),
                                           "score": start["score"]}, "cells": cells}, fig)


if __name__ == "__main__":
    main()
