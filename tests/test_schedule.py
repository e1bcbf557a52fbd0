"""The learning-rate schedule, step by step against its formula: linear warmup from base_lr / warmup_steps,
then a cosine from base_lr toward final_ratio * base_lr; and a stage logs exactly that at every step."""
import json
import math

import pytest

from common import lr_at
from test_errors import run, tiny_chat  # noqa: F401 (a fixture)


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


def test_sft_logs_the_schedule_it_was_given(tmp_path, tiny_chat):  # noqa: F811
    r = run(tmp_path, "chat_sft.py", "--init", tiny_chat, "--steps", "6", "--lr", "2e-3", "--warmup-steps", "2",
            "--final-lr-ratio", "0.25", "--num-train", "48", "--num-val", "4", "--eval-problems", "0",
            "--batch-size", "8", "--save-every", "1000")
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "sft" / "default" / "metrics.jsonl") as f:
        logged = {row["step"]: row["lr"] for row in map(json.loads, f) if "lr" in row}
    assert [logged[s + 1] for s in range(6)] == pytest.approx([reference_lr(s, 6, 2e-3, 2, 0.25) for s in range(6)])
