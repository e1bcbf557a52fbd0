"""lab/rejection_vs_rl.py at smoke size on conftest.lab_home: its figure and the JSON keys its page quotes; the two
methods drew the same answers at every evaluation."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_rejection_vs_rl_smoke(lab_home, tmp_path):
    data = run_lab("rejection_vs_rl", lab_home, tmp_path)
    per_round = data["prompts_per_round"] * data["samples"]
    assert data["answers_drawn"] == [per_round * r for r in range(data["rounds"] + 1)]
    rejection, grpo = data["runs"]["rejection"][0], data["runs"]["grpo"][0]
    assert grpo["answers_drawn"] == data["answers_drawn"]  # GRPO evaluated after each round's worth of answers
    assert len(rejection["pass@1"]) == len(grpo["pass@1"]) == data["rounds"] + 1
    assert rejection["pass@1"][0] == grpo["pass@1"][0] == data["start"]["greedy"]  # the same start, both measured
    assert len(rejection["kept"]) == data["rounds"] and all(k >= 2 for k in rejection["kept"])
    for run in (rejection, grpo):
        assert len(run["pass@k"]) == data["k"] and len(run["sampled"]["correct"]) == data["eval_problems"]
    for key in ("greedy", "pass@1_t1", f"pass@{data['k']}_t1"):
        s = data["summary"][key]
        assert {"start", "rejection", "grpo", "grpo_minus_rejection", "rejection_minus_start"} <= s.keys()
        assert s["grpo_minus_rejection"]["n"] == data["eval_problems"]
    # per round a sampling and an SFT, then one GRPO run
    commands = [c["command"] for c in data["commands"]]
    assert [c.split()[1] for c in commands] == ["chat_sample.py", "chat_sft.py"] * data["rounds"] + ["chat_rl.py"]
    assert "--no-dynamic-sampling" in commands[-1]
