"""
KTO: preference learning from single answers labeled good or bad, no pairs needed.

Kahneman-Tversky optimization (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306) keeps DPO's implicit
reward beta * (log pi(y|x) - log pi_ref(y|x)) but scores each answer alone, against a reference point: a good
answer's reward should rise above it, a bad one's fall below it, through a sigmoid that saturates (losses
loom larger than gains: desirable_weight and undesirable_weight). The reference point is the batch's own
KL estimate, the mean log-ratio of mismatched prompt/answer pairs (each answer given the next row's
completion), clamped at 0 and detached. So data that is only thumbs up or down (most production feedback)
trains a policy; a pair gives one good and one bad answer.

    python chat_kto.py                                             # 1 CPU, the embedded world's pairs, unpaired
    python chat_kto.py --data feedback.jsonl --init /models/my-sft --device cuda     # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_kto.py --data feedback.jsonl --init ...   # N GPUs

Data: --data FILE.jsonl with rows {"prompt", "completion", "label": true | false} (TRL's unpaired form), or
preference pairs, each giving its chosen answer as good and its rejected one as bad. The sequence
log-probs, the reference and the held-out implicit-reward accuracy are chat_dpo.py's. Writes
$NANOPOST_HOME/kto/<run>/ (checkpoints/, metrics.jsonl, eval.json).
"""
import argparse
import json
import math
import os

import torch

import peak_memory
from checkpoint import (load_config, load_model, load_tokenizer, reference_model, resolve_model_path, resume_checkpoint,
                        resume_state, save_checkpoint)
from common import (UserError, all_reduce_dict, all_reduce_sum, check_finite, fit_warmup, idle_pass, learning_rate,
                    lr_at, make_optimizer, nanopost_home, no_sync, optimizer_step, peak_memory_mb, print0, progress,
                    run_main, set_lr, unwrap, wrap_model)
from data import kto_rows, load_kto, split_heldout
from decontaminate import overlap_warning
from lora import lora_options
from packing import check_batch_fits, epoch_batch, micro_batches
from preferences import (add_preference_flags, check_pair_flags, completion_example, completion_logps, evaluate_pairs,
                         final_scores, pair_eval_line, pair_items, pair_references, pass_at_start, reference_of,
                         sampled_pairs)
from rundir import open_run, start_run, write_eval
from tasks import preference_pairs, rl_prompts
from tokenizer import settle_chat_template

parser = argparse.ArgumentParser(description="KTO: preference learning from single answers labeled good or bad")
parser.add_argument("--init", default=None, help="chat model folder or run dir to start from (default: the SFT run)")
parser.add_argument("--data", default=None, help="JSONL of {prompt, completion, label} rows or preference pairs "
                    "(default: the embedded world's pairs, unpaired)")
parser.add_argument("--eval-data", default=None, help="held-out rows of the same forms (default: the last 2%% of "
                    "--data)")
parser.add_argument("--beta", type=float, default=0.1, help="the implicit reward's beta")
parser.add_argument("--desirable-weight", type=float, default=1.0, help="weight of the good answers' loss")
parser.add_argument("--undesirable-weight", type=float, default=1.0, help="weight of the bad answers' loss")
parser.add_argument("--batch-size", type=int, default=32, help="answers per optimizer step, all ranks together")
parser.add_argument("--lr", type=float, default=None, help="default: DPO's (2e-5 on the embedded world, 5e-7 for a "
                    "real model)")
add_preference_flags(parser, "kto")  # --pairs, --max-len, --ref, --steps, --eval-problems, --run-name, --lora-rank, ...


# ------------------------------------------------------------------------------------------------
# The loss, per answer, on log-probs summed over each completion's tokens

def kto_loss(policy_logps, ref_logps, desirable, kl, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    """KTO on single answers labeled good (desirable) or bad: a good answer's reward
    beta * (log-ratio) should rise above the reference point beta * kl, a bad one's fall below it.
    kl: the batch's KL estimate (mean log-ratio of mismatched prompt/answer pairs, clamped at 0, detached).
    -> (losses, rewards). Worked point: log-ratio +0.5, kl 0.1, beta 0.1: good 1 - sigmoid(0.04) = 0.49000."""
    logratios = policy_logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, good, bad), beta * logratios.detach()


def reference_point(partner_logratio_sum, n):
    """KTO's reference point: the KL estimate, the mean log-ratio log pi / pi_ref of n mismatched prompt /
    answer pairs, clamped at 0 (the KTO paper, TRL's KTOTrainer): a KL is never negative, and an unclamped
    estimate runs negative once the policy moves away from answers that fit no prompt, dragging every
    desirable answer's target down with it (-17.6 within 12 steps in nanopost's audit).
    Example: log-ratios summing to +0.8 over 8 partners: 0.1; summing to -3.2: 0.0, not -0.4."""
    return max(0.0, partner_logratio_sum / n)


def kto_micro_loss(model, answers, ref, *, pad_id, capacity, answers_per_step, kl, beta, desirable_weight,
                   undesirable_weight):
    """KTO on a micro-batch of single answers (answer example, partner example, desirable); ref: (n, 2)
    reference log-probs of the answers and partners; kl: the step's reference point."""
    logps, _ = completion_logps(model, [a for a, _, _ in answers], pad_id, "packed", capacity)
    good = torch.tensor([g for _, _, g in answers], device=logps.device)
    losses, rewards = kto_loss(logps, ref[:, 0], good, kl, beta, desirable_weight, undesirable_weight)
    g = good.float()
    stats = {"rewards/chosen": (rewards * g).sum().item(), "rewards/rejected": (rewards * (1 - g)).sum().item(),
             "logps/chosen": (logps.detach() * g).sum().item(),
             "logps/rejected": (logps.detach() * (1 - g)).sum().item(),
             "good": g.sum().item(), "bad": (1 - g).sum().item()}
    return losses.sum() / answers_per_step, stats


# ------------------------------------------------------------------------------------------------
# Data: single answers, each with a mismatched partner for the reference point

def kto_items(tok, singles, max_len):
    """KTO's data: single answers {"prompt", "completion", "label"} (data.kto_rows), each with a mismatched
    partner (its prompt, the next answer's completion) whose log-ratio estimates the KL reference point.
    -> (answer example, partner example, desirable)."""
    items, counts = [], {"dropped_prompt_too_long": 0}
    for i, s in enumerate(singles):
        a = completion_example(tok, s["prompt"], s["completion"], s.get("tools"), max_len)
        b = completion_example(tok, s["prompt"], singles[(i + 1) % len(singles)]["completion"], s.get("tools"), max_len)
        if a is None or b is None:
            counts["dropped_prompt_too_long"] += 1
        else:
            items.append((a, b, s["label"]))
    return items, counts


def pairs_of_singles(singles):
    """Held-out pairs from labeled single answers: a good and a bad answer to the same prompt (none when
    the file never answers a prompt both ways; the implicit-reward accuracy is then not measured)."""
    by_prompt = {}
    for s in singles:
        by_prompt.setdefault(json.dumps(s["prompt"]), {}).setdefault(s["label"], s["completion"])
    return [{"prompt": json.loads(p), "chosen": d[True], "rejected": d[False]} for p, d in by_prompt.items()
            if len(d) == 2]


# ------------------------------------------------------------------------------------------------
# Know before you OOM

def memory_estimate(args, init, *, world_size=1, cuda=False) -> dict:
    """This run's peak memory per device (peak_memory.estimate), from its flags and init's config.json:
    what main prints before it loads the model, and `python memory.py --init FOLDER kto [flags]` prints.
    A pass holds at most a step's answers on this rank, each at --max-len."""
    policy = peak_memory.Shape.of(load_config(init))
    step_tokens = -(-args.batch_size // world_size) * args.max_len
    return peak_memory.estimate(trained=[policy], frozen=[policy] * (args.ref == "live" and not args.lora_rank),
                                lora_rank=args.lora_rank, micro_batch_tokens=min(args.micro_batch_tokens, step_tokens),
                                world_size=world_size, fsdp=args.fsdp, cuda=cuda,
                                grad_checkpointing=args.grad_checkpointing,
                                sample_rows=32 * args.samples if args.pairs != "embedded" else 0, sample_prompts=32,
                                sample_tokens=args.max_len)


def main():
    args = parser.parse_args()
    check_pair_flags(args)
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    held_out = load_kto(args.eval_data, "--eval-data") if args.eval_data else None
    if args.data:  # a user file: --eval-data, or its last 2% held out; held-out pairs from its labeled answers
        train_rows, val_rows = split_heldout(load_kto(args.data), held_out)
        val_rows = pairs_of_singles(val_rows)
    else:
        train_rows = preference_pairs("train", args.num_train, seed=args.seed) if args.pairs == "embedded" else None
        val_rows = pairs_of_singles(held_out) if held_out else preference_pairs("test", args.num_val, seed=args.seed)
    dist, out_dir = start_run(args, "kto", "chat_kto")
    device = dist.device
    if args.data and (warning := overlap_warning(train_rows, val_rows)):  # the held-out rows should be new to training
        print0(warning)
    if args.data and len(labels := {s["label"] for s in train_rows}) == 1:
        only = labels.pop()
        print0(f"warning: every training answer of {args.data} is labelled {str(only).lower()}: KTO then only "
               f"moves those answers against the reference point and learns nothing of the other kind; add answers "
               f"labelled {'false (undesirable)' if only else 'true (desirable)'}")
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
    if "label" not in train_rows[0]:  # pairs (the embedded world's, or sampled): two labeled answers each
        train_rows = [single for r in train_rows for single in kto_rows(r)]
    settle_chat_template(tok, train_rows, args.chat_template)  # the template checkpoints ship renders as we train
    items, counts = kto_items(tok, train_rows, args.max_len)
    val_items, _ = pair_items(tok, val_rows, args.max_len)
    if not items:
        raise UserError(f"no training example fits in --max-len {args.max_len}: {counts}")
    print0(f"data: {len(items)} training answers, {len(val_items)} held-out pairs; {counts}"
           + ("" if val_items else " (no held-out pair: the implicit-reward accuracy is not measured)"))

    # the reference log-probs (or a frozen copy for live forwards), and greedy pass@1 at the start
    pad, cap = tok.pad_id, args.max_len
    val_ref, ref, ref_model = pair_references(model, items, val_items, ref=args.ref, init=init, fsdp=args.fsdp,
                                              lora=lora, pad_id=pad, capacity=cap)
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
    check_batch_fits(per_step, len(items), "training answers")
    steps_per_epoch = math.ceil(len(items) / per_step)
    total_steps = args.steps or max(1, round(args.epochs * steps_per_epoch))
    warmup_steps = fit_warmup(args.warmup_steps, total_steps)
    peak_lr = learning_rate(args.lr, "dpo", unwrap(model))
    optimizer = make_optimizer(model, peak_lr, args.weight_decay)
    start_step = resume_state(ckpt, optimizer, model)["step"]
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; beta {args.beta}, ref {args.ref}; "
           f"{total_steps} steps ({steps_per_epoch} per epoch)")
    fwd = torch.compile(model) if args.compile else model
    model.train()

    log = open_run(args, out_dir, "kto")  # every input checked: now --overwrite replaces the old run
    bar = progress(range(start_step, total_steps), initial=start_step, total=total_steps, desc="kto")
    for step in bar:
        lr = lr_at(step, total_steps, peak_lr, warmup_steps, args.final_lr_ratio)
        set_lr(optimizer, lr)
        mine = epoch_batch(len(items), step, per_step, args.seed)[dist.rank::dist.world_size]
        micros = [[mine[j] for j in part] for part in
                  micro_batches([len(items[i][0][0]) for i in mine], args.micro_batch_tokens, packed=True)]
        # the reference point: the mean log-ratio of the mismatched partners over the global batch
        kl_sum = 0.0
        with torch.no_grad():
            for m in micros:
                if not m:
                    idle_pass(fwd, backward=False)
                    if ref_model is not None:
                        idle_pass(ref_model, backward=False)
                    continue
                partners = completion_logps(fwd, [items[i][1] for i in m], pad, "packed", cap)[0]
                kl_sum += (partners - reference_of(m, items, ref, ref_model, pad, cap)[:, 1]).sum().item()
        kl = reference_point(all_reduce_sum(kl_sum), per_step)
        totals = {"loss": 0.0}
        for j, m in enumerate(micros):
            # DDP sums gradients over ranks only at the last pass of the step (forward and backward)
            with no_sync(model, last=j == len(micros) - 1):
                if not m:  # this rank has nothing left: join the other ranks' collectives, train nothing
                    idle_pass(fwd)
                    if ref_model is not None:
                        idle_pass(ref_model, backward=False)
                    continue
                loss, stats = kto_micro_loss(fwd, [items[i] for i in m],
                                             reference_of(m, items, ref, ref_model, pad, cap), pad_id=pad, capacity=cap,
                                             answers_per_step=per_step, kl=kl, beta=args.beta,
                                             desirable_weight=args.desirable_weight,
                                             undesirable_weight=args.undesirable_weight)
                check_finite(loss, step + 1)
                loss.backward()
            totals["loss"] += loss.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        grad_norm = optimizer_step(model, optimizer, args.grad_clip)
        totals = all_reduce_dict(totals, keys=["loss", "rewards/chosen", "rewards/rejected", "logps/chosen",
                                               "logps/rejected", "good", "bad"])
        n_good, n_bad = max(totals["good"], 1), max(totals["bad"], 1)  # per good answer, per bad answer
        metrics = {"rewards/chosen": totals["rewards/chosen"] / n_good, "kl": kl,
                   "rewards/rejected": totals["rewards/rejected"] / n_bad,
                   "logps/chosen": totals["logps/chosen"] / n_good, "logps/rejected": totals["logps/rejected"] / n_bad}
        metrics = {"loss": round(totals["loss"], 6), **{k: round(v, 5) for k, v in metrics.items()}, "lr": lr,
                   "grad_norm": round(grad_norm, 4), "peak_mem_mb": round(peak_memory_mb(device))}
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
    ev["ref"] = args.ref
    log.log(total_steps, **{f"final/{k}": v for k, v in ev.items()})
    write_eval(out_dir, ev)
    log.close()


if __name__ == "__main__":
    run_main(main)
