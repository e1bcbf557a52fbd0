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

    python chat_rl.py                                                   # 1 CPU, the embedded world
    torchrun --standalone --nproc_per_node=2 chat_rl.py                 # 2 CPU ranks (1 thread each)
    python chat_rl.py --init /models/my-sft --data rl.jsonl --device cuda            # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_rl.py --init ... --data rl.jsonl   # N GPUs

Data: --data FILE.jsonl with rows {"prompt": [...] or str, "ground_truth": ..., "verifier": ...}, or
verl's rows (data_source, reward_model.ground_truth). Writes $NANOPOST_HOME/rl/<run>/.
"""
import argparse
import math
import os
import time

import torch

from common import (IGNORE, MetricsLogger, all_reduce_sum, autocast, broadcast_parameters, check_finite,
                    cleanup_dist, init_dist, latest_checkpoint, load_training_state, lr_at, make_optimizer,
                    nanopost_home, optimizer_step, print0, print_config, progress, resolve_model_path, run_dir,
                    save_checkpoint, seed_everything, set_lr, write_eval)

parser = argparse.ArgumentParser(description="GRPO-family RL with verifiable rewards")
parser.add_argument("--init", default=None, help="model folder or run dir (default: the SFT run)")
parser.add_argument("--run-name", default="default")
parser.add_argument("--device", default="auto")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data", default=None, help="RL JSONL (default: the embedded world's problems)")
parser.add_argument("--num-prompts", type=int, default=4000, help="embedded-world training prompts")
# rollouts
parser.add_argument("--steps", type=int, default=60, help="rollout batches (each followed by optimizer steps)")
parser.add_argument("--time-budget", type=float, default=0, help="stop after this many seconds of training, evaluation excluded (0: off)")
parser.add_argument("--prompts-per-step", type=int, default=64, help="prompts per rollout batch, all ranks together")
parser.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt (G)")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--top-k", type=int, default=None)
parser.add_argument("--top-p", type=float, default=None)
parser.add_argument("--tools", action="store_true", help="offer the calculator: multi-turn tool rollouts")
parser.add_argument("--max-tool-turns", type=int, default=4)
# rewards
parser.add_argument("--reward", default="verifier", help="'verifier' (per-row) or 'rm:PATH' (a reward model)")
parser.add_argument("--format-penalty", type=float, default=0.0, help="subtracted when the answer has no parseable final answer")
parser.add_argument("--overlong-buffer", type=int, default=0, help="DAPO soft overlong penalty over the last N tokens before the limit (0: off)")
parser.add_argument("--overlong-penalty", type=float, default=1.0, help="the penalty at the limit")
# advantages and loss
parser.add_argument("--estimator", choices=["grpo", "rloo"], default="grpo", help="group mean, or leave-one-out mean, baseline")
parser.add_argument("--scale", choices=["group", "batch", "none"], default="group", help="divide by the group's std, the batch's, or not at all (Dr. GRPO)")
parser.add_argument("--loss", choices=["ppo", "cispo"], default="ppo", dest="kind")
parser.add_argument("--level", choices=["token", "sequence"], default="token", help="token ratios, or GSPO's sequence ratio")
parser.add_argument("--agg", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"], default="token-mean")
parser.add_argument("--eps-low", type=float, default=0.2)
parser.add_argument("--eps-high", type=float, default=0.28, help="clip-higher (DAPO); 0.2 for symmetric PPO")
parser.add_argument("--dual-clip", type=float, default=None, help="dual-clip bound for negative advantages (e.g. 3.0)")
parser.add_argument("--kl-beta", type=float, default=0.0, help="KL penalty weight against the frozen start (0: no reference model)")
parser.add_argument("--kl-kind", choices=["k1", "k2", "k3"], default="k2", help="KL estimator in the loss (k2: its gradient is the exact KL gradient)")
parser.add_argument("--tis-cap", type=float, default=2.0, help="truncated importance sampling cap on trainer/engine ratios (0: off)")
parser.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True, help="drop groups with equal rewards and sample more (DAPO)")
parser.add_argument("--max-resample", type=int, default=3, help="extra sampling rounds per step for dynamic sampling")
parser.add_argument("--mask-truncated", action="store_true", help="answers cut off at the length limit give no gradient")
# optimization
parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass")
parser.add_argument("--device-batch-size", type=int, default=32, help="sequences per forward pass")
parser.add_argument("--lr", type=float, default=1e-4)
parser.add_argument("--warmup-steps", type=int, default=3)
parser.add_argument("--grad-clip", type=float, default=1.0)
# evaluation and checkpoints
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--eval-problems", type=int, default=200)
parser.add_argument("--pass-k", type=int, default=4, help="pass@1..k at --temperature, besides greedy pass@1")
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--resume", action="store_true")


# ------------------------------------------------------------------------------------------------
# Advantages

def group_advantages(rewards, group_size, scale="group", estimator="grpo", eps=1e-6):
    """One advantage per answer, relative to its group of `group_size` answers to the same prompt.

    Worked numbers (seed): rewards [1, 0, 0, 1, 0, 1, 0, 0], mean 0.375, population std 0.4841:
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


# ------------------------------------------------------------------------------------------------
# The policy loss

def policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.2, dual_clip=None, level="token",
                agg="token-mean", kind="ppo", normalizer=None, max_len=None, weights=None):
    """The clipped importance-ratio objective, negated (a loss to minimize). Returns (loss, stats).

    logp: (B, T) log-probs under the policy being trained (with gradient); old_logp: the same tokens
    under the policy that sampled them, a snapshot taken before the first update on this batch;
    advantages: (B,) one per answer, or (B, T) per token; mask: (B, T), 1 on the answer's sampled tokens.
    weights: optional (B, T) detached per-token weights (truncated importance sampling).

    kind="ppo":   -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token. eps_high > eps_low is
                  DAPO's clip-higher: with eps 0.2 a rare token at p_old 0.10 can only reach 0.12;
                  at 0.28 it reaches 0.128, a common one at 0.82 is not bound either way (seed).
                  dual_clip=c also bounds the loss of a negative-advantage token at -c A.
    kind="cispo": -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log p: the weight is clipped and detached,
                  so no token is dropped from the gradient ("Wait", "However" keep theirs).
    level="sequence" (GSPO): one ratio per answer, exp(mean over its tokens of log r), the geometric
                  mean of the token ratios: seed deltas -0.02, +0.02, -0.02, +0.90, -0.01 give
                  exp(0.87 / 5) = 1.1901, inside the clip range where the raw token ratio 2.4596 is not.
                  Its value is per answer, but the gradient flows through each token's log-prob.
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
    if kind == "ppo":
        unclipped, clipped = -adv * ratio, -adv * clipped_ratio
        per_token = torch.maximum(unclipped, clipped)
        is_clipped = clipped > unclipped
        if dual_clip is not None:
            per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    elif kind == "cispo":
        per_token = -clipped_ratio.detach() * adv * logp
        is_clipped = clipped_ratio != ratio
    else:
        raise ValueError(f"unknown kind {kind!r}")
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


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token estimators of KL(policy || reference) from tokens sampled by the policy
    (Schulman, "Approximating KL divergence", 2020). With log r = ref_logp - logp:
        k1 = -log r                   unbiased value; its gradient is zero in expectation
        k2 = (log r)^2 / 2            biased value; its gradient is exactly the KL gradient
        k3 = (r - 1) - log r          unbiased, low-variance value; its gradient is that of the
                                      REVERSE KL(reference || policy) (trl#4637)
    So the loss uses k2 (--kl-kind, tested against the analytic gradient); k3 is the number to log.
    Worked numbers (seed): log p now - log p start = +0.20, +0.10, +0.80: mean k1 = +0.3667."""
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}")


def tis_weights(trainer_logp, engine_logp, cap):
    """Truncated importance sampling: the engine sampled with its own numerics (kernels, precision,
    top-k/top-p truncation), so reweight each token by min(p_trainer / p_engine, cap), detached.
    Worked numbers (seed): per-token ratios 0.9802, 1.0513, 0.9704, 2.4596, 0.8187 multiply to 2.0138;
    truncating each at 2.0 gives 1.6375."""
    return torch.exp(trainer_logp - engine_logp).clamp(max=cap).detach()


def overlong_penalty(length, max_len, buffer, penalty=1.0):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linear down to -penalty at max_len."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    return -penalty * min(1.0, (length - (max_len - buffer)) / buffer)


# ------------------------------------------------------------------------------------------------
# Rollouts

def rollout_tensors(prompts, completions, advantages, pad_id, device, mask_truncated=False):
    """Right-padded (inputs, targets, loss mask, engine log-probs, advantages) for training.
    The loss mask is 1 exactly on the answer tokens the model sampled: never the prompt, never a
    forced tool-result token, never padding."""
    seqs = [prompts[c.prompt_index] + c.tokens for c in completions]
    T = max(len(s) for s in seqs) - 1
    B = len(seqs)
    x = torch.full((B, T), pad_id, dtype=torch.long)
    y = torch.full((B, T), IGNORE, dtype=torch.long)
    m = torch.zeros(B, T)
    eng = torch.zeros(B, T)
    for b, (s, c) in enumerate(zip(seqs, completions)):
        n, p = len(s) - 1, len(prompts[c.prompt_index])
        x[b, :n] = torch.tensor(s[:-1])
        y[b, :n] = torch.tensor(s[1:])
        if not (mask_truncated and c.finish_reason == "length"):
            m[b, p - 1:n] = torch.tensor(c.mask, dtype=torch.float)
        eng[b, p - 1:n] = torch.tensor(c.logprobs)
    return x.to(device), y.to(device), m.to(device), eng.to(device), advantages.to(device)


if __name__ == "__main__":
    from chat_eval import evaluate_chat
    from rewards import answer_text, format_ok, verify
    from engine import Engine
    from model import GPT
    from tasks import CALCULATOR_SCHEMA, TOOLS, load_rl, rl_prompts
    from tokenizer import Tokenizer

    args = parser.parse_args()
    dist = init_dist(args.device)
    device = dist.device
    seed_everything(args.seed, dist.rank)
    print_config(args, "chat_rl")
    out_dir = run_dir("rl", args.run_name)
    log = MetricsLogger(os.path.join(out_dir, "metrics.jsonl"))
    if args.prompts_per_step % dist.world_size:
        parser.error(f"--prompts-per-step must be a multiple of the number of ranks ({dist.world_size})")

    rows = load_rl(args.data) if args.data else rl_prompts("train", args.num_prompts, seed=args.seed)
    eval_rows = rl_prompts("test", args.eval_problems, seed=args.seed)
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"))
    tok = Tokenizer.load(init)
    ckpt = latest_checkpoint(out_dir) if args.resume else None
    model = GPT.from_hf(ckpt or init, device=device, dtype=torch.float32)
    optimizer = make_optimizer(model, args.lr)
    start_step = 0
    if ckpt:
        start_step = load_training_state(ckpt, optimizer)["step"]
        print0(f"resumed from {ckpt} at step {start_step}")
    elif dist.is_main and os.path.exists(log.path):
        os.remove(log.path)
    broadcast_parameters(model)
    ref_model = None
    if args.kl_beta > 0:  # the frozen start; with beta = 0 it is not even loaded
        ref_model = GPT.from_hf(init, device=device, dtype=torch.float32).eval().requires_grad_(False)
    reward_model = None
    if args.reward.startswith("rm:"):
        from chat_rm import load_reward_model, score
        reward_model = load_reward_model(args.reward[3:], device)
    elif args.reward != "verifier":
        parser.error("--reward must be 'verifier' or 'rm:PATH'")
    engine = Engine(model, tok, tools=TOOLS if args.tools else None)
    tool_schemas = [CALCULATOR_SCHEMA] if args.tools else None
    G = args.group_size
    local_prompts = args.prompts_per_step // dist.world_size
    print0(f"model: {model.num_params():,} parameters from {init}; {len(rows)} prompts; "
           f"{args.prompts_per_step} prompts x {G} answers per step on {dist.world_size} rank(s)")

    def evaluate(step):
        t0 = time.time()
        greedy = evaluate_chat(model, tok, eval_rows, max_new_tokens=args.max_new_tokens, use_tools=args.tools)
        sampled = evaluate_chat(model, tok, eval_rows, num_samples=args.pass_k, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=step,
                                use_tools=args.tools)
        scores = {"pass@1": greedy["pass@1"], "format_rate": greedy["format_rate"], "stop_rate": greedy["stop_rate"],
                  **{f"{k}_t{args.temperature:g}": v for k, v in sampled.items() if k.startswith("pass@")}}
        print0(f"eval @ step {step} ({time.time() - t0:.0f}s): " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        return scores

    def grade(row, completion, rm_score=None):
        """Reward of one answer: the row's verifier (or the reward model's score), plus shaping."""
        text = answer_text(tok.decode(completion.tokens))
        if rm_score is not None:
            r = rm_score
        else:
            try:
                r = verify(row["verifier"], text, row["ground_truth"])
            except Exception as e:  # a verifier that raises scores 0, is counted, and never stops the run
                verifier_errors.append(f"{type(e).__name__}: {e}")
                r = 0.0
        if args.format_penalty and not format_ok(text):
            r -= args.format_penalty
        return r + overlong_penalty(len(completion.tokens), args.max_new_tokens, args.overlong_buffer,
                                    args.overlong_penalty)

    verifier_errors = []  # messages of the verifiers that raised during the current step
    train_clock = 0.0  # seconds spent in steps, evaluation excluded (--time-budget, and the x axis of a curve)
    if dist.is_main and start_step == 0:
        log.log(0, train_seconds=0.0, **{f"eval/{k}": v for k, v in evaluate(0).items()})
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="rl")
    for step in bar:
        lr = lr_at(step, args.steps, args.lr, args.warmup_steps, final_ratio=1.0)  # warmup, then constant
        set_lr(optimizer, lr)
        # 1. rollouts: this rank's prompts, G answers each, graded; with dynamic sampling, groups whose
        #    answers all scored the same are dropped and more prompts sampled, up to --max-resample rounds
        t0 = t_step = time.time()
        kept, n_groups, n_flat, sampled_tokens = [], 0, 0, 0
        verifier_errors.clear()
        for round_ in range(1 + (args.max_resample if args.dynamic_sampling else 0)):
            need = local_prompts - len(kept)
            if need <= 0:
                break
            # a pure function of (seed, step, round, rank): resumable, and ranks draw different prompts
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + round_ * 17 + dist.rank)
            batch_rows = [rows[i] for i in torch.randint(len(rows), (need,), generator=g).tolist()]
            prompt_ids = [tok.render_for_completion(r["prompt"], tools=tool_schemas) for r in batch_rows]
            outs = engine.generate(prompt_ids, num_samples=G, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                   seed=int(g.initial_seed()) % 2**31, max_tool_turns=args.max_tool_turns)
            sampled_tokens += sum(len(o.tokens) for o in outs)
            rm_scores = [None] * len(outs) if reward_model is None else \
                score(reward_model, [prompt_ids[o.prompt_index] + o.tokens for o in outs])  # one batched pass
            for i, r in enumerate(batch_rows):
                group = outs[i * G:(i + 1) * G]
                rewards = [grade(r, o, s) for o, s in zip(group, rm_scores[i * G:(i + 1) * G])]
                n_groups += 1
                flat = max(rewards) == min(rewards)
                n_flat += flat
                if flat and args.dynamic_sampling and round_ < args.max_resample:
                    continue  # teaches nothing: its advantages are all zero
                kept.append((prompt_ids[i], group, rewards))
        kept = kept[:local_prompts]
        t_sample = time.time() - t0

        # 2. advantages within each group; one prompt list for the whole local batch
        prompts = [p for p, _, _ in kept]
        completions = []
        for j, (_, group, _) in enumerate(kept):
            for o in group:
                o.prompt_index = j
                completions.append(o)
        rewards = torch.tensor([x for _, _, rs in kept for x in rs])
        adv = group_advantages(rewards, G, scale=args.scale, estimator=args.estimator)
        if args.scale == "batch":  # the batch's std spans all ranks: recompute with the global std
            n = all_reduce_sum(float(len(rewards)))
            mean = all_reduce_sum(float(rewards.sum())) / n
            var = all_reduce_sum(float(((rewards - mean) ** 2).sum())) / n
            adv = group_advantages(rewards, G, scale="none", estimator=args.estimator) / (math.sqrt(var) + 1e-6)
        x, y, mask, engine_logp, adv = rollout_tensors(prompts, completions, adv, tok.pad_id, device,
                                                       args.mask_truncated)

        # 3. the snapshot of the sampling policy (and the reference), before any update on this batch
        t1 = time.time()
        micro = [slice(i, i + args.device_batch_size) for i in range(0, len(completions), args.device_batch_size)]
        with torch.no_grad(), autocast(device):
            old_logp = torch.cat([model.token_logprobs(x[s], y[s], temperature=args.temperature) for s in micro])
            ref_logp = None if ref_model is None else \
                torch.cat([ref_model.token_logprobs(x[s], y[s], temperature=args.temperature) for s in micro])
        tis = tis_weights(old_logp, engine_logp, args.tis_cap) if args.tis_cap > 0 else None
        n_mask = mask.sum().clamp(min=1)
        mismatch = ((old_logp - engine_logp).abs() * mask).sum() / n_mask

        # 4. --ppo-epochs passes, each split into --minibatches optimizer steps; every minibatch's loss
        #    is normalized by its GLOBAL token (or answer) count, so ranks and micro-batches cannot bias it
        stats_sum = {"loss": 0.0, "clip_frac": 0.0, "ratio": 0.0, "kl": 0.0}
        n_updates = 0
        order = torch.randperm(len(completions), generator=torch.Generator().manual_seed(step))
        for epoch in range(args.ppo_epochs):
            for mb in order.chunk(args.minibatches):
                norm = all_reduce_sum(loss_normalizer(mask[mb], args.agg))
                if norm == 0:
                    continue
                for s in range(0, len(mb), args.device_batch_size):
                    idx = mb[s:s + args.device_batch_size]
                    with autocast(device):
                        logp = model.token_logprobs(x[idx], y[idx], temperature=args.temperature)
                        loss, st = policy_loss(logp, old_logp[idx], adv[idx], mask[idx], args.eps_low, args.eps_high,
                                               args.dual_clip, args.level, args.agg, args.kind, normalizer=norm,
                                               max_len=args.max_new_tokens,
                                               weights=None if tis is None else tis[idx])
                        if ref_model is not None:
                            kl = kl_penalty(logp, ref_logp[idx], args.kl_kind)
                            loss = loss + args.kl_beta * (kl * mask[idx]).sum() / norm
                            stats_sum["kl"] += (kl_penalty(logp.detach(), ref_logp[idx], "k3") * mask[idx]).sum().item()
                    check_finite(loss, step)
                    loss.backward()
                    stats_sum["loss"] += loss.item()
                    stats_sum["clip_frac"] += st["clip_frac"] * mask[idx].sum().item()
                    stats_sum["ratio"] += st["ratio_mean"] * mask[idx].sum().item()
                optimizer_step(model, optimizer, args.grad_clip)
                n_updates += 1
        t_train = time.time() - t1

        # 5. log (every number summed over ranks)
        train_clock += time.time() - t_step
        lengths = torch.tensor([len(c.tokens) for c in completions], dtype=torch.float)
        n_ans = all_reduce_sum(float(len(completions)))
        n_tok_all = all_reduce_sum(float(mask.sum()))
        metrics = {
            "reward": all_reduce_sum(float(rewards.sum())) / n_ans,
            "accuracy": all_reduce_sum(float((rewards >= 1.0).sum())) / n_ans,
            "entropy": all_reduce_sum(float(-(engine_logp * mask).sum())) / max(1.0, n_tok_all),  # E[-log p]
            "clip_frac": all_reduce_sum(stats_sum["clip_frac"]) / max(1.0, n_tok_all * args.ppo_epochs),
            "ratio_mean": all_reduce_sum(stats_sum["ratio"]) / max(1.0, n_tok_all * args.ppo_epochs),
            "loss": all_reduce_sum(stats_sum["loss"]) / max(1, n_updates),
            "verifier_errors": all_reduce_sum(float(len(verifier_errors))),
            "length_mean": all_reduce_sum(float(lengths.sum())) / n_ans,
            "length_max": lengths.max().item(),
            "truncated_frac": all_reduce_sum(float(sum(c.finish_reason == "length" for c in completions))) / n_ans,
            "flat_group_frac": all_reduce_sum(float(n_flat)) / max(1.0, all_reduce_sum(float(n_groups))),
            "logprob_mismatch": all_reduce_sum(float(mismatch)) / dist.world_size,
            "sample_tok_per_s": all_reduce_sum(sampled_tokens / max(t_sample, 1e-9)),
            "train_tok_per_s": all_reduce_sum(float((y != IGNORE).sum()) * args.ppo_epochs / max(t_train, 1e-9)),
            "lr": lr,
            "train_seconds": train_clock,
        }
        if ref_model is not None:
            metrics["kl"] = all_reduce_sum(stats_sum["kl"]) / max(1.0, n_tok_all * args.ppo_epochs)
        # rank 0's clock decides for all (the other ranks' clocks include waiting for its evaluations)
        over_budget = args.time_budget > 0 and all_reduce_sum(train_clock if dist.is_main else 0.0) >= args.time_budget
        last = step + 1 == args.steps or over_budget
        if dist.is_main and ((step + 1) % args.eval_every == 0 or last):
            final_scores = evaluate(step + 1)
            metrics.update({f"eval/{k}": v for k, v in final_scores.items()})
        if verifier_errors:
            print0(f"step {step + 1}: {len(verifier_errors)} verifier error(s) scored 0, e.g. {verifier_errors[0]}")
        log.log(step + 1, **metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}", refresh=False)
        if (step + 1) % args.save_every == 0 or last:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, {"run_config": vars(args)})
        if over_budget:
            print0(f"time budget of {args.time_budget:g} s spent after {step + 1} steps")
            break

    if dist.is_main:
        write_eval(out_dir, final_scores if start_step < args.steps else evaluate(args.steps))
    cleanup_dist()
