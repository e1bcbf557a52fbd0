"""
PPO with a learned critic: the InstructGPT / Tülu 3 recipe, every network and every step in plain sight.

Four networks run at once:
    actor      the policy being trained (starts from the SFT model)
    critic     a value head on a GPT trunk, trained alongside: from any point of an answer it predicts
               how good the rest will turn out. Started from the reward model, as InstructGPT and
               Tülu 3 do (a trunk that already reads answers for quality); without one, from the SFT
               trunk with a fresh head that predicts 0 everywhere
    reward     a verifier of the final answer (the default), or a reward model (--reward rm:PATH)
    reference  a frozen copy of the start; the per-token KL against it is subtracted from the reward

One step, in the order verl runs it: generate -> log-probs (actor) -> reference log-probs -> values
(critic) -> rewards (score at the last answer token, -beta * KL at every token) -> advantages (GAE)
-> critic update -> actor update, for --ppo-epochs passes of --minibatches optimizer steps each.

    PPO          Schulman et al. 2017                     https://arxiv.org/abs/1707.06347
    GAE          Schulman et al. 2015                     https://arxiv.org/abs/1506.02438
    RLHF + KL    Ziegler et al. 2019 (adaptive KL)        https://arxiv.org/abs/1909.08593
    InstructGPT  Ouyang et al. 2022                       https://arxiv.org/abs/2203.02155
    Tülu 3       Lambert et al. 2024 (RLVR with PPO)      https://arxiv.org/abs/2411.15124

    python chat_ppo.py                                                  # 1 CPU, the embedded world
    torchrun --standalone --nproc_per_node=2 chat_ppo.py                # 2 CPU ranks (1 thread each)
    python chat_ppo.py --init /models/my-sft --critic-init /models/my-rm --data rl.jsonl --device cuda   # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_ppo.py --init ... --data rl.jsonl                      # N GPUs

Data as chat_rl.py: --data FILE.jsonl with rows {"prompt", "ground_truth", "verifier"} or verl's rows.
Writes $NANOPOST_HOME/ppo/<run>/ (the actor's checkpoints/, the critic's critic/checkpoints/, metrics.jsonl,
eval.json). --time-budget SECONDS stops after that much training time (evaluation not counted).
"""
import argparse
import os
import time

import torch

from chat_rl import kl_penalty, policy_loss, rollout_tensors, tis_weights  # the GRPO family's loss IS PPO's
from common import (IGNORE, MetricsLogger, all_reduce_sum, autocast, broadcast_parameters, check_finite,
                    cleanup_dist, init_dist, latest_checkpoint, load_training_state, lr_at, make_optimizer,
                    nanopost_home, optimizer_step, peak_memory_mb, print0, print_config, progress,
                    resolve_model_path, run_dir, save_checkpoint, seed_everything, set_lr, write_eval)

parser = argparse.ArgumentParser(description="PPO with actor, critic, reward and reference")
parser.add_argument("--init", default=None, help="actor (and reference) model folder or run dir (default: the SFT run)")
parser.add_argument("--critic-init", default=None, help="critic trunk: an RM or LM folder / run dir "
                    "(default: $NANOPOST_HOME/rm/default, else the --init model with a fresh value head)")
parser.add_argument("--run-name", default="default")
parser.add_argument("--device", default="auto")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data", default=None, help="RL JSONL (default: the embedded world's problems)")
parser.add_argument("--num-prompts", type=int, default=4000, help="embedded-world training prompts")
# rollouts
parser.add_argument("--steps", type=int, default=60, help="rollout batches (each followed by optimizer steps)")
parser.add_argument("--time-budget", type=float, default=0, help="stop after this many seconds of training, evaluation excluded (0: off)")
parser.add_argument("--prompts-per-step", type=int, default=64, help="prompts per rollout batch, all ranks together")
parser.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt (the critic is the baseline, no group needed)")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--top-k", type=int, default=None)
parser.add_argument("--top-p", type=float, default=None)
parser.add_argument("--tools", action="store_true", help="offer the calculator: multi-turn tool rollouts")
parser.add_argument("--max-tool-turns", type=int, default=4)
# rewards
parser.add_argument("--reward", default="verifier", help="'verifier' (per-row) or 'rm:PATH' (a reward model)")
parser.add_argument("--truncated-reward", type=float, default=None, help="score of an answer cut at the length limit, instead of its grade (e.g. -1 with an RM)")
parser.add_argument("--kl-beta", type=float, default=0.05, help="weight of the per-token KL penalty in the reward")
parser.add_argument("--kl-kind", choices=["k1", "k2", "k3"], default="k1", help="KL estimator in the reward (k1: unbiased log-ratio)")
parser.add_argument("--kl-target", type=float, default=None, help="adaptive KL (Ziegler et al.): the per-answer KL to steer beta towards")
parser.add_argument("--kl-horizon", type=float, default=10000, help="adaptive KL: answers over which beta may move by ~e^0.2")
# advantages and losses
parser.add_argument("--gamma", type=float, default=1.0)
parser.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
parser.add_argument("--whiten", action=argparse.BooleanOptionalAction, default=True, help="normalize advantages over the batch")
parser.add_argument("--eps-low", type=float, default=0.2)
parser.add_argument("--eps-high", type=float, default=0.2, help="0.2: classic symmetric PPO clip")
parser.add_argument("--value-clip", type=float, default=0.2, help="how far a value may move from its snapshot per batch (0: off)")
parser.add_argument("--tis-cap", type=float, default=2.0, help="truncated importance sampling cap on trainer/engine ratios (0: off)")
# optimization
parser.add_argument("--ppo-epochs", type=int, default=2, help="passes over each rollout batch")
parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass (per model)")
parser.add_argument("--device-batch-size", type=int, default=32, help="sequences per forward pass")
parser.add_argument("--lr", type=float, default=1e-4, help="actor learning rate")
parser.add_argument("--critic-lr", type=float, default=5e-4)
parser.add_argument("--warmup-steps", type=int, default=3)
parser.add_argument("--freeze-actor-steps", type=int, default=4, help="train only the critic for the first N steps: a critic "
                    "started from the RM speaks the RM's scale, not the reward's, and its first advantages are noise")
parser.add_argument("--grad-clip", type=float, default=1.0)
# evaluation and checkpoints
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--eval-problems", type=int, default=200)
parser.add_argument("--pass-k", type=int, default=4, help="pass@1..k at --temperature, besides greedy pass@1")
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--resume", action="store_true")


# ------------------------------------------------------------------------------------------------
# Rewards: one score at the end of the answer, a KL penalty at every token

def token_rewards(scores, logp, ref_logp, mask, beta, kind="k1"):
    """Per-token rewards (B, T) and the per-token KL (B, T), OpenRLHF's compute_reward shape:
    -beta * KL(actor || reference) at every answer token, plus the answer's score at its LAST answer
    token (the last position of the mask: found from the mask, never by searching for a pad or eos id).
    k1 = log p_actor - log p_ref is the unbiased per-token KL (it may be negative on a single token).
    Worked numbers: score 1.0, k1 = 0.2, 0.1, 0.8 over three tokens, beta 0.1 -> -0.02, -0.01, +0.92."""
    mask = mask.to(logp.dtype)
    kl = kl_penalty(logp, ref_logp, kind) * mask
    rewards = -beta * kl
    last = mask.size(1) - 1 - mask.flip(1).argmax(1)      # index of each row's last answer token
    has_answer = (mask.sum(1) > 0).to(rewards.dtype)      # a row with no trained token gets nothing
    rewards[torch.arange(mask.size(0)), last] += scores.to(rewards.dtype) * has_answer
    return rewards, kl


def adaptive_kl_beta(beta, kl, target, horizon, n_answers):
    """The adaptive KL controller of Ziegler et al. 2019: nudge beta so that the KL per answer (the sum
    over its tokens) approaches `target`, proportionally to the error, clipped to +-20%:
        e = clip(kl / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n_answers / horizon)
    Worked numbers: beta 0.1, KL 9 nats vs target 6 -> e = +0.2 (clipped from 0.5); 64 answers over a
    horizon of 10000 -> beta * 1.00128 = 0.100128. KL 3 nats -> e = -0.2 -> 0.099872."""
    error = max(-0.2, min(0.2, kl / target - 1))
    return beta * (1 + error * n_answers / horizon)


# ------------------------------------------------------------------------------------------------
# Advantages: GAE over the answer tokens

@torch.no_grad()
def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalized advantage estimation over right-padded (B, T) tensors; returns (advantages, returns).

    At each answer token the temporal-difference error delta_t = r_t + gamma * V_next - V_t is how much
    better things look than the critic expected; the advantage is delta_t plus a (gamma * lam)-discounted
    share of all the deltas after it:  A_t = delta_t + gamma * lam * A_next;  returns R_t = A_t + V_t,
    the critic's targets. Only tokens in the mask count: a token outside it (prompt, padding, a forced
    tool-result token) neither receives nor passes on credit. The recursion steps over it, so V_next is
    the value at the next ANSWER token, and 0 after the last one.

    Worked numbers (seed), gamma 1, lam 0.95, reward 1 at the end only:
        t   r    V     V_next  delta   A_t
        0   0   0.50   0.55   +0.05   +0.436389
        1   0   0.55   0.60   +0.05   +0.406725
        2   0   0.60   0.70   +0.10   +0.375500
        3   0   0.70   0.80   +0.10   +0.290000     = 0.10 + 0.95 * 0.20
        4   1   0.80   0.00   +0.20   +0.200000     nothing after it to add"""
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        in_answer = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(in_answer, adv_t, 0.0)
        next_adv = torch.where(in_answer, adv_t, next_adv)          # skipped tokens keep the carry
        next_value = torch.where(in_answer, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def masked_mean_var(x, mask):
    """Mean and (population) variance of x over the masked tokens of the WHOLE batch, all ranks."""
    mask = mask.to(x.dtype)
    n = max(1.0, all_reduce_sum(float(mask.sum())))
    mean = all_reduce_sum(float((x * mask).sum())) / n
    var = all_reduce_sum(float((((x - mean) * mask) ** 2).sum())) / n
    return mean, var


def whiten(advantages, mask, eps=1e-8):
    """Advantages to mean 0, std 1 over the answer tokens of the global batch (every rank's, so a rank
    with only wrong answers is not told they were average). Zero outside the mask.
    Worked numbers: the seed's A = 0.436389, 0.406725, 0.375500, 0.290000, 0.200000 (mean 0.341723,
    std 0.086126) -> +1.0992, +0.7547, +0.3922, -0.6005, -1.6455."""
    mean, var = masked_mean_var(advantages, mask)
    return (advantages - mean) * (var + eps) ** -0.5 * mask.to(advantages.dtype)


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over the answer tokens: 1 is a perfect critic, 0 one no better than a
    constant, negative one that is worse than a constant."""
    _, var_r = masked_mean_var(returns, mask)
    _, var_err = masked_mean_var(returns - values, mask)
    return 1.0 - var_err / max(var_r, 1e-12)


# ------------------------------------------------------------------------------------------------
# The losses: the actor's is chat_rl.policy_loss (imported), the critic's is below

def value_loss(values, old_values, returns, mask, clip=0.2, normalizer=None):
    """The clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -c, c):
    within one rollout batch a value may not move more than `clip` from its snapshot; past that the
    larger (clipped) error is what counts, and it has no gradient. Returns (loss, stats).
    Aggregation: token-mean, the sum over answer tokens divided by `normalizer`, the GLOBAL answer-token
    count of the minibatch (all micro-batches, all ranks), as chat_rl.py's policy loss: so N ranks give
    one rank's gradient.
    Worked numbers: V_old 0.5, V 0.9 (moved +0.4, clipped to 0.7):
        R = 1.0: 0.5 * max(0.01, 0.09) = 0.045, the clipped side: no gradient
        R = 0.6: 0.5 * max(0.09, 0.01) = 0.045, the unclipped side: gradient V - R = +0.3"""
    mask = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        is_clipped = clipped > unclipped
    else:
        per_token, is_clipped = 0.5 * unclipped, torch.zeros_like(mask, dtype=torch.bool)
    loss = (per_token * mask).sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    n_tok = mask.sum().clamp(min=1)
    return loss, {"clip_frac": ((is_clipped.to(mask.dtype) * mask).sum() / n_tok).item()}


def ppo_losses(actor, critic, x, y, mask, old_logp, old_values, advantages, returns, normalizer,
               temperature=1.0, eps_low=0.2, eps_high=0.2, value_clip=0.2, weights=None):
    """Both losses on one micro-batch, each normalized by the minibatch's global answer-token count."""
    logp = actor.token_logprobs(x, y, temperature=temperature)
    pg_loss, pg_stats = policy_loss(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer=normalizer,
                                    weights=weights)
    v_loss, v_stats = value_loss(critic(x), old_values, returns, mask, value_clip, normalizer=normalizer)
    return pg_loss, v_loss, {"clip_frac": pg_stats["clip_frac"], "ratio_mean": pg_stats["ratio_mean"],
                             "value_clip_frac": v_stats["clip_frac"]}


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
    print_config(args, "chat_ppo")
    out_dir = run_dir("ppo", args.run_name)
    log = MetricsLogger(os.path.join(out_dir, "metrics.jsonl"))
    if args.prompts_per_step % dist.world_size:
        parser.error(f"--prompts-per-step must be a multiple of the number of ranks ({dist.world_size})")
    local_prompts = args.prompts_per_step // dist.world_size
    S = args.samples_per_prompt
    if local_prompts * S < args.minibatches:
        parser.error(f"each rank needs at least --minibatches answers per step ({local_prompts * S} < {args.minibatches})")

    rows = load_rl(args.data) if args.data else rl_prompts("train", args.num_prompts, seed=args.seed)
    eval_rows = rl_prompts("test", args.eval_problems, seed=args.seed)
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"))
    tok = Tokenizer.load(init)

    # the four networks. 1: the actor, the policy being trained
    ckpt = latest_checkpoint(out_dir) if args.resume else None
    critic_ckpt = latest_checkpoint(os.path.join(out_dir, "critic")) if args.resume else None
    actor = GPT.from_hf(ckpt or init, device=device, dtype=torch.float32)  # fp32 master weights
    # 2: the critic, a value head on a GPT trunk; by default the reward model's (InstructGPT, Tülu 3)
    critic_init = args.critic_init
    if critic_init is None:
        critic_init = os.path.join(nanopost_home(), "rm", "default")
        try:
            critic_init = resolve_model_path(critic_init)
        except FileNotFoundError:
            print0(f"no reward model at {critic_init} (train one with chat_rm.py to start the critic from it, "
                   f"as InstructGPT and Tülu 3 do); starting the critic from {init} with a fresh value head")
            critic_init = init
    else:
        critic_init = resolve_model_path(critic_init)
    critic = GPT.from_hf(critic_ckpt or critic_init, device=device, dtype=torch.float32, head="scalar")
    # 3: the reward: the row's verifier, or a reward model
    reward_model = None
    if args.reward.startswith("rm:"):
        from chat_rm import load_reward_model, score
        reward_model = load_reward_model(args.reward[3:], device)
    elif args.reward != "verifier":
        parser.error("--reward must be 'verifier' or 'rm:PATH'")
    # 4: the frozen reference (not loaded when there is no KL penalty)
    use_kl = args.kl_beta > 0 or args.kl_target is not None
    ref_model = GPT.from_hf(init, device=device, dtype=torch.float32).eval().requires_grad_(False) if use_kl else None

    actor_opt = make_optimizer(actor, args.lr)
    critic_opt = make_optimizer(critic, args.critic_lr)
    start_step, kl_beta, train_clock = 0, args.kl_beta, 0.0
    if ckpt:
        if critic_ckpt is None or os.path.basename(critic_ckpt) != os.path.basename(ckpt):
            raise FileNotFoundError(f"resuming from {ckpt} needs the critic checkpoint of the same step under "
                                    f"{os.path.join(out_dir, 'critic')}; found {critic_ckpt}")
        load_training_state(critic_ckpt, critic_opt)
        state = load_training_state(ckpt, actor_opt)
        start_step, kl_beta, train_clock = state["step"], state["kl_beta"], state["train_seconds"]
        print0(f"resumed from {ckpt} at step {start_step}")
    elif dist.is_main and os.path.exists(log.path):
        os.remove(log.path)
    broadcast_parameters(actor)
    broadcast_parameters(critic)
    engine = Engine(actor, tok, tools=TOOLS if args.tools else None)
    tool_schemas = [CALCULATOR_SCHEMA] if args.tools else None
    print0(f"actor {actor.num_params():,} parameters from {init}; critic {critic.num_params():,} from {critic_init}; "
           f"reward {args.reward}; reference {'loaded' if ref_model else 'off (no KL)'}; {len(rows)} prompts; "
           f"{args.prompts_per_step} prompts x {S} answers per step on {dist.world_size} rank(s)")

    def evaluate(step):
        t0 = time.time()
        greedy = evaluate_chat(actor, tok, eval_rows, max_new_tokens=args.max_new_tokens, use_tools=args.tools)
        sampled = evaluate_chat(actor, tok, eval_rows, num_samples=args.pass_k, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=step,
                                use_tools=args.tools)
        scores = {"pass@1": greedy["pass@1"], "format_rate": greedy["format_rate"], "stop_rate": greedy["stop_rate"],
                  **{f"{k}_t{args.temperature:g}": v for k, v in sampled.items() if k.startswith("pass@")}}
        print0(f"eval @ step {step} ({time.time() - t0:.0f}s): " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        return scores

    def grade(row, completion, rm_score=None):
        """The score of one answer: its verifier's grade, or the reward model's score."""
        if args.truncated_reward is not None and completion.finish_reason == "length":
            return args.truncated_reward
        if rm_score is not None:
            return rm_score
        try:
            return verify(row["verifier"], answer_text(tok.decode(completion.tokens)), row["ground_truth"])
        except Exception as e:  # a verifier that raises scores 0, is counted, and never stops the run
            verifier_errors.append(f"{type(e).__name__}: {e}")
            return 0.0

    verifier_errors = []
    if dist.is_main and start_step == 0:
        log.log(0, train_seconds=0.0, **{f"eval/{k}": v for k, v in evaluate(0).items()})
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="ppo")
    for step in bar:
        t_step = time.time()
        lr = lr_at(step, args.steps, args.lr, args.warmup_steps, final_ratio=1.0)  # warmup, then constant
        set_lr(actor_opt, lr)
        set_lr(critic_opt, lr_at(step, args.steps, args.critic_lr, args.warmup_steps, final_ratio=1.0))
        train_actor = step >= args.freeze_actor_steps

        # 1. generate: this rank's prompts (a pure function of seed, step and rank), S answers each, graded
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dist.rank)
        batch_rows = [rows[i] for i in torch.randint(len(rows), (local_prompts,), generator=g).tolist()]
        prompts = [tok.render_for_completion(r["prompt"], tools=tool_schemas) for r in batch_rows]
        outs = engine.generate(prompts, num_samples=S, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               seed=int(g.initial_seed()) % 2**31, max_tool_turns=args.max_tool_turns)
        verifier_errors.clear()
        rm_scores = [None] * len(outs) if reward_model is None else \
            score(reward_model, [prompts[o.prompt_index] + o.tokens for o in outs])  # one batched pass
        scores = torch.tensor([grade(batch_rows[o.prompt_index], o, s) for o, s in zip(outs, rm_scores)])
        x, y, mask, engine_logp, scores = rollout_tensors(prompts, outs, scores, tok.pad_id, device)
        t_sample = time.time() - t_step

        # 2. the snapshot, before any update on this batch: the actor's log-probs (the "old" policy of
        #    the ratio), the reference's, and the critic's values
        t1 = time.time()
        micro = [slice(i, i + args.device_batch_size) for i in range(0, len(outs), args.device_batch_size)]
        with torch.no_grad(), autocast(device):
            old_logp = torch.cat([actor.token_logprobs(x[s], y[s], temperature=args.temperature) for s in micro])
            ref_logp = old_logp if ref_model is None else \
                torch.cat([ref_model.token_logprobs(x[s], y[s], temperature=args.temperature) for s in micro])
            old_values = torch.cat([critic(x[s]) for s in micro]).float() * mask
        tis = tis_weights(old_logp, engine_logp, args.tis_cap) if args.tis_cap > 0 else None

        # 3. rewards (score at the end, KL everywhere) and advantages (GAE, then whitened over all ranks)
        rewards, kl = token_rewards(scores, old_logp, ref_logp, mask, kl_beta, args.kl_kind)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        if args.whiten:
            advantages = whiten(advantages, mask)
        explained_var = explained_variance(old_values, returns, mask)

        # 4. --ppo-epochs passes, each --minibatches optimizer steps of the critic and of the actor; each
        #    minibatch's losses are normalized by its GLOBAL answer-token count (see value_loss)
        st = {"policy_loss": 0.0, "value_loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "value_clip_frac": 0.0}
        n_updates = 0
        order = torch.randperm(len(outs), generator=torch.Generator().manual_seed(step))
        for epoch in range(args.ppo_epochs):
            for mb in order.tensor_split(args.minibatches):  # the same number of steps on every rank
                norm = all_reduce_sum(float(mask[mb].sum()))
                if norm == 0:
                    continue
                for s in range(0, len(mb), args.device_batch_size):
                    i = mb[s:s + args.device_batch_size]
                    with autocast(device):
                        pg_loss, v_loss, mst = ppo_losses(actor, critic, x[i], y[i], mask[i], old_logp[i],
                                                          old_values[i], advantages[i], returns[i], norm,
                                                          args.temperature, args.eps_low, args.eps_high,
                                                          args.value_clip, None if tis is None else tis[i])
                    check_finite(pg_loss + v_loss, step)
                    (pg_loss * train_actor + v_loss).backward()  # two separate networks: two separate grads
                    n_i = float(mask[i].sum())
                    st["policy_loss"] += pg_loss.item()
                    st["value_loss"] += v_loss.item()
                    for k in ("clip_frac", "ratio_mean", "value_clip_frac"):
                        st[k] += mst[k] * n_i
                optimizer_step(critic, critic_opt, args.grad_clip)
                if train_actor:
                    optimizer_step(actor, actor_opt, args.grad_clip)
                else:
                    actor_opt.zero_grad(set_to_none=True)
                n_updates += 1
        t_train = time.time() - t1

        # 5. the adaptive KL controller moves beta towards the target KL per answer
        n_ans = all_reduce_sum(float(len(outs)))
        kl_per_answer = all_reduce_sum(float(kl.sum())) / n_ans
        if args.kl_target is not None:
            kl_beta = adaptive_kl_beta(kl_beta, kl_per_answer, args.kl_target, args.kl_horizon, n_ans)

        # 6. log (every number summed over ranks) and stop when the time budget is spent
        train_clock += time.time() - t_step
        lengths = torch.tensor([len(o.tokens) for o in outs], dtype=torch.float)
        n_tok = max(1.0, all_reduce_sum(float(mask.sum())))
        n_passes = n_tok * args.ppo_epochs
        sampled_tokens = float(lengths.sum())
        metrics = {
            "reward": all_reduce_sum(float(scores.sum())) / n_ans,               # the score, before the KL penalty
            "accuracy": all_reduce_sum(float((scores >= 1.0).sum())) / n_ans,
            "kl": all_reduce_sum(float(kl.sum())) / n_tok,                       # per token (k-estimator of --kl-kind)
            "kl_per_answer": kl_per_answer,
            "kl_beta": kl_beta,
            "value_loss": all_reduce_sum(st["value_loss"]) / max(1, n_updates),
            "policy_loss": all_reduce_sum(st["policy_loss"]) / max(1, n_updates),
            "explained_var": explained_var,
            "value_mean": all_reduce_sum(float(old_values.sum())) / n_tok,
            "return_mean": all_reduce_sum(float(returns.sum())) / n_tok,
            "clip_frac": all_reduce_sum(st["clip_frac"]) / n_passes,
            "value_clip_frac": all_reduce_sum(st["value_clip_frac"]) / n_passes,
            "ratio_mean": all_reduce_sum(st["ratio_mean"]) / n_passes,
            "entropy": all_reduce_sum(float(-(engine_logp * mask).sum())) / n_tok,  # E[-log p] of sampled tokens
            "verifier_errors": all_reduce_sum(float(len(verifier_errors))),
            "length_mean": all_reduce_sum(sampled_tokens) / n_ans,
            "length_max": lengths.max().item(),
            "truncated_frac": all_reduce_sum(float(sum(o.finish_reason == "length" for o in outs))) / n_ans,
            "logprob_mismatch": all_reduce_sum(float(((old_logp - engine_logp).abs() * mask).sum())) / n_tok,
            "sample_tok_per_s": all_reduce_sum(sampled_tokens / max(t_sample, 1e-9)),
            "train_tok_per_s": all_reduce_sum(float((y != IGNORE).sum()) * args.ppo_epochs / max(t_train, 1e-9)),
            "tok_per_s": all_reduce_sum(sampled_tokens) / max(time.time() - t_step, 1e-9),
            "lr": lr,
            "train_seconds": train_clock,
            "peak_mem_mb": peak_memory_mb(device),
        }
        # rank 0's clock decides for all (the other ranks' clocks include waiting for its evaluations)
        over_budget = args.time_budget > 0 and all_reduce_sum(train_clock if dist.is_main else 0.0) >= args.time_budget
        last = step + 1 == args.steps or over_budget
        if dist.is_main and ((step + 1) % args.eval_every == 0 or last):
            final_scores = evaluate(step + 1)
            metrics.update({f"eval/{k}": v for k, v in final_scores.items()})
        if verifier_errors:
            print0(f"step {step + 1}: {len(verifier_errors)} verifier error(s) scored 0, e.g. {verifier_errors[0]}")
        log.log(step + 1, **metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", ev=f"{explained_var:.2f}", kl=f"{metrics['kl']:.4f}",
                        refresh=False)
        if (step + 1) % args.save_every == 0 or last:
            state = {"run_config": vars(args), "kl_beta": kl_beta, "train_seconds": train_clock}
            save_checkpoint(os.path.join(out_dir, "critic"), step + 1, critic, tok, critic_opt, state)
            save_checkpoint(out_dir, step + 1, actor, tok, actor_opt, state)
        if over_budget:
            print0(f"time budget of {args.time_budget:g} s spent after {step + 1} steps")
            break

    if dist.is_main:
        write_eval(out_dir, final_scores if start_step < args.steps else evaluate(start_step))
        print0(f"peak memory {peak_memory_mb(device):.0f} MiB")
    cleanup_dist()
