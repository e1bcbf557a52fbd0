"""lab/labkit.py and lab/run_all.py: what every experiment's JSON records (paths relative to $NANOPOST_HOME, the
commit, the CPU, the hash of the home's report.json), that every experiment is in run_all's list, and that without
matplotlib every lab script stops at once with one line naming what to install (#48, item 4), before it runs
anything."""
import hashlib
import json
import os
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "lab"))
import labkit  # noqa: E402
import run_all  # noqa: E402


def test_relative_writes_paths_under_the_home_and_the_repository_relative():
    home = "/tmp/np"
    assert labkit.relative("--init /tmp/np/sft/default", home) == "--init $NANOPOST_HOME/sft/default"
    assert labkit.relative({"a": ["/tmp/np", "/tmp/np2/x"]}, home) == {"a": ["$NANOPOST_HOME", "/tmp/np2/x"]}
    assert labkit.relative(f"python {REPO}/chat_rl.py --x {REPO}", home) == "python chat_rl.py --x ."
    assert labkit.relative(3.5, home) == 3.5
    assert labkit.compact({"x": [0.123456789, 2, "s"]}) == {"x": [0.123457, 2, "s"]}


def saved(tmp_path, level, home):
    """The JSON a Lab writes after running one command with a path under the home among its flags."""
    args = SimpleNamespace(home=str(home), out=str(tmp_path / "out"), threads=None)
    lab = labkit.Lab("probe", args, level=level)
    if level == "model":  # a script run as Lab.run runs a stage (this one does nothing, at once)
        (home / "stage.py").write_text("import sys\n")
        lab.command(str(home / "stage.py"), "--init", str(home / "sft" / "default"))
    with open(lab.save({"home": str(home), "init": str(home / "sft" / "default")})) as f:
        return json.load(f)


def test_the_json_records_provenance_and_no_absolute_path(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "report.json").write_text('{"sft": {"pass@1": 0.5}}\n')
    data = saved(tmp_path, "model", home)
    prov = data["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or None
    assert prov["commit"] == head and isinstance(prov["dirty"], bool) and prov["cpu"] and prov["level"] == "model"
    assert prov["home_report_sha256"] == hashlib.sha256((home / "report.json").read_bytes()).hexdigest()
    assert data["commands"][0]["command"] == "python $NANOPOST_HOME/stage.py --init $NANOPOST_HOME/sft/default"
    assert data["home"] == "$NANOPOST_HOME" and data["init"] == "$NANOPOST_HOME/sft/default"
    assert str(tmp_path) not in json.dumps(data) and REPO not in json.dumps(data)
    exact_level = saved(tmp_path, "exact", home)["provenance"]  # an exact-level experiment starts from no home
    assert exact_level["level"] == "exact" and exact_level["home_report_sha256"] is None


def test_every_experiment_script_is_in_run_all():
    scripts = {f[:-3] for f in os.listdir(os.path.join(REPO, "lab")) if f.endswith(".py")}
    assert set(run_all.EXPERIMENTS) == scripts - {"labkit", "lmkit", "exact_dynamics", "run_all"}
    assert all(level in ("exact", "model") for level, _ in run_all.EXPERIMENTS.values())


def test_run_all_wants_the_pipeline_for_a_model_level_experiment(tmp_path):
    """(tests/test_lab_kl_placement.py runs an experiment through run_all.)"""
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "run_all.py"), "--only", "goodhart", "--home",
                        str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "bash runs/cpu.sh" in r.stderr and "[run_all] goodhart" not in r.stdout


@pytest.mark.parametrize("name", [*run_all.EXPERIMENTS, "run_all"])
def test_without_matplotlib_every_lab_script_stops_at_once_saying_what_to_install(name, tmp_path, monkeypatch):
    """With `import matplotlib` failing (as when it is not installed), every experiment, and run_all, stops with
    the one line before it looks for a checkpoint (the home is empty: a script that looked first would say "no sft
    run" instead) or runs anything (no subprocess, nothing written). Run in this process, as `python lab/NAME.py`."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"{name} ran {a[0]} before the check"))
    monkeypatch.setattr(sys, "argv", [f"lab/{name}.py", "--home", str(tmp_path / "empty"),
                                      "--out", str(tmp_path / "out"), "--smoke"])  # (--smoke: should the check be missing, the exact ones run small)
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(os.path.join(REPO, "lab", f"{name}.py"), run_name="__main__")
    assert stop.value.code == labkit.MATPLOTLIB_MISSING
    assert os.listdir(tmp_path) == []


def test_without_matplotlib_the_command_prints_one_line(tmp_path):
    """The same from the shell: a matplotlib that fails to import ahead on the path; exit status 1, one line."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('No module named matplotlib', name='matplotlib')\n")
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "goodhart.py"), "--home", str(tmp_path / "empty")],
                       env={**os.environ, "PYTHONPATH": str(tmp_path / "fake")}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == "" and r.stderr == labkit.MATPLOTLIB_MISSING + "\n"


@pytest.mark.parametrize("requirements", ["requirements-lab.txt", "requirements-test.txt"])
def test_the_lab_requirements_bring_matplotlib(requirements):
    """requirements-lab.txt: the stages' requirements and matplotlib; the test requirements include it."""
    text = open(os.path.join(REPO, requirements)).read()
    assert ("matplotlib==" in text) == (requirements == "requirements-lab.txt")
    assert ("-r requirements.txt" in text) == (requirements == "requirements-lab.txt")
    assert requirements == "requirements-lab.txt" or "-r requirements-lab.txt" in text
