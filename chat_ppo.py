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
-> critic update -> actor update, for --ppo-epochs passes of --minibatches optimizer steps each. The
update is written out in ppo_losses, CleanRL's order: the ratio, the approximate KL and the clip fraction,
the clipped surrogate, the clipped value loss, the entropy, and the two sums the optimizers step on.

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

import peak_memory
from checkpoint import (load_config, load_model, load_tokenizer, load_training_state, reference_model,
                        resolve_model_path, resume_checkpoint, resume_state, save_checkpoint)
from common import (UserError, all_reduce_dict, all_reduce_sum, autocast, check_finite, fit_warmup, global_mean_var,
                    idle_pass, learning_rate, lr_at, make_optimizer, nanopost_home, optimizer_step, peak_memory_mb,
                    print0, progress, run_main, set_lr, unwrap, wrap_model)
from data import rl_rows
from decontaminate import overlap_warning
from engine import Engine
from evaluation import heldout_scores
from lora import adapters_off, add_lora_flags, lora_options
from packing import micro_batches
from rewards import Grader, grader_shapes
from rollout import (add_rollout_flags, batch_logprobs, clipped_surrogate, draw_prompts, importance_ratio,
                     minibatches_of, prompt_length, prompts_per_rank, rollout_metrics, sample, sampler_correction,
                     token_rewards, training_batch, whiten)
from rundir import add_run_flags, open_run, start_run, write_eval
from tasks import CALCULATOR_SCHEMA, TOOLS
from tokenizer import settle_chat_template

parser = argparse.ArgumentParser(description="PPO with actor, critic, reward and reference")
parser.add_argument("--init", default=None, help="actor (and reference) model folder or run dir (default: the SFT run)")
parser.add_argument("--critic-init", default=None, help="critic trunk: an RM or LM folder / run dir "
                    "(default: $NANOPOST_HOME/rm/default, else the --init model with a fresh value head)")
add_rollout_flags(parser)  # --data, --steps, --prompts-per-step, --max-new-tokens, --temperature, --reward, ...
# rollouts
parser.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt (the critic is the baseline, "
                    "no group needed)")
# rewards
parser.add_argument("--truncated-reward", type=float, default=None, help="score of an answer cut at the length limit, "
                    "instead of its grade (e.g. -1 with an RM)")
parser.add_argument("--kl-beta", type=float, default=0.05, help="weight of the per-token KL penalty in the reward")
parser.add_argument("--kl-kind", choices=["k1", "k2", "k3"], default="k1", help="KL estimator in the reward (k1: "
                    "unbiased log-ratio)")
parser.add_argument("--kl-target", type=float, default=None, help="adaptive KL (Ziegler et al.): the per-answer KL to "
                    "steer beta towards")
parser.add_argument("--kl-horizon", type=float, default=10000, help="adaptive KL: answers over which beta may move by "
                    "~e^0.2")
# advantages and losses
parser.add_argument("--gamma", type=float, default=1.0)
parser.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
parser.add_argument("--whiten", action=argparse.BooleanOptionalAction, default=True, help="normalize advantages over "
                    "the batch")
parser.add_argument("--eps-low", type=float, default=0.2)
parser.add_argument("--eps-high", type=float, default=0.2, help="0.2: classic symmetric PPO clip")
parser.add_argument("--value-clip", type=float, default=0.2, help="how far a value may move from its snapshot per "
                    "batch (0: off)")
parser.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus in the actor's loss")
parser.add_argument("--target-kl", type=float, default=None, help="stop this step's updates once the approximate KL to "
                    "the sampling policy exceeds it (CleanRL)")
# optimization
parser.add_argument("--ppo-epochs", type=int, default=2, help="passes over each rollout batch")
parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass (per model)")
parser.add_argument("--lr", type=float, default=None, help="actor learning rate (default: 1e-4 on the embedded world, "
                    "1e-6 for a real model)")
parser.add_argument("--critic-lr", type=float, default=None, help="default: 5e-4 on the embedded world, 1e-5 for a "
                    "real model")
parser.add_argument("--freeze-actor-steps", type=int, default=4, help="train only the critic for the first N steps: a "
                    "critic started from the RM speaks the RM's scale, not the reward's, and its first advantages are "
                    "noise")
add_run_flags(parser, "ppo")  # --run-name, --seed, --device, --resume, --wandb, --fsdp, ...
add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# Rewards: one score at the end of the answer, a KL penalty at every token (rollout.token_rewards)

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

    Example: gamma 1, lam 0.95, reward 1 at the last token only:
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


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over the answer tokens: 1 is a perfect critic, 0 one no better than a
    constant, negative one that is worse than a constant."""
    _, var_r = global_mean_var(returns, mask)
    _, var_err = global_mean_var(returns - values, mask)
    return 1.0 - var_err / max(var_r, 1e-12)


# ------------------------------------------------------------------------------------------------
# The losses

def value_loss(values, old_values, returns, mask, clip=0.2, normalizer=None):
    """The clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -c, c):
    within one rollout batch a value may not move more than `clip` from its snapshot; past that the
    larger (clipped) error is what counts, and it has no gradient. Returns (loss, stats).
    Aggregation: token-mean, the sum over answer tokens divided by `normalizer`, the GLOBAL answer-token
    count of the minibatch (all micro-batches, all ranks): so N ranks give one rank's gradient.
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


def ppo_losses(actor, critic, x, y, mask, *, old_logp, old_values, advantages, returns, normalizer,
               temperature=1.0, top_k=None, top_p=None, eps_low=0.2, eps_high=0.2, value_clip=0.2,
               entropy_coef=0.0, weights=None):
    """The actor's and the critic's losses on one micro-batch, in CleanRL's order, every term normalized
    by the minibatch's GLOBAL answer-token count (`normalizer`). Returns (actor_loss, critic_loss, stats);
    the two networks are separate, so one backward of their sum gives each its own gradient.
    weights: optional (B, T) sampler correction (rollout.sampler_correction), detached."""
    m = mask.to(torch.float32)
    logp, entropy = actor(x, y, temperature=temperature, top_k=top_k, top_p=top_p, with_entropy=True)
    log_ratio = logp - old_logp                        # old_logp: the snapshot before this batch's first update
    ratio = importance_ratio(log_ratio)                # exp of the log-ratio clamped to [-20, 20] (verl)
    with torch.no_grad():
        approx_kl = (((ratio - 1) - log_ratio) * m).sum()          # k3(sampling policy || current), summed
    pg_loss, clipped = clipped_surrogate(ratio, advantages, eps_low, eps_high)  # -min(r A, clip(r) A); where the
    clipped = clipped.float()                                                   # clip binds (verl's clip fraction)
    if weights is not None:
        pg_loss = pg_loss * weights
    pg_loss = (pg_loss * m).sum() / normalizer
    entropy_loss = (entropy * m).sum() / normalizer
    actor_loss = pg_loss - entropy_coef * entropy_loss  # an entropy bonus: one coefficient in the sum
    v_loss, v_stats = value_loss(critic(x), old_values, returns, mask, value_clip, normalizer=normalizer)
    stats = {"policy_loss": pg_loss.item(), "entropy": entropy_loss.item(), "approx_kl_sum": approx_kl.item(),
             "clip_sum": (clipped * m).sum().item(), "ratio_sum": (ratio.detach() * m).sum().item(),
             "value_clip_sum": v_stats["clip_frac"] * m.sum().item()}
    return actor_loss, v_loss, stats


# ------------------------------------------------------------------------------------------------
# Know before you OOM

def critic_folder(args, init) -> str:
    """Where the critic starts: --critic-init, else the reward model of chat_rm.py, else the actor's folder."""
    if args.critic_init is not None:
        return resolve_model_path(args.critic_init, flag="--critic-init")
    try:
        return resolve_model_path(os.path.join(nanopost_home(), "rm", "default"))
    except UserError:
        return init


def memory_estimate(args, init, *, prompt_len, world_size=1, cuda=False) -> dict:
    """This run's peak memory per device (peak_memory.estimate), from its flags, the actor's and the critic's
    config.json and the longest prompt: what main prints before it loads the models, and `python memory.py
    --init FOLDER ppo [flags]` prints. The actor and the critic train; the reference and graders run forward."""
    policy = peak_memory.Shape.of(load_config(init))
    value = peak_memory.Shape.of(load_config(critic_folder(args, init), head="scalar"))
    use_kl = args.kl_beta > 0 or args.kl_target is not None
    return peak_memory.rollout_estimate(
        trained=[policy, value], frozen=[policy] * (use_kl and not args.lora_rank) + grader_shapes(args.reward),
        answers=args.prompts_per_step // world_size * args.samples_per_prompt,
        prompts=args.prompts_per_step // world_size, prompt_len=prompt_len,
        max_new_tokens=args.max_new_tokens, minibatches=args.minibatches, micro_batch_tokens=args.micro_batch_tokens,
        lora_rank=args.lora_rank, world_size=world_size, fsdp=args.fsdp, cuda=cuda,
        grad_checkpointing=args.grad_checkpointing)


def main():
    args = parser.parse_args()
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    rows, eval_rows = rl_rows(args.data, args.eval_data, eval_problems=args.eval_problems,
                              num_prompts=args.num_prompts, seed=args.seed)
    dist, out_dir = start_run(args, "ppo", "chat_ppo")
    device = dist.device
    if args.data and (warning := overlap_warning(rows, eval_rows)):  # the held-out rows should be new to training
        print0(warning)
    local_prompts, S = prompts_per_rank(args.prompts_per_step, dist.world_size, len(rows)), args.samples_per_prompt
    if local_prompts * S < args.minibatches:
        raise UserError(f"each rank needs at least --minibatches answers per step ({local_prompts * S} < "
                        f"{args.minibatches})")
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"), head="lm")
    tok = load_tokenizer(init)

    # the four networks. 1: the actor, the policy being trained, float32 master weights
    ckpt = resume_checkpoint(out_dir) if args.resume else None
    critic_ckpt = resume_checkpoint(os.path.join(out_dir, "critic")) if args.resume else None
    # 2: the critic, a value head on a GPT trunk; by default the reward model's (InstructGPT, Tülu 3)
    critic_init = critic_folder(args, init)
    if critic_init == init and args.critic_init is None:
        print0(f"no reward model at {os.path.join(nanopost_home(), 'rm', 'default')} (train one with chat_rm.py "
               f"to start the critic from it, as InstructGPT and Tülu 3 do); starting the critic from {init} "
               f"with a fresh value head")
    # know before you OOM: the actor and the critic train; the reference and any grader model only run forward
    tool_schemas = [CALCULATOR_SCHEMA] if args.tools else None
    settle_chat_template(tok, rows, args.chat_template, tools=tool_schemas)  # checkpoints ship what we train on
    prompt_len = prompt_length(tok, rows, tool_schemas)
    use_kl = args.kl_beta > 0 or args.kl_target is not None
    peak_memory.check(memory_estimate(args, init, prompt_len=prompt_len, world_size=dist.world_size,
                                      cuda=device.type == "cuda"), device)
    lora = lora_options(args, ckpt or init, resume=bool(ckpt), scores_samples=True)  # None without --lora-rank
    actor = wrap_model(load_model(ckpt or init, fsdp=args.fsdp, save_dtype=args.save_dtype, lora=lora,
                                  head_precision=args.head_precision), fsdp=args.fsdp)
    # with --lora-rank the critic is a second model with its own frozen base, adapters and value head (docs/lora.md)
    critic_lora = lora_options(args, critic_ckpt or critic_init, resume=bool(critic_ckpt), scores_samples=True)
    critic = wrap_model(load_model(critic_ckpt or critic_init, head="scalar", fsdp=args.fsdp,
                                   save_dtype=args.save_dtype, lora=critic_lora), fsdp=args.fsdp)
    unwrap(actor).grad_checkpointing = unwrap(critic).grad_checkpointing = args.grad_checkpointing
    # 3: the reward: the row's verifier, a reward model, or a weighted sum (rewards.Grader)
    grader = Grader(args.reward, tok, device, rubric=args.rubric)  # its reward models stay whole on every rank
    # 4: the frozen reference, in the compute dtype (not loaded when there is no KL penalty)
    ref_model = reference_model(actor, init, args.fsdp, lora) if use_kl else None  # LoRA: the actor, adapters off

    peak_lr = learning_rate(args.lr, "ppo", unwrap(actor))
    critic_peak_lr = learning_rate(args.critic_lr, "critic", unwrap(critic), name="--critic-lr")
    actor_opt = make_optimizer(actor, peak_lr)
    critic_opt = make_optimizer(critic, critic_peak_lr)
    if ckpt:
        if os.path.basename(critic_ckpt) != os.path.basename(ckpt):
            raise UserError(f"--resume: the actor's checkpoint {ckpt} and the critic's {critic_ckpt} are of different "
                            f"steps; remove the newer one")
        load_training_state(critic_ckpt, critic_opt, critic)
    state = resume_state(ckpt, actor_opt, actor)  # the adaptive KL's beta goes on where it was
    start_step, kl_beta, train_clock = state["step"], state.get("kl_beta", args.kl_beta), state["train_seconds"]
    engine = Engine(unwrap(actor), tok, tools=TOOLS if args.tools else None)
    logits_settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    reference = "off (no KL)" if ref_model is None else "the actor, adapters off" if args.lora_rank else "loaded"
    print0(f"actor {unwrap(actor).num_params():,} parameters from {init}; critic {unwrap(critic).num_params():,} from "
           f"{critic_init}; reward {args.reward}; reference {reference}; {len(rows)} prompts; "
           f"{args.prompts_per_step} prompts x {S} answers per step on {dist.world_size} rank(s)")

    def evaluate(step):
        return heldout_scores(actor, tok, eval_rows, max_new_tokens=args.max_new_tokens, samples=args.pass_k,
                              seed=step, use_tools=args.tools, label=f"eval @ step {step}", **logits_settings)

    log = open_run(args, out_dir, "ppo")  # every input checked: now --overwrite replaces the old run
    final_scores = None
    if start_step == 0 and eval_rows and args.eval_before_train:  # every rank evaluates its share
        final_scores = evaluate(0)
        log.log(0, train_seconds=0.0, **{f"eval/{k}": v for k, v in final_scores.items()})
    warmup_steps = fit_warmup(args.warmup_steps, args.steps)
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="ppo")
    for step in bar:
        t_step = time.time()
        lr = lr_at(step, args.steps, peak_lr, warmup_steps, final_ratio=1.0)  # warmup, then constant
        set_lr(actor_opt, lr)
        set_lr(critic_opt, lr_at(step, args.steps, critic_peak_lr, warmup_steps, final_ratio=1.0))
        train_actor = step >= args.freeze_actor_steps

        # 1. generate: this rank's prompts (a pure function of seed, step and rank), S answers each, graded
        batch_rows, seed = draw_prompts(rows, local_prompts, seed=args.seed, step=step, rank=dist.rank)
        rollouts = sample(engine, batch_rows, grader, samples_per_prompt=S, seed=seed, tool_schemas=tool_schemas,
                          max_new_tokens=args.max_new_tokens, max_tool_turns=args.max_tool_turns, **logits_settings)
        scores = rollouts.rewards.clone()
        if args.truncated_reward is not None:  # an answer cut at the limit never reached its end
            truncated = torch.tensor([c.finish_reason == "length" for c in rollouts.completions])
            scores[truncated] = args.truncated_reward
        batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, device)
        mask, scores = batch.mask, scores.to(device)
        t_sample = time.time() - t_step

        # 2. the snapshot, before any update on this batch: the actor's log-probs (the "old" policy of
        #    the ratio), the reference's, and the critic's values
        t1 = time.time()
        old_logp, entropy = batch_logprobs(actor, batch, args.micro_batch_tokens, with_entropy=True, **logits_settings)
        ref_logp = old_logp
        if ref_model is not None:
            with adapters_off(ref_model):  # untruncated: a sampled token outside ITS top-k/top-p is no infinite KL
                ref_logp = batch_logprobs(ref_model, batch, args.micro_batch_tokens, temperature=args.temperature)
        old_values = torch.zeros_like(mask)
        with torch.no_grad(), autocast(device):
            for part in micro_batches(batch.lengths, args.micro_batch_tokens):
                if not part:  # join the other ranks' passes (an FSDP2 forward is a collective)
                    idle_pass(critic, backward=False)
                    continue
                i, cols = torch.tensor(part, device=device), int(batch.lengths[part].max())
                old_values[i, :cols] = critic(batch.inputs[i, :cols]).float() * mask[i, :cols]
        weights = sampler_correction(old_logp, batch.engine_logp, mask, args.correction, cap=args.tis_cap,
                                     eps=args.mask_eps)

        # 3. rewards (score at the end, KL everywhere) and advantages (GAE, then whitened over all ranks)
        rewards, kl = token_rewards(scores, old_logp, ref_logp, mask, kl_beta, args.kl_kind)
        advantages, returns = gae(rewards, old_values, mask, gamma=args.gamma, lam=args.lam)
        if args.whiten:
            advantages = whiten(advantages, mask)
        explained_var = explained_variance(old_values, returns, mask)

        # 4. --ppo-epochs passes, each --minibatches optimizer steps of the critic and of the actor; each
        #    minibatch's losses are normalized by its GLOBAL answer-token count (see value_loss)
        st = {"policy_loss": 0.0, "value_loss": 0.0, "clip_sum": 0.0, "ratio_sum": 0.0, "value_clip_sum": 0.0,
              "tokens": 0.0, "approx_kl": 0.0}
        n_updates = 0
        for mb in minibatches_of(batch, step=step, epochs=args.ppo_epochs, count=args.minibatches):
            approx_kl = 0.0
            for p in mb.passes([actor, critic], args.micro_batch_tokens):  # p(tensor): this pass's slice of it
                with autocast(device):
                    actor_loss, critic_loss, mst = ppo_losses(
                        actor, critic, p(batch.inputs), p(batch.targets), p(mask), old_logp=p(old_logp),
                        old_values=p(old_values), advantages=p(advantages), returns=p(returns), normalizer=mb.tokens,
                        eps_low=args.eps_low, eps_high=args.eps_high, value_clip=args.value_clip,
                        entropy_coef=args.entropy_coef, weights=p(weights), **logits_settings)
                check_finite(actor_loss + critic_loss, step + 1)
                (actor_loss * train_actor + critic_loss).backward()  # two networks: each gets its own gradient
                for k in ("policy_loss", "clip_sum", "ratio_sum", "value_clip_sum"):
                    st[k] += mst[k]
                st["value_loss"] += critic_loss.item()
                st["tokens"] += float(p(mask).sum())
                approx_kl += mst["approx_kl_sum"]
            optimizer_step(critic, critic_opt, args.grad_clip)
            if train_actor:
                optimizer_step(actor, actor_opt, args.grad_clip)
            else:
                actor_opt.zero_grad(set_to_none=True)
            n_updates += 1
            st["approx_kl"] += (approx_kl := all_reduce_sum(approx_kl) / mb.tokens)  # the same on every rank
            if args.target_kl is not None and train_actor and approx_kl > args.target_kl:
                break
        t_train = time.time() - t1

        # 5. this rank's sums, added over the ranks in one collective: the KL controller's input, and the log's
        train_clock += time.time() - t_step
        s = all_reduce_dict({**rollouts.stats(), "score": float(scores.sum()), "kl": float(kl.sum()),
                             "tokens": float(mask.sum()),
                             "values": float(old_values.sum()), "returns": float(returns.sum()),
                             "entropy": float((entropy * mask).sum()),
                             "mismatch": float(((old_logp - batch.engine_logp).abs() * mask).sum()),
                             "sample_tok_per_s": sum(len(c.tokens) for c in rollouts.completions) / max(t_sample, 1e-9),
                             "train_tok_per_s": float(mask.sum()) * args.ppo_epochs / max(t_train, 1e-9),
                             **{f"update_{k}": v for k, v in st.items() if k != "approx_kl"}})
        # 6. the adaptive KL controller moves beta towards the target KL per answer
        kl_per_answer = s["kl"] / s["answers"]
        if args.kl_target is not None:
            kl_beta = adaptive_kl_beta(kl_beta, kl_per_answer, target=args.kl_target, horizon=args.kl_horizon,
                                       n_answers=s["answers"])

        # 7. log, each sum divided by its global count, and stop when the time budget is spent
        n_tok, n_passes, updates = max(1.0, s["tokens"]), max(1.0, s["update_tokens"]), max(1, n_updates)
        metrics = {
            **rollout_metrics(s),
            "reward": s["score"] / s["answers"],  # the score, before the KL penalty
            "length_max": max(len(c.tokens) for c in rollouts.completions),  # this rank's
            "kl": s["kl"] / n_tok,  # per token (k-estimator of --kl-kind)
            "kl_per_answer": kl_per_answer,
            "kl_beta": kl_beta,
            "value_loss": s["update_value_loss"] / updates,
            "policy_loss": s["update_policy_loss"] / updates,
            "explained_var": explained_var,
            "value_mean": s["values"] / n_tok,
            "return_mean": s["returns"] / n_tok,
            "clip_frac": s["update_clip_sum"] / n_passes,  # where the clip binds (verl's pg_clipfrac)
            "value_clip_frac": s["update_value_clip_sum"] / n_passes,
            "ratio_mean": s["update_ratio_sum"] / n_passes,
            "approx_kl": st["approx_kl"] / updates,  # (already over every rank)
            "updates": n_updates,
            "entropy": s["entropy"] / n_tok,  # of the sampling distribution
            "logprob_mismatch": s["mismatch"] / n_tok,
            "sample_tok_per_s": s["sample_tok_per_s"],
            "train_tok_per_s": s["train_tok_per_s"],
            "tok_per_s": s["length_sum"] / max(time.time() - t_step, 1e-9),
            "lr": lr,
            "train_seconds": train_clock,
            "peak_mem_mb": peak_memory_mb(device),
        }
        # rank 0's clock decides for all, so that every rank stops at the same step
        over_budget = args.time_budget > 0 and all_reduce_sum(train_clock if dist.is_main else 0.0) >= args.time_budget
        last = step + 1 == args.steps or over_budget
        if eval_rows and ((step + 1) % args.eval_every == 0 or last):
            final_scores = evaluate(step + 1)
            metrics.update({f"eval/{k}": v for k, v in final_scores.items()})
        if rollouts.errors:
            print0(f"step {step + 1}: {len(rollouts.errors)} verifier error(s) scored 0, e.g. {rollouts.errors[0]}")
        log.log(step + 1, **metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", ev=f"{explained_var:.2f}", kl=f"{metrics['kl']:.4f}",
                        refresh=False)
        if (step + 1) % args.save_every == 0 or last:
            state = {"run_config": vars(args), "kl_beta": kl_beta, "train_seconds": train_clock}
            save_checkpoint(os.path.join(out_dir, "critic"), step + 1, critic, tok, critic_opt, state, lora=critic_lora)
            save_checkpoint(out_dir, step + 1, actor, tok, actor_opt, state, lora=lora)
        if over_budget:
            print0(f"time budget of {args.time_budget:g} s spent after {step + 1} steps")
            break

    if eval_rows:
        scores = final_scores if final_scores is not None and start_step < args.steps else evaluate(start_step)
        write_eval(out_dir, scores)
    print0(f"peak memory {peak_memory_mb(device):.0f} MiB")
    log.close()


if __name__ == "__main__":
    run_main(main)
