"""Running one lab experiment at smoke size on conftest.lab_home, as its test does: `python lab/NAME.py --smoke`."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_lab(name, home, out, *flags):
    """lab/NAME.py --smoke on `home`, its JSON and figure written to `out`: the JSON, after checking the figure."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", f"{name}.py"), "--home", str(home), "--out", str(out),
                        "--smoke", "--threads", "1", *flags], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (out / f"{name}.png").stat().st_size > 0
    data = json.loads((out / f"{name}.json").read_text())
    assert data["seconds"] > 0 and data["provenance"]["level"] == "model" and str(home) not in json.dumps(data)
    return data
