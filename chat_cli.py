"""
Talk to a checkpoint: what a learner wants after each stage, to see what the model just learned.

    python chat_cli.py --init out/sft/default                  # a run directory: its latest checkpoint
    python chat_cli.py --init out/rl/default --tools           # with the calculator, run mid-reply
    python chat_cli.py --init /models/Qwen3-0.6B --device cuda # any Qwen3 / Llama folder with ChatML tokens
    echo "Mia has 12 apples and buys 7 more. How many apples?" | python chat_cli.py --init out/sft/default

The conversation is kept as the token ids the model has read and written, token in, token out: each
user turn is rendered by the chat template (render_for_completion, the render every stage samples from)
and appended, the engine samples the reply (printed as it is decoded), and the reply's own tokens go
back into the conversation, never its decoded text re-tokenized (BPE does not round-trip: the model
would read words it did not write). With --tools the calculator's schema is in the system turn and a
call is executed mid-reply; its result appears inline, as the model reads it (a <tool_response> block).

Commands: /reset starts a new conversation, /quit (or the end of the input) leaves.
"""
import argparse
import sys

import torch

from checkpoint import load_hf, load_tokenizer, resolve_model_path
from common import UserError, check_flag_ranges, compute_dtype, run_main
from engine import Engine
from tasks import CALCULATOR_SCHEMA, TOOLS


def next_prompt(tok, conversation, user_text, tools=None):
    """The ids the model reads next: the conversation so far (the ids it read and wrote), then the user's
    turn and the assistant header as render_for_completion writes them. The first turn carries the
    system block (the tool schemas, with --tools)."""
    turn = [{"role": "user", "content": user_text}]
    if not conversation:
        return tok.render_for_completion(turn, tools=tools)
    return conversation + tok.render_for_completion(turn)


def close_reply(tok, prompt, completion):
    """The conversation after a reply: the prompt, the reply's tokens as sampled (tool results included),
    and the end of the assistant turn as the template writes it ("<|im_end|>\n"; only its "\n" when the
    reply stopped on <|im_end|> itself)."""
    end = tok.encode("<|im_end|>\n")
    return prompt + completion.tokens + (end[1:] if completion.tokens[-1:] == end[:1] else end)


class StreamPrinter:
    """Prints one completion's text as the engine decodes it (stop tokens are not shown)."""

    def __init__(self, tok, out=sys.stdout):
        self.tok, self.out, self.ids, self.shown = tok, out, [], 0

    def __call__(self, step_tokens):
        t = step_tokens[0]
        if t is None or t in self.tok.stop_ids:
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for its other bytes
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def finish(self):
        self.out.write(self.tok.decode(self.ids)[self.shown:])  # what was held back, if the reply ended there


def chat_turn(engine, tok, prompt, args, turn, out=sys.stdout):
    """Sample and print the reply to `prompt`; returns the completion, or None when the conversation no
    longer fits the model's context."""
    room = engine.model.config.max_seq_len - len(prompt)
    if room < 1:
        out.write(f"(the conversation is {len(prompt)} tokens, the model's context {engine.model.config.max_seq_len}: "
                  f"/reset to start again)\n")
        return None
    printer = StreamPrinter(tok, out)
    completion = engine.generate([prompt], max_new_tokens=min(args.max_new_tokens, room), temperature=args.temperature,
                                 seed=args.seed + turn, stream=printer)[0]
    printer.finish()
    out.write("\n" if completion.finish_reason == "stop" else " [cut at --max-new-tokens]\n")
    return completion


def load(path, device):
    """The chat model and tokenizer at `path`, in the compute dtype (nothing here trains)."""
    path = resolve_model_path(path, head="lm")  # a UserError naming the path when there is nothing to load
    tok = load_tokenizer(path)
    return load_hf(path, dtype=compute_dtype(device), device=device).eval(), tok


def main():
    ap = argparse.ArgumentParser(description="talk to a checkpoint (/reset, /quit)")
    ap.add_argument("--init", help="model folder or run directory (its latest checkpoint)")
    ap.add_argument("--tools", action="store_true", help="offer the calculator, executed mid-reply")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = ap.parse_args()
    check_flag_ranges(args, greedy=True)
    if not args.init:
        raise UserError("--init PATH is required: a model folder (config.json) or a run directory, e.g. "
                        "out/sft/default")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, tok = load(args.init, device)
    engine = Engine(model, tok, tools=TOOLS if args.tools else None)
    tools = [CALCULATOR_SCHEMA] if args.tools else None
    print(f"{args.init}: {model.num_params() / 1e6:.1f}M parameters on {device}"
          f"{', calculator on' if args.tools else ''}. /reset starts again, /quit leaves.", flush=True)
    conversation, turn = [], 0
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            break
        if line == "/quit":
            break
        if line == "/reset":
            conversation = []
            print("(new conversation)")
            continue
        if not line:
            continue
        prompt = next_prompt(tok, conversation, line, tools)
        completion = chat_turn(engine, tok, prompt, args, turn)
        if completion is not None:
            conversation = close_reply(tok, prompt, completion)
        turn += 1


if __name__ == "__main__":
    run_main(main)
