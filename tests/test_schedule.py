"""The learning-rate schedule, step by step against its formula: linear warmup from base_lr / warmup_steps,
then a cosine from base_lr toward final_ratio * base_lr; and every stage logs exactly that at every step, with
AdamW's weight decay and the gradient clip its flags name."""
import importlib
import math

import pytest

from common import lr_at
from inprocess import run_stage, spy
from test_errors import tiny_chat  # noqa: F401 (a fixture)


def reference_lr(step, total, base, warmup, final):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / (total - warmup)
    return base * (final + (1 - final) * (1 + math.cos(math.pi * t)) / 2)


@pytest.mark.parametrize("total,warmup,final", [(5, 2, 0.1), (12, 0, 0.0), (10, 3, 1.0), (7, 1, 0.5)])
def test_lr_at_follows_the_formula_step_by_step(total, warmup, final):
    got = [lr_at(s, total, 2e-3, warmup, final) for s in range(total)]
    assert got == pytest.approx([reference_lr(s, total, 2e-3, warmup, final) for s in range(total)], rel=1e-12)
    if warmup:
        assert got[warmup - 1] == pytest.approx(2e-3) and got[0] == pytest.approx(2e-3 / warmup)  # peaks, from lr/W
    assert max(got) == pytest.approx(2e-3)
    if final == 1.0:
        assert got[warmup:] == pytest.approx([2e-3] * (total - warmup))  # constant after warmup


# ------------------------------------------------------------------------------------------------
# Every training stage: the schedule its --lr / --warmup-steps / --final-lr-ratio give, AdamW's --weight-decay on the
# matrices only, the gradient clipped at --grad-clip (a real run of main, tests/inprocess.py)

SCHEDULE_RUNS = {  # stage: its module, the flags of a 3-step run on the tiny model, where its cosine ends (None: at
    # --final-lr-ratio), whether it takes --weight-decay
    "base": ("base_train", ["--tokenizer", "{init}", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                            "--n-kv-head", "1", "--num-docs", "40", "--seq-len", "64", "--batch-size", "2",
                            "--device-batch-size", "2", "--eval-problems", "0"], 0.1, True),
    "sft": ("chat_sft", ["--init", "{init}", "--num-train", "24", "--num-val", "4", "--eval-problems", "0",
                         "--batch-size", "4", "--device-batch-size", "4"], None, True),
    "rm": ("chat_rm", ["--init", "{init}", "--num-train", "16", "--num-val", "4", "--batch-size", "4"], None, True),
    "dpo": ("chat_dpo", ["--init", "{init}", "--num-train", "16", "--num-val", "4", "--eval-problems", "0",
                         "--batch-size", "4"], None, True),
    "kto": ("chat_kto", ["--init", "{init}", "--num-train", "16", "--num-val", "4", "--eval-problems", "0",
                         "--batch-size", "4"], None, True),
    "rl": ("chat_rl", ["--init", "{init}", "--num-prompts", "8", "--prompts-per-step", "2", "--group-size", "2",
                       "--max-new-tokens", "4", "--eval-problems", "0",  # warmup, then constant; the tiny model's
                       "--no-dynamic-sampling"], 1.0, False),  # groups are all flat, and kept flat groups train nothing
    "ppo": ("chat_ppo", ["--init", "{init}", "--num-prompts", "8", "--prompts-per-step", "2", "--samples-per-prompt",
                         "2", "--max-new-tokens", "4", "--eval-problems", "0", "--critic-lr", "5e-3"], 1.0, False),
    "distill": ("chat_distill", ["--init", "{init}", "--teacher", "{init}", "--num-prompts", "8", "--prompts-per-step",
                                 "2", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--eval-problems", "0"],
                1.0, False),
}


@pytest.mark.parametrize("stage", sorted(SCHEDULE_RUNS))
def test_every_stage_follows_its_schedule_decay_and_clip_flags(monkeypatch, tmp_path, tiny_chat, stage):  # noqa: F811
    module_name, flags, final, decays = SCHEDULE_RUNS[stage]
    module = importlib.import_module(module_name)
    argv = [f.format(init=tiny_chat) for f in flags] + ["--steps", "3", "--lr", "2e-3", "--warmup-steps", "1",
                                                         "--grad-clip", "0.7", "--save-every", "100"]
    argv += ["--weight-decay", "0.05"] if decays else []
    if final is None:
        argv, final = argv + ["--final-lr-ratio", "0.25"], 0.25
    opt = spy(monkeypatch, module, "make_optimizer")
    # distillation steps through chat_rl.update_policy
    steps = spy(monkeypatch, importlib.import_module("chat_rl") if stage == "distill" else module, "optimizer_step")
    lrs = spy(monkeypatch, module, "set_lr")
    rows = [r for r in run_stage(monkeypatch, tmp_path, module, *argv) if "lr" in r]
    want = [reference_lr(s, 3, 2e-3, 1, final) for s in range(3)]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12)
    if stage == "ppo":  # the critic: its own --critic-lr on the same schedule
        assert [c.args[1] for c in lrs[1::2]] == pytest.approx([reference_lr(s, 3, 5e-3, 1, 1.0) for s in range(3)])
    for call in opt:  # AdamW decays the matrices by --weight-decay (0 where the stage has no flag), never the gains
        group_of = {id(p): g["weight_decay"] for g in call.out.param_groups for p in g["params"]}
        for p in call.args[0].parameters():
            if p.requires_grad:
                assert group_of[id(p)] == (0.05 if decays and p.dim() >= 2 else 0.0)
    assert steps and all(c.args[2] == 0.7 for c in steps)
