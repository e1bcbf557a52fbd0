"""
The GPT: the Qwen3 / Llama family shape, written so that a Hugging Face checkpoint's tensors map onto
it one to one (parameter names are exactly transformers' names, e.g. `model.layers.0.self_attn.q_proj.weight`).

    token ids -> embed_tokens -> n_layer x [RMSNorm -> grouped-query attention (QK-norm, RoPE) -> +residual
                                           RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> lm_head | score

- `forward` gives logits (inference), values (scalar head), or, with `targets`, per-token log-probs.
- `doc_ids` (B, T) marks documents packed into one row: positions restart at each document and attention
  never crosses one, each document attending as a row of its own (`PackedDocuments`: no T x T mask, and no
  work across documents). In the engine's prefill a mask isolates the left padding of a batch of prompts.
- `kv_cache` (a `KVCache`) makes decoding one token per step cost O(T) instead of O(T^2) (the engine's
  fast decode step, engine.decode_step, is the same step as one flat function over fused weights).
- `forward(idx, targets)` gives per-token log-probs (and entropies) in float32, chunk by chunk over the
  graded positions only (`vocab_logprobs`), so no (B, T, V) tensor is ever built in training; the SFT
  loss is its negation. The head's matmul runs in `head_precision` (`head_logits`), as the engine's does.
  `grad_checkpointing = True` recomputes each block's activations in backward.
- `GPTConfig.head = "scalar"` swaps the vocabulary head for a one-number head (`score`), as reward
  models and critics need; everything below the head is the same code.
- Bad shapes raise ValueError; loading and saving Hugging Face folders is checkpoint.py's, LoRA lora.py's.
  This file imports only torch.
"""
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint


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
    dtype: str | None = None         # what its weights are stored in on disk, and its checkpoints ship in
                                     # (config.json's dtype; None: as its parameters are)

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
        raise ValueError(f"unsupported rope_scaling {rs}; supported: none, llama3")
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
        # the length on the device too, which a captured decode step reads and advances (engine.decode_step)
        self.end = torch.zeros(1, dtype=torch.long, device=device)
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

    def append_at_end(self, layer: int, k, v, length: int):
        """A decode step's k, v (B, H_kv, 1, D) written at position `end` (a device index: no Python int in a
        captured step); returns the layer's first `length` positions, past `end` too (a bucket: see decode_step)."""
        self.k[layer].index_copy_(2, self.end, k)
        self.v[layer].index_copy_(2, self.end, v)
        return self.k[layer, :, :, :length], self.v[layer, :, :, :length]

    def keep_rows(self, rows):
        """Keep only these batch rows (any order), moved to the front in place, one layer at a time: dropping
        rows never allocates a second cache (the storage stays; the rows behind are left unused)."""
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
        with attention_kernels(q.device, masked=isinstance(mask, torch.Tensor)):
            if isinstance(mask, PackedDocuments):  # packed rows: each document attends within itself
                return self.o_proj(mask.attention(q, k, v))
            if T == 1 and kv_cache is not None:
                # one decode step: fold each kv head's group of query heads into the query-length axis, so
                # attention is one plain (no GQA broadcast) call; the mask (B, 1, 1, S) or None covers the group
                qg = q.reshape(B, self.n_kv_head, self.n_head // self.n_kv_head, self.head_dim)
                y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, self.n_head, 1, self.head_dim)
            elif mask is None:  # plain causal self-attention: the fast path
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:  # the engine's prefill: left-padded prompts, isolated from their padding by a mask
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def attention_kernels(device, masked=False):
    """The attention kernels SDPA may pick on CUDA, pinned (on CPU, torch's own choice: its flash kernel): flash
    where no mask is passed (training, packed documents included), memory-efficient where one is (the engine's
    prefill and decode: flash takes no mask). Never cuDNN, which torch prefers on H100 with a recent cuDNN: its
    graph cache is keyed on the shapes, so a growing KV cache, or each batch's document lengths, would build a
    new graph, 42-400 ms each (pytorch/pytorch#191576, flashinfer-ai/flashinfer#5245). runs/gpu_check.sh reads
    the kernel each call gets from a profiler trace."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION] if masked else
                       [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


@dataclass
class PackedDocuments:
    """The documents of packed rows (doc_ids), laid out for attention as batches of their own, so that no
    (T, T) mask is ever built and every attention call is plain causal: the fused kernel (flash, on CPU and
    CUDA) computes only each document's own lower triangle and never a block across two documents.

    Documents are sorted by length, longest first, and grouped: a batch is padded to its longest document,
    and a document joins it while longer than half of that (so each is padded to less than twice its length,
    and documents of one length cost exactly what they cost as rows of their own). The padding copies the
    document's last token and sits after it, where causal attention never looks back from a real token.
    Example: doc_ids [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]] (flat tokens 0..11: documents of 3, 2, 1, 4, 2
    tokens) gives batches [[6, 7, 8, 9], [0, 1, 2, 2]], [[3, 4], [10, 11]] and [[5]]; `inverse` (each token's
    place in their outputs, concatenated) is [4, 5, 6, 8, 9, 12, 0, 1, 2, 3, 10, 11]. (Not FlexAttention nor
    varlen_attn: torch 2.13 runs their backward only on CUDA, docs/speed.md.)"""
    batches: list            # per batch, (documents, padded length): the flat token index (row * T + column)
    inverse: torch.Tensor    # (B * T,): each token's row in the batches' outputs, flattened and concatenated

    @classmethod
    def from_doc_ids(cls, doc_ids):
        # the lengths decide the shapes: one copy to the host per forward, never per layer
        B, T = doc_ids.shape
        doc = doc_ids.cpu()
        starts = torch.ones(B, T, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        start = starts.flatten().nonzero().squeeze(1)  # each document's first token, as a flat index
        length = torch.diff(start, append=torch.tensor([B * T]))
        order = torch.argsort(length, descending=True, stable=True)
        batches, src, i = [], [], 0
        while i < len(order):
            longest = int(length[order[i]])
            n = int((2 * length[order[i:]] > longest).sum())  # the documents longer than half the longest
            docs, column = order[i:i + n], torch.arange(longest)
            batches.append(start[docs, None] + torch.minimum(column, length[docs, None] - 1))
            src.append(torch.where(column < length[docs, None], batches[-1], -1).flatten())  # -1: padding
            i += n
        src = torch.cat(src)
        inverse = torch.empty(B * T, dtype=torch.long)
        inverse[src[src >= 0]] = (src >= 0).nonzero().squeeze(1)
        dev = doc_ids.device
        return cls([b.to(dev, non_blocking=True) for b in batches], inverse.to(dev, non_blocking=True))

    def attention(self, q, k, v):
        """Causal attention of q (B, H, T, D) to k, v (B, H_kv, T, D) within each document: (B, T, H * D)."""
        B, H, T, D = q.shape

        def tokens(x):  # (B * T, heads, D): a view when x is a transposed (B, T, heads, D), as q, k, v are
            return x.transpose(1, 2).reshape(B * T, x.size(1), D)

        q, k, v = tokens(q), tokens(k), tokens(v)
        outs = []
        for index in self.batches:  # (documents, padded length, heads, D), then heads before positions
            y = F.scaled_dot_product_attention(*(x.index_select(0, index.flatten()).unflatten(0, index.shape)
                                                 .transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True)
            outs.append(y.transpose(1, 2).reshape(-1, H * D))
        return torch.cat(outs).index_select(0, self.inverse).view(B, T, H * D)


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


# the LM head's precision -> the dtype its weight and inputs are in (GPT.head_precision, --head-precision)
HEAD_PRECISIONS = {"float32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


def head_logits(hidden, weight, precision="float32"):
    """The LM head's logits (N, V), float32, from hidden states (N, C) and the head weight (V, C): the one
    function the engine samples from and the trainers score with, so that they compute the same numbers.
      float32  float32 inputs and products (on a GPU, CUDA cores: the default until a GPU measures the others)
      tf32     float32 inputs, products on TF32 tensor cores (inputs rounded to 10 mantissa bits, float32
               accumulation), for this matmul alone, forward and backward (CUDA; on CPU it is float32)
      bf16     bfloat16 inputs and output, float32 accumulation inside the matmul
    The logits come out float32 in every case, so every log-sum-exp over them accumulates in float32. The
    caller casts the weight to HEAD_PRECISIONS[precision] once (not per chunk or token), outside autocast."""
    h = hidden.to(HEAD_PRECISIONS[precision])
    logits = TF32Linear.apply(h, weight) if precision == "tf32" else F.linear(h, weight)
    return logits.float()


@contextmanager
def tf32_matmuls():
    """CUDA float32 matmuls on TF32 tensor cores inside the block; the process's own setting restored after."""
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


class TF32Linear(torch.autograd.Function):
    """F.linear(x, w), 2-D float32 x, each matmul under tf32_matmuls: autograd runs the backward after a block
    around the call has closed, so its two matmuls (two thirds of the head's FLOPs) would run in float32."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with tf32_matmuls():
            return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with tf32_matmuls():
            return (grad @ w if ctx.needs_input_grad[0] else None,
                    grad.t() @ x if ctx.needs_input_grad[1] else None)


def vocab_logprobs(hidden, weight, targets, *, temperature=1.0, top_k=None, top_p=None, with_entropy=False,
                   precision="float32", chunk_elements=2**26):
    """log p(targets) in float32 (B, T), 0 where targets < 0, from final hidden states (B, T, C) and a
    vocabulary head weight (V, C), without ever building the (B, T, V) logits: only the graded positions
    (targets >= 0) are computed, in chunks of about chunk_elements logits (441 tokens at a vocabulary of
    151,936: 256 MB in float32); under autograd each chunk's logits are recomputed in backward, so only
    the (N, C) hidden states are kept. The head runs in `precision` (head_logits: float32 by default, the
    weight and hidden states cast up), as the engine's does: the output head is where bf16 engine/trainer
    mismatch comes from (MiniMax-M1; prime-rl#2438), so the two always share one setting.
    with_entropy=True also returns each graded position's entropy -sum p log p under the distribution
    sampled from (temperature, top-k/top-p applied): a truncated token (logit -inf, p = 0) contributes
    0, not 0 * -inf = NaN."""
    graded = targets >= 0
    h, t = hidden[graded], targets[graded]                  # (N, C), (N,)
    step = max(1, chunk_elements // weight.size(0))
    weight = weight.to(HEAD_PRECISIONS[precision])          # once, not per chunk

    def chunk_fn(h_chunk, t_chunk):
        with torch.autocast(h_chunk.device.type, enabled=False):
            logits = process_logits(head_logits(h_chunk, weight, precision), temperature, top_k, top_p)
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
        self.head_precision = "float32"  # the LM head's matmul, here and in the engine (head_logits; --head-precision)
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
        # on one CPU thread: in a process's first parallel call, torch's float32 cos can compute the new worker
        # thread's share imprecisely (errors ~1.5e-4 at angles near 500, against ~4e-8; about one process in four
        # on 2 cores), which made two runs of the same command train differently (tests/test_model.py)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cos, sin = emb.cos(), freqs.sin()
        finally:
            torch.set_num_threads(threads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", torch.cat((-sin, sin), dim=-1), persistent=False)

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
                mask = PackedDocuments.from_doc_ids(doc_ids)
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
            kv_cache.end.fill_(kv_cache.length)
        return self.model.norm(x)

    # -- the heads ---------------------------------------------------------------------------

    def forward(self, idx, targets=None, doc_ids=None, kv_cache=None, *, temperature=1.0, top_k=None, top_p=None,
                with_entropy=False, graded_hidden=False):
        """What each head gives, from the hidden states of idx (B, T):
          head="scalar"        values (B, T), float32 (reward models, critics); with targets also their
                               log-probs through the vocabulary head (the RM's LM regularizer)
          no targets           logits (B, T, V): for inference and tests only; at a vocabulary of 151,936
                               they are 0.6 GB per 1,000 tokens in float32, so training never asks for them
          targets (B, T)       log p(targets[t] | idx[:t+1]) in float32, (B, T), 0 where targets < 0: the
                               training forward of every stage (the SFT loss is its negation), computed by
                               vocab_logprobs; with_entropy=True also returns each graded position's entropy
          targets, graded_hidden=True   the final hidden states at the graded positions (targets >= 0), (N, C),
                               for a loss over the whole vocabulary that the caller runs through lm_head in
                               chunks (chat_distill's GKD)
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
            return values, vocab_logprobs(h, head, targets, precision=self.head_precision)
        if targets is None:
            return self.lm_head(h)
        if graded_hidden:
            return h[targets >= 0]
        return self.head_logprobs(h, targets, temperature=temperature, top_k=top_k, top_p=top_p,
                                   with_entropy=with_entropy)

    def head_logprobs(self, hidden, targets, **kwargs):
        """vocab_logprobs through this model's LM head, in its head_precision (see there)."""
        return vocab_logprobs(hidden, self.lm_head.weight, targets, precision=self.head_precision, **kwargs)



def positions_from_doc_ids(doc_ids):
    """Position of each token inside its document: 0 at every document start."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx
