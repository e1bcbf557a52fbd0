"""The user's tokenizer files survive: a checkpoint carries the --init folder's tokenizer files byte for byte, and
a folder whose chat template renders the training data otherwise than nanopost trains stops the run at start
(--chat-template ours ships nanopost's template, --chat-template theirs keeps the folder's, knowingly)."""
import json
import os

import pytest
import torch

from checkpoint import save_hf
from common import UserError
from model import GPT, GPTConfig
from tasks import CALCULATOR_SCHEMA, preference_pairs, rl_prompts, sft_conversations
from test_errors import one_line_error, run
from tokenizer import QWEN3_CHAT_TEMPLATE, Tokenizer, render_text, settle_chat_template

# Qwen2.5's edit of the same template: a default system turn when the conversation has none
DEFAULT_SYSTEM = QWEN3_CHAT_TEMPLATE.replace(
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n",
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n", 1)
RENAMED_TOOLS = QWEN3_CHAT_TEMPLATE.replace('"# Tools\\n\\n', '"# Functions\\n\\n', 1)  # changes rows with tools only
assert DEFAULT_SYSTEM != QWEN3_CHAT_TEMPLATE and RENAMED_TOOLS != QWEN3_CHAT_TEMPLATE
# what a Hub Qwen3 folder's tokenizer_config.json holds besides the template, none of which we write ourselves
HUB_CONFIG = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False,
              "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
              "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
              "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}


def hub_folder(path, tok, template=QWEN3_CHAT_TEMPLATE, template_in_config=False):
    """A folder laid out as transformers 5 saves a Qwen3 download: tokenizer.json written by other code (compact
    JSON here), tokenizer_config.json with the Hub's keys, the template in chat_template.jinja (or in the config)."""
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    with open(path / "tokenizer.json", encoding="utf-8") as f:
        (path / "tokenizer.json").write_text(json.dumps(json.load(f), separators=(",", ":")), encoding="utf-8")
    config = {**HUB_CONFIG, **({"chat_template": template} if template_in_config and template else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    (path / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}\n')
    if template and not template_in_config:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return path


def tokenizer_files(path):
    return {name: (path / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json",
                                                          "special_tokens_map.json", "chat_template.jinja")
            if (path / name).is_file()}


def hf_render(path, messages, **kwargs):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)).apply_chat_template(messages, tokenize=False, **kwargs)


def test_a_folders_tokenizer_files_come_back_byte_for_byte(tok, tmp_path):
    src = hub_folder(tmp_path / "src", tok)
    loaded = Tokenizer.load(src)
    settle_chat_template(loaded, sft_conversations("train", 8), "check")  # Qwen3's own template: nothing to do
    loaded.save(tmp_path / "out")
    assert tokenizer_files(tmp_path / "out") == tokenizer_files(src)
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["additional_special_tokens"]


def test_an_edited_template_stops_at_the_first_row_it_renders_otherwise(tok, tmp_path):
    world = sft_conversations("train", 40)
    rows = [r for r in world if not r.get("tools")][:3] + [r for r in world if r.get("tools")][:1]
    with_tools = 3
    loaded = Tokenizer.load(hub_folder(tmp_path / "src", tok, RENAMED_TOOLS))
    with pytest.raises(UserError) as e:
        settle_chat_template(loaded, rows, "check")
    msg = str(e.value)
    assert f"training row {with_tools + 1} " in msg and "# Functions" in msg and "# Tools" in msg
    assert "--chat-template ours" in msg and "--chat-template theirs" in msg
    settle_chat_template(loaded, rows[:with_tools], "check")  # rows without tools render the same: kept
    assert loaded.chat_template == RENAMED_TOOLS
    # RL prompts are compared as the engine samples from them: with the generation prompt and the calculator
    with pytest.raises(UserError, match="training row 1 "):
        settle_chat_template(loaded, rl_prompts("train", 2), "check", tools=[CALCULATOR_SCHEMA])
    settle_chat_template(loaded, rl_prompts("train", 2), "check")


@pytest.mark.parametrize("in_config", [False, True])
def test_ours_ships_our_template_where_the_folder_kept_its_own_and_theirs_keeps_it(tok, tmp_path, in_config):
    src = hub_folder(tmp_path / "src", tok, DEFAULT_SYSTEM, template_in_config=in_config)
    rows = preference_pairs("train", 4)
    with pytest.raises(UserError, match="You are a helpful assistant"):
        settle_chat_template(Tokenizer.load(src), rows, "check")
    theirs = Tokenizer.load(src)
    settle_chat_template(theirs, rows, "theirs")
    theirs.save(tmp_path / "theirs")
    assert tokenizer_files(tmp_path / "theirs") == tokenizer_files(src)
    ours = Tokenizer.load(src)
    settle_chat_template(ours, rows, "ours")
    ours.save(tmp_path / "ours")
    assert ours.chat_template == QWEN3_CHAT_TEMPLATE
    messages = rows[0]["prompt"] + rows[0]["chosen"]
    assert hf_render(tmp_path / "ours", messages) == render_text(messages) != hf_render(src, messages)
    before, after = tokenizer_files(src), tokenizer_files(tmp_path / "ours")
    assert {k for k in before if before[k] != after[k]} == {"tokenizer_config.json" if in_config else "chat_template.jinja"}
    config_before, config_after = (json.loads(d["tokenizer_config.json"]) for d in (before, after))
    assert {k: v for k, v in config_after.items() if k != "chat_template"} == \
        {k: v for k, v in config_before.items() if k != "chat_template"}


def test_a_template_that_differs_in_text_only_is_kept_and_a_folder_without_one_gets_ours(tok, tmp_path, capsys):
    comment = "{#- edited: the same output #}\n" + QWEN3_CHAT_TEMPLATE
    src = hub_folder(tmp_path / "comment", tok, comment)
    kept = Tokenizer.load(src)
    settle_chat_template(kept, sft_conversations("train", 8), "check")
    # the check says the one thing it does not compare: the last turn's empty think block, which training leaves out
    assert "empty think block, which training leaves out" in capsys.readouterr().out
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids, _ = kept.render_conversation(conversation)
    assert "<think>\n\n</think>" in hf_render(src, conversation) and "<think>" not in kept.decode(ids)
    kept.save(tmp_path / "kept")
    assert tokenizer_files(tmp_path / "kept") == tokenizer_files(src)
    bare = hub_folder(tmp_path / "bare", tok, template=None)
    assert Tokenizer.load(bare).chat_template is None
    filled = Tokenizer.load(bare)
    settle_chat_template(filled, sft_conversations("train", 8), "check")
    filled.save(tmp_path / "filled")
    assert (tmp_path / "filled" / "chat_template.jinja").read_text(encoding="utf-8") == QWEN3_CHAT_TEMPLATE
    assert (tmp_path / "filled" / "tokenizer_config.json").read_bytes() == (bare / "tokenizer_config.json").read_bytes()
    messages = sft_conversations("train", 1)[0]["messages"]
    assert hf_render(tmp_path / "filled", messages) == render_text(messages)


RL_SMALL = ["--prompts-per-step", "2", "--max-new-tokens", "8", "--eval-problems", "0"]
STAGES = {  # each stage at its smallest; the template check comes before any training step
    "chat_sft.py": ["--num-train", "16", "--num-val", "4", "--eval-problems", "0", "--batch-size", "4",
                    "--device-batch-size", "4", "--seq-len", "256"],
    "chat_rm.py": ["--num-train", "16", "--num-val", "4", "--batch-size", "4"],
    "chat_dpo.py": ["--num-train", "16", "--num-val", "4", "--batch-size", "4", "--eval-problems", "0"],
    "chat_kto.py": ["--num-train", "16", "--num-val", "4", "--batch-size", "4", "--eval-problems", "0"],
    "chat_rl.py": RL_SMALL + ["--group-size", "2"],
    "chat_ppo.py": RL_SMALL,
    "chat_distill.py": RL_SMALL,
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(STAGES))
def test_every_stage_stops_on_an_edited_template(tok, tmp_path, script):
    src = hub_folder(tmp_path / "src", tok, DEFAULT_SYSTEM)
    teacher = ["--teacher", str(src)] if script == "chat_distill.py" else []
    msg = one_line_error(run(tmp_path, script, "--init", str(src), *teacher, "--steps", "1", *STAGES[script]))
    assert "training row 1 " in msg and "You are a helpful assistant" in msg and "--chat-template ours" in msg


def test_a_stage_ships_the_folders_files_byte_for_byte_with_theirs(tok, tmp_path):
    src = hub_folder(tmp_path / "src", tok, DEFAULT_SYSTEM)
    r = run(tmp_path, "chat_sft.py", "--init", str(src), "--chat-template", "theirs", "--steps", "1",
            *STAGES["chat_sft.py"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--chat-template theirs" in r.stdout
    ckpt = tmp_path / "sft" / "default" / "checkpoints" / "step_000001"
    assert tokenizer_files(ckpt) == tokenizer_files(src)
    assert os.path.isfile(ckpt / "model.safetensors")
