"""
Peak memory of real steps at the real vocabulary, against the estimate each stage prints.

    python benchmarks/bench_memory.py sft     # chat_sft.py steps of 2 rows of 1,024 tokens
    python benchmarks/bench_memory.py rm      # chat_rm.py steps of 2 pairs, each side about 1,024 tokens
    python benchmarks/bench_memory.py dpo     # chat_dpo.py (and kto: chat_kto.py) steps on the same pairs
    python benchmarks/bench_memory.py grpo    # one chat_rl.py step: 16 rollouts (2 prompts x 8) of 256 new tokens
    python benchmarks/bench_memory.py ppo     # one chat_ppo.py step: the same 16 rollouts, a critic of the same shape
    python benchmarks/bench_memory.py grpo --extra="--lora-rank 16"   # the same step, LoRA adapters on a frozen base
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_folder(path, args):
    """A random Qwen3-shaped model folder with the real vocabulary and the embedded world's tokenizer."""
    import torch

    from checkpoint import save_hf
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
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": words(i, int(tokens * 0.85))}]}) + "\n")


def pair_data(path, tokens):
    """Preference pairs whose prompt + answer renders to about `tokens` tokens on each side (about 1.6
    tokens a word with the embedded world's tokenizer)."""
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": "Tell me a story.", "chosen": words(i, int(tokens * 0.55)),
                                "rejected": words(i + 1, int(tokens * 0.55))}) + "\n")


def words(i, n):
    vocabulary = "apples marbles count each friend gives buys more equal piles dollars".split()
    return " ".join(vocabulary[(i + j) % len(vocabulary)] for j in range(n))


def run(cmd, home):
    env = {**os.environ, "NANOPOST_HOME": home}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    estimate = re.search(r"estimated peak memory per device: ([\d.]+) GiB( \(.*\))?", r.stdout)
    return max(peak, before) / 2**20, estimate and (float(estimate.group(1)), estimate.group(2) or "")


def logged_peak(home, stage):
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        return max(json.loads(line).get("peak_mem_mb", 0) for line in f) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["sft", "rm", "dpo", "kto", "grpo", "ppo"])
    ap.add_argument("--repo", default=REPO, help="the nanopost checkout whose stage scripts run")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=1024, help="sft: tokens per row; rm, dpo, kto: per side of a pair")
    ap.add_argument("--rows", type=int, default=2, help="sft: rows in the step; rm, dpo, kto: pairs")
    ap.add_argument("--new-tokens", type=int, default=256, help="grpo, ppo: tokens sampled per rollout")
    ap.add_argument("--extra", default="", help="more flags for the stage script")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torchrun); the peaks are rank 0's")
    args = ap.parse_args()
    shape = f"{args.layers}x{args.width}-v{args.vocab}"
    cache = os.path.join(tempfile.gettempdir(), f"nanopost-bench-{shape}")
    make_folder(cache, args)
    home = tempfile.mkdtemp()
    helps = subprocess.run([sys.executable, os.path.join(args.repo, "chat_rl.py"), "--help"], capture_output=True,
                           text=True).stdout
    quiet = ["--save-every", "1000000", "--eval-every", "1000000"]
    if args.mode == "sft":
        data = os.path.join(home, "sft.jsonl")
        sft_data(data, args.tokens)
        script = "chat_sft.py"
        flags = ["--data", data, "--steps", "2", "--seq-len", str(args.tokens + 64), "--batch-size", str(args.rows),
                 "--device-batch-size", str(max(1, args.rows // args.nproc)), "--eval-problems", "0", "--overlong", "crop"]
    elif args.mode in ("rm", "dpo", "kto"):
        data = os.path.join(home, "pairs.jsonl")
        pair_data(data, args.tokens)
        script = {"rm": "chat_rm.py", "dpo": "chat_dpo.py", "kto": "chat_kto.py"}[args.mode]
        flags = ["--data", data, "--steps", "2", "--max-len", str(args.tokens + 64), "--batch-size", str(args.rows),
                 "--micro-batch-tokens", str(2 * args.rows * (args.tokens + 64))]
        flags += [] if args.mode == "rm" else ["--eval-problems", "0"]
    else:
        per_pass = ["--micro-batch-tokens", "8192"] if "--micro-batch-tokens" in helps else ["--device-batch-size", "32"]
        script = "chat_rl.py" if args.mode == "grpo" else "chat_ppo.py"
        group = ["--group-size", "8", "--no-dynamic-sampling"] if args.mode == "grpo" else \
            ["--samples-per-prompt", "8", "--critic-init", cache, "--freeze-actor-steps", "0"]
        flags = ["--steps", "1", "--prompts-per-step", "2", *group, "--max-new-tokens", str(args.new_tokens),
                 "--eval-problems", "0", "--num-prompts", "16", *per_pass]
    cmd = [sys.executable, os.path.join(args.repo, script), "--init", cache, *flags, *quiet]
    cmd += args.extra.split()
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *cmd[1:]]
    peak, est = run(cmd, home)
    stage = {"grpo": "rl"}.get(args.mode, args.mode)
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
          f"{own}; estimate {f'{est[0]:.2f} GiB{est[1]}' if est else '-'}; last step {seconds}")


if __name__ == "__main__":
    main()
