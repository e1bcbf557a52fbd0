"""The shell recipes (runs/*.sh) call the stage scripts with flags that exist: a renamed or removed flag fails
here in seconds, not 10 minutes into a pipeline. Every `X.py --flag` in every recipe is checked against
`python X.py --help`, bash arrays ("${FLAGS[@]}") expanded."""
import glob
import os
import re
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
        for m in re.finditer(r"(?:^|\s)([\w/]+\.py)\b(.*)", line):
            path, rest = m.group(1), m.group(2)
            if not path.startswith("tests/") and os.path.exists(os.path.join(REPO, path)):
                calls.append((path, set(FLAG.findall(rest))))
                break
    return calls


def test_invocations_parses_continuations_and_arrays():
    text = 'FLAGS=(--device cuda ${FSDP:+--fsdp})\nlaunch chat_sft.py --init "$M" "${FLAGS[@]}" \\\n  --seq-len 4  # --not-a-flag\n'
    assert invocations(text) == [("chat_sft.py", {"--init", "--device", "--fsdp", "--seq-len"})]


@pytest.mark.slow
def test_every_recipe_flag_exists():
    calls = [(os.path.basename(sh), path, flags) for sh in sorted(glob.glob(os.path.join(REPO, "runs", "*.sh")))
             for path, flags in invocations(open(sh).read())]
    assert {"cpu.sh", "r1.sh", "tulu3.sh", "qwen3.sh"} <= {sh for sh, _, _ in calls}
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
