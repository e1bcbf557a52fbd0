"""lab/length_bias.py at smoke size on conftest.lab_home: its figure and the JSON keys docs/lab/length_bias.md
quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_length_bias_smoke(lab_home, tmp_path):
    data = run_lab("length_bias", lab_home, tmp_path)
    assert list(data["runs"]) == ["grpo", "token-mean", "dr-grpo"] and data["tools"] is False
    for name, runs in data["runs"].items():
        run = runs[0]
        assert run["step"] == [1, 2] and len(run["length_wrong"]) == len(run["length_correct"]) == 2
        assert all(len(v) == data["eval_problems"] for v in run["end"].values())
        s = data["summary"][name]
        assert {"wrong", "right", "accuracy", "cv", "minus_dr_grpo", "wrong_minus_start"} <= s.keys()
    commands = [c["command"] for c in data["commands"]]
    assert "--agg seq-mean-token-mean" in commands[0] and "--scale none --agg seq-mean-token-sum-norm" in commands[2]
