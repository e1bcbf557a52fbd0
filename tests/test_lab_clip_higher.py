"""lab/clip_higher.py at smoke size on conftest.lab_home: its figure and the JSON keys docs/lab/clip_higher.md
quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_clip_higher_smoke(lab_home, tmp_path):
    data = run_lab("clip_higher", lab_home, tmp_path)
    assert list(data["runs"]) == ["eps-0.2", "eps-0.28"]
    assert data["updates"] == ["--ppo-epochs", "2", "--minibatches", "8"]
    for name, runs in data["runs"].items():
        run = runs[0]
        assert run["step"] == [1, 2] and len(run["entropy"]) == len(run["clip_frac"]) == 2
        assert len(run["pass@k"]) == data["k"] and run["pass@k"] == sorted(run["pass@k"])  # pass@k grows with k
        assert {"entropy_first", "entropy_last", "clip_frac", "pass@1", "minus_start", "start_catches_up_at_k"} <= \
            data["summary"][name].keys()
    assert "pass@1_0.28_minus_0.2" in data["summary"] and len(data["start"]["pass@k"]) == data["k"]
    commands = [c["command"] for c in data["commands"]]
    assert all("--ppo-epochs 2 --minibatches 8" in c for c in commands)
    assert "--eps-high 0.2 " in commands[0] and "--eps-high 0.28 " in commands[1]
