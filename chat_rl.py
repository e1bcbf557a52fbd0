"""
Reinforcement learning from verifiable rewards: the GRPO family, with rollouts on the training device.

Each step samples a group of G answers per prompt with the engine, grades every answer (a verifier,
or a reward model), and turns grades into advantages relative to the group: an answer is pushed up by
how much it beat its group and down by how much it missed. The loss is the SFT loss on the model's own
answers, weighted by the advantage, with PPO's importance ratio and clip because several optimizer
steps reuse one batch of rollouts:

    loss = -mean over answer tokens of min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  r = p / p_old

    GRPO      DeepSeekMath, Shao et al. 2024            https://arxiv.org/abs/2402.03300
    Dr. GRPO  Liu et al. 2025 (no std, no length norm)  https://arxiv.org/abs/2503.20783
    DAPO      Yu et al. 2025 (clip-higher, dynamic sampling, overlong shaping)  https://arxiv.org/abs/2503.14476
    GSPO      Zheng et al. 2025 (sequence-level ratio)  https://arxiv.org/abs/2507.18071
    CISPO     MiniMax-M1 2025 (clipped, detached IS weight)  https://arxiv.org/abs/2506.13585
    RLOO      Ahmadian et al. 2024 (leave-one-out baseline)  https://arxiv.org/abs/2402.14740
    REINFORCE++  Hu et al. 2025 (global whitening)      https://arxiv.org/abs/2501.03262
    80/20     Wang et al. 2025 (high-entropy tokens only)  https://arxiv.org/abs/2506.01939

Where the defaults depart from paper GRPO, and why (each departure is one flag away from the paper):
- token-mean aggregation (paper: seq-mean-token-mean, --agg): the paper averages each answer's tokens, so a
  token of a long answer counts less than one of a short answer, a length bias (Dr. GRPO, DAPO);
- clip-higher, eps_high 0.28 (paper: 0.2, --eps-high): a rare token may grow further before it is clipped,
  which keeps the policy's entropy from collapsing (DAPO);
- no KL penalty (paper: 0.04 with the k3 estimator, --kl-beta --kl-kind): with verifiable rewards it mostly
  slows learning, and without it no reference model is loaded; when on, the loss uses k2, whose gradient is
  the KL's (k3's is the reverse KL's: rollout.kl_penalty);
- dynamic sampling (DAPO; --no-dynamic-sampling): groups whose answers all scored the same teach nothing
  and are replaced by more samples; those the last round (--max-resample) must keep train nothing and count in
  no denominator, as in DAPO and verl (paper GRPO trains them at advantage 0, their tokens in token-mean's);
- the sampler correction, token-tis (--correction none): the engine's numerics are not the trainer's, so
  each token is weighted by min(p_trainer / p_engine, 2), truncated importance sampling.

One step reads as four: 1. rollouts (rollout.sample, with dynamic sampling); 2. the snapshot of the policy that
sampled (and of the reference), and the advantages; 3. the update (update_policy): --ppo-epochs passes of
--minibatches optimizer steps on policy_loss; 4. log. Off the default path, marked where they act: sampling from
stale weights (--off-policy, --staleness), the 80/20 token mask, REINFORCE++'s advantages, the entropy bonus, the
KL penalty, --target-kl's early stop.

    python chat_rl.py                                                   # 1 CPU, the embedded world
    torchrun --standalone --nproc_per_node=2 chat_rl.py                 # 2 CPU ranks (1 thread each)
    python chat_rl.py --init /models/my-sft --data rl.jsonl --device cuda            # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_rl.py --init ... --data rl.jsonl   # N GPUs
    python chat_rl.py --init /models/Qwen3-8B-sft --data rl.jsonl --device cuda --lora-rank 32 --lr 1e-5  # LoRA

Data: --data FILE.jsonl with rows {"prompt": [...] or str, "ground_truth": ..., "verifier": ...}, or
verl's rows (data_source, reward_model.ground_truth). Writes $NANOPOST_HOME/rl/<run>/.
"""
import argparse
import os
import time

import torch

import peak_memory
from checkpoint import (load_config, load_model, load_tokenizer, reference_model, resolve_model_path, resume_checkpoint,
                        resume_state, save_checkpoint)
from common import (UserError, all_reduce_dict, all_reduce_sum, autocast, check_finite, fit_warmup, global_mean_var,
                    learning_rate, lr_at, make_optimizer, nanopost_home, optimizer_step, peak_memory_mb, print0,
                    progress, run_main, set_lr, unwrap, wrap_model)
from data import rl_rows
from decontaminate import overlap_warning
from engine import Engine
from evaluation import heldout_scores
from lora import adapters_off, add_lora_flags, lora_options
from rewards import Grader, grader_shapes
from rollout import (ENGINE_DTYPES, IDLE_PATIENCE, StaleSampler, add_overlong_penalty, add_rollout_flags,
                     batch_logprobs, clipped_surrogate, draw_prompts, dynamic_sampling, flat_answers, heldout_rewards,
                     high_entropy_mask, idle_warning, importance_ratio, kl_penalty, kl_to_start, minibatches_of,
                     prompt_length, prompts_per_rank, returns_to_go, rollout_metrics, sample, sampler_correction,
                     token_rewards, training_batch, whiten)
from rundir import add_run_flags, open_run, start_run, write_eval
from tasks import CALCULATOR_SCHEMA, TOOLS
from tokenizer import PROMPT_FORMATS, settle_chat_template

parser = argparse.ArgumentParser(description="GRPO-family RL with verifiable rewards")
parser.add_argument("--init", default=None, help="model folder or run dir (default: the SFT run)")
parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat", help="plain: prompt a base as it was "
                    "pretrained, 'question\\n' (R1-Zero)")
add_rollout_flags(parser)  # --data, --steps, --prompts-per-step, --max-new-tokens, --temperature, --reward, ...
# rollouts
parser.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt (G)")
parser.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True,
                    help="drop groups with equal rewards and sample more (DAPO)")
parser.add_argument("--max-resample", type=int, default=3, help="extra sampling rounds per step for dynamic sampling")
parser.add_argument("--off-policy", action="store_true", help="one-step-off-policy: sample the next batch (in a "
                    "thread, from a snapshot of the weights) while this one trains")
parser.add_argument("--staleness", type=int, default=0, help="sample with weights N steps old (an experiment; 0: off)")
parser.add_argument("--engine-dtype", choices=ENGINE_DTYPES, default="auto", help="the sampler's weights and KV cache "
                    "(auto: the compute dtype); bfloat16 on CPU: a sampler unlike the trainer")
parser.add_argument("--sampler-temperature", type=float, default=None, help="sample at this temperature, score at "
                    "--temperature: a sampler unlike the trainer, of known size (default: --temperature)")
# rewards
parser.add_argument("--overlong-buffer", type=int, default=0, help="DAPO's overlong penalty's last N tokens (0: off)")
parser.add_argument("--overlong-penalty", type=float, default=1.0, help="the penalty at the limit")
# advantages and the loss
parser.add_argument("--estimator", choices=["grpo", "rloo", "reinforce++", "reinforce++-baseline"], default="grpo",
                    help="group mean, or leave-one-out mean, baseline; REINFORCE++: each token's return (the KL in "
                    "the reward), or the group mean, whitened over the batch")
parser.add_argument("--scale", choices=["group", "batch", "none"], default="group", help="grpo, rloo: divide by the "
                    "group's std, the batch's, or not at all (Dr. GRPO)")
parser.add_argument("--eps-low", type=float, default=0.2)
parser.add_argument("--eps-high", type=float, default=0.28, help="clip-higher (DAPO); 0.2 for symmetric PPO")
parser.add_argument("--agg", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
                    default="token-mean")
parser.add_argument("--level", choices=["token", "sequence"], default="token", help="sequence: GSPO's ratio per answer")
parser.add_argument("--loss", choices=["ppo", "cispo", "cispo-two-sided"], default="ppo", help="the clipped ratio "
                    "objective; CISPO's detached weight, capped (MiniMax-M1) or clipped to [1 - eps_low, 1 + eps_high]")
parser.add_argument("--cispo-cap", type=float, default=5.0, help="--loss cispo: the weight's upper bound (TRL: 5)")
parser.add_argument("--dual-clip", type=float, default=None, help="dual-clip PPO's bound for A < 0 (e.g. 3.0)")
parser.add_argument("--mask-truncated", action="store_true", help="answers cut off at the length limit: no gradient")
parser.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus (aggregated as --agg)")
parser.add_argument("--top-entropy", type=float, default=1.0, help="train on this fraction of the batch's tokens, "
                    "those of highest entropy (Wang et al. 2025: 0.2; TRL's top_entropy_quantile); 1: every token")
parser.add_argument("--kl-beta", type=float, default=0.0, help="KL penalty weight to the frozen start (0: none)")
parser.add_argument("--log-kl-to-start", action="store_true", help="log kl_to_start at --kl-beta 0 (loads the start)")
parser.add_argument("--kl-kind", choices=["k1", "k2", "k3"], default="k2", help="KL estimator in the loss (k2: its "
                    "gradient is the exact KL gradient); in the reward under --estimator reinforce++ (its paper: k1)")
parser.add_argument("--target-kl", type=float, default=None, help="stop this step's updates once the approximate KL to "
                    "the sampling policy exceeds it (CleanRL)")
parser.add_argument("--mask-kl-coef", type=float, default=0.0, help="token-mask: prime-rl's squared log-ratio weight")
# optimization
parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass")
parser.add_argument("--lr", type=float, default=None, help="default: 1e-4 on the embedded world, 1e-6 for a real model")
add_run_flags(parser, "rl")  # --run-name, --seed, --device, --resume, --wandb, --fsdp, ...
add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# Advantages

def group_advantages(rewards, group_size, scale="group", estimator="grpo", eps=1e-6):
    """One advantage per answer, relative to its group of `group_size` answers to the same prompt; scale="batch"
    divides by the std of the rewards of the WHOLE batch, every rank's answers (common.global_mean_var).

    Example: rewards [1, 0, 0, 1, 0, 1, 0, 0] (G = 8), mean 0.375, population std 0.4841 (as the seed's table;
    TRL and verl divide by Bessel's std, 0.5175, so their advantages are sqrt((G - 1) / G) = 0.9354 of these):
    a correct answer gets (1 - 0.375) / 0.4841 = +1.2910, a wrong one -0.7746; without the division
    (Dr. GRPO, scale="none") +0.6250 and -0.3750. A group whose rewards are all equal teaches nothing:
    its advantages are exactly 0, never a float-noise std blown up into a huge number (NeMo-RL#4161).
    scale="batch", G = 2: rewards [1, 0, 1, 1] -> group means 0.5, 1; batch std 0.4330: +1.1547, -1.1547, 0, 0."""
    r = rewards.double().view(-1, group_size)
    if estimator == "grpo":
        baseline = r.mean(dim=1, keepdim=True)
    elif estimator == "rloo":  # the mean of the OTHER answers: an unbiased baseline
        baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    else:
        raise ValueError(f"unknown estimator {estimator!r}")
    adv = r - baseline
    flat = (r.max(dim=1, keepdim=True).values - r.min(dim=1, keepdim=True).values) == 0
    if scale == "group":
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (global_mean_var(r)[1] ** 0.5 + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    return adv.masked_fill(flat, 0.0).view(-1).float()


# ------------------------------------------------------------------------------------------------
# The policy loss

def policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.2, dual_clip=None, level="token",
                agg="token-mean", loss_type="ppo", normalizer=None, max_len=None, weights=None, cispo_cap=5.0):
    """The clipped importance-ratio objective, negated (a loss to minimize). Returns (loss, stats).

    logp: (B, T) log-probs under the policy being trained (with gradient); old_logp: the same tokens under the
    policy that sampled them, a snapshot taken before the first update on this batch; advantages: (B,) one per
    answer, or (B, T) per token; mask: (B, T), 1 on the answer's sampled tokens.

    The paper's objective, per token: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp - old_logp).
    eps_high > eps_low is DAPO's clip-higher. Example, A = +1: a rare token at p_old 0.1003 with ratio 1.4918 is
    clipped to 1.2 with eps 0.2 (p may reach 0.1203) and to 1.28 with eps_high 0.28 (0.1283); a common token at
    p_old 0.8187, ratio 1.1052, is inside either range.
    Departures, each off by default:
      level="sequence" (GSPO): one ratio per answer, exp(mean over its tokens of log r), the geometric mean of the
          token ratios. Example: log-ratios -0.02, +0.02, -0.02, +0.90, -0.01 give exp(0.87 / 5) = 1.1901, inside
          the clip range where the fourth token's own ratio 2.4596 is not. Its value is per answer; the gradient
          flows through each token's log-prob.
      dual_clip=c: the loss of a negative-advantage token is at most -c A (dual-clip PPO).
      loss_type="cispo": -sg(min(r, cispo_cap)) A log p, MiniMax-M1's weight: capped, no lower bound, detached, so
          no token leaves the gradient ("Wait", "However" keep theirs). TRL's loss_type="cispo" at epsilon_high=c
          is cispo_cap=c. "cispo-two-sided": sg(clip(r, 1 - eps_low, 1 + eps_high)) in place of the capped weight.
      weights: (B, T) detached per-token weights, the sampler correction (rollout.sampler_correction).
    agg and normalizer: see aggregate."""
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    log_ratio = logp - old_logp
    if level == "sequence":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # value: sequence; grad: token
    elif level != "token":
        raise ValueError(f"unknown level {level!r}")
    ratio = importance_ratio(log_ratio)  # exp of the log-ratio clamped to [-20, 20] (verl)
    if loss_type == "ppo":
        per_token, is_clipped = clipped_surrogate(ratio, adv, eps_low, eps_high)  # the pessimistic side, and where
        if dual_clip is not None:                                                 # the clip binds
            per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    elif loss_type in ("cispo", "cispo-two-sided"):
        if dual_clip is not None:
            raise ValueError("dual_clip bounds the PPO objective; CISPO has none to bound")
        clipped_ratio = ratio.clamp(max=cispo_cap) if loss_type == "cispo" else ratio.clamp(1 - eps_low, 1 + eps_high)
        per_token = -clipped_ratio.detach() * adv * logp
        is_clipped = clipped_ratio != ratio
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if weights is not None:
        per_token = per_token * weights
    n_tok = mask.sum().clamp(min=1)
    stats = {"clip_frac": ((is_clipped.to(mask.dtype) * mask).sum() / n_tok).item(),
             "ratio_mean": ((ratio.detach() * mask).sum() / n_tok).item()}
    return aggregate(per_token, mask, agg, normalizer, max_len), stats


def aggregate(per_token, mask, agg="token-mean", normalizer=None, max_len=None):
    """One number from per-token losses (B, T) over the mask's tokens:
      "token-mean" (DAPO): sum over all tokens / number of tokens; long answers count per token.
      "seq-mean-token-mean" (paper GRPO): mean over answers of each answer's token mean.
      "seq-mean-token-sum-norm" (Dr. GRPO): sum over tokens / (answers x max_len), a constant.
    normalizer: the denominator (tokens, or answers) over the WHOLE global batch; pass it when the batch is
    split into micro-batches or ranks, so the split cannot change the gradient (rollout.Minibatch's counts).
    Example: two answers of 1 and 3 tokens, per-token losses [1] and [2, 2, 2]: token-mean 7 / 4 = 1.75;
    seq-mean-token-mean (1 + 2) / 2 = 1.5; seq-mean-token-sum-norm at max_len 4: 7 / (2 x 4) = 0.875."""
    if agg == "token-mean":
        return (per_token * mask).sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    if agg == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / (normalizer if normalizer is not None else per_token.size(0))
    if agg == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the constant normalizer)")
        return (per_token * mask).sum() / ((normalizer if normalizer is not None else per_token.size(0)) * max_len)
    raise ValueError(f"unknown agg {agg!r}")


# ------------------------------------------------------------------------------------------------
# The update

def update_policy(model, optimizer, batch, *, old_logp, advantages, step, loss_settings, weights=None, ref_logp=None,
                  kl_beta=0.0, kl_kind="k2", entropy_coef=0.0, mask_kl_coef=0.0, target_kl=None, ppo_epochs=1,
                  minibatches=2, micro_batch_tokens=8192, grad_clip=1.0, temperature=1.0, top_k=None, top_p=None):
    """ppo_epochs passes over one batch of rollouts, each split into `minibatches` optimizer steps, each minibatch into
    forward passes of at most micro_batch_tokens tokens. The loss of a pass: policy_loss (its settings: loss_settings,
    e.g. {"eps_low": 0.2, "eps_high": 0.28, "agg": "token-mean"}), and, each off at 0: minus entropy_coef times the
    entropy, plus kl_beta times the KL to the reference (ref_logp, by kl_kind), plus mask_kl_coef times the squared
    log-ratio to the sampler (prime-rl, with token-mask). Every term is aggregated as the policy loss is (--agg, as
    verl and TRL do: paper GRPO's KL is a per-answer mean too), over the GLOBAL counts of the minibatch (all passes,
    all ranks), so the split into passes and ranks cannot change the gradient. After each optimizer step the
    approximate KL between the sampling policy and the current one is measured over all ranks; past target_kl the
    remaining updates of this batch are skipped (every rank sees the same number, so every rank stops).
    advantages: (B,) one per answer, or (B, T) per token; weights: the sampler correction (B, T) or None;
    temperature, top_k, top_p: the distribution the answers were sampled from, which the log-probs are of.
    Returns sums over this rank's tokens and the updates' statistics."""
    logits_settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    totals = {"loss": 0.0, "clip_frac": 0.0, "ratio": 0.0, "approx_kl": 0.0, "kl": 0.0, "tokens": 0.0,
              "grad_norm": 0.0, "updates": 0}
    agg, max_len = loss_settings.get("agg", "token-mean"), loss_settings.get("max_len")
    for mb in minibatches_of(batch, step=step, epochs=ppo_epochs, count=minibatches):
        normalizer = mb.tokens if agg == "token-mean" else mb.answers
        approx_kl = 0.0  # over the minibatch's tokens: k3(sampling policy || current policy), as CleanRL logs it
        for p in mb.passes([model], micro_batch_tokens):  # p(tensor): this forward pass's slice of it
            m = p(batch.mask)
            with autocast(m.device):
                logp, entropy = model(p(batch.inputs), p(batch.targets), with_entropy=True, **logits_settings) \
                    if entropy_coef > 0 else (model(p(batch.inputs), p(batch.targets), **logits_settings), None)
            pg_loss, st = policy_loss(logp, p(old_logp), p(advantages), m, weights=p(weights), normalizer=normalizer,
                                      **loss_settings)

            def mean(per_token):  # every term aggregated as the policy loss is (--agg), as verl and TRL do
                return aggregate(per_token, m, agg, normalizer, max_len)
            # the loss, one weighted sum; each term after the first is off (and not computed) at coefficient 0
            entropy_bonus = mean(entropy) if entropy_coef > 0 else 0.0
            kl = mean(kl_penalty(logp, p(ref_logp), kl_kind)) if ref_logp is not None else 0.0
            mask_kl = mean((logp - p(batch.engine_logp)) ** 2) if mask_kl_coef > 0 else 0.0
            loss = pg_loss + mask_kl_coef * mask_kl - entropy_coef * entropy_bonus + kl_beta * kl
            check_finite(loss, step + 1)
            loss.backward()
            log_ratio = (logp.detach() - p(old_logp)) * m
            approx_kl += ((log_ratio.exp() - 1) - log_ratio).mul(m).sum().item()
            if ref_logp is not None:  # the KL to the start, logged as k3 whatever --kl-kind the loss uses
                totals["kl"] += (kl_penalty(logp.detach(), p(ref_logp), "k3") * m).sum().item()
            for key, value in (("loss", loss.item()), ("clip_frac", st["clip_frac"] * m.sum().item()),
                               ("ratio", st["ratio_mean"] * m.sum().item()), ("tokens", m.sum().item())):
                totals[key] += value
        totals["grad_norm"] += optimizer_step(model, optimizer, grad_clip)
        totals["updates"] += 1
        totals["approx_kl"] += (approx_kl := all_reduce_sum(approx_kl) / mb.tokens)
        if target_kl is not None and approx_kl > target_kl:  # CleanRL's early stop, the same on every rank
            break
    return totals


def update_settings(args) -> dict:
    """update_policy's settings from this script's flags: what main passes, and what the tests build."""
    if args.dual_clip is not None and args.loss != "ppo":
        raise UserError("--dual-clip bounds the PPO objective (--loss ppo); CISPO has none to bound")
    if args.level == "sequence" and args.agg == "token-mean":  # as TRL warns: GSPO's paper averages answers
        print0("warning: --level sequence with --agg token-mean weighs answers by length; GSPO: seq-mean-token-mean")
    return dict(loss_settings=dict(eps_low=args.eps_low, eps_high=args.eps_high, dual_clip=args.dual_clip,
                                   level=args.level, agg=args.agg, loss_type=args.loss, max_len=args.max_new_tokens,
                                   cispo_cap=args.cispo_cap),
                kl_beta=0.0 if args.estimator == "reinforce++" else args.kl_beta,  # REINFORCE++: in the reward
                kl_kind=args.kl_kind, entropy_coef=args.entropy_coef,
                mask_kl_coef=args.mask_kl_coef if args.correction == "token-mask" else 0.0, target_kl=args.target_kl,
                ppo_epochs=args.ppo_epochs, minibatches=args.minibatches, micro_batch_tokens=args.micro_batch_tokens,
                grad_clip=args.grad_clip, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def memory_estimate(args, init, *, prompt_len, world_size=1, cuda=False) -> dict:
    """Know before you OOM: the peak memory per device that main prints (and `python memory.py --init FOLDER rl`):
    the policy trains; the reference (kl_beta > 0 or --log-kl-to-start; not LoRA) and grader models only run forward."""
    policy = peak_memory.Shape.of(load_config(init))
    return peak_memory.rollout_estimate(
        trained=[policy], frozen=[policy] * ((args.kl_beta > 0 or args.log_kl_to_start) and not args.lora_rank)
        + grader_shapes(args.reward),
        answers=args.prompts_per_step // world_size * args.group_size, prompts=args.prompts_per_step // world_size,
        prompt_len=prompt_len, max_new_tokens=args.max_new_tokens, minibatches=args.minibatches,
        micro_batch_tokens=args.micro_batch_tokens, lora_rank=args.lora_rank, world_size=world_size, fsdp=args.fsdp,
        cuda=cuda, grad_checkpointing=args.grad_checkpointing)


def main():
    args = parser.parse_args()
    # the update's flags, then the data (a malformed row names its file:line), checked before any model is looked for
    settings = update_settings(args)
    rows, eval_rows = rl_rows(args.data, args.eval_data, eval_problems=args.eval_problems,
                              num_prompts=args.num_prompts, seed=args.seed)
    dist, out_dir = start_run(args, "rl", "chat_rl")
    device = dist.device
    if args.data and (warning := overlap_warning(rows, eval_rows)):  # the held-out rows should be new to training
        print0(warning)

    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"), head="lm")
    tok = load_tokenizer(init).with_prompt_format(args.prompt_format)
    tool_schemas = [CALCULATOR_SCHEMA] if args.tools else None
    settle_chat_template(tok, rows, args.chat_template, tools=tool_schemas)  # checkpoints ship what we train on
    G, local_prompts = args.group_size, prompts_per_rank(args.prompts_per_step, dist.world_size, len(rows))
    peak_memory.check(memory_estimate(args, init, prompt_len=prompt_length(tok, rows, tool_schemas),
                                      world_size=dist.world_size, cuda=device.type == "cuda"), device)
    ckpt = resume_checkpoint(out_dir) if args.resume else None
    # float32 master weights; under torchrun wrapped in DDP, or sharded with --fsdp
    lora = lora_options(args, ckpt or init, resume=bool(ckpt), scores_samples=True)  # None without --lora-rank
    model = wrap_model(load_model(ckpt or init, fsdp=args.fsdp, save_dtype=args.save_dtype, lora=lora,
                                  head_precision=args.head_precision), fsdp=args.fsdp)
    unwrap(model).grad_checkpointing = args.grad_checkpointing
    peak_lr = learning_rate(args.lr, "rl", unwrap(model))
    optimizer = make_optimizer(model, peak_lr)
    state = resume_state(ckpt, optimizer, model)  # train_seconds: in steps, evaluation excluded (--time-budget)
    start_step, train_clock = state["step"], state["train_seconds"]
    # the frozen start (compute dtype; LoRA: the policy, run with its adapters off); at beta = 0 only for kl_to_start
    ref_model = reference_model(model, init, args.fsdp, lora) if args.kl_beta > 0 or args.log_kl_to_start else None
    grader = Grader(args.reward, tok, device, rubric=args.rubric)  # its reward models stay whole on every rank
    engine = Engine(unwrap(model), tok, tools=TOOLS if args.tools else None, dtype=ENGINE_DTYPES[args.engine_dtype])
    logits_settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    sampling = dict(max_new_tokens=args.max_new_tokens, tool_schemas=tool_schemas, max_tool_turns=args.max_tool_turns,
                    **{**logits_settings, "temperature": args.sampler_temperature or args.temperature})
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; {len(rows)} prompts; "
           f"{args.prompts_per_step} prompts x {G} answers per step on {dist.world_size} rank(s); reward {args.reward}")

    def evaluate(step):  # pass@k; with another --reward than the verifier, each grader on held-out answers too
        return {**heldout_scores(model, tok, eval_rows, max_new_tokens=args.max_new_tokens, samples=args.pass_k,
                                 seed=step, use_tools=args.tools, label=f"eval @ step {step}", **logits_settings),
                **(heldout_rewards(engine, eval_rows, grader, seed=step, **sampling)
                   if args.reward != "verifier" else {})}

    def sample_round(sampler, step, round_, n):
        """n prompts' groups, graded (the prompts and seeds a pure function of seed, step, round and rank)."""
        batch_rows, seed = draw_prompts(rows, n, seed=args.seed, step=step, rank=dist.rank, round_=round_)
        rollouts = sample(sampler, batch_rows, grader, samples_per_prompt=G, seed=seed, **sampling)
        if args.overlong_buffer:  # DAPO's soft overlong punishment, part of the reward
            add_overlong_penalty(rollouts, args.max_new_tokens, args.overlong_buffer, args.overlong_penalty)
        return rollouts

    def sample_step(sampler, step):
        """One step's rollouts, dynamic sampling included, drawn by `sampler` (its weights built once)."""
        with sampler.prepared():
            return dynamic_sampling(lambda round_, n: sample_round(sampler, step, round_, n), local_prompts,
                                    1 + (args.max_resample if args.dynamic_sampling else 0))

    # departures from on-policy sampling: --off-policy and --staleness sample with older weights
    behind = StaleSampler(engine, sample_step, off_policy=args.off_policy, staleness=args.staleness, steps=args.steps,
                          resumed=start_step > 0) if args.off_policy or args.staleness else None

    log = open_run(args, out_dir, "rl")  # every input checked: now --overwrite replaces the old run
    final_scores = None
    if start_step == 0 and eval_rows and args.eval_before_train:  # every rank evaluates its share
        final_scores = evaluate(0)
        log.log(0, train_seconds=0.0, **{f"eval/{k}": v for k, v in final_scores.items()})
    warmup_steps = fit_warmup(args.warmup_steps, args.steps)
    idle_steps = state.get("idle_steps", 0)  # consecutive steps without a gradient: part of the resumed state
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="rl")
    for step in bar:
        t_step = time.time()
        lr = lr_at(step, args.steps, peak_lr, warmup_steps, final_ratio=1.0)  # warmup, then constant
        set_lr(optimizer, lr)

        # 1. rollouts: this rank's prompts, G answers each, graded (dynamic sampling: mixed groups only);
        #    staleness: how many updates the sampling weights are behind the weights this batch trains
        rollouts, groups, staleness = behind(step) if behind else (*sample_step(engine, step), 0)
        t_sample = time.time() - t_step

        # 2. the tensors, the snapshot of the policy that sampled (and of the reference) before any update on
        #    this batch, and the advantages: one per answer relative to its group, or REINFORCE++'s per token
        t1 = time.time()
        batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, device, args.mask_truncated)
        flat = flat_answers(rollouts.rewards, G) & args.dynamic_sampling  # the last round's flat groups train nothing
        sampled, mask = batch.mask.clone(), batch.mask  # every sampled token (the sampler's diagnostics); the trained
        mask[flat.to(device)] = 0  # (DAPO, verl): out of the loss mask, in place, they count in no denominator
        old_logp, entropy = batch_logprobs(model, batch, args.micro_batch_tokens, with_entropy=True, **logits_settings)
        ref_logp = None
        if ref_model is not None:
            with adapters_off(ref_model):  # untruncated: a sampled token outside ITS top-k/top-p is no infinite KL
                ref_logp = batch_logprobs(ref_model, batch, args.micro_batch_tokens, temperature=args.temperature)
        weights = sampler_correction(old_logp, batch.engine_logp, sampled, args.correction, cap=args.tis_cap,
                                     eps=args.mask_eps)
        if args.estimator == "reinforce++":  # the score at the last token, -beta KL at each: returns, whitened
            rewards, _ = token_rewards(rollouts.rewards.to(device), old_logp, ref_logp, mask, args.kl_beta,
                                       args.kl_kind)
            adv = whiten(returns_to_go(rewards, mask), mask)
        elif args.estimator == "reinforce++-baseline":  # the group-mean advantage, whitened over the batch's tokens
            adv = whiten(group_advantages(rollouts.rewards, G, "none", "grpo").to(device)[:, None] * mask, mask)
        else:
            adv = group_advantages(rollouts.rewards, G, args.scale, args.estimator).to(device)

        # 3. the update: --ppo-epochs passes of --minibatches optimizer steps on this batch
        # the 80/20 paper (--top-entropy): only the forking tokens, where the policy hesitates, train
        trained = weights * high_entropy_mask(entropy, mask, args.top_entropy) if args.top_entropy < 1 else weights
        totals = update_policy(model, optimizer, batch, old_logp=old_logp, advantages=adv, weights=trained,
                               ref_logp=ref_logp if settings["kl_beta"] > 0 else None, step=step, **settings)
        t_train = time.time() - t1
        train_clock += time.time() - t_step

        # 4. log: this rank's sums, added over the ranks in one collective, each then divided by its global count
        s = all_reduce_dict({**rollouts.stats(), "groups": groups["groups"], "flat": groups["flat"],
                             "flat_kept": float(flat.sum()),
                             "sampled": float(sampled.sum()), "entropy": float((entropy * sampled).sum()),
                             "mismatch": float(((old_logp - batch.engine_logp).abs() * sampled).sum()),
                             "correction": float(weights.sum()),
                             "masked": float(((weights == 0) & (sampled > 0)).sum()),
                             "kl_to_start": 0.0 if ref_logp is None else float(kl_to_start(old_logp, ref_logp,
                                                                                               mask).sum()),
                             "sample_tok_per_s": sum(len(c.tokens) for c in rollouts.completions) / max(t_sample, 1e-9),
                             "train_tok_per_s": float(mask.sum()) * args.ppo_epochs / max(t_train, 1e-9),
                             **{f"update_{k}": totals[k] for k in ("loss", "clip_frac", "ratio", "tokens", "kl")}})
        n_sampled, n_trained, updates = max(1.0, s["sampled"]), max(1.0, s["update_tokens"]), max(1, totals["updates"])
        metrics = {
            **rollout_metrics(s),
            "length_max": max(len(c.tokens) for c in rollouts.completions),  # this rank's
            "flat_group_frac": s["flat"] / max(1.0, s["groups"]),  # sampled, every round of dynamic sampling counted
            "flat_groups_kept": s["flat_kept"] / G,  # in the batch, masked: trained on nothing
            "entropy": s["entropy"] / n_sampled,  # of the sampling distribution; it and the next 3: every sampled token
            "loss": s["update_loss"] / updates,
            "clip_frac": s["update_clip_frac"] / n_trained,  # where the clip binds (verl's pg_clipfrac)
            "ratio_mean": s["update_ratio"] / n_trained,
            "approx_kl": totals["approx_kl"] / updates,  # (already over every rank)
            "updates": totals["updates"], "grad_norm": totals["grad_norm"] / updates,
            "logprob_mismatch": s["mismatch"] / n_sampled,
            "correction_mean": s["correction"] / n_sampled,  # the sampler correction's mean weight
            "masked_frac": s["masked"] / n_sampled,
            "staleness": staleness,  # how many updates the sampling weights were behind
            "sample_tok_per_s": s["sample_tok_per_s"], "train_tok_per_s": s["train_tok_per_s"],
            "lr": lr, "train_seconds": train_clock, "peak_mem_mb": peak_memory_mb(device),
            # how far the policy that sampled this batch is from the start, per answer; the KL term, per token
            **({"kl_to_start": s["kl_to_start"] / s["answers"]} if ref_model is not None else {}),
            **({"kl": s["update_kl"] / n_trained} if settings["kl_beta"] > 0 else {}),
        }
        idle_steps = idle_steps + 1 if metrics["flat_group_frac"] == 1.0 or metrics["grad_norm"] == 0.0 else 0
        metrics["idle_steps"] = idle_steps  # consecutive steps without a gradient
        if idle_steps == IDLE_PATIENCE:
            # the graders count every answer sampled, the resampled rounds' too: a share of those, not of the kept
            print0(idle_warning(idle_steps, metrics.get("count/ungradable", 0.0) / max(1.0, s["groups"] * G)))
        # rank 0's clock decides for all, so that every rank stops at the same step
        over_budget = args.time_budget > 0 and all_reduce_sum(train_clock if dist.is_main else 0.0) >= args.time_budget
        last = step + 1 == args.steps or over_budget
        if eval_rows and ((step + 1) % args.eval_every == 0 or last):
            final_scores = evaluate(step + 1)
            metrics.update({f"eval/{k}": v for k, v in final_scores.items()})
        if rollouts.errors:
            print0(f"step {step + 1}: {len(rollouts.errors)} verifier error(s) scored 0, e.g. {rollouts.errors[0]}")
        log.log(step + 1, **metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}", refresh=False)
        if (step + 1) % args.save_every == 0 or last:
            state = {"run_config": vars(args), "train_seconds": train_clock, "idle_steps": idle_steps}
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, state, lora=lora)
        if over_budget:
            print0(f"time budget of {args.time_budget:g} s spent after {step + 1} steps")
            break
    if behind:
        behind.close()  # a batch still being sampled for a step that will not run

    if eval_rows:
        scores = final_scores if final_scores is not None and start_step < args.steps else evaluate(args.steps)
        write_eval(out_dir, scores)
    log.close()


if __name__ == "__main__":
    run_main(main)
