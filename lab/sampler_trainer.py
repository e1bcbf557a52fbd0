"""
The sampler is not the trainer. At scale the rollouts come from an inference engine (vLLM, SGLang) whose sampling
distribution is not the trainer's: other kernels and precision, and often other sampling settings (a temperature or a
top-p the trainer does not apply when it scores the same tokens). The importance ratio p_trainer / p_sampler that
PPO-style losses assume is 1 is not, and a late collapse of RL runs has been traced to that gap (OpenRLHF#1120,
allenai/open-instruct#1473). The fixes weight or drop each token by it (rollout.sampler_correction): token-tis,
min(p_trainer / p_sampler, 2) per token (truncated importance sampling, verl#2953), the default; token-mask, drop a
token whose probabilities differ by more than 0.1 (prime-rl); none. Does the mismatch hurt, and does a correction win
it back?

nanopost's engine samples in the trainer's numerics (float32 on CPU: the two agree to ~1e-7 nats), so the mismatch is
made on purpose, as a knob of known size: chat_rl.py --sampler-temperature T samples at T while the trainer scores at
--temperature 1.0 (SIZES: 1.1 and 1.3), and, for scale, a bfloat16 engine (--engine-dtype bfloat16: ~2e-3 nats a
token, which changed nothing in 30 steps, docs/lab/sampler_trainer.md).

Part 1, one batch in this process: ONE_BATCH_PROMPTS prompts x 8 answers from the SFT weights by each sampler (float32
at 1.0, bfloat16 at 1.0, float32 at each size), each answer's tokens scored by the float32 trainer at 1.0
(rollout.batch_logprobs): the distribution of |log p_trainer - log p_sampler| per token, the weights token-tis gives
them and the share token-mask drops.
Part 2, chat_rl.py from runs/cpu.sh's SFT run, SEEDS seeds each, the calculator offered as the pipeline's RL runs,
16 prompts x 8 answers a step on 2 ranks, STEPS steps: on-policy (token-tis, the default), and at each size of the
knob each correction (none, token-tis, token-mask). Logged each step: logprob_mismatch, correction_mean, masked_frac,
accuracy. At the end, greedy pass@1 on EVAL_PROBLEMS held-out problems (the same for every run), problem by problem,
each run paired with the on-policy run of its seed.

    python lab/sampler_trainer.py              # ~45 min on 2 cores; docs/lab/sampler_trainer.{json,png}
    python lab/sampler_trainer.py --home /tmp/np
    python lab/staleness.py                    # the second half of docs/lab/sampler_trainer.md: samplers k steps old
"""
import os
import time

import torch

import lmkit  # (puts the repository on the path)
from checkpoint import load_hf, resolve_model_path
from engine import Engine
from labkit import Lab, checkpoint, figure, parser
from rewards import Grader
from rollout import ENGINE_DTYPES, batch_logprobs, sample, sampler_correction, training_batch
from tasks import CALCULATOR_SCHEMA, TOOLS, rl_prompts
from tokenizer import Tokenizer

os.environ["NANOPOST_CPU_AUTOCAST"] = "float32"  # the float32 trainer, here and in the chat_rl.py runs it starts

SIZES = (1.1, 1.3)  # --sampler-temperature against the trainer's 1.0
CORRECTIONS = ("none", "token-tis", "token-mask")
CONFIGS = {"on-policy": ["--correction", "token-tis"],
           **{f"T{t:g}-{c.removeprefix('token-')}": ["--sampler-temperature", t, "--correction", c]
              for t in SIZES for c in CORRECTIONS}}
SAMPLERS = {"float32, T=1.0": ("float32", 1.0), "bfloat16, T=1.0": ("bfloat16", 1.0),
            **{f"float32, T={t:g}": ("float32", t) for t in SIZES}}
STEPS, PROMPTS, EVAL_PROBLEMS, ONE_BATCH_PROMPTS, MAX_NEW_TOKENS = 20, 16, 100, 32, 192
SMOKE = dict(steps=2, prompts=4, group=4, eval_problems=4, one_batch_prompts=4, max_new_tokens=24)
GAP_BINS = [10.0 ** e for e in range(-9, 2)]  # |log p_trainer - log p_sampler| histogram edges, 1e-9 .. 10 nats


def histogram(values: torch.Tensor, edges: list) -> list:
    """Counts of values in [edges[i], edges[i+1]), with everything below the first edge in the first bin and above
    the last in the last: len(edges) - 1 counts that sum to len(values)."""
    inner = torch.tensor(edges[1:-1], dtype=values.dtype)
    return torch.bincount(torch.bucketize(values, inner, right=True), minlength=len(edges) - 1).tolist()


@torch.no_grad()
def one_batch(sft, *, prompts, max_new_tokens, tools):
    """Part 1: the same prompts sampled by each sampler over the SFT weights, scored by the float32 trainer at 1.0; per
    sampler the gap's statistics and histogram, token-tis's weights and token-mask's drops."""
    path = resolve_model_path(sft)
    model, tok = load_hf(path), Tokenizer.load(path)
    rows, grader = rl_prompts("train", prompts, seed=1), Grader("verifier", tok)
    out = {}
    for name, (dtype, temperature) in SAMPLERS.items():
        engine = Engine(model, tok, tools=TOOLS if tools else None, dtype=ENGINE_DTYPES[dtype])
        rollouts = sample(engine, rows, grader, samples_per_prompt=8, max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=0, tool_schemas=[CALCULATOR_SCHEMA] if tools else None)
        batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, "cpu")
        trainer = batch_logprobs(model, batch, 8192)
        sampled = batch.mask > 0
        gap = (trainer - batch.engine_logp)[sampled].abs()
        tis = sampler_correction(trainer, batch.engine_logp, batch.mask, "token-tis")[sampled]
        mask = sampler_correction(trainer, batch.engine_logp, batch.mask, "token-mask")[sampled]
        out[name] = {"tokens": int(sampled.sum()), "accuracy": float((rollouts.rewards >= 1).float().mean()),
                     "gap_mean": gap.mean().item(), "gap_median": gap.median().item(),
                     "gap_p99": gap.quantile(0.99).item(), "gap_max": gap.max().item(),
                     "gap_histogram": histogram(gap.clamp(min=1e-12), GAP_BINS), "tis_mean": tis.mean().item(),
                     "tis_min": tis.min().item(), "tis_capped_frac": (tis >= 2.0).float().mean().item(),
                     "tis_below_0.9_frac": (tis < 0.9).float().mean().item(),
                     "mask_dropped_frac": (mask == 0).float().mean().item()}
        o = out[name]
        print(f"[sampler_trainer] {name}: |gap| mean {o['gap_mean']:.2e} nats over {o['tokens']} tokens; token-tis "
              f"mean {o['tis_mean']:.4f}; token-mask drops {o['mask_dropped_frac']:.4f}", flush=True)
    return out


def main():
    p = parser("sampler_trainer", __doc__.strip().split("\n\n")[0])
    lmkit.add_seed_flag(p)
    args = p.parse_args()
    lab = Lab("sampler_trainer", args)
    sft = checkpoint(args.home, "sft")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = SMOKE if args.smoke else dict(steps=STEPS, prompts=PROMPTS, group=8, eval_problems=EVAL_PROBLEMS,
                                         one_batch_prompts=ONE_BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    tools = [] if args.smoke else ["--tools"]  # the smoke home's tiny vocabulary cannot hold the tools block
    nproc, seeds = 1 if args.smoke else 2, lmkit.seeds(args)

    t = time.time()
    batch = one_batch(sft, prompts=size["one_batch_prompts"], max_new_tokens=size["max_new_tokens"], tools=bool(tools))
    lab.commands.append({"command": "one_batch (in lab/sampler_trainer.py)", "seconds": round(time.time() - t, 1)})

    rows = lmkit.heldout(size["eval_problems"])
    runs = {name: [] for name in CONFIGS}
    for seed in seeds:
        for name, flags in CONFIGS.items():
            run = lab.run("chat_rl.py", "--init", sft, "--seed", seed, *flags, *tools, "--steps", size["steps"],
                          "--prompts-per-step", size["prompts"], "--group-size", size["group"], "--max-new-tokens",
                          size["max_new_tokens"], "--eval-problems", 0, "--save-every", 100000, stage="rl",
                          run_name=f"lab-sampler_trainer-{name}-s{seed}", nproc=nproc)
            steps = [r for r in lab.metrics(run) if "logprob_mismatch" in r]
            ev = lmkit.per_problem(run, rows, max_new_tokens=size["max_new_tokens"], tools=bool(tools))
            runs[name].append({"seed": seed, "step": [r["step"] for r in steps],
                               **{k: [r[k] for r in steps] for k in ("logprob_mismatch", "correction_mean",
                                                                     "masked_frac", "accuracy", "clip_frac")},
                               "pass@1": ev["pass@1"], "per_problem": ev["score"],
                               "seconds": lab.commands[-1]["seconds"]})
            r = runs[name][-1]
            print(f"[sampler_trainer] {name} seed {seed}: mismatch {lmkit.mean(r['logprob_mismatch']):.2e}, "
                  f"held-out pass@1 {r['pass@1']:.3f}", flush=True)
    start = lmkit.per_problem(sft, rows, max_new_tokens=size["max_new_tokens"], tools=bool(tools))

    tail = max(1, size["steps"] // 4)  # the last quarter of the steps
    reference = lmkit.seed_mean([r["per_problem"] for r in runs["on-policy"]])
    summary = {name: {"pass@1": lmkit.spread([r["pass@1"] for r in rs]),
                      "minus_on_policy": lmkit.paired(reference, lmkit.seed_mean([r["per_problem"] for r in rs])),
                      "mismatch": lmkit.spread([lmkit.mean(r["logprob_mismatch"]) for r in rs]),
                      "correction_mean": lmkit.spread([lmkit.mean(r["correction_mean"]) for r in rs]),
                      "masked_frac": lmkit.spread([lmkit.mean(r["masked_frac"]) for r in rs]),
                      "accuracy_last": lmkit.spread([lmkit.mean(r["accuracy"][-tail:]) for r in rs])}
               for name, rs in runs.items()}
    summary["start_pass@1"] = start["pass@1"]

    fig, axes = figure(2, 2, layout="constrained")
    for i, name in enumerate(SAMPLERS):
        axes[0].stairs(batch[name]["gap_histogram"], GAP_BINS, color=f"C{i}", label=name)
    axes[0].set_xscale("log")
    axes[0].set(title="one batch: |log p_trainer(T=1) - log p_sampler| per token", xlabel="nats (below 1e-9: the first "
                "bin)", ylabel="tokens")
    styles = {"none": ":", "tis": "-", "mask": "--"}
    for name in CONFIGS:
        color = "k" if name == "on-policy" else f"C{SIZES.index(float(name[1:4])) + 1}"
        style = "-" if name == "on-policy" else styles[name.split("-", 1)[1]]
        x = runs[name][0]["step"]
        lmkit.draw_band(axes[1], x, [r["logprob_mismatch"] for r in runs[name]], color=color, linestyle=style,
                        label=name)
        lmkit.draw_band(axes[2], x, [r["accuracy"] for r in runs[name]], color=color, linestyle=style, label=name)
    axes[1].set_yscale("log")
    axes[1].set(title="RL: logprob_mismatch", xlabel="RL step", ylabel="nats per token (mean)")
    axes[2].set(title="RL: accuracy of each step's answers", xlabel="RL step", ylabel="share right")
    names = list(CONFIGS)
    means = [summary[n]["pass@1"]["mean"] for n in names]
    axes[3].bar(range(len(names)), means, color=["k"] + [f"C{SIZES.index(float(n[1:4])) + 1}" for n in names[1:]],
                alpha=0.5)
    for i, n in enumerate(names):
        axes[3].plot([i] * len(runs[n]), [r["pass@1"] for r in runs[n]], "k.", markersize=4)
    axes[3].axhline(start["pass@1"], color="k", lw=0.5, linestyle=":")
    axes[3].set_xticks(range(len(names)), names, rotation=30, fontsize=7)
    axes[3].set(title="held-out greedy pass@1 at the end (dots: seeds; dotted: SFT)", ylabel="pass@1")
    for ax in axes[:3]:
        ax.legend(fontsize=6)
    for ax in axes:
        ax.grid(alpha=0.3)
    lab.save({"question": "With the sampler at another temperature than the trainer, does RL learn less, and does "
                          "token-tis or token-mask win it back?", "init": "sft/default", "tools": bool(tools),
              "seeds": seeds, **size, "ranks": nproc, "sizes": list(SIZES), "one_batch": batch, "gap_bins": GAP_BINS,
              "summary": summary, "runs": runs}, fig)


if __name__ == "__main__":
    main()
