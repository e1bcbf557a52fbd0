"""lab/lenient_verifier.py at smoke size on conftest.lab_home, with 2 seeds (the one experiment whose smoke test
runs two: the seeds' bands and their per-problem means end to end): its figure and the JSON keys its page quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_lenient_verifier_smoke(lab_home, tmp_path):
    data = run_lab("lenient_verifier", lab_home, tmp_path, "--seeds", "2")
    assert data["seeds"] == [0, 1] and data["checkpoints"] == [1, 2] and set(data["foothold"]) == {"sft", "hedged"}
    for name in ("lenient", "strict"):
        assert [r["seed"] for r in data["runs"][name]] == [0, 1]
        for run in data["runs"][name]:
            assert run["eval_step"] == [0, 1, 2] and len(run["evals"]) == 3 and run["step"] == [1, 2]
            for ev in run["evals"]:
                assert all(len(v) == data["eval_problems"] for v in ev["per_problem"].values())
                assert ev["lines"] == pytest.approx(sum(ev["per_problem"]["lines"]) / data["eval_problems"])
        for key in ("strict", "lenient", "lines", "multi", "length"):
            s = data["summary"][name][key]
            assert s["end_seeds"]["seeds"] == 2 and s["change"]["n"] == data["eval_problems"]
            assert s["change"]["diff"] == pytest.approx(s["end"] - s["start"], abs=1e-6)
    assert set(data["summary"]["lenient_minus_strict_at_end"]) == {"strict", "lenient", "lines", "multi"}
    # the hedging SFT, then per seed and configuration its 2 segments (--overwrite, then --resume)
    commands = [c["command"] for c in data["commands"]]
    assert len(commands) == 9 and "chat_sft.py" in commands[0] and "--resume" in commands[2]
