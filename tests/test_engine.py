"""The engine: cache == recompute, batch == alone, seeds, log-probs == trainer's, stops, tool loop token in/out."""

import pytest
import torch

from engine import Engine, run_tool_calls
from model import GPT, GPTConfig, logprobs_from_logits, process_logits
from tasks import TOOLS

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                    intermediate_size=128, max_seq_len=128)
    return GPT(cfg).eval()


def prompts_of(tok, n=5):
    qs = ["Mia has 12 apples.", "What is 3 + 4?", "Tom buys 5 pens and gives away 2. How many are left now?",
          "Hi", "Sam has 7 boxes with 6 eggs in each box. How many eggs does he have?"][:n]
    return [tok.render_for_completion([{"role": "user", "content": q}]) for q in qs]


@torch.no_grad()
def greedy_recompute(model, prompt, n, stop_ids):
    x = list(prompt)
    for _ in range(n):
        t = int(model(torch.tensor([x]))[0, -1].argmax())
        x.append(t)
        if t in stop_ids:
            break
    return x[len(prompt):]


def test_cached_greedy_equals_recompute_and_batch_equals_alone(tok, model):
    prompts = prompts_of(tok)
    assert len({len(p) for p in prompts}) > 1  # mixed lengths: left padding is exercised
    eng = Engine(model, tok)
    batched = eng.generate(prompts, max_new_tokens=24, temperature=0.0)
    for p, out in zip(prompts, batched):
        alone = eng.generate([p], max_new_tokens=24, temperature=0.0)[0]
        assert out.tokens == alone.tokens
        assert out.tokens == greedy_recompute(model, p, 24, tok.stop_ids)


def test_seeds_and_first_tokens_vary(tok, model):
    eng = Engine(model, tok)
    prompts = prompts_of(tok, 2)
    a = eng.generate(prompts, num_samples=4, max_new_tokens=8, seed=1)
    b = eng.generate(prompts, num_samples=4, max_new_tokens=8, seed=1)
    c = eng.generate(prompts, num_samples=4, max_new_tokens=8, seed=2)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in c]
    assert [o.prompt_index for o in a] == [0, 0, 0, 0, 1, 1, 1, 1]
    # the samples of one prompt are not copies of each other (nanochat#38): first tokens differ
    assert len({o.tokens[0] for o in a[:4]}) > 1 or len({o.tokens[0] for o in a[4:]}) > 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 20, None), (1.3, None, 0.9)])
def test_engine_logprobs_equal_trainer_recomputation(tok, model, temperature, top_k, top_p):
    eng = Engine(model, tok)
    prompts = prompts_of(tok, 3)
    for batch in (prompts, prompts[:1]):  # independent of batch size
        outs = eng.generate(batch, num_samples=2, max_new_tokens=16, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=3)
        for o in outs:
            seq = batch[o.prompt_index] + o.tokens
            x, y = torch.tensor([seq[:-1]]), torch.tensor([seq[1:]])
            with torch.no_grad():
                lp = logprobs_from_logits(model(x), y, temperature, top_k, top_p)[0, len(batch[o.prompt_index]) - 1:]
            torch.testing.assert_close(torch.tensor(o.logprobs), lp, atol=1e-4, rtol=0)


class ScriptedGPT(GPT):
    """A GPT whose next token is always the next token of a fixed script: drives the engine
    through an exact transcript (a tool call, then a final answer)."""

    def __init__(self, config, script):
        super().__init__(GPTConfig(**{**config.__dict__, "max_seq_len": 1024}))
        self.script = script
        self.lm_head = torch.nn.Identity()  # hidden_states below already are the logits

    def hidden_states(self, idx, doc_ids=None, kv_cache=None):
        B, T = idx.shape
        start = kv_cache.length
        kv_cache.length += T
        logits = torch.full((B, T, self.config.vocab_size), -1e4)
        for t in range(T):
            nxt = start + t + 1
            if nxt < len(self.script):
                logits[:, t, self.script[nxt]] = 0.0
        return logits

    def decode_step(self, tokens, kv_cache, weights):
        return self.forward(tokens[:, None], kv_cache=kv_cache)[:, -1]


def tool_conversation():
    return [
        {"role": "user", "content": "Mia has 12 apples and buys 7 more. How many apples?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"name": "calculator", "arguments": {"expression": "12 + 7"}}]},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": "Mia has 12 + 7 = 19 apples.\n#### 19"},
    ]


def test_tool_loop_transcript_rerenders_to_the_same_ids(tok, model):
    msgs = tool_conversation()
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    full, mask = tok.render_conversation(msgs, tools=tools)
    prompt = tok.render_for_completion(msgs[:1], tools=tools)
    assert full[:len(prompt)] == prompt
    scripted = ScriptedGPT(model.config, full)
    out = Engine(scripted, tok, tools=TOOLS).generate([prompt], max_new_tokens=len(full) - len(prompt), temperature=0.0)[0]
    assert out.finish_reason == "stop" and out.tool_calls == 1
    # token in, token out: the rollout IS the rendered conversation, with the tool result computed live
    # (the training render also trains the "\n" after the final <|im_end|>; sampling stops before it)
    assert prompt + out.tokens == full[:-1] and tok.decode(full[-1:]) == "\n"
    # what the model sampled is exactly what SFT would train (mask 1); forced tokens are the tool turn
    # and the next header (mask 0), plus the "\n" after <|im_end|>, which SFT trains but RL must force
    completion_mask = mask[len(prompt):len(full) - 1]
    forced = [i for i, m in enumerate(out.mask) if m == 0]
    assert [i for i, m in enumerate(completion_mask) if m == 0] == forced[1:]
    assert tok.decode([out.tokens[forced[0]]]) == "\n" and completion_mask[forced[0]] == 1
    assert tok.decode([out.tokens[i] for i in forced]).count("19") == 1
    assert all(out.logprobs[i] == 0.0 for i in forced)


def test_bad_tool_call_becomes_an_error_string(tok, model):
    bad = tok.render_for_completion([{"role": "user", "content": "x"}])
    call = "<tool_call>\n{not json}\n</tool_call>"
    results = run_tool_calls(call, TOOLS)
    assert len(results) == 1 and results[0].startswith("error")
    script = bad + tok.encode(call + "<|im_end|>") + tok.render_tool_responses(results) + tok.encode("ok<|im_end|>")
    scripted = ScriptedGPT(model.config, script)
    out = Engine(scripted, tok, tools=TOOLS).generate([bad], max_new_tokens=len(script), temperature=0.0)[0]
    forced_text = tok.decode([t for t, m in zip(out.tokens, out.mask) if m == 0])
    assert "error" in forced_text and out.tool_calls == 1
    assert tok.decode(out.tokens).endswith("<|im_end|>")


def test_every_stop_id_ends_a_row_and_is_not_truncation(tok, model):
    prompt = tok.render_for_completion([{"role": "user", "content": "x"}])
    for stop in sorted(tok.stop_ids):
        scripted = ScriptedGPT(model.config, prompt + tok.encode("a b c") + [stop] + tok.encode("d e f"))
        out = Engine(scripted, tok).generate([prompt], max_new_tokens=30, temperature=0.0)[0]
        assert out.finish_reason == "stop" and out.tokens[-1] == stop  # nothing after the stop
    scripted = ScriptedGPT(model.config, prompt + tok.encode(" a" * 40))
    out = Engine(scripted, tok).generate([prompt], max_new_tokens=10, temperature=0.0)[0]
    assert out.finish_reason == "length" and len(out.tokens) == 10


def test_too_long_is_a_clear_error(tok, model):
    with pytest.raises(ValueError, match="max_seq_len"):
        Engine(model, tok).generate([[1] * 100], max_new_tokens=50)


def test_run_tool_calls_never_raises():
    def boom(expression):
        raise RuntimeError("tool crashed")
    call = '<tool_call>\n{"name": "%s", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert run_tool_calls(call % "calculator", TOOLS) == ["5"]
    assert run_tool_calls(call % "nope", TOOLS)[0].startswith("error: unknown tool")
    assert "tool crashed" in run_tool_calls(call % "calculator", {"calculator": boom})[0]
    assert run_tool_calls(call % "calculator" + call % "calculator", TOOLS) == ["5", "5"]


def test_sampler_draws_from_the_processed_distribution():
    # the inverse-CDF sampler: frequencies match the softmax of the processed logits, and a token cut by
    # top-k or of probability 0 is never drawn
    from engine import sample_next
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]]).expand(40000, 6).contiguous()
    gen = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, 0.7, 4, None, gen)
    probs = process_logits(logits[:1], 0.7, 4).softmax(-1)[0]
    freq = torch.bincount(tok, minlength=6).float() / len(tok)
    assert freq[4] == 0 and freq[3] == 0  # -inf, and outside the top 4
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)  # 40k draws: a standard error <= 0.0025
    torch.testing.assert_close(lp, probs.log()[tok])
