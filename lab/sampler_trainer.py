"""
The sampler is not the trainer: a bfloat16 engine samples the answers that a float32 trainer learns from.

At scale the rollouts come from an inference engine (vLLM, SGLang) in bfloat16 with its own kernels, and the
trainer recomputes the log-probs of the same tokens in its own numerics: the two disagree, and the importance ratio
p_trainer / p_engine that PPO-style losses assume is 1 is not (OpenRLHF#1120, allenai/open-instruct#1473: a late
collapse traced to that gap). The fixes weight or drop the tokens by that ratio (rollout.sampler_correction):
token-tis, min(p_trainer / p_engine, 2) per token (truncated importance sampling, verl#2953), the default; token-mask,
drop a token whose probabilities differ by more than 0.1 (prime-rl); none. nanopost's own engine samples in the
trainer's numerics (float32 on CPU: the two agree to ~1e-7 nats), so this experiment makes the gap on purpose with
chat_rl.py --engine-dtype bfloat16: the engine's weights and KV cache in bfloat16, its head in float32. (On a CPU
with bfloat16 units the stages' trainer autocasts to bfloat16, common.train_dtype: this experiment pins it to
float32, so that the gap it measures is the sampler's alone.)

Part 1, one batch in this process: SFT_PROMPTS prompts x 8 answers sampled by a float32 and by a bfloat16 engine
over the same SFT weights, each answer's tokens then scored by the float32 trainer (rollout.batch_logprobs); the
distribution of |log p_trainer - log p_engine| per token, the weights token-tis and token-mask give them, and the
seconds each engine took (this CPU's bfloat16 arithmetic against its float32).
Part 2, four runs of chat_rl.py from runs/cpu.sh's SFT checkpoint (sft/default), the same seed, prompts and steps,
on 2 ranks with the calculator offered as the pipeline's RL runs, but 16 prompts x 8 answers a step (the pipeline:
64): a float32 engine with token-tis (the default), and a bfloat16 engine with --correction none, token-tis and
token-mask. Logged each step: logprob_mismatch (the mean of that gap), correction_mean, masked_frac, accuracy and
the engine's tokens a second; greedy held-out pass@1 at the start and the end.

    python lab/sampler_trainer.py              # ~15 min on 2 cores; docs/lab/sampler_trainer.{json,png}
    python lab/sampler_trainer.py --home /tmp/np
    python lab/staleness.py                    # the second half of docs/lab/sampler_trainer.md: samplers k steps old
"""
import os
import sys
import time

import torch

from labkit import REPO, RL_SMOKE, Lab, checkpoint, figure, moving_average, parser

sys.path.insert(0, REPO)
from checkpoint import load_hf, resolve_model_path  # noqa: E402
from engine import Engine  # noqa: E402
from rewards import Grader  # noqa: E402
from rollout import ENGINE_DTYPES, batch_logprobs, sample, sampler_correction, training_batch  # noqa: E402
from tasks import CALCULATOR_SCHEMA, TOOLS, rl_prompts  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

os.environ["NANOPOST_CPU_AUTOCAST"] = "float32"  # the float32 trainer, here and in the chat_rl.py runs it starts

CONFIGS = {  # run name -> chat_rl.py flags
    "float32-tis": ["--engine-dtype", "float32", "--correction", "token-tis"],
    "bfloat16-none": ["--engine-dtype", "bfloat16", "--correction", "none"],
    "bfloat16-tis": ["--engine-dtype", "bfloat16", "--correction", "token-tis"],
    "bfloat16-mask": ["--engine-dtype", "bfloat16", "--correction", "token-mask"],
}
STEPS, PROMPTS, EVAL_PROBLEMS, SFT_PROMPTS = 30, 16, 200, 32
GAP_BINS = [10.0 ** e for e in range(-9, 2)]  # |log p_trainer - log p_engine| histogram edges, 1e-9 .. 10 nats
WEIGHT_BINS = [0.5, 0.9, 0.99, 0.999, 1.001, 1.01, 1.1, 1.999, 2.0]  # token-tis weights: around 1, and the cap 2


def histogram(values: torch.Tensor, edges: list) -> list:
    """Counts of values in [edges[i], edges[i+1]), with everything below the first edge in the first bin and above
    the last in the last: len(edges) - 1 counts that sum to len(values)."""
    inner = torch.tensor(edges[1:-1], dtype=values.dtype)
    return torch.bincount(torch.bucketize(values, inner, right=True), minlength=len(edges) - 1).tolist()


def one_batch(sft, *, prompts, group, max_new_tokens, tools):
    """Part 1: the same prompts sampled by a float32 and a bfloat16 engine over the SFT weights, scored by the float32
    trainer; per engine, the gap's statistics and histogram, the correction weights, and the sampling seconds."""
    path = resolve_model_path(sft)
    model, tok = load_hf(path), Tokenizer.load(path)
    rows, grader = rl_prompts("train", prompts, seed=1), Grader("verifier", tok)
    sampling = dict(samples_per_prompt=group, max_new_tokens=max_new_tokens, temperature=1.0, seed=0,
                    tool_schemas=[CALCULATOR_SCHEMA] if tools else None)
    out = {}
    for name in ("float32", "bfloat16"):
        engine = Engine(model, tok, tools=TOOLS if tools else None, dtype=ENGINE_DTYPES[name])
        seconds = []
        for _ in range(2):  # the same answers twice (one seed): the faster of two, the first warms the caches up
            t = time.time()
            rollouts = sample(engine, rows, grader, **sampling)
            seconds.append(time.time() - t)
        batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, "cpu")
        trainer_logp = batch_logprobs(model, batch, 8192)
        sampled = batch.mask > 0
        gap = (trainer_logp - batch.engine_logp)[sampled].abs()
        prob_gap = (trainer_logp.exp() - batch.engine_logp.exp())[sampled].abs()
        tis = sampler_correction(trainer_logp, batch.engine_logp, batch.mask, "token-tis")[sampled]
        mask = sampler_correction(trainer_logp, batch.engine_logp, batch.mask, "token-mask")[sampled]
        tokens = sum(len(c.tokens) for c in rollouts.completions)
        out[name] = {
            "tokens": int(sampled.sum()), "answers": len(rollouts), "accuracy": float((rollouts.rewards >= 1).float().mean()),
            "sample_seconds": round(min(seconds), 3), "sample_tok_per_s": round(tokens / min(seconds), 1),
            "gap_mean": gap.mean().item(), "gap_median": gap.median().item(),
            "gap_p99": gap.quantile(0.99).item(), "gap_max": gap.max().item(),
            "prob_gap_max": prob_gap.max().item(),
            "gap_histogram": {"edges": GAP_BINS, "counts": histogram(gap.clamp(min=1e-12), GAP_BINS)},
            "tis_mean": tis.mean().item(), "tis_min": tis.min().item(), "tis_max": tis.max().item(),
            "tis_capped_frac": (tis >= 2.0).float().mean().item(),
            "tis_histogram": {"edges": WEIGHT_BINS, "counts": histogram(tis, WEIGHT_BINS)},
            "mask_dropped_frac": (mask == 0).float().mean().item(),
        }
        o = out[name]
        print(f"[sampler_trainer] {name} engine: {o['tokens']} sampled tokens in {o['sample_seconds']:.1f} s; "
              f"|gap| mean {o['gap_mean']:.2e}, median {o['gap_median']:.2e}, max {o['gap_max']:.2e} nats; token-tis "
              f"weights {o['tis_min']:.4f} .. {o['tis_max']:.4f}; token-mask drops {o['mask_dropped_frac']:.4f}", flush=True)
    return out


def main():
    args = parser("sampler_trainer", __doc__.strip().split("\n\n")[0]).parse_args()
    lab = Lab("sampler_trainer", args)
    sft = checkpoint(args.home, "sft")
    if args.threads:
        torch.set_num_threads(args.threads)

    # part 1: one batch, both engines, the gap token by token
    t = time.time()
    batch = one_batch(sft, prompts=4 if args.smoke else SFT_PROMPTS, group=4 if args.smoke else 8,
                      max_new_tokens=24 if args.smoke else 192, tools=not args.smoke)
    lab.commands.append({"command": "one_batch (in lab/sampler_trainer.py)", "seconds": round(time.time() - t, 1)})

    # part 2: RL with a bfloat16 engine, each correction, against a float32 engine
    common = ["--init", sft, "--seed", "0", "--pass-k", "0", "--save-every", "100000"]
    if args.smoke:
        common += RL_SMOKE + ["--eval-every", "2"]
    else:
        common += ["--tools", "--steps", STEPS, "--prompts-per-step", PROMPTS, "--eval-problems", EVAL_PROBLEMS,
                   "--eval-every", STEPS]
    runs = {}
    for name, flags in CONFIGS.items():
        path = lab.run("chat_rl.py", *common, *flags, stage="rl", run_name=f"lab-sampler_trainer-{name}",
                       nproc=1 if args.smoke else 2)
        rows = lab.metrics(path)
        steps = [r for r in rows if "logprob_mismatch" in r]
        evals = [r for r in rows if "eval/pass@1" in r]
        runs[name] = {
            "flags": flags,
            "step": [r["step"] for r in steps],
            **{key: [r[key] for r in steps] for key in ("logprob_mismatch", "correction_mean", "masked_frac", "accuracy",
                                                        "reward", "sample_tok_per_s", "train_tok_per_s")},
            "heldout_pass@1": {"start": evals[0]["eval/pass@1"], "end": evals[-1]["eval/pass@1"]},
            "seconds": lab.commands[-1]["seconds"],
        }
        r = runs[name]
        print(f"[sampler_trainer] {name}: mismatch {r['logprob_mismatch'][0]:.2e} -> {r['logprob_mismatch'][-1]:.2e}; "
              f"held-out pass@1 {r['heldout_pass@1']['start']:.3f} -> {r['heldout_pass@1']['end']:.3f}", flush=True)

    fig, axes = figure(2, 2, layout="constrained")
    for i, (name, b) in enumerate(batch.items()):
        axes[0].stairs(b["gap_histogram"]["counts"], GAP_BINS, color=f"C{i}", label=f"{name} engine")
    axes[0].set_xscale("log")
    axes[0].set_title("one batch: |log p_trainer - log p_engine| per token", fontsize=10)
    axes[0].set_xlabel("nats (below 1e-9: the first bin)", fontsize=9)
    counts = batch["bfloat16"]["tis_histogram"]["counts"]
    labels = [f"[{a:g}, {b:g})" for a, b in zip(WEIGHT_BINS, WEIGHT_BINS[1:])]
    axes[1].bar(range(len(counts)), counts, color="C1")
    axes[1].set_xticks(range(len(counts)), labels, rotation=45, fontsize=7)
    axes[1].set_title(f"bfloat16 engine: token-tis weights (token-mask drops "
                      f"{batch['bfloat16']['mask_dropped_frac']:.2%})", fontsize=10)
    for i, (name, r) in enumerate(runs.items()):
        axes[2].plot(r["step"], r["logprob_mismatch"], color=f"C{i}", label=name)
        axes[3].plot(r["step"], moving_average(r["accuracy"]), color=f"C{i}",
                     label=f"{name}: held-out {r['heldout_pass@1']['start']:.2f} -> {r['heldout_pass@1']['end']:.2f}")
    axes[2].set_yscale("log")
    axes[2].set_title("RL: logprob_mismatch (mean nats per token)", fontsize=10)
    axes[3].set_title("RL: accuracy of the step's answers (5-step mean)", fontsize=10)
    for ax in axes[2:]:
        ax.set_xlabel("step", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    lab.save({"home": args.home, "init": sft, "smoke": args.smoke, "tools": not args.smoke,
              "steps": 2 if args.smoke else STEPS, "prompts_per_step": 4 if args.smoke else PROMPTS,
              "group_size": 4 if args.smoke else 8, "ranks": 1 if args.smoke else 2, "one_batch": batch, "runs": runs},
             fig)


if __name__ == "__main__":
    main()
