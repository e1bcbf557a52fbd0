"""lab/dpo_likelihood.py (experiment 3) at smoke size, on the lab's tiny home: both DPO runs go under their
own run names, and it writes its figure and the JSON keys docs/lab/dpo_likelihood.md quotes, the changes
from the reference read off the stage's own metrics (rewards / beta)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_smoke_writes_the_figure_and_the_json_the_page_quotes(lab_home, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "dpo_likelihood.py"), "--smoke", "--home",
                        str(lab_home), "--out", str(tmp_path), "--threads", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "dpo_likelihood.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "dpo_likelihood.json").read_text())
    assert {"init", "beta", "steps", "runs", "by_kind", "commands", "seconds", "speed_reference"} <= set(data)
    assert set(data["runs"]) == {"sigmoid", "rpo"} and set(data["by_kind"]) == {"sft", "sigmoid", "rpo"}
    assert "--rpo-alpha 1" in data["commands"][1]["command"] and "--rpo-alpha" not in data["commands"][0]["command"]
    for name, run in data["runs"].items():
        assert os.path.isfile(lab_home / "dpo" / f"lab-dpo_likelihood-{name}" / "eval.json")
        assert {"val_steps", "val_delta_chosen", "val_delta_rejected", "val_margin", "val_pair_accuracy",
                "train_delta_chosen", "train_delta_rejected", "pass@1", "start/pass@1", "pass@1_change",
                "pass@1_change_se", "pair_accuracy", "tool_use_rate", "start/tool_use_rate", "seconds",
                "val_accuracy_by_kind"} <= set(run)
        assert set(run["val_accuracy_by_kind"]) == {"wrong_step", "missing_answer", "rambling"}
        assert run["val_steps"] == [0, 1, 2, 3] and run["val_delta_chosen"][0] == 0.0
        # the curves are the stage's metrics divided by beta: the last held-out point is eval.json's
        assert run["val_delta_chosen"][-1] == pytest.approx(run["rewards/chosen"] / data["beta"], abs=2e-3)
        assert run["val_margin"][-1] == pytest.approx(run["val_delta_chosen"][-1] - run["val_delta_rejected"][-1],
                                                      abs=2e-3)
        for kind, (chosen, rejected) in data["by_kind"][name].items():
            assert chosen < 0 and rejected < 0 and kind in data["by_kind"]["sft"]
