"""lab/sampler_trainer.py and lab/staleness.py (the two halves of docs/lab/sampler_trainer.md) at smoke size, on the
tiny home tests/conftest.py builds: each writes its figure and the JSON keys the page quotes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_lab(name, home, out):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", f"{name}.py"), "--home", str(home), "--out", str(out),
                        "--smoke", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_sampler_trainer_smoke(lab_home, tmp_path):
    data = run_lab("sampler_trainer", lab_home, tmp_path)
    f32, bf16 = data["one_batch"]["float32"], data["one_batch"]["bfloat16"]
    # one batch: the float32 engine is the trainer to float noise, the bfloat16 one is not
    assert f32["gap_max"] < 1e-5 < bf16["gap_mean"]
    assert sum(bf16["gap_histogram"]["counts"]) == bf16["tokens"] and sum(bf16["tis_histogram"]["counts"]) == bf16["tokens"]
    for key in ("gap_median", "gap_p99", "tis_mean", "tis_capped_frac", "mask_dropped_frac", "sample_tok_per_s"):
        assert key in bf16 and key in f32
    assert list(data["runs"]) == ["float32-tis", "bfloat16-none", "bfloat16-tis", "bfloat16-mask"]
    runs = data["runs"]
    assert max(runs["float32-tis"]["logprob_mismatch"]) < 1e-5 < min(runs["bfloat16-none"]["logprob_mismatch"])
    for run in runs.values():
        assert len(run["step"]) == len(run["correction_mean"]) == len(run["masked_frac"]) == len(run["accuracy"]) == 2
        assert set(run["heldout_pass@1"]) == {"start", "end"} and run["sample_tok_per_s"][0] > 0
    assert len(data["commands"]) == 5


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_staleness_smoke(lab_home, tmp_path):
    data = run_lab("staleness", lab_home, tmp_path)
    runs = data["runs"]
    assert list(runs) == ["k0-tis", "k0-none", "k1-tis", "k1-none", "k4-tis", "k4-none", "offpolicy-tis"]
    # the staleness each run trained at, step by step (k = 4 reaches 4 only after 4 steps: the smoke runs 3)
    assert runs["k0-tis"]["staleness"] == {"0": 3} and runs["k1-none"]["staleness"] == {"0": 1, "1": 2}
    assert runs["k4-tis"]["staleness"] == {"0": 1, "1": 1, "2": 1} and runs["offpolicy-tis"]["staleness"] == {"0": 1, "1": 2}
    for run in runs.values():
        for key in ("steps_per_min", "reward_2nd_half", "pass@1", "pass@1_t1", "logprob_mismatch", "correction_mean",
                    "clip_frac", "ratio_mean"):
            assert isinstance(run[key], float)
    assert "pass@1" in data["start"] and data["table"].count("\n") == 8
