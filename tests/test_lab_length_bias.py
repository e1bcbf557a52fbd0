"""lab/length_bias.py at smoke size, on the tiny home tests/conftest.py builds: it writes its figure and the JSON
keys docs/lab/length_bias.md quotes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_length_bias_smoke(lab_home, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "length_bias.py"), "--home", str(lab_home), "--out",
                        str(tmp_path), "--smoke", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "length_bias.png").stat().st_size > 0
    data = json.loads((tmp_path / "length_bias.json").read_text())
    # the smoke home has no calculator: the variant without it only
    assert list(data["runs"]) == ["no-tools"] and list(data["runs"]["no-tools"]) == ["grpo", "token-mean", "dr-grpo"]
    for run in data["runs"]["no-tools"].values():
        assert len(run["step"]) == len(run["length_correct"]) == len(run["length_wrong"]) == len(run["accuracy"]) == 2
        assert len(run["truncated_frac"]) == len(run["tool_use_rate"]) == 2  # the page quotes both
        assert set(run["first_step"]) == set(run["end"]) == {"length_correct", "length_wrong", "accuracy"}
        assert set(run["heldout_pass@1"]) == {"start", "end"} and run["seconds"] > 0 and "--tools" not in run["flags"]
    assert len(data["commands"]) == 3 and data["seconds"] > 0 and "speed_reference" in data
