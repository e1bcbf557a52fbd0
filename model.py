"""
The GPT: the Qwen3 / Llama family shape, written so that a Hugging Face checkpoint's tensors map onto
it one to one (parameter names are exactly transformers' names, e.g. `model.layers.0.self_attn.q_proj.weight`).

    token ids -> embed_tokens -> n_layer x [RMSNorm -> grouped-query attention (QK-norm, RoPE) -> +residual
                                           RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> lm_head | score

- `forward` gives logits (inference), values (scalar head), or, with `targets`, per-token log-probs.
- `doc_ids` (B, T) marks documents packed into one row: positions restart at each document and attention
  never crosses one. The same mechanism isolates the left padding of a batch of prompts in the engine.
- `kv_cache` (a `KVCache`) makes decoding one token per step cost O(T) instead of O(T^2); `decode_step`
  is the same step as one flat function over fused weights, for the engine's inner loop.
- `forward(idx, targets)` gives per-token log-probs (and entropies) in float32, chunk by chunk over the
  graded positions only (`vocab_logprobs`), so no (B, T, V) tensor is ever built in training; the SFT
  loss is its negation. `grad_checkpointing = True` recomputes each block's activations in backward.
- `GPTConfig.head = "scalar"` swaps the vocabulary head for a one-number head (`score`), as reward
  models and critics need; everything below the head is the same code.
- Checkpoints are Hugging Face folders: `save_hf` / `from_hf` (config.json in Qwen3 or Llama form,
  model.safetensors, the tokenizer files).
"""
import json
import math
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common import UserError


@dataclass
class GPTConfig:
    vocab_size: int = 2048
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2               # grouped-query attention: n_head / n_kv_head queries share a key/value head
    n_embd: int = 128
    head_dim: int = 32               # Qwen3 decouples head_dim from n_embd / n_head
    intermediate_size: int = 384     # SwiGLU hidden width
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3: {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True             # Qwen3 normalizes q and k per head; Llama does not
    tie_word_embeddings: bool = True
    arch: str = "qwen3"              # which Hugging Face architecture config.json speaks: "qwen3" | "llama"
    head: str = "lm"                 # "lm": next-token logits; "scalar": one number per position (RM, critic)

    def __post_init__(self):
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.arch not in ("qwen3", "llama"):
            raise ValueError(f"arch must be 'qwen3' or 'llama', got {self.arch!r}")
        if self.head not in ("lm", "scalar"):
            raise ValueError(f"head must be 'lm' or 'scalar', got {self.head!r}")


# ------------------------------------------------------------------------------------------------
# Building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, weight, eps):
    # transformers normalizes in float32, casts back, then applies the gain. In float32 that is exactly
    # F.rms_norm with the gain, one call instead of four (a decode step runs 13 norms: op count matters)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.size(-1),), weight, eps)
    y = F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)
    return y if weight is None else weight * y


def rope_inv_freq(config: GPTConfig) -> torch.Tensor:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        # Llama 3.1: slow down the low frequencies by `factor`, keep the high ones, blend in between
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise UserError(f"unsupported rope_scaling {rs}; supported: none, llama3")
    return inv_freq


def apply_rope(x, cos, signed_sin):
    # x: (B, H, T, D); cos, signed_sin: (B, 1, T, D). The "rotate half" layout of transformers' Llama/Qwen,
    # x * cos + cat(-x2, x1) * sin, written as a roll by D/2 times a sine whose first half is negated
    # (bit-identical, and 4 ops instead of 6: a decode step runs this 8 times)
    return x * cos + x.roll(x.size(-1) // 2, dims=-1) * signed_sin


class KVCache:
    """Preallocated keys and values for every layer, in the dtype the model computes in, plus the document
    id of every cached position (so left padding and packed documents stay isolated while decoding) and
    each row's next position.

    A prefill may have fewer rows than the cache: with B prompts and a cache of B * n rows, prompt i's keys
    and values are written to its n rows i*n ... i*n + n - 1 (one prefill serves n samples of each prompt,
    and no second cache is ever built to repeat it). Decode steps then run on all the cache's rows."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device, dtype):
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.doc = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len
        self.isolated = True  # whether a decode step must mask other documents (set at prefill)

    def _rows_of(self, x):
        """x (B, ...) of a prefill batch, each row repeated for its group of cache rows (small tensors only)."""
        n = self.doc.size(0) // x.size(0)
        return x if n == 1 else x.repeat_interleave(n, dim=0)

    def record_positions(self, doc_ids, pos):
        """The documents and positions of the T tokens about to be appended (doc_ids, pos: (B, T))."""
        t0 = self.length
        self.doc[:, t0:t0 + doc_ids.size(1)] = self._rows_of(doc_ids)
        self.next_pos = self._rows_of(pos[:, -1] + 1)

    def update(self, layer: int, k, v):
        """Append k, v (B, H_kv, T, D) at the current length; return the layer's keys and values so far."""
        t0, t1 = self.length, self.length + k.size(2)
        rows = self.k.size(1)
        if k.size(0) == rows:
            self.k[layer, :, :, t0:t1] = k
            self.v[layer, :, :, t0:t1] = v
            return self.k[layer, :, :, :t1], self.v[layer, :, :, :t1]
        # a prefill of the distinct prompts: each one's keys and values go to its group of rows, broadcast
        # (no copy of them is built), and its attention needs only its own
        B = k.size(0)
        if t0 != 0 or rows % B:
            raise ValueError(f"a batch of {B} rows can only prefill an empty cache of a multiple of {B} rows, "
                             f"not {rows} rows at length {t0}")
        self.k[layer, :, :, :t1].unflatten(0, (B, rows // B)).copy_(k[:, None])
        self.v[layer, :, :, :t1].unflatten(0, (B, rows // B)).copy_(v[:, None])
        return k, v

    def keep_rows(self, rows):
        """Keep only these batch rows (ascending indices), moved to the front in place, one layer at a time:
        dropping rows never allocates a second cache (the storage stays; the rows behind are left unused)."""
        n, t = rows.numel(), self.length
        for layer in range(self.k.size(0)):
            self.k[layer, :n, :, :t] = self.k[layer, rows, :, :t]
            self.v[layer, :n, :, :t] = self.v[layer, rows, :, :t]
        self.k, self.v = self.k[:, :n], self.v[:, :n]
        self.doc, self.next_pos = self.doc[rows], self.next_pos[rows]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.q_proj = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache, layer):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        if T == 1 and kv_cache is not None:
            # one decode step: fold each kv head's group of query heads into the query-length axis, so
            # attention is one plain (no GQA broadcast) call; the mask (B, 1, 1, S) or None covers the group
            qg = q.reshape(B, self.n_kv_head, self.n_head // self.n_kv_head, self.head_dim)
            y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, self.n_head, 1, self.head_dim)
        elif mask is None:  # plain causal self-attention: the fast path
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, kv_cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Trunk(nn.Module):
    """Named `model` inside GPT, as in transformers, so checkpoint keys match."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.rms_norm_eps)


# ------------------------------------------------------------------------------------------------
# LoRA: a frozen base, trainable low-rank adapters (Hu et al. 2021, https://arxiv.org/abs/2106.09685)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer W (out, in) plus a trainable low-rank update:

        y = W x + (alpha / r) * B(A(dropout(x)))        A: (r, in), B: (out, r), both float32

    A starts as PEFT's (kaiming_uniform_, a = sqrt(5): uniform in +-1/sqrt(in)) and B at zero, so at step 0
    the layer IS the base layer. The names (weight, lora_A.weight, lora_B.weight) are PEFT's, so an adapter
    file's keys map onto these one to one. `enabled = False` switches the update off (adapters_off).
    Example: W = 0, in = 2, out = 2, r = 1, alpha = 2, A = [[1, 1]], B = [[0.5], [0]], x = [1, 3]:
    A x = 4, B A x = [2, 0], y = (2 / 1) * [2, 0] = [4, 0]; the merged weight W + (alpha/r) B A = [[1, 1], [0, 0]]
    gives the same y."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        # built on the meta device (no draw from the global RNG), then allocated and initialized here
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device="meta", dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device="meta", dtype=torch.float32)
        if not base.weight.is_meta:
            self.lora_A.to_empty(device=base.weight.device)
            self.lora_B.to_empty(device=base.weight.device)
            self.reset_lora()
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    @torch.no_grad()
    def reset_lora(self, generator=None):
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        y = F.linear(x, self.weight)
        if not self.enabled:
            return y
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def delta(self):
        """The update as a full matrix, (alpha / r) * B @ A in float32: what merging adds to W."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())


def lora_init_tensors(model, seed=0) -> dict:
    """Fresh adapter tensors for every LoRALinear of `model` ({name: float32 CPU tensor}, drawn in module
    order from one generator seeded by `seed`): the same on every rank, whatever the model's device."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            a = torch.empty(m.lora_A.weight.shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
            out[f"{name}.lora_A.weight"] = a
            out[f"{name}.lora_B.weight"] = torch.zeros(m.lora_B.weight.shape)
    return out


def add_lora(model, rank: int, alpha: float | None = None, targets=LORA_TARGETS, dropout: float = 0.0):
    """Freeze every parameter of `model` and wrap each targeted linear layer of every block in a LoRALinear
    (in place; on the meta device too). A reward model's or critic's score head stays trainable (it is
    new). alpha defaults to 2 * rank. Returns the model, with `model.lora` the options (for checkpoints).
    Errors: a rank above a layer's smaller side (the update could not be low-rank); a target naming no
    layer."""
    targets = list(targets)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise UserError(f"--lora-targets {','.join(unknown) or '(none)'}: no such layer; valid names: {', '.join(LORA_TARGETS)}")
    alpha = float(2 * rank if alpha is None else alpha)
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in targets:
                lin = getattr(parent, name, None)
                if not isinstance(lin, nn.Linear):
                    continue
                if not 0 < rank <= min(lin.in_features, lin.out_features):
                    raise UserError(f"--lora-rank {rank} does not fit layer {name} ({lin.out_features} x "
                                    f"{lin.in_features}): the rank must be at most {min(lin.in_features, lin.out_features)}")
                setattr(parent, name, LoRALinear(lin, rank, alpha, dropout))
    if model.config.head == "scalar":
        model.score.float().weight.requires_grad_(True)  # trained, so float32 like the adapters
    model.lora = {"r": rank, "alpha": alpha, "targets": targets, "dropout": dropout}
    return model


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


@contextmanager
def adapters_off(model):
    """The base model, for the block's duration: every adapter of `model` switched off. A LoRA run's
    reference policy (DPO, the GRPO KL term, PPO) is this, so no second model is ever loaded."""
    layers = lora_layers(model)
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


def _fused_low_rank(linears, row_scale=None):
    """One (A, B) pair for linear layers whose outputs are concatenated (q, k, v; gate, up), so that
    F.linear(F.linear(x, A), B) is their low-rank updates concatenated: A stacks their A's (sum r, in) and
    B is block-diagonal (sum out, sum r), each block alpha / r times its B (times row_scale[i] if given).
    None when none of them is adapted. Dtype: that of the adapters (the engine's copy: the compute dtype)."""
    if not any(isinstance(m, LoRALinear) for m in linears):
        return None
    blocks_a, rows, cols = [], 0, 0
    ref = next(m for m in linears if isinstance(m, LoRALinear)).lora_A.weight
    B = ref.new_zeros(sum(m.out_features for m in linears), sum(m.lora_A.out_features for m in linears
                                                                    if isinstance(m, LoRALinear)))
    for i, m in enumerate(linears):
        if isinstance(m, LoRALinear):
            r = m.lora_A.out_features
            scale = m.scaling * (row_scale[i] if row_scale else 1.0)
            B[rows:rows + m.out_features, cols:cols + r] = m.lora_B.weight * scale
            blocks_a.append(m.lora_A.weight)
            cols += r
        rows += m.out_features
    return torch.cat(blocks_a), B


def _low_rank(y, x, pair):
    """y + B(A(x)): a fused low-rank update (None: nothing to add)."""
    return y if pair is None else y + F.linear(F.linear(x, pair[0]), pair[1])


# ------------------------------------------------------------------------------------------------
# Log-probs under the distribution a sampler uses (shared by the engine and the trainers)

def process_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Float32 logits of the distribution that is sampled from: divided by the temperature, tokens
    outside top-k / top-p set to -inf. The engine samples from this; the trainer recomputes with it."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def logprobs_from_logits(logits, targets, temperature=1.0, top_k=None, top_p=None):
    """log p(target) per position, float32. Targets < 0 (ignore index) give 0."""
    logits = process_logits(logits, temperature, top_k, top_p)
    safe = targets.clamp(min=0)
    # gather - logsumexp is log_softmax without materializing the whole (.., V) log-softmax
    lp = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return lp.masked_fill(targets < 0, 0.0)


def vocab_logprobs(hidden, weight, targets, *, temperature=1.0, top_k=None, top_p=None, with_entropy=False,
                   chunk_elements=2**26):
    """log p(targets) in float32 (B, T), 0 where targets < 0, from final hidden states (B, T, C) and a
    vocabulary head weight (V, C), without ever building the (B, T, V) logits: only the graded positions
    (targets >= 0) are computed, in chunks of about chunk_elements logits (441 tokens at a vocabulary of
    151,936: 256 MB in float32); under autograd each chunk's logits are recomputed in backward, so only
    the (N, C) hidden states are kept. The head runs in float32 (weight and hidden states cast up): the
    engine samples from float32 logits of the same head, and the output head is where bf16
    engine/trainer mismatch comes from (MiniMax-M1; prime-rl#2438).
    with_entropy=True also returns each graded position's entropy -sum p log p under the distribution
    sampled from (temperature, top-k/top-p applied): a truncated token (logit -inf, p = 0) contributes
    0, not 0 * -inf = NaN."""
    graded = targets >= 0
    h, t = hidden[graded], targets[graded]                  # (N, C), (N,)
    step = max(1, chunk_elements // weight.size(0))

    def chunk_fn(h_chunk, t_chunk):
        with torch.autocast(h_chunk.device.type, enabled=False):
            logits = process_logits(F.linear(h_chunk.float(), weight.float()), temperature, top_k, top_p)
            lse = torch.logsumexp(logits, dim=-1)
            lp = logits.gather(-1, t_chunk[:, None]).squeeze(-1) - lse
            if not with_entropy:
                return lp, None
            p = torch.exp(logits - lse[:, None])
            return lp, lse - (p * torch.where(torch.isfinite(logits), logits, 0.0)).sum(-1)

    lps, ents = [], []
    for s in range(0, h.size(0), step):
        args = (h[s:s + step], t[s:s + step])
        lp, ent = checkpoint(chunk_fn, *args, use_reentrant=False) if torch.is_grad_enabled() else chunk_fn(*args)
        lps.append(lp)
        ents.append(ent)
    zeros = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
    out = zeros.masked_scatter(graded, torch.cat(lps)) if lps else zeros
    if not with_entropy:
        return out
    return out, (zeros.masked_scatter(graded, torch.cat(ents)) if ents else zeros)


# ------------------------------------------------------------------------------------------------
# The model

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.model = Trunk(config)
        if config.head == "lm":
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.score = nn.Linear(config.n_embd, 1, bias=False)
        self.grad_checkpointing = False  # activation checkpointing per decoder block (--grad-checkpointing)
        self._init_rope()
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)
            # GPT-2's scaled init: each residual branch adds to the stream, so shrink its output layer
            for name, p in self.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _init_rope(self, device=None):
        inv_freq = rope_inv_freq(self.config).to(device)
        t = torch.arange(self.config.max_seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # tied weights count once

    # -- the trunk ---------------------------------------------------------------------------

    def hidden_states(self, idx, doc_ids=None, kv_cache=None):
        """Final-normed hidden states (B, T, C). See the module docstring for doc_ids and kv_cache."""
        B, T = idx.shape
        dev = idx.device
        mask = None
        if kv_cache is None:
            if doc_ids is None:
                pos = torch.arange(T, device=dev).expand(B, T)
            else:
                pos = positions_from_doc_ids(doc_ids)
                same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
                mask = (same_doc & torch.ones(T, T, dtype=torch.bool, device=dev).tril())[:, None]
        else:
            t0 = kv_cache.length
            if t0 + T > kv_cache.max_len:
                raise ValueError(f"KV cache full: {t0} + {T} > {kv_cache.max_len}")
            if t0 == 0:  # prefill: the prompt's own documents (left padding is a document of its own)
                doc_ids = doc_ids if doc_ids is not None else torch.zeros(B, T, dtype=torch.long, device=dev)
                pos = positions_from_doc_ids(doc_ids)
                # left padding or packed prompts: decoding must keep masking the other documents (one sync)
                kv_cache.isolated = bool((doc_ids != doc_ids[:, -1:]).any())
                kv_cache.record_positions(doc_ids, pos)
                k_doc = doc_ids  # the prompts attend to themselves (the cache may hold n rows per prompt)
            else:        # decode: every new token continues its row's last document
                doc_ids = kv_cache.doc[:, t0 - 1:t0].expand(B, T)
                pos = kv_cache.next_pos[:, None] + torch.arange(T, device=dev)
                kv_cache.record_positions(doc_ids, pos)
                k_doc = kv_cache.doc[:, :t0 + T]
            if T == 1:  # one decode step sees every cached position of its own document, nothing else
                mask = (k_doc == doc_ids)[:, None, None] if kv_cache.isolated else None
            else:
                causal = torch.arange(t0 + T, device=dev)[None, :] <= torch.arange(t0, t0 + T, device=dev)[:, None]
                mask = ((doc_ids[:, :, None] == k_doc[:, None, :]) & causal)[:, None]
        # a position never exceeds its index in the cache: when the index fits, skip the device sync
        fits = kv_cache is not None and kv_cache.length + T <= self.config.max_seq_len
        if not fits and int(pos.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(pos.max())} exceeds max_seq_len={self.config.max_seq_len}; "
                             f"crop the sequence or raise max_seq_len")
        # rotate in the dtype q and k have: the compute dtype under autocast (no float32 promotion)
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else \
            self.model.embed_tokens.weight.dtype
        cos = self.rope_cos[pos].unsqueeze(1).to(dtype)
        sin = self.rope_signed_sin[pos].unsqueeze(1).to(dtype)
        x = self.model.embed_tokens(idx)
        recompute = self.grad_checkpointing and kv_cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.model.layers):
            if recompute:  # keep only each block's input; its activations are recomputed in backward
                x = checkpoint(block, x, cos, sin, mask, None, i, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.length += T
        return self.model.norm(x)

    # -- the heads ---------------------------------------------------------------------------

    def forward(self, idx, targets=None, doc_ids=None, kv_cache=None, *, temperature=1.0, top_k=None, top_p=None,
                with_entropy=False):
        """What each head gives, from the hidden states of idx (B, T):
          head="scalar"        values (B, T), float32 (reward models, critics); with targets also their
                               log-probs through the vocabulary head (the RM's LM regularizer)
          no targets           logits (B, T, V): for inference and tests only; at a vocabulary of 151,936
                               they are 0.6 GB per 1,000 tokens in float32, so training never asks for them
          targets (B, T)       log p(targets[t] | idx[:t+1]) in float32, (B, T), 0 where targets < 0: the
                               training forward of every stage (the SFT loss is its negation), computed by
                               vocab_logprobs; with_entropy=True also returns each graded position's entropy
        Training code calls the model (forward) rather than a method, so that a DDP or FSDP wrapper sees
        the call: DDP's gradient all-reduce is armed by its forward, and nothing else."""
        h = self.hidden_states(idx, doc_ids, kv_cache)
        if self.config.head == "scalar":
            values = self.score(h).squeeze(-1).float()
            if targets is None:
                return values
            # a reward model with GRM's LM regularizer (chat_rm.py): the chat model's log-probs of the
            # targets, from the same hidden states, through the tied embeddings or a frozen copy of the
            # chat model's untied head (the buffer frozen_lm_head, attached by chat_rm.py)
            head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.frozen_lm_head
            return values, vocab_logprobs(h, head, targets)
        if targets is None:
            return self.lm_head(h)
        return self.head_logprobs(h, targets, temperature=temperature, top_k=top_k, top_p=top_p,
                                   with_entropy=with_entropy)

    def head_logprobs(self, hidden, targets, **kwargs):
        """vocab_logprobs through this model's LM head (see there)."""
        return vocab_logprobs(hidden, self.lm_head.weight, targets, **kwargs)

    # -- one decode step, fast ----------------------------------------------------------------

    def decode_weights(self, head=None):
        """The weights decode_step reads: per layer, fused, the q, k and v projections as one matrix, gate
        and up as one, the q/k-norm gains as one (H + H_kv, D) table, attention's 1/sqrt(D) folded into q
        (into q's norm gain when there is one: the norm would undo it on the weights); and `head`, the
        (V, C) float32 matrix the logits come from (default: this model's lm_head in float32; the engine
        passes the master weights' own). A copy in this model's dtype: build it again whenever the weights
        change (the engine does, in Engine.prepare: one pass over them)."""
        assert self.config.head == "lm", "decode_step needs the language-model head"
        scale = self.config.head_dim ** -0.5
        layers = []
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            w_q, qk_gain = a.q_proj.weight, None
            if hasattr(a, "q_norm"):
                qk_gain = torch.cat([a.q_norm.weight.expand(a.n_head, -1) * scale, a.k_norm.weight.expand(a.n_kv_head, -1)])
            else:
                w_q = w_q * scale  # RoPE is linear: scaling q before it is scaling after it
            # LoRA adapters stay unmerged: a bfloat16 W + (alpha/r) B A would round away every update under
            # half a ulp of W (~0.2% of |W|), which the trainer sees; the fused low-rank pairs add them apart
            low_rank = None
            if lora_layers(layer):
                low_rank = (_fused_low_rank([a.q_proj, a.k_proj, a.v_proj], None if qk_gain is not None else [scale, 1, 1]),
                            _fused_low_rank([a.o_proj]), _fused_low_rank([mlp.gate_proj, mlp.up_proj]),
                            _fused_low_rank([mlp.down_proj]))
            # o and down are applied as addmm(residual, y, W.T): the residual add rides in the matmul
            layers.append((layer.input_layernorm.weight, torch.cat([w_q, a.k_proj.weight, a.v_proj.weight]), qk_gain,
                           a.o_proj.weight.t(), layer.post_attention_layernorm.weight,
                           torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight.t(), low_rank))
        return {"layers": layers, "head": self.lm_head.weight.float() if head is None else head}

    def decode_step(self, tokens, kv_cache, weights):
        """Float32 logits (B, V) of one new token per row (tokens: (B,)), appended to kv_cache: the numbers
        of F.linear(hidden_states(tokens[:, None], kv_cache=kv_cache)[:, -1].float(), weights["head"]), but
        as one flat function over the fused weights of decode_weights, with q and k normed and rotated
        together and each residual add inside its matmul. A small model's decode step is mostly per-op
        overhead, and this runs about half the ops of the module forward (see benchmarks/bench_engine.py).
        Everything runs in the dtype of this model's weights (the KV cache's too); only the head is float32."""
        c, t = self.config, kv_cache.length
        if not 0 < t < kv_cache.max_len:
            raise ValueError(f"decode_step needs a prefilled KV cache with room: length {t}, max_len {kv_cache.max_len}")
        B, H, Hk, D, eps = tokens.size(0), c.n_head, c.n_kv_head, c.head_dim, c.rms_norm_eps
        doc = kv_cache.doc[:, t - 1]  # the new token continues its row's last document
        kv_cache.doc[:, t] = doc
        mask = (kv_cache.doc[:, :t + 1] == doc[:, None])[:, None, None] if kv_cache.isolated else None
        pos = kv_cache.next_pos
        dtype = self.model.embed_tokens.weight.dtype
        cos = self.rope_cos[pos][:, None].to(dtype)  # (B, 1, D): the same for every head
        sin = self.rope_signed_sin[pos][:, None].to(dtype)
        x = self.model.embed_tokens(tokens)  # (B, C)
        for i, (ln_attn, w_qkv, qk_gain, w_o_t, ln_mlp, w_gate_up, w_down_t, low_rank) in enumerate(weights["layers"]):
            lr_qkv, lr_o, lr_gate_up, lr_down = low_rank or (None,) * 4  # LoRA adapters, unmerged (or none)
            h = rms_norm(x, ln_attn, eps)
            qkv = _low_rank(F.linear(h, w_qkv), h, lr_qkv).view(B, H + 2 * Hk, D)
            qk, v = qkv[:, :H + Hk], qkv[:, H + Hk:]
            if qk_gain is not None:  # the gain differs per head: normalize, then one (H + Hk, D) multiply
                qk = rms_norm(qk, None, eps) * qk_gain
            qk = apply_rope(qk, cos, sin)
            k_all, v_all = kv_cache.update(i, qk[:, H:, None], v[:, :, None])  # (B, Hk, t + 1, D)
            # each kv head's group of query heads (pre-scaled) as its query axis: one plain attention call,
            # which keeps the scores in float32 in bfloat16 too
            q = qk[:, :H].reshape(B, Hk, H // Hk, D)
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=1.0)
            y = y.reshape(B, H * D)
            x = _low_rank(torch.addmm(x, y, w_o_t), y, lr_o)
            h = rms_norm(x, ln_mlp, eps)
            gate, up = _low_rank(F.linear(h, w_gate_up), h, lr_gate_up).chunk(2, dim=-1)
            y = F.silu(gate) * up
            x = _low_rank(torch.addmm(x, y, w_down_t), y, lr_down)
        kv_cache.length += 1
        kv_cache.next_pos = pos + 1
        return F.linear(rms_norm(x, self.model.norm.weight, eps).float(), weights["head"])

    # -- Hugging Face folders ----------------------------------------------------------------

    def save_hf(self, path, tokenizer=None, dtype=None, max_shard_bytes=5 * 2**30):
        """Write a folder that transformers loads: config.json, the weights (model.safetensors, or files
        of at most max_shard_bytes with model.safetensors.index.json, as transformers shards them),
        generation_config.json and the tokenizer files. Not atomic by itself (see common.py).
        Under FSDP2 every rank must call it: each tensor is gathered on its own (full_tensor) and rank 0
        writes, so no rank ever holds more than one file's worth of full tensors."""
        import torch.distributed as dist
        from safetensors.torch import save_file
        writer = not dist.is_initialized() or dist.get_rank() == 0
        state = self.state_dict()
        if self.config.head == "lm" and self.config.tie_word_embeddings:
            state.pop("lm_head.weight")  # tied: transformers re-ties it from embed_tokens
        out_dtype = dtype or next(self.parameters()).dtype
        files, current, size = [], [], 0  # consecutive tensors, a file at most max_shard_bytes
        for key, value in state.items():
            nbytes = value.numel() * (dtype or value.dtype).itemsize
            if current and size + nbytes > max_shard_bytes:
                files.append(current)
                current, size = [], 0
            current.append(key)
            size += nbytes
        files.append(current)
        names = ["model.safetensors"] if len(files) == 1 else \
            [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        if writer:
            os.makedirs(path, exist_ok=True)
        for name, keys in zip(names, files):
            tensors = {}
            for key in keys:
                value = state[key].detach()
                value = value.full_tensor() if hasattr(value, "full_tensor") else value  # a DTensor shard
                if writer:
                    tensors[key] = value.to(dtype or value.dtype).cpu().contiguous()
            if writer:
                save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        if not writer:
            return
        if len(files) > 1:
            total = sum(state[k].numel() * (dtype or state[k].dtype).itemsize for k in state)
            index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, ks in zip(names, files) for k in ks}}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        hf = config_to_hf(self.config, out_dtype, tokenizer)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        if self.config.head == "lm":
            # generate() stops where our engine stops: <|im_end|> first (the end of turn), then <|endoftext|>
            eos = [tokenizer.eos_id] + sorted(tokenizer.stop_ids - {tokenizer.eos_id}) if tokenizer else None
            gen = {"eos_token_id": eos, "pad_token_id": hf.get("pad_token_id"), "bos_token_id": None}
            with open(os.path.join(path, "generation_config.json"), "w") as f:
                json.dump(gen, f, indent=2)
        if tokenizer is not None:
            tokenizer.save(path)

    @classmethod
    def from_hf(cls, path, dtype=None, device="cpu", head=None, shard=None, lora=None):
        """Load a Hugging Face folder (ours or a downloaded Qwen3 / Llama) tensor by tensor, without
        holding two copies of the weights. head="scalar" on an LM checkpoint starts a reward model or
        critic from it (the vocabulary head is dropped, the score head freshly initialized at 0).
        shard: a function that shards a model in place (common.shard_model, FSDP2). The model is then
        built on the meta device, sharded, allocated, and each rank copies only its own slice of each
        tensor from the memory-mapped files: no rank ever holds the whole model.
        `path` may be a LoRA adapter folder (PEFT's format; adapter_chain): its base is loaded and every
        adapter of the chain merged into each weight in float32, then cast to `dtype`.
        lora: LoRA training (a dict: r, alpha, targets, dropout, seed, resume): the base frozen in `dtype`,
        adapters (float32) on top: fresh ones (seeded), or with resume=True the adapter of `path` itself,
        unmerged, to continue training it (the adapters below it in the chain are merged)."""
        from safetensors import safe_open
        base, chain = adapter_chain(path)
        own = None
        if lora and lora.get("resume"):
            if not chain:
                raise UserError(f"{path}: not a LoRA adapter folder; resume it without --lora-rank")
            chain, own = chain[:-1], read_adapter(chain[-1])
            lora = {**lora, "r": own[0]["r"], "alpha": own[0]["lora_alpha"], "targets": own[0]["target_modules"]}
        config = load_config(base, head)
        files = _safetensors_files(base)
        with torch.device("meta"):
            model = cls(config)
        if lora:
            if dtype is not None:
                model.to(dtype)  # the frozen base in the compute dtype; the adapters float32 (add_lora)
            add_lora(model, lora["r"], lora.get("alpha"), lora.get("targets") or LORA_TARGETS, lora.get("dropout", 0.0))
            # the folder this adapter applies to (a plain model, or the adapter folder it was started from)
            model.lora["base"] = own[0]["base_model_name_or_path"] if own else os.path.abspath(path)
        if shard is not None:  # every parameter is a fresh object after these: build the optimizer later
            if dtype is not None and not lora:
                model.to(dtype)
            shard(model)
            model.to_empty(device=device)
        params = dict(model.named_parameters())  # a tied head appears once, as model.embed_tokens.weight
        expected = set(params) if shard is not None else set(model.state_dict().keys())
        deltas, replaced = merged_updates(chain, params)  # float32 updates of the adapters merged below

        def put(key, t):  # into the parameter, in its dtype (a LoRA model's or a sharded one's is set already)
            t = t.to(params[key].dtype if lora or shard is not None else dtype or t.dtype)
            if shard is not None:
                _copy_shard(params[key], t)
            else:
                _set_tensor(model, key, t.to(device))

        loaded = set()
        for file in files:
            with safe_open(file, framework="pt", device="cpu" if shard is not None or deltas else str(device)) as f:
                for key in f.keys():
                    if key not in expected:
                        if key in ("lm_head.weight", "score.weight"):
                            continue  # the other head (e.g. an RM started from an LM checkpoint)
                        raise UserError(f"{file}: unexpected tensor {key!r} for {config.arch}")
                    t = replaced.get(key, f.get_tensor(key))
                    if key in deltas:  # merge in float32, then cast: a bfloat16 sum would drop small updates
                        t = t.float() + deltas[key]
                    put(key, t)
                    loaded.add(key)
        for key in set(replaced) - loaded:  # a score head an adapter holds, on an LM checkpoint
            if key in expected:
                put(key, replaced[key])
                loaded.add(key)
        if lora:  # the adapters: the checkpoint's own, or fresh (the same on every rank)
            tensors = own[1] if own else lora_init_tensors(model, lora.get("seed", 0))
            for key, t in tensors.items():
                if key not in expected:
                    raise UserError(f"{path}: adapter tensor {key!r} has no layer in the model {base}")
                if tuple(t.shape) != tuple(params[key].shape):
                    raise UserError(f"{path}: adapter tensor {key} is {tuple(t.shape)}, the model {base} needs "
                                    f"{tuple(params[key].shape)}: the adapter was trained on another base")
                put(key, t)
                loaded.add(key)
        if config.head == "lm" and config.tie_word_embeddings:
            if shard is None:
                model.lm_head.weight = model.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = expected - loaded
        if config.head == "scalar" and missing == {"score.weight"}:  # fresh score head: every reward 0
            if shard is not None:
                with torch.no_grad():
                    params["score.weight"].zero_()
            else:
                ref = model.model.embed_tokens.weight
                _set_tensor(model, "score.weight", torch.zeros(1, config.n_embd, dtype=torch.float32 if lora else
                                                               ref.dtype, device=ref.device))
            missing = set()
        if missing:
            raise UserError(f"{path}: checkpoint lacks tensors {sorted(missing)[:5]}...")
        model._init_rope(device)
        return model if shard is not None else model.to(device)  # (.to would replace FSDP's sharded parameters)

    def save_adapter(self, path, tokenizer=None):
        """Write this LoRA model's adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors:
        what peft.PeftModel.from_pretrained and vLLM's --enable-lora load) plus the tokenizer files; the
        frozen base is not written: adapter_config.json names it (base_model_name_or_path). Keys are PEFT's:
        base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight; a reward model's or critic's score
        head is saved whole (PEFT's modules_to_save). Under FSDP2 every rank calls it (rank 0 writes)."""
        import torch.distributed as dist
        from safetensors.torch import save_file
        writer = not dist.is_initialized() or dist.get_rank() == 0
        tensors = {}
        for name, p in self.named_parameters():
            if "lora_" in name or (name == "score.weight" and self.config.head == "scalar"):
                t = p.detach()
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                tensors[_PEFT_PREFIX + name] = t.float().cpu().contiguous()
        if not writer:
            return
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        o = self.lora
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if self.config.head == "lm" else "SEQ_CLS",
               "base_model_name_or_path": o["base"], "r": o["r"], "lora_alpha": o["alpha"],
               "lora_dropout": o["dropout"], "target_modules": list(o["targets"]), "bias": "none",
               "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
               "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
               "layers_pattern": None, "modules_to_save": ["score"] if self.config.head == "scalar" else None,
               "revision": None}
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
            json.dump(cfg, f, indent=2)
        if tokenizer is not None:
            tokenizer.save(path)


# ------------------------------------------------------------------------------------------------
# LoRA adapter folders in PEFT's format

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # PeftModel -> its base (the *ForCausalLM) -> our names


def is_adapter(path) -> bool:
    """An adapter folder: adapter_config.json and no config.json (a folder with both is a model)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(os.path.join(path, "config.json"))


def read_adapter(path):
    """(adapter_config.json as a dict, {our tensor name: float32 tensor}) of a PEFT LoRA folder. What
    PEFT can write and we cannot apply (DoRA, per-layer ranks, biases, transposed weights) is refused;
    rsLoRA's scaling alpha / sqrt(r) is applied by folding it into lora_alpha (alpha' = alpha sqrt(r))."""
    from safetensors.torch import load_file
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform")
                   if cfg.get(k)] + (["bias"] if cfg.get("bias", "none") != "none" else [])
    if unsupported:
        raise UserError(f"{path}: adapter options {unsupported} are not supported (plain LoRA only)")
    if cfg.get("use_rslora"):
        cfg = {**cfg, "lora_alpha": cfg["lora_alpha"] * math.sqrt(cfg["r"]), "use_rslora": False}
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # PEFT's "all-linear", or a regex
        targets = list(LORA_TARGETS) if targets == "all-linear" else [t for t in LORA_TARGETS if t in targets]
    cfg["target_modules"] = targets
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise UserError(f"{path}: no {ADAPTER_WEIGHTS}")
    tensors = {}
    for key, t in load_file(weights).items():
        name = key.removeprefix(_PEFT_PREFIX).replace(".default.", ".").replace(".modules_to_save.", ".")
        tensors[name] = t.float()
    return cfg, tensors


def adapter_chain(path):
    """(the plain model folder at the bottom, [adapter folders from the base up]) of a model or adapter
    folder: an adapter names its base (base_model_name_or_path), which may itself be an adapter (an RL
    adapter trained on an unmerged SFT adapter). A plain model folder: (path, [])."""
    chain = []
    while is_adapter(path):
        chain.insert(0, path)
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            base = json.load(f).get("base_model_name_or_path")
        found = next((c for c in ([os.path.join(path, base), base] if base else []) if os.path.isdir(c)), None)
        if found is None:  # e.g. a hub name ("Qwen/Qwen3-8B") of an adapter trained elsewhere
            raise UserError(f"{path}: its base_model_name_or_path {base!r} is not a folder here; set it (in "
                            f"{ADAPTER_CONFIG}) to the local folder of the model the adapter was trained on")
        path = found
        if len(chain) > 16:
            raise UserError(f"{chain[0]}: adapters chained more than 16 deep (a cycle?)")
    return path, chain


def merged_updates(chain, params):
    """The float32 updates that merging the adapters of `chain` adds to each base weight, summed
    ({weight name: delta}), and the tensors they replace whole ({name: tensor}: a score head). Each
    adapter's shapes are checked against the model's (params: its parameters by name)."""
    deltas, replaced = {}, {}
    for folder in chain:
        cfg, tensors = read_adapter(folder)
        scaling = cfg["lora_alpha"] / cfg["r"]
        for name, t in tensors.items():
            if ".lora_A." not in name:
                if ".lora_B." not in name:
                    replaced[name] = t  # modules_to_save: the score head
                continue
            layer = name.split(".lora_A.")[0]
            b = tensors.get(f"{layer}.lora_B.weight")
            key = f"{layer}.weight"
            if b is None or key not in params:
                raise UserError(f"{folder}: adapter tensor {name} has no {'lora_B' if b is None else 'layer'} "
                                f"in the model")
            want = tuple(params[key].shape)
            if (b.size(0), t.size(1)) != want or b.size(1) != t.size(0):
                raise UserError(f"{folder}: adapter of {layer} is {b.size(0)} x {t.size(1)} (B {tuple(b.shape)}, "
                                f"A {tuple(t.shape)}), the base has {want[0]} x {want[1]}: the adapter was "
                                f"trained on another base")
            deltas[key] = deltas.get(key, 0) + scaling * (b @ t)
    return deltas, replaced


def _copy_shard(param, full):
    """Copy this rank's slice of a full tensor into a sharded (DTensor) parameter, without communication."""
    from torch.distributed.tensor import distribute_tensor
    with torch.no_grad():
        param.copy_(distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None))


def load_config(path, head=None) -> GPTConfig:
    """The GPTConfig of a Hugging Face folder (its config.json; an adapter folder: its base's), without
    loading any weight."""
    path = adapter_chain(path)[0]
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"{path}: no config.json; expected a Hugging Face model folder (config.json + model.safetensors)")
    with open(cfg_path) as f:
        config = config_from_hf(json.load(f), path)
    if head is not None:
        config.head = head
    return config


def load_lm_head(path, device="cpu"):
    """The untied lm_head.weight of the LM checkpoint at `path`, read alone (float32)."""
    from safetensors import safe_open
    for file in _safetensors_files(adapter_chain(path)[0]):  # adapters never touch the head
        with safe_open(file, framework="pt", device=str(device)) as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").float()
    raise ValueError(f"{path}: no lm_head.weight (a tied checkpoint's head is its embed_tokens.weight)")


def positions_from_doc_ids(doc_ids):
    """Position of each token inside its document: 0 at every document start."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


def _set_tensor(model, key, tensor):
    mod_name, _, attr = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    trainable = getattr(mod, attr).requires_grad and tensor.is_floating_point()  # a frozen LoRA base stays frozen
    setattr(mod, attr, nn.Parameter(tensor, requires_grad=trainable))


def _safetensors_files(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise UserError(f"{index} names shards that are not in the folder: {missing}")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        other = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.isfile(os.path.join(path, f))]
        hint = f"; found {other[0]}: re-save it with save_pretrained(safe_serialization=True)" if other else ""
        raise UserError(f"{path}: no model.safetensors (or model.safetensors.index.json){hint}")
    return [single]


# ------------------------------------------------------------------------------------------------
# config.json in the Hugging Face form

_HF_ARCH = {("qwen3", "lm"): "Qwen3ForCausalLM", ("qwen3", "scalar"): "Qwen3ForSequenceClassification",
            ("llama", "lm"): "LlamaForCausalLM", ("llama", "scalar"): "LlamaForSequenceClassification"}


def config_to_hf(c: GPTConfig, dtype, tokenizer=None) -> dict:
    hf = {
        "architectures": [_HF_ARCH[(c.arch, c.head)]],
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),  # what transformers 4.x (and vLLM with it) reads
        "dtype": str(dtype).removeprefix("torch."),        # what transformers 5 writes and reads
        "use_cache": True,
    }
    if c.arch == "llama":
        hf["mlp_bias"] = False
    if c.head == "scalar":
        hf["num_labels"] = 1
    if tokenizer is not None:
        hf["eos_token_id"] = tokenizer.eos_id
        hf["pad_token_id"] = tokenizer.pad_id
        hf["bos_token_id"] = None
    else:
        hf["eos_token_id"] = None
    return hf


def config_from_hf(hf: dict, where="config.json") -> GPTConfig:
    arch = hf.get("model_type")
    if arch not in ("qwen3", "llama"):
        raise UserError(f"{where}: model_type {arch!r} is not supported (supported: qwen3, llama)")
    archs = hf.get("architectures") or []
    head = "scalar" if any(a.endswith("ForSequenceClassification") for a in archs) else "lm"
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UserError(f"{where}: biases in attention/MLP are not supported")
    if hf.get("use_sliding_window"):
        raise UserError(f"{where}: sliding-window attention (use_sliding_window) is not supported")
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    n_head = hf["num_attention_heads"]
    return GPTConfig(
        vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=hf["hidden_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        intermediate_size=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        qk_norm=(arch == "qwen3"), tie_word_embeddings=hf.get("tie_word_embeddings", arch == "qwen3"),
        arch=arch, head=head,
    )


def config_dict(c: GPTConfig) -> dict:
    return asdict(c)


def config_from_dict(d: dict) -> GPTConfig:
    names = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in d.items() if k in names})
