"""
Reinforcement learning from verifiable rewards: the GRPO family, with rollouts on the training device.

Each step samples a group of G answers per prompt with the engine, grades every answer (a verifier,
or a reward model), and turns grades into advantages relative to the group: an answer is pushed up by
how much it beat its group and down by how much it missed. The loss is the SFT loss on the model's own
answers, weighted by the advantage, with PPO's importance ratio and clip because several optimizer
steps reuse one batch of rollouts.

    GRPO      DeepSeekMath, Shao et al. 2024            https://arxiv.org/abs/2402.03300
    Dr. GRPO  Liu et al. 2025 (no std, no length norm)  https://arxiv.org/abs/2503.20783
    DAPO      Yu et al. 2025 (clip-higher, token-mean, dynamic sampling, overlong shaping)
                                                        https://arxiv.org/abs/2503.14476
    GSPO      Zheng et al. 2025 (sequence-level ratio)  https://arxiv.org/abs/2507.18071
    CISPO     MiniMax-M1 2025 (clipped, detached IS weight)  https://arxiv.org/abs/2506.13585
    RLOO      Ahmadian et al. 2024 (leave-one-out baseline)  https://arxiv.org/abs/2402.14740

The defaults are what a practitioner would pick in 2026 (DAPO-style): token-mean aggregation,
clip-higher (0.2 / 0.28), no KL penalty (no reference model is even loaded), dynamic sampling.

One step reads as four: 1. rollouts (rollout.sample, with DAPO's dynamic sampling: groups whose answers
all scored the same are dropped and more are sampled); 2. advantages and the snapshot of the policy that
sampled (and of the reference); 3. the update: --ppo-epochs passes of --minibatches optimizer steps on the
clipped objective (policy_loss), minus an optional entropy bonus, plus an optional KL penalty, stopping
early past --target-kl; 4. log.

    python chat_rl.py                                                   # 1 CPU, the embedded world
    torchrun --standalone --nproc_per_node=2 chat_rl.py                 # 2 CPU ranks (1 thread each)
    python chat_rl.py --init /models/my-sft --data rl.jsonl --device cuda            # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_rl.py --init ... --data rl.jsonl   # N GPUs
    python chat_rl.py --init /models/Qwen3-8B-sft --data rl.jsonl --device cuda --lora-rank 32 --lr 1e-5  # LoRA, 1 GPU

With --lora-rank the base is frozen and only adapters train (model.LoRALinear); the KL reference is the
policy with its adapters off (no second model); LoRA wants about 10x full fine-tuning's --lr.

Data: --data FILE.jsonl with rows {"prompt": [...] or str, "ground_truth": ..., "verifier": ...}, or
verl's rows (data_source, reward_model.ground_truth). Writes $NANOPOST_HOME/rl/<run>/.
"""
import argparse
import collections
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import (MetricsLogger, UserError, add_lora_flags, all_reduce_dict, all_reduce_sum, autocast, check_finite,
                    global_mean_var, idle_pass, init_dist, learning_rate, load_model,
                    load_training_state, lora_options, lr_at, make_optimizer, micro_batches, nanopost_home, no_sync,
                    optimizer_step, peak_memory_mb, print0, print_config, progress, reference_model,
                    resolve_model_path, resume_checkpoint, run_dir, run_main, save_checkpoint, seed_everything, set_lr,
                    unwrap, wrap_model, write_eval)
from rollout import CORRECTIONS, Rollouts, batch_logprobs, kl_penalty, sample, sampler_correction, training_batch

parser = argparse.ArgumentParser(description="GRPO-family RL with verifiable rewards")
parser.add_argument("--init", default=None, help="model folder or run dir (default: the SFT run)")
parser.add_argument("--run-name", default="default")
parser.add_argument("--wandb", metavar="PROJECT", help="also log to this Weights & Biases project (WANDB_MODE=offline: no network)")
parser.add_argument("--device", default="auto")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data", default=None, help="RL JSONL (default: the embedded world's problems)")
parser.add_argument("--eval-data", default=None, help="held-out RL JSONL (default with --data: its last 2%%)")
parser.add_argument("--num-prompts", type=int, default=4000, help="embedded-world training prompts")
# rollouts
parser.add_argument("--steps", type=int, default=60, help="rollout batches (each followed by optimizer steps)")
parser.add_argument("--time-budget", type=float, default=0, help="stop after this many seconds of training, evaluation excluded (0: off)")
parser.add_argument("--prompts-per-step", type=int, default=64, help="prompts per rollout batch, all ranks together")
parser.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt (G)")
parser.add_argument("--max-new-tokens", type=int, default=192)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--top-k", type=int, default=None)
parser.add_argument("--top-p", type=float, default=None)
parser.add_argument("--tools", action="store_true", help="offer the calculator: multi-turn tool rollouts")
parser.add_argument("--max-tool-turns", type=int, default=6)
# rewards
parser.add_argument("--reward", default="verifier", help="graders, weighted and summed: verifier (the row's), "
                    "format, rm:PATH, judge:PATH; e.g. verifier+0.1*format (see rewards.py)")
parser.add_argument("--rubric", default=None, help="the judge's rubric file, with --reward ...judge:PATH (e.g. rubrics/flattery.txt)")
parser.add_argument("--overlong-buffer", type=int, default=0, help="DAPO soft overlong penalty over the last N tokens before the limit (0: off)")
parser.add_argument("--overlong-penalty", type=float, default=1.0, help="the penalty at the limit")
# advantages and loss
parser.add_argument("--estimator", choices=["grpo", "rloo"], default="grpo", help="group mean, or leave-one-out mean, baseline")
parser.add_argument("--scale", choices=["group", "batch", "none"], default="group", help="divide by the group's std, the batch's, or not at all (Dr. GRPO)")
parser.add_argument("--loss", choices=["ppo", "cispo"], default="ppo", help="the clipped ratio objective, or CISPO's clipped detached weight")
parser.add_argument("--level", choices=["token", "sequence"], default="token", help="token ratios, or GSPO's sequence ratio")
parser.add_argument("--agg", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"], default="token-mean")
parser.add_argument("--eps-low", type=float, default=0.2)
parser.add_argument("--eps-high", type=float, default=0.28, help="clip-higher (DAPO); 0.2 for symmetric PPO")
parser.add_argument("--dual-clip", type=float, default=None, help="dual-clip bound for negative advantages (e.g. 3.0)")
parser.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus (token-mean entropy of the sampling distribution)")
parser.add_argument("--kl-beta", type=float, default=0.0, help="KL penalty weight against the frozen start (0: no reference model)")
parser.add_argument("--kl-kind", choices=["k1", "k2", "k3"], default="k2", help="KL estimator in the loss (k2: its gradient is the exact KL gradient)")
parser.add_argument("--target-kl", type=float, default=None, help="stop this step's updates once the approximate KL to the sampling policy exceeds it (CleanRL)")
parser.add_argument("--correction", choices=CORRECTIONS, default="token-tis", help="for answers the sampler drew from "
                    "another distribution (its numerics, or stale weights): reweight or mask (rollout.sampler_correction)")
parser.add_argument("--tis-cap", type=float, default=2.0, help="the cap of token-tis and sequence-tis; sequence-mask keeps [1/cap, cap]")
parser.add_argument("--mask-eps", type=float, default=0.1, help="token-mask drops a token whose probabilities differ by more than this")
parser.add_argument("--mask-kl-coef", type=float, default=0.0, help="token-mask: weight of prime-rl's squared log-ratio to the sampler")
parser.add_argument("--staleness", type=int, default=0, help="sample with the weights of this many steps back (an experiment; 0: on-policy)")
parser.add_argument("--off-policy", action="store_true", help="one-step-off-policy: sample the next batch (in a thread, from "
                    "a snapshot of the weights) while this one trains")
parser.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True, help="drop groups with equal rewards and sample more (DAPO)")
parser.add_argument("--max-resample", type=int, default=3, help="extra sampling rounds per step for dynamic sampling")
parser.add_argument("--mask-truncated", action="store_true", help="answers cut off at the length limit give no gradient")
# optimization
parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass")
parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per forward pass (padding included); bounds activation memory")
parser.add_argument("--grad-checkpointing", action="store_true", help="recompute each block's activations in backward")
parser.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state across ranks (FSDP2)")
parser.add_argument("--dist-timeout", type=float, default=30, help="minutes a rank may wait in a collective")
parser.add_argument("--lr", type=float, default=None, help="default: 1e-4 on the embedded world, 1e-6 for a real model")
parser.add_argument("--warmup-steps", type=int, default=3)
parser.add_argument("--grad-clip", type=float, default=1.0)
# evaluation and checkpoints
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems, at most (0: no evaluation)")
parser.add_argument("--pass-k", type=int, default=4, help="pass@1..k at --temperature, besides greedy pass@1")
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--resume", action="store_true")
add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# Advantages

def group_advantages(rewards, group_size, scale="group", estimator="grpo", eps=1e-6):
    """One advantage per answer, relative to its group of `group_size` answers to the same prompt.

    Example: rewards [1, 0, 0, 1, 0, 1, 0, 0] (G = 8), mean 0.375, population std 0.4841:
    a correct answer gets (1 - 0.375) / 0.4841 = +1.2910, a wrong one -0.7746; without the division
    (Dr. GRPO, scale="none") +0.6250 and -0.3750. A group whose rewards are all equal teaches nothing:
    its advantages are exactly 0, never a float-noise std blown up into a huge number (NeMo-RL#4161)."""
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
        adv = adv / (r.std(unbiased=False) + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    return adv.masked_fill(flat, 0.0).view(-1).float()


def step_advantages(rewards, group_size, scale, estimator):
    """group_advantages of this rank's answers, where scale="batch" divides by the std of the rewards of
    the WHOLE batch, every rank's answers (global_mean_var), not only this rank's.
    Example, one rank, G = 2: rewards [1, 0, 1, 1] -> group means 0.5, 1; batch std sqrt(0.1875) = 0.4330:
    advantages +1.1547, -1.1547, 0, 0."""
    if scale != "batch":
        return group_advantages(rewards, group_size, scale=scale, estimator=estimator)
    _, var = global_mean_var(rewards)
    return group_advantages(rewards, group_size, scale="none", estimator=estimator) / (var ** 0.5 + 1e-6)


# ------------------------------------------------------------------------------------------------
# The policy loss

def policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.2, dual_clip=None, level="token",
                agg="token-mean", loss_type="ppo", normalizer=None, max_len=None, weights=None):
    """The clipped importance-ratio objective, negated (a loss to minimize). Returns (loss, stats).

    logp: (B, T) log-probs under the policy being trained (with gradient); old_logp: the same tokens
    under the policy that sampled them, a snapshot taken before the first update on this batch;
    advantages: (B,) one per answer, or (B, T) per token; mask: (B, T), 1 on the answer's sampled tokens.
    weights: optional (B, T) detached per-token weights (truncated importance sampling).

    loss_type="ppo":   -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token. eps_high > eps_low is
                  DAPO's clip-higher. Example, A = +1: a rare token at p_old 0.1003 with ratio 1.4918
                  is clipped to 1.2 with eps 0.2 (p may reach 0.1203) and to 1.28 with eps_high 0.28
                  (0.1283); a common token at p_old 0.8187, ratio 1.1052, is inside either range.
                  dual_clip=c also bounds the loss of a negative-advantage token at -c A.
    loss_type="cispo": -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log p: the weight is clipped and detached,
                  so no token is dropped from the gradient ("Wait", "However" keep theirs).
    level="sequence" (GSPO): one ratio per answer, exp(mean over its tokens of log r), the geometric
                  mean of the token ratios. Example: log-ratios -0.02, +0.02, -0.02, +0.90, -0.01 give
                  exp(0.87 / 5) = 1.1901, inside the clip range where the fourth token's own ratio
                  2.4596 is not. Its value is per answer; the gradient flows through each token's log-prob.
    agg:  "token-mean" (DAPO): sum over all tokens / number of tokens; long answers count per token.
          "seq-mean-token-mean" (GRPO): mean over answers of each answer's token mean.
          "seq-mean-token-sum-norm" (Dr. GRPO): sum over tokens / (answers x max_len), a constant.
    normalizer: the denominator of agg over the WHOLE global batch (tokens, or answers); pass it when
          the batch is split into micro-batches or ranks, so the split cannot change the gradient."""
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    log_ratio = logp - old_logp
    if level == "sequence":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # value: sequence; grad: token
    elif level != "token":
        raise ValueError(f"unknown level {level!r}")
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    if loss_type == "ppo":
        unclipped, clipped = -adv * ratio, -adv * clipped_ratio
        per_token = torch.maximum(unclipped, clipped)
        is_clipped = clipped > unclipped
        if dual_clip is not None:
            per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    elif loss_type == "cispo":
        per_token = -clipped_ratio.detach() * adv * logp
        is_clipped = clipped_ratio != ratio
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if weights is not None:
        per_token = per_token * weights
    if agg == "token-mean":
        loss = (per_token * mask).sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    elif agg == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = per_seq.sum() / (normalizer if normalizer is not None else logp.size(0))
    elif agg == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the constant normalizer)")
        loss = (per_token * mask).sum() / ((normalizer if normalizer is not None else logp.size(0)) * max_len)
    else:
        raise ValueError(f"unknown agg {agg!r}")
    n_tok = mask.sum().clamp(min=1)
    stats = {"clip_frac": ((is_clipped.to(mask.dtype) * mask).sum() / n_tok).item(),
             "ratio_mean": ((ratio.detach() * mask).sum() / n_tok).item()}
    return loss, stats


def loss_normalizer(mask, agg):
    """This rank's share of the policy loss denominator: tokens for token-mean, answers otherwise."""
    return float(mask.sum()) if agg == "token-mean" else float(mask.size(0))




# ------------------------------------------------------------------------------------------------
# The update

def update_policy(model, optimizer, batch, *, old_logp, advantages, ref_logp, weights, step, args):
    """--ppo-epochs passes over one batch of rollouts, each split into --minibatches optimizer steps, each
    minibatch into forward passes of at most --micro-batch-tokens tokens. The loss of a pass: the clipped
    objective (policy_loss), minus --entropy-coef times the entropy, plus --kl-beta times the KL to the
    reference. Every term is divided by its GLOBAL normalizer over the minibatch (all passes, all ranks),
    so the split into passes and ranks cannot change the gradient. After each optimizer step the approximate
    KL between the sampling policy and the current one is measured over all ranks; past --target-kl the
    remaining updates of this batch are skipped (every rank sees the same number, so every rank stops).
    advantages: (B,) one per answer, or (B, T) one per token; weights: the sampler correction (B, T) or None.
    args: the parsed flags above. Returns sums over this rank's tokens and the updates' statistics."""
    mask = batch.mask
    logits_settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    totals = {"loss": 0.0, "clip_frac": 0.0, "ratio": 0.0, "approx_kl": 0.0, "kl": 0.0, "tokens": 0.0,
              "grad_norm": 0.0, "updates": 0}
    order = torch.randperm(len(mask), generator=torch.Generator().manual_seed(step))
    for epoch in range(args.ppo_epochs):
        for mb in order.tensor_split(args.minibatches):  # the same number of steps on every rank
            norm = all_reduce_sum(loss_normalizer(mask[mb], args.agg))
            n_tokens = all_reduce_sum(float(mask[mb].sum()))
            if n_tokens == 0:
                continue
            mb_kl = 0.0  # sum over this minibatch's tokens of k3(sampling policy || current policy)
            passes = micro_batches(batch.lengths[mb], args.micro_batch_tokens)
            for j, part in enumerate(passes):
                # DDP sums gradients over ranks only at the last pass (forward and backward)
                with no_sync(model, last=j == len(passes) - 1):
                    if not part:  # this rank has no answers left: join the others' collectives, train nothing
                        idle_pass(model)
                        continue
                    i, cols = mb[part].to(mask.device), int(batch.lengths[mb[part]].max())
                    x, y, m = batch.inputs[i, :cols], batch.targets[i, :cols], mask[i, :cols]
                    with autocast(x.device):
                        if args.entropy_coef > 0:
                            logp, entropy = model(x, y, with_entropy=True, **logits_settings)
                        else:
                            logp = model(x, y, **logits_settings)
                    adv = advantages[i] if advantages.dim() == 1 else advantages[i, :cols]
                    loss, st = policy_loss(logp, old_logp[i, :cols], adv, m, eps_low=args.eps_low, eps_high=args.eps_high,
                                           dual_clip=args.dual_clip, level=args.level, agg=args.agg,
                                           loss_type=args.loss, normalizer=norm, max_len=args.max_new_tokens,
                                           weights=None if weights is None else weights[i, :cols])
                    if args.correction == "token-mask" and args.mask_kl_coef > 0:  # prime-rl: pull towards the sampler
                        log_ratio = logp - batch.engine_logp[i, :cols]
                        loss = loss + args.mask_kl_coef * (log_ratio ** 2 * m).sum() / n_tokens
                    if args.entropy_coef > 0:  # a bonus for spread-out distributions: subtract the entropy
                        loss = loss - args.entropy_coef * (entropy * m).sum() / n_tokens
                    if ref_logp is not None:  # the KL penalty to the frozen start, token-mean
                        kl = kl_penalty(logp, ref_logp[i, :cols], args.kl_kind)
                        loss = loss + args.kl_beta * (kl * m).sum() / n_tokens
                        totals["kl"] += (kl_penalty(logp.detach(), ref_logp[i, :cols], "k3") * m).sum().item()
                    check_finite(loss, step + 1)
                    loss.backward()
                log_ratio = (logp.detach() - old_logp[i, :cols]) * m
                mb_kl += ((log_ratio.exp() - 1) - log_ratio).mul(m).sum().item()  # k3, as CleanRL logs it
                totals["loss"] += loss.item()
                totals["clip_frac"] += st["clip_frac"] * m.sum().item()
                totals["ratio"] += st["ratio_mean"] * m.sum().item()
                totals["tokens"] += m.sum().item()
            totals["grad_norm"] += optimizer_step(model, optimizer, args.grad_clip)
            totals["updates"] += 1
            approx_kl = all_reduce_sum(mb_kl) / n_tokens
            totals["approx_kl"] += approx_kl
            if args.target_kl is not None and approx_kl > args.target_kl:
                return totals
    return totals


# ------------------------------------------------------------------------------------------------
# Rollouts: DAPO's dynamic sampling, and the overlong shaping

def dynamic_sampling(sample_round, need, max_rounds):
    """Groups whose answers all scored the same teach nothing (their advantages are all 0, and with no KL
    term their loss is exactly 0: trl#2703). DAPO samples more instead: sample_round(round, n) returns the
    Rollouts of n prompts' groups; flat groups are dropped and more are sampled, up to max_rounds rounds;
    the last round keeps everything it needs, flat or not, so the batch is always full.
    Returns (rollouts of `need` groups, {"groups": groups sampled, "flat": flat groups among them})."""
    kept, have, groups, flat = [], 0, 0, 0
    for round_ in range(max_rounds):
        if have == need:
            break
        rollouts = sample_round(round_, need - have)
        G = rollouts.group_size
        rewards = rollouts.rewards.view(-1, G)
        is_flat = (rewards.max(1).values == rewards.min(1).values).tolist()
        groups += len(is_flat)
        flat += sum(is_flat)
        last = round_ == max_rounds - 1
        keep = [g for g, f in enumerate(is_flat) if last or not f]
        kept.append(rollouts.select([g * G + j for g in keep for j in range(G)]))
        have += len(keep)
    return Rollouts.concat(kept), {"groups": groups, "flat": flat}


def overlong_penalty(length, max_len, buffer, penalty=1.0):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linear down to -penalty at max_len."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    return -penalty * min(1.0, (length - (max_len - buffer)) / buffer)


def main():
    import memory
    from chat_eval import heldout_scores
    from engine import Engine
    from model import load_config
    from rewards import Grader
    from tasks import CALCULATOR_SCHEMA, TOOLS, load_rl, overlap_warning, rl_prompts
    from tokenizer import Tokenizer

    args = parser.parse_args()
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    if args.data:  # held out: --eval-data, or the last 2% of --data
        rows = load_rl(args.data)
        eval_rows = load_rl(args.eval_data) if args.eval_data else rows[len(rows) - max(1, len(rows) // 50):]
        rows = rows if args.eval_data else rows[:len(rows) - len(eval_rows)]
        eval_rows = eval_rows[:args.eval_problems]
    else:
        rows = rl_prompts("train", args.num_prompts, seed=args.seed)
        eval_rows = rl_prompts("test", args.eval_problems, seed=args.seed)
    dist = init_dist(args.device, args.dist_timeout)
    device = dist.device
    seed_everything(args.seed, dist.rank)
    print_config(args, "chat_rl")
    if args.data and (warning := overlap_warning(rows, eval_rows)):  # the held-out rows should be new to training
        print0(warning)
    out_dir = run_dir("rl", args.run_name)
    log = MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), wandb_project=args.wandb, run_name=f"rl/{args.run_name}",
                        config=vars(args))
    if args.prompts_per_step % dist.world_size:
        raise UserError(f"--prompts-per-step {args.prompts_per_step} must be a multiple of the number of ranks ({dist.world_size})")

    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"))
    tok = Tokenizer.load(init)
    tool_schemas = [CALCULATOR_SCHEMA] if args.tools else None
    G = args.group_size
    local_prompts = args.prompts_per_step // dist.world_size
    # know before you OOM: the policy trains; the reference and any grader model only run forward
    policy, graders = memory.Shape.of(load_config(init)), memory.grader_shapes(args.reward)
    prompt_len = max(len(tok.render_for_completion(r["prompt"], tools=r.get("tools") or tool_schemas)) for r in rows[:256])
    memory.check(memory.estimate(
        trained=[policy], frozen=[policy] * (args.kl_beta > 0 and not args.lora_rank) + graders, lora_rank=args.lora_rank, world_size=dist.world_size, fsdp=args.fsdp,
        micro_batch_tokens=min(args.micro_batch_tokens, -(-local_prompts * G // args.minibatches) * (prompt_len + args.max_new_tokens)),
        graded_tokens=min(args.micro_batch_tokens, -(-local_prompts * G // args.minibatches) * args.max_new_tokens),
        cuda=device.type == "cuda", grad_checkpointing=args.grad_checkpointing, sample_rows=local_prompts * G,
        sample_tokens=prompt_len + args.max_new_tokens), device)
    ckpt = resume_checkpoint(out_dir) if args.resume else None
    # float32 master weights; under torchrun wrapped in DDP, or sharded with --fsdp
    model = wrap_model(load_model(ckpt or init, fsdp=args.fsdp, lora=lora_options(args, resume=bool(ckpt))),
                       fsdp=args.fsdp)
    unwrap(model).grad_checkpointing = args.grad_checkpointing
    args.lr = learning_rate(args.lr, "rl", unwrap(model).config)
    optimizer = make_optimizer(model, args.lr)
    start_step, train_clock = 0, 0.0  # train_clock: seconds in steps, evaluation excluded (--time-budget)
    if ckpt:
        state = load_training_state(ckpt, optimizer, model)
        start_step, train_clock = state["step"], state["train_seconds"]
        print0(f"resumed from {ckpt} at step {start_step} ({train_clock:.0f} s of training)")
    elif dist.is_main and os.path.exists(log.path):
        os.remove(log.path)
    ref_model = None
    if args.kl_beta > 0:  # the frozen start (compute dtype; LoRA: the adapters off); with beta = 0 not even loaded
        ref_model = reference_model(model, init, args.fsdp)
    grader = Grader(args.reward, tok, device, rubric=args.rubric)  # a reward model among the graders stays whole on every rank
    engine = Engine(unwrap(model), tok, tools=TOOLS if args.tools else None)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, tool_schemas=tool_schemas, max_tool_turns=args.max_tool_turns)
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; {len(rows)} prompts; "
           f"{args.prompts_per_step} prompts x {G} answers per step on {dist.world_size} rank(s); reward {args.reward}")

    def evaluate(step):
        t0 = time.time()
        scores = heldout_scores(model, tok, eval_rows, max_new_tokens=args.max_new_tokens, samples=args.pass_k,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=step,
                                use_tools=args.tools)
        print0(f"eval @ step {step} ({time.time() - t0:.0f}s): " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        return scores

    def sample_round(sampler, step, round_, n):
        """n prompts' groups, graded: a pure function of (seed, step, round, rank), so a resumed run samples
        what the uninterrupted one would, and ranks draw different prompts."""
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + round_ * 17 + dist.rank)
        batch_rows = [rows[i] for i in torch.randint(len(rows), (n,), generator=g).tolist()]
        rollouts = sample(sampler, batch_rows, grader, samples_per_prompt=G, seed=int(g.initial_seed()) % 2**31,
                          **sampling)
        if args.overlong_buffer:  # DAPO's soft overlong punishment, part of the reward
            shaping = torch.tensor([overlong_penalty(len(c.tokens), args.max_new_tokens, args.overlong_buffer,
                                                     args.overlong_penalty) for c in rollouts.completions])
            rollouts.reward_parts["overlong"] = shaping
            rollouts.rewards = rollouts.rewards + shaping
        return rollouts

    def sample_step(sampler, step):
        """The rollouts of one step, dynamic sampling included, drawn by `sampler` (whose weights are built
        once for all the rounds)."""
        with sampler.prepared():
            return dynamic_sampling(lambda round_, n: sample_round(sampler, step, round_, n), local_prompts,
                                    1 + (args.max_resample if args.dynamic_sampling else 0))

    snapshots = collections.deque()  # --staleness: engines over the weights of the last steps, oldest first
    pending = None                   # --off-policy: the next step's rollouts, being sampled in a thread
    sampler_thread = ThreadPoolExecutor(max_workers=1) if args.off_policy else None
    final_scores = None
    if start_step == 0 and eval_rows:  # every rank evaluates its share
        final_scores = evaluate(0)
        log.log(0, train_seconds=0.0, **{f"eval/{k}": v for k, v in final_scores.items()})
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="rl")
    for step in bar:
        t_step = time.time()
        lr = lr_at(step, args.steps, args.lr, args.warmup_steps, final_ratio=1.0)  # warmup, then constant
        set_lr(optimizer, lr)

        # 1. rollouts: this rank's prompts, G answers each, graded (dynamic sampling: mixed groups only);
        #    staleness = how many updates the sampling weights are behind the weights this batch trains
        if args.off_policy:  # this batch was sampled while the last one trained, by the weights before it
            rollouts, groups = pending.result() if pending is not None else sample_step(engine, step)
            staleness = int(pending is not None)
            pending = sampler_thread.submit(sample_step, engine.snapshot(), step + 1) if step + 1 < args.steps else None
        elif args.staleness:  # an experiment: sample with the weights of --staleness steps back
            snapshots.append(engine.snapshot())
            if len(snapshots) > args.staleness + 1:
                snapshots.popleft()
            rollouts, groups = sample_step(snapshots[0], step)
            staleness = len(snapshots) - 1
        else:
            rollouts, groups = sample_step(engine, step)
            staleness = 0
        t_sample = time.time() - t_step

        # 2. advantages (one per answer, relative to its group), the tensors, and the snapshot of the
        #    policy that sampled (and of the reference), before any update on this batch
        t1 = time.time()
        adv = step_advantages(rollouts.rewards, G, args.scale, args.estimator)
        batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, device, args.mask_truncated)
        adv = adv.to(device)
        mask = batch.mask
        logits_settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        old_logp, entropy = batch_logprobs(model, batch, args.micro_batch_tokens, with_entropy=True, **logits_settings)
        ref_logp = None if ref_model is None else batch_logprobs(ref_model, batch, args.micro_batch_tokens,
                                                                 **logits_settings)
        weights = sampler_correction(old_logp, batch.engine_logp, mask, args.correction, cap=args.tis_cap,
                                     eps=args.mask_eps)

        # 3. the update: --ppo-epochs passes of --minibatches optimizer steps on this batch
        totals = update_policy(model, optimizer, batch, old_logp=old_logp, advantages=adv, ref_logp=ref_logp,
                               weights=weights, step=step, args=args)
        t_train = time.time() - t1
        train_clock += time.time() - t_step

        # 4. log: every number summed over ranks, then divided by its global count
        s = all_reduce_dict(rollouts.stats())  # the same names on every rank: one collective
        n_ans, n_tok = s["answers"], max(1.0, all_reduce_sum(float(mask.sum())))
        n_tok_updates = max(1.0, all_reduce_sum(totals["tokens"]))
        metrics = {
            "reward": s["reward_sum"] / n_ans,
            "accuracy": s["correct"] / n_ans,
            **{k: v / n_ans for k, v in s.items() if k.startswith("reward/")},
            **{k: v for k, v in s.items() if k.startswith("count/")},
            "entropy": all_reduce_sum(float((entropy * mask).sum())) / n_tok,  # of the sampling distribution
            "clip_frac": all_reduce_sum(totals["clip_frac"]) / n_tok_updates,
            "ratio_mean": all_reduce_sum(totals["ratio"]) / n_tok_updates,
            "approx_kl": totals["approx_kl"] / max(1, totals["updates"]),
            "updates": totals["updates"],
            "loss": all_reduce_sum(totals["loss"]) / max(1, totals["updates"]),
            "grad_norm": totals["grad_norm"] / max(1, totals["updates"]),
            "verifier_errors": all_reduce_sum(float(len(rollouts.errors))),
            "length_mean": s["length_sum"] / n_ans,
            "length_max": max(len(c.tokens) for c in rollouts.completions),
            "truncated_frac": s["truncated"] / n_ans,
            "tool_use_rate": s["tool_answers"] / n_ans,  # answers that called a tool
            "tool_turns": s["tool_calls"] / n_ans,  # tool-calling turns per answer
            "tool_errors": s["tool_errors"] / n_ans,  # tool results that were errors, per answer
            "accuracy_with_tool": s["correct_with_tool"] / max(1.0, s["tool_answers"]),
            "accuracy_without_tool": (s["correct"] - s["correct_with_tool"]) / max(1.0, n_ans - s["tool_answers"]),
            "flat_group_frac": all_reduce_sum(float(groups["flat"])) / max(1.0, all_reduce_sum(float(groups["groups"]))),
            "logprob_mismatch": all_reduce_sum(float(((old_logp - batch.engine_logp).abs() * mask).sum())) / n_tok,
            "sample_tok_per_s": all_reduce_sum(s["length_sum"] / dist.world_size / max(t_sample, 1e-9)),
            "train_tok_per_s": all_reduce_sum(float(mask.sum()) * args.ppo_epochs / max(t_train, 1e-9)),
            "staleness": staleness,
            "correction_mean": all_reduce_sum(float(weights.sum())) / n_tok,  # the sampler correction's mean weight
            "masked_frac": all_reduce_sum(float(((weights == 0) & (mask > 0)).sum())) / n_tok,
            "lr": lr,
            "train_seconds": train_clock,
            "peak_mem_mb": peak_memory_mb(device),
        }
        if ref_model is not None:
            metrics["kl"] = all_reduce_sum(totals["kl"]) / n_tok_updates
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
            save_checkpoint(out_dir, step + 1, model, tok, optimizer,
                            {"run_config": vars(args), "train_seconds": train_clock})
        if over_budget:
            print0(f"time budget of {args.time_budget:g} s spent after {step + 1} steps")
            break
    if sampler_thread is not None:
        sampler_thread.shutdown(wait=True)  # a batch still being sampled for a step that will not run

    if eval_rows:
        scores = final_scores if final_scores is not None and start_step < args.steps else evaluate(args.steps)
        if dist.is_main:
            write_eval(out_dir, scores)
    log.close()


if __name__ == "__main__":
    run_main(main)
