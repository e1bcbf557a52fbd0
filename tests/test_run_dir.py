"""A run directory belongs to one run: a fresh run refuses another run's checkpoints (they would be mistaken for
its own by the next --init), --overwrite replaces them unless an input lies inside, and eval.json says which run
and step its figures measure."""
import json
import os
import shutil

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


@pytest.mark.parametrize("resample", [["--no-dynamic-sampling"], ["--max-resample", "3"]], ids=["once", "resampled"])
def test_rl_that_cannot_learn_says_so(tmp_path, tiny_chat, resample):
    # a random model never writes "#### N": every group scores 0 alike, so no step has a gradient. Dynamic
    # sampling then samples 4 rounds a step: the share of unreadable answers is of all 16, not of the 4 kept
    r = run(tmp_path, "chat_rl.py", "--init", tiny_chat, "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "8", "--eval-problems", "0", "--num-prompts", "8", *resample)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 steps in a row learned nothing" in r.stdout and "100% of the answers had no final answer" in r.stdout
    with open(tmp_path / "rl" / "default" / "metrics.jsonl") as f:
        rows = [row for row in map(json.loads, f) if "idle_steps" in row]
    sampled = 4 * (1 if resample == ["--no-dynamic-sampling"] else 4)
    assert [row["idle_steps"] for row in rows] == [1, 2, 3] and all(row["count/ungradable"] == sampled for row in rows)


def test_overwrite_replaces_the_old_run_only_once_every_input_is_checked(tmp_path, tiny_chat):
    assert run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "1", *SFT).returncode == 0
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_chat, no_tokenizer)
    os.remove(no_tokenizer / "tokenizer.json")
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", str(no_tokenizer), "--steps", "1", "--overwrite", *SFT))
    assert "tokenizer.json" in msg
    assert checkpoints(tmp_path) == ["step_000001"]  # the old run is untouched
    # a flag found wrong only once the model is loaded: the old run stays too
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "1", "--overwrite", *SFT,
                             "--batch-size", "6", "--device-batch-size", "4"))
    assert "--batch-size 6" in msg and checkpoints(tmp_path) == ["step_000001"]


def test_resume_refuses_a_flag_that_changes_what_is_trained_and_says_what_else_changed(tmp_path, tiny_chat):
    assert run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "2", *SFT).returncode == 0
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "3", *SFT, "--resume",
                             "--seq-len", "256", "--seed", "5"))
    assert "--seq-len 256 (the run's: 512)" in msg and "--seed 5 (the run's: 0)" in msg and "--run-name" in msg
    assert checkpoints(tmp_path) == ["step_000001", "step_000002"]
    # the schedule may change (a lower --lr rescues a diverged run), said in one line; plumbing changes silently
    r = run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "3", *SFT, "--resume", "--lr", "5e-4",
            "--eval-every", "7")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--resume: --lr 0.0005 (the run's: 0.001)" in r.stdout and "--resume: --steps 3 (the run's: 2)" in r.stdout
    assert "--resume: --eval-every" not in r.stdout  # not said: the trained numbers do not depend on it
    with open(tmp_path / "sft" / "default" / "metrics.jsonl") as f:
        assert [row["lr"] for row in map(json.loads, f) if "lr" in row][-1] < 5e-4 + 1e-12


def test_resume_flag_kinds_cover_every_flag_of_every_stage():
    """Each stage flag is plumbing (changes silently on --resume), the schedule (said), or refused: a new flag
    lands in the refused kind unless it is added to one of the other two, and neither lists a flag no stage has."""
    import importlib
    from rundir import RESUME_NOTED, RESUME_QUIET
    flags = {a.dest for m in ("base_train", "chat_sft", "chat_rm", "chat_dpo", "chat_kto", "chat_rl", "chat_ppo",
                              "chat_distill") for a in importlib.import_module(m).parser._actions}
    assert (RESUME_QUIET | RESUME_NOTED) <= flags and not RESUME_QUIET & RESUME_NOTED
    assert {"seq_len", "batch_size", "data", "init", "seed", "group_size", "beta", "loss"} <= flags - RESUME_QUIET \
        - RESUME_NOTED


@pytest.mark.slow
def test_a_chain_of_three_lora_adapters_survives_its_first_run_going_on(tmp_path, tiny_chat):
    lora = ["--lora-rank", "4", "--lr", "1e-3"]
    for name, init in (("a", tiny_chat), ("b", str(tmp_path / "sft" / "a")), ("c", str(tmp_path / "sft" / "b"))):
        r = run(tmp_path, "chat_sft.py", "--init", init, "--run-name", name, "--steps", "2", *SFT, *lora)
        assert r.returncode == 0, r.stderr[-2000:]
    a_base = str(tmp_path / "sft" / "a" / "checkpoints" / "step_000002")  # b's adapter names it as its base
    # a goes on: rotation would delete the checkpoint b's adapter (and so c's) is built on
    r = run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--run-name", "a", "--steps", "5", *SFT, *lora, "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    kept = sorted(os.listdir(tmp_path / "sft" / "a" / "checkpoints"))
    assert kept == ["step_000002", "step_000004", "step_000005"] and os.path.isdir(a_base)
    r = run(tmp_path, "chat_eval.py", "--model", str(tmp_path / "sft" / "c"), "--problems", "2", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]  # c loads: its chain c -> b -> a's step 2 -> the base is whole
    msg = one_line_error(run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--run-name", "a", "--steps", "1", *SFT,
                             *lora, "--overwrite"))
    assert "step_000002" in msg and str(tmp_path / "sft" / "b") in msg and os.path.isdir(a_base)
    # once b and c are gone nothing holds a's old checkpoint: a's next save rotates it away
    shutil.rmtree(tmp_path / "sft" / "b")
    shutil.rmtree(tmp_path / "sft" / "c")
    r = run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--run-name", "a", "--steps", "6", *SFT, *lora, "--resume")
    assert r.returncode == 0 and sorted(os.listdir(tmp_path / "sft" / "a" / "checkpoints")) == ["step_000005",
                                                                                                "step_000006"]


def test_rl_resume_keeps_its_idle_count_and_says_what_a_stale_sampler_loses(tmp_path, tiny_chat):
    """What chat_rl carries from step to step comes back on --resume: the count of idle steps in a row (a run
    resumed after two idle steps warns at its third, as the uninterrupted run does). What it cannot bring back, a
    stale sampler's older weights, the resumed run says it lost."""
    rl = ["--init", tiny_chat, "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
          "--eval-problems", "0", "--num-prompts", "8", "--no-dynamic-sampling", "--save-every", "1"]
    assert run(tmp_path, "chat_rl.py", *rl, "--steps", "2").returncode == 0
    r = run(tmp_path, "chat_rl.py", *rl, "--steps", "3", "--resume")
    assert r.returncode == 0 and "3 steps in a row learned nothing" in r.stdout, r.stderr[-2000:]
    r = run(tmp_path, "chat_rl.py", *rl, "--steps", "2", "--staleness", "1", "--run-name", "stale")
    assert r.returncode == 0 and "fresher" not in r.stdout
    r = run(tmp_path, "chat_rl.py", *rl, "--steps", "3", "--staleness", "1", "--run-name", "stale", "--resume")
    assert r.returncode == 0 and "--staleness 1 run samples its first 1 step(s) with weights fresher" in r.stdout
