"""
Rejection sampling against RL, at equal samples: is RL's gain more than filtering the model's own answers? Expert
iteration (SFT on the model's verified best-of-n answers, round after round: RFT, Yuan et al. 2023, arXiv:2308.01825;
the rejection sampling of Llama 2 and DeepSeek-R1, arXiv:2501.12948) and GRPO (DeepSeekMath, arXiv:2402.03300) both
learn from answers the model samples and a verifier grades; GRPO also learns from the wrong ones. From the same start,
given the same number of sampled answers, which gets further, on pass@1 and on pass@k?

From runs/cpu.sh's SFT run, with the calculator offered as the pipeline's RL runs, SEEDS seeds each:
    rejection   ROUNDS rounds of: chat_sample.py --samples N --keep verified --max-per-prompt 1 on PROMPTS_PER_ROUND
                new training problems from the current model, then chat_sft.py --data on the kept answers from it
                (--epochs 2 --lr 3e-4, runs/r1.sh's rejection-sampling SFT); each round draws PROMPTS_PER_ROUND x N
    grpo        chat_rl.py --no-dynamic-sampling (so that a step draws exactly its prompts x G answers), 16 prompts x
                8 answers a step on 2 ranks, ROUNDS x (PROMPTS_PER_ROUND x N / 128) steps: the same answers drawn
Greedy pass@1 on EVAL_PROBLEMS held-out problems (the same for every run and seed) after every round (chat_rl.py's
--eval-every, with --eval-data, for GRPO), against the answers drawn so far; at the end, pass@1..K at T=1 (K answers to
each problem) of the start and both ends, problem by problem, paired.

    python lab/rejection_vs_rl.py                   # from ./out/cpu (runs/cpu.sh); docs/lab/rejection_vs_rl.*
    python lab/rejection_vs_rl.py --home /tmp/np    # another pipeline's $NANOPOST_HOME
    python lab/rejection_vs_rl.py --smoke           # tiny sizes (tests/test_lab_rejection_vs_rl.py)
"""
import os

import lmkit  # (puts the repository on the path)
from evaluation import pass_at_k
from labkit import Lab, checkpoint, figure, parser
from tasks import rl_prompts

ROUNDS, PROMPTS_PER_ROUND, SAMPLES, RL_PROMPTS, GROUP = 4, 96, 8, 16, 8
EVAL_PROBLEMS, K, MAX_NEW_TOKENS = 100, 8, 192
SMOKE = dict(rounds=2, prompts_per_round=4, samples=4, rl_prompts=4, group=4, eval_problems=6, k=2, max_new_tokens=64)
# the smoke home's tiny model gets no answer right: its rounds keep any finished answer (the plumbing, not the method)
SMOKE_KEEP = ["--threshold", "0"]
SFT_FLAGS = ["--epochs", "2", "--lr", "3e-4", "--warmup-steps", "3", "--eval-problems", "0"]  # runs/r1.sh's RS SFT


def pass_curve(correct, samples):
    """pass@1..samples from per-problem correct counts, averaged over the problems."""
    return [lmkit.mean([pass_at_k(samples, c, k) for c in correct]) for k in range(1, samples + 1)]


def main():
    p = parser("rejection_vs_rl", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("rejection_vs_rl", args)
    sft = checkpoint(args.home, "sft")
    size = SMOKE if args.smoke else dict(rounds=ROUNDS, prompts_per_round=PROMPTS_PER_ROUND, samples=SAMPLES,
                                         rl_prompts=RL_PROMPTS, group=GROUP, eval_problems=EVAL_PROBLEMS, k=K,
                                         max_new_tokens=MAX_NEW_TOKENS)
    tools = [] if args.smoke else ["--tools"]  # the smoke home's tiny vocabulary cannot hold the tools block
    nproc, seeds = 1 if args.smoke else 2, lmkit.seeds(args)
    per_round = size["prompts_per_round"] * size["samples"]  # answers drawn per round
    if per_round % (size["rl_prompts"] * size["group"]):
        raise SystemExit("a round's answers must be a whole number of GRPO steps")
    rl_steps = per_round // (size["rl_prompts"] * size["group"])  # GRPO steps per round
    rows = lmkit.heldout(size["eval_problems"])
    data = os.path.join(args.home, "data")
    heldout_file = lmkit.write_rows(rows, os.path.join(data, "lab-rejection_vs_rl-heldout.jsonl"))
    greedy = dict(max_new_tokens=size["max_new_tokens"], tools=bool(tools))
    drawn = [per_round * r for r in range(size["rounds"] + 1)]  # answers drawn at each evaluation

    start = lmkit.per_problem(sft, rows, **greedy)
    runs = {"rejection": [], "grpo": []}
    for seed in seeds:
        # rejection sampling: each round new problems, sampled from the model the last round trained
        model, curve, kept = sft, [start["score"]], []
        problems = rl_prompts("train", size["rounds"] * size["prompts_per_round"], seed=100 + seed)
        for r in range(size["rounds"]):
            prompts = lmkit.write_rows(problems[r * size["prompts_per_round"]:(r + 1) * size["prompts_per_round"]],
                                       os.path.join(data, f"lab-rejection_vs_rl-s{seed}-r{r}-prompts.jsonl"))
            out = os.path.join(data, f"lab-rejection_vs_rl-s{seed}-r{r}-kept.jsonl")
            lab.command("chat_sample.py", "--init", model, "--data", prompts, "--samples", size["samples"], "--keep",
                        "verified", "--max-per-prompt", 1, "--max-new-tokens", size["max_new_tokens"], "--seed",
                        seed * 100 + r, "--out", out, *tools,
                        *(SMOKE_KEEP if args.smoke else []), nproc=nproc)
            with open(out) as f:
                kept.append(sum(1 for line in f if line.strip()))
            if kept[-1] < 2:
                raise SystemExit(f"[rejection_vs_rl] round {r} kept {kept[-1]} verified answer(s): too few to train on")
            # one conversation a row, up to 16 a step (the SFT stage's batch), fewer when a round kept fewer
            batch = min(16, kept[-1] - max(1, kept[-1] // 50))
            model = lab.run("chat_sft.py", "--init", model, "--data", out, "--seed", seed, *SFT_FLAGS, "--packing",
                            "none", "--batch-size", batch, "--device-batch-size", batch, stage="sft",
                            run_name=f"lab-rejection_vs_rl-s{seed}-r{r}")
            curve.append(lmkit.per_problem(model, rows, **greedy)["score"])
        runs["rejection"].append({"seed": seed, "kept": kept, "pass@1": [lmkit.mean(c) for c in curve],
                                  "end": model, "per_problem_end": curve[-1]})
        # GRPO: the same answers drawn, as steps of prompts x G, evaluated after each round's worth of steps
        run = lab.run("chat_rl.py", "--init", sft, "--seed", seed, "--no-dynamic-sampling", "--prompts-per-step",
                      size["rl_prompts"], "--group-size", size["group"], "--steps", size["rounds"] * rl_steps,
                      "--eval-data", heldout_file, "--eval-problems", size["eval_problems"], "--eval-every", rl_steps,
                      "--pass-k", 0, "--max-new-tokens", size["max_new_tokens"], "--save-every", 100000, *tools,
                      stage="rl", run_name=f"lab-rejection_vs_rl-grpo-s{seed}", nproc=nproc)
        evals = [r for r in lab.metrics(run) if "eval/pass@1" in r]
        runs["grpo"].append({"seed": seed, "pass@1": [r["eval/pass@1"] for r in evals],
                             "eval_step": [r["step"] for r in evals], "end": run,
                             "answers_drawn": [r["step"] * size["rl_prompts"] * size["group"] for r in evals]})
        print(f"[rejection_vs_rl] seed {seed}: greedy pass@1 rejection {runs['rejection'][-1]['pass@1']}, grpo "
              f"{runs['grpo'][-1]['pass@1']}", flush=True)

    # at the end: pass@1..K at T=1 of the start and of every run's end, problem by problem, the same samples' seeds
    sampled = dict(samples=size["k"], temperature=1.0, seed=7, **greedy)
    at_k = {"start": lmkit.per_problem(sft, rows, **sampled)}
    for name in runs:
        for run in runs[name]:
            run["sampled"] = lmkit.per_problem(run["end"], rows, **sampled)
            run["pass@k"] = pass_curve(run["sampled"]["correct"], size["k"])
            run["per_problem_greedy"] = lmkit.per_problem(run["end"], rows, **greedy)["score"]
    at_k["start"]["pass@k"] = pass_curve(at_k["start"]["correct"], size["k"])

    def problems(name, key):  # per problem, seed-averaged: pass@1 (greedy) or pass@K at T=1
        if key == "greedy":
            return lmkit.seed_mean([r["per_problem_greedy"] for r in runs[name]])
        k = 1 if key == "pass@1_t1" else size["k"]
        return lmkit.seed_mean([[pass_at_k(size["k"], c, k) for c in r["sampled"]["correct"]] for r in runs[name]])
    start_of = {"greedy": start["score"], "pass@1_t1": [pass_at_k(size["k"], c, 1) for c in at_k["start"]["correct"]],
                f"pass@{size['k']}_t1": [pass_at_k(size["k"], c, size["k"]) for c in at_k["start"]["correct"]]}
    per_seed = {"greedy": lambda r: lmkit.mean(r["per_problem_greedy"]), "pass@1_t1": lambda r: r["pass@k"][0],
                f"pass@{size['k']}_t1": lambda r: r["pass@k"][-1]}
    summary = {key: {"start": lmkit.mean(start_of[key]),  # each end over seeds (mean, min, max), and paired changes
                     **{name: lmkit.spread([per_seed[key](r) for r in runs[name]]) for name in runs},
                     "grpo_minus_rejection": lmkit.paired(problems("rejection", key), problems("grpo", key)),
                     "rejection_minus_start": lmkit.paired(start_of[key], problems("rejection", key)),
                     "grpo_minus_start": lmkit.paired(start_of[key], problems("grpo", key))}
               for key in start_of}

    fig, (ax_curve, ax_k) = figure(1, 2, layout="constrained")
    lmkit.draw_band(ax_curve, drawn, [r["pass@1"] for r in runs["rejection"]], color="C0", marker="o",
                    label="rejection sampling + SFT, round by round")
    lmkit.draw_band(ax_curve, runs["grpo"][0]["answers_drawn"], [r["pass@1"] for r in runs["grpo"]], color="C3",
                    marker="s", label="GRPO")
    ax_curve.set(title=f"held-out greedy pass@1 ({size['eval_problems']} problems)", xlabel="answers sampled for "
                 "training", ylabel="pass@1")
    ks = list(range(1, size["k"] + 1))
    ax_k.plot(ks, at_k["start"]["pass@k"], "k:", label="SFT (the start)")
    for name, color in (("rejection", "C0"), ("grpo", "C3")):
        lmkit.draw_band(ax_k, ks, [r["pass@k"] for r in runs[name]], color=color, label=f"{name}, at the end")
    ax_k.set_xscale("log", base=2)
    ax_k.set(title=f"pass@k at T=1 at the end, {size['k']} answers a problem", xlabel="k", ylabel="pass@k")
    for ax in (ax_curve, ax_k):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for group in runs.values():  # the JSON names the ends relative to the home (labkit.relative), not as objects
        for r in group:
            r["sampled"] = {k: v for k, v in r["sampled"].items() if k in ("correct", "pass@1", "mean_length")}
    lab.save({"question": "From the same SFT start and the same number of sampled answers, does GRPO beat SFT on the "
                          "model's own verified answers (rejection sampling, round by round), on pass@1 and on pass@k?",
              "init": "sft/default", "tools": bool(tools), "seeds": seeds, **size, "answers_per_round": per_round,
              "grpo_steps_per_round": rl_steps, "answers_drawn": drawn, "ranks": nproc,
              "start": {"greedy": start["pass@1"], "pass@k": at_k["start"]["pass@k"],
                        "correct": at_k["start"]["correct"]},
              "summary": summary, "runs": runs}, fig)


if __name__ == "__main__":
    main()
