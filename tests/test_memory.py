"""Know before you OOM: the estimate each stage prints matches the peak measured on real steps, at the real
vocabulary size (151,936), within 20%; and a run that cannot fit is refused before it starts."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import memory
from model import GPT, GPTConfig
from checkpoint import save_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_NARROW = dict(vocab_size=151936, n_layer=2, n_embd=256, n_head=4, n_kv_head=2, head_dim=64,
                    intermediate_size=768, max_seq_len=4096)


@pytest.fixture(scope="module")
def real_vocab_folder(tok, tmp_path_factory):
    """A Qwen3 shape with the real vocabulary and a narrow trunk (40M parameters, nearly all embedding)."""
    path = tmp_path_factory.mktemp("qwen3_narrow")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(**QWEN3_NARROW)), str(path), tok)
    return str(path)


def run(home, script, *args):
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, os.path.join(REPO, script), *args], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    estimate = float(re.search(r"estimated peak memory per device: ([\d.]+) GiB", r.stdout).group(1))
    return estimate, r.stdout


def measured_peak_gib(home, stage):
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        return max(json.loads(line).get("peak_mem_mb", 0) for line in f) / 1024


@pytest.mark.slow
def test_sft_steps_peak_within_20_percent_of_the_estimate_and_a_real_model_gets_a_real_lr(tmp_path, real_vocab_folder):
    words = "apples marbles count each friend gives buys more equal piles dollars".split()
    with open(tmp_path / "sft.jsonl", "w") as f:  # conversations of about 500 tokens
        for i in range(4):
            answer = " ".join(words[(i + j) % len(words)] for j in range(420))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    estimate, out = run(tmp_path, "chat_sft.py", "--init", real_vocab_folder, "--data", str(tmp_path / "sft.jsonl"),
                        "--steps", "2", "--seq-len", "544", "--batch-size", "2", "--device-batch-size", "2",
                        "--eval-problems", "0", "--save-every", "1000", "--overlong", "crop", "--warmup-steps", "0")
    measured = measured_peak_gib(tmp_path, "sft")
    assert abs(estimate - measured) <= 0.2 * measured, (estimate, measured)
    # no --lr on a real-vocabulary model: the real-model learning rate, said out loud, not the toy world's 1e-3
    assert "--lr 1e-05: the real-model default for sft" in out
    with open(os.path.join(tmp_path, "sft", "default", "metrics.jsonl")) as f:
        assert json.loads(f.readline())["lr"] == 1e-5


@pytest.mark.slow
def test_grpo_step_peak_within_20_percent_of_the_estimate(tmp_path, real_vocab_folder):
    estimate, _ = run(tmp_path, "chat_rl.py", "--init", real_vocab_folder, "--steps", "1", "--prompts-per-step", "1",
                      "--group-size", "8", "--max-new-tokens", "64", "--no-dynamic-sampling", "--eval-problems", "0",
                      "--num-prompts", "16", "--save-every", "1000")
    measured = measured_peak_gib(tmp_path, "rl")
    assert abs(estimate - measured) <= 0.2 * measured, (estimate, measured)


def test_the_estimate_adds_up_and_shards():
    qwen3_8b = memory.Shape(151936, 36, 4096, 32, 8, 128, 12288, tie_word_embeddings=False)
    assert 8.1e9 < qwen3_8b.params() < 8.3e9  # Qwen3-8B: 8.19B parameters
    one = memory.estimate(trained=[qwen3_8b], micro_batch_tokens=4096, cuda=True, grad_checkpointing=True)
    eight = memory.estimate(trained=[qwen3_8b], micro_batch_tokens=4096, cuda=True, grad_checkpointing=True,
                            world_size=8, fsdp=True)
    # replicated: 16 bytes a parameter before activations; sharded over 8: an eighth, plus one gathered block
    assert one["weights"] + one["gradients"] + one["optimizer"] == 16 * qwen3_8b.params()
    assert abs(eight["optimizer"] - one["optimizer"] / 8) < 1 and eight["total"] < one["total"] / 3
    assert one["total"] == one["weights"] + one["optimizer"] + max(one["activations"], 2 * one["gradients"])


def test_a_run_that_cannot_fit_is_refused_before_it_starts(tmp_path, real_vocab_folder, monkeypatch):
    from common import UserError
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**30)  # a device with 1 GiB free
    est = memory.estimate(trained=[memory.Shape(**{k: QWEN3_NARROW[k] for k in (
        "vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "intermediate_size")})],
        micro_batch_tokens=4096)
    with pytest.raises(UserError, match=r"needs about [\d.]+ GiB per device .* has 1.0 GiB available"):
        memory.check(est, "cpu")
