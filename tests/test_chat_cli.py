"""chat_cli.py: driven through standard input, replies streamed, the history re-rendered token in, token out,
tool calls run mid-reply, and a user's mistake ends in one line with exit code 2."""
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, trainers

from chat_cli import chat_turn, close_reply, next_prompt
from engine import Engine
from model import GPT, GPTConfig
from tasks import CALCULATOR_SCHEMA, TOOLS
from test_engine import ScriptedGPT, tool_conversation
from checkpoint import load_hf, save_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def chat_folder(tok, tmp_path_factory):
    """A tiny random chat model whose replies depend on the context (peaked: a large final norm gain)."""
    path = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                      intermediate_size=64, max_seq_len=512))
    with torch.no_grad():
        m.model.norm.weight.fill_(5.0)
    save_hf(m, str(path), tok)
    return str(path)


def run_cli(*args, stdin=""):
    return subprocess.run([sys.executable, os.path.join(REPO, "chat_cli.py"), *args], input=stdin, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def engine_reply(model, tok, prompt, n, seed):
    """The engine's reply at temperature 1 to these ids, and how the CLI prints it (no stop tokens)."""
    out = Engine(model, tok).generate([prompt], max_new_tokens=n, temperature=1.0, seed=seed)[0]
    shown = tok.decode([t for t in out.tokens if t not in tok.stop_ids])
    return out, shown + ("\n" if out.finish_reason == "stop" else " [cut at --max-new-tokens]\n")


def test_multi_turn_conversation_through_stdin(tok, chat_folder):
    r = run_cli("--init", chat_folder, "--temperature", "1", "--max-new-tokens", "12", "--seed", "3",
                stdin="What is 3 + 4?\nAnd 5 + 6?\n\n/reset\nAnd 5 + 6?\n/quit\nnever read\n")
    assert r.returncode == 0, r.stderr
    model = load_hf(chat_folder).eval()
    first_q, second_q = ({"role": "user", "content": q} for q in ("What is 3 + 4?", "And 5 + 6?"))
    first_prompt = tok.render_for_completion([first_q])
    first, first_shown = engine_reply(model, tok, first_prompt, 12, seed=3)  # turn i samples with seed + i
    # the second turn reads the first as it was read and sampled, token for token, then the new question
    # and the assistant header as the template renders them after a finished assistant turn
    newline = tok.encode("<|im_end|>\n")[1:]
    closed = first.tokens + (newline if first.finish_reason == "stop" else tok.encode("<|im_end|>\n"))
    second_prompt = first_prompt + closed + tok.render_for_completion([second_q])
    _, second_shown = engine_reply(model, tok, second_prompt, 12, seed=4)
    assert second_shown != engine_reply(model, tok, tok.render_for_completion([second_q]), 12, seed=4)[1]
    _, fresh_shown = engine_reply(model, tok, tok.render_for_completion([second_q]), 12, seed=5)  # after /reset
    header, body = r.stdout.split("\n", 1)
    assert "/reset" in header
    assert body == "> " + first_shown + "> " + second_shown + "> > (new conversation)\n> " + fresh_shown + "> "


def test_tool_call_runs_mid_reply_and_the_conversation_is_the_rendered_one(tok):
    # a scripted model writes a calculator call, then the final answer: the calculator runs mid-reply,
    # its result is printed as the model reads it, and the conversation then holds exactly the ids of the
    # training render of those messages, so the next turn reads what SFT trained on
    msgs = tool_conversation()
    tools = [CALCULATOR_SCHEMA]
    full, _ = tok.render_conversation(msgs, tools=tools)
    engine = Engine(ScriptedGPT(tok.vocab_size, full), tok, tools=TOOLS)
    printed = io.StringIO()
    prompt = next_prompt(tok, [], msgs[0]["content"], tools)
    completion = chat_turn(engine, tok, prompt, SimpleNamespace(max_new_tokens=200, temperature=0.0, seed=0),
                           turn=0, out=printed)
    assert completion.tool_calls == 1 and completion.finish_reason == "stop"
    assert "</tool_call>\n<|im_start|>user\n<tool_response>\n19\n</tool_response>" in printed.getvalue()
    assert printed.getvalue().endswith("<|im_start|>assistant\n" + msgs[3]["content"] + "\n")
    conversation = close_reply(tok, prompt, completion)
    assert conversation == full
    thanks = {"role": "user", "content": "thanks"}
    assert next_prompt(tok, conversation, "thanks", tools) == tok.render_for_completion(msgs + [thanks], tools=tools)


def test_missing_init_is_one_line_and_exit_2():
    r = run_cli()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: --init PATH is required") and r.stderr.count("\n") == 1


def test_folder_without_chatml_tokens_is_one_line_and_exit_2(tok, chat_folder, tmp_path):
    save_hf(load_hf(chat_folder), str(tmp_path))  # the model, without our tokenizer
    plain = HFTokenizer(models.BPE())
    plain.train_from_iterator(["some text without chat tokens"] * 10, trainers.BpeTrainer(vocab_size=300))
    plain.save(str(tmp_path / "tokenizer.json"))
    r = run_cli("--init", str(tmp_path))
    assert r.returncode == 2 and "<|im_start|>" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run_cli("--init", str(tmp_path / "nothing here"))
    assert r.returncode == 2 and "nothing here" in r.stderr and r.stderr.count("\n") == 1, r.stderr
