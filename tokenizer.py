"""
Tokenizer and chat renderer: the contract between SFT, preference training, RL and the engine.

Every stage turns conversations into tokens here and nowhere else, so what a model is trained on,
what it is prompted with at RL time and what the engine forces into it mid-rollout cannot drift apart.

A conversation is a list of messages {"role": "system" | "user" | "assistant" | "tool", "content": str}.
An assistant message may also carry "reasoning_content" (its thinking) and "tool_calls":
[{"name": ..., "arguments": {...} or a JSON string}], or OpenAI's {"type": "function", "function": {...}}.

Three renderings:
- render_text(): character for character the chat template that ships with Qwen3 checkpoints
  (QWEN3_CHAT_TEMPLATE, saved into every tokenizer_config.json), so what we train is what
  transformers, vLLM and friends serve.
- Tokenizer.render_conversation(): the training render, ids plus a loss mask. It differs from
  render_text in exactly one place, the think block (see _segments), which makes it prefix-stable:
  the ids of messages[:i] are the first ids of messages (unless the cut splits a group of tool results).
- Tokenizer.render_for_completion(): the prompt RL samples from, a token prefix of the training
  render of the conversation with the reply appended. A base model that never saw ChatML is prompted
  instead as it read its pretraining documents, "question\n" (with_prompt_format("plain"), plain_prompt).

Ids are built segment by segment (role header, body, end of turn), each segment encoded on its own.
So a prompt is always a true token prefix of prompt + completion, even when the completion starts with
"\n", which BPE would otherwise merge with the header's "\n" (trl#5224, SkyRL#2092).

CLI: python tokenizer.py show FILE.jsonl [--n K] [--tokenizer PATH]   prints rendered rows with the mask.
"""

import argparse
import copy
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from common import UserError, nanopost_home, print0

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2/Qwen3's pre-tokenizer: words, single digits (\p{N}, not \p{N}{1,3}), punctuation runs, newline runs
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
ROLES = ("system", "user", "assistant", "tool")
THINK_OFF = "<think>\n\n</think>\n\n"  # what enable_thinking=False prefills after the assistant header
TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

# The chat template of Qwen/Qwen3-8B's tokenizer_config.json, verbatim. render_text() reproduces it;
# Tokenizer.save() ships it so that transformers renders our checkpoints the same way.
QWEN3_CHAT_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
# A model folder's tokenizer files: Tokenizer.load keeps their bytes and save() writes them back unchanged.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")


# -----------------------------------------------------------------------------
# Rendering to text

def _tojson(x) -> str:
    # transformers' tojson filter: json.dumps with ensure_ascii=False (Jinja's own escapes < > & ')
    return json.dumps(x, ensure_ascii=False)


def _check(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        # None is an assistant turn that only calls tools (OpenAI exports); anything else must be text
        if not (isinstance(content, str) or (content is None and role == "assistant")):
            raise ValueError(f"message {i} ({role}): content must be a string, got {type(content).__name__}")
        for call in m.get("tool_calls") or []:
            fn = (call.get("function") or call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"message {i}: tool call without a name: {call!r}")


def _last_query_index(messages: list[dict]) -> int:
    # the last user message that is a real query, not tool results passed as a user turn
    for i in range(len(messages) - 1, -1, -1):
        c = messages[i].get("content")
        if messages[i]["role"] == "user" and isinstance(c, str) and not (
                c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            return i
    return len(messages) - 1


def _split_thinking(m: dict) -> tuple[str | None, str]:
    """(reasoning, content) of an assistant message, read as Qwen3 reads them; reasoning None = no thinking."""
    content = m.get("content") or ""
    if isinstance(m.get("reasoning_content"), str):
        return m["reasoning_content"], content
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        return reasoning, content.split("</think>")[-1].lstrip("\n")
    return None, content


def _segments(messages: list[dict], tools: list[dict] | None, training: bool) -> list[tuple[str, int]]:
    """The conversation as (text, mask) segments; mask 1 on what the assistant wrote.

    training=False is the Qwen3 template: a think block only on assistant turns after the last real
    user query, and there only if the turn has reasoning, or is the last message (then maybe empty).
    training=True keeps a think block on every assistant turn that has thinking (a "reasoning_content"
    string, even empty, or "</think>" in its content) and never adds one to a turn without it.
    That is the only difference, and it makes each turn's rendering independent of what follows.
    """
    _check(messages)
    segs = []
    system_first = bool(messages) and messages[0]["role"] == "system"
    if tools:  # the tools block is merged into the system turn
        system = messages[0]["content"] + "\n\n" if system_first else ""
        body = system + TOOLS_HEAD + "".join("\n" + _tojson(t) for t in tools) + TOOLS_TAIL
        segs += [("<|im_start|>system\n", 0), (body, 0), ("<|im_end|>\n", 0)]
    elif system_first:
        segs += [("<|im_start|>system\n", 0), (messages[0]["content"], 0), ("<|im_end|>\n", 0)]
    last_query, last = _last_query_index(messages), len(messages) - 1
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user" or (role == "system" and i > 0):
            segs += [(f"<|im_start|>{role}\n", 0), (m["content"], 0), ("<|im_end|>\n", 0)]
        elif role == "tool":  # consecutive tool results share one user turn
            first = i == 0 or messages[i - 1]["role"] != "tool"
            if first:
                segs.append(("<|im_start|>user\n", 0))
            segs.append((("" if first else "\n") + f"<tool_response>\n{m['content']}\n</tool_response>", 0))
            if i == last or messages[i + 1]["role"] != "tool":
                segs.append(("<|im_end|>\n", 0))
        elif role == "assistant":
            reasoning, content = _split_thinking(m)
            if training:
                think = reasoning is not None
            else:
                think = i > last_query and (i == last or bool(reasoning))
            body = content
            if think:
                body = "<think>\n" + (reasoning or "").strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
            for j, call in enumerate(m.get("tool_calls") or []):
                call = call.get("function") or call
                args = call.get("arguments", {})
                body += "\n" if (j > 0 or content) else ""
                body += ('<tool_call>\n{"name": "' + call["name"] + '", "arguments": '
                         + (args if isinstance(args, str) else _tojson(args)) + "}\n</tool_call>")
            segs += [("<|im_start|>assistant\n", 0), (body, 1), ("<|im_end|>\n", 1)]
    return segs


def render_text(messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False, enable_thinking: bool = True) -> str:
    """Exactly what QWEN3_CHAT_TEMPLATE renders (transformers' apply_chat_template(..., tokenize=False))."""
    text = "".join(text for text, _ in _segments(messages, tools, training=False))
    if add_generation_prompt:
        text += "<|im_start|>assistant\n" + ("" if enable_thinking else THINK_OFF)
    return text


def completion_message(text: str, enable_thinking: bool = True) -> dict:
    """The assistant message for a sampled completion (its text, decoded without the final <|im_end|>).

    With thinking off, the empty think block came from the prompt, not the completion (trl#6361), so it
    comes back as empty reasoning. Then render_conversation(prompt + [message]) gives exactly
    render_for_completion(prompt) + encode(text) + <|im_end|>\\n whenever the text is in the template's
    canonical form ("<think>\\nR\\n</think>\\n\\nA" with thinking on, "A" with it off; A not starting with "\\n").
    """
    if enable_thinking:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "reasoning_content": "", "content": text}


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict]:
    """[{"name", "arguments"}] from the <tool_call>\\n{json}\\n</tool_call> blocks of an assistant reply.
    Raises ValueError on malformed calls (the engine hands the message back to the model as the result)."""
    text = text.split("</think>")[-1]  # a call written while thinking is not a call
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call is not valid JSON ({e}): {block.strip()!r}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f'tool call must be {{"name": ..., "arguments": {{...}}}}, got {block.strip()!r}')
        if not isinstance(call.get("arguments", {}), dict):
            raise ValueError(f"tool call arguments must be a JSON object, got {block.strip()!r}")
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    if text.count("<tool_call>") != len(calls):
        raise ValueError("unterminated <tool_call>: every call must end with </tool_call>")
    return calls


PROMPT_FORMATS = ("chat", "plain")


def plain_prompt(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt a base model continues the way it was pretrained: its documents read "question\\nsolution"
    then <|endoftext|> (base_train.py), so the prompt is the one user message and a newline, and the answer
    ends at <|endoftext|>, a stop token. No role, no template, no tools: there is nothing else it ever saw.
    Example: [{"role": "user", "content": "Mia has 3 pens. How many pens does Mia have?"}] ->
    "Mia has 3 pens. How many pens does Mia have?\\n"."""
    if tools:
        raise UserError("--prompt-format plain prompts a base model as its pretraining documents read: it has no "
                        "tool calls; drop --tools (and rows' own tools)")
    if len(messages) != 1 or messages[0].get("role") != "user":
        raise UserError(f"--prompt-format plain renders a prompt of one user message, as a pretraining document "
                        f"starts; got {[m.get('role') for m in messages]}")
    return messages[0]["content"] + "\n"


# -----------------------------------------------------------------------------
# Tokenizer

class Tokenizer:
    """Byte-level BPE (a HF `tokenizers` model) plus the ChatML rendering that every stage uses."""
    prompt_format = "chat"  # what render_for_completion renders: see with_prompt_format

    def __init__(self, tok: HFTokenizer, files: dict[str, bytes] | None = None):
        self._tok = tok
        self.files = files or {}  # the folder's tokenizer files as read (empty for a tokenizer we trained)
        self.generation_defaults = {}  # the folder's generation_config.json, which every checkpoint passes on
        for s in ("<|im_start|>", "<|im_end|>"):  # must be single added tokens, or ChatML cannot be rendered
            if tok.token_to_id(s) is None or self.encode(s) != [tok.token_to_id(s)]:
                raise UserError(f"tokenizer has no {s} token: nanopost renders ChatML and needs <|im_start|> "
                                "and <|im_end|> as added tokens (add them to tokenizer.json's added_tokens)")
        self.im_start_id = tok.token_to_id("<|im_start|>")
        self.eos_id = tok.token_to_id("<|im_end|>")  # ends every assistant turn: the stop token
        self.endoftext_id = tok.token_to_id("<|endoftext|>")  # ends documents in pretraining; None if absent
        self.pad_id = self.eos_id if self.endoftext_id is None else self.endoftext_id
        self.stop_ids = {self.eos_id} | ({self.endoftext_id} - {None})

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 2048) -> "Tokenizer":
        """Byte-level BPE with Qwen's pre-tokenizer; SPECIAL_TOKENS get ids 0..8. vocab_size counts everything."""
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """From a tokenizer.json, or a folder holding one (ours, or a real checkpoint's as is). A folder's
        tokenizer files (TOKENIZER_FILES, additional_chat_templates/*.jinja) are kept byte for byte."""
        path = Path(path)
        folder, path = (path, path / "tokenizer.json") if path.is_dir() else (None, path)
        if not path.is_file():
            raise UserError(f"no tokenizer.json at {path}")
        files = {}
        if folder is not None:
            names = [*TOKENIZER_FILES, *(f"additional_chat_templates/{p.name}"
                                         for p in sorted(folder.glob("additional_chat_templates/*.jinja")))]
            files = {name: (folder / name).read_bytes() for name in names if (folder / name).is_file()}
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own untyped errors on a malformed file
            raise UserError(f"{path}: not a tokenizer.json the tokenizers library reads ({e})") from None
        tok = cls(hf, files)
        if folder is not None and (folder / "generation_config.json").is_file():
            try:
                tok.generation_defaults = json.loads((folder / "generation_config.json").read_text())
            except ValueError as e:
                raise UserError(f"{folder / 'generation_config.json'} is not valid JSON: {e}") from None
        return tok

    def generation_config(self) -> dict:
        """generation_config.json for a model trained with this tokenizer: the --init folder's as it came (its
        temperature, top_p, top_k, do_sample, bos_token_id: how its makers meant it to be sampled), with the
        stop tokens the engine stops at put first in eos_token_id (<|im_end|>, where training ends every turn,
        then <|endoftext|>) and the folder's own kept after them, so that transformers' generate() stops where
        our engine does. A folder without one (the embedded world's): those stops, our pad id, no bos."""
        gen = dict(self.generation_defaults)
        theirs = gen.get("eos_token_id")
        theirs = theirs if isinstance(theirs, list) else [] if theirs is None else [theirs]
        ours = [self.eos_id] + sorted(self.stop_ids - {self.eos_id})
        gen["eos_token_id"] = ours + [i for i in theirs if i not in ours]
        gen.setdefault("pad_token_id", self.pad_id)
        gen.setdefault("bos_token_id", None)
        return gen

    def save(self, folder: str | Path, model_max_length: int = 32768) -> None:
        """The folder's files as they were read; for a tokenizer we trained, tokenizer.json +
        tokenizer_config.json (with QWEN3_CHAT_TEMPLATE), loadable by transformers.AutoTokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.files:
            for name, data in self.files.items():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(data)
            return
        self._tok.save(str(folder / "tokenizer.json"))
        added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                          "single_word": t.single_word, "special": t.special}
                 for i, t in sorted(self._tok.get_added_tokens_decoder().items())}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
                  "bos_token": None, "eos_token": "<|im_end|>", "pad_token": self._tok.id_to_token(self.pad_id),
                  "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
                  "model_max_length": model_max_length, "chat_template": QWEN3_CHAT_TEMPLATE}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def _config(self, name: str = "tokenizer_config.json") -> dict:
        try:
            return json.loads(self.files[name]) if name in self.files else {}
        except ValueError as e:
            raise UserError(f"{name} of the tokenizer folder is not valid JSON: {e}") from None

    @property
    def chat_template(self) -> str | None:
        """The template transformers applies to this folder: chat_template.jinja, else tokenizer_config.json's
        (the "default" of a list of named ones); None if the folder has none."""
        if not self.files:
            return QWEN3_CHAT_TEMPLATE
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"].decode("utf-8")
        template = self._config().get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def use_our_template(self) -> None:
        """Put QWEN3_CHAT_TEMPLATE wherever the folder keeps its template (chat_template.jinja,
        tokenizer_config.json, chat_template.json), or into chat_template.jinja if it keeps none."""
        if not self.files:
            return
        for name in ("tokenizer_config.json", "chat_template.json"):
            config = self._config(name)
            if isinstance(config.get("chat_template"), list):
                config["chat_template"] = [{**t, "template": QWEN3_CHAT_TEMPLATE} if t.get("name") == "default" else t
                                           for t in config["chat_template"]]
            elif "chat_template" in config:
                config["chat_template"] = QWEN3_CHAT_TEMPLATE
            else:
                continue
            self.files[name] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        if "chat_template.jinja" in self.files or self.chat_template is None:
            self.files["chat_template.jinja"] = QWEN3_CHAT_TEMPLATE.encode("utf-8")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def largest_id(self) -> int:
        """The largest token id (ids may have holes: a model needs at least this many + 1 embedding rows)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values())

    def encode(self, text: str) -> list[int]:
        """Special-token strings inside text become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _encode_segments(self, segs: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
        ids, mask = [], []
        for text, m in segs:
            piece = self.encode(text)
            ids += piece
            mask += [m] * len(piece)
        return ids, mask

    def render_conversation(self, messages: list[dict], tools: list[dict] | None = None
                            ) -> tuple[list[int], list[int]]:
        """Training render: (ids, mask). mask is 1 on each assistant turn's think block, text, tool calls,
        <|im_end|> and the "\\n" after it; 0 on role headers, system, user and tool-result tokens.
        decode(ids) is render_text(messages) except for the think blocks (see _segments)."""
        segs = _segments(messages, tools, training=True)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"no assistant message among the {len(messages)} messages: nothing to train on")
        return self._encode_segments(segs)

    def with_prompt_format(self, prompt_format: str) -> "Tokenizer":
        """This tokenizer, rendering prompts in `prompt_format` (a copy; self is unchanged): "chat" (ChatML, the
        default) or "plain" (plain_prompt: how a base model read its pretraining documents; chat_rl.py
        --prompt-format plain, RL straight from a base as DeepSeek-R1-Zero). Nothing else changes: the training
        batch is the prompt's ids and the sampled ids, never re-rendered."""
        if prompt_format not in PROMPT_FORMATS:
            raise UserError(f"unknown prompt format {prompt_format!r}; one of {', '.join(PROMPT_FORMATS)}")
        tok = copy.copy(self)
        tok.prompt_format = prompt_format
        return tok

    def render_for_completion(self, messages: list[dict], tools: list[dict] | None = None,
                              enable_thinking: bool = True) -> list[int]:
        """The prompt to sample the next assistant turn from: ends with <|im_start|>assistant\\n (+ an empty
        think block when thinking is off). A token prefix of render_conversation(messages + [reply]); unlike
        render_text(..., add_generation_prompt=True), earlier turns keep their thinking, as in training.
        In the "plain" prompt format (with_prompt_format), plain_prompt's text instead."""
        if self.prompt_format == "plain":
            return self.encode(plain_prompt(messages, tools))
        segs = _segments(messages, tools, training=True) + [("<|im_start|>assistant\n", 0)]
        if not enable_thinking:
            segs.append((THINK_OFF, 0))
        return self._encode_segments(segs)[0]

    def render_tool_responses(self, contents: list[str], enable_thinking: bool = True) -> list[int]:
        """What the engine forces after the model ends a tool-calling turn with <|im_end|>: the "\\n" that
        closes that turn, the tool results as one user turn, and the next <|im_start|>assistant\\n (+ an empty
        think block when thinking is off). Exactly the ids render_conversation puts there."""
        tool_msgs = [{"role": "tool", "content": c} for c in contents]
        segs = [("\n", 0)] + _segments(tool_msgs, None, training=True) + [("<|im_start|>assistant\n", 0)]
        if not enable_thinking:
            segs.append((THINK_OFF, 0))
        return self._encode_segments(segs)[0]

    def visualize(self, ids: list[int], mask: list[int]) -> str:
        """ANSI view: gray = not trained (mask 0), bright = trained; the background alternates per token."""
        out = []
        for k, (i, m) in enumerate(zip(ids, mask)):
            style = ("\033[97m" if m else "\033[90m") + ("\033[48;5;236m" if k % 2 else "\033[48;5;239m")
            lines = self.decode([i]).replace("\n", "↵\n").split("\n")  # a char split over tokens shows as �
            out.append("\n".join(style + line + "\033[0m" if line else "" for line in lines))
        return "".join(out)


# -----------------------------------------------------------------------------
# The folder's chat template against ours: what a served model will be prompted with

def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers compiles it (apply_chat_template)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent, **kw)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def conversations_of(rows: list[dict], tools: list[dict] | None = None
                     ) -> list[tuple[int, list[dict], list | None, bool]]:
    """(row index, messages, tools, add_generation_prompt) of every conversation a stage renders from its
    rows: SFT's messages, both sides of a preference pair, KTO's prompt + completion, an RL prompt."""
    out = []
    for i, r in enumerate(rows):
        row_tools = r.get("tools") or tools
        if "messages" in r:
            out.append((i, r["messages"], row_tools, False))
        elif "chosen" in r:
            out += [(i, r["prompt"] + r[side], row_tools, False) for side in ("chosen", "rejected")]
        elif "completion" in r:
            out.append((i, r["prompt"] + r["completion"], row_tools, False))
        else:
            out.append((i, r["prompt"], row_tools, True))
    return out


def first_difference(a: str, b: str, context: int = 40) -> tuple[str, str]:
    """The two texts around where they first differ, newlines shown as \\n.
    first_difference("abcX", "abcY", 2) -> ("bcX", "bcY")"""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    cut = max(0, i - context)
    return a[cut:i + context].replace("\n", "\\n"), b[cut:i + context].replace("\n", "\\n")


def settle_chat_template(tok: Tokenizer, rows: list[dict], choice: str = "check", tools: list[dict] | None = None
                         ) -> None:
    """Decide which chat template the checkpoints ship (tok.save writes it). The folder's template is held against
    render_text, nanopost's Qwen3 template (QWEN3_CHAT_TEMPLATE); a folder whose template renders the stage's data
    otherwise would serve the model a format it never saw. check: stop at the first conversation rendered
    differently; ours: ship QWEN3_CHAT_TEMPLATE; theirs: keep the folder's, knowingly. A folder without a
    template gets ours. What the check cannot settle, and says: training renders one thing otherwise than any
    Qwen3 template (render_conversation): the last assistant turn of a conversation, which the template gives an
    empty think block when it has no thinking, is trained without one (the training render is prefix-stable)."""
    theirs = tok.chat_template
    if theirs == QWEN3_CHAT_TEMPLATE:
        return
    if choice == "ours" or theirs is None:
        tok.use_our_template()
        print0("chat template: " + ("the folder has none; " if theirs is None else "--chat-template ours: ")
               + "checkpoints ship nanopost's Qwen3 template, the one training renders with")
        return
    if choice == "theirs":
        print0("chat template: --chat-template theirs keeps the folder's, which is not nanopost's: a served model "
               "is prompted in a format that may differ from the one it is trained on")
        return
    special = {k: v for k, v in tok._config().items() if k.endswith("_token") and isinstance(v, str)}
    fix = ("pass --chat-template ours to ship nanopost's template (the one training renders with), or "
           "--chat-template theirs to keep the folder's knowingly")
    try:
        template = compile_chat_template(theirs)
        for i, messages, row_tools, prompt in conversations_of(rows, tools):
            ours = render_text(messages, tools=row_tools, add_generation_prompt=prompt)
            rendered = template.render(messages=messages, tools=row_tools, add_generation_prompt=prompt, **special)
            if rendered != ours:
                a, b = first_difference(rendered, ours)
                raise UserError(f"the --init folder's chat template renders training row {i + 1} otherwise than "
                                f"nanopost's Qwen3 template, the one training renders with (theirs: ...{a}... "
                                f"ours: ...{b}...): " + fix)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the --init folder's chat template fails on the training data ({e}): {fix}") from None
    print0(f"chat template: the folder's differs from nanopost's in text but renders all {len(rows)} rows the same; "
           f"kept. Like every Qwen3 template it gives a last assistant turn without thinking an empty think block, "
           f"which training leaves out (its render is prefix-stable): served whole conversations differ there")


# -----------------------------------------------------------------------------
# CLI

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nanopost tokenizer tools")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print rendered conversations with the loss mask")
    show.add_argument("file", help='JSONL with rows {"messages": [...], "tools": [...] (optional)}')
    show.add_argument("--n", type=int, default=3, help="how many conversations to print")
    show.add_argument("--tokenizer", default=None, help="tokenizer.json or a folder with one")
    args = parser.parse_args(argv)

    path = Path(args.tokenizer or os.path.join(nanopost_home(), "tokenizer", "tokenizer.json"))
    if not path.exists():
        sys.exit(f"no tokenizer at {path}: run `python base_train.py` first, or pass --tokenizer PATH")
    tok = Tokenizer.load(path)
    print("legend: \033[90mgray = masked out (mask 0)\033[0m, \033[97mbright = trained (mask 1)\033[0m; "
          "the background alternates per token; ↵ = newline")
    shown = 0
    with open(args.file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if shown == args.n:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                    raise ValueError('expected a row {"messages": [...]}')
                ids, mask = tok.render_conversation(row["messages"], row.get("tools"))
            except ValueError as e:  # JSONDecodeError is a ValueError
                sys.exit(f"{args.file}:{lineno}: {e}")
            print(f"\n=== {args.file}:{lineno}: {len(ids)} tokens, {sum(mask)} trained")
            print(tok.visualize(ids, mask))
            shown += 1


if __name__ == "__main__":
    main()
