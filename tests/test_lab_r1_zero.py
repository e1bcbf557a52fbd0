"""lab/r1_zero.py at smoke size, on the tiny home of conftest.lab_home: it writes its figure and the JSON keys
docs/lab/r1_zero.md quotes."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_r1_zero_writes_its_figure_and_the_keys_its_page_quotes(lab_home, tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "r1_zero.py"), "--home", str(lab_home), "--out",
                        str(tmp_path), "--smoke", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (tmp_path / "r1_zero.png").stat().st_size > 0
    with open(tmp_path / "r1_zero.json") as f:
        data = json.load(f)
    assert data["reward"] == "verifier+0.1*format"
    # the runs with the calculator are left out at smoke size: the tiny vocabulary cannot hold its tools block
    assert list(data["runs"]) == ["base-plain", "base-chat", "sft"]
    for name, run in data["runs"].items():
        assert run["prompt_format"] == ("plain" if name == "base-plain" else "chat") and run["tools"] is False
        assert run["init"] == os.path.join("sft" if name == "sft" else "base", "default")
        assert [s["step"] for s in run["steps"]] == [1, 2]
        assert {"accuracy", "format_rate", "length", "tool_use"} <= run["first5"].keys() == run["last5"].keys()
        assert {"kl_to_start", "flat_groups"} <= run["steps"][0].keys() and run["steps"][0]["kl_to_start"] == 0.0
        assert [h["step"] for h in run["heldout"]] == [0, 1, 2]
        assert {"pass@1", "accuracy_t1", "format_rate_t1", "stop_rate"} <= run["heldout"][0].keys()
        for when in ("start", "end"):  # the answers shown on the page, with the prompt as the model saw it
            shown = run["answers"][when]
            assert len(shown) == 3 and all(a["prompt"].startswith("<|im_start|>user\n") == (name != "base-plain")
                                           for a in shown)
    assert len(data["commands"]) == 3
