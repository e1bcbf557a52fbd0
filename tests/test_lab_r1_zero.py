"""lab/r1_zero.py at smoke size on conftest.lab_home: its figure and the JSON keys docs/lab/r1_zero.md quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_r1_zero_smoke(lab_home, tmp_path):
    data = run_lab("r1_zero", lab_home, tmp_path)
    assert data["reward"] == "verifier+0.1*format" and data["tools"] is False
    sel = data["selection"]
    assert sel["train"]["problems"] == data["select_train"] and sum(sel["train"]["right_of_k"].values()) == \
        data["select_train"] and len(sel["train"]["right_of_k"]) == data["select_k"] + 1
    for name in ("base", "sft"):
        for run in data["runs"][name]:
            assert run["step"] == [1, 2] and len(run["format_rate"]) == len(run["length"]) == 2
            assert run["eval_step"] == [0, 1, 2] and len(run["heldout_accuracy_t1"]) == 3
            assert len(run["start"]["score"]) == len(run["end"]["score"]) == sel["heldout"]["kept"]
        s = data["summary"][name]
        assert s["heldout_accuracy"]["change"]["n"] == sel["heldout"]["kept"]
        assert {"format_rate", "mean_length", "steps_accuracy", "steps_length", "steps_format_rate"} <= s.keys()
    commands = [c["command"] for c in data["commands"]]
    assert "--prompt-format plain" in commands[0] and "--prompt-format chat" in commands[-1]
    assert all("--no-dynamic-sampling" in c and "--tools" not in c for c in commands)
