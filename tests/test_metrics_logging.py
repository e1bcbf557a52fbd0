"""MetricsLogger mirrors every metrics.jsonl row to Weights & Biases when asked, and chat_eval.py --plot draws
the rows as curves. wandb is replaced by a stub module that records its calls; matplotlib really draws."""
import json
import os
import struct
import subprocess
import sys
import types

import pytest

import common
from common import DistInfo, UserError
from checkpoint import save_hf
from rundir import MetricsLogger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: init() returns a run whose log() and finish() are recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        calls = self.calls

        class Run:
            def log(self, data, step=None):
                calls.append(("log", dict(data), step))

            def finish(self):
                calls.append(("finish",))
        return Run()


def test_wandb_mirrors_every_row(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLogger(path, wandb_project="nanopost-test", run_name="rl/default", config={"lr": 1e-4})
    log.log(0, train_seconds=0.0, **{"eval/pass@1": 0.5})
    log.log(1, reward=0.25, accuracy=0.125, train_seconds=3.5)
    log.close()
    log.close()  # a second close is harmless and finishes nothing twice

    rows = [json.loads(line) for line in open(path)]
    assert fake.calls[0] == ("init", {"project": "nanopost-test", "name": "rl/default", "config": {"lr": 1e-4},
                                      "dir": str(tmp_path)})
    logged = [c for c in fake.calls if c[0] == "log"]
    assert len(logged) == len(rows) == 2
    for (_, data, step), row in zip(logged, rows):
        assert step == row["step"]  # the JSONL step is wandb's step
        assert data == {k: v for k, v in row.items() if k not in ("step", "time")}  # same names, same values
    assert fake.calls[-1] == ("finish",) and sum(c[0] == "finish" for c in fake.calls) == 1


def test_wandb_only_on_rank_0(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(common, "_DIST", DistInfo(rank=1, world_size=2))
    log = MetricsLogger(str(tmp_path / "metrics.jsonl"), wandb_project="p")
    log.log(1, reward=1.0)
    log.close()
    assert fake.calls == [] and not (tmp_path / "metrics.jsonl").exists()


def test_wandb_missing_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    with pytest.raises(UserError, match="pip install wandb"):
        MetricsLogger(str(tmp_path / "metrics.jsonl"), wandb_project="p")
    MetricsLogger(str(tmp_path / "metrics.jsonl"))  # without a project, wandb is never imported


# ------------------------------------------------------------------------------------------------
# chat_eval.py --plot

def write_run(folder, steps, with_kl, seconds_per_step):
    """A synthetic RL run's metrics.jsonl: training rows every step, held-out rows every 5 steps."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(steps + 1):
            row = {"step": step, "time": 1e9 + step, "train_seconds": seconds_per_step * step}
            if step:
                row.update(reward=0.3 + 0.02 * step, accuracy=0.2 + 0.02 * step, entropy=0.5 - 0.01 * step,
                           loss=0.1, lr=1e-4)
                if with_kl:
                    row["kl"] = 0.001 * step
            if step % 5 == 0:
                row["eval/pass@1"] = 0.5 + 0.01 * step
            f.write(json.dumps(row) + "\n")
    return folder


def png_size(path):
    """(width, height) from the PNG signature and IHDR chunk, read by hand."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", head[16:24])


def has_color(image, hex_color, tolerance=0.02):
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return bool((abs(image[..., :3] - rgb) < tolerance).all(axis=-1).any())


def test_plot_two_runs(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    from chat_eval import plot_runs
    a = write_run(str(tmp_path / "rl" / "grpo"), steps=10, with_kl=False, seconds_per_step=3.0)
    b = write_run(str(tmp_path / "rl" / "kl"), steps=12, with_kl=True, seconds_per_step=4.0)
    out = str(tmp_path / "curves.png")
    drawn = plot_runs([a, os.path.join(b, "metrics.jsonl")], out)
    # the RL curves that were logged, in the documented order; loss and lr are not among them
    assert drawn == ["reward", "accuracy", "entropy", "kl", "eval/pass@1"]
    # 5 panels of 450 x 300 pixels, 3 to a row: 2 rows
    assert png_size(out) == (3 * 450, 2 * 300)
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (600, 1350)
    assert has_color(image, "#1f77b4") and has_color(image, "#ff7f0e")  # both runs drawn (colors C0, C1)
    assert (image[300:, 900:, :3] == 1.0).all()  # the sixth panel's place is left blank, no empty axes

    drawn = plot_runs([a], out, metrics=["loss"])
    assert drawn == ["loss"] and png_size(out) == (450, 300)
    with pytest.raises(UserError, match="kl not logged"):
        plot_runs([a], out, metrics=["kl"])
    with pytest.raises(UserError, match="no metrics.jsonl"):
        plot_runs([str(tmp_path / "nowhere")], out)


def test_read_metrics_merges_rows_of_a_step(tmp_path):
    """A resumed run logs the steps after its checkpoint again: the later row wins, step by step."""
    from chat_eval import read_metrics
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/pass@1": 0.5}, {"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2},
            {"step": 2, "reward": 0.25}, {"step": 1, "train_seconds": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(str(path)) == [{"step": 0, "eval/pass@1": 0.5}, {"step": 1, "reward": 0.1, "train_seconds": 1.0},
                                       {"step": 2, "reward": 0.25}]
    path.write_text(json.dumps(rows[0]) + "\n" + '{"step": 1, "rew')  # killed mid-line
    with pytest.raises(UserError, match="metrics.jsonl:2"):
        read_metrics(str(path))


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    from chat_eval import plot_runs
    run = write_run(str(tmp_path / "run"), steps=2, with_kl=False, seconds_per_step=1.0)
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now fails as if not installed
    with pytest.raises(UserError, match="pip install matplotlib"):
        plot_runs([run], str(tmp_path / "curves.png"))
    # the command line: one line on stderr, exit code 2, no traceback
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None; "
            f"sys.argv = ['chat_eval.py', '--plot', {run!r}]; runpy.run_path('chat_eval.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --plot needs matplotlib, which is not installed: pip install matplotlib"]


def test_a_stage_with_wandb_logs_the_same_rows(tmp_path, tok):
    """chat_sft.py --wandb PROJECT, with a stub wandb package on the path that records its calls."""
    import torch

    from model import GPT, GPTConfig
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(tmp_path / "base"), tok)
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "wandb.py").write_text(
        "import json, os\n"
        "LOG = os.environ['WANDB_STUB_LOG']\n"
        "def _w(*a):\n    open(LOG, 'a').write(json.dumps(a) + '\\n')\n"
        "class _Run:\n    def log(self, data, step=None): _w('log', data, step)\n    def finish(self): _w('finish')\n"
        "def init(**kw):\n    _w('init', kw['project'], kw['name'])\n    return _Run()\n")
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "WANDB_STUB_LOG": str(tmp_path / "w.log"),
           "PYTHONPATH": f"{stub}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_sft.py"), "--init", str(tmp_path / "base"), "--steps", "2",
                        "--num-train", "32", "--batch-size", "8", "--eval-problems", "0", "--wandb", "my-project"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = [json.loads(line) for line in open(tmp_path / "w.log")]
    rows = [json.loads(line) for line in open(tmp_path / "sft" / "default" / "metrics.jsonl")]
    assert calls[0] == ["init", "my-project", "sft/default"] and calls[-1] == ["finish"]
    logged = [c for c in calls if c[0] == "log"]
    assert [c[2] for c in logged] == [row["step"] for row in rows]
    assert all(c[1] == {k: v for k, v in row.items() if k not in ("step", "time")} for c, row in zip(logged, rows))
