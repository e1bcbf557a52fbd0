"""Know before you OOM: the estimate each stage prints is what `python memory.py --init FOLDER STAGE [flags]`
prints, and it is within 25% of the peak measured on real steps at the real vocabulary size (151,936), for every
stage and LoRA (benchmarks/bench_memory.py measures a larger shape; docs/LOG.md); a run that cannot fit is
refused before it starts."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import peak_memory
from model import GPT, GPTConfig
from checkpoint import save_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_TINY = dict(vocab_size=151936, n_layer=2, n_embd=128, n_head=4, n_kv_head=2, head_dim=32,
                  intermediate_size=384, max_seq_len=4096)
QWEN3_NARROW = dict(vocab_size=151936, n_layer=2, n_embd=256, n_head=4, n_kv_head=2, head_dim=64,
                    intermediate_size=768, max_seq_len=4096)
WORDS = "apples marbles count each friend gives buys more equal piles dollars".split()


@pytest.fixture(scope="module")
def real_vocab_folder(tok, tmp_path_factory):
    """A Qwen3 shape with the real vocabulary and a tiny trunk (20M parameters, nearly all embedding), and
    data that fills the flags' bounds: conversations and pairs of about 500 tokens a side."""
    path = tmp_path_factory.mktemp("qwen3_tiny")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(**QWEN3_TINY)), str(path / "model"), tok)
    story = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(300)) for i in range(5)]
    with open(path / "sft.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a story."},
                                             {"role": "assistant", "content": story[i]}]}) + "\n")
    with open(path / "pairs.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": "Tell me a story.", "chosen": story[i], "rejected": story[i + 1]}) + "\n")
    return path


FILL = ["--max-len", "544", "--batch-size", "2", "--steps", "2", "--save-every", "1000"]
ROLLOUT = ["--steps", "1", "--prompts-per-step", "1", "--max-new-tokens", "64", "--eval-problems", "0",
           "--num-prompts", "16", "--save-every", "1000"]
CASES = {  # stage, its flags ({} is the folder, {sft} and {pairs} the data files)
    "sft": ("sft", ["--data", "{sft}", "--seq-len", "544", "--batch-size", "2", "--device-batch-size", "2", "--steps",
                    "2", "--eval-problems", "0", "--save-every", "1000", "--overlong", "crop"]),
    "rm": ("rm", ["--data", "{pairs}", *FILL]),
    "dpo": ("dpo", ["--data", "{pairs}", "--eval-problems", "0", *FILL]),
    "kto": ("kto", ["--data", "{pairs}", "--eval-problems", "0", *FILL]),
    "grpo": ("rl", ["--group-size", "8", "--no-dynamic-sampling", *ROLLOUT]),
    "ppo": ("ppo", ["--samples-per-prompt", "8", "--critic-init", "{}", "--freeze-actor-steps", "0", *ROLLOUT]),
    "distill": ("distill", ["--samples-per-prompt", "8", "--teacher", "{}", *ROLLOUT]),
    "sft-lora": ("sft", ["--lora-rank", "16", "--data", "{sft}", "--seq-len", "544", "--batch-size", "2",
                         "--device-batch-size", "2", "--steps", "2", "--eval-problems", "0", "--save-every", "1000",
                         "--overlong", "crop"]),
    "dpo-lora": ("dpo", ["--lora-rank", "16", "--data", "{pairs}", "--eval-problems", "0", *FILL]),
    "grpo-lora": ("rl", ["--lora-rank", "16", "--group-size", "8", "--no-dynamic-sampling", *ROLLOUT]),
}
SCRIPT = {"sft": "chat_sft.py", "rm": "chat_rm.py", "dpo": "chat_dpo.py", "kto": "chat_kto.py", "rl": "chat_rl.py",
          "ppo": "chat_ppo.py", "distill": "chat_distill.py"}


def run(home, script, *args):
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, os.path.join(REPO, script), *args], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def measured_peak_gib(home, stage):
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        return max(json.loads(line).get("peak_mem_mb", 0) for line in f) / 1024


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_stage_prints_what_memory_py_says_within_25_percent_of_its_measured_peak(tmp_path, real_vocab_folder,
                                                                                     case):
    stage, flags = CASES[case]
    folder = str(real_vocab_folder / "model")
    flags = [f.format(folder, sft=real_vocab_folder / "sft.jsonl", pairs=real_vocab_folder / "pairs.jsonl")
             for f in flags]
    out = run(tmp_path, SCRIPT[stage], "--init", folder, *flags)
    printed = re.search(r"estimated peak memory per device: (([\d.]+) GiB .*)", out)
    cli = run(tmp_path, "memory.py", "--init", folder, stage, *flags)
    assert f"estimated peak memory per device {printed.group(1)}" in cli, (printed.group(1), cli)
    estimate, measured = float(printed.group(2)), measured_peak_gib(tmp_path, {"rl": "rl"}.get(stage, stage))
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)


@pytest.mark.slow
def test_a_real_model_gets_a_real_lr(tmp_path, real_vocab_folder):
    out = run(tmp_path, "chat_sft.py", "--init", str(real_vocab_folder / "model"), "--data",
              str(real_vocab_folder / "sft.jsonl"), "--steps", "1", "--seq-len", "544", "--batch-size", "2",
              "--device-batch-size", "2", "--eval-problems", "0", "--save-every", "1000", "--overlong", "crop",
              "--warmup-steps", "0")
    # no --lr on a real-vocabulary model: the real-model learning rate, said out loud, not the toy world's 1e-3
    assert "--lr 1e-05: the real-model default for sft" in out
    with open(os.path.join(tmp_path, "sft", "default", "metrics.jsonl")) as f:
        assert json.loads(f.readline())["lr"] == 1e-5


@pytest.mark.slow
def test_memory_py_without_arguments_prints_the_tables_of_what_fits_where():
    r = subprocess.run([sys.executable, os.path.join(REPO, "memory.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Qwen3" in r.stdout and "8B" in r.stdout and "LoRA rank 32" in r.stdout, r.stderr


def test_the_estimate_adds_up_and_shards():
    qwen3_8b = peak_memory.Shape(151936, 36, 4096, 32, 8, 128, 12288, tie_word_embeddings=False)
    assert 8.1e9 < qwen3_8b.params() < 8.3e9  # Qwen3-8B: 8.19B parameters
    one = peak_memory.estimate(trained=[qwen3_8b], micro_batch_tokens=4096, cuda=True, grad_checkpointing=True)
    eight = peak_memory.estimate(trained=[qwen3_8b], micro_batch_tokens=4096, cuda=True, grad_checkpointing=True,
                                 world_size=8, fsdp=True)
    # replicated: 16 bytes a parameter before activations; sharded over 8: an eighth, plus one gathered block
    assert one["weights"] + one["gradients"] + one["optimizer"] == 16 * qwen3_8b.params()
    assert abs(eight["optimizer"] - one["optimizer"] / 8) < 1 and eight["total"] < one["total"] / 3
    assert one["total"] == one["weights"] + one["optimizer"] + max(one["activations"], 2 * one["gradients"])


def test_a_run_that_cannot_fit_is_refused_before_it_starts(monkeypatch):
    from common import UserError
    monkeypatch.setattr(peak_memory, "available_bytes", lambda device: 2**30)  # a device with 1 GiB free
    est = peak_memory.estimate(trained=[peak_memory.Shape(**{k: QWEN3_NARROW[k] for k in (
        "vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "intermediate_size")})],
        micro_batch_tokens=4096)
    with pytest.raises(UserError, match=r"needs about [\d.]+ GiB per device .* has 1.0 GiB available"):
        peak_memory.check(est, "cpu")


def test_the_docs_memory_tables_are_what_memory_py_prints():
    """docs/real-models.md's and docs/lora.md's tables quote `python memory.py` (memory.tables()): a change to the
    estimator that moves a figure fails here until the pages say the same (docs/lora.md once said 19.6 GiB for
    8B LoRA SFT, memory.py 25.2)."""
    import memory
    t = memory.tables()
    stages = memory.STAGE_NAMES
    quoted = 0
    for page, setup_of in (("real-models.md", {", 1 GPU": "1 GPU", ", 8 GPUs `--fsdp`": "8 GPUs, --fsdp"}),
                           ("lora.md", {"": "1 GPU, LoRA 32"})):
        text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", page)).read()
        for m in re.finditer(r"^\| Qwen3-([\d.]+B)(, 1 GPU|, 8 GPUs `--fsdp`)? \| (?:[\d.]+M \| )?"
                             r"([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M):
            setup = setup_of[m.group(2) or ""]
            assert [float(v) for v in m.groups()[2:]] == [round(t[setup][m.group(1)][s], 1) for s in stages], \
                f"docs/{page}: {m.group(0)}"
            quoted += 1
        for m in re.finditer(r"^\| (1 GPU|8 GPUs), (\d+) GiB(, `--fsdp`)? \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$",
                             text, re.M):
            setup = "8 GPUs, --fsdp" if m.group(3) else m.group(1)
            assert list(m.groups()[3:]) == list(t["fits"][(setup, int(m.group(2)))].values()), f"docs/{page}: {m.group(0)}"
            quoted += 1
    assert quoted >= 15  # every table row above was read
