"""The main job reproduces: runs/cpu.sh's chain of stages (base, SFT, RM, DPO, RL on 2 ranks, PPO, the report),
shrunk to seconds, run twice in two homes, gives the same report.json byte for byte; and the report carries
held-out figures only, no time or memory figure (those go to timings.json, which differs from run to run)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUT = ["--num-prompts", "16", "--steps", "2", "--prompts-per-step", "4", "--max-new-tokens", "24",
           "--eval-problems", "8", "--pass-k", "2"]
# each stage starts from the one before, through $NANOPOST_HOME's default run directories, as in runs/cpu.sh
PIPELINE = [
    (1, "base_train.py", ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--n-kv-head", "1", "--seq-len", "128",
                          "--num-docs", "200", "--vocab-size", "400", "--steps", "4", "--batch-size", "8",
                          "--device-batch-size", "8", "--warmup-steps", "1", "--eval-problems", "8"]),
    (1, "chat_sft.py", ["--num-train", "64", "--num-val", "8", "--steps", "4", "--batch-size", "8", "--warmup-steps",
                        "1", "--eval-problems", "8", "--pass-k", "2", "--max-new-tokens", "24"]),
    (1, "chat_rm.py", ["--num-train", "32", "--num-val", "8", "--steps", "3", "--batch-size", "8", "--warmup-steps",
                       "1"]),
    (1, "chat_dpo.py", ["--num-train", "32", "--num-val", "8", "--steps", "3", "--batch-size", "8", "--warmup-steps",
                        "1", "--eval-problems", "8", "--max-new-tokens", "24"]),
    (2, "chat_rl.py", ROLLOUT + ["--group-size", "4", "--max-resample", "1", "--warmup-steps", "1"]),
    (1, "chat_ppo.py", ROLLOUT + ["--freeze-actor-steps", "1", "--warmup-steps", "1"]),
]


def run_pipeline(home, cpu_autocast="float32"):
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1", "NANOPOST_CPU_AUTOCAST": cpu_autocast}
    for nproc, script, args in PIPELINE:
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc_per_node={nproc}"]
        r = subprocess.run([*launcher, os.path.join(REPO, script), *args], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{script}: {r.stderr[-3000:]}"
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_eval.py"), "--report"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(home / "report.json", "rb") as f:
        return f.read()


@pytest.mark.slow
@pytest.mark.parametrize("cpu_autocast", ["float32", "bfloat16"])  # bfloat16: runs/cpu.sh on a CPU with its units
def test_the_same_pipeline_twice_gives_the_same_report_byte_for_byte(tmp_path, cpu_autocast):
    first, second = run_pipeline(tmp_path / "a", cpu_autocast), run_pipeline(tmp_path / "b", cpu_autocast)
    report = json.loads(first)
    assert list(report) == ["base", "sft", "rm", "dpo", "rl", "ppo"]
    assert first == second, "two runs of the same pipeline wrote different report.json files"
    machine = [f"{stage}/{k}" for stage, m in report.items() for k in m
               if any(word in k for word in ("second", "memory", "_mb", "time", "_s_"))]
    assert not machine, f"report.json holds machine figures, which differ between runs and machines: {machine}"
