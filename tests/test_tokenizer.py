"""Tests for tokenizer.py: the Qwen3 chat format, the training render and its mask, the tokenizer itself."""

import hashlib
import json
import random
import time

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import tokenizer as T
from tokenizer import Tokenizer, completion_message, parse_tool_calls, render_text

# The jinja oracle every rendering test compiles: the shipped template (pinned to Qwen3-8B's below).
TEMPLATE = T.QWEN3_CHAT_TEMPLATE


# -----------------------------------------------------------------------------
# reference renderers: the template itself, compiled the way transformers compiles it

def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)  # transformers' tojson

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


# The training render = the Qwen3 template with its think condition replaced by "the turn has thinking".
THINK_GATE = ("        {%- if loop.index0 > ns.last_query_index %}\n"
              "            {%- if loop.last or (not loop.last and reasoning_content) %}\n")
TRAIN_GATE = ("        {%- if message.reasoning_content is string or "
              "(message.content is string and '</think>' in message.content) %}\n"
              "            {%- if true %}\n")
assert TEMPLATE.count(THINK_GATE) == 1
QWEN3 = _compile(TEMPLATE)
QWEN3_TRAINING = _compile(TEMPLATE.replace(THINK_GATE, TRAIN_GATE))


def jinja_render(messages, tools=None, **kwargs) -> str:
    return QWEN3.render(messages=messages, tools=tools, **kwargs)


# -----------------------------------------------------------------------------
# random conversations that exercise every branch of the template

WORDS = ["the", "apple", "costs", "12", "dollars", "Paris", "café", "中文", "x=3.5", "  ", "\n", "\n\n",
         "!", '{"a": 1}', "<b>", "it's", "1000", "\t", "naïve", "😀"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in °C",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluates <expr> & returns it",
                                      "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}},
]


def rand_text(rng: random.Random, lo: int = 1, hi: int = 10) -> str:
    return "".join(rng.choice(["", " ", " ", "\n"]) + rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def rand_call(rng: random.Random) -> dict:
    name, args = rng.choice([("get_weather", {"city": rng.choice(["Paris", "São Paulo", "東京"])}),
                             ("calculator", {"expr": f"{rng.randint(0, 99)}*{rng.randint(0, 99)}", "exact": True}),
                             ("calculator", {"nested": {"xs": [1, 2.5, None]}})])
    if rng.random() < 0.3:
        args = json.dumps(args)  # a JSON string is pasted as is (here with \u escapes, unlike tojson)
    call = {"name": name, "arguments": args}
    return {"type": "function", "function": call} if rng.random() < 0.5 else call


def rand_assistant(rng: random.Random, calls: bool) -> dict:
    content, reasoning = rand_text(rng, 0, 8), rand_text(rng, 0, 6)
    m = {"role": "assistant", "content": content}
    kind = rng.choice(["none", "none", "field", "field_empty", "inline", "inline_sloppy"])
    if kind == "field":
        m["reasoning_content"] = rng.choice(["", "\n"]) + reasoning + rng.choice(["", "\n"])
    elif kind == "field_empty":
        m["reasoning_content"] = ""
    elif kind == "inline":
        m["content"] = f"<think>\n{reasoning}\n</think>\n\n{content}"
    elif kind == "inline_sloppy":
        m["content"] = f"{reasoning}</think>{content}"
    if calls:
        m["tool_calls"] = [rand_call(rng) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.3:
            m["content"] = None
    return m


def random_conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rand_text(rng)})
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.1:
            msgs.append({"role": "system", "content": rand_text(rng)})  # a system message that is not first
        if rng.random() < 0.1:  # tool results pasted as a user turn do not count as a query
            msgs.append({"role": "user", "content": f"<tool_response>\n{rand_text(rng)}\n</tool_response>"})
        msgs.append({"role": "user", "content": rand_text(rng)})
        while True:
            calls = rng.random() < 0.4
            msgs.append(rand_assistant(rng, calls))
            if not calls:
                break
            msgs += [{"role": "tool", "content": rand_text(rng)} for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        msgs.append({"role": "user", "content": rand_text(rng)})
    return msgs, (TOOLS if rng.random() < 0.4 else None)


def conversations(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [random_conversation(rng) for _ in range(n)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(1234)
    corpus = [render_text(m, t) for m, t in conversations(300, seed=99)]
    corpus += [rand_text(rng, 5, 40) for _ in range(300)]
    return Tokenizer.train(corpus, vocab_size=512)


# -----------------------------------------------------------------------------
# render_text is the Qwen3 template

def test_shipped_template_is_the_qwen3_template():
    # sha256 of "chat_template" in Qwen/Qwen3-8B's tokenizer_config.json: an edit to the .jinja file fails here
    digest = hashlib.sha256(TEMPLATE.encode("utf-8")).hexdigest()
    assert digest == "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"


def test_worked_renderings():
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."}]
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    # the last assistant turn after the query gets an (empty) think block, as Qwen3 renders it
    assert render_text(msgs) == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>\n"
    assert render_text(msgs[:2], add_generation_prompt=True) == head + "<|im_start|>assistant\n"
    assert render_text(msgs[:2], add_generation_prompt=True, enable_thinking=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_worked_tool_call_layout(tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
            {"role": "tool", "content": '{"temp_c": 21, "sky": "clear"}'},
            {"role": "assistant", "content": "It is 21 C and clear in Paris."}]
    layout = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp_c": 21, "sky": "clear"}\n'
              '</tool_response><|im_end|>\n<|im_start|>assistant\n')
    assert render_text(msgs).endswith(layout + "<think>\n\n</think>\n\nIt is 21 C and clear in Paris.<|im_end|>\n")
    # the training render never invents the empty think block, so the conversation's layout comes out verbatim
    assert tok.decode(tok.render_conversation(msgs)[0]).endswith(layout + "It is 21 C and clear in Paris.<|im_end|>\n")


def test_render_text_equals_jinja_template():
    rng = random.Random(7)
    for msgs, tools in conversations(400, seed=1):
        kwargs = {"add_generation_prompt": rng.random() < 0.5, "enable_thinking": rng.random() < 0.5}
        assert render_text(msgs, tools, **kwargs) == jinja_render(msgs, tools, **kwargs)


def test_render_text_handles_every_branch():
    # the generator must actually reach the branches the equality test claims to cover
    texts = [render_text(m, t) for m, t in conversations(400, seed=1)]
    for needle in ["# Tools", "\n</tool_response>\n<tool_response>\n", "</tool_call>\n<tool_call>",
                   "<think>\n\n</think>", '"arguments": {"city": "S\\u00e3o', "<|im_start|>system", "São Paulo"]:
        assert any(needle in t for t in texts), needle
    assert any(t.count("<think>") >= 2 for t in texts)


# -----------------------------------------------------------------------------
# the training render: ids, mask, prefix stability

def test_training_render_is_the_template_with_thinking_always_kept(tok):
    for msgs, tools in conversations(300, seed=2):
        if any(m["role"] == "assistant" for m in msgs):
            ids, mask = tok.render_conversation(msgs, tools)
            assert tok.decode(ids) == QWEN3_TRAINING.render(messages=msgs, tools=tools)
            assert len(mask) == len(ids)


def test_mask_is_exactly_the_assistant_turns(tok):
    header = tok.encode("<|im_start|>assistant\n")
    newline = tok.encode("\n")
    for msgs, tools in conversations(300, seed=3):
        if not any(m["role"] == "assistant" for m in msgs):
            continue
        ids, mask = tok.render_conversation(msgs, tools)
        runs, start = [], None
        for j, m in enumerate(mask + [0]):
            if m and start is None:
                start = j
            elif not m and start is not None:
                runs.append((start, j))
                start = None
        # expected spans, from the reference template text: everything after each assistant header
        text = QWEN3_TRAINING.render(messages=msgs, tools=tools)
        spans = [c[len("assistant\n"):] for c in text.split("<|im_start|>") if c.startswith("assistant\n")]
        assert [tok.decode(ids[a:b]) for a, b in runs] == spans
        for a, b in runs:
            assert ids[a - len(header):a] == header  # the role header is context, not target
            assert ids[b - 1 - len(newline):b] == [tok.eos_id] + newline  # the stop token is trained (trl#5988)


def test_prefix_stability(tok):
    for msgs, tools in conversations(200, seed=4):
        if not any(m["role"] == "assistant" for m in msgs):
            continue
        ids, mask = tok.render_conversation(msgs, tools)
        first_assistant = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        for i in range(first_assistant + 1, len(msgs) + 1):
            if i < len(msgs) and msgs[i - 1]["role"] == "tool" and msgs[i]["role"] == "tool":
                continue  # Qwen3 closes a group of tool results only after its last one
            sub_ids, sub_mask = tok.render_conversation(msgs[:i], tools)
            assert ids[:len(sub_ids)] == sub_ids and mask[:len(sub_mask)] == sub_mask


def test_qwen3_render_is_not_prefix_stable():
    # why the training render exists: Qwen3 drops earlier thinking once a new query arrives
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "r", "content": "a"},
            {"role": "user", "content": "again"}]
    assert not render_text(msgs).startswith(render_text(msgs[:2]))


def test_render_for_completion_is_a_prefix(tok):
    header = tok.encode("<|im_start|>assistant\n")
    for msgs, tools in conversations(150, seed=5):
        ids, mask = tok.render_conversation(msgs, tools) if any(m["role"] == "assistant" for m in msgs) else ([], [])
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = tok.render_for_completion(msgs[:k], tools)
            assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
            assert ids[:len(prompt)] == prompt
            # the header is the last untrained token, what the model samples is the first trained one
            assert mask[len(prompt) - len(header):len(prompt) + 1] == [0] * len(header) + [1]


def test_completion_roundtrip(tok):
    # trl#6361: prompt + sampled completion, rendered back as messages, gives back the same ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"}]
    for thinking, completion in [(True, "<think>\nsix sevens\n</think>\n\n42"),
                                 (True, "The answer is 42."),
                                 (True, "\n42"),  # starts with "\n" right after the header's "\n"
                                 (False, "The answer is 42."),
                                 (False, " 42")]:
        prompt = tok.render_for_completion(msgs, enable_thinking=thinking)
        completion_ids = tok.encode(completion) + [tok.eos_id]
        ids, mask = tok.render_conversation(msgs + [completion_message(completion, thinking)])
        assert ids == prompt + completion_ids + tok.encode("\n"), completion
        assert ids[:len(prompt)] == prompt


def test_newline_completion_would_merge_if_retokenized(tok):
    # trl#5224 / SkyRL#2092: re-tokenizing the decoded text merges the header "\n" with the completion's "\n"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nhello"}]
    ids, _ = tok.render_conversation(msgs)
    prompt = tok.render_for_completion(msgs[:1])
    assert ids[:len(prompt)] == prompt
    naive = tok.encode(tok.decode(ids))
    assert naive[:len(prompt)] != prompt  # so ids must never be rebuilt from text


@pytest.mark.parametrize("thinking", [True, False])
def test_tool_loop_forced_tokens(tok, thinking):
    system = {"role": "system", "content": "Use the calculator."}
    user = {"role": "user", "content": "What is 12*7 and 3+4?"}
    calls = [{"name": "calculator", "arguments": {"expr": "12*7"}}, {"name": "calculator", "arguments": {"expr": "3+4"}}]
    reasoning = "need math" if thinking else ""
    call_text = ("<think>\nneed math\n</think>\n\n" if thinking else "") + "\n".join(
        '<tool_call>\n' + json.dumps(c, ensure_ascii=False) + '\n</tool_call>' for c in calls)
    assert parse_tool_calls(call_text) == calls
    answer = "12*7 = 84 and 3+4 = 7."
    # what the engine builds: prompt, sampled call, forced results, sampled answer
    prompt = tok.render_for_completion([system, user], TOOLS, enable_thinking=thinking)
    forced = tok.render_tool_responses(["84", "7"], enable_thinking=thinking)
    engine_ids = prompt + tok.encode(call_text) + [tok.eos_id] + forced + tok.encode(answer) + [tok.eos_id]
    msgs = [system, user, {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": calls},
            {"role": "tool", "content": "84"}, {"role": "tool", "content": "7"},
            {"role": "assistant", "content": answer, **({} if thinking else {"reasoning_content": ""})}]
    ids, mask = tok.render_conversation(msgs, TOOLS)
    assert ids == engine_ids + tok.encode("\n")
    assert tok.decode(forced) == ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n7\n"
                                  "</tool_response><|im_end|>\n<|im_start|>assistant\n"
                                  + ("" if thinking else "<think>\n\n</think>\n\n"))


# -----------------------------------------------------------------------------
# tool call parsing and errors

def test_parse_tool_calls():
    text = ('<think>\nmaybe <tool_call>\n{"name": "no"}\n</tool_call>?\n</think>\n\nSure.\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1+1"}}\n</tool_call>')
    assert parse_tool_calls(text) == [{"name": "get_weather", "arguments": {"city": "東京"}},
                                      {"name": "calculator", "arguments": {"expr": "1+1"}}]
    assert parse_tool_calls("no calls here") == []
    for bad in ['<tool_call>\n{"name": "x", "arguments": {\n</tool_call>',  # malformed JSON
                '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
                '<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>',  # arguments not an object
                '<tool_call>\n{"name": "x", "arguments": {}}']:  # never closed
        with pytest.raises(ValueError):
            parse_tool_calls(bad)


@pytest.mark.parametrize("msgs, index", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "robot", "content": "c"}], 2),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": ["a", "list"]}], 1),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "b"}], 0),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}], 1),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "",
                                         "tool_calls": [{"type": "function", "function": {"name": ""}}]}], 1),
])
def test_errors_name_the_message(tok, msgs, index):
    for render in (render_text, tok.render_conversation):
        with pytest.raises(ValueError, match=f"message {index}"):
            render(msgs)


def test_conversation_without_assistant_is_an_error(tok):
    with pytest.raises(ValueError, match="no assistant message"):
        tok.render_conversation([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])


# -----------------------------------------------------------------------------
# the tokenizer

def test_specials_and_round_trip(tok):
    assert [tok.token_to_id(s) for s in T.SPECIAL_TOKENS] == list(range(len(T.SPECIAL_TOKENS)))
    assert tok.vocab_size == 512
    assert tok.eos_id == tok.token_to_id("<|im_end|>") and tok.im_start_id == tok.token_to_id("<|im_start|>")
    assert tok.pad_id == tok.endoftext_id == tok.token_to_id("<|endoftext|>")
    assert tok.stop_ids == {tok.eos_id, tok.endoftext_id}
    assert tok.encode("a<|im_end|>b<think>") == tok.encode("a") + [tok.eos_id] + tok.encode("b") + [3]
    rng = random.Random(0)
    for _ in range(200):
        text = rand_text(rng, 0, 30) + rng.choice(T.SPECIAL_TOKENS) + rand_text(rng, 0, 5)
        assert tok.decode(tok.encode(text)) == text
    for msgs, tools in conversations(50, seed=6):
        text = render_text(msgs, tools)
        assert tok.decode(tok.encode(text)) == text


def test_digits_split_one_by_one(tok):
    ids = tok.encode("x=2024 and 1000000")
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == list("2024") + list("1000000")


def test_train_is_fast_enough():
    texts = [render_text(m, t) for m, t in conversations(200, seed=8)] * 10  # ~1 MB
    assert sum(map(len, texts)) > 500_000
    t0 = time.time()
    Tokenizer.train(texts, vocab_size=2048)
    assert time.time() - t0 < 10


def test_save_load_and_transformers(tok, tmp_path):
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>" and config["bos_token"] is None
    assert config["added_tokens_decoder"]["2"]["content"] == "<|im_end|>"
    for loaded in (Tokenizer.load(tmp_path), Tokenizer.load(tmp_path / "tokenizer.json")):
        assert loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id
        assert loaded.encode("hello 42 <|im_start|>") == tok.encode("hello 42 <|im_start|>")

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    rng = random.Random(9)
    for msgs, tools in conversations(40, seed=9):
        kwargs = {"add_generation_prompt": rng.random() < 0.5, "enable_thinking": rng.random() < 0.5}
        assert hf.apply_chat_template(msgs, tools=tools, tokenize=False, **kwargs) == render_text(msgs, tools, **kwargs)
    for text in ["hello world 12345", "café 中文 😀\n\n  x", render_text(*conversations(1, seed=10)[0])]:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text


def test_load_a_foreign_chatml_tokenizer(tmp_path):
    # a Qwen-like tokenizer.json: specials appended at the end, tool tags as non-special added tokens, no <think>
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["some text to learn from, think about it"] * 10,
                           trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.load(tmp_path)
    assert tok.eos_id == hf.token_to_id("<|im_end|>") and tok.pad_id == hf.token_to_id("<|endoftext|>")
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "reasoning_content": "think", "content": "ok",
             "tool_calls": [{"name": "f", "arguments": {}}]}]
    ids, mask = tok.render_conversation(msgs)
    assert tok.decode(ids) == QWEN3_TRAINING.render(messages=msgs)  # <think> is plain text here
    assert ids[-2] == tok.eos_id and mask[-2] == 1

    no_chatml = HFTokenizer(models.BPE())
    no_chatml.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
    no_chatml.save(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"<\|im_end\|>"):
        Tokenizer.load(tmp_path / "bad.json")


# -----------------------------------------------------------------------------
# the CLI

def test_cli_show(tok, tmp_path, capsys, monkeypatch):
    rows = [{"messages": m, **({"tools": t} if t else {})} for m, t in conversations(3, seed=11)]
    rows = [r for r in rows if any(m["role"] == "assistant" for m in r["messages"])]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok.save(tmp_path / "tok")
    T.main(["show", str(data), "--n", "1", "--tokenizer", str(tmp_path / "tok")])
    out = capsys.readouterr().out
    ids, mask = tok.render_conversation(rows[0]["messages"], rows[0].get("tools"))
    assert f"{len(ids)} tokens, {sum(mask)} trained" in out and "legend" in out
    assert out.count("===") == 1 and "\033[90m" in out and "\033[97m" in out

    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="base_train.py"):
        T.main(["show", str(data)])
    data.write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    with pytest.raises(SystemExit, match=r"data.jsonl:1: no assistant"):
        T.main(["show", str(data), "--tokenizer", str(tmp_path / "tok")])
