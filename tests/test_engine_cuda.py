"""The engine in bfloat16 on a GPU (skipped without CUDA; runs/gpu_check.sh runs them): the fused bf16
decode_step against the module forward, the engine/trainer log-prob gap on a Qwen3-0.6B-shaped random
model with the real vocabulary, and one host sync per 8 decoded tokens. The first two checks are functions
of the device, so tests/test_engine.py runs them on CPU too, at a small size."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from common import autocast
from engine import Engine, decode_step
from model import GPT, GPTConfig, KVCache

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Qwen/Qwen3-0.6B's shape (config.json): 28 layers, width 1024, 16 query and 8 key/value heads of 128,
# SwiGLU 3072, tied embeddings, the real vocabulary
QWEN3_06B = GPTConfig(vocab_size=151_936, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_dim=128,
                      intermediate_size=3072, max_seq_len=1024, rope_theta=1_000_000.0, tie_word_embeddings=True)


class NoStopTokenizer:
    """What the engine needs from a tokenizer, with no stop ids: every row runs to the limit."""
    pad_id = 0
    stop_ids = frozenset()


def random_model(cfg, device, norm_gain):
    """Random weights, built on the device. Norm gains in [0.5, 1.5] (a wrongly fused gain table shows),
    the final one `norm_gain` times larger: next-token distributions then peak as a trained model's do."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        model.model.norm.weight.mul_(norm_gain)
    return model


@torch.no_grad()
def check_bf16_decode_step(device, cfg, steps=8):
    """decode_step over the bf16 prepared weights against the module forward of the same bf16 model, both
    measured against the float32 master's logits: the fused step may not be less accurate than the
    module forward's own bf16 rounding (twice it, at most)."""
    master = random_model(cfg, device, norm_gain=1.0)
    prep = Engine(master, NoStopTokenizer(), dtype=torch.bfloat16).prepare()
    ids = torch.randint(1, cfg.vocab_size, (2, 9), device=device)
    doc = torch.tensor([[0] * 4 + [1] * 5, [1] * 9], device=device)  # left padding: the isolating mask is on
    exact, module, fused = (KVCache(cfg, 4, 32, device, dtype) for dtype in (torch.float32, torch.bfloat16, torch.bfloat16))
    master.hidden_states(ids, doc_ids=doc, kv_cache=exact)
    prep.model.hidden_states(ids, doc_ids=doc, kv_cache=module)
    prep.model.hidden_states(ids, doc_ids=doc, kv_cache=fused)
    assert fused.k.dtype == torch.bfloat16
    x = torch.randint(1, cfg.vocab_size, (4,), device=device)
    err_module, err_fused = 0.0, 0.0
    for _ in range(steps):
        want = F.linear(master.hidden_states(x[:, None], kv_cache=exact)[:, -1].float(), prep.head)
        by_module = F.linear(prep.model.hidden_states(x[:, None], kv_cache=module)[:, -1].float(), prep.head)
        got = decode_step(prep.model, x, fused, prep.weights)
        assert got.dtype == torch.float32
        err_module = max(err_module, (by_module - want).abs().max().item())
        err_fused = max(err_fused, (got - want).abs().max().item())
        x = want.argmax(-1)
    assert 0 < err_module and err_fused <= 2 * err_module, (err_fused, err_module)


@torch.no_grad()
def check_logprob_gap(device, cfg, prompts=8, samples=4, prompt_len=32, new_tokens=64, norm_gain=5.0):
    """The engine samples in bf16 (log-probs from the float32 head); the trainer recomputes them from the
    float32 master weights under bf16 autocast. Returns the mean |gap| over the sampled tokens and their
    mean log-prob (the distributions must be spread, or any gap is trivially 0)."""
    master = random_model(cfg, device, norm_gain)
    batch = torch.randint(1, cfg.vocab_size, (prompts, prompt_len)).tolist()
    outs = Engine(master, NoStopTokenizer(), dtype=torch.bfloat16).generate(
        batch, num_samples=samples, max_new_tokens=new_tokens, temperature=1.0, seed=0)
    seqs = torch.tensor([batch[o.prompt_index] + o.tokens for o in outs], device=device)
    with autocast(device, torch.bfloat16):
        trainer = master(seqs[:, :-1], seqs[:, 1:])[:, prompt_len - 1:]
    engine = torch.tensor([o.logprobs for o in outs], device=device)
    return (engine - trainer).abs().mean().item(), trainer.mean().item()


@needs_cuda
def test_bf16_decode_step_matches_the_module_forward_cuda():
    check_bf16_decode_step("cuda", QWEN3_06B)


@needs_cuda
def test_engine_trainer_logprob_gap_qwen3_shape_cuda():
    gap, mean_logprob = check_logprob_gap("cuda", QWEN3_06B)
    print(f"engine/trainer log-prob gap {gap:.4f} nats (mean sampled log-prob {mean_logprob:.2f})")
    assert mean_logprob < -0.5
    assert gap < 0.02


@needs_cuda
def test_one_host_sync_per_check_every_decoded_tokens_cuda():
    # torch's sync debug mode warns at every operation that makes the host wait for the GPU: the host reads how
    # many rows are live once every check_every (8) decode steps, plus a few per generate (prefill, the results)
    cfg = GPTConfig(vocab_size=4096, n_layer=2, n_head=8, n_kv_head=4, n_embd=256, head_dim=64,
                    intermediate_size=512, max_seq_len=256)
    engine = Engine(random_model(cfg, "cuda", norm_gain=1.0), NoStopTokenizer(), dtype=torch.bfloat16)
    prompts = torch.randint(1, cfg.vocab_size, (4, 16)).tolist()
    engine.generate(prompts, max_new_tokens=4)  # warm up
    steps = 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(prompts, num_samples=4, max_new_tokens=steps, seed=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert engine.check_every == 8 and steps // 8 <= syncs <= steps // 8 + 16, syncs
