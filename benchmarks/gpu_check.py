"""
The single-GPU check (runs/gpu_check.sh runs it): a Qwen3-0.6B-shaped model with random weights and the real
vocabulary, 2 SFT steps at 4,096-token rows and 2 GRPO steps of 64 prompts x 8 answers x 512 new tokens,
through the real stage scripts. Prints tokens/s, MFU (model FLOPs: 6 x parameters per trained token, 2 x
per sampled one, against the GPU's dense bf16 peak), the peak memory each stage logged against its own
estimate, and which scaled-dot-product-attention backend each attention pattern of the stages gets.

    python benchmarks/gpu_check.py            # on a CUDA machine
    python benchmarks/gpu_check.py --smoke    # a tiny shape on CPU, to check the script itself
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PEAK_BF16_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "RTX 4090": 165}  # dense, per GPU


def make_folder(path, shape):
    import torch

    from checkpoint import save_hf
    from model import GPT, GPTConfig
    from tasks import pretrain_text, sft_conversations
    from tokenizer import Tokenizer, render_text
    texts = pretrain_text("train", 2000) + [render_text(c["messages"], tools=c.get("tools"))
                                            for c in sft_conversations("train", 500)]
    tok = Tokenizer.train(texts, vocab_size=512)
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape, max_seq_len=8192))
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model._init_rope()
    save_hf(model, path, tok, dtype=torch.bfloat16)
    return model.num_params()


def attention_backends(device, heads, kv_heads, head_dim, tokens):
    """Which SDPA backend each of the stages' attention calls gets on this device."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=dtype)
    doc = torch.zeros(1, tokens, dtype=torch.long, device=device)
    doc[:, tokens // 2:] = 1
    packed = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril())[:, None]
    calls = {"causal (training: padded rows, and each document of packed ones)": dict(is_causal=True, enable_gqa=True),
             "masked (the engine's prefill of left-padded prompts)": dict(attn_mask=packed, enable_gqa=True)}
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    found = {}
    for name, kwargs in calls.items():
        for backend in order:
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, k, **kwargs)
                found[name] = backend.name
                break
            except RuntimeError:
                continue
    return found


def run_stage(script, args, home):
    env = {**os.environ, "NANOPOST_HOME": home}
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.join(REPO, script), *args], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{script} failed:\n{r.stderr[-4000:]}")
    stage = {"chat_sft.py": "sft", "chat_rl.py": "rl"}[script]
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    estimate = next((line.split(": ", 1)[1] for line in r.stdout.splitlines()
                     if line.startswith("estimated peak memory per device")), "-")
    return rows, estimate, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    import torch
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: run with --smoke to check the script on CPU")
    if args.smoke:
        shape = dict(vocab_size=151936, n_layer=2, n_embd=128, n_head=4, n_kv_head=2, head_dim=32, intermediate_size=384)
        sft_tokens, prompts, group, new_tokens = 256, 4, 2, 16
    else:  # Qwen3-0.6B
        shape = dict(vocab_size=151936, n_layer=28, n_embd=1024, n_head=16, n_kv_head=8, head_dim=128,
                     intermediate_size=3072)
        sft_tokens, prompts, group, new_tokens = 4096, 64, 8, 512
    device = "cuda" if cuda else "cpu"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    work = tempfile.mkdtemp(prefix="nanopost-gpu-check-")
    folder = os.path.join(work, "qwen3")
    n_params = make_folder(folder, shape)
    print(f"device: {gpu}; model: {n_params / 1e6:.0f}M parameters, vocabulary {shape['vocab_size']:,}")
    for name, backend in attention_backends(device, shape["n_head"], shape["n_kv_head"], shape["head_dim"],
                                            1024).items():
        print(f"attention backend, {name}: {backend}")

    # SFT: 2 steps, one row of sft_tokens tokens per step
    words = "apples marbles count each friend gives buys more equal piles dollars".split()
    data = os.path.join(work, "sft.jsonl")
    with open(data, "w") as f:
        for i in range(4):
            answer = " ".join(words[(i + j) % len(words)] for j in range(int(sft_tokens * 0.8)))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    rows, estimate, seconds = run_stage("chat_sft.py", [
        "--init", folder, "--data", data, "--device", device, "--steps", "2", "--seq-len", str(sft_tokens),
        "--batch-size", "1", "--device-batch-size", "1", "--overlong", "crop", "--eval-problems", "0",
        "--save-every", "1000000", "--eval-every", "1000000"], os.path.join(work, "home"))
    steps = [r for r in rows if "loss" in r]
    tokens = sft_tokens * len(steps)
    step_time = (steps[-1]["time"] - steps[0]["time"]) or seconds / len(steps)  # the second step: no warm-up
    tok_s = sft_tokens / step_time
    mfu = f"{6 * n_params * tok_s / (peak * 1e12):.1%}" if peak else "-"
    print(f"SFT, {sft_tokens}-token rows: {tok_s:,.0f} tokens/s (second step), MFU {mfu}, peak "
          f"{max(r['peak_mem_mb'] for r in steps) / 1024:.1f} GiB (estimated {estimate}); {tokens} tokens in {seconds:.0f} s")

    # GRPO: 2 steps of prompts x group answers x new_tokens, dynamic sampling off (random weights: all 0)
    rows, estimate, seconds = run_stage("chat_rl.py", [
        "--init", folder, "--device", device, "--steps", "2", "--prompts-per-step", str(prompts), "--group-size",
        str(group), "--max-new-tokens", str(new_tokens), "--no-dynamic-sampling", "--eval-problems", "0",
        "--save-every", "1000000", "--num-prompts", str(4 * prompts), "--overlong-buffer", str(new_tokens // 2)],
        os.path.join(work, "home"))
    steps = [r for r in rows if "reward" in r]
    last = steps[-1]
    sample_flops = 2 * n_params * last["sample_tok_per_s"]
    train_flops = 6 * n_params * last["train_tok_per_s"]
    mfu = f"sampling {sample_flops / (peak * 1e12):.1%}, training {train_flops / (peak * 1e12):.1%}" if peak else "-"
    print(f"GRPO, {prompts} x {group} x {new_tokens}: sampling {last['sample_tok_per_s']:,.0f} tokens/s, training "
          f"{last['train_tok_per_s']:,.0f} tokens/s, engine/trainer log-prob gap {last['logprob_mismatch']:.4f} nats, "
          f"MFU {mfu}, peak {max(r['peak_mem_mb'] for r in steps) / 1024:.1f} GiB (estimated {estimate}); "
          f"{seconds:.0f} s for 2 steps")


if __name__ == "__main__":
    main()
