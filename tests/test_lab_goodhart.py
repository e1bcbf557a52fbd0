"""lab/goodhart.py at smoke size on conftest.lab_home: its figure and the JSON keys docs/lab/goodhart.md quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_goodhart_smoke(lab_home, tmp_path):
    data = run_lab("goodhart", lab_home, tmp_path)
    bon = data["summary"]["bon"]
    assert bon["n"] == [1, 2, 4, 8] and bon["sqrt_kl"][0] == 0.0 and len(bon["gold_interval"]) == 4
    assert all(lo <= g <= hi for g, (lo, hi) in zip(bon["gold"], bon["gold_interval"]))
    assert bon["proxy"] == sorted(bon["proxy"])  # the best of more answers scores at least as high on the proxy
    seed = data["seeds_data"][0]
    assert seed["pairs"] > 0 and len(seed["bon"]["per_problem_gold"][0]) == data["bon_problems"]
    assert list(seed["rl"]) == ["beta=0", "beta=0.04", "beta=0.4"] == [k for k in data["summary"] if "beta" in k]
    for run in seed["rl"].values():
        assert run["step"] == [1, 2] and run["sqrt_kl"][0] == 0.0  # the first batch is sampled by the start
        assert [h["step"] for h in run["heldout"]] == [0, 1, 2] and run["heldout"][0]["sqrt_kl"] == 0.0
    commands = [c["command"].split()[1] for c in data["commands"]]
    assert commands == ["chat_sample.py", "chat_rm.py", "chat_rl.py", "chat_rl.py", "chat_rl.py"]
