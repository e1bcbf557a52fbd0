"""lab/forgetting.py at smoke size on conftest.lab_home: its figure, the JSON keys its page quotes, and the mixed
runs' held-out loss of each source (the mixture's metrics reaching a lab page)."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_forgetting_smoke(lab_home, tmp_path):
    data = run_lab("forgetting", lab_home, tmp_path)
    assert data["seeds"] == [0] and set(data["runs"]) == {"new only", "mixed"}
    assert data["mixtures"]["mixed"].endswith("code.jsonl:0.7,$NANOPOST_HOME/data/lab-forgetting/old.jsonl:0.3")
    for name in ("new only", "mixed"):
        for skill in ("old", "new"):
            s = data["summary"][name][skill]
            assert s["change"]["n"] == data["eval_problems"]
            assert s["change"]["diff"] == pytest.approx(s["end"] - data["summary"]["start"][skill], abs=1e-6)
        (run,) = data["runs"][name]
        assert len(run["evals"]["old"]["score"]) == data["eval_problems"] and run["step"]
    mixed, alone = data["runs"]["mixed"][0], data["runs"]["new only"][0]
    assert all(v is not None for v in mixed["val_loss/code"] + mixed["val_loss/old"])  # a source each
    assert all(v is None for v in alone["val_loss/old"])  # one file: no source of its own
    assert set(data["summary"]["mixed_minus_new_only"]) == {"old", "new"}
    assert len(data["commands"]) == 2 and "code.jsonl:0.7" in data["commands"][1]["command"]
