"""
New tokens/s of our engine against transformers' `generate`, side by side in one run, on the same tiny
random Qwen3 weights (the default base size: 4 layers, 128 wide, 4 heads, 2 kv heads, vocab 1024).
Both decode greedily and never stop early (no stop id is ever produced: ours has none, transformers is
held by min_new_tokens), so each row decodes exactly --new-tokens tokens, and both outputs are checked
to be the same tokens before any time is printed.

    python benchmarks/bench_hf_generate.py [--batches 1,16,64] [--prompt-len 64] [--new-tokens 128]

Needs transformers (a test-only dependency). Transformers runs with its default (dynamic) KV cache and
its default attention ("sdpa"); the time of each side is the best of --repeats runs, the two sides
run alternately.
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import Engine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from checkpoint import save_hf  # noqa: E402


class NoStopTokenizer:
    """What the engine needs from a tokenizer, with no stop ids: every row runs to the limit."""
    pad_id = 0
    stop_ids = frozenset()


def timed_pair(fns, repeats):
    """Best-of-`repeats` seconds of each function, run alternately so that load from other processes
    on the machine lands on both sides alike; and each one's last output."""
    best, outs = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[i] = fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best, outs


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=1024, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, head_dim=32,
                         intermediate_size=512, max_seq_len=512)).eval()
    with tempfile.TemporaryDirectory() as d:  # the very same weights, through our HF checkpoint
        save_hf(ours, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    engine = Engine(ours, NoStopTokenizer())
    N = args.new_tokens

    @torch.no_grad()
    def hf_generate(prompts):
        x = torch.tensor(prompts)
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N,
                          min_new_tokens=N, eos_token_id=1023, pad_token_id=0)
        return out[:, x.size(1):].tolist()

    print(f"model {ours.num_params() / 1e6:.2f}M params, {torch.get_num_threads()} threads, prompt "
          f"{args.prompt_len}, {N} new tokens per row, greedy, transformers {transformers.__version__}")
    print(f"{'batch':>5s} {'ours tok/s':>11s} {'transformers tok/s':>19s} {'speedup':>8s}")
    for B in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(1, 1023, (B, args.prompt_len), generator=torch.Generator().manual_seed(B)).tolist()
        (t_ours, t_hf), (outs, hf_out) = timed_pair(
            [lambda: engine.generate(prompts, max_new_tokens=N, temperature=0.0), lambda: hf_generate(prompts)],
            args.repeats)
        same = sum(o.tokens == h for o, h in zip(outs, hf_out))
        # float32 reductions in a different order can flip a near-tie argmax deep in a long greedy run;
        # most rows must match token for token, or the comparison is not of the same computation
        assert same >= 0.9 * B, f"batch {B}: only {same}/{B} rows equal transformers' greedy tokens"
        print(f"{B:5d} {B * N / t_ours:11.0f} {B * N / t_hf:19.0f} {t_hf / t_ours:7.2f}x   ({same}/{B} rows equal)")
