"""The shell recipes (runs/*.sh) call the stage scripts with flags that exist: a renamed or removed flag fails
here in seconds, not 10 minutes into a pipeline. Every `X.py --flag` in every recipe is checked against
`python X.py --help`, bash arrays ("${FLAGS[@]}") expanded."""
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def invocations(script_text):
    """(script path, flags) for every call of a repository .py in a bash script; `\\` continuations joined
    and arrays expanded. Example: 'A=(--x 1)\\n$PY chat_sft.py "${A[@]}" --y' -> [("chat_sft.py", {"--x", "--y"})]."""
    text = script_text.replace("\\\n", " ")
    arrays = dict(re.findall(r"^\s*(\w+)=\((.*)\)\s*$", text, re.MULTILINE))
    calls = []
    for line in text.splitlines():
        line = re.sub(r"\"?\$\{(\w+)\[@\]\}\"?", lambda m: arrays.get(m.group(1), ""), line.split("#")[0])
        for m in re.finditer(r"(?:^|\s)([\w/]+\.py)\b", line):
            path = m.group(1)  # runs/launch.py is torchrun's stand-in: the stage is the next .py on the line
            if path != "runs/launch.py" and not path.startswith("tests/") and os.path.exists(os.path.join(REPO, path)):
                calls.append((path, set(FLAG.findall(line[m.end():]))))
                break
    return calls


def test_invocations_parses_continuations_and_arrays():
    text = 'FLAGS=(--device cuda ${FSDP:+--fsdp})\nlaunch chat_sft.py --init "$M" "${FLAGS[@]}" \\\n  --seq-len 4  # --not-a-flag\n'
    assert invocations(text) == [("chat_sft.py", {"--init", "--device", "--fsdp", "--seq-len"})]
    text = "$PY runs/launch.py --standalone --nproc_per_node=2 chat_rl.py --tools\n"
    assert invocations(text) == [("chat_rl.py", {"--tools"})]


@pytest.mark.slow
def test_every_recipe_flag_exists():
    calls = [(os.path.basename(sh), path, flags) for sh in sorted(glob.glob(os.path.join(REPO, "runs", "*.sh")))
             for path, flags in invocations(open(sh).read())]
    assert {"cpu.sh", "r1.sh", "tulu3.sh", "instructgpt.sh", "qwen3.sh"} <= {sh for sh, _, _ in calls}
    scripts = sorted({path for _, path, _ in calls})

    def help_flags(path):
        r = subprocess.run([sys.executable, os.path.join(REPO, path), "--help"], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert r.returncode == 0, f"{path} --help: {r.stderr[-2000:]}"
        return set(FLAG.findall(r.stdout))

    with ThreadPoolExecutor(4) as pool:
        known = dict(zip(scripts, pool.map(help_flags, scripts)))
    unknown = [f"runs/{sh}: {path} {flag}" for sh, path, flags in calls for flag in sorted(flags - known[path])]
    assert not unknown, "flags the scripts do not take:\n" + "\n".join(unknown)


# The recipes' switches, each on at 1 only (OVERWRITE=0 once replaced a run). Each switch: the flag it adds to
# every stage it launches, and its default.
SWITCHES = {"cpu.sh": {"OVERWRITE": ("--overwrite", "1")}, "r1.sh": {"OVERWRITE": ("--overwrite", "0")},
            "tulu3.sh": {"OVERWRITE": ("--overwrite", "0")}, "instructgpt.sh": {"OVERWRITE": ("--overwrite", "0")},
            "qwen3.sh": {"OVERWRITE": ("--overwrite", "0"), "FSDP": ("--fsdp", "0")}}


TRAINING_STAGES = {"base_train.py", "chat_sft.py", "chat_rm.py", "chat_dpo.py", "chat_kto.py", "chat_rl.py",
                   "chat_ppo.py", "chat_distill.py"}


def stub_calls(tmp_path, script, env):
    """Run runs/SCRIPT in a copy of the repository's layout whose .venv/bin/python (and pip) records its
    arguments and does nothing: the stage invocations the script makes, one list of words each."""
    root = tmp_path / script
    os.makedirs(root / "runs")
    os.makedirs(root / ".venv" / "bin")
    shutil.copy(os.path.join(REPO, "runs", script), root / "runs" / script)
    log = root / "calls.txt"
    for name in ("python", "pip"):
        (root / ".venv" / "bin" / name).write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
        os.chmod(root / ".venv" / "bin" / name, 0o755)
    base = {"PATH": os.environ["PATH"], "NANOPOST_HOME": str(root / "home"), "MODEL": "/m", "SFT": "s.jsonl",
            "PREFS": "p.jsonl", "RL": "r.jsonl", "DEVICE": "cpu", "NGPU": "2"}
    r = subprocess.run(["bash", str(root / "runs" / script)], env={**base, **env}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return [line.split() for line in log.read_text().splitlines() if re.search(r"\b\w+\.py\b", line)]


@pytest.mark.parametrize("script", sorted(SWITCHES))
def test_every_switch_is_on_at_1_and_off_otherwise(tmp_path, script):
    for name, (flag, default) in SWITCHES[script].items():
        for value in ("1", "0", "", None):
            env = {} if value is None else {name: value}
            stages = [c for c in stub_calls(tmp_path / f"{name}-{value}", script, env)
                      if any(w in TRAINING_STAGES for w in c)]
            assert stages, f"{script}: no stage launched"
            on = (value or default) == "1"  # empty is unset: the default
            assert all((flag in c) == on for c in stages), f"{script} with {name}={value!r}: {stages}"


def test_the_docs_set_only_variables_the_recipes_read():
    """An environment variable the docs set before `bash runs/X.sh`, or list in recipes.md's table of knobs, is
    one the script reads (`${VAR`) or the code does (os.environ): RL_SECONDS stayed in the docs after the scripts
    stopped reading it. docs/LOG.md, dated, records what was run then."""
    stale = []
    code = "".join(open(f).read() for f in glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "tests", "*.py")))
    for md in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")) + [os.path.join(REPO, "README.md")]):
        if md.endswith("LOG.md"):
            continue
        for assigns, script in re.findall(r"((?:\b[A-Z][A-Z_]+=\S+\s+)+)bash runs/(\w+\.sh)", open(md).read()):
            read = open(os.path.join(REPO, "runs", script)).read()
            stale += [f"{os.path.basename(md)}: {v} for runs/{script}" for v in re.findall(r"\b([A-Z][A-Z_]+)=", assigns)
                      if "${" + v not in read and f'"{v}"' not in code]
    recipes = "".join(open(os.path.join(REPO, "runs", f)).read() for f in ("r1.sh", "tulu3.sh", "instructgpt.sh"))
    for v in re.findall(r"^\| `([A-Z][A-Z_]+)` \|", open(os.path.join(REPO, "docs", "recipes.md")).read(), re.M):
        if "${" + v not in recipes:
            stale.append(f"recipes.md's table: {v}")
    assert not stale, "variables the scripts do not read:\n" + "\n".join(stale)
