"""lab/goodhart.py at smoke size, on the tiny home of conftest.lab_home: it writes its figure and the JSON keys
docs/lab/goodhart.md quotes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_goodhart_writes_its_figure_and_the_keys_its_page_quotes(lab_home, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "goodhart.py"), "--home", str(lab_home), "--out",
                        str(tmp_path), "--smoke", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (tmp_path / "goodhart.png").stat().st_size > 0
    with open(tmp_path / "goodhart.json") as f:
        data = json.load(f)
    assert data["tools"] is False and data["leashes"] == [0.0, 0.04, 0.4]
    assert list(data["summary"]) == ["beta=0", "beta=0.04", "beta=0.4", "weak-rm, beta=0"]
    assert data["proxies"]["weak-rm"]["pairs"] == 16 and "pair_accuracy" in data["proxies"]["rm"]
    for name, run in data["runs"].items():
        assert [s["step"] for s in run["steps"]] == [1, 2]
        assert run["steps"][0]["sqrt_kl"] == 0.0  # the first batch is sampled by the start itself
        assert {"sqrt_kl", "proxy", "gold", "length"} <= run["steps"][0].keys()
        assert [h["step"] for h in run["heldout"]] == [0, 1, 2] and run["heldout"][0]["sqrt_kl"] == 0.0
        assert {"gold_start", "gold_peak", "gold_peak_sqrt_kl", "gold_end", "proxy_start", "proxy_end",
                "sqrt_kl_end", "pass@1_start", "pass@1_end"} <= data["summary"][name].keys()
    assert list(data["exploits"]) == ["beta=0", "weak-rm, beta=0"]
    for exploits in data["exploits"].values():
        assert exploits["problems"] == 4 and {"rm", "verifier", "tokens"} <= exploits["start"].keys()
        assert {"end_rm_of_wrong", "end_rm_of_right"} <= exploits.keys()
        for example in exploits["examples"]:  # the end's answers the verifier failed, the RM's favourites first
            assert example["end"]["verifier"] == 0.0 and {"question", "answer", "rm"} <= example["start"].keys()
    assert len(data["commands"]) == 5 and data["seconds"] > 0  # the weak RM, then four RL runs
