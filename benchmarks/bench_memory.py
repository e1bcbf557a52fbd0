"""
Peak memory of real steps at the real vocabulary, against memory.estimate.

    python benchmarks/bench_memory.py sft     # chat_sft.py steps of 2 rows of 1,024 tokens
    python benchmarks/bench_memory.py grpo    # one chat_rl.py step: 16 rollouts (2 prompts x 8) of 256 new tokens
    python benchmarks/bench_memory.py sft --layers 2 --width 256      # a narrow Qwen3 shape, seconds
    python benchmarks/bench_memory.py sft --repo /path/to/old/nanopost    # the same step with other code
    python benchmarks/bench_memory.py sft --nproc 2 --extra=--fsdp        # per-rank peak of 2 FSDP2 ranks

The model is Qwen3-0.6B's shape by default (28 layers, width 1024, 16 heads, 8 kv heads, head_dim 128,
intermediate 3072, tied embeddings, vocabulary 151,936) with random weights, float32 on this CPU. Each
step runs as its own process; reported: the process's peak resident memory (what `top` shows at its
worst), the run's own peak above the interpreter and torch (peak_mem_mb in metrics.jsonl), and the
estimate the stage printed before it started. Slow at the full size on 2 cores (minutes per step).
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from checkpoint import save_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_folder(path, args):
    """A random Qwen3-shaped model folder with the real vocabulary and the embedded world's tokenizer."""
    import torch

    from model import GPT, GPTConfig
    from tasks import pretrain_text, sft_conversations
    from tokenizer import Tokenizer, render_text
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    texts = pretrain_text("train", 2000) + [render_text(c["messages"], tools=c.get("tools"))
                                            for c in sft_conversations("train", 500)]
    tok = Tokenizer.train(texts, vocab_size=512)
    config = GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                       n_kv_head=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
                       max_seq_len=4096)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model._init_rope()
    save_hf(model, path, tok)


def sft_data(path, tokens):
    """Conversations whose rendering is about `tokens` tokens: long assistant answers of words."""
    words = "apples marbles count each friend gives buys more equal piles dollars".split()
    with open(path, "w") as f:
        for i in range(8):
            answer = " ".join(words[(i + j) % len(words)] for j in range(int(tokens * 0.85)))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": answer}]}) + "\n")


def run(cmd, home):
    env = {**os.environ, "NANOPOST_HOME": home}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    estimate = re.search(r"estimated peak memory per device: ([\d.]+) GiB", r.stdout)
    return max(peak, before) / 2**20, float(estimate.group(1)) if estimate else None


def logged_peak(home, stage):
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        return max(json.loads(line).get("peak_mem_mb", 0) for line in f) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["sft", "grpo"])
    ap.add_argument("--repo", default=REPO, help="the nanopost checkout whose stage scripts run")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=1024, help="sft: tokens per row")
    ap.add_argument("--rows", type=int, default=2, help="sft: rows in the step")
    ap.add_argument("--new-tokens", type=int, default=256, help="grpo: tokens sampled per rollout")
    ap.add_argument("--extra", default="", help="more flags for the stage script")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torchrun); the peaks are rank 0's")
    args = ap.parse_args()
    shape = f"{args.layers}x{args.width}-v{args.vocab}"
    cache = os.path.join(tempfile.gettempdir(), f"nanopost-bench-{shape}")
    make_folder(cache, args)
    home = tempfile.mkdtemp()
    helps = subprocess.run([sys.executable, os.path.join(args.repo, "chat_rl.py"), "--help"], capture_output=True,
                           text=True).stdout
    if args.mode == "sft":
        data = os.path.join(home, "sft.jsonl")
        sft_data(data, args.tokens)
        cmd = [sys.executable, os.path.join(args.repo, "chat_sft.py"), "--init", cache, "--data", data, "--steps", "2",
               "--seq-len", str(args.tokens + 64), "--batch-size", str(args.rows), "--device-batch-size",
               str(max(1, args.rows // args.nproc)), "--eval-problems", "0", "--save-every", "1000000", "--eval-every", "1000000",
               "--overlong", "crop"]
    else:
        per_pass = ["--micro-batch-tokens", "8192"] if "--micro-batch-tokens" in helps else ["--device-batch-size", "32"]
        cmd = [sys.executable, os.path.join(args.repo, "chat_rl.py"), "--init", cache, "--steps", "1",
               "--prompts-per-step", "2", "--group-size", "8", "--max-new-tokens", str(args.new_tokens),
               "--no-dynamic-sampling", "--eval-problems", "0", "--save-every", "1000000", "--num-prompts", "16",
               *per_pass]
    cmd += args.extra.split()
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *cmd[1:]]
    peak, est = run(cmd, home)
    stage = "sft" if args.mode == "sft" else "rl"
    try:
        own = f"{logged_peak(home, stage):.2f} GiB"
    except (OSError, ValueError):
        own = "-"
    seconds = "-"
    try:
        with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
            times = [json.loads(line)["time"] for line in f if '"loss"' in line]
        seconds = f"{times[-1] - times[-2]:.1f} s" if len(times) > 1 else "-"
    except (OSError, KeyError):
        pass
    print(f"{args.mode} {shape} x{args.nproc} {args.extra} ({args.repo}): process peak {peak:.2f} GiB; run's own peak "
          f"{own}; estimate {'-' if est is None else f'{est:.2f} GiB'}; last step {seconds}")


if __name__ == "__main__":
    main()
