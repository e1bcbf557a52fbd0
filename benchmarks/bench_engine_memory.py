"""
Peak memory, measured on this CPU, of what nanopost holds at real scale: a Qwen3-0.6B-shaped model with
random weights and the real vocabulary (151,936; 28 layers, width 1024, 16 query / 8 key-value heads of
128, SwiGLU 3072, tied embeddings), float32 master weights as a training run holds them.

Modes:
  engine   Engine.generate: --prompts x --samples rows, --new-tokens each (random weights almost never
           stop early, so every row decodes them all), sampling in --dtype (the engine's compute dtype;
           bfloat16 is what it uses on CUDA)

    python benchmarks/bench_engine_memory.py engine [--dtype float32|bfloat16] [--prompts 8] [--samples 8]
                                             [--prompt-len 64] [--new-tokens 256] [--layers 28]
    python benchmarks/bench_engine_memory.py engine --repo /tmp/before     # another checkout's engine

Peak process memory is the high-water mark of resident memory (VmHWM), reset once the model is built and
the code measured has run once on a tiny input (libraries and kernels loaded), minus the resident memory
at that moment: what the measured code adds on top of the model. One configuration per process, so that
nothing from an earlier measurement is counted.
"""
import argparse
import inspect
import json
import os
import sys
import time

import torch

# --repo DIR measures another checkout's engine (the code before a change): its modules come first
_repo = sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(_repo))
from engine import Engine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def qwen3_06b(n_layer=28, max_seq_len=1024):
    return GPTConfig(vocab_size=151_936, n_layer=n_layer, n_head=16, n_kv_head=8, n_embd=1024, head_dim=128,
                     intermediate_size=3072, max_seq_len=max_seq_len, rope_theta=1_000_000.0,
                     tie_word_embeddings=True)


def proc_status_mib(field):
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak():
    """Start VmHWM again from the current resident memory (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class NoStopTokenizer:
    """What the engine needs from a tokenizer, with no stop ids: every row runs to the limit."""
    pad_id = 0
    stop_ids = frozenset()


def measure_engine(args):
    dtype = getattr(torch, args.dtype)
    cfg = qwen3_06b(args.layers, max_seq_len=args.prompt_len + args.new_tokens)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    prompts = torch.randint(1, cfg.vocab_size, (args.prompts, args.prompt_len)).tolist()
    if "dtype" in inspect.signature(Engine).parameters:
        engine = Engine(model, NoStopTokenizer(), dtype=dtype)
    elif dtype != torch.float32:
        raise SystemExit(f"{_repo}: this engine has no dtype (it samples in the model's float32)")
    else:
        engine = Engine(model, NoStopTokenizer())
    rows = args.prompts * args.samples
    cache_mib = (2 * cfg.n_layer * rows * cfg.n_kv_head * (args.prompt_len + args.new_tokens) * cfg.head_dim
                 * dtype.itemsize / 2**20)
    engine.generate(prompts[:1], max_new_tokens=2)  # warm up: load what the first call loads
    baseline = proc_status_mib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    outs, stats = engine.generate(prompts, num_samples=args.samples, max_new_tokens=args.new_tokens,
                                  temperature=1.0, seed=0, return_stats=True)
    return {"mode": "engine", "dtype": args.dtype, "layers": cfg.n_layer, "rows": rows,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "decoded": stats["new_tokens"], "seconds": round(time.perf_counter() - t0, 1),
            "model_mib": round(baseline), "peak_above_model_mib": round(proc_status_mib("VmHWM") - baseline),
            "kv_cache_mib": round(cache_mib)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["engine"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=28, help="fewer for a quick check (Qwen3-0.6B has 28)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repo", default=None, help="measure the engine of this checkout (e.g. the code before a change)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"engine": measure_engine}[args.mode](args)))
