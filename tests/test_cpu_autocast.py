"""Training forwards on CPU autocast to bfloat16 where the CPU has bfloat16 units (common.train_dtype), float32
elsewhere; $NANOPOST_CPU_AUTOCAST overrides. The choice must reach the training loss, and a bfloat16 run must
repeat itself to the last digit, as a float32 one does (the rest of the suite pins float32: conftest.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import common
from common import UserError, autocast, train_dtype
from test_pipeline import PIPELINE, REPO


@pytest.mark.parametrize("choice, units, dtype", [("auto", True, torch.bfloat16), ("auto", False, torch.float32),
                                                  ("float32", True, torch.float32),
                                                  ("bfloat16", False, torch.bfloat16)])
def test_the_cpu_trains_in_bfloat16_only_where_it_has_the_units_unless_told(monkeypatch, choice, units, dtype):
    monkeypatch.setenv("NANOPOST_CPU_AUTOCAST", choice)
    monkeypatch.setattr(common, "cpu_has_bf16_units", lambda: units)
    assert train_dtype("cpu") == dtype
    with autocast("cpu"):
        out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == dtype  # what autocast() does with it, not only what train_dtype says


def test_a_misspelt_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv("NANOPOST_CPU_AUTOCAST", "bf16")
    with pytest.raises(UserError, match="NANOPOST_CPU_AUTOCAST=bf16: expected auto, float32 or bfloat16"):
        train_dtype("cpu")


def base_run(home, choice):
    """base_train.py as test_pipeline shrinks it; returns (its metrics lines, its stdout)."""
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1", "NANOPOST_CPU_AUTOCAST": choice}
    _, script, args = PIPELINE[0]
    r = subprocess.run([sys.executable, os.path.join(REPO, script), *args, "--eval-every", "2"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(home / "base" / "default" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    drop = ("time", "tokens_per_s", "peak_mem_mb")  # the machine's figures, not the model's
    return [{k: v for k, v in row.items() if k not in drop} for row in rows], r.stdout


def test_bfloat16_reaches_the_loss_and_repeats_itself(tmp_path):
    first, out = base_run(tmp_path / "a", "bfloat16")
    second, _ = base_run(tmp_path / "b", "bfloat16")
    float32, out32 = base_run(tmp_path / "c", "float32")
    assert "training forwards compute in bfloat16" in out and "training forwards compute in float32" in out32
    assert first == second, "two bfloat16 runs of one command logged different numbers"
    losses = [(a["loss"], b["loss"]) for a, b in zip(first, float32) if "loss" in a]
    assert len(losses) == 4 and first != float32, "bfloat16 and float32 trained alike: the choice never reached the loss"
    assert all(abs(a - b) < 0.01 * b for a, b in losses), f"bfloat16 strays from float32: {losses}"
