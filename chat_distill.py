"""
On-policy distillation: the student writes, the teacher grades every token it wrote.

RL grades a whole answer with one number; supervised distillation shows the student the teacher's own
answers, which the student will never write itself once it is on its own. On-policy distillation takes
the good half of each: the student samples its answers (on-policy, as in RL), and a teacher that shares
the tokenizer scores each sampled token with its log-prob. The per-token reward is the reverse KL,
log p_teacher(y_t) - log p_student(y_t): a token the teacher would also have written costs nothing, a
token the teacher finds unlikely is pushed down, at the place where the mistake was made. It is trained
with chat_rl.py's clipped policy-gradient update (policy_loss / update_policy) and no value function.

    GKD           Agarwal et al. 2024 (on-policy samples, a divergence to the teacher)
                                                        https://arxiv.org/abs/2306.13649
    MiniLLM       Gu et al. 2024 (reverse KL, policy gradient)  https://arxiv.org/abs/2306.08543
    Qwen3         Qwen Team 2025 (strong-to-weak distillation of the small models: off-policy, then on-policy)
                                                        https://arxiv.org/abs/2505.09388
    Thinking Machines Lab 2025, "On-Policy Distillation": the per-token reverse KL as the advantage of an
                  importance-sampled policy-gradient update, discount 0.
    Sequence-level KD, Kim & Rush 2016 (--mode kd: NLL on the teacher's samples)
                                                        https://arxiv.org/abs/1606.07947

One step: 1. the student samples --samples-per-prompt answers to each prompt (rollout.sample; the
verifier's grade is only logged); 2. the snapshot of the student's log-probs, the frozen teacher's
log-probs of the same tokens, and the advantage of each token (reverse_kl_advantages); 3. the update:
chat_rl.update_policy with per-token advantages; 4. log. Two supervised modes share distill_update:
  --mode gkd   GKD's on-policy form (its lambda = 1): on the student's own samples, the generalized JSD
               between the two models' WHOLE next-token distributions at each position (generalized_jsd,
               --gkd-beta), not only the sampled token's log-probs; a gradient without sampling noise over the
               vocabulary, at the price of both heads' (tokens, V) logits, computed in chunks (gkd_loss).
  --mode kd    the teacher samples, and the student maximizes the likelihood of the teacher's tokens:
               supervised, off-policy, for contrast.
Left out: GKD's lambda < 1, which mixes in a fixed data set's answers (prompt-only data has none), and a KL
to the start.
Both models' log-probs are taken at the sampling --temperature; with --tools the teacher scores the student's
sampled tokens of its multi-turn tool rollouts (tool results are never trained).

    python chat_distill.py                                         # 1 CPU: the SFT run learns from the RL run
    python chat_distill.py --tools                                 # the calculator offered, as the RL run had it
    torchrun --standalone --nproc_per_node=2 chat_distill.py       # 2 CPU ranks
    python chat_distill.py --init /models/small-sft --teacher /models/big --data rl.jsonl --device cuda  # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_distill.py --init ... --teacher ... --data rl.jsonl  # N GPUs

Data: prompts only, as chat_rl.py reads them (--data FILE.jsonl, or the embedded world's problems); the
ground truth, when there is one, is only used to log accuracy and held-out pass@k.
Writes $NANOPOST_HOME/distill/<run>/.
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import peak_memory
from chat_rl import update_policy
from checkpoint import (load_config, load_model, load_tokenizer, resolve_model_path, resume_checkpoint, resume_state,
                        save_checkpoint)
from common import (UserError, all_reduce_dict, all_reduce_sum, autocast, check_finite, compute_dtype, fit_warmup,
                    learning_rate, lr_at, make_optimizer, nanopost_home, optimizer_step, peak_memory_mb, print0,
                    progress, run_main, set_lr, unwrap, wrap_model)
from data import rl_rows
from engine import Engine
from evaluation import heldout_scores
from model import head_logits
from rewards import Grader
from rollout import (add_sampling_flags, batch_logprobs, draw_prompts, minibatches_of, prompt_length, prompts_per_rank,
                     sample, sampler_correction, training_batch)
from rundir import add_run_flags, open_run, start_run, write_eval
from tasks import CALCULATOR_SCHEMA, TOOLS
from tokenizer import settle_chat_template

parser = argparse.ArgumentParser(description="on-policy distillation from a teacher sharing the tokenizer")
parser.add_argument("--init", default=None, help="the student: model folder or run dir (default: the SFT run)")
parser.add_argument("--teacher", default=None, help="the teacher: model folder or run dir (default: the RL run)")
parser.add_argument("--mode", choices=["on-policy", "gkd", "kd"], default="on-policy",
                    help="the student samples and the teacher grades each sampled token; gkd: the student samples "
                    "and learns the teacher's whole next-token distribution there; kd: the teacher samples and the "
                    "student learns its answers by NLL")
parser.add_argument("--gkd-beta", type=float, default=0.5, help="--mode gkd: the generalized JSD's beta (0: forward "
                    "KL, 1: reverse KL; TRL's default 0.5)")
add_sampling_flags(parser)  # --data, --steps, --prompts-per-step, --max-new-tokens, --temperature, --tools, ...
parser.add_argument("--samples-per-prompt", type=int, default=4, help="answers sampled per prompt")
parser.add_argument("--discount", type=float, default=0.0, help="a token's advantage adds the discounted rewards of "
                    "the tokens after it (0: its own reverse KL only, as Thinking Machines; 1: the whole rest of the "
                    "answer)")
parser.add_argument("--eps-low", type=float, default=0.2)
parser.add_argument("--eps-high", type=float, default=0.28)
parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each batch")
parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass")
parser.add_argument("--lr", type=float, default=None, help="default: 1e-4 on the embedded world, 1e-6 for a real model")
parser.add_argument("--eval-every", type=int, default=10)
add_run_flags(parser, "distill")  # --run-name, --seed, --device, --resume, --wandb, --fsdp (the teacher too), ...


# ------------------------------------------------------------------------------------------------
# The loss: the teacher's per-token verdict as an advantage

def reverse_kl_advantages(teacher_logp, student_logp, mask, discount=0.0):
    """Per-token advantages (B, T) of the student's own samples: the reward of token t is
    log p_teacher(y_t) - log p_student(y_t), minus the per-token reverse KL, and its advantage is the
    discounted sum of the rewards from t to the end of the answer (discount 0: the reward itself).
    Tokens outside the mask (the prompt, tool results, padding) get reward 0 and advantage 0.

    Why this is the reverse KL's gradient: KL(student || teacher) = E_student[sum_t log p_s(y_t) - log p_t(y_t)],
    and its gradient is E_student[sum_t grad log p_s(y_t) * (sum_{k >= t} log p_s(y_k) - log p_t(y_k))] (the
    score function; a token's own reward and those after it, the earlier ones do not depend on it): the
    policy gradient with advantages at discount 1. Discount 0 keeps only each token's own term: the
    gradient of each position's KL with the prefix that led there held fixed (tests/test_distill.py
    checks both against the analytic KL by enumerating every sequence).

    Example, one answer of three tokens, student log-probs -0.10, -2.00, -0.50 and teacher's -0.30, -0.70,
    -0.50: rewards -0.20 (the student is surer than the teacher), +1.30 (the teacher likes this token more:
    push it up), 0.00; at discount 0.5 the advantages are -0.20 + 0.5 * (1.30 + 0.5 * 0) = 0.45, 1.30, 0.00.
    When the student is the teacher every advantage is exactly 0, and so is the gradient."""
    mask = mask.to(student_logp.dtype)
    reward = (teacher_logp - student_logp) * mask
    if discount == 0:
        return reward
    adv, running = torch.zeros_like(reward), torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.size(1))):
        running = reward[:, t] + discount * running
        adv[:, t] = running
    return adv * mask


def kd_loss(student_logp, mask, normalizer):
    """--mode kd: the negative log-likelihood of the teacher's sampled tokens, summed and divided by the
    tokens of the whole global batch (normalizer). Its gradient is the one of the forward KL
    KL(teacher || student) = E_teacher[log p_t(y) - log p_s(y)] estimated on the same samples (the
    teacher's own term does not depend on the student): sequence-level KD (Kim & Rush 2016).
    Example: teacher tokens the student gives p = 0.50, 0.90, 0.20 cost -(ln 0.5 + ln 0.9 + ln 0.2) / 3 = 0.8026."""
    return -(student_logp * mask).sum() / normalizer


def generalized_jsd(student_logits, teacher_logits, beta=0.5):
    """GKD's divergence at each position (N,) between the student's and the teacher's next-token
    distributions over the whole vocabulary, from their logits (N, V):
        JSD(beta) = beta KL(T || M) + (1 - beta) KL(S || M),   M = beta T + (1 - beta) S,
    as TRL's GKDTrainer.generalized_jsd_loss (and GKD's Eq. 1 with its P the teacher): beta = 0 is the forward KL
    KL(T || S) and beta = 1 the reverse KL(S || T), each taken exactly (the mixture's limits would be 0).
    Example, a two-token vocabulary, student (0.5, 0.5), teacher (0.9, 0.1): beta 0.5 gives M = (0.7, 0.3)
    and 0.5 * 0.1163 + 0.5 * 0.0872 = 0.1017; beta 0: 0.9 ln(0.9 / 0.5) + 0.1 ln(0.1 / 0.5) = 0.3681;
    beta 1: 0.5 ln(0.5 / 0.9) + 0.5 ln(0.5 / 0.1) = 0.5108."""
    s, t = F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1)

    def kl(a, b):  # KL(A || B) from log-probs, each row; a token A gives p = 0 adds 0
        return (a.exp() * (a - b)).sum(-1)
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def gkd_loss(student_hidden, student_head, teacher_hidden, teacher_head, *, beta, normalizer, temperature=1.0,
             precision="float32", chunk_elements=2**24):
    """--mode gkd: generalized_jsd at every graded position of the student's samples, summed and divided by the
    tokens of the whole global batch (normalizer), from the two models' final hidden states there (N, C) and
    their vocabulary heads (V, C). The (N, V) logits of both are never held at once: chunks of about
    chunk_elements logits each, recomputed in backward (model.vocab_logprobs' scheme), so at a vocabulary of
    151,936 a chunk is 110 positions and a few 64 MB tensors. Both distributions at `temperature`, as TRL."""
    step = max(1, chunk_elements // student_head.size(0))

    def chunk_sum(h_s, h_t):
        with torch.autocast(h_s.device.type, enabled=False):
            return generalized_jsd(head_logits(h_s, student_head, precision) / temperature,
                                   head_logits(h_t, teacher_head, precision) / temperature, beta).sum()
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, student_hidden.size(0), step):
        args = (student_hidden[s:s + step], teacher_hidden[s:s + step])
        total = total + (checkpoint(chunk_sum, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else chunk_sum(*args))
    return total / normalizer


def distill_update(model, optimizer, batch, *, step, loss_of, ppo_epochs=1, minibatches=2, micro_batch_tokens=8192,
                   grad_clip=1.0):
    """The supervised modes' update (kd, gkd): minibatches optimizer steps (times ppo_epochs), each minibatch
    in forward passes of at most micro_batch_tokens; loss_of(p, normalizer) is a pass's loss, p(tensor) its
    slice of a batch tensor and normalizer the minibatch's global token count. Returns sums over this rank:
    loss, updates, grad_norm."""
    totals = {"loss": 0.0, "updates": 0, "grad_norm": 0.0}
    for mb in minibatches_of(batch, step=step, epochs=ppo_epochs, count=minibatches):
        for p in mb.passes([model], micro_batch_tokens):  # p(tensor): this forward pass's slice of it
            loss = loss_of(p, mb.tokens)
            check_finite(loss, step + 1)
            loss.backward()
            totals["loss"] += loss.item()
        totals["grad_norm"] += optimizer_step(model, optimizer, grad_clip)
        totals["updates"] += 1
    return totals


def same_vocabulary(a, b) -> bool:
    """Two tokenizers map the same strings to the same ids: the teacher's log-prob of token id i is then
    the log-prob of the token the student wrote."""
    vocab_a, vocab_b = a._tok.get_vocab(with_added_tokens=True), b._tok.get_vocab(with_added_tokens=True)
    return a.vocab_size == b.vocab_size and vocab_a == vocab_b


# ------------------------------------------------------------------------------------------------
# Know before you OOM

def teacher_folder(args) -> str:
    return resolve_model_path(args.teacher or os.path.join(nanopost_home(), "rl", "default"), flag="--teacher",
                              head="lm")


def memory_estimate(args, init, *, prompt_len, world_size=1, cuda=False) -> dict:
    """This run's peak memory per device (peak_memory.estimate), from its flags, the student's and the
    teacher's config.json and the longest prompt: what main prints before it loads the models, and `python
    memory.py --init FOLDER distill [flags]` prints. The student trains, the teacher only runs forward."""
    return peak_memory.rollout_estimate(
        trained=[peak_memory.Shape.of(load_config(init))],
        frozen=[peak_memory.Shape.of(load_config(teacher_folder(args)))],
        answers=args.prompts_per_step // world_size * args.samples_per_prompt,
        prompts=args.prompts_per_step // world_size, prompt_len=prompt_len,
        max_new_tokens=args.max_new_tokens, minibatches=args.minibatches, micro_batch_tokens=args.micro_batch_tokens,
        world_size=world_size, fsdp=args.fsdp, cuda=cuda, grad_checkpointing=args.grad_checkpointing)


def main():
    args = parser.parse_args()
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    rows, eval_rows = rl_rows(args.data, args.eval_data, eval_problems=args.eval_problems,
                              num_prompts=args.num_prompts, seed=args.seed)
    if not 0 <= args.discount <= 1:
        raise UserError(f"--discount {args.discount}: must be in [0, 1]")
    if args.mode == "gkd" and args.fsdp:  # gkd_loss reads each model's whole head weight outside its forward
        raise UserError("--mode gkd runs the vocabulary heads outside the models' forward, which --fsdp shards; "
                        "use DDP (torchrun without --fsdp)")
    dist, out_dir = start_run(args, "distill", "chat_distill")
    device = dist.device

    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"), head="lm")
    teacher_path = teacher_folder(args)
    tok = load_tokenizer(init)
    if not same_vocabulary(tok, load_tokenizer(teacher_path, flag="--teacher")):
        raise UserError(f"--teacher {teacher_path}: its tokenizer differs from the student's ({init}); "
                        "distillation compares the log-probs of the same token ids")
    S, local_prompts = args.samples_per_prompt, prompts_per_rank(args.prompts_per_step, dist.world_size, len(rows))
    tool_schemas = [CALCULATOR_SCHEMA] if args.tools else None
    settle_chat_template(tok, rows, args.chat_template, tools=tool_schemas)  # checkpoints ship what we train on
    prompt_len = prompt_length(tok, rows, tool_schemas)
    peak_memory.check(memory_estimate(args, init, prompt_len=prompt_len, world_size=dist.world_size,
                                      cuda=device.type == "cuda"), device)
    ckpt = resume_checkpoint(out_dir) if args.resume else None
    # float32 master weights
    model = wrap_model(load_model(ckpt or init, fsdp=args.fsdp, save_dtype=args.save_dtype,
                                  head_precision=args.head_precision), fsdp=args.fsdp)
    unwrap(model).grad_checkpointing = args.grad_checkpointing
    peak_lr = learning_rate(args.lr, "rl", unwrap(model))
    optimizer = make_optimizer(model, peak_lr)
    state = resume_state(ckpt, optimizer, model)  # train_seconds: in steps, evaluation excluded (--time-budget)
    start_step, train_clock = state["step"], state["train_seconds"]
    # the teacher: frozen, in the compute dtype, sharded too under --fsdp
    teacher = load_model(teacher_path, dtype=compute_dtype(device), fsdp=args.fsdp,
                         head_precision=args.head_precision).eval().requires_grad_(False)
    grader = Grader("verifier", tok, device)  # only logged: the teacher's log-probs are the signal
    tools = TOOLS if args.tools else None
    sampler = Engine(unwrap(teacher if args.mode == "kd" else model), tok, tools=tools)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, tool_schemas=tool_schemas,
                    max_tool_turns=args.max_tool_turns)
    update = dict(ppo_epochs=args.ppo_epochs, minibatches=args.minibatches, micro_batch_tokens=args.micro_batch_tokens,
                  grad_clip=args.grad_clip)
    print0(f"student: {unwrap(model).num_params():,} parameters from {init}; teacher: "
           f"{unwrap(teacher).num_params():,} from {teacher_path}; mode {args.mode}; {args.prompts_per_step} "
           f"prompts x {S} answers per step on {dist.world_size} rank(s)")

    def evaluate(net, step):
        """Held-out pass@1 (greedy), pass@k at --temperature, and the reverse KL to the teacher per token of
        the student's own answers at --temperature (one per problem): the number distillation lowers."""
        t0 = time.time()
        scores = heldout_scores(net, tok, eval_rows, max_new_tokens=args.max_new_tokens, samples=args.pass_k,
                                temperature=args.temperature, seed=step, use_tools=args.tools)
        if net is model:
            mine = eval_rows[dist.rank::dist.world_size]
            engine = Engine(unwrap(model), tok, tools=tools)
            with engine.prepared():
                rollouts = sample(engine, mine, grader, samples_per_prompt=1, seed=10_000 + step, **sampling)
            batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, device)
            diff = batch_logprobs(model, batch, args.micro_batch_tokens, temperature=args.temperature) - \
                batch_logprobs(teacher, batch, args.micro_batch_tokens, temperature=args.temperature)
            sums = all_reduce_dict({"tokens": float(batch.mask.sum()), "kl": float((diff * batch.mask).sum())})
            scores["reverse_kl"] = sums["kl"] / sums["tokens"]
        print0(f"eval @ step {step} ({time.time() - t0:.0f}s): " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        return scores

    log = open_run(args, out_dir, "distill")  # every input checked: now --overwrite replaces the old run
    final_scores = None
    if start_step == 0 and eval_rows:  # the teacher's scores are the target; the student's are where it starts
        teacher_scores = evaluate(teacher, 0)
        final_scores = evaluate(model, 0)
        log.log(0, train_seconds=0.0, **{f"eval/{k}": v for k, v in final_scores.items()},
                **{f"teacher/{k}": v for k, v in teacher_scores.items()})
    warmup_steps = fit_warmup(args.warmup_steps, args.steps)
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="distill")
    for step in bar:
        t_step = time.time()
        lr = lr_at(step, args.steps, peak_lr, warmup_steps, final_ratio=1.0)  # warmup, then constant
        set_lr(optimizer, lr)

        # 1. samples: the student's (on-policy, gkd) or the teacher's (kd), graded only to be logged; a pure
        #    function of (seed, step, rank), so a resumed run samples what the uninterrupted one would
        batch_rows, seed = draw_prompts(rows, local_prompts, seed=args.seed, step=step, rank=dist.rank)
        with sampler.prepared():
            rollouts = sample(sampler, batch_rows, grader, samples_per_prompt=S, seed=seed, **sampling)
        t_sample = time.time() - t_step

        # 2. both models' log-probs of every sampled token, before any update on this batch
        t1 = time.time()
        batch = training_batch(rollouts.prompts, rollouts.completions, tok.pad_id, device)
        mask = batch.mask
        student_logp = batch_logprobs(model, batch, args.micro_batch_tokens, temperature=args.temperature)
        teacher_logp = batch_logprobs(teacher, batch, args.micro_batch_tokens, temperature=args.temperature)

        # 3. the update
        if args.mode == "on-policy":
            adv = reverse_kl_advantages(teacher_logp, student_logp, mask, args.discount)
            weights = sampler_correction(student_logp, batch.engine_logp, mask, args.correction, cap=args.tis_cap)
            # chat_rl's clipped objective at its defaults (token-mean, the token ratio), no entropy bonus, no KL
            totals = update_policy(model, optimizer, batch, old_logp=student_logp, advantages=adv, weights=weights,
                                   step=step, temperature=args.temperature, **update,
                                   loss_settings=dict(eps_low=args.eps_low, eps_high=args.eps_high,
                                                      max_len=args.max_new_tokens))
        elif args.mode == "gkd":  # the teacher's whole distribution at each of the student's positions
            def loss_of(p, normalizer):
                with autocast(device):
                    h_s = model(p(batch.inputs), p(batch.targets), graded_hidden=True)
                    with torch.no_grad():
                        h_t = teacher(p(batch.inputs), p(batch.targets), graded_hidden=True)
                return gkd_loss(h_s, unwrap(model).lm_head.weight, h_t, unwrap(teacher).lm_head.weight,
                                beta=args.gkd_beta, normalizer=normalizer, temperature=args.temperature,
                                precision=unwrap(model).head_precision)
            totals = distill_update(model, optimizer, batch, step=step, loss_of=loss_of, **update)
        else:  # kd: the likelihood of the teacher's tokens
            def loss_of(p, normalizer):
                with autocast(device):
                    logp = model(p(batch.inputs), p(batch.targets), temperature=args.temperature)
                return kd_loss(logp, p(batch.mask), normalizer)
            totals = distill_update(model, optimizer, batch, step=step, loss_of=loss_of, **update)
        t_train = time.time() - t1
        train_clock += time.time() - t_step

        # 4. log: this rank's sums, added over the ranks in one collective, each then divided by its global count
        s = all_reduce_dict({**rollouts.stats(), "tokens": float(mask.sum()),
                             "kl": float(((student_logp - teacher_logp) * mask).sum()),
                             "mismatch": float(((student_logp - batch.engine_logp).abs() * mask).sum()),
                             "sample_tok_per_s": sum(len(c.tokens) for c in rollouts.completions) / max(t_sample, 1e-9),
                             "train_tok_per_s": float(mask.sum()) * args.ppo_epochs / max(t_train, 1e-9),
                             **{f"update_{k}": totals.get(k, 0.0) for k in ("loss", "clip_frac", "ratio", "tokens")}})
        n_ans, n_tok, updates = s["answers"], max(1.0, s["tokens"]), max(1, totals["updates"])
        metrics = {
            # per token, before the update: on the student's samples (on-policy) log p_s - log p_t estimates the
            # reverse KL; on the teacher's (kd) log p_t - log p_s estimates the forward KL
            **({"reverse_kl": s["kl"] / n_tok} if args.mode != "kd" else {"forward_kl": -s["kl"] / n_tok}),
            "accuracy": s["correct"] / n_ans,
            "loss": s["update_loss"] / updates,
            "grad_norm": totals["grad_norm"] / updates,
            "updates": totals["updates"],
            "length_mean": s["length_sum"] / n_ans,
            "truncated_frac": s["truncated"] / n_ans,
            "sample_tok_per_s": s["sample_tok_per_s"],
            "train_tok_per_s": s["train_tok_per_s"],
            "lr": lr,
            "train_seconds": train_clock,
            "peak_mem_mb": peak_memory_mb(device),
        }
        if args.mode == "on-policy":  # chat_rl's clipped objective: where the clip binds, the ratio, the KL moved
            n_upd = max(1.0, s["update_tokens"])
            metrics.update(clip_frac=s["update_clip_frac"] / n_upd, ratio_mean=s["update_ratio"] / n_upd,
                           approx_kl=totals["approx_kl"] / updates, logprob_mismatch=s["mismatch"] / n_tok)
        over_budget = args.time_budget > 0 and all_reduce_sum(train_clock if dist.is_main else 0.0) >= args.time_budget
        last = step + 1 == args.steps or over_budget
        if eval_rows and ((step + 1) % args.eval_every == 0 or last):
            final_scores = evaluate(model, step + 1)
            metrics.update({f"eval/{k}": v for k, v in final_scores.items()})
        log.log(step + 1, **metrics)
        kl = metrics.get("reverse_kl", metrics.get("forward_kl"))
        bar.set_postfix(kl=f"{kl:.3f}", acc=f"{metrics['accuracy']:.2f}", refresh=False)
        if (step + 1) % args.save_every == 0 or last:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer,
                            {"run_config": vars(args), "train_seconds": train_clock})
        if over_budget:
            print0(f"time budget of {args.time_budget:g} s spent after {step + 1} steps")
            break

    if eval_rows:
        scores = final_scores if final_scores is not None and start_step < args.steps else evaluate(model, args.steps)
        write_eval(out_dir, scores)
    log.close()


if __name__ == "__main__":
    run_main(main)
