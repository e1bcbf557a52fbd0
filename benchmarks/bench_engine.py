"""
New tokens/s of the engine's cached batched decoding, against (a) a loop that recomputes the whole
sequence every step (no KV cache) and (b) the same cached decoding one prompt at a time (batch 1).
All measured side by side in one run, on random weights of the default base size (no stop token is
ever hit, so every row decodes exactly --new-tokens tokens).

    python benchmarks/bench_engine.py [--batch 16] [--prompt-len 64] [--new-tokens 128]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import Engine, sample_next  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


class NoStopTokenizer:
    """What the engine needs from a tokenizer, with no stop ids: every row runs to the limit."""
    pad_id = 0
    stop_ids = frozenset()


@torch.no_grad()
def no_cache_generate(model, prompts, new_tokens, gen):
    x = torch.tensor(prompts)
    for _ in range(new_tokens):
        tok, _ = sample_next(model(x)[:, -1], 1.0, None, None, gen)
        x = torch.cat([x, tok[:, None]], 1)
    return x


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # the default base of base_train.py
    model = GPT(GPTConfig(vocab_size=1024, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, head_dim=32,
                          intermediate_size=512, max_seq_len=512)).eval()
    engine = Engine(model, NoStopTokenizer())
    prompts = torch.randint(1, 1024, (args.batch, args.prompt_len)).tolist()
    n_new = args.batch * args.new_tokens
    kw = dict(max_new_tokens=args.new_tokens, temperature=1.0)

    t_batched = timed(lambda: engine.generate(prompts, **kw), args.repeats)
    t_single = timed(lambda: [engine.generate([p], **kw) for p in prompts], args.repeats)
    gen = torch.Generator().manual_seed(0)
    t_nocache = timed(lambda: no_cache_generate(model, prompts, args.new_tokens, gen), args.repeats)

    print(f"model {model.num_params() / 1e6:.2f}M params, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens per row")
    print(f"{'method':34s} {'new tok/s':>10s} {'vs cached batched':>18s}")
    for name, t in (("cached, batched (engine)", t_batched), (f"cached, batch 1 x {args.batch}", t_single),
                    ("no cache, batched (recompute)", t_nocache)):
        print(f"{name:34s} {n_new / t:10.0f} {t / t_batched:17.2f}x")
