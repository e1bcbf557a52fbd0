"""docs/real-models.md works as written: every `python` command of its Commands block runs, in order, each stage
from the run before it, and so does runs/qwen3.sh with its sizes from the environment. On CPU, on a tiny
Qwen3-shaped folder with the real vocabulary size (151,936): only the model path, `--device cuda` and the
sizes are swapped, and the test checks that nothing else is."""
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from checkpoint import resolve_model_path, save_hf
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "real-models.md")
QWEN3_TINY = dict(vocab_size=151936, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, head_dim=16,
                  intermediate_size=128, max_seq_len=1024)
# what the test may change in a command: how big, never what
SMALL = {
    "chat_sft.py": ["--steps", "2", "--seq-len", "512", "--batch-size", "4", "--device-batch-size", "4"],
    "chat_rm.py": ["--steps", "2", "--max-len", "512", "--batch-size", "4", "--micro-batch-tokens", "2048"],
    "chat_dpo.py": ["--steps", "2", "--max-len", "512", "--batch-size", "4", "--micro-batch-tokens", "2048",
                    "--eval-problems", "0"],
    "chat_rl.py": ["--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "16", "--micro-batch-tokens", "2048",
                   "--eval-problems", "2"],
    "chat_ppo.py": ["--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "16", "--micro-batch-tokens", "2048",
                    "--eval-problems", "2"],
    "chat_cli.py": ["--max-new-tokens", "8"],
}
SIZE_FLAGS = {"--steps", "--seq-len", "--max-len", "--batch-size", "--device-batch-size", "--micro-batch-tokens",
              "--prompts-per-step", "--max-new-tokens", "--eval-problems"}


def doc_commands(text):
    """The first bash block under '## Commands', one string per command, `\\` continuations joined.
    Example: '## Commands\\n```bash\\npython a.py \\\\\\n  --x 1\\n# note\\n```' -> ['python a.py   --x 1']."""
    block = text.split("## Commands\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_doc_commands_joins_continuations_and_skips_comments():
    assert doc_commands("## Commands\n```bash\npython a.py \\\n  --x 1\n# note\n```\n```bash\nb\n```") == \
        ["python a.py --x 1"]


@pytest.fixture(scope="module")
def world(tok, tmp_path_factory):
    """A Qwen3-shaped folder (random weights, vocabulary 151,936) and the embedded world's rows as the user's
    sft.jsonl, prefs.jsonl and rl.jsonl."""
    root = tmp_path_factory.mktemp("real_models")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(**QWEN3_TINY)), str(root / "Qwen3-tiny"), tok)
    for kind, name in (("sft", "sft.jsonl"), ("pairs", "prefs.jsonl"), ("rl", "rl.jsonl")):
        rows = subprocess.run([sys.executable, os.path.join(REPO, "tasks.py"), kind, "--n", "24"], capture_output=True,
                              text=True, check=True, cwd=REPO).stdout
        (root / name).write_text(rows)
    return root


@pytest.mark.slow
def test_every_stage_command_of_the_docs_runs_as_written(world, tmp_path):
    home = tmp_path / "out"
    commands = doc_commands(open(DOC).read())
    scripts = [shlex.split(c)[1] for c in commands if c.startswith("python ")]
    assert scripts == ["chat_sft.py", "chat_rm.py", "chat_dpo.py", "chat_rl.py", "chat_ppo.py", "chat_cli.py"]
    assert "--critic-init" in next(c for c in commands if "chat_ppo.py" in c)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "NANOPOST_HOME": str(home)}
    for command in commands:
        words = shlex.split(command)
        if words[0] != "python":  # huggingface-cli (elsewhere), source, export: set up by this test instead
            continue
        script = words[1]
        assert SIZE_FLAGS >= {w for w in SMALL[script] if w.startswith("--")}
        args = [w.replace("$NANOPOST_HOME", str(home)).replace("/models/Qwen3-0.6B-Base", str(world / "Qwen3-tiny"))
                for w in words[2:]]
        args = [str(world / a) if a.endswith(".jsonl") else a for a in args]
        args[args.index("--device") + 1] = "cpu"
        r = subprocess.run([sys.executable, os.path.join(REPO, script), *args, *SMALL[script]], env=env, cwd=REPO,
                           input="What is 3 + 4?\n/quit\n", capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    for stage, run in (("sft", "qwen3-sft"), ("rm", "qwen3-rm"), ("dpo", "qwen3-dpo"), ("rl", "qwen3-grpo"),
                       ("ppo", "qwen3-ppo")):
        ckpt = resolve_model_path(str(home / stage / run))
        assert json.load(open(os.path.join(ckpt, "config.json")))["vocab_size"] == 151936
    assert "loading its latest checkpoint" in r.stdout  # chat_cli says which checkpoint it talks to


def small_cpu_line():
    """runs/qwen3.sh's header line for trying it small on CPU, as its environment: {"DEVICE": "cpu", ...}."""
    line = next(line for line in open(os.path.join(REPO, "runs", "qwen3.sh")) if line.startswith("#   DEVICE=cpu"))
    return line[1:].strip(), dict(w.split("=", 1) for w in line[1:].split() if "=" in w and "..." not in w)


def test_the_small_cpu_line_is_the_same_in_the_script_and_the_docs():
    line, sizes = small_cpu_line()
    assert {"DEVICE", "NGPU", "SEQ_LEN", "RL_STEPS"} <= set(sizes)
    assert line in open(os.path.join(REPO, "docs", "real-models.md")).read()


@pytest.mark.slow
def test_qwen3_recipe_runs_small_on_cpu(world, tmp_path):
    # the recipe's header line for trying it small (the one docs/real-models.md quotes), as a user runs it
    env = {**os.environ, "OMP_NUM_THREADS": "2", "NANOPOST_HOME": str(tmp_path / "out"), **small_cpu_line()[1],
           "MODEL": str(world / "Qwen3-tiny"), "SFT": str(world / "sft.jsonl"), "PREFS": str(world / "prefs.jsonl"),
           "RL": str(world / "rl.jsonl")}
    r = subprocess.run(["bash", os.path.join(REPO, "runs", "qwen3.sh")], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for stage in ("sft", "dpo", "rl"):
        assert os.path.exists(os.path.join(resolve_model_path(str(tmp_path / "out" / stage / "qwen3")), "config.json"))
    # a second run into the same directories refuses (a run directory belongs to one run) unless OVERWRITE=1,
    # in one line, not buried under torchrun's traceback (runs/launch.py); OVERWRITE=0 is off, not on
    for overwrite in ({}, {"OVERWRITE": "0"}):
        again = subprocess.run(["bash", os.path.join(REPO, "runs", "qwen3.sh")], env={**env, **overwrite}, cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
        errors = [line for line in again.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "--overwrite" in errors[0], again.stderr[-3000:]
