"""
New tokens/s of the engine's cached batched decoding, against (a) the same cached decoding one prompt
at a time (batch 1), (b) a loop that recomputes the whole sequence every step (no KV cache), and (c)
the engine stepping with the module forward instead of decode_step (the fused flat step). Then the
sampler: inverse-CDF sampling (sample_next) against torch.multinomial, at 16 and 512 rows.
All measured side by side in one run, on random weights of the default base size (no stop token is
ever hit, so every row decodes exactly --new-tokens tokens), sampling at temperature 1.

    python benchmarks/bench_engine.py [--batch 16] [--prompt-len 64] [--new-tokens 128]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
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
        tok, _ = sample_next(model(x)[:, -1], 1.0, None, None, torch.rand(len(x), generator=gen, dtype=torch.float64))
        x = torch.cat([x, tok[:, None]], 1)
    return x


def timed(fns, repeats):
    """Best-of-`repeats` seconds of each function, run in turns, so that load from other processes on
    this (noisy) machine lands on all of them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def module_forward_step(model, tokens, cache, weights, **kwargs):
    """decode_step done by the module forward (what the engine would run without the fused step)."""
    return model(tokens[:, None], kv_cache=cache)[:, -1]


class ModuleForwardEngine(Engine):
    def generate(self, *a, **kw):
        fused, engine.decode_step = engine.decode_step, module_forward_step
        try:
            return super().generate(*a, **kw)
        finally:
            engine.decode_step = fused  # back to the fused decode_step


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # the default base of base_train.py
    model = GPT(GPTConfig(vocab_size=1024, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, head_dim=32,
                          intermediate_size=512, max_seq_len=512)).eval()
    fused_engine = Engine(model, NoStopTokenizer())
    prompts = torch.randint(1, 1024, (args.batch, args.prompt_len)).tolist()
    n_new = args.batch * args.new_tokens
    kw = dict(max_new_tokens=args.new_tokens, temperature=1.0)

    module_engine = ModuleForwardEngine(model, NoStopTokenizer())
    gen = torch.Generator().manual_seed(0)
    t_batched, t_single, t_nocache, t_module = timed([
        lambda: fused_engine.generate(prompts, **kw),
        lambda: [fused_engine.generate([p], **kw) for p in prompts],
        lambda: no_cache_generate(model, prompts, args.new_tokens, gen),
        lambda: module_engine.generate(prompts, **kw)], args.repeats)

    print(f"model {model.num_params() / 1e6:.2f}M params, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens per row")
    print(f"{'method':34s} {'new tok/s':>10s} {'vs cached batched':>18s}")
    for name, t in (("cached, batched (engine)", t_batched), (f"cached, batch 1 x {args.batch}", t_single),
                    ("no cache, batched (recompute)", t_nocache), ("cached, batched, module forward", t_module)):
        print(f"{name:34s} {n_new / t:10.0f} {t / t_batched:17.2f}x")

    print(f"{'sampling one token, T=1':34s} {'rows':>10s} {'multinomial us':>15s} {'inverse CDF us':>15s} {'speedup':>8s}")
    for rows in (16, 512):
        logits = torch.randn(rows, model.config.vocab_size)

        def multinomial():
            logp = torch.log_softmax(logits, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
        def inverse_cdf():
            return sample_next(logits, 1.0, None, None, torch.rand(rows, generator=gen, dtype=torch.float64))
        n = 200
        t_mult, t_icdf = (t / n for t in timed([lambda: [multinomial() for _ in range(n)],
                                                 lambda: [inverse_cdf() for _ in range(n)]], args.repeats))
        print(f"{'':34s} {rows:10d} {t_mult * 1e6:15.0f} {t_icdf * 1e6:15.0f} {t_mult / t_icdf:7.1f}x")
