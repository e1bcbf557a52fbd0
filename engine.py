"""
Batched KV-cache sampling on the training device, token in, token out.

    engine = Engine(model, tokenizer, tools={"calculator": calculator})
    outs = engine.generate(prompts, num_samples=8, max_new_tokens=256, temperature=1.0, seed=0)
    outs[i].tokens, outs[i].logprobs, outs[i].mask, outs[i].finish_reason

The weights it samples with. `Engine.prepare()` reads the model once, parameter by parameter through
`_full_weight`, into everything the decode loop uses: a plain (unwrapped) model in the compute dtype
(bfloat16 on CUDA, float32 on CPU; `Engine(..., dtype=)` overrides), the fused decode weights of
`decode_weights`, and the LM head in the dtype of the model's head precision (`GPT.head_precision`:
float32 by default). Master weights already plain and in that dtype (float32 on CPU) are shared, not
copied. Nothing is cast while decoding and no autocast is entered: the KV cache is in the compute dtype
too. The logits sampled from are `model.head_logits(h, head, model.head_precision)`, the function and the
setting with which the trainer computes its log-probs: the output head is the main source of
sampler/trainer mismatch in bfloat16 (MiniMax-M1, arXiv:2506.13585; PrimeIntellect-ai/prime-rl#2438).

A LoRA model (lora.LoRALinear) is sampled with its adapters unmerged: the frozen base, already in the
compute dtype, is shared; the adapters are cast to it, and decode_step adds each fused layer's low-rank
update B(A x) after its matmul (decode_weights). A bfloat16 merge W + (alpha/r) B A would round away
every update element below half a ulp of W, which the trainer, applying them unmerged, does see.

`generate` prepares on every call, so it always samples from the weights as they are now. A loop that
calls it several times on unchanged weights (dynamic sampling's extra rounds) prepares once for all:

    with engine.prepared():
        for round in range(rounds):
            outs = engine.generate(...)

Inside such a block, generate raises if a weight changed since (an optimizer step, a load): it never
samples from stale copies silently.

How a batch runs. The P distinct prompts are left-padded into one (P, L) batch whose padding is a document
of its own (so no prompt token ever attends to it, and positions start at 0 at each prompt's first token)
and prefilled once, into a cache of P * num_samples rows allocated once: each prompt's keys and values
go straight to its num_samples rows. Then one decode step per token for the whole batch. A row stops at
any stop id (<|im_end|>, <|endoftext|>); a stopped row stays in the batch, masked, its outputs ignored,
and the batch is compacted in place when the live rows fall to half or fewer (compiled: when they fit a
smaller power of two, so that the batch sizes are the prompts' rows, then powers of two, each a shape the
compiled step captures once): at most log2(rows) compactions, each moving at most half the cache, and never
a second cache. Tokens, log-probs, masks and stop flags live on the device in preallocated buffers; the host
reads one small tensor (how many rows are live, whether one called a tool) every `check_every` steps (every
step on CPU, where it costs nothing, or with tools or a stream), and everything else once, at the end.
Engine(compile=True) runs the decode step compiled (torch.compile, mode "reduce-overhead": CUDA graphs on a
GPU), off by default until runs/gpu_check.sh shows it equal and faster.

Sampling is exact at any vocabulary size: an inverse CDF in float64 (see sample_next).

Tools mid-rollout: when a row ends its turn with a tool call (the token before its <|im_end|> is
`</tool_call>`, one special token in our tokenizer and in Qwen3's), the host decodes that turn, runs the
tool, and queues exactly the tokens the chat renderer puts between that <|im_end|> and the next
assistant turn's text (tokenizer.render_tool_responses); they are fed one per decode step with mask 0
and log-prob 0, then the row samples again. The completion is therefore the very token sequence the
trainer will score: nothing is decoded to text and re-tokenized.
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from common import compute_dtype, unwrap
from lora import LoRALinear, copy_lora_layers, fuse_projections, lora_layers, stacked_rows
from model import GPT, HEAD_PRECISIONS, KVCache, apply_rope, attention_kernels, head_logits, process_logits, rms_norm
from tokenizer import parse_tool_calls


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int] = field(default_factory=list)     # everything after the prompt, forced tokens included
    logprobs: list[float] = field(default_factory=list)  # log-prob of each sampled token (0 for forced ones)
    mask: list[int] = field(default_factory=list)       # 1: sampled by the model, 0: forced (tool results)
    finish_reason: str = "length"                       # "stop" (a stop token) or "length" (max_new_tokens)
    tool_calls: int = 0                                 # tool-calling turns the engine answered
    tool_errors: int = 0                                # tool results that were errors (malformed call, bad expression)


def sample_next(logits, temperature, top_k, top_p, uniform):
    """Sample from each row of logits (B, V), given uniform draws in [0, 1), float64: uniform (B,) draws
    one token per row, (B, k) draws k per row from the same distribution. Returns the tokens and their
    log-probs under the distribution they came from, shaped as uniform. temperature=0 is greedy (one
    token per row, uniform unused), its log-prob taken under the unscaled distribution.

    Inverse CDF: the first token whose cumulative probability exceeds u * total. The same distribution as
    torch.multinomial, 5x faster at 16 rows and 12x at 512 on CPU (benchmarks/bench_engine.py). The sum
    runs in float64: a float32 CDF near 1 moves in steps of 6e-8, so a token below ~3e-8 gets an empty
    interval and can never be drawn (with token 0 at 0.997 and 151,935 tokens at 1e-8 to 3e-8, only
    47,819 of the 151,936 could be; tests/test_engine.py draws every one)."""
    if temperature == 0:
        logits = logits.float()
        tok = logits.argmax(-1)
        return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    logits = process_logits(logits, temperature, top_k, top_p)
    peak = logits.amax(-1, keepdim=True)
    # unnormalized probabilities in place, then one float64 copy summed in place: at 64 rows x 151,936
    # tokens the sampler's temporaries are 3x the logits
    cdf = (logits - peak).exp_().double().cumsum_(-1)
    total = cdf[:, -1:]
    # u * total kept strictly below the total: the first index whose CDF exceeds it then always exists, and
    # a token of probability 0 (cut by top-k / top-p) is never that index, its CDF being the one before it
    target = torch.minimum(uniform.view(logits.size(0), -1) * total, torch.nextafter(total, torch.zeros_like(total)))
    tok = torch.searchsorted(cdf, target, right=True)
    # its log-prob as the trainer computes it, logit - logsumexp (model.vocab_logprobs), the logsumexp
    # from the float64 sum (float32 log_softmax on CPU sums 151,936 exponentials in float32: off by 4e-4)
    logsumexp = peak + total.log().float()
    return tok.view(uniform.shape), (logits.gather(-1, tok) - logsumexp).view(uniform.shape)


def run_tool_calls(text: str, tools: dict) -> list[str]:
    """Run every call in an assistant turn; any failure becomes an error string for the model."""
    try:
        calls = parse_tool_calls(text)
    except ValueError as e:
        return [f"error: {e}"]
    results = []
    for call in calls:
        fn = tools.get(call["name"])
        if fn is None:
            results.append(f"error: unknown tool {call['name']!r}; available: {sorted(tools)}")
            continue
        try:  # parse_tool_calls hands the arguments as a dict
            results.append(str(fn(**call["arguments"])))
        except Exception as e:  # a bad call must never crash the batch
            results.append(f"error: {type(e).__name__}: {e}")
    return results


# ------------------------------------------------------------------------------------------------
# One decode step, fast: the module forward's numbers as one flat function over fused weights

def decode_weights(model, head=None):
    """The weights decode_step reads: per layer, fused, the q, k and v projections as one matrix, gate
    and up as one, the q/k-norm gains as one (H + H_kv, D) table, attention's 1/sqrt(D) folded into q
    (into q's norm gain when there is one: the norm would undo it on the weights); and `head`, the
    (V, C) matrix the logits come from, in the dtype of this model's head_precision (default: this
    model's lm_head, cast; the engine passes the master weights' own), with that precision. A copy in
    this model's dtype: build it again whenever the weights change (Engine.prepare does: one pass over them)."""
    if model.config.head != "lm":
        raise ValueError("decode_step needs the language-model head")
    scale = model.config.head_dim ** -0.5
    layers = []
    for layer in model.model.layers:
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
            low_rank = (fused_low_rank([a.q_proj, a.k_proj, a.v_proj], None if qk_gain is not None else [scale, 1, 1]),
                        fused_low_rank([a.o_proj]), fused_low_rank([mlp.gate_proj, mlp.up_proj]),
                        fused_low_rank([mlp.down_proj]))
        # o and down are applied as addmm(residual, y, W.T): the residual add rides in the matmul
        layers.append((layer.input_layernorm.weight, stacked_rows([w_q, a.k_proj.weight, a.v_proj.weight]), qk_gain,
                       a.o_proj.weight.t(), layer.post_attention_layernorm.weight,
                       stacked_rows([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight.t(), low_rank))
    precision = model.head_precision
    head = model.lm_head.weight.to(HEAD_PRECISIONS[precision]) if head is None else head
    return {"layers": layers, "head": head, "head_precision": precision}

def length_bucket(length, max_len):
    """The attention length a decode step at cache length `length` reads: the next power of two (at most max_len),
    so that the step's shapes change only when the cache crosses one, and a captured step serves a whole bucket."""
    return min(max_len, 1 << (length - 1).bit_length())


def decode_step(model, tokens, kv_cache, weights, *, bucketed=False, step=None):
    """Float32 logits (B, V) of one new token per row (tokens: (B,)), appended to kv_cache: the numbers
    of head_logits(hidden_states(tokens[:, None], kv_cache=kv_cache)[:, -1], weights["head"], precision), but
    as one flat function over the fused weights of decode_weights, with q and k normed and rotated
    together and each residual add inside its matmul. A small model's decode step is mostly per-op
    overhead, and this runs about half the ops of the module forward (see benchmarks/bench_engine.py).
    Everything runs in the dtype of this model's weights (the KV cache's too); the head in its precision.
    The step itself (fused_decode, or `step`, its compiled form) reads the cache length from the device and does
    no host work; bucketed=True attends over a whole length bucket (length_bucket), so that its shapes stay the
    same for every length in it: one captured graph per (rows, bucket) (Engine(compile=True))."""
    t = kv_cache.length
    if not 0 < t < kv_cache.max_len:
        raise ValueError(f"decode_step needs a prefilled KV cache with room: length {t}, max_len {kv_cache.max_len}")
    length = length_bucket(t + 1, kv_cache.max_len) if bucketed else t + 1
    logits = (step or fused_decode)(model, tokens, kv_cache, weights, length)
    kv_cache.length += 1
    return logits


def fused_decode(model, tokens, kv_cache, weights, length):
    """decode_step's work, attention over the cache's first `length` positions (the new token's included)."""
    c = model.config
    B, H, Hk, D, eps = tokens.size(0), c.n_head, c.n_kv_head, c.head_dim, c.rms_norm_eps
    end = kv_cache.end  # the new token's cache position, on the device
    doc = kv_cache.doc.index_select(1, end - 1)  # (B, 1): the new token continues its row's last document
    kv_cache.doc.index_copy_(1, end, doc)
    # its own document up to itself: left padding and the bucket's empty positions past it are masked
    mask = ((kv_cache.doc[:, :length] == doc) & (torch.arange(length, device=end.device) <= end))[:, None, None]
    pos = kv_cache.next_pos
    dtype = model.model.embed_tokens.weight.dtype
    cos = model.rope_cos[pos][:, None].to(dtype)  # (B, 1, D): the same for every head
    sin = model.rope_signed_sin[pos][:, None].to(dtype)
    x = model.model.embed_tokens(tokens)  # (B, C)
    for i, (ln_attn, w_qkv, qk_gain, w_o_t, ln_mlp, w_gate_up, w_down_t, low_rank) in enumerate(weights["layers"]):
        lr_qkv, lr_o, lr_gate_up, lr_down = low_rank or (None,) * 4  # LoRA adapters, unmerged (or none)
        h = rms_norm(x, ln_attn, eps)
        qkv = add_low_rank(F.linear(h, w_qkv), h, lr_qkv).view(B, H + 2 * Hk, D)
        qk, v = qkv[:, :H + Hk], qkv[:, H + Hk:]
        if qk_gain is not None:  # the gain differs per head: normalize, then one (H + Hk, D) multiply
            qk = rms_norm(qk, None, eps) * qk_gain
        qk = apply_rope(qk, cos, sin)
        k_all, v_all = kv_cache.append_at_end(i, qk[:, H:, None], v[:, :, None], length)  # (B, Hk, length, D)
        # each kv head's group of query heads (pre-scaled) as its query axis: one plain attention call,
        # which keeps the scores in float32 in bfloat16 too
        q = qk[:, :H].reshape(B, Hk, H // Hk, D)
        with attention_kernels(q.device, masked=True):
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=1.0)
        y = y.reshape(B, H * D)
        x = add_low_rank(torch.addmm(x, y, w_o_t), y, lr_o)
        h = rms_norm(x, ln_mlp, eps)
        gate, up = add_low_rank(F.linear(h, w_gate_up), h, lr_gate_up).chunk(2, dim=-1)
        y = F.silu(gate) * up
        x = add_low_rank(torch.addmm(x, y, w_down_t), y, lr_down)
    end.add_(1)
    pos.add_(1)
    return head_logits(rms_norm(x, model.model.norm.weight, eps), weights["head"], weights["head_precision"])


def fused_low_rank(linears, row_scale=None):
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


def add_low_rank(y, x, pair):
    """y + B(A(x)): a fused low-rank update (None: nothing to add)."""
    return y if pair is None else y + F.linear(F.linear(x, pair[0]), pair[1])


# ------------------------------------------------------------------------------------------------
# The weights the engine decodes with

def _full_weight(p):
    """A parameter as one whole, plain tensor. The single place the engine reads a weight: a sharded
    parameter (FSDP2's DTensor) is gathered here, one parameter at a time (a collective: every rank
    prepares at the same moment, at the start of a rollout phase, never once per decoded token)."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def fsdp_param_dtype(model):
    """The dtype in which FSDP2 gathers a sharded model's parameters for its forward (its MixedPrecisionPolicy's
    param_dtype: bf16 on CUDA, common.shard_model), or None: not sharded, or gathered as stored."""
    model = unwrap(model)
    return model._get_fsdp_state()._mp_policy.param_dtype if isinstance(model, FSDPModule) else None


@dataclass
class Prepared:
    """What generate decodes with (Engine.prepare)."""
    model: GPT              # plain, in the compute dtype: the prefill runs its forward, decode decode_step
    weights: dict           # decode_weights(model, head): the fused per-layer weights and the head
    head: torch.Tensor      # (V, C) in the head precision's dtype: logits = head_logits(h, head, precision)
    versions: tuple         # the master parameters' version counters at prepare time (a change = an update)


def _tensors(nested):
    """Every tensor in nested tuples and lists (decode_weights' layers)."""
    if isinstance(nested, torch.Tensor):
        return [nested]
    if isinstance(nested, (tuple, list)):
        return [t for item in nested for t in _tensors(item)]
    return []  # None: an absent gain or adapter


def _versions(model):
    return tuple(0 if p.is_inference() else p._version for p in model.parameters())  # inference tensors: no counter


def _write_back(results, rows, **state):
    """The completion-ordered results, given the batch's state (batch row b holds completion rows[b]).
    None before the first compaction: the batch is then in completion order, and its buffers are them."""
    if results is None:
        return dict(state)
    for name, value in state.items():
        results[name][rows] = value
    return results


class Engine:
    compact = True  # finished rows leave the batch (see generate; False: never, they stay masked to the end)

    def __init__(self, model, tokenizer, tools: dict | None = None, dtype: torch.dtype | None = None,
                 compile: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.tools = tools or {}
        # the dtype of the weights, the residual stream and the KV cache: as the trainer's forward computes, which
        # under FSDP2 is its parameters' gathered dtype (bf16 on CUDA), else the compute dtype
        self.dtype = dtype or fsdp_param_dtype(model) or compute_dtype(unwrap(model).device)
        # how often the host reads the batch's state (a device sync): on CPU every step, where it costs nothing
        self.check_every = 1 if unwrap(model).device.type == "cpu" else 8
        self.compile = compile
        # batch sizes and cache lengths in powers of two: each shape a graph the compiled step captures once. Eager,
        # exact shapes (no padding computed), the batch compacted when half of it or less is live
        self.buckets = compile
        self._compiled = None  # fused_decode compiled, built at the first generate (compile=True)
        self._prepared = None
        self._frozen = None  # a snapshot's weights, fixed (Engine.snapshot)
        self.call_end_id = None
        if self.tools:
            self.call_end_id = tokenizer.token_to_id("</tool_call>")
            if self.call_end_id is None or tokenizer.encode("</tool_call>") != [self.call_end_id]:
                raise ValueError("tools need `</tool_call>` as one special token in the tokenizer (it is in "
                                 "Qwen3's and in ours): the engine detects a tool call by it")

    def _compiled_step(self, prep, cache):
        """fused_decode compiled (compile=True; else None), its weights and cache marked as static addresses:
        a CUDA graph then reads them in place instead of copying them into its own inputs at every replay."""
        if not self.compile:
            return None
        if self._compiled is None:
            # one graph per (rows, length bucket) met: more than dynamo's default 8 in a long rollout
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(fused_decode, mode="reduce-overhead", fullgraph=True, dynamic=False)
        for t in [*prep.model.parameters(), *prep.model.buffers(), prep.head, *_tensors(prep.weights["layers"])]:
            torch._dynamo.mark_static_address(t)
        self._mark_static(cache)
        return self._compiled

    def _mark_static(self, cache):
        """The cache's tensors as static addresses for the compiled step (after a prefill or a compaction)."""
        if self.compile:
            for t in (cache.k, cache.v, cache.doc, cache.end, cache.next_pos):
                torch._dynamo.mark_static_address(t)

    @torch.no_grad()
    def prepare(self, copy=False) -> Prepared:
        """Read the model's weights once into what the engine decodes with (see the module docstring).
        copy=True copies them even where they could be shared (a snapshot must not move with training)."""
        master = unwrap(self.model)
        params = dict(master.named_parameters())  # a tied head is listed once, as the embedding
        adapters = lora_layers(master)
        if not copy and all(type(p.detach()) is torch.Tensor and p.dtype == self.dtype for p in params.values()) \
                and not any(isinstance(m.dropout, nn.Dropout) for m in adapters):
            model = master  # already plain and in the compute dtype (float32 on CPU): share, copy nothing
        else:
            with torch.device("meta"):
                model = GPT(master.config)
            if adapters:  # LoRA: the adapters too, unmerged, in the compute dtype (see decode_weights), no dropout
                copy_lora_layers(master, model)
            for name, p in params.items():
                if name == "lm_head.weight":
                    continue  # an untied head is only ever used in its precision (below): no compute-dtype copy
                module_name, _, attr = name.rpartition(".")
                # a snapshot copies even a weight already in the compute dtype, where .to() would return the
                # master's own tensor and the optimizer's in-place updates would reach the sampler
                w = _full_weight(p).to(self.dtype, copy=copy)
                setattr(model.get_submodule(module_name), attr, nn.Parameter(w, requires_grad=False))
            if master.config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
            fuse_projections(model)  # q/k/v and gate/up as one tensor each: decode_weights then copies nothing
            # the RoPE tables in the compute dtype too, so no step casts them
            model.rope_cos = master.rope_cos.to(self.dtype)
            model.rope_signed_sin = master.rope_signed_sin.to(self.dtype)
            model.head_precision = master.head_precision  # the trainer's: one function for both (head_logits)
        # the head as the trainer's forward sees it (under FSDP2 gathered in its param dtype, rounded), then in the
        # head precision's dtype; no copy when the master is already that (float32, on CPU or for the float32 head)
        head = _full_weight(master.lm_head.weight).to(fsdp_param_dtype(master) or master.lm_head.weight.dtype)
        head = head.to(HEAD_PRECISIONS[master.head_precision])
        if copy and head.data_ptr() == master.lm_head.weight.data_ptr():
            head = head.clone()
        return Prepared(model=model, weights=decode_weights(model, head), head=head, versions=_versions(master))

    def snapshot(self) -> "Engine":
        """An engine over a frozen copy of the weights as they are now: it samples while the trainer moves on
        (one-step-off-policy RL), or on purpose k steps behind (chat_rl.py --staleness). A collective under
        FSDP2, like prepare: every rank takes it at the same moment."""
        frozen = Engine(self.model, self.tokenizer, self.tools, self.dtype, self.compile)
        frozen._frozen = self.prepare(copy=True)
        return frozen

    @contextmanager
    def prepared(self):
        """Prepare once for every generate inside the block (the weights must not change inside it)."""
        if self._frozen is not None:  # a snapshot is prepared once and for all
            yield self
            return
        self._prepared = self.prepare()
        try:
            yield self
        finally:
            self._prepared = None

    @torch.inference_mode()  # as no_grad, and no autograd bookkeeping per op (~10% of a small decode step)
    @torch.autocast("cuda", enabled=False)  # the weights are already in the compute dtype, and the head must
    @torch.autocast("cpu", enabled=False)   # stay float32, whatever the caller's context
    def generate(self, prompts, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=None, top_p=None,
                 seed=0, max_tool_turns=4, return_stats=False, stream=None):
        """Sample `num_samples` completions for each prompt (a list of token-id lists).
        Returns a list of Completion, prompt-major: the samples of prompt i are at i*num_samples + j.
        stream: called after every step with the token each completion got at that step (a list in
        completion order; None for a completion that had already ended), e.g. to print text as it grows."""
        tok, cfg = self.tokenizer, unwrap(self.model).config
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs a non-empty list of non-empty prompts")
        if any(max(p) >= cfg.vocab_size or min(p) < 0 for p in prompts):
            raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's max_seq_len ({cfg.max_seq_len}); shorten the prompt or max_new_tokens")
        t_start = time.perf_counter()
        prep = self._frozen or self._prepared or self.prepare()  # a snapshot's, the block's, or prepared now
        if prep is self._prepared and _versions(unwrap(self.model)) != prep.versions:
            raise RuntimeError("the model's weights changed inside `with engine.prepared():`; the engine would "
                               "sample from stale copies. Update the weights outside the block, or enter it again")
        model, device = prep.model, prep.model.device
        gen = torch.Generator(device=device).manual_seed(seed)
        P, N = len(prompts), num_samples
        R = P * N  # completion r is sample r % N of prompt r // N

        # prefill the distinct prompts once, left-padded (padding is document 0, the prompt document 1),
        # into a cache of R rows: each prompt's keys and values go to its N rows
        ids = torch.full((P, longest), tok.pad_id, dtype=torch.long)
        doc = torch.zeros((P, longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p)
            doc[i, longest - len(p):] = 1
        cache = KVCache(cfg, R, longest + max_new_tokens, device, self.dtype)
        compiled = self._compiled_step(prep, cache)
        # only the last position's logits are needed: the head on all of them is ~12% of a prefill
        h = model.hidden_states(ids.to(device), doc_ids=doc.to(device), kv_cache=cache)[:, -1]
        logits = head_logits(h.repeat_interleave(N, dim=0), prep.head, model.head_precision)

        # the batch's state, on the device: batch row b holds completion rows[b] (the identity until the
        # first compaction, when these buffers are also the completion-ordered results)
        rows = torch.arange(R, device=device)
        live = torch.ones(R, dtype=torch.bool, device=device)
        length = torch.zeros(R, dtype=torch.long, device=device)  # tokens so far, the stop token included
        out_tokens = torch.zeros(R, max_new_tokens, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(R, max_new_tokens, dtype=torch.float32, device=device)
        out_sampled = torch.ones(R, max_new_tokens, dtype=torch.bool, device=device)  # 0: forced
        prev = torch.full((R,), -1, dtype=torch.long, device=device)  # each row's previous token
        forced = torch.zeros(R, 0, dtype=torch.long, device=device)   # tool-result tokens queued per row,
        forced_len = torch.zeros(R, dtype=torch.long, device=device)  # how many,
        forced_at = torch.zeros(R, dtype=torch.long, device=device)   # and how many of them already fed
        forcing_until = -1        # the last step at which a queued token may still be fed (host-side)
        tool_calls = [0] * R      # per completion (host-side)
        tool_errors = [0] * R     # per completion: tool results that were an error
        turn_start = [0] * R      # where each completion's current assistant turn began
        stop_ids = torch.tensor(sorted(tok.stop_ids), dtype=torch.long, device=device)
        results, n_batch, compactions = None, R, 0
        for step in range(max_new_tokens):
            # one uniform per completion, whatever the batch layout: compaction never changes a sample
            uniform = torch.rand(R, generator=gen, dtype=torch.float64, device=device)
            next_tok, next_lp = sample_next(logits, temperature, top_k, top_p,
                                            uniform if n_batch == R else uniform[rows])
            sampled = None
            if step <= forcing_until:  # a queued tool result replaces the sample (mask 0, log-prob 0)
                sampled = forced_at >= forced_len
                queued = forced.gather(1, forced_at.clamp(max=forced.size(1) - 1)[:, None]).squeeze(1)
                next_tok = torch.where(sampled, next_tok, queued)
                next_lp = next_lp.masked_fill(~sampled, 0.0)
                forced_at += ~sampled
                out_sampled[:, step] = sampled
            out_tokens[:, step] = next_tok
            out_logprobs[:, step] = next_lp
            ends = live & torch.isin(next_tok, stop_ids)
            if sampled is not None:
                ends &= sampled
            calls = None
            if self.tools:  # a turn that ends right after </tool_call> is a tool call, not the end
                calls = ends & (prev == self.call_end_id)
                ends &= ~calls
            shown = torch.where(live, next_tok, -1) if stream is not None else None
            length += live
            live &= ~ends
            prev = next_tok

            last = step == max_new_tokens - 1
            if not (self.tools or stream is not None or last or (step + 1) % self.check_every == 0):
                logits = decode_step(model, next_tok, cache, prep.weights, bucketed=self.buckets, step=compiled)
                continue
            # the host's read of the batch, a device sync (every check_every steps, or every step with tools or a
            # stream): how many rows are live, how many called a tool, and (streaming) what each completion got
            report = live.sum()[None] if calls is None else torch.stack([live.sum(), calls.sum()])
            if stream is not None:
                step_tokens = torch.full((R,), -1, dtype=torch.long, device=device)
                step_tokens[rows] = shown
                report = torch.cat([report, step_tokens])
            report = report.tolist()
            n_live, n_calls = report[0], report[1] if calls is not None else 0

            if n_calls:  # the host reads the calling turns, runs the tools, and queues their results
                calling = calls.nonzero().squeeze(1).tolist()
                queue = {}
                for b, r, history in zip(calling, rows[calling].tolist(), out_tokens[calling, :step + 1].tolist()):
                    if tool_calls[r] >= max_tool_turns:
                        live[b] = False  # out of tool turns: this turn ends the completion
                        n_live -= 1
                        continue
                    tool_calls[r] += 1
                    replies = run_tool_calls(tok.decode(history[turn_start[r]:-1]), self.tools)
                    tool_errors[r] += sum(x.startswith("error:") for x in replies)
                    queue[b] = tok.render_tool_responses(replies)
                    turn_start[r] = step + 1 + len(queue[b])
                    forcing_until = max(forcing_until, step + len(queue[b]))
                if queue:
                    forced = F.pad(forced, (0, max(0, max(map(len, queue.values())) - forced.size(1))))
                    for b, q in queue.items():
                        forced[b, :len(q)] = torch.tensor(q, device=device)
                        forced_len[b], forced_at[b] = len(q), 0
            if stream is not None:
                stream([t if t >= 0 else None for t in report[-R:]])
            if n_live == 0 or last:
                break
            if self.buckets:  # the live rows' bucket, a power of two (filled up with finished rows)
                size = 1 << (n_live - 1).bit_length()
            else:  # the live rows, once they are half the batch or fewer
                size = n_live if 2 * n_live <= n_batch else n_batch
            if self.compact and size < n_batch:
                # move the rows kept to the front of the cache, so the batch only pays for them
                results = _write_back(results, rows, live=live, length=length, tokens=out_tokens,
                                      logprobs=out_logprobs, sampled=out_sampled)
                keep = torch.sort((~live).to(torch.uint8), stable=True).indices[:size]  # live first: no sync
                cache.keep_rows(keep)
                rows, live, length, prev = rows[keep], live[keep], length[keep], prev[keep]
                out_tokens, out_logprobs, out_sampled = out_tokens[keep], out_logprobs[keep], out_sampled[keep]
                forced, forced_len, forced_at = forced[keep], forced_len[keep], forced_at[keep]
                next_tok, n_batch, compactions = next_tok[keep], size, compactions + 1
                self._mark_static(cache)
            logits = decode_step(model, next_tok, cache, prep.weights, bucketed=self.buckets, step=compiled)
        results = _write_back(results, rows, live=live, length=length, tokens=out_tokens,
                              logprobs=out_logprobs, sampled=out_sampled)

        # the one copy of the results to the host
        live, length = results["live"].tolist(), results["length"].tolist()
        tokens, logprobs, sampled = (results[k].tolist() for k in ("tokens", "logprobs", "sampled"))
        outs = [Completion(prompt_index=r // N, tokens=tokens[r][:length[r]], logprobs=logprobs[r][:length[r]],
                           mask=[int(m) for m in sampled[r][:length[r]]], finish_reason="length" if live[r] else "stop",
                           tool_calls=tool_calls[r], tool_errors=tool_errors[r]) for r in range(R)]
        if return_stats:
            new_tokens = sum(len(o.tokens) for o in outs)
            return outs, {"new_tokens": new_tokens, "seconds": time.perf_counter() - t_start,
                          "compactions": compactions}
        return outs
