"""Errors for people: every user mistake ends in one line naming what and where, exit code 2, no traceback
(under torchrun too: rank 0 prints it); a bug of ours keeps its traceback."""
import json
import os
import re
import resource
import signal
import subprocess
import sys

import pytest
import torch

from model import GPT, GPTConfig
from checkpoint import save_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def run(home, script, *args, nproc=1, preexec_fn=None):
    path = os.path.join(REPO, script)
    cmd = [sys.executable, path, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path, *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)


def one_line_error(r):
    """The run failed with exit code 2 and said why in exactly one 'error:' line, without a traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr[-2000:]
    return errors[0]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_a_malformed_row_is_named_before_any_model_is_looked_for(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = write_jsonl(tmp_path / "sft.jsonl", [good, '{"messages": [{"role": "robot", "content": "x"}]}'])
    # no base model exists at all: the data error must come first
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--data", data, "--init", str(tmp_path / "missing")))
    assert f"{data}:2:" in msg and "robot" in msg
    rl = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "2+2?", "ground_truth": "4", "verifier": "regex"}])
    msg = one_line_error(run(tmp_path, "chat_rl.py", "--data", rl, "--init", str(tmp_path / "missing")))
    assert f"{rl}:1:" in msg and "unknown verifier 'regex'" in msg
    prefs = write_jsonl(tmp_path / "p.jsonl", ["{not json"])
    for script in ("chat_dpo.py", "chat_rm.py"):
        msg = one_line_error(run(tmp_path, script, "--data", prefs, "--init", str(tmp_path / "missing")))
        assert f"{prefs}:1: invalid JSON" in msg


@pytest.mark.slow
def test_a_missing_init_and_resume_without_a_checkpoint(tmp_path, tiny_chat):
    msg = one_line_error(run(tmp_path, "chat_dpo.py", "--init", str(tmp_path / "nowhere")))
    assert str(tmp_path / "nowhere") in msg and "pass --init PATH" in msg
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--resume"))
    assert "--resume: no checkpoint in" in msg and str(tmp_path / "sft" / "default") in msg


def test_a_tokenizer_without_chatml_tokens(tmp_path, tiny_chat):
    folder = tmp_path / "no_chatml"
    os.makedirs(folder)
    for name in os.listdir(tiny_chat):
        if name != "tokenizer.json":
            os.symlink(os.path.join(tiny_chat, name), folder / name)
    tok = json.load(open(os.path.join(tiny_chat, "tokenizer.json")))
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|im_start|>"]
    tok["model"]["vocab"].pop("<|im_start|>")
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    msg = one_line_error(run(tmp_path, "chat_rl.py", "--init", str(folder), "--eval-problems", "0"))
    assert "tokenizer has no <|im_start|> token" in msg


@pytest.mark.slow
def test_incompatible_flags(tmp_path, tiny_chat):
    msg = one_line_error(run(tmp_path, "chat_dpo.py", "--init", tiny_chat, "--loss", "orpo", "--ref", "live"))
    assert "ORPO has no reference" in msg
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--batch-size", "6", "--device-batch-size", "4"))
    assert "--batch-size 6 must be a multiple" in msg
    msg = one_line_error(run(tmp_path, "chat_rl.py", "--init", tiny_chat, "--reward", "verifier+0.1*vibes"))
    assert "--reward 'verifier+0.1*vibes'" in msg and "'0.1*vibes'" in msg
    # under torchrun the line comes once, from rank 0
    r = run(tmp_path, "chat_rl.py", "--init", tiny_chat, "--prompts-per-step", "3", nproc=2)
    assert "--prompts-per-step 3 must be a multiple of the number of ranks (2)" in one_line_error_or_launcher(r)


def one_line_error_or_launcher(r):
    """Under torchrun the launcher adds its own summary (a traceback of the launcher, not of ours)."""
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "chat_" not in "".join(l for l in r.stderr.splitlines() if 'File "/' in l and "chat_" in l)
    return errors[0]


@pytest.mark.slow
def test_eval_problems_zero_skips_evaluation_in_rl_and_ppo(tmp_path, tiny_chat):
    for script, extra in (("chat_rl.py", ["--group-size", "2"]), ("chat_ppo.py", ["--critic-init", tiny_chat])):
        r = run(tmp_path, script, "--init", tiny_chat, "--eval-problems", "0", "--steps", "1", "--prompts-per-step", "2",
                "--max-new-tokens", "8", "--num-prompts", "8", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "eval @" not in r.stdout


def test_a_full_disk_while_checkpointing_is_one_line_and_publishes_nothing(tmp_path, tiny_chat):
    def small_files():  # writing past 200 kB fails with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "2", "--num-train", "32",
                             "--batch-size", "8", "--eval-problems", "0", preexec_fn=small_files))
    assert "no room to write the checkpoint" in msg and "step_000002" in msg
    assert not os.path.exists(tmp_path / "sft" / "default" / "checkpoints" / "step_000002")
    assert not os.path.exists(tmp_path / "sft" / "default" / "checkpoints" / "step_000002.tmp")



def test_a_run_that_cannot_fit_is_one_line_before_any_weight_is_read(tmp_path, tiny_chat):
    """A folder holding only the config of a 64-layer, 5120-wide model (~25B parameters) and a tokenizer: SFT
    refuses it from the estimate, naming the estimate and what this machine has, without reading a weight
    (there are none to read)."""
    import shutil
    big = tmp_path / "big"
    big.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_chat, name), big / name)
    with open(os.path.join(tiny_chat, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=128)
    (big / "config.json").write_text(json.dumps(config))
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", str(big), "--steps", "1", "--num-train", "200",
                             "--eval-problems", "0"))
    assert re.search(r"needs about [\d.]+ GiB per device .* cpu has [\d.]+ GiB available", msg), msg


def test_a_bug_of_ours_keeps_its_traceback(tmp_path):
    from common import run_main

    def buggy():
        raise KeyError("a bug")
    with pytest.raises(KeyError):
        run_main(buggy)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_of_a_cpu_build_says_how_to_get_one(tmp_path, tiny_chat):
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--device", "cuda"))
    assert "--device cuda" in msg and ("CPU build" in msg if torch.version.cuda is None else "no CUDA GPU" in msg)
    assert "--device cpu" in msg
