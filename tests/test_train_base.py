"""Checkpoints, gradient accumulation and 2-rank DDP on real base_train.py runs (kill and resume: test_resume.py)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checkpoint import latest_checkpoint, list_checkpoints, load_hf, pin_bases, resolve_model_path, save_checkpoint
from common import UserError
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--n-kv-head", "2", "--seq-len", "128",
        "--num-docs", "400", "--vocab-size", "400", "--eval-problems", "0", "--eval-every", "1000",
        "--warmup-steps", "2"]


def base_cmd(*extra, nproc=1):
    if nproc == 1:
        return [sys.executable, os.path.join(REPO, "base_train.py"), *TINY, *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(REPO, "base_train.py"), *TINY, *extra]


def env_for(home):
    return {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}


def losses(home, run="default"):
    out = {}
    with open(os.path.join(home, "base", run, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                out[row["step"]] = row["loss"]  # a step re-run after resume overwrites the killed one
    return out


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    m = GPT(GPTConfig(vocab_size=50, n_layer=1, n_embd=16, n_head=2, n_kv_head=1, head_dim=8, intermediate_size=32))
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, m, state={"note": step})
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_000002", "step_000003"]
    # a save killed half-way leaves only a .tmp folder, which is never mistaken for a checkpoint
    os.makedirs(tmp_path / "checkpoints" / "step_000004.tmp")
    (tmp_path / "checkpoints" / "step_000004.tmp" / "config.json").write_text("{")
    assert latest_checkpoint(str(tmp_path)).endswith("step_000003")
    assert resolve_model_path(str(tmp_path)).endswith("step_000003")
    with pytest.raises(UserError, match="run the stage that makes it first"):
        resolve_model_path(str(tmp_path / "nothing"))


def test_rotation_keeps_a_checkpoint_another_runs_adapter_is_built_on(tmp_path):
    """pin_bases marks a checkpoint as the base of a LoRA run's adapters: this run's rotation keeps it while
    that run holds checkpoints, and lets it go once the dependent run is gone."""
    m = GPT(GPTConfig(vocab_size=50, n_layer=1, n_embd=16, n_head=2, n_kv_head=1, head_dim=8, intermediate_size=32))
    run, dependent = tmp_path / "a", tmp_path / "b"
    save_checkpoint(str(run), 1, m)
    save_checkpoint(str(dependent), 1, m)
    pin_bases(str(run / "checkpoints" / "step_000001"), str(dependent))
    for step in (2, 3):
        save_checkpoint(str(run), step, m)
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000001", "step_000002", "step_000003"]
    shutil.rmtree(dependent)
    save_checkpoint(str(run), 4, m)
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000003", "step_000004"]


@pytest.mark.slow
def test_gradient_accumulation_and_two_ranks_equal_one_big_batch(tmp_path):
    steps = ["--steps", "4", "--batch-size", "8", "--save-every", "1000"]
    subprocess.run(base_cmd(*steps, "--device-batch-size", "8"), env=env_for(tmp_path / "one"), check=True,
                   capture_output=True)
    subprocess.run(base_cmd(*steps, "--device-batch-size", "2"), env=env_for(tmp_path / "accum"), check=True,
                   capture_output=True)
    r = subprocess.run(base_cmd(*steps, "--device-batch-size", "4", nproc=2), env=env_for(tmp_path / "ddp"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    one, accum, ddp = losses(tmp_path / "one"), losses(tmp_path / "accum"), losses(tmp_path / "ddp")
    for other in (accum, ddp):
        assert sorted(other) == sorted(one)
        for s in one:
            assert abs(other[s] - one[s]) < 1e-4, (s, one[s], other[s])
    # the weights after 4 steps agree too
    w = [load_hf(latest_checkpoint(str(h / "base" / "default"))).state_dict()
         for h in (tmp_path / "one", tmp_path / "ddp")]
    for k in w[0]:
        torch.testing.assert_close(w[0][k], w[1][k], atol=1e-4, rtol=1e-3)
