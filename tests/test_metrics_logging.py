"""MetricsLogger mirrors every metrics.jsonl row to Weights & Biases when asked, and chat_eval.py --plot draws
the rows as curves. wandb is replaced by a stub module that records its calls; matplotlib really draws."""
import json
import os
import sys
import types

import pytest

import common
from common import DistInfo, MetricsLogger, UserError

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
