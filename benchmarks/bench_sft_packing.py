"""
SFT throughput, packed against padded, measured side by side in one run: trained tokens/s (the
assistant tokens that carry the loss) and the fraction of each batch that is padding, for
chat_sft.py's best-fit-decreasing packing (--packing bfd) and one-conversation-per-row padding
(--packing none), on the embedded world's conversations and the default base size (random weights:
speed does not depend on them). The two layouts alternate batch by batch so machine noise hits both.

    python benchmarks/bench_sft_packing.py [--conversations 1200] [--rounds 6]
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chat_sft import build_rows, render_examples, sft_loss  # noqa: E402
from packing import IGNORE, make_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tasks import pretrain_text, sft_conversations  # noqa: E402
from tokenizer import Tokenizer, render_text  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=1200)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8, help="rows per packed batch")
    ap.add_argument("--rounds", type=int, default=6, help="batches timed per layout")
    args = ap.parse_args()
    torch.manual_seed(0)
    convs = sft_conversations("train", args.conversations)
    tok = Tokenizer.train(pretrain_text("train", 5000) + [render_text(c["messages"], c.get("tools")) for c in convs],
                          vocab_size=1024)
    examples, _ = render_examples(tok, convs, args.seq_len, "drop")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, head_dim=32,
                          intermediate_size=512, max_seq_len=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    packed_rows = build_rows(examples, args.seq_len, "bfd")
    padded_rows = build_rows(examples, args.seq_len, "none")
    random.Random(0).shuffle(packed_rows)  # as training draws them: bfd's own order is longest-first
    random.Random(0).shuffle(padded_rows)
    # the same number of conversations per batch in both layouts
    per_batch = round(len(examples) / len(packed_rows) * args.rows)
    stats = {p: {"seconds": 0.0, "trained": 0, "padding": 0, "tokens": 0} for p in ("bfd", "none")}
    for r in range(args.rounds + 1):  # round 0 warms up
        for packing, rows, n in (("bfd", packed_rows, args.rows), ("none", padded_rows, per_batch)):
            batch = rows[r * n:(r + 1) * n]
            x, y, d = make_batch(examples, batch, tok.pad_id, args.seq_len, packing, "cpu")
            t0 = time.perf_counter()
            loss = sft_loss(model(x, y, doc_ids=d), (y != IGNORE).sum())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r:
                s = stats[packing]
                s["seconds"] += time.perf_counter() - t0
                s["trained"] += int((y != IGNORE).sum())
                s["tokens"] += x.numel()
                s["padding"] += x.numel() - sum(len(examples[i][0]) for row in batch for i in row)
    print(f"{len(examples)} conversations: {len(packed_rows)} packed rows of {args.seq_len} tokens, or "
          f"{len(padded_rows)} padded rows; {args.rounds} timed batches per layout ({args.rows} packed rows, "
          f"{per_batch} padded conversations); {torch.get_num_threads()} threads")
    print(f"{'layout':14s} {'trained tok/s':>14s} {'padding':>9s} {'vs padded':>10s}")
    padded_speed = stats["none"]["trained"] / stats["none"]["seconds"]
    for packing, name in (("bfd", "packed (bfd)"), ("none", "padded")):
        s = stats[packing]
        speed = s["trained"] / s["seconds"]
        print(f"{name:14s} {speed:14.0f} {s['padding'] / s['tokens']:9.1%} {speed / padded_speed:9.2f}x")
