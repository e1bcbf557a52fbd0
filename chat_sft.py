"""
Supervised fine-tuning (SFT): copy the expert, with the loss on exactly the assistant's tokens.

The first stage of every recipe (InstructGPT, Ouyang et al. 2022, https://arxiv.org/abs/2203.02155).
Each conversation is rendered by tokenizer.render_conversation into ids and a loss mask that is 1
exactly on what the assistant wrote (its thinking, text, tool calls, its <|im_end|>) and 0 on system,
user and tool-result tokens. The model reads the whole conversation as context and is graded only on
the mask-1 tokens: skip the mask and it learns to write user turns too; leave <|im_end|> out of it
and it never learns to stop.

Conversations are packed best-fit-decreasing into fixed-length rows, each conversation a document of
its own (positions restart, attention never crosses), or padded one per row with --packing none.

    python chat_sft.py                                              # 1 CPU, the embedded world
    python chat_sft.py --data my.jsonl --init /models/Qwen3-0.6B-Base --device cuda   # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_sft.py --data my.jsonl --init ...  # N GPUs
    python chat_sft.py --data my.jsonl --init /models/Qwen3-8B-Base --device cuda --lora-rank 32 --lr 1e-4  # LoRA

Data: --data FILE.jsonl with rows {"messages": [...], "tools": [...]?}; validated before any model
is loaded. Writes $NANOPOST_HOME/sft/<run>/ (checkpoints/, metrics.jsonl, eval.json).
"""
import argparse
import math
import os

import torch

import peak_memory
from checkpoint import (load_config, load_model, load_tokenizer, resolve_model_path, resume_checkpoint, resume_state,
                        save_checkpoint)
from common import (Default, UserError, all_reduce_sum, autocast, check_finite, fit_warmup, learning_rate, lr_at,
                    make_optimizer, nanopost_home, no_sync, optimizer_step, peak_memory_mb, print0, progress, run_main,
                    set_lr, unwrap, wrap_model)
from data import load_sft, mixture_rows
from decontaminate import overlap_warning
from evaluation import MIN_HELDOUT, heldout_scores, scores_line
from lora import add_lora_flags, lora_options
from packing import IGNORE, check_batch_fits, epoch_batch, heldout_loss, make_batch, pack_bfd, sft_example
from rundir import add_run_flags, open_run, start_run, write_eval
from tasks import rl_prompts, sft_conversations
from tokenizer import settle_chat_template

parser = argparse.ArgumentParser(description="supervised fine-tuning on the assistant's tokens")
parser.add_argument("--init", default=None, help="model folder or run dir to start from (default: the tiny base)")
parser.add_argument("--data", default=None, help="JSONL of {'messages': [...]} rows, or a mixture of files, "
                    "a.jsonl:0.7,b.jsonl:0.3 (default: the embedded world)")
parser.add_argument("--eval-data", default=None, help="held-out JSONL rows for the validation loss (default: the last "
                    "2%% of --data)")
parser.add_argument("--num-train", type=int, default=6000, help="embedded-world training conversations")
parser.add_argument("--num-val", type=int, default=200, help="embedded-world validation conversations")
parser.add_argument("--packing", choices=["bfd", "none"], default="bfd", help="best-fit-decreasing packing, or one "
                    "conversation per padded row")
parser.add_argument("--overlong", choices=["drop", "crop"], default="drop", help="what to do with a conversation "
                    "longer than --seq-len")
parser.add_argument("--seq-len", type=int, default=512, help="tokens per row")
parser.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step, all ranks together")
parser.add_argument("--device-batch-size", type=int, default=8, help="rows per forward pass")
parser.add_argument("--epochs", type=float, default=2.0)
parser.add_argument("--steps", type=int, default=0, help="optimizer steps (overrides --epochs when > 0)")
parser.add_argument("--lr", type=float, default=None, help="default: 1e-3 on the embedded world, 1e-5 for a real model")
parser.add_argument("--warmup-steps", type=int, default=Default(10), help="at most a tenth of the run unless given")
parser.add_argument("--final-lr-ratio", type=float, default=0.1, help="cosine decay to this fraction of --lr")
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
parser.add_argument("--eval-problems", type=int, default=200, help="embedded-world held-out problems sampled at the "
                    "end (and at --sample-every); 0: none")
parser.add_argument("--sample-every", type=int, default=0, help="steps between sampling evals (0: only at the end)")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--pass-k", type=int, default=4, help="held-out pass@1..k at temperature 1, besides greedy (0: "
                    "greedy only)")
parser.add_argument("--tools", action="store_true", help="evaluate with the calculator offered (as chat_rl.py --tools)")
parser.add_argument("--save-every", type=int, default=200)
parser.add_argument("--compile", action="store_true")
add_run_flags(parser, "sft")  # --run-name, --seed, --device, --resume, --wandb, --fsdp, ...
add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# The loss

def sft_loss(token_logprobs, num_trained_global):
    """The cross-entropy -log p summed over the trained tokens (the model's log-probs are 0 elsewhere),
    divided by the number of trained tokens in the WHOLE global batch (all micro-batches, all ranks).
    Dividing each micro-batch by its own count instead would weight a token of a short micro-batch more
    than one of a long one, and make the gradient depend on how the batch was split (open-instruct#1137,
    verl#5625).

    Example, a twelve-token conversation: five answer tokens predicted at p = 0.40, 0.85, 0.92, 0.78,
    0.96 give -log(0.40*0.85*0.92*0.78*0.96) = 1.4515, / 5 = 0.2903; grading all twelve (the seven prompt
    tokens at a mean penalty of 0.7715 too) gives 0.5710: training on the prompt roughly doubles it."""
    return -token_logprobs.sum() / num_trained_global


# ------------------------------------------------------------------------------------------------
# Data: render, handle overlong conversations, pack or pad

def render_examples(tok, rows, seq_len, overlong):
    """Render every conversation; returns (examples, counts). A conversation whose inputs exceed seq_len
    is dropped or cropped (never silently): both are counted and reported."""
    examples, counts = [], {"kept": 0, "dropped": 0, "cropped": 0, "dropped_empty_after_crop": 0}
    for r in rows:
        ids, mask = tok.render_conversation(r["messages"], tools=r.get("tools"))
        if len(ids) - 1 > seq_len:
            if overlong == "drop":
                counts["dropped"] += 1
                continue
            ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
            if not any(mask[1:]):
                counts["dropped_empty_after_crop"] += 1
                continue
            counts["cropped"] += 1
        examples.append(sft_example(ids, mask))
        counts["kept"] += 1
    return examples, counts


def build_rows(examples, seq_len, packing):
    if packing == "bfd":
        return pack_bfd([len(x) for x, _ in examples], seq_len)
    return [[i] for i in range(len(examples))]


# ------------------------------------------------------------------------------------------------
# Know before you OOM

def memory_estimate(args, init, *, world_size=1, cuda=False) -> dict:
    """This run's peak memory per device (peak_memory.estimate), from its flags and init's config.json:
    what main prints before it loads the model, and `python memory.py --init FOLDER sft [flags]` prints."""
    return peak_memory.estimate(trained=[peak_memory.Shape.of(load_config(init))], lora_rank=args.lora_rank,
                                micro_batch_tokens=args.device_batch_size * args.seq_len, world_size=world_size,
                                fsdp=args.fsdp, cuda=cuda, grad_checkpointing=args.grad_checkpointing)


def main():
    args = parser.parse_args()
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    held_out = load_sft(args.eval_data, "--eval-data") if args.eval_data else None
    if args.data:  # a user file, or a mixture of files: --eval-data, or each file's last 2% held out
        train_rows, val_rows = mixture_rows(args.data, load_sft, held_out, seed=args.seed)
    else:
        train_rows = sft_conversations("train", args.num_train, seed=args.seed)
        val_rows = held_out or sft_conversations("val", args.num_val, seed=args.seed)
    dist, out_dir = start_run(args, "sft", "chat_sft")
    device = dist.device
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "base", "default"), head="lm")
    tok = load_tokenizer(init)
    settle_chat_template(tok, train_rows, args.chat_template)  # the template checkpoints ship renders as we train
    # pass@1 on held-out problems: the embedded world's (a user's SFT rows have no answer key)
    eval_rows = rl_prompts("test", args.eval_problems) if not args.data else []
    if args.data and (warning := overlap_warning(train_rows, val_rows)):  # the held-out rows should be new to training
        print0(warning)
    train_ex, counts = render_examples(tok, train_rows, args.seq_len, args.overlong)
    val_ex, _ = render_examples(tok, val_rows, args.seq_len, args.overlong)
    if not train_ex:
        raise UserError(f"no training conversation fits in --seq-len {args.seq_len}: {counts}")
    rows = build_rows(train_ex, args.seq_len, args.packing)
    val_sets = {"val_loss": (val_ex, build_rows(val_ex, args.seq_len, args.packing))}
    for source in sorted({r["source"] for r in val_rows if "source" in r}):  # rows that name their source
        ex, _ = render_examples(tok, [r for r in val_rows if r.get("source") == source], args.seq_len, args.overlong)
        if ex:  # the held-out loss of each source too: what a mixture keeps, and what it forgets
            val_sets[f"val_loss/{source}"] = (ex, build_rows(ex, args.seq_len, args.packing))
    n_tokens = sum(len(x) for x, _ in train_ex)
    n_trained = sum(sum(t != IGNORE for t in y) for _, y in train_ex)
    print0(f"data: {counts} conversations over {len(rows)} rows ({args.packing}); {n_tokens:,} tokens, "
           f"{n_trained:,} trained ({n_trained / n_tokens:.0%})")
    if len(val_ex) < MIN_HELDOUT:  # as every stage says of its held-out figures (evaluation.scores_line)
        print0(f"note: the held-out loss rests on {len(val_ex)} conversation(s) (--eval-data, --num-val, or the last "
               f"2% of --data): too few for its changes to mean much; hold out {MIN_HELDOUT} or more")
    if counts["dropped"] or counts["cropped"]:
        print0(f"note: {counts['dropped']} dropped and {counts['cropped']} cropped for exceeding --seq-len "
               f"{args.seq_len} (--overlong {args.overlong})")

    per_step = args.batch_size
    if per_step % (args.device_batch_size * dist.world_size):
        raise UserError(f"--batch-size {per_step} must be a multiple of --device-batch-size x ranks "
                        f"({args.device_batch_size} x {dist.world_size})")
    accum = per_step // (args.device_batch_size * dist.world_size)
    check_batch_fits(per_step, len(rows), "packed rows" if args.packing != "none" else "conversations")
    steps_per_epoch = math.ceil(len(rows) / per_step)
    total_steps = args.steps or max(1, round(args.epochs * steps_per_epoch))
    warmup_steps = fit_warmup(args.warmup_steps, total_steps)

    ckpt = resume_checkpoint(out_dir) if args.resume else None
    peak_memory.check(memory_estimate(args, init, world_size=dist.world_size, cuda=device.type == "cuda"), device)
    # float32 master weights; under torchrun wrapped in DDP, or sharded with --fsdp
    lora = lora_options(args, ckpt or init, resume=bool(ckpt))  # None without --lora-rank
    model = wrap_model(load_model(ckpt or init, fsdp=args.fsdp, save_dtype=args.save_dtype, lora=lora,
                                  head_precision=args.head_precision), fsdp=args.fsdp)
    unwrap(model).grad_checkpointing = args.grad_checkpointing
    peak_lr = learning_rate(args.lr, "sft", unwrap(model))
    optimizer = make_optimizer(model, peak_lr, args.weight_decay)
    start_step = resume_state(ckpt, optimizer, model)["step"]
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; {total_steps} steps "
           f"({steps_per_epoch} per epoch), {accum} micro-batches per step per rank")
    fwd = torch.compile(model) if args.compile else model

    def val_losses():
        return {name: heldout_loss(model, ex, batches, tok.pad_id, args.seq_len, args.packing, device)
                for name, (ex, batches) in val_sets.items()}

    log = open_run(args, out_dir, "sft")  # every input checked: now --overwrite replaces the old run
    bar = progress(range(start_step, total_steps), initial=start_step, total=total_steps, desc="sft")
    for step in bar:
        lr = lr_at(step, total_steps, peak_lr, warmup_steps, args.final_lr_ratio)
        set_lr(optimizer, lr)
        step_rows = [rows[i] for i in epoch_batch(len(rows), step, per_step, args.seed)]
        my_rows = step_rows[dist.rank::dist.world_size]  # this rank's share of the global batch
        micro = [make_batch(train_ex, my_rows[a * args.device_batch_size:(a + 1) * args.device_batch_size],
                            tok.pad_id, args.seq_len, args.packing, device) for a in range(accum)]
        # the normalizer: trained tokens of the whole global batch
        n_global = all_reduce_sum(float(sum((y != IGNORE).sum().item() for _, y, _ in micro)))
        if n_global == 0:  # nothing to train on: skip rather than divide 0 by 0 (nanochat#834)
            print0(f"step {step + 1}: no trained token in the batch, skipped")
            continue
        loss_sum = 0.0
        for a, (x, y, d) in enumerate(micro):
            with no_sync(model, last=a == accum - 1), autocast(device):
                loss = sft_loss(fwd(x, y, doc_ids=d), n_global)
                check_finite(loss, step + 1)
                loss.backward()
            loss_sum += loss.item()
        grad_norm = optimizer_step(model, optimizer, args.grad_clip)
        loss_sum = all_reduce_sum(loss_sum)
        metrics = {"loss": round(loss_sum, 6), "lr": lr, "grad_norm": round(grad_norm, 4),
                   "trained_tokens": int(n_global), "peak_mem_mb": round(peak_memory_mb(device))}
        if (step + 1) % args.eval_every == 0 or step + 1 == total_steps:
            metrics.update({name: round(loss, 6) for name, loss in val_losses().items()})
            if dist.is_main:
                bar.write(f"step {step + 1}: loss {loss_sum:.4f}  val {metrics['val_loss']:.4f}")
        if args.sample_every and (step + 1) % args.sample_every == 0 and eval_rows:
            scores = heldout_scores(model, tok, eval_rows, max_new_tokens=args.max_new_tokens, samples=0,
                                    use_tools=args.tools)
            metrics.update({f"eval/{k}": round(v, 4) for k, v in scores.items()})
        log.log(step + 1, **metrics)
        bar.set_postfix(loss=f"{loss_sum:.3f}", refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == total_steps:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, {"run_config": vars(args)}, lora=lora)

    # held-out: the validation loss, and (on the embedded world) answers graded, every rank its share
    scores = heldout_scores(model, tok, eval_rows, max_new_tokens=args.max_new_tokens, samples=args.pass_k,
                            use_tools=args.tools) if eval_rows else {}
    scores.update(val_losses())
    print0("held-out: " + scores_line(scores, len(eval_rows)))
    log.log(total_steps, **{f"final/{k}": v for k, v in scores.items()})
    write_eval(out_dir, scores)
    log.close()


if __name__ == "__main__":
    run_main(main)
