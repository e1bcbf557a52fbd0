"""
Packed attention, dense document mask against per-document batches, measured side by side: forward and
backward of the model on one packed row of T tokens, its time and its peak memory, for today's path
(model.PackedDocuments: each document's attention as a plain causal call, nothing across documents) and the
path it replaced (one (B, 1, T, T) boolean mask over the whole row, which Attention still takes for the
engine's prefill). Then issue #51's case: one row of 8 documents of 1,024 tokens against the same documents
as 8 rows of their own.

    python benchmarks/bench_packed_attention.py                    # T = 1k, 4k, 16k; documents of 100-1,000
    python benchmarks/bench_packed_attention.py --lengths 1024,4096 --rounds 3

Each measurement runs in a fresh process (its peak resident memory is its own: the step's peak above what the
process held before it, as common.peak_memory_mb reads it), one warm-up step and then --steps timed ones, of
which the fastest counts. The variants take turns, round after round, so that a machine's drift hits them
alike; each figure is the best over the rounds. torch 2.13 offers no other path for CPU training: FlexAttention
has no backward on CPU (its eager forward builds the T x T scores), varlen_attn runs only on CUDA.
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import model as nanopost_model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def dense_document_mask(doc_ids):
    """The path PackedDocuments replaced: a (B, 1, T, T) mask of same-document causal pairs."""
    T = doc_ids.size(1)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril())[:, None]


def document_lengths(total, low, high, seed):
    """Random document lengths in [low, high] filling `total` tokens, the last one cut to fit."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(low, high), total - sum(lengths)))
    return lengths


def measure(variant, lengths, rows, steps, layers):
    """Seconds of the fastest forward + backward, and the peak memory above the process's before the first step
    (MiB), of `variant` ("dense" or "documents") on `rows` rows, each packed with documents of `lengths`."""
    if variant == "dense":
        nanopost_model.PackedDocuments.from_doc_ids = staticmethod(dense_document_mask)
    T = sum(lengths)
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=layers, max_seq_len=T))
    x = torch.randint(0, m.config.vocab_size, (rows, T))
    y = torch.randint(0, m.config.vocab_size, (rows, T))
    doc = torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)]).expand(rows, T)
    doc = None if len(lengths) == 1 else doc  # a single document: plain causal attention
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(1 + steps):
        t0 = time.perf_counter()
        (-m(x, y, doc_ids=doc).sum()).backward()
        times.append(time.perf_counter() - t0)
        m.zero_grad(set_to_none=True)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # Linux: KiB
    return {"seconds": min(times[1:]), "peak_mb": peak}


def run(variant, lengths, rows, args):
    """measure() in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", variant, "--doc-lengths",
           ",".join(map(str, lengths)), "--rows", str(rows), "--steps", str(args.steps), "--layers", str(args.layers),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def best(results):
    return {"seconds": min(r["seconds"] for r in results), "peak_mb": min(r["peak_mb"] for r in results)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384", help="row lengths T to time, comma-separated")
    ap.add_argument("--doc-min", type=int, default=100, help="shortest document")
    ap.add_argument("--doc-max", type=int, default=1000, help="longest document")
    ap.add_argument("--rounds", type=int, default=2, help="turns of every variant")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per process, after one warm-up step")
    ap.add_argument("--layers", type=int, default=4, help="layers of the default base shape (4)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-issue-case", action="store_true", help="leave out the 8 x 1,024 case")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--doc-lengths", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure:
        lengths = [int(n) for n in args.doc_lengths.split(",")]
        print(json.dumps(measure(args.measure, lengths, args.rows, args.steps, args.layers)))
        return

    print(f"model: GPTConfig() with {args.layers} layers; {args.threads} threads; forward + backward of one row; "
          f"best of {args.rounds} rounds x {args.steps} step(s)")
    print(f"{'T':>6s} {'docs':>5s} {'dense s':>9s} {'docs s':>8s} {'time':>7s} {'dense MB':>9s} {'docs MB':>8s} "
          f"{'memory':>7s}")
    for T in (int(t) for t in args.lengths.split(",")):
        lengths = document_lengths(T, args.doc_min, args.doc_max, seed=T)
        results = {"dense": [], "documents": []}
        for _ in range(args.rounds):
            for variant in results:
                results[variant].append(run(variant, lengths, 1, args))
        dense, docs = best(results["dense"]), best(results["documents"])
        print(f"{T:6d} {len(lengths):5d} {dense['seconds']:9.3f} {docs['seconds']:8.3f} "
              f"{dense['seconds'] / docs['seconds']:6.2f}x {dense['peak_mb']:9.0f} {docs['peak_mb']:8.0f} "
              f"{dense['peak_mb'] / max(docs['peak_mb'], 1):6.2f}x", flush=True)
    if args.skip_issue_case:
        return
    # issue #51: one row of 8 documents of 1,024 tokens against the same documents as 8 rows
    cases = {"8 rows of 1,024 (no packing)": ("documents", [1024], 8),
             "1 row of 8 x 1,024, documents": ("documents", [1024] * 8, 1),
             "1 row of 8 x 1,024, dense mask": ("dense", [1024] * 8, 1)}
    results = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (variant, lengths, rows) in cases.items():
            results[name].append(run(variant, lengths, rows, args))
    rows_alone = best(results["8 rows of 1,024 (no packing)"])
    print(f"\n{'8 documents of 1,024 tokens':32s} {'seconds':>8s} {'vs rows':>8s} {'peak MB':>8s}")
    for name in cases:
        r = best(results[name])
        print(f"{name:32s} {r['seconds']:8.3f} {r['seconds'] / rows_alone['seconds']:7.2f}x {r['peak_mb']:8.0f}")


if __name__ == "__main__":
    main()
