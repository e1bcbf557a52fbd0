"""A run directory belongs to one run: a fresh run refuses another run's checkpoints (they would be mistaken for
its own by the next --init), --overwrite replaces them unless an input lies inside, and eval.json says which run
and step its figures measure."""
import json
import os

import pytest
import torch

from checkpoint import save_hf
from common import Default, fit_warmup
from model import GPT, GPTConfig
from test_errors import one_line_error, run

SFT = ["--num-train", "32", "--num-val", "4", "--eval-problems", "2", "--max-new-tokens", "8", "--pass-k", "0",
       "--batch-size", "8", "--save-every", "1", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def checkpoints(home):
    return sorted(os.listdir(home / "sft" / "default" / "checkpoints"))


def test_a_fresh_run_refuses_an_old_runs_checkpoints_and_overwrite_replaces_them(tmp_path, tiny_chat):
    first = run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "4", *SFT)
    assert first.returncode == 0, first.stderr[-2000:]
    assert checkpoints(tmp_path) == ["step_000003", "step_000004"]
    assert "±" in first.stdout and "(n 2: too few" in first.stdout  # 2 held-out problems: said to be noise
    # the case that loaded the old model: a shorter re-run under the same name, without --resume
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "2", *SFT))
    assert "step_000004" in msg and "--resume" in msg and "--run-name" in msg and "--overwrite" in msg
    assert checkpoints(tmp_path) == ["step_000003", "step_000004"]  # untouched
    again = run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "2", "--overwrite", *SFT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "replaced" in again.stdout and "step_000004" in again.stdout
    assert checkpoints(tmp_path) == ["step_000001", "step_000002"]  # nothing of the old run is left
    # the default --warmup-steps 10 of a 2-step run is cut to fit, so the lr reaches --lr
    assert "warming up for 1" in again.stdout
    with open(tmp_path / "sft" / "default" / "metrics.jsonl") as f:
        assert max(row.get("lr", 0) for row in map(json.loads, f)) == pytest.approx(1e-3)
    with open(tmp_path / "sft" / "default" / "eval.json") as f:
        ev = json.load(f)
    assert (ev["run"], ev["step"]) == (os.path.join("sft", "default"), 2)
    # the next stage loads the run's own latest checkpoint and says which
    r = run(tmp_path, "chat_eval.py", "--report")
    assert r.returncode == 0 and "sft/default @ step 2" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.slow
def test_overwrite_refuses_to_delete_an_input_and_resume_with_overwrite_is_ambiguous(tmp_path, tiny_chat):
    assert run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "1", *SFT).returncode == 0
    inside = str(tmp_path / "sft" / "default" / "checkpoints" / "step_000001")
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", inside, "--steps", "1", "--overwrite", *SFT))
    assert inside in msg and "--run-name" in msg
    assert os.path.isdir(inside)
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--resume", "--overwrite", *SFT))
    assert "--resume" in msg and "--overwrite" in msg


def test_warmup_fits_the_run():
    assert fit_warmup(Default(30), 600) == 30                        # a tenth of the run or less: kept
    assert fit_warmup(Default(10), 4) == 1 and fit_warmup(Default(3), 19) == 1   # a default cut to a tenth
    assert fit_warmup(10, 40) == 10                                   # given: kept while it fits in the run
    assert fit_warmup(50, 40) == 4                                    # longer than the run itself: cut


def test_a_batch_larger_than_the_data_is_an_error(tmp_path, tiny_chat):
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--num-train", "4", "--packing", "none",
                             "--batch-size", "8", "--steps", "1", "--eval-problems", "0"))
    assert "--batch-size 8" in msg and "4 conversations" in msg


def test_rl_that_cannot_learn_says_so(tmp_path, tiny_chat):
    # a random model never writes "#### N": every group scores 0 alike, so no step has a gradient
    r = run(tmp_path, "chat_rl.py", "--init", tiny_chat, "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "8", "--no-dynamic-sampling", "--eval-problems", "0", "--num-prompts", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 steps in a row learned nothing" in r.stdout and "100% of the answers had no final answer" in r.stdout
    with open(tmp_path / "rl" / "default" / "metrics.jsonl") as f:
        rows = [row for row in map(json.loads, f) if "idle_steps" in row]
    assert [row["idle_steps"] for row in rows] == [1, 2, 3] and all(row["count/ungradable"] == 4 for row in rows)
