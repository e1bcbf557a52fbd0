"""What the loops draw from and report, against the definitions: a step's rows (packing.epoch_batch: every epoch a
new permutation of all the rows, a pure function of seed and step), a rank's prompts (rollout.draw_prompts: a pure
function of seed, step, round and rank, so ranks train on different prompts), the rows --data and --eval-data make
train and hold out, and the held-out evaluation's problems and sampling settings, in every stage that has them (a
real run of main, tests/inprocess.py); merge.py's --dtype; memory.py's --nproc."""
import importlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import evaluation
import memory
import merge
import preferences
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
    "sft": ("chat_sft", "mixture_rows", lambda n: sft_conversations("train", n, seed=5),
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


HELD_OUT_SEEN = {"sft": "render_examples", "rm": "render_pairs", "dpo": "pair_items", "kto": "pair_items",
                 "rl": "rl_rows", "ppo": "rl_rows", "distill": "rl_rows"}  # the function whose last call sees them


@pytest.mark.parametrize("stage", sorted(DATA_RUNS))
def test_eval_data_alone_is_what_each_stage_holds_out(monkeypatch, tmp_path, tiny_chat, stage):
    """--eval-data FILE without --data: the embedded world's rows train, FILE's rows are held out. RM, DPO, KTO,
    RL, PPO and distillation once ignored FILE there and held out the world's test rows, drawn by --seed (a lab
    experiment's GRPO runs evaluated the same start at 0.60, 0.56 and 0.54, by seed)."""
    module_name, _, make, flags = DATA_RUNS[stage]
    module = importlib.import_module(module_name)
    eval_rows = make(4)[::-1]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    size = ["--num-prompts", "8"] if HELD_OUT_SEEN[stage] == "rl_rows" else ["--num-train", "16"]
    argv = ["--init", tiny_chat, "--eval-data", str(tmp_path / "eval.jsonl"), "--steps", "1", "--save-every", "100",
            *size, *[f.format(init=tiny_chat) for f in flags]]
    calls = spy(monkeypatch, module, HELD_OUT_SEEN[stage])
    run_stage(monkeypatch, tmp_path, module, *argv)
    held = calls[-1].out[1] if HELD_OUT_SEEN[stage] == "rl_rows" else calls[-1].args[1]
    key = "messages" if stage == "sft" else "prompt"
    want = eval_rows[:3] if HELD_OUT_SEEN[stage] == "rl_rows" else eval_rows  # at most --eval-problems 3
    assert {json.dumps(r[key]) for r in held} == {json.dumps(r[key]) for r in want}  # KTO pairs its singles up


EVAL_RUNS = {  # stage: its module, the flags of a one-step run that evaluates held-out problems before and after
    "sft": ("chat_sft", ["--num-train", "24", "--num-val", "4", "--batch-size", "4", "--device-batch-size", "4"]),
    "dpo": ("chat_dpo", ["--num-train", "8", "--num-val", "2", "--batch-size", "4"]),
    "kto": ("chat_kto", ["--num-train", "8", "--num-val", "2", "--batch-size", "4"]),
    "rl": ("chat_rl", ["--num-prompts", "8", "--prompts-per-step", "2", "--group-size", "2"]),
    "ppo": ("chat_ppo", ["--num-prompts", "8", "--prompts-per-step", "2"]),
    "distill": ("chat_distill", ["--teacher", "{init}", "--num-prompts", "8", "--prompts-per-step", "2"]),
}
EVAL_FLAGS = [["--temperature", "0.7"], ["--top-k", "5"], ["--top-p", "0.5"], ["--pass-k", "3"], ["--tools"],
              ["--eval-problems", "3"], ["--max-new-tokens", "5"]]
SAMPLING = ("--temperature", "--top-k", "--top-p")  # DPO's and KTO's --temperature is --pairs on-policy's


def evaluates(stage, flag):
    parser = importlib.import_module(EVAL_RUNS[stage][0]).parser
    return flag in parser._option_string_actions and (stage not in ("dpo", "kto") or flag not in SAMPLING)


@pytest.mark.parametrize("stage, flags", [(stage, flags) for stage in sorted(EVAL_RUNS) for flags in EVAL_FLAGS
                                          if evaluates(stage, flags[0])],
                         ids=lambda v: v if isinstance(v, str) else "_".join(x.lstrip("-") for x in v))
def test_held_out_evaluation_samples_as_the_flags_say(monkeypatch, tmp_path, tiny_chat, stage, flags):
    """A stage's held-out evaluation (before and after training; SFT's after): --eval-problems problems answered
    greedily, and where the stage has --pass-k that many answers each, sampled from the training distribution
    (--temperature, --top-k, --top-p; SFT's at temperature 1), with the calculator under --tools."""
    module_name, extra = EVAL_RUNS[stage]
    module = importlib.import_module(module_name)
    own = module.parser._option_string_actions
    argv = ["--init", tiny_chat, "--steps", "1", "--max-new-tokens", "3", "--eval-problems", "2", "--save-every", "100",
            *(["--pass-k", "2"] if "--pass-k" in own else []), *[f.format(init=tiny_chat) for f in extra], *flags]
    args = module.parser.parse_args(argv)
    calls = spy(monkeypatch, evaluation, "evaluate_chat")
    through_preferences = spy(monkeypatch, preferences, "evaluate_chat")  # DPO's and KTO's
    run_stage(monkeypatch, tmp_path, module, *argv)
    calls = calls + through_preferences
    problems = rl_prompts("test", args.eval_problems, seed=args.seed)
    pass_k = getattr(args, "pass_k", 0)
    greedy = [c for c in calls if c.kwargs.get("num_samples", 1) == 1 and c.args[2] == problems]
    sampled = [c for c in calls if pass_k > 1 and c.kwargs.get("num_samples", 1) == pass_k and c.args[2] == problems]
    # before and after (SFT: after; distillation also evaluates the teacher at the start)
    assert len(greedy) >= (1 if stage == "sft" else 2) and len(sampled) == (len(greedy) if pass_k > 1 else 0)
    for c in greedy:
        assert c.kwargs.get("temperature", 0.0) == 0.0
    for c in sampled + greedy:
        assert c.kwargs["use_tools"] == args.tools and c.kwargs["max_new_tokens"] == args.max_new_tokens
    for c in sampled:
        assert (c.kwargs["temperature"], c.kwargs.get("top_k"), c.kwargs.get("top_p")) == \
            (getattr(args, "temperature", 1.0), getattr(args, "top_k", None), getattr(args, "top_p", None))
