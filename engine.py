"""
Batched KV-cache sampling on the training device, token in, token out.

    engine = Engine(model, tokenizer, tools={"calculator": calculator})
    outs = engine.generate(prompts, num_samples=8, max_new_tokens=256, temperature=1.0, seed=0)
    outs[i].tokens, outs[i].logprobs, outs[i].mask, outs[i].finish_reason

How a batch runs: the prompts are left-padded into one (P, L) batch whose padding is a document of
its own (so no prompt token ever attends to it, and positions start at 0 at each prompt's first
token), prefilled once, and the cache is repeated `num_samples` times. Then one decode step per token
for the whole batch. A row stops at any stop id (<|im_end|>, <|endoftext|>); rows that have stopped are
dropped from the batch, and the loop ends when none is left.

Tools mid-rollout: when a row ends its turn with a tool call (`</tool_call>` then <|im_end|>), the
engine parses the call, runs the tool, and forces exactly the tokens the chat renderer puts between
that <|im_end|> and the next assistant turn's text (tokenizer.render_tool_responses), one per decode
step with mask 0 and log-prob 0, then keeps sampling. The completion is therefore the very token
sequence the trainer will score: nothing is decoded to text and re-tokenized.
"""
import contextlib
import time
from dataclasses import dataclass, field

import torch

from common import autocast
from model import KVCache, process_logits
from tokenizer import parse_tool_calls


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int] = field(default_factory=list)     # everything after the prompt, forced tokens included
    logprobs: list[float] = field(default_factory=list)  # log-prob of each sampled token (0 for forced ones)
    mask: list[int] = field(default_factory=list)       # 1: sampled by the model, 0: forced (tool results)
    finish_reason: str = "length"                       # "stop" (a stop token) or "length" (max_new_tokens)
    tool_calls: int = 0


def sample_next(logits, temperature, top_k, top_p, generator):
    """Sample one token per row; return it and its log-prob under the distribution it came from.
    temperature=0 is greedy, and its log-prob is taken under the unscaled distribution."""
    if temperature == 0:
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, lp
    logp = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), -1)
    # inverse-CDF sampling: the first token whose cumulative probability exceeds u ~ U(0, total). The same
    # distribution as torch.multinomial, 5x faster at 16 rows and 12x at 512 on CPU, softmax included
    # (benchmarks/bench_engine.py). A token of probability 0 adds nothing to the CDF, so it is never the
    # first to exceed u; `last` guards the one case float rounding leaves, u rounding up to the total.
    cdf = logp.exp().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(cdf.size(0), 1, generator=generator, device=cdf.device) * total
    last = (cdf < total).sum(-1, keepdim=True)  # the last token with probability > 0
    tok = torch.minimum(torch.searchsorted(cdf, u, right=True), last).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


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
        try:
            args = call.get("arguments") or {}
            results.append(str(fn(**args) if isinstance(args, dict) else fn(args)))
        except Exception as e:  # a bad call must never crash the batch
            results.append(f"error: {type(e).__name__}: {e}")
    return results


class Engine:
    def __init__(self, model, tokenizer, tools: dict | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.tools = tools or {}

    @contextlib.contextmanager
    def prepared(self):
        """Generate calls inside share one preparation of the weights (today each reads the model directly)."""
        yield self

    @torch.inference_mode()  # as no_grad, and no autograd bookkeeping per op (~10% of a small decode step)
    def generate(self, prompts, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=None, top_p=None,
                 seed=0, max_tool_turns=4, return_stats=False):
        """Sample `num_samples` completions for each prompt (a list of token-id lists).
        Returns a list of Completion, prompt-major: the samples of prompt i are at i*num_samples + j."""
        model, tok = self.model, self.tokenizer
        cfg = model.config
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs a non-empty list of non-empty prompts")
        if any(max(p) >= cfg.vocab_size or min(p) < 0 for p in prompts):
            raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's max_seq_len ({cfg.max_seq_len}); shorten the prompt or max_new_tokens")
        was_training = model.training
        model.eval()
        device = model.device
        dtype = model.model.embed_tokens.weight.dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        t_start = time.perf_counter()

        # prefill the distinct prompts once, left-padded; padding is document 0, the prompt document 1
        P = len(prompts)
        ids = torch.full((P, longest), tok.pad_id, dtype=torch.long)
        doc = torch.zeros((P, longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p)
            doc[i, longest - len(p):] = 1
        cache = KVCache(cfg, P, longest + max_new_tokens, device, dtype)
        with autocast(device):
            # only the last position's logits are needed: the head on all of them is ~12% of a prefill
            logits = model.lm_head(model.hidden_states(ids.to(device), doc_ids=doc.to(device), kv_cache=cache)[:, -1])
        weights = model.decode_weights()  # fused copies for decode_step, from the weights as they are now
        if num_samples > 1:
            cache.repeat_rows(num_samples)
            logits = logits.repeat_interleave(num_samples, dim=0)

        outs = [Completion(prompt_index=i // num_samples) for i in range(P * num_samples)]
        rows = list(range(len(outs)))       # which completion each live batch row belongs to
        forced = {r: [] for r in rows}      # tokens still to force into each completion
        turn_start = {r: 0 for r in rows}   # where the current assistant turn began in the completion
        stop_ids = tok.stop_ids
        for step in range(max_new_tokens):
            next_tok, next_lp = sample_next(logits, temperature, top_k, top_p, gen)
            next_tok, next_lp = next_tok.tolist(), next_lp.tolist()
            keep = []
            for b, r in enumerate(rows):
                out = outs[r]
                if forced[r]:
                    t, lp, m = forced[r].pop(0), 0.0, 0
                    if not forced[r]:
                        turn_start[r] = len(out.tokens) + 1
                else:
                    t, lp, m = next_tok[b], next_lp[b], 1
                out.tokens.append(t)
                out.logprobs.append(lp)
                out.mask.append(m)
                next_tok[b] = t
                if m == 1 and t in stop_ids:
                    turn = tok.decode(out.tokens[turn_start[r]:-1])
                    if self.tools and turn.rstrip().endswith("</tool_call>") and out.tool_calls < max_tool_turns:
                        out.tool_calls += 1
                        forced[r] = tok.render_tool_responses(run_tool_calls(turn, self.tools))
                    else:
                        out.finish_reason = "stop"
                        continue
                keep.append(b)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) < len(rows):  # drop finished rows so the batch only pays for live ones
                cache.keep_rows(torch.tensor(keep, device=device))
                rows = [rows[b] for b in keep]
                next_tok = [next_tok[b] for b in keep]
            with autocast(device):
                logits = model.decode_step(torch.tensor(next_tok, device=device), cache, weights)
        model.train(was_training)
        if return_stats:
            new_tokens = sum(len(o.tokens) for o in outs)
            return outs, {"new_tokens": new_tokens, "seconds": time.perf_counter() - t_start}
        return outs

