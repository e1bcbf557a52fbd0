"""What the loops draw from, against its definition: a step's rows (packing.epoch_batch: every epoch a new
permutation of all the rows, a pure function of seed and step) and a rank's prompts (rollout.draw_prompts: a
pure function of seed, step, round and rank, so ranks train on different prompts); merge.py's --dtype, a real
run of its main (tests/inprocess.py); memory.py's --nproc; and --data / --eval-data of every training stage."""
import importlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import memory
import merge
from inprocess import run_stage, spy
from packing import epoch_batch
from rollout import draw_prompts
from tasks import preference_pairs, rl_prompts, sft_conversations
from test_errors import tiny_chat  # noqa: F401 (a fixture)
from test_merge import save_tiny


def test_every_epoch_is_a_new_permutation_of_all_the_rows():
    n, batch = 10, 4
    rows = [i for step in range(5) for i in epoch_batch(n, step, batch, seed=3)]  # 20 rows: two epochs
    first, second = rows[:n], rows[n:2 * n]
    assert sorted(first) == sorted(second) == list(range(n))   # each epoch reads every row once
    assert first != second                                     # in a new order
    assert epoch_batch(n, 3, batch, seed=3) == rows[12:16]     # a pure function of (seed, step): resume reads the same
    assert epoch_batch(n, 0, batch, seed=4) != rows[:4]        # and the seed chooses the order


def test_ranks_steps_rounds_and_seeds_draw_different_prompts():
    rows = [{"id": i} for i in range(1000)]
    draw = lambda **kw: [r["id"] for r in draw_prompts(rows, 8, **{**dict(seed=0, step=0, rank=0), **kw})[0]]  # noqa: E731
    base = draw()
    assert draw() == base                                      # a pure function: a resumed run draws the same
    for change in (dict(rank=1), dict(step=1), dict(round_=1), dict(seed=1)):
        assert draw(**change) != base, change                  # every part of the key moves the draw
    seeds = {draw_prompts(rows, 8, seed=0, step=0, rank=r)[1] for r in range(4)}
    assert len(seeds) == 4                                     # and each rank samples its answers with its own seed


@pytest.mark.parametrize("dtype", ["input", "float32"])
def test_merge_writes_the_dtype_its_flag_names(monkeypatch, tmp_path, tok, dtype):
    a = save_tiny(tmp_path / "a", tok, seed=0, dtype=torch.bfloat16)
    b = save_tiny(tmp_path / "b", tok, seed=1, dtype=torch.bfloat16)
    run_stage(monkeypatch, tmp_path, merge, a, b, "--out", str(tmp_path / "soup"), "--weights", "0.25,0.75",
              "--dtype", dtype)
    ta, tb = (load_file(os.path.join(f, "model.safetensors")) for f in (a, b))
    got = load_file(str(tmp_path / "soup" / "model.safetensors"))
    for k in ta:  # summed in float32, written in the inputs' dtype (bfloat16) or in float32
        want = 0.25 * ta[k].float() + 0.75 * tb[k].float()
        torch.testing.assert_close(got[k], want if dtype == "float32" else want.bfloat16(), rtol=0, atol=0)


def test_memory_nproc_gives_each_ranks_share(tmp_path, tok):
    """python memory.py --init FOLDER --nproc N STAGE [flags]: the stage's estimate per device for N ranks; with
    --fsdp each rank holds 1/N of the sharded optimizer state."""
    folder = save_tiny(tmp_path / "m", tok, seed=0)
    one = memory.run_estimate(["--init", folder, "sft", "--fsdp"])
    two = memory.run_estimate(["--init", folder, "--nproc", "2", "sft", "--fsdp"])
    assert two["optimizer"] == pytest.approx(one["optimizer"] / 2, rel=0.02) and two["total"] < one["total"]


DATA_RUNS = {  # stage: its module, where its rows are split (a spy there), its rows, the flags of a one-step run
    "sft": ("chat_sft", "split_heldout", lambda n: sft_conversations("train", n, seed=5),
            ["--eval-problems", "0", "--batch-size", "4", "--device-batch-size", "4"]),
    "rm": ("chat_rm", "split_heldout", lambda n: preference_pairs("train", n, seed=5), ["--batch-size", "4"]),
    "dpo": ("chat_dpo", "split_heldout", lambda n: preference_pairs("train", n, seed=5),
            ["--eval-problems", "0", "--batch-size", "4"]),
    "kto": ("chat_kto", "split_heldout", lambda n: [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                                                   for p in preference_pairs("train", n // 2, seed=5)
                                                   for side in ("chosen", "rejected")],
            ["--eval-problems", "0", "--batch-size", "4"]),
    "rl": ("chat_rl", "rl_rows", lambda n: rl_prompts("train", n, seed=5),
           ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "3"]),
    "ppo": ("chat_ppo", "rl_rows", lambda n: rl_prompts("train", n, seed=5),
            ["--prompts-per-step", "2", "--max-new-tokens", "4", "--eval-problems", "3", "--pass-k", "1"]),
    "distill": ("chat_distill", "rl_rows", lambda n: rl_prompts("train", n, seed=5),
                ["--teacher", "{init}", "--prompts-per-step", "2", "--max-new-tokens", "4", "--eval-problems", "3",
                 "--pass-k", "1"]),
}


@pytest.mark.parametrize("held_out", [False, True], ids=["data", "data_eval-data"])
@pytest.mark.parametrize("stage", sorted(DATA_RUNS))
def test_data_and_eval_data_are_the_rows_each_stage_trains_and_holds_out(monkeypatch, tmp_path, tiny_chat, stage,
                                                                        held_out):
    """--data FILE: its rows train, but for its last 2% (at least one), held out; with --eval-data FILE2 every row
    of FILE trains and FILE2's are held out (the sampling stages evaluate at most --eval-problems of them)."""
    module_name, split, make, flags = DATA_RUNS[stage]
    module = importlib.import_module(module_name)
    rows, eval_rows = make(60), make(4)[::-1]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    argv = ["--init", tiny_chat, "--data", str(tmp_path / "train.jsonl"), "--steps", "1", "--save-every", "100",
            *[f.format(init=tiny_chat) for f in flags]] + (["--eval-data", str(tmp_path / "eval.jsonl")] if held_out else [])
    calls = spy(monkeypatch, module, split)
    run_stage(monkeypatch, tmp_path, module, *argv)
    train, held = calls[0].out
    want_train, want_held = (rows, eval_rows) if held_out else (rows[:-1], rows[-1:])  # 60 rows: 2% is one
    if split == "rl_rows":
        want_held = want_held[:3]
    key = "messages" if stage == "sft" else "completion" if stage == "kto" else "prompt"
    assert [r[key] for r in train] == [r[key] for r in want_train]
    assert [r[key] for r in held] == [r[key] for r in want_held]
