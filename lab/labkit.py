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
so that a reader can tell a slow machine from a slow experiment. Plotting needs matplotlib
(requirements-test.txt); nothing else outside requirements.txt.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from speed_reference import speed_reference  # noqa: E402  (benchmarks/ is not a package)


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The flags every experiment takes; an experiment adds its own below them."""
    p = argparse.ArgumentParser(prog=f"lab/{name}.py", description=description)
    p.add_argument("--home", default=os.environ.get("NANOPOST_HOME", os.path.join(REPO, "out", "cpu")),
                   help="the $NANOPOST_HOME of a runs/cpu.sh pipeline: the checkpoints start there, the runs go there")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "lab"), help="where NAME.json and NAME.png go")
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


class Lab:
    """One experiment's runs and record. `lab.run(...)` runs a stage script as a user would and returns its run
    directory; `lab.metrics(path)` reads its metrics.jsonl; `lab.save(data, fig)` writes NAME.json and NAME.png
    with the commands run, their seconds and the speed reference beside the experiment's own figures."""

    def __init__(self, name: str, args):
        self.name, self.home, self.out, self.threads = name, args.home, args.out, args.threads
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
        """Write NAME.json (data, plus the commands, seconds and speed reference) and NAME.png; returns the json's path."""
        os.makedirs(self.out, exist_ok=True)
        record = {"experiment": self.name, **data, "commands": self.commands,
                  "seconds": round(time.time() - self.t0, 1), "speed_reference": speed_reference()}
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
