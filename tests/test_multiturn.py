"""Multi-turn RL rollouts with tools: what the trainer trains is the rendered conversation, tool results
are never trained on, and a rollout that runs out of tool turns ends cleanly."""

import torch

from engine import Engine
from packing import IGNORE
from rollout import training_batch
from tasks import TOOLS
from test_engine import ScriptedGPT

TOOL_SCHEMAS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def call(expression):
    return {"name": "calculator", "arguments": {"expression": expression}}


def two_call_conversation():
    return [
        {"role": "user", "content": "Sam has 12 boxes with 7 eggs in each. He breaks 5. How many are left?"},
        {"role": "assistant", "content": "", "tool_calls": [call("12 * 7")]},
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": "", "tool_calls": [call("84 - 5")]},
        {"role": "tool", "content": "79"},
        {"role": "assistant", "content": "12 * 7 = 84 eggs, 84 - 5 = 79 left.\n#### 79"},
    ]


def rollout_of(tok, msgs, max_tool_turns=4):
    """Drive the engine through the rendered conversation (a scripted model) and build the RL batch."""
    full, render_mask = tok.render_conversation(msgs, tools=TOOL_SCHEMAS)
    prompt = tok.render_for_completion(msgs[:1], tools=TOOL_SCHEMAS)
    out = Engine(ScriptedGPT(tok.vocab_size, full), tok, tools=TOOLS).generate(
        [prompt], max_new_tokens=len(full) - len(prompt), temperature=0.0, max_tool_turns=max_tool_turns)[0]
    return full, render_mask, prompt, out, training_batch([prompt], [out], tok.pad_id, "cpu")


def test_rl_rollout_with_tool_calls_rerenders_to_the_trained_ids_and_mask(tok):
    msgs = two_call_conversation()
    full, render_mask, prompt, out, batch = rollout_of(tok, msgs)
    assert out.finish_reason == "stop" and out.tool_calls == 2
    # the tools ran for real: their results are in the forced tokens, computed live
    forced_text = tok.decode([t for t, m in zip(out.tokens, out.mask) if m == 0])
    assert "84" in forced_text and "79" in forced_text
    # the trainer's inputs are exactly the rendered conversation (sampling stops before the final "\n")
    n = len(full) - 2
    assert batch.inputs[0, :n].tolist() == full[:n]
    # the trained positions, read from render_conversation's own mask: every assistant token after the
    # prompt, except the "\n" that follows each tool-calling turn's <|im_end|> (SFT trains it; in a rollout
    # the engine forces it with the tool's reply, so RL must not) and the final "\n" (never sampled)
    im_end = tok.token_to_id("<|im_end|>")
    newline_after_call = {i for i in range(len(prompt), len(full) - 1)
                          if full[i - 1] == im_end and render_mask[i] == 1}
    assert len(newline_after_call) == 2
    expected = [i - 1 for i in range(len(prompt), len(full) - 1)
                if render_mask[i] == 1 and i not in newline_after_call]
    trained = batch.mask[0].nonzero().squeeze(1).tolist()
    assert trained == expected
    # ... and their targets are the rendered tokens; everywhere else the target is IGNORE
    assert batch.targets[0, trained].tolist() == [full[i + 1] for i in trained]
    untrained = torch.ones(batch.mask.size(1), dtype=torch.bool)
    untrained[trained] = False
    assert (batch.targets[0, untrained] == IGNORE).all()


def test_tool_result_tokens_carry_mask_zero_and_log_prob_zero(tok):
    full, _, prompt, out, batch = rollout_of(tok, two_call_conversation())
    text = tok.decode(out.tokens)
    for result in ("84", "79"):  # each tool result's tokens: forced (mask 0), never trained
        start = text.index(f"<tool_response>\n{result}")
        prefix = len(tok.encode(text[:start]))
        span = range(prefix, prefix + len(tok.encode(f"<tool_response>\n{result}\n</tool_response>")))
        assert all(out.mask[i] == 0 and out.logprobs[i] == 0.0 for i in span)
        assert all(batch.mask[0, len(prompt) - 1 + i] == 0 for i in span)
    assert sum(out.mask) == int(batch.mask.sum())


def test_a_rollout_out_of_tool_turns_ends_cleanly(tok):
    """max_tool_turns=1: the second call is not run; that turn ends the completion as a normal stop."""
    msgs = two_call_conversation()
    full, _, prompt, out, batch = rollout_of(tok, msgs, max_tool_turns=1)
    assert out.tool_calls == 1 and out.finish_reason == "stop"
    assert out.tokens[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(out.tokens).count("<tool_response>") == 1  # the second call got no reply
    assert "84 - 5" in tok.decode(out.tokens) and "#### 79" not in tok.decode(out.tokens)
    assert prompt + out.tokens == full[:len(prompt) + len(out.tokens)]  # a prefix of the conversation
    assert len(out.tokens) == len(out.mask) == len(out.logprobs)
    assert batch.mask[0].sum() == sum(out.mask) and batch.mask[0, -1] == 1  # the last <|im_end|> is trained
