"""
What every lab experiment shares, and nothing of any method: where the main job's checkpoints are, running a
stage the way a user does (its command line), reading what a run logged, and writing the experiment's JSON and
figure. An experiment is one short script in lab/ that reads top to bottom:

    python lab/NAME.py                       # from runs/cpu.sh's checkpoints in ./out/cpu; writes docs/lab/NAME.{json,png}
    python lab/NAME.py --home /tmp/np        # another pipeline's $NANOPOST_HOME
    python lab/NAME.py --smoke               # the smallest sizes: what tests/test_lab.py runs, in seconds

Its runs go under the same home, in run directories named after the experiment (rl/lab-NAME-...), each started
with --overwrite so that a rerun replaces them, never the pipeline's own runs. Every configuration stops after
fixed --steps, so that it takes the same steps on any machine. The JSON holds the figures a page quotes, the
commands that made them, the seconds they took and the machine's speed reference (benchmarks/speed_reference.py),
so that a reader can tell a slow machine from a slow experiment, and where it came from (provenance: the commit,
the CPU, the hash of the report.json of the home it started from), every path in it written relative to
$NANOPOST_HOME or to the repository. Plotting needs matplotlib (requirements-lab.txt): an experiment checks for
it before it runs anything. An exact-level experiment (exact.py's enumerable world, seconds, no checkpoint) says
so, Lab(name, args, level="exact"), and records no home.

A page quotes its experiment's numbers through marks that tests/test_lab_pages.py checks against the JSON, so
that a page cannot drift from its JSON: after `<!--json NAME.json-->`, a number written `0.437<!--=a/b/0-->` is
the JSON's ["a"]["b"][0], rounded as written (refresh_page rewrites them all from the JSONs; run_all.py does).
"""
import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from speed_reference import speed_reference  # noqa: E402  (benchmarks/ is not a package)


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The flags every experiment takes; an experiment adds its own below them."""
    p = argparse.ArgumentParser(prog=f"lab/{name}.py", description=description)
    p.add_argument("--home", type=os.path.abspath,
                   default=os.environ.get("NANOPOST_HOME", os.path.join(REPO, "out", "cpu")),
                   help="the $NANOPOST_HOME of a runs/cpu.sh pipeline: the checkpoints start there, the runs go there")
    p.add_argument("--out", type=os.path.abspath, default=os.path.join(REPO, "docs", "lab"),
                   help="where NAME.json and NAME.png go")
    p.add_argument("--smoke", action="store_true", help="the smallest sizes, to check the experiment runs end to end")
    p.add_argument("--threads", type=int, default=None, help="threads per process (default: the cores this process may use)")
    return p


# chat_rl.py at smoke size: the test home's tiny model, without the calculator
RL_SMOKE = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--num-prompts", "16",
            "--eval-problems", "4", "--max-resample", "1"]


def moving_average(values, width=5):
    """The mean of each value and the width - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
            for i in range(len(values))]


def checkpoint(home: str, stage: str, run: str = "default") -> str:
    """A run directory of the pipeline, or a clear error naming the command that makes it."""
    path = os.path.join(home, stage, run)
    if not os.path.isdir(os.path.join(path, "checkpoints")):
        raise SystemExit(f"error: no {stage} run at {path}: run `NANOPOST_HOME={home} bash runs/cpu.sh` first "
                         f"(or pass --home)")
    return path


MATPLOTLIB_MISSING = "error: the lab draws its figures with matplotlib, which is not installed: pip install -r requirements-lab.txt"


def require_matplotlib():
    """Stop with one line naming what to install, before any run, when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401  (optional: the lab's pictures only)
    except ImportError:
        raise SystemExit(MATPLOTLIB_MISSING)


def relative(value, home: str):
    """`value` (a string, or a dict or list holding strings) with every path under `home` written
    $NANOPOST_HOME/..., and every other path in the repository relative to it: what a JSON may hold.
    Example, home /tmp/np: "--init /tmp/np/sft/default" -> "--init $NANOPOST_HOME/sft/default"."""
    if isinstance(value, dict):
        return {k: relative(v, home) for k, v in value.items()}
    if isinstance(value, list):
        return [relative(v, home) for v in value]
    if not isinstance(value, str):
        return value
    for root, name in ((home, "$NANOPOST_HOME"), (REPO, ".")):
        value = re.sub(re.escape(root.rstrip("/")) + r"(?=/|$|[^\w.-])", name, value)
    return re.sub(r"(?<![\w$.])\./", "", value)  # "./lab/x.py" -> "lab/x.py"


def compact(value, digits: int = 6):
    """`value` with every float rounded to `digits` significant digits (a page quotes at most four): JSON files
    a reader can diff."""
    if isinstance(value, dict):
        return {k: compact(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v, digits) for v in value]
    return float(f"{value:.{digits}g}") if isinstance(value, float) else value


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def provenance(home: str, level: str) -> dict:
    """Where a record came from: the commit (and whether tracked files other than the documentation, the lab's
    outputs among it, differed from it), the CPU, the command, and for a model-level experiment the sha256 of the report.json of the home
    whose checkpoints it started from (None where the home has none)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    report = os.path.join(home, "report.json")
    command = ["python", os.path.relpath(os.path.abspath(sys.argv[0]), REPO)] + [shlex.quote(a) for a in sys.argv[1:]]
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs", ":!*.md")),
            "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": torch.__version__, "command": " ".join(command), "level": level,
            "home_report_sha256": sha256(report) if level == "model" and os.path.exists(report) else None}


class Lab:
    """One experiment's runs and record. `lab.run(...)` runs a stage script as a user would and returns its run
    directory; `lab.metrics(path)` reads its metrics.jsonl; `lab.save(data, fig)` writes NAME.json and NAME.png
    with the commands run, their seconds, the speed reference and the provenance beside the experiment's own
    figures. level: "model" (from the home's checkpoints) or "exact" (exact.py's world: no home)."""

    def __init__(self, name: str, args, level: str = "model"):
        require_matplotlib()  # before anything runs: the figure comes at the end
        if level not in ("model", "exact"):
            raise ValueError(f"unknown level {level!r}")
        self.name, self.home, self.out, self.threads, self.level = name, args.home, args.out, args.threads, level
        self.commands, self.t0 = [], time.time()

    def run(self, script: str, *flags, stage: str, run_name: str, nproc: int = 1) -> str:
        """Run `script` with `flags` (strings) under $NANOPOST_HOME=home, as run `run_name` (replacing an earlier
        one), on `nproc` ranks. Output goes to the run's lab.log; a failure stops the experiment with its tail."""
        path = os.path.join(self.home, stage, run_name)
        self.command(script, *flags, "--run-name", run_name, "--overwrite", nproc=nproc, log=os.path.join(path, "lab.log"))
        return path

    def command(self, script: str, *flags, nproc: int = 1, log: str | None = None):
        """Run `script` with `flags` under $NANOPOST_HOME=home on `nproc` ranks, its command line and seconds
        recorded; its output written to `log` (if given); a failure stops the experiment with its tail."""
        flags = [str(f) for f in flags]
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc_per_node={nproc}"]
        cmd = launcher + [os.path.join(REPO, script)] + flags
        shown = " ".join(["python" if nproc == 1 else f"torchrun --standalone --nproc_per_node={nproc}", script]
                         + [shlex.quote(f) for f in flags])
        print(f"[{self.name}] {shown}", flush=True)
        env = {**os.environ, "NANOPOST_HOME": self.home}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        t = time.time()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if log:
            os.makedirs(os.path.dirname(log), exist_ok=True)
            with open(log, "w") as f:
                f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise SystemExit(f"[{self.name}] failed ({r.returncode}): {shown}\n{(r.stdout + r.stderr)[-3000:]}")
        self.commands.append({"command": shown, "seconds": round(time.time() - t, 1)})

    @staticmethod
    def metrics(run_dir: str) -> list:
        """The rows of a run's metrics.jsonl, in order."""
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]

    @staticmethod
    def eval_json(run_dir: str) -> dict:
        with open(os.path.join(run_dir, "eval.json")) as f:
            return json.load(f)

    def save(self, data: dict, fig=None) -> str:
        """Write NAME.json (data, plus the commands, seconds, speed reference and provenance; every path relative,
        `relative`; every float to 6 significant digits, `compact`) and NAME.png; returns the json's path."""
        os.makedirs(self.out, exist_ok=True)
        record = compact(relative({"experiment": self.name, **data, "commands": self.commands,
                                   "seconds": round(time.time() - self.t0, 1), "speed_reference": speed_reference(),
                                   "provenance": provenance(self.home, self.level)}, self.home))
        path = os.path.join(self.out, f"{self.name}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)
        if fig is not None:
            fig.savefig(os.path.join(self.out, f"{self.name}.png"), dpi=110, bbox_inches="tight")
        print(f"[{self.name}] {record['seconds']:.0f} s -> {path}", flush=True)
        return path


def figure(rows: int = 1, cols: int = 1, width: float = 5.0, height: float = 3.6, layout=None):
    """A matplotlib figure and its axes (a flat list), drawn off-screen; layout: matplotlib's layout engine."""
    from matplotlib.figure import Figure  # optional: the lab's pictures only
    fig = Figure(figsize=(width * cols, height * rows), layout=layout)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


# ------------------------------------------------------------------------------------------------
# A page's numbers, read from its JSON: `<!--json NAME.json-->` names the JSON of what follows (a page may
# switch, section by section); `0.437<!--=a/b/0-->` is a number quoted from it, at the path a/b/0 (keys and
# list indices, "/" between), rounded as written.

PAGE_MARK = re.compile(r"<!--json (?P<json>[\w.-]+\.json)-->|"
                       r"(?P<number>[-−]?\d[\d,]*(?:\.\d+)?(?:e[-+−]?\d+)?%?)<!--=(?P<path>[^>]*)-->")


def format_like(value, written: str) -> str:
    """`value` written as `written` is: its decimals, scientific notation, thousands commas, minus sign, percent.
    Examples: 0.43719 like "0.44" -> "0.44"; 1191.6 like "1,000" -> "1,192"; 0.001834 like "2.0e-3" -> "1.8e-3";
    -0.25 like "−0.10" -> "−0.25"; 0.0621 like "5.0%" -> "6.2%"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    if written.endswith("%"):
        return format_like(100 * value, written[:-1]) + "%"
    mantissa = written.replace("−", "-").split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    if "e" in written:
        m, e = f"{value:.{decimals}e}".split("e")
        text = f"{m}e{'+' if '+' in written and int(e) >= 0 else ''}{int(e)}"
    else:
        text = f"{value:{',' if ',' in written else ''}.{decimals}f}"
    return text.replace("-", "−") if "−" in written else text


def lookup(data, path: str):
    """data's value at a path of keys and list indices: "runs/grpo/0" is data["runs"]["grpo"][0]."""
    for key in path.split("/"):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


def page_numbers(page: str) -> list:
    """Every number `page` (a docs/lab/*.md) quotes through a mark: dicts with its line, the text written, the
    JSON and path it names, and the JSON's value written the same way (`expected`). A mark with no JSON
    declared above it, or a path its JSON lacks, raises with the page and line."""
    with open(page) as f:
        text = f.read()
    found, source, cache = [], None, {}
    orphans = len(re.findall(r"<!--=", text)) - len([m for m in PAGE_MARK.finditer(text) if m["number"]])
    if orphans:
        raise ValueError(f"{page}: {orphans} mark(s) <!--=PATH--> not right after a number")
    for m in PAGE_MARK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m["json"]:
            source = os.path.join(os.path.dirname(page), m["json"])
            if source not in cache:
                if not os.path.exists(source):
                    raise ValueError(f"{page}:{line}: no {m['json']} beside the page")
                with open(source) as f:
                    cache[source] = json.load(f)
            continue
        if source is None:
            raise ValueError(f"{page}:{line}: {m['number']} is marked before any <!--json NAME.json-->")
        try:
            value = lookup(cache[source], m["path"])
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(f"{page}:{line}: {os.path.basename(source)} has nothing at {m['path']!r}")
        found.append({"line": line, "written": m["number"], "json": os.path.basename(source), "path": m["path"],
                      "expected": format_like(value, m["number"]), "start": m.start("number"), "end": m.end("number")})
    return found


def refresh_page(page: str) -> int:
    """Rewrite every marked number of `page` from its JSON (as page_numbers reads them); returns how many changed."""
    with open(page) as f:
        text = f.read()
    changed = [n for n in page_numbers(page) if n["expected"] != n["written"]]
    for n in sorted(changed, key=lambda n: -n["start"]):  # from the end, so that earlier offsets hold
        text = text[:n["start"]] + n["expected"] + text[n["end"]:]
    with open(page, "w") as f:
        f.write(text)
    return len(changed)
