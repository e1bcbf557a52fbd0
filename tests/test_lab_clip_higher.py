"""lab/clip_higher.py at smoke size, on the tiny home tests/conftest.py builds: it writes its figure and the JSON
keys docs/lab/clip_higher.md quotes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_clip_higher_smoke(lab_home, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "clip_higher.py"), "--home", str(lab_home), "--out",
                        str(tmp_path), "--smoke", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "clip_higher.png").stat().st_size > 0
    data = json.loads((tmp_path / "clip_higher.json").read_text())
    assert list(data["runs"]) == ["default", "minibatches-8"]
    assert all(list(runs) == ["eps-0.2", "eps-0.28"] for runs in data["runs"].values())
    assert data["runs"]["minibatches-8"]["eps-0.2"]["flags"] == ["--minibatches", "8", "--eps-high", "0.2"]
    for run in [run for runs in data["runs"].values() for run in runs.values()]:
        assert len(run["step"]) == len(run["entropy"]) == len(run["clip_frac"]) == len(run["accuracy"]) == 2 and run["eval_step"] == [0, 1, 2]
        assert list(run["pass@k"]) == ["1", "2"] and all(len(v) == 3 for v in run["pass@k"].values())
        assert len(run["greedy_pass@1"]) == 3
    large = data["large_k"]
    assert list(large["pass@k"]) == ["sft", "eps-0.2", "eps-0.28"] and large["samples"] == 4
    assert all(list(v) == ["1", "2", "3", "4"] for v in large["pass@k"].values())
    # pass@k never falls as k grows
    assert all(v["1"] <= v["2"] <= v["3"] <= v["4"] for v in large["pass@k"].values())
    assert len(data["commands"]) == 7 and data["seconds"] > 0
