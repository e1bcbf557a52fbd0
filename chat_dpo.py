"""
Direct preference optimization (DPO): learn from (prompt, chosen, rejected) pairs without a reward model.

DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) shows that the KL-regularized RLHF objective
has a closed-form optimum, so the policy can be trained on preference pairs directly: raise the log-prob
of the chosen answer relative to a frozen reference copy of the starting model, and lower the rejected
one's, through -log sigmoid(beta * margin). The reference stops the model from winning by collapsing
onto short, safe text: every gain is measured from where it started. Variants (--loss), each a few
lines of dpo_loss: ipo (Azar et al. 2023), hinge (SLiC), sigmoid_norm (length-normalized, SimPO's
idea), robust (Chowdhury et al. 2024). --rpo-alpha adds the NLL of the chosen answer (Iterative RPO,
Pang et al. 2024). One family departs from the reference: orpo (Hong et al. 2024) has none, and adds an
odds-ratio term to the SFT loss of the chosen answer (orpo_micro_loss). KTO, on single answers labeled
good or bad, is chat_kto.py.

    python chat_dpo.py                                             # 1 CPU, the embedded world's pairs
    python chat_dpo.py --pairs on-policy                           # pairs sampled from the policy itself
    python chat_dpo.py --pairs judge --judge standin:arithmetic --rubric rubrics/arithmetic.txt  # pairs a judge chose
    python chat_dpo.py --data prefs.jsonl --init /models/my-sft --device cuda     # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_dpo.py --data prefs.jsonl --init ...   # N GPUs

The log-prob of a completion is the sum of its tokens' log-probs: prompt + completion rendered by
tokenizer.render_conversation, graded where the mask is 1 after the prompt (the assistant's tokens and
its <|im_end|>). Reference log-probs are computed once before training (--ref precompute; the
policy is the reference at step 0, so no second model is ever loaded) or by a frozen copy kept in
memory (--ref live). Writes $NANOPOST_HOME/dpo/<run>/ (checkpoints/, metrics.jsonl, eval.json with the
held-out implicit-reward accuracy, pass@1 of the start and the end on the same problems, and the paired
change).
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F

import peak_memory
from checkpoint import (load_config, load_model, load_tokenizer, reference_model, resolve_model_path, resume_checkpoint,
                        resume_state, save_checkpoint)
from common import (UserError, all_reduce_dict, all_reduce_sum, check_finite, fit_warmup, idle_pass, learning_rate,
                    lr_at, make_optimizer, nanopost_home, no_sync, optimizer_step, peak_memory_mb, print0, progress,
                    run_main, set_lr, unwrap, wrap_model)
from data import load_preferences, split_heldout
from decontaminate import overlap_warning
from lora import lora_options
from packing import IGNORE, check_batch_fits, epoch_batch, micro_batches
from preferences import (add_preference_flags, check_pair_flags, completion_logps, evaluate_pairs, final_scores,
                         pair_eval_line, pair_items, pair_references, pass_at_start, reference_of, sampled_pairs)
from rundir import open_run, start_run, write_eval
from tasks import preference_pairs, rl_prompts
from tokenizer import settle_chat_template

LOSSES = ("sigmoid", "ipo", "hinge", "sigmoid_norm", "robust", "orpo")


parser = argparse.ArgumentParser(description="direct preference optimization and its variants")
parser.add_argument("--init", default=None, help="chat model folder or run dir to start from (default: the SFT run)")
parser.add_argument("--data", default=None, help="JSONL of {prompt, chosen, rejected} rows (default: the embedded "
                    "world)")
parser.add_argument("--eval-data", default=None,
                    help="held-out rows of the same form (default: the last 2%% of --data)")
parser.add_argument("--loss", choices=LOSSES, default="sigmoid")
parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta; ORPO's lambda (weight of the odds-ratio term)")
parser.add_argument("--label-smoothing", type=float, default=0.0, help="sigmoid (cDPO) and robust: the assumed "
                    "label-flip rate")
parser.add_argument("--rpo-alpha", type=float, default=0.0, help="weight of the NLL of the chosen answer (Iterative "
                    "RPO); 0: off")
parser.add_argument("--batch-size", type=int, default=32, help="pairs per optimizer step, all ranks together")
parser.add_argument("--lr", type=float, default=None, help="default: 2e-5 on the embedded world (2e-4 took pass@1 from "
                    "0.60 to 0.33), 5e-7 for a real model")
add_preference_flags(parser, "dpo")


# ------------------------------------------------------------------------------------------------
# The losses: per pair, on log-probs summed over each completion's tokens

def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None):
    """-> (losses, chosen_rewards, rejected_rewards), each (B,). The rewards are DPO's implicit rewards
    beta * (log pi - log pi_ref) of each completion, detached, for logging.

    Example, sigmoid: margins +1.40 / -0.20 / -2.60 (already right / near tie / backwards)
    lose 0.6256 / 0.7032 / 0.8316 at beta 0.1, with |d loss / d margin| = beta * sigmoid(-beta * margin)
    = 0.0465 / 0.0505 / 0.0565: all near log 2, the backwards pair pushed only 1.2x harder than the right
    one. At beta 0.5 the losses are 0.4032 / 0.7444 / 1.5410 and the gradients 0.1659 / 0.2625 / 0.3929: the
    backwards pair is pushed 2.4x harder than the right one."""
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    margin = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type == "sigmoid":  # DPO; label_smoothing > 0 is conservative DPO (cDPO): eps of the labels flipped
        losses = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    elif loss_type == "robust":  # an unbiased estimate of the clean loss under flip rate eps
        if not 0 <= eps < 0.5:
            raise ValueError(f"robust needs 0 <= label_smoothing < 0.5, got {eps}")
        losses = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    elif loss_type == "hinge":  # SLiC: no loss once beta * margin passes 1
        losses = F.relu(1 - beta * margin)
    elif loss_type in ("ipo", "sigmoid_norm"):  # on length-averaged log-probs, so long answers don't dominate
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"{loss_type} needs chosen_lengths and rejected_lengths")
        norm_margin = chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths
        if loss_type == "ipo":  # a squared error to a target margin 1/(2 beta): never pushes past it
            losses = (norm_margin - 1 / (2 * beta)) ** 2
        else:  # beta acts on a per-token margin here: Tulu 3 used beta = 5
            losses = -F.logsigmoid(beta * norm_margin)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; one of {LOSSES[:5]}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def orpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_lengths, rejected_lengths, beta=0.1):
    """ORPO's odds-ratio term (added to the chosen answer's NLL by the training loop; no reference).
    odds(y) = p / (1 - p) with p the length-averaged probability exp(mean token log-prob);
    loss = -beta * log sigmoid(log odds(chosen) - log odds(rejected)).
    Worked point: mean log-probs -0.5 and -1.0 give log odds 0.43275 and -0.54132, loss 0.1 * 0.32031."""
    avg_c = (policy_chosen_logps / chosen_lengths).clamp(max=-1e-6)  # p < 1, so log(1 - p) is finite
    avg_r = (policy_rejected_logps / rejected_lengths).clamp(max=-1e-6)
    log_odds = (avg_c - torch.log(-torch.expm1(avg_c))) - (avg_r - torch.log(-torch.expm1(avg_r)))
    return -beta * F.logsigmoid(log_odds), beta * avg_c.detach(), beta * avg_r.detach()


# ------------------------------------------------------------------------------------------------
# One micro-batch of each loss family: its share of the global batch's loss, and statistics summed over
# it (TRL's names). Each loss term is divided by its global count (pairs or tokens of the whole step,
# every micro-batch and rank), so accumulation and DDP give the one-batch gradient (common.py).

def pair_stats(chosen_logps, rejected_logps, chosen_rewards, rejected_rewards):
    return {"rewards/chosen": chosen_rewards.sum().item(), "rewards/rejected": rejected_rewards.sum().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).sum().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).sum().item(),
            "logps/chosen": chosen_logps.detach().sum().item(), "logps/rejected": rejected_logps.detach().sum().item()}


def dpo_micro_loss(model, pairs, ref, *, pad_id, capacity, pairs_per_step, chosen_tokens_per_step, beta, loss_type,
                   label_smoothing=0.0, rpo_alpha=0.0):
    """DPO and its reference-based variants on a micro-batch of pairs; ref: (n, 2) reference log-probs.
    rpo_alpha adds the chosen answers' NLL, per chosen token of the step (Iterative RPO)."""
    logps, lengths = completion_logps(model, [e for pair in pairs for e in pair[:2]], pad_id, "packed", capacity)
    chosen, rejected = logps[0::2], logps[1::2]
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=beta,
                                                        loss_type=loss_type, label_smoothing=label_smoothing,
                                                        chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])
    loss = losses.sum() / pairs_per_step
    if rpo_alpha:
        loss = loss - rpo_alpha * chosen.sum() / chosen_tokens_per_step
    return loss, pair_stats(chosen, rejected, chosen_rewards, rejected_rewards)


def orpo_micro_loss(model, pairs, *, pad_id, capacity, pairs_per_step, chosen_tokens_per_step, beta):
    """ORPO: the SFT loss on the chosen answers (per chosen token of the step) plus the odds-ratio term
    (per pair of the step); no reference."""
    logps, lengths = completion_logps(model, [e for pair in pairs for e in pair[:2]], pad_id, "packed", capacity)
    chosen, rejected = logps[0::2], logps[1::2]
    losses, chosen_rewards, rejected_rewards = orpo_loss(chosen, rejected, lengths[0::2], lengths[1::2], beta)
    loss = losses.sum() / pairs_per_step - chosen.sum() / chosen_tokens_per_step
    return loss, pair_stats(chosen, rejected, chosen_rewards, rejected_rewards)


# ------------------------------------------------------------------------------------------------
# Know before you OOM

def memory_estimate(args, init, *, world_size=1, cuda=False) -> dict:
    """This run's peak memory per device (peak_memory.estimate), from its flags and init's config.json:
    what main prints before it loads the model, and `python memory.py --init FOLDER dpo [flags]` prints.
    A pass holds at most a step's pairs on this rank, both sides at --max-len; a live reference is a frozen
    copy of the policy (none for ORPO, none with LoRA: the adapters off)."""
    policy = peak_memory.Shape.of(load_config(init))
    live_ref = args.ref == "live" and args.loss != "orpo" and not args.lora_rank
    step_tokens = -(-args.batch_size // world_size) * 2 * args.max_len
    return peak_memory.estimate(trained=[policy], frozen=[policy] * live_ref, lora_rank=args.lora_rank,
                                micro_batch_tokens=min(args.micro_batch_tokens, step_tokens), world_size=world_size,
                                fsdp=args.fsdp,
                                cuda=cuda, grad_checkpointing=args.grad_checkpointing,
                                sample_rows=32 * args.samples if args.pairs != "embedded" else 0, sample_prompts=32,
                                sample_tokens=args.max_len)


def main():
    args = parser.parse_args()
    check_pair_flags(args)
    orpo = args.loss == "orpo"
    if args.rpo_alpha and orpo:
        raise UserError("--rpo-alpha adds the chosen answer's NLL to a reference-based pair loss; --loss orpo has it "
                        "already")
    if args.ref == "live" and orpo:
        raise UserError("--ref live: ORPO has no reference model")
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    held_out = load_preferences(args.eval_data, "--eval-data") if args.eval_data else None
    if args.data:  # a user file: --eval-data, or its last 2% held out
        train_rows, val_rows = split_heldout(load_preferences(args.data), held_out)
    else:
        train_rows = preference_pairs("train", args.num_train, seed=args.seed) if args.pairs == "embedded" else None
        val_rows = held_out or preference_pairs("test", args.num_val, seed=args.seed)
    dist, out_dir = start_run(args, "dpo", "chat_dpo")
    device = dist.device
    if args.data and (warning := overlap_warning(train_rows, val_rows)):  # the held-out rows should be new to training
        print0(warning)
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"), head="lm")
    tok = load_tokenizer(init)

    ckpt = resume_checkpoint(out_dir) if args.resume else None
    peak_memory.check(memory_estimate(args, init, world_size=dist.world_size, cuda=device.type == "cuda"), device)
    # float32 master weights; under torchrun wrapped in DDP, or sharded with --fsdp
    lora = lora_options(args, init)  # None without --lora-rank
    model = wrap_model(load_model(init, fsdp=args.fsdp, save_dtype=args.save_dtype, lora=lora,
                                  head_precision=args.head_precision),
                       fsdp=args.fsdp)
    if args.pairs != "embedded" and not args.data:
        train_rows = sampled_pairs(model, tok, num_prompts=args.num_train, samples=args.samples,
                                   temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                   tools=args.tools, judge=args.judge, rubric=args.rubric)
    settle_chat_template(tok, train_rows, args.chat_template)  # the template checkpoints ship renders as we train
    items, counts = pair_items(tok, train_rows, args.max_len)
    val_items, _ = pair_items(tok, val_rows, args.max_len)
    if not items:
        raise UserError(f"no training example fits in --max-len {args.max_len}: {counts}")
    print0(f"data: {len(items)} training pairs, {len(val_items)} held-out pairs; {counts}"
           + ("" if val_items else " (no held-out pair: the implicit-reward accuracy is not measured)"))

    # the reference log-probs (or a frozen copy for live forwards), and greedy pass@1 at the start
    pad, cap = tok.pad_id, args.max_len
    val_ref, ref, ref_model = pair_references(model, items, val_items, ref="none" if orpo else args.ref, init=init,
                                              fsdp=args.fsdp, lora=lora, pad_id=pad, capacity=cap)
    eval_rows = rl_prompts("test", args.eval_problems) if not args.data else []  # the embedded world's answer key
    start = ({}, None) if ckpt else pass_at_start(model, tok, eval_rows, max_new_tokens=args.max_new_tokens,
                                                  tools=args.tools)
    if ckpt:
        lora = lora_options(args, ckpt, resume=True)  # the checkpoint's adapter, continued
        model = wrap_model(load_model(ckpt, fsdp=args.fsdp, save_dtype=args.save_dtype, lora=lora,
                                      head_precision=args.head_precision),
                           fsdp=args.fsdp)
        if ref_model is not None and args.lora_rank:  # the reloaded policy, with its adapters off
            ref_model = reference_model(model, init, args.fsdp, lora)
    unwrap(model).grad_checkpointing = args.grad_checkpointing

    per_step = args.batch_size
    if per_step < dist.world_size:
        raise UserError(f"--batch-size {per_step} must be at least the number of ranks ({dist.world_size})")
    check_batch_fits(per_step, len(items), "training pairs")
    steps_per_epoch = math.ceil(len(items) / per_step)
    total_steps = args.steps or max(1, round(args.epochs * steps_per_epoch))
    warmup_steps = fit_warmup(args.warmup_steps, total_steps)
    peak_lr = learning_rate(args.lr, "dpo", unwrap(model))
    optimizer = make_optimizer(model, peak_lr, args.weight_decay)
    start_step = resume_state(ckpt, optimizer, model)["step"]
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; loss {args.loss}, beta {args.beta}, ref "
           f"{'none' if orpo else args.ref}; {total_steps} steps ({steps_per_epoch} per epoch)")
    fwd = torch.compile(model) if args.compile else model
    model.train()

    log = open_run(args, out_dir, "dpo")  # every input checked: now --overwrite replaces the old run
    bar = progress(range(start_step, total_steps), initial=start_step, total=total_steps, desc=args.loss)
    for step in bar:
        lr = lr_at(step, total_steps, peak_lr, warmup_steps, args.final_lr_ratio)
        set_lr(optimizer, lr)
        mine = epoch_batch(len(items), step, per_step, args.seed)[dist.rank::dist.world_size]
        lengths = [len(items[i][0][0]) + len(items[i][1][0]) for i in mine]
        micros = [[mine[j] for j in part] for part in micro_batches(lengths, args.micro_batch_tokens, packed=True)]
        # the global normalizer of the chosen answers' NLL (ORPO, RPO): their tokens in the whole step
        chosen_tokens = all_reduce_sum(float(sum(sum(t != IGNORE for t in items[i][0][1]) for i in mine)))
        totals = {"loss": 0.0}
        for j, m in enumerate(micros):
            # DDP sums gradients over ranks only at the last pass of the step (forward and backward)
            with no_sync(model, last=j == len(micros) - 1):
                if not m:  # this rank has nothing left: join the other ranks' collectives, train nothing
                    idle_pass(fwd)
                    if ref_model is not None:
                        idle_pass(ref_model, backward=False)
                    continue
                micro = [items[i] for i in m]
                if orpo:
                    loss, stats = orpo_micro_loss(fwd, micro, pad_id=pad, capacity=cap, pairs_per_step=per_step,
                                                  chosen_tokens_per_step=chosen_tokens, beta=args.beta)
                else:
                    loss, stats = dpo_micro_loss(fwd, micro, reference_of(m, items, ref, ref_model, pad, cap),
                                                 pad_id=pad, capacity=cap,
                                                 pairs_per_step=per_step, chosen_tokens_per_step=chosen_tokens,
                                                 beta=args.beta, loss_type=args.loss,
                                                 label_smoothing=args.label_smoothing, rpo_alpha=args.rpo_alpha)
                check_finite(loss, step + 1)
                loss.backward()
            totals["loss"] += loss.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        grad_norm = optimizer_step(model, optimizer, args.grad_clip)
        totals = all_reduce_dict(totals, keys=["loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
                                               "rewards/accuracies", "logps/chosen", "logps/rejected"])
        metrics = {"loss": round(totals["loss"], 6),
                   **{k: round(v / per_step, 5) for k, v in totals.items() if k != "loss"},
                   "lr": lr, "grad_norm": round(grad_norm, 4), "peak_mem_mb": round(peak_memory_mb(device))}
        if ((step + 1) % args.eval_every == 0 or step + 1 == total_steps) and val_items:
            ev = evaluate_pairs(model, val_items, val_ref, pad, cap, args.beta)
            metrics.update({f"val/{k}": round(v, 4) for k, v in ev.items()})
            if dist.is_main:
                bar.write(pair_eval_line(step + 1, metrics["loss"], ev))
        log.log(step + 1, **metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == total_steps:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, {"run_config": vars(args)}, lora=lora)

    ev = final_scores(model, tok, val_items, val_ref, eval_rows, start, pad_id=pad, capacity=cap, beta=args.beta,
                      max_new_tokens=args.max_new_tokens, tools=args.tools)
    ev["ref"] = "none" if orpo else args.ref
    log.log(total_steps, **{f"final/{k}": v for k, v in ev.items()})
    write_eval(out_dir, ev)
    log.close()


if __name__ == "__main__":
    run_main(main)
