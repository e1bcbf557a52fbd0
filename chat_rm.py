"""
Reward model (RM): learn to score the better of two answers higher, from (prompt, chosen, rejected) pairs.

The RLHF reward model of InstructGPT (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155): the chat
model's trunk with its vocabulary head swapped for a one-number head (`score`), read at the last token of
the assistant's answer, its <|im_end|>: the one position that has seen the whole prompt and answer.
Trained with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), which constrains only the gap
between two scores (see reward_loss), plus GRM's regularizer (Yang et al. 2024): the chat model's own
LM loss on the chosen answers, which keeps the trunk's features while the head learns to read them (see
lm_regularizer). chat_rl.py and chat_ppo.py use the result as their reward (`--reward rm:PATH`) through
rewards.load_reward_model and rewards.score.

    python chat_rm.py                                               # 1 CPU, the embedded world's pairs
    python chat_rm.py --data prefs.jsonl --init /models/my-sft --device cuda     # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_rm.py --data prefs.jsonl --init ...   # N GPUs

Data: --data FILE.jsonl with rows {"prompt", "chosen", "rejected"} (strings or message lists), or by
default the embedded world's pairs: a wrong arithmetic step, a missing "#### N" line, or a right but
rambling answer, each against the clean solution. The last two are learned in a few dozen steps; an
off-by-one sum is not (it takes thousands of pairs), so the default training mix (--kinds) is mostly
wrong steps, while the held-out pairs stay an equal mix of the three. Writes $NANOPOST_HOME/rm/<run>/ (checkpoints/, a
Hugging Face *ForSequenceClassification folder; metrics.jsonl; eval.json with the held-out pair accuracy).
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F

import peak_memory
from checkpoint import (load_config, load_lm_head, load_model, load_tokenizer, resolve_model_path, resume_checkpoint,
                        resume_state, save_checkpoint)
from common import (Default, UserError, all_gather_objects, all_reduce_dict, autocast, check_finite, dist_info,
                    fit_warmup, idle_pass, learning_rate, lr_at, make_optimizer, nanopost_home, no_sync,
                    optimizer_step, peak_memory_mb, print0, progress, rank_passes, run_main, set_lr, unwrap,
                    wrap_model)
from data import load_preferences, split_heldout
from decontaminate import overlap_warning
from evaluation import scores_line
from lora import add_lora_flags, lora_options
from packing import IGNORE, check_batch_fits, epoch_batch, micro_batches, pack_sequences
from rewards import score
from rundir import add_run_flags, open_run, start_run, write_eval
from tasks import preference_pairs
from tokenizer import settle_chat_template

parser = argparse.ArgumentParser(description="reward model: Bradley-Terry on preference pairs")
parser.add_argument("--init", default=None, help="chat model folder or run dir to start from (default: the SFT run)")
parser.add_argument("--data", default=None, help="JSONL of {prompt, chosen, rejected} rows (default: the embedded "
                    "world)")
parser.add_argument("--eval-data", default=None, help="held-out preference rows (default: the last 2%% of --data)")
parser.add_argument("--num-train", type=int, default=8000, help="embedded-world training pairs (500 steps at "
                    "--batch-size 16)")
parser.add_argument("--kinds", default="wrong_step=14,missing_answer=1,rambling=1",
                    help="embedded-world training mix, kind=weight (held-out pairs are always an equal mix)")
parser.add_argument("--num-val", type=int, default=300, help="held-out pairs (embedded test split; else the file's "
                    "last 2%%)")
parser.add_argument("--max-len", type=int, default=512, help="a pair whose prompt + answer exceeds this is dropped "
                    "(counted)")
parser.add_argument("--batch-size", type=int, default=16, help="pairs per optimizer step, all ranks together")
parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per forward pass (both answers of a "
                    "pair count)")
parser.add_argument("--epochs", type=float, default=1.0)
parser.add_argument("--steps", type=int, default=0, help="optimizer steps (overrides --epochs when > 0)")
parser.add_argument("--lr", type=float, default=None, help="default: 3e-3 on the embedded world, 1e-5 for a real model")
parser.add_argument("--warmup-steps", type=int, default=Default(5), help="at most a tenth of the run unless given")
parser.add_argument("--final-lr-ratio", type=float, default=0.1)
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--center-coef", type=float, default=0.01, help="weight of mean((r_c + r_r)^2); 0 turns it off")
parser.add_argument("--lm-coef", type=float, default=1.0,
                    help="weight of the LM loss on the chosen answers (GRM's regularizer); 0 turns it off")
parser.add_argument("--eval-every", type=int, default=250,
                    help="steps between held-out evaluations (and the last step)")
parser.add_argument("--save-every", type=int, default=200)
parser.add_argument("--compile", action="store_true")
add_run_flags(parser, "rm")  # --run-name, --seed, --device, --resume, --wandb, --fsdp, ...
add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# The loss

def reward_loss(rewards_chosen, rewards_rejected, margin=None, center_coef=None):
    """Bradley-Terry: -log sigmoid(r_c - r_r - margin), mean over pairs.

    Only the gap r_c - r_r enters, so adding a constant to every score changes nothing and the scale
    drifts freely: a score from one batch cannot be compared with one from another, and an RL reward
    wanders. center_coef * mean((r_c + r_r)^2) (0.01 recommended, TRL's center_rewards_coefficient)
    pins the mean score near 0 without touching the ranking. `margin` (Llama 2) asks for a bigger gap
    on pairs the labelers were surer about: graded preferences, a `margin` number on each --data row.

    Example: pairs A..D with margins +1.70, +0.35, +1.40, +0.85 lose 0.1678, 0.5334,
    0.2204, 0.3559: total 1.2775. Score D backwards (-0.85) and it loses 1.2059: total 2.1275, an
    increase of exactly 0.85 (log sigmoid(x) - log sigmoid(-x) = x)."""
    diff = rewards_chosen - rewards_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * ((rewards_chosen + rewards_rejected) ** 2).mean()
    return loss


def lm_regularizer(target_logprobs, n_tokens):
    """GRM's SFT regularizer (Yang et al. 2024, https://arxiv.org/abs/2406.10216): the chat model's
    next-token loss on the chosen answers, from the same hidden states the score head reads (the reward
    model's forward with targets gives their log-probs through the vocabulary head, see attach_vocab_head),
    summed over the graded positions and divided by n_tokens, the step's count over every micro-batch and
    rank (so accumulation and DDP give the one-batch mean).

    Why: the Bradley-Terry loss is one bit per pair, and alone it lets the trunk drift away from what it
    knew as a language model. Keeping the LM loss keeps those features; here that is the arithmetic
    which tells a wrong step from a right one. Measured on the embedded default (python chat_rm.py at
    lr 3e-3, same SFT start), held-out pair accuracy (wrong-step pairs): 0.870 (0.61) without it;
    0.930 (0.79) with lm_coef 1; 0.917 (0.75) with lm_coef 2, and 0.910 (0.73) against 0.883 (0.65)
    for lm_coef 1 at --seed 1 (other pairs, held-out ones too). Again on 2026-12-05 (the SFT run of runs/cpu.sh at
    44a22d4, 4,000 pairs, 125 steps): 0.870 (lm_coef 2), 0.880 (lm_coef 1); with 12,000 pairs (375 steps) lm_coef 2
    gave 0.856, so lm_coef stays 1 (how many pairs pay, and in what batches: docs/rm.md)."""
    return -target_logprobs.sum() / n_tokens


def attach_vocab_head(model, init):
    """The regularizer's vocabulary head: the tied embeddings (trained along), or else a frozen copy of the
    untied lm_head.weight of the chat model at `init` (the reward model has no lm_head of its own),
    attached as the non-persistent buffer frozen_lm_head that the forward reads."""
    if not model.config.tie_word_embeddings:
        model.register_buffer("frozen_lm_head", load_lm_head(init, model.device), persistent=False)


# ------------------------------------------------------------------------------------------------
# The answers a reward is read at

def rm_example(tok, prompt, answer, tools=None):
    """(ids, targets). ids: prompt + answer ending at the answer's last <|im_end|>, the token the reward
    is read at; the same ids as render_for_completion(prompt) + the engine's completion tokens, so what
    the RM trains on is exactly what chat_rl.py hands it. targets[t]: ids[t + 1] where that is a token
    the answer wrote (mask 1, after the prompt), else IGNORE: what lm_regularizer trains on."""
    ids, mask = tok.render_conversation(prompt + answer, tools=tools)
    n_prompt = len(tok.render_for_completion(prompt, tools=tools))
    end = max(i for i, (t, m) in enumerate(zip(ids, mask)) if m and t == tok.eos_id)
    targets = [ids[t + 1] if t + 1 >= n_prompt and mask[t + 1] else IGNORE for t in range(end)] + [IGNORE]
    return ids[:end + 1], targets


# ------------------------------------------------------------------------------------------------
# Data

def render_pairs(tok, rows, max_len):
    """Each row -> (chosen ids, rejected ids, kind, chosen targets, margin: the row's, 0 without one). A pair with a
    side longer than max_len is dropped and counted: cropping it would cut off the <|im_end|> the reward is read at."""
    pairs, dropped = [], 0
    for r in rows:
        c, c_targets = rm_example(tok, r["prompt"], r["chosen"], r.get("tools"))
        j, _ = rm_example(tok, r["prompt"], r["rejected"], r.get("tools"))
        if max(len(c), len(j)) > max_len:
            dropped += 1
            continue
        pairs.append((c, j, r.get("kind", "all"), c_targets, r.get("margin", 0.0)))
    return pairs, dropped


def parse_kinds(spec):
    """"wrong_step=6,missing_answer=1" -> the cycle of kinds preference_pairs draws, each repeated by
    its weight."""
    kinds = []
    for part in spec.split(","):
        kind, _, weight = part.partition("=")
        if not weight.isdigit():
            raise ValueError(f"--kinds: {part!r} is not kind=weight (e.g. wrong_step=6,missing_answer=1,rambling=1)")
        kinds += [kind.strip()] * int(weight)
    return tuple(kinds)


@torch.no_grad()
def evaluate_pairs(model, pairs, batch_size=32):
    """Held-out pair accuracy (r_c > r_r; a tie counts as wrong), mean margin, reward statistics and
    accuracy per kind of pair. Under torchrun every rank scores its share of the pairs, in as many passes
    as the others (an FSDP2 forward is a collective), and the scores are gathered."""
    info = dist_info()
    model = unwrap(model)
    mine = list(range(info.rank, len(pairs), info.world_size))
    scored = {}
    for idx in rank_passes(model, [mine[k:k + batch_size] for k in range(0, len(mine), batch_size)]):
        values = score(model, [pairs[i][0] for i in idx] + [pairs[i][1] for i in idx], batch_size=2 * len(idx))
        scored.update({i: (c, r) for i, c, r in zip(idx, values[:len(idx)], values[len(idx):])})
    for part in all_gather_objects(scored):
        scored.update(part)
    rc = torch.tensor([scored[i][0] for i in range(len(pairs))])
    rr = torch.tensor([scored[i][1] for i in range(len(pairs))])
    both = torch.cat([rc, rr])
    right = (rc > rr).float()
    m = {"pair_accuracy": right.mean().item(), "margin": (rc - rr).mean().item(), "reward_mean": both.mean().item(),
         "reward_min": both.min().item(), "reward_max": both.max().item()}
    for kind in sorted({p[2] for p in pairs}):
        sel = torch.tensor([p[2] == kind for p in pairs])
        m[f"accuracy/{kind}"] = right[sel].mean().item()
    return m


# ------------------------------------------------------------------------------------------------
# Know before you OOM

def memory_estimate(args, init, *, world_size=1, cuda=False) -> dict:
    """This run's peak memory per device (peak_memory.estimate), from its flags and init's config.json:
    what main prints before it loads the model, and `python memory.py --init FOLDER rm [flags]` prints.
    A pass holds at most a step's pairs on this rank, both sides at --max-len; the LM regularizer
    (--lm-coef) runs the vocabulary head on the answers."""
    shape = peak_memory.Shape.of(load_config(init, head="lm" if args.lm_coef else "scalar"))
    step_tokens = -(-args.batch_size // world_size) * 2 * args.max_len
    return peak_memory.estimate(trained=[shape], lora_rank=args.lora_rank, world_size=world_size, fsdp=args.fsdp,
                                micro_batch_tokens=min(args.micro_batch_tokens, step_tokens), cuda=cuda,
                                grad_checkpointing=args.grad_checkpointing)


def main():
    args = parser.parse_args()
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    held_out = load_preferences(args.eval_data, "--eval-data") if args.eval_data else None
    if args.data:  # a user file: --eval-data, or its last 2% held out
        train_rows, val_rows = split_heldout(load_preferences(args.data), held_out)
    else:
        try:
            kinds = parse_kinds(args.kinds)
            train_rows = preference_pairs("train", args.num_train, seed=args.seed, kinds=kinds)
        except ValueError as e:
            raise UserError(f"--kinds {args.kinds!r}: {e}") from None
        val_rows = held_out or preference_pairs("test", args.num_val, seed=args.seed)
    dist, out_dir = start_run(args, "rm", "chat_rm")
    device = dist.device
    if args.data and (warning := overlap_warning(train_rows, val_rows)):  # the held-out rows should be new to training
        print0(warning)
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"))
    tok = load_tokenizer(init)
    settle_chat_template(tok, train_rows, args.chat_template)  # the template checkpoints ship renders as we train
    train_pairs, dropped = render_pairs(tok, train_rows, args.max_len)
    val_pairs, _ = render_pairs(tok, val_rows, args.max_len)
    if not train_pairs:
        raise UserError(f"no training pair fits in --max-len {args.max_len}")
    n_tokens = sum(len(p[0]) + len(p[1]) for p in train_pairs)
    graded = any(p[4] for p in train_pairs)  # graded preferences: the data's margins reach the loss
    print0(f"data: {len(train_pairs)} training pairs ({n_tokens:,} tokens), {len(val_pairs)} held-out"
           + (f"; {dropped} dropped for exceeding --max-len {args.max_len}" if dropped else "")
           + ("; graded: each pair's margin is the gap its loss asks for" if graded else ""))

    per_step = args.batch_size
    if per_step < dist.world_size:
        raise UserError(f"--batch-size {per_step} must be at least the number of ranks ({dist.world_size})")
    check_batch_fits(per_step, len(train_pairs), "training pairs")
    steps_per_epoch = math.ceil(len(train_pairs) / per_step)
    total_steps = args.steps or max(1, round(args.epochs * steps_per_epoch))
    warmup_steps = fit_warmup(args.warmup_steps, total_steps)

    ckpt = resume_checkpoint(out_dir) if args.resume else None
    peak_memory.check(memory_estimate(args, init, world_size=dist.world_size, cuda=device.type == "cuda"), device)
    # a fresh score head starts at 0: every reward 0 at step 0
    # float32 master weights (LoRA: a frozen base in the compute dtype, float32 adapters and score head)
    lora = lora_options(args, ckpt or init, resume=bool(ckpt))  # None without --lora-rank
    model = load_model(ckpt or init, head="scalar", fsdp=args.fsdp, save_dtype=args.save_dtype, lora=lora,
                       head_precision=args.head_precision)
    model.grad_checkpointing = args.grad_checkpointing
    if args.lm_coef:
        attach_vocab_head(model, init)
    model = wrap_model(model, fsdp=args.fsdp)  # DDP under torchrun, or FSDP2 with --fsdp
    peak_lr = learning_rate(args.lr, "rm", unwrap(model))
    optimizer = make_optimizer(model, peak_lr, args.weight_decay)
    start_step = resume_state(ckpt, optimizer, model)["step"]
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; {total_steps} steps "
           f"({steps_per_epoch} per epoch)")
    fwd = torch.compile(model) if args.compile else model
    model.train()

    ev = None  # the latest held-out evaluation; the loop's last step always makes one
    log = open_run(args, out_dir, "rm")  # every input checked: now --overwrite replaces the old run
    bar = progress(range(start_step, total_steps), initial=start_step, total=total_steps, desc="rm")
    for step in bar:
        lr = lr_at(step, total_steps, peak_lr, warmup_steps, args.final_lr_ratio)
        set_lr(optimizer, lr)
        step_pairs = [train_pairs[i] for i in epoch_batch(len(train_pairs), step, per_step, args.seed)]
        mine = step_pairs[dist.rank::dist.world_size]
        n_graded = sum(sum(t != IGNORE for t in p[3]) for p in step_pairs)  # LM tokens of the step, all ranks
        totals = {}
        passes = micro_batches([len(p[0]) + len(p[1]) for p in mine], args.micro_batch_tokens, packed=True)
        for j, part in enumerate(passes):
            # DDP sums gradients over ranks only at the last pass of the step (forward and backward)
            with no_sync(model, last=j == len(passes) - 1):
                if not part:  # this rank has no pairs left: join the other ranks' collectives, train nothing
                    idle_pass(fwd)
                    continue
                micro = [mine[i] for i in part]
                n = len(micro)
                ids, docs, targets, ends = pack_sequences([p[0] for p in micro] + [p[1] for p in micro], tok.pad_id,
                                                          "packed", args.max_len, [p[3] for p in micro] + [None] * n)
                with autocast(device):
                    if args.lm_coef:  # the scores, and the chosen answers' log-probs under the chat head
                        values, target_logprobs = fwd(ids.to(device), targets.to(device), doc_ids=docs.to(device))
                    else:
                        values = fwd(ids.to(device), doc_ids=docs.to(device))
                values = values[ends[0].to(device), ends[1].to(device)]
                chosen, rejected = values[:n], values[n:]
                # reward_loss is a mean over this micro-batch's pairs; weighting it by n / per_step makes the
                # sum over micro-batches and ranks the mean over the global batch (see common.py)
                margin = torch.tensor([p[4] for p in micro], device=device) if graded else None
                rm_loss = reward_loss(chosen, rejected, margin=margin, center_coef=args.center_coef) * (n / per_step)
                lm_loss = lm_regularizer(target_logprobs, n_graded) if args.lm_coef else torch.zeros((), device=device)
                loss = rm_loss + args.lm_coef * lm_loss
                check_finite(loss, step + 1)
                loss.backward()
                for k, v in {"reward_loss": rm_loss.item(), "lm_loss": lm_loss.item(),
                             "correct": (chosen > rejected).sum().item(), "margin": (chosen - rejected).sum().item(),
                             "reward_sum": values.sum().item()}.items():
                    totals[k] = totals.get(k, 0.0) + v
        grad_norm = optimizer_step(model, optimizer, args.grad_clip)
        totals = all_reduce_dict(totals, keys=["reward_loss", "lm_loss", "correct", "margin", "reward_sum"])
        metrics = {"loss": round(totals["reward_loss"] + args.lm_coef * totals["lm_loss"], 6),
                   "reward_loss": round(totals["reward_loss"], 6), "lm_loss": round(totals["lm_loss"], 6),
                   "accuracy": totals["correct"] / per_step, "margin": totals["margin"] / per_step,
                   "reward_mean": totals["reward_sum"] / (2 * per_step), "lr": lr, "grad_norm": round(grad_norm, 4),
                   "peak_mem_mb": round(peak_memory_mb(device))}
        if (step + 1) % args.eval_every == 0 or step + 1 == total_steps:
            ev = evaluate_pairs(model, val_pairs)
            metrics.update({f"val/{k}": round(v, 4) for k, v in ev.items()})
            if dist.is_main:
                bar.write(f"step {step + 1}: loss {metrics['loss']:.4f}  held-out accuracy {ev['pair_accuracy']:.3f}  "
                          f"margin {ev['margin']:.3f}")
        log.log(step + 1, **metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.2f}", refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == total_steps:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, {"run_config": vars(args)}, lora=lora)

    if ev is None:  # resumed with no step left to train
        ev = evaluate_pairs(model, val_pairs)  # every rank its share
    print0("held-out pairs: " + scores_line(ev, len(val_pairs)))
    log.log(total_steps, **{f"final/{k}": v for k, v in ev.items()})
    write_eval(out_dir, ev)
    log.close()


if __name__ == "__main__":
    run_main(main)
