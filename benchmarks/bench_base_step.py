"""
Where a base pretraining step's time could go, measured side by side: the step as base_train.py takes it
(float32, 8 packed rows of 512 tokens with attention restarting at every document), against the same step
with plain causal attention (the whole causal triangle of each row, across its documents: what the model's
per-document attention, model.PackedDocuments, is weighed against), and against bfloat16 autocast (what AMX or
AVX-512 BF16 matrix units give).

    python benchmarks/bench_base_step.py                      # the world's documents, the default base shape
    python benchmarks/bench_base_step.py --tokenizer out/cpu/tokenizer --rounds 5

The variants take turns, round after round, on the same rows, so that a machine's drift hits them alike;
each prints the median seconds of its steps and its ratio to base_train's own step. The tokenizer is the
pipeline's ($NANOPOST_HOME/tokenizer, written by base_train.py) or, without one, one trained here on the
world's text (a few seconds).
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from base_train import documents  # noqa: E402
from common import nanopost_home  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from packing import make_batch, pack_bfd  # noqa: E402
from tasks import pretrain_text  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: $NANOPOST_HOME/tokenizer, else trained here)")
parser.add_argument("--rows", type=int, default=8, help="rows per step (base_train's --device-batch-size)")
parser.add_argument("--seq-len", type=int, default=512)
parser.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
parser.add_argument("--rounds", type=int, default=3)


def variant_step(model, optimizer, x, y, doc_ids, dtype):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = -model(x, y, doc_ids=doc_ids).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main():
    args = parser.parse_args()
    path = args.tokenizer or os.path.join(nanopost_home(), "tokenizer")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tok = Tokenizer.load(path)
    else:
        tok = Tokenizer.train(pretrain_text("train", 5000), vocab_size=1024)
    examples = documents(tok, "train", 400, 0, args.seq_len)
    rows = random.Random(0).sample(pack_bfd([len(x) for x, _ in examples], args.seq_len), args.rows)  # as an epoch draws them
    x, y, doc_ids = make_batch(examples, rows, tok.pad_id, args.seq_len, "bfd", "cpu")
    n_docs = sum(len(r) for r in rows)
    print(f"{args.rows} rows of {args.seq_len} tokens holding {n_docs} documents; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, head_dim=32,
                       intermediate_size=512, max_seq_len=args.seq_len)  # base_train.py's defaults
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    variants = {"float32, document attention (base_train.py)": (doc_ids, "float32"),
                "float32, plain causal attention": (None, "float32"),
                "bfloat16 autocast, document attention": (doc_ids, "bfloat16")}
    times = {name: [] for name in variants}
    for name, (d, dtype) in variants.items():  # warm-up: first calls allocate and pick kernels
        variant_step(model, optimizer, x, y, d, dtype)
    for _ in range(args.rounds):
        for name, (d, dtype) in variants.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                variant_step(model, optimizer, x, y, d, dtype)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        print(f"{name:48s} {statistics.median(ts):.3f} s a step   x{statistics.median(ts) / base:.2f}")


if __name__ == "__main__":
    main()
