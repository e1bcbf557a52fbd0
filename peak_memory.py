"""
Know before you OOM: the peak memory of a stage on one device, estimated from the model's shape and the
run's flags, printed before a run starts (and refused, with the numbers, when it cannot fit). Each stage
builds its estimate in its own memory_estimate(args, ...); `python memory.py --init FOLDER STAGE [flags]`
prints it for a run without starting it.

A run holds, per device:
    weights     float32 master weights of what trains (4 bytes a parameter), plus every frozen model
                (reference, reward model, judge) in the compute dtype; 1/N of each under FSDP2 (--fsdp)
    gradients   float32, one per trained parameter (1/N under FSDP2); alive from the first backward
    optimizer   AdamW's two float32 moments (8 bytes a parameter; 1/N under FSDP2)
    engine      while sampling: the sampler's weights (a compute-dtype copy on CUDA or under FSDP2, its q/k/v
                and gate/up fused in place; on a float32 CPU run the master weights themselves, plus fused
                copies of those), the KV cache (2 x layers x rows x kv heads x head dim x tokens), and the
                larger of the prefill (the prompts in one pass) and a decode step's sampler (20 bytes a logit)
    activations while training: what backward needs of one forward pass of --micro-batch-tokens tokens
                (every block's saved tensors, or only each block's input with --grad-checkpointing), plus
                the chunked vocabulary head (about 2^26 logits at a time, never the whole (B, T, V))
Sampling, the forward and backward, and the optimizer step take turns: the peak is the largest of the three
on top of the weights and the optimizer state. On CUDA a margin of 10% on top: the caching allocator's
fragmentation (runs/gpu_check.sh compares the estimate with the peak it reserves).
The per-token activation count below was measured on this CPU for our block (tests/test_memory.py holds
the estimate within 20% of the measured peak of real SFT and GRPO steps at the real vocabulary size).
"""
from dataclasses import dataclass

import torch

from common import UserError, print0

GiB = 2**30
FRAGMENTATION = 0.10  # on CUDA, a margin on top of the peak: what the caching allocator reserves beyond it


@dataclass
class Shape:
    """What the estimate needs of a model: GPTConfig's numbers."""
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    head: str = "lm"  # "scalar": a one-number head (reward model, critic), no vocabulary head to run

    @classmethod
    def of(cls, config):
        return cls(config.vocab_size, config.n_layer, config.n_embd, config.n_head, config.n_kv_head,
                   config.head_dim, config.intermediate_size, config.tie_word_embeddings, config.head)

    def block_params(self):
        C, D, I = self.n_embd, self.head_dim, self.intermediate_size
        return C * (self.n_head + 2 * self.n_kv_head) * D + self.n_head * D * C + 3 * C * I + 2 * C + 2 * D

    def lora_params(self, rank):
        """The adapters' parameters at this rank on every linear layer of attention and MLP: r x (in + out)
        each. Qwen3-8B at rank 32: 87.3M (1.1% of its 8.19B)."""
        C, HD, KD, I = self.n_embd, self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.intermediate_size
        return self.n_layer * rank * ((C + HD) * 2 + (C + KD) * 2 + (C + I) * 3)

    def params(self):
        embed = self.vocab_size * self.n_embd
        heads = self.n_embd if self.head == "scalar" else 0 if self.tie_word_embeddings else embed
        return embed + heads + self.n_layer * self.block_params() + self.n_embd


def activation_bytes(shape: Shape, tokens: int, dtype_bytes: int, grad_checkpointing=False, graded_tokens=None,
                     head_grad=True):
    """What one training pass over `tokens` tokens adds at its peak, early in backward.
    Blocks: per token and block, 1.2 x (6 C + 5 H*D + 2 Hk*D + 5 I) values (the norms' inputs, q/k/v before
    and after RoPE, attention's output, the MLP's gate, up and their product; the 1.2 is what the
    allocator adds, measured); with checkpointing only each block's input (C values), plus one block's
    worth while it is recomputed. The vocabulary head runs on the graded tokens only (graded_tokens, default
    all), chunked (about 2^26 float32 logits at a time):
    about five chunks' worth of logits live in a chunk's recomputed backward, and 1.5 float32 copies of
    its (V, C) weight gradient while the chunks accumulate into it (head_grad=False: a frozen head, LoRA;
    see below). A scalar head (reward model, critic) has no vocabulary head. The constants were fitted to
    real steps on this CPU (benchmarks/bench_memory.py) and tests/test_memory.py holds them there."""
    C, I = shape.n_embd, shape.intermediate_size
    HD, KD = shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    per_block = 1.2 * (6 * C + 5 * HD + 2 * KD + 5 * I) * dtype_bytes
    if grad_checkpointing:
        blocks = tokens * (C * dtype_bytes * shape.n_layer + per_block)
    else:
        blocks = tokens * per_block * shape.n_layer
    if shape.head == "scalar":
        return blocks
    graded = tokens if graded_tokens is None else graded_tokens
    chunk = min(graded, max(1, 2**26 // shape.vocab_size)) * shape.vocab_size
    # LoRA (head_grad=False) has no head gradient, yet its runs measured 2.4 float32 (V, C) copies above the
    # blocks and the logits, at 2 x 128 and 8 x 512 alike: taken as measured (the cause is not pinned down)
    return blocks + 5 * 4 * chunk + (1.5 if head_grad else 2.4) * 4 * shape.vocab_size * C


def engine_bytes(shape: Shape, rows: int, tokens: int, dtype_bytes: int, sampler_copy: bool, fused_copy: bool,
                 prompts: int, prompt_len: int):
    """The engine while it samples `rows` rows of at most `tokens` tokens (prompt + new), from `prompts` distinct
    prompts of at most prompt_len tokens: its weights (sampler_copy: a compute-dtype copy and the float32 head;
    fused_copy: fused q/k/v and gate/up copies of weights it shares), the KV cache, and the larger of
      the prefill     the prompts left-padded in one pass (engine.generate): a block's temporaries, at most
                      its MLP's (2 C + 4 I values a token), the (prompts, 1, L, L) mask and its additive copy,
                      and the first logits, repeated to every row (float32)
      the sampler     a decode step's (rows, V) float32 logits, their scaled and exponentiated copies and the
                      float64 cumulative sum: 20 bytes a logit (engine.sample_next; top-p sorts: about twice)"""
    C, D, I, V = shape.n_embd, shape.head_dim, shape.intermediate_size, shape.vocab_size
    fused = shape.n_layer * (C * (shape.n_head + 2 * shape.n_kv_head) * D + 2 * C * I) * dtype_bytes * fused_copy
    copy = shape.params() * dtype_bytes + V * C * 4 if sampler_copy else 0  # + the float32 head
    kv_cache = 2 * shape.n_layer * rows * shape.n_kv_head * D * tokens * dtype_bytes
    prefill = prompts * prompt_len * ((2 * C + 4 * I) * dtype_bytes + prompt_len * (1 + dtype_bytes)) + rows * V * 4
    sampler = rows * V * (4 + 4 + 4 + 8)
    return fused + copy + kv_cache + max(prefill, sampler)


def estimate(*, trained: list[Shape], frozen: list[Shape] = (), micro_batch_tokens: int, graded_tokens=None,
             world_size: int = 1, fsdp: bool = False, cuda: bool = False, grad_checkpointing: bool = False,
             sample_rows: int = 0, sample_tokens: int = 0, sample_prompts: int | None = None,
             prompt_len: int | None = None, lora_rank: int = 0) -> dict:
    """Peak bytes per device, by component (see the module docstring), and their "total".
    trained: the shapes of the models an optimizer updates (one; PPO's actor and critic: two);
    frozen: models that only run forward; micro_batch_tokens: the tokens of one training pass (graded_tokens
    of them trained: the answers of RL passes; default all); sample_rows x sample_tokens: the engine's
    batch (0: no sampling), from sample_prompts distinct prompts of prompt_len tokens (default: as many as
    rows, as long as sample_tokens: an upper bound). lora_rank > 0: the trained models' bases are frozen in the
    compute dtype and only their adapters (Shape.lora_params, float32) have gradients and optimizer state; the
    reference is the policy with its adapters off (pass no frozen copy of it)."""
    compute = 2 if cuda else 4
    shard = world_size if fsdp else 1
    n_trained = sum(s.lora_params(lora_rank) if lora_rank else s.params() for s in trained)
    frozen_params = sum(s.params() for s in frozen) + (sum(s.params() for s in trained) if lora_rank else 0)
    out = {"weights": (4 * n_trained + compute * frozen_params) / shard,
           "gradients": 4 * n_trained / shard,
           "optimizer": 8 * n_trained / shard}
    if fsdp and world_size > 1:  # one block gathered at a time (and the root), in the compute dtype
        out["weights"] += compute * max(s.block_params() + s.vocab_size * s.n_embd for s in trained)
    out["activations"] = sum(activation_bytes(s, micro_batch_tokens, compute, grad_checkpointing, graded_tokens,
                                              head_grad=not lora_rank) for s in trained)
    # a LoRA base already in the compute dtype is shared by the engine, not copied (only its float32 head is), and
    # fused in place like the engine's own copy: only float32 master weights shared on CPU get fused copies
    copy = (cuda or fsdp) and not (lora_rank and not fsdp)
    out["engine"] = engine_bytes(trained[0], sample_rows, sample_tokens, compute, sampler_copy=copy,
                                 fused_copy=not copy and not lora_rank, prompts=sample_prompts or sample_rows,
                                 prompt_len=prompt_len or sample_tokens) \
        + (4 * trained[0].vocab_size * trained[0].n_embd if lora_rank and not copy and cuda else 0) \
        if sample_rows else 0
    # three phases take turns on top of the weights and the optimizer state: sampling (the engine), a
    # forward and backward (activations), and the optimizer step (every gradient, and AdamW's temporaries,
    # about one more float32 copy of the trained parameters)
    out["total"] = out["weights"] + out["optimizer"] + max(out["engine"], out["activations"], 2 * out["gradients"])
    out["fragmentation"] = FRAGMENTATION * out["total"] if cuda else 0
    out["total"] += out["fragmentation"]
    return out


def rollout_estimate(*, trained, frozen=(), answers, prompts, prompt_len, max_new_tokens, minibatches,
                     micro_batch_tokens, **kwargs) -> dict:
    """estimate() for a stage that samples `answers` answers per rank per step to `prompts` prompts (of up to
    prompt_len tokens, max_new_tokens new ones) and trains on them in `minibatches` optimizer steps of forward passes
    of at most micro_batch_tokens tokens. kwargs: estimate's world_size, fsdp, cuda, grad_checkpointing,
    lora_rank."""
    rows_per_pass = -(-answers // minibatches)
    return estimate(trained=trained, frozen=frozen,
                    micro_batch_tokens=min(micro_batch_tokens, rows_per_pass * (prompt_len + max_new_tokens)),
                    graded_tokens=min(micro_batch_tokens, rows_per_pass * max_new_tokens),
                    sample_rows=answers, sample_tokens=prompt_len + max_new_tokens, sample_prompts=prompts,
                    prompt_len=prompt_len, **kwargs)

def describe(est: dict) -> str:
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in est.items() if k != "total" and v)
    return f"{est['total'] / GiB:.2f} GiB ({parts})"


def available_bytes(device) -> int | None:
    """What the device can hold: free GPU memory, or the machine's available RAM (None if unknown)."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check(est: dict, device) -> None:
    """Print the estimate before a run starts; refuse to start, naming both numbers, when it exceeds what
    the device has available."""
    print0(f"estimated peak memory per device: {describe(est)}")
    available = available_bytes(device)
    if available is not None and est["total"] > available:
        raise UserError(f"this run needs about {est['total'] / GiB:.1f} GiB per device ({describe(est)}) and "
                        f"{device} has {available / GiB:.1f} GiB available: lower --micro-batch-tokens (or "
                        f"--device-batch-size), add --grad-checkpointing, shard with --fsdp on more devices, or "
                        f"use a larger device")


# Qwen3's published shapes: layers, width, heads, kv heads, head dim, MLP width, tied embeddings
QWEN3 = {name: Shape(151936, L, C, H, Hk, 128, I, tie) for name, (L, C, H, Hk, I, tie) in {
    "0.6B": (28, 1024, 16, 8, 3072, True), "1.7B": (28, 2048, 16, 8, 6144, True),
    "4B": (36, 2560, 32, 8, 9728, True), "8B": (36, 4096, 32, 8, 12288, False),
    "14B": (40, 5120, 40, 8, 17408, False), "32B": (64, 5120, 64, 8, 25600, False)}.items()}


def stage_estimates(shape: Shape, world_size=1, fsdp=False, lora_rank=0) -> dict:
    """Each stage at real-model settings on CUDA (bf16 compute, --grad-checkpointing): SFT and DPO at
    4,096-token passes (DPO's reference precomputed), GRPO sampling 64 answers of 1,024 tokens after a
    512-token prompt per device and training 8,192-token passes, PPO the same with a critic of the same
    size and the reference loaded (with LoRA: the actor's adapters off, no copy)."""
    common = dict(world_size=world_size, fsdp=fsdp, cuda=True, grad_checkpointing=True, lora_rank=lora_rank)
    rollout = dict(sample_rows=64, sample_tokens=512 + 1024, sample_prompts=8, prompt_len=512, micro_batch_tokens=8192,
                   graded_tokens=8192 * 2 // 3)
    return {"SFT": estimate(trained=[shape], micro_batch_tokens=4096, **common),
            "DPO": estimate(trained=[shape], micro_batch_tokens=4096, **common),
            "GRPO": estimate(trained=[shape], **rollout, **common),
            "PPO": estimate(trained=[shape, shape], frozen=[] if lora_rank else [shape], **rollout, **common)}
