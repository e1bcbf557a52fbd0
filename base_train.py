"""
Pretrain the tiny base model of the embedded default world.

Real users start from a real base checkpoint (Qwen3-0.6B-Base, ...) and skip this script. The
embedded default cannot download one, so this script makes one in a few minutes of CPU: it trains
the byte-level BPE tokenizer on the world's text, then a small GPT on the world's plain-text stream
(word problems followed by their worked solutions, no chat tokens), the next-token loss on every
token, as in any pretraining (the nanoGPT recipe). The base it leaves behind writes the solution
format ("... = 19 apples.\\n#### 19"), which is what SFT then puts in the chat format.

    python base_train.py                                          # 1 CPU, the defaults (a few minutes)
    python base_train.py --device cuda --n-layer 8 --n-embd 512   # 1 GPU, a bigger base
    torchrun --standalone --nproc_per_node=2 base_train.py        # N ranks (gloo on CPU, nccl on GPU)

Writes $NANOPOST_HOME/tokenizer/ and $NANOPOST_HOME/base/<run>/ (checkpoints/, metrics.jsonl).
Resume a killed run with --resume.
"""
import argparse
import os
import time

import torch

import peak_memory
from checkpoint import load_model, resume_checkpoint, resume_state, save_checkpoint
from common import (Default, UserError, all_reduce_dict, all_reduce_sum, autocast, broadcast_parameters, check_finite,
                    dist_info, fit_warmup, lr_at, make_optimizer, nanopost_home, no_sync, optimizer_step,
                    peak_memory_mb, print0, progress, run_main, set_lr, unwrap, wrap_model)
from engine import Engine
from evaluation import scores_line
from model import GPT, GPTConfig
from packing import IGNORE, check_batch_fits, epoch_batch, heldout_loss, make_batch, pack_bfd
from verifiers import has_format, verify
from rundir import add_run_flags, open_run, start_run, write_eval
from tasks import generate_problems, pretrain_text, sft_conversations
from tokenizer import Tokenizer, render_text

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
# tokenizer
parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size, specials included")
parser.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
# model
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=128)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--n-kv-head", type=int, default=2)
parser.add_argument("--max-seq-len", type=int, default=512, help="the model's context (positions)")
# data and optimization
parser.add_argument("--num-docs", type=int, default=20000, help="training documents (problems with solutions)")
parser.add_argument("--seq-len", type=int, default=512, help="tokens per training row")
parser.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step, all ranks together")
parser.add_argument("--device-batch-size", type=int, default=8, help="rows per forward pass (gradient accumulation "
                    "above it)")
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup-steps", type=int, default=Default(30), help="at most a tenth of the run unless given")
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--compile", action="store_true", help="torch.compile the model (+~20%% after a ~30 s compile)")
# evaluation and checkpoints
parser.add_argument("--eval-every", type=int, default=100)
parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems sampled at the end")
parser.add_argument("--save-every", type=int, default=200)
add_run_flags(parser, "base")  # --run-name, --seed, --device, --resume, --wandb, --grad-checkpointing, --fsdp, ...


def build_tokenizer(args, dist):
    """Train the BPE on the world's text (plain documents and rendered chats, so chat words are in
    the vocabulary), once, shared by every stage through $NANOPOST_HOME/tokenizer/."""
    if args.tokenizer:
        return Tokenizer.load(args.tokenizer)
    path = os.path.join(nanopost_home(), "tokenizer")
    if dist.is_main and not (args.resume and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        t0 = time.time()
        texts = pretrain_text("train", 20000, seed=args.seed)
        texts += [render_text(c["messages"], tools=c.get("tools"))
                  for c in sft_conversations("train", 5000, seed=args.seed)]
        tok = Tokenizer.train(texts, vocab_size=args.vocab_size)
        tok.save(path)
        print0(f"tokenizer: vocab {tok.vocab_size}, trained in {time.time() - t0:.1f}s -> {path}")
    if dist.world_size > 1:
        torch.distributed.barrier()
    return Tokenizer.load(path)


def documents(tok, split, num_docs, seed, seq_len):
    """Each document is its own example, ending with <|endoftext|> so the base learns where a
    document stops. Inputs and targets are built per document, then packed best-fit into rows where
    attention and positions restart at every document: exactly how SFT conversations and inference
    prompts are seen (a prompt at position 0, with nothing before it)."""
    examples, too_long = [], 0
    for doc in pretrain_text(split, num_docs, seed=seed):
        ids = tok.encode(doc) + [tok.endoftext_id]
        if len(ids) - 1 > seq_len:
            too_long += 1
            continue
        examples.append((ids[:-1], ids[1:]))
    if too_long:
        print0(f"note: {too_long} of {num_docs} {split} documents are longer than --seq-len {seq_len} and were dropped")
    return examples


@torch.no_grad()
def eval_samples(model, tok, n, seed, max_new_tokens=160):
    """Greedy-complete held-out questions the way the base saw them ("question\\n") and grade them; every
    rank its share of the problems, the counts summed. Returns (metrics, rank 0's first samples)."""
    info = dist_info()
    problems = generate_problems("test", n, seed=seed)[info.rank::info.world_size]
    engine = Engine(unwrap(model), tok)
    with engine.prepared():  # a collective under FSDP2: every rank, even one without problems
        outs = engine.generate([tok.encode(p.question + "\n") for p in problems], max_new_tokens=max_new_tokens,
                               temperature=0.0) if problems else []
    texts = [tok.decode([t for t in o.tokens if t not in tok.stop_ids]) for o in outs]
    sums = all_reduce_dict({"format_rate": sum(has_format("gsm8k", t) for t in texts),
                            "pass@1": sum(verify("gsm8k", t, str(p.answer)) for t, p in zip(texts, problems)),
                            "stop_rate": sum(o.finish_reason == "stop" for o in outs)},
                           keys=["format_rate", "pass@1", "stop_rate"])
    return {k: v / n for k, v in sums.items()}, [(p.question, t) for p, t in zip(problems[:3], texts[:3])]


def main():
    args = parser.parse_args()
    dist, out_dir = start_run(args, "base", "base_train")
    device = dist.device

    tok = build_tokenizer(args, dist)
    train_ex = documents(tok, "train", args.num_docs, args.seed, args.seq_len)
    val_ex = documents(tok, "val", 500, args.seed, args.seq_len)
    train_rows = pack_bfd([len(x) for x, _ in train_ex], args.seq_len)
    val_rows = pack_bfd([len(x) for x, _ in val_ex], args.seq_len)
    n_tokens = sum(len(x) for x, _ in train_ex)
    print0(f"data: {len(train_ex):,} documents, {n_tokens:,} tokens in {len(train_rows):,} rows of {args.seq_len} "
           f"({n_tokens / (len(train_rows) * args.seq_len):.1%} full); "
           f"{args.steps * args.batch_size / len(train_rows):.2f} epochs")

    if args.batch_size % (args.device_batch_size * dist.world_size):
        raise UserError(f"--batch-size {args.batch_size} must be a multiple of --device-batch-size x ranks "
                        f"({args.device_batch_size} x {dist.world_size})")
    check_batch_fits(args.batch_size, len(train_rows), "packed rows")
    accum = args.batch_size // (args.device_batch_size * dist.world_size)
    config = GPTConfig(vocab_size=tok.vocab_size, n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head,
                       n_embd=args.n_embd, head_dim=args.n_embd // args.n_head, intermediate_size=4 * args.n_embd,
                       max_seq_len=args.max_seq_len, dtype=None if args.save_dtype == "auto" else args.save_dtype)
    ckpt = resume_checkpoint(out_dir) if args.resume else None
    peak_memory.check(peak_memory.estimate(trained=[peak_memory.Shape.of(config)],
                                           micro_batch_tokens=args.device_batch_size * args.seq_len,
                                           world_size=dist.world_size, fsdp=args.fsdp, cuda=device.type == "cuda",
                                           grad_checkpointing=args.grad_checkpointing), device)  # know before you OOM
    if ckpt:
        model = load_model(ckpt, fsdp=args.fsdp, save_dtype=args.save_dtype)
    else:
        model = GPT(config).to(device)
        broadcast_parameters(model)  # ranks were seeded apart: every rank starts from rank 0's weights
    model = wrap_model(model, fsdp=args.fsdp)
    unwrap(model).grad_checkpointing = args.grad_checkpointing
    unwrap(model).head_precision = args.head_precision
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    start_step = resume_state(ckpt, optimizer, model)["step"]
    print0(f"model: {unwrap(model).num_params():,} parameters, {config}")
    fwd = torch.compile(model) if args.compile else model

    log = open_run(args, out_dir, "base")  # every input checked: now --overwrite replaces the old run
    warmup_steps = fit_warmup(args.warmup_steps, args.steps)
    bar = progress(range(start_step, args.steps), initial=start_step, total=args.steps, desc="base")
    t_last, tokens_since = time.time(), 0
    for step in bar:
        lr = lr_at(step, args.steps, args.lr, warmup_steps)
        set_lr(optimizer, lr)
        rows = epoch_batch(len(train_rows), step, args.batch_size, args.seed)
        my_rows = [train_rows[i] for i in rows[dist.rank::dist.world_size]]  # this rank's share
        micro = [make_batch(train_ex, my_rows[a * args.device_batch_size:(a + 1) * args.device_batch_size],
                            tok.pad_id, args.seq_len, "bfd", device) for a in range(accum)]
        # mean over every target token of the global batch (all micro-batches, all ranks)
        n_global = all_reduce_sum(float(sum((y != IGNORE).sum().item() for _, y, _ in micro)))
        loss_sum = 0.0
        for a, (x, y, d) in enumerate(micro):
            with no_sync(model, last=a == accum - 1), autocast(device):
                loss = -fwd(x, y, doc_ids=d).sum() / n_global  # the next-token loss on every token
                check_finite(loss, step + 1)
                loss.backward()
            loss_sum += loss.item()
        grad_norm = optimizer_step(model, optimizer, args.grad_clip)
        loss_sum = all_reduce_sum(loss_sum)
        tokens_since += n_global
        metrics = {"loss": round(loss_sum, 6), "lr": lr, "grad_norm": round(grad_norm, 4),
                   "peak_mem_mb": round(peak_memory_mb(device))}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            dt = time.time() - t_last
            val_loss = heldout_loss(model, val_ex, val_rows, tok.pad_id, args.seq_len, "bfd", device)
            metrics.update(val_loss=round(val_loss, 6),
                           tokens_per_s=round(tokens_since / dt))
            t_last, tokens_since = time.time(), 0
            if dist.is_main:
                bar.write(f"step {step + 1}: loss {loss_sum:.4f}  val {metrics['val_loss']:.4f}  "
                          f"{metrics['tokens_per_s']:,} tok/s")
        log.log(step + 1, **metrics)
        bar.set_postfix(loss=f"{loss_sum:.3f}", lr=f"{lr:.1e}", refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, {"run_config": vars(args)})

    if args.eval_problems > 0:  # every rank its share of the held-out problems
        scores, examples = eval_samples(model, tok, args.eval_problems, args.seed)
        for q, t in examples:
            print0(f"--- sample ---\n{q}\n{t}")
        print0("held-out problems, greedy: " + scores_line(scores, args.eval_problems))
        log.log(args.steps, **{f"final/{k}": v for k, v in scores.items()})
        write_eval(out_dir, scores)
    log.close()


if __name__ == "__main__":
    run_main(main)
