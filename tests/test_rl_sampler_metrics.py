"""What the lab's RL experiments read from chat_rl.py's metrics (lab/length_bias.py, lab/sampler_trainer.py): the mean
length of right and of wrong answers, from Rollouts.stats summed over ranks; and --engine-dtype, the sampler's dtype,
which reaches the engine (its fused weights and KV cache) and the run's logprob_mismatch."""
import json
import os
import subprocess
import sys

import pytest
import torch

import engine as engine_module
from checkpoint import save_hf
from engine import Completion, Engine
from model import GPT, GPTConfig
from rollout import ENGINE_DTYPES, Rollouts, rollout_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rollouts(lengths, rewards):
    comps = [Completion(0, tokens=[1] * n, finish_reason="stop") for n in lengths]
    return Rollouts(rows=[{}] * len(lengths), prompts=[[0]] * len(lengths), completions=comps,
                    rewards=torch.tensor(rewards), group_size=len(lengths))


def test_length_of_right_and_of_wrong_answers():
    # right answers (reward >= 1, as accuracy counts them) of 10 and 30 tokens, wrong ones of 50 and 70 (one
    # rewarded 0.5: a partial score is not a right answer)
    m = rollout_metrics(rollouts([10, 50, 30, 70], [1.0, 0.0, 1.2, 0.5]).stats())
    assert (m["length_mean"], m["length_correct"], m["length_wrong"]) == (40.0, 20.0, 60.0)
    # summed over two ranks (what all_reduce_dict hands rollout_metrics): the means of all four answers
    a, b = rollouts([10, 50], [1.0, 0.0]).stats(), rollouts([30, 70], [1.0, 0.0]).stats()
    m = rollout_metrics({k: a[k] + b[k] for k in a})
    assert (m["length_correct"], m["length_wrong"]) == (20.0, 60.0)
    # a step without right answers logs no length_correct (a mean of nothing is not 0), and the reverse
    assert "length_correct" not in rollout_metrics(rollouts([10, 50], [0.0, 0.0]).stats())
    m = rollout_metrics(rollouts([10, 50], [1.0, 1.0]).stats())
    assert "length_wrong" not in m and m["length_correct"] == 30.0


@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("sft")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def test_engine_dtype_flag_names_the_engines_dtype(tok, monkeypatch):
    """--engine-dtype bfloat16 builds the engine in bfloat16: its fused weights and its KV cache (the head stays
    float32, as the trainer's); auto leaves the compute dtype (float32 on CPU). tests/test_engine.py checks the
    bfloat16 engine itself (no cast while decoding, the master head shared)."""
    from chat_rl import parser
    assert ENGINE_DTYPES[parser.parse_args([]).engine_dtype] is None
    dtype = ENGINE_DTYPES[parser.parse_args(["--engine-dtype", "bfloat16"]).engine_dtype]
    caches = []

    class RecordedCache(engine_module.KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)
    monkeypatch.setattr(engine_module, "KVCache", RecordedCache)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=128))
    eng = Engine(model, tok, dtype=dtype)
    prep = eng.prepare()
    fused = [w for layer in prep.weights["layers"] for w in layer if torch.is_tensor(w)]
    assert fused and all(w.dtype == torch.bfloat16 for w in fused) and prep.head.dtype == torch.float32
    eng.generate([tok.encode("<|im_start|>user\n2+2<|im_end|>\n")], num_samples=2, max_new_tokens=4, seed=0)
    assert caches and all(c.k.dtype == c.v.dtype == torch.bfloat16 for c in caches)


def rl_step(home, init, *extra):
    args = [os.path.join(REPO, "chat_rl.py"), "--init", init, "--num-prompts", "16", "--steps", "1",
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "16", "--eval-problems", "0",
            "--save-every", "100", "--no-dynamic-sampling", *extra]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(home, "rl", "default", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "reward" in line][-1]


def test_a_bfloat16_engine_is_a_sampler_unlike_the_float32_trainer(tmp_path, tiny_chat):
    """--engine-dtype reaches the run: a float32 engine's log-probs are the trainer's to float noise; a bfloat16
    engine's (weights and cache rounded to 8 bits of mantissa) are not, and its answers get weights other than 1."""
    same = rl_step(tmp_path / "f32", tiny_chat, "--engine-dtype", "float32")
    bf16 = rl_step(tmp_path / "bf16", tiny_chat, "--engine-dtype", "bfloat16")
    # measured: 5e-8 nats per token against 2.9e-4 (a random 1-layer model's near-uniform distributions; the
    # pipeline's SFT model: docs/lab/sampler_trainer.md), mean weights 1.0000000 and 1.0000123
    assert same["logprob_mismatch"] < 1e-6 and abs(same["correction_mean"] - 1) < 1e-6
    assert bf16["logprob_mismatch"] > 1e-4 and abs(bf16["correction_mean"] - 1) > 1e-6
    # dynamic sampling's last round keeps flat groups out of the loss, not out of the sampler's diagnostics: the
    # random model's groups all score 0, yet its bfloat16 gap and its entropy are still measured
    flat = rl_step(tmp_path / "flat", tiny_chat, "--engine-dtype", "bfloat16", "--dynamic-sampling",
                   "--max-resample", "0")
    assert flat["flat_groups_kept"] == 4 and flat["logprob_mismatch"] > 1e-4 and flat["entropy"] > 0
