"""lab/grid.py at smoke size on conftest.lab_home: every one of the nine cells runs (its command, or for a DPO cell
whose grader told no pair apart, none), is graded on the same held-out problems, paired with the start."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_grid_smoke(lab_home, tmp_path):
    data = run_lab("grid", lab_home, tmp_path)
    assert set(data["cells"]) == {f"{g} x {m}" for g in ("reward model", "judge", "verifier")
                                  for m in ("PPO", "GRPO", "DPO")}
    for name, cell in data["cells"].items():
        assert len(cell["score"]) == data["eval_problems"] and cell["change"]["n"] == data["eval_problems"]
        assert cell["change"]["diff"] == pytest.approx(cell["pass@1"] - data["start"]["pass@1"], abs=1e-6)
        if cell["method"] == "DPO":
            assert cell["pairs"] is not None
        else:  # the verifier logged beside the reward: the gold of the training batches
            assert cell["gold_first"] is not None and cell["seconds"] > 0
    commands = " ".join(c["command"] for c in data["commands"])
    assert "judge:standin:arithmetic+0*verifier" in commands and "--pairs-judge standin:arithmetic" in commands
    assert commands.count("chat_ppo.py") == 3 and commands.count("chat_rl.py") == 3
    assert commands.count("chat_sample.py") == 3
