#!/usr/bin/env bash
# The main job: the whole nanopost pipeline on the embedded default world, on CPU.
# On a fresh machine it installs what it needs (a .venv next to the code), then runs every stage and
# ends by writing $NANOPOST_HOME/report.json (held-out metrics per stage) and printing it as a table.
# Every stage stops after a fixed number of steps, so the same machine gives the same report.json to the
# last digit; the stage times and a machine-speed reference go to timings.json beside it. On a CPU with
# bfloat16 units (AVX-512 BF16, AMX) the training forwards autocast to bfloat16, elsewhere float32
# (common.train_dtype); NANOPOST_CPU_AUTOCAST=float32 bash runs/cpu.sh trains in float32 everywhere.
#   bash runs/cpu.sh                    # everything under ./out/cpu
#   NANOPOST_HOME=/tmp/np bash runs/cpu.sh
#   OVERWRITE=0 bash runs/cpu.sh        # refuse, rather than replace, the runs of an earlier pipeline there
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q -r requirements.txt
PY=.venv/bin/python
export NANOPOST_HOME="${NANOPOST_HOME:-$PWD/out/cpu}"
mkdir -p "$NANOPOST_HOME"
OW=(); if [ "${OVERWRITE:-1}" = 1 ]; then OW=(--overwrite); fi  # each stage says what it replaced
echo "nanopost CPU pipeline -> $NANOPOST_HOME"

TIMES=()  # "name seconds" per stage, for timings.json
stage() {  # stage NAME command...: run one stage, timed
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "=== $name ==="
  "$@"
  echo "=== $name done in $((SECONDS - t0)) s ==="
  TIMES+=("$name=$((SECONDS - t0))")
}

t_all=$SECONDS
stage base $PY base_train.py "${OW[@]}"
stage sft $PY chat_sft.py "${OW[@]}" --tools
stage rm $PY chat_rm.py "${OW[@]}"
# DPO on its own answers, judged by the verifier (a correct answer against a wrong one to the same prompt)
stage dpo $PY chat_dpo.py "${OW[@]}" --tools --pairs on-policy
# RL and PPO start from the model the SFT stage has just evaluated: no second evaluation at step 0
stage rl $PY runs/launch.py --standalone --nproc_per_node=2 chat_rl.py "${OW[@]}" --tools --steps 6 --no-eval-before-train
stage ppo $PY chat_ppo.py "${OW[@]}" --tools --steps 12 --no-eval-before-train
echo; echo "pipeline done in $((SECONDS - t_all)) s"
$PY chat_eval.py --report
$PY - "$((SECONDS - t_all))" "${TIMES[@]}" <<'PYEOF'
import json, os, platform, sys
sys.path.insert(0, "benchmarks")
import torch
from common import train_dtype
from speed_reference import speed_reference
total, stages = int(sys.argv[1]), dict(kv.split("=") for kv in sys.argv[2:])
timings = {"stage_s": {k: int(v) for k, v in stages.items()}, "total_s": total, "speed_reference": speed_reference(),
           "train_dtype": str(train_dtype("cpu")).removeprefix("torch."),
           "torch": torch.__version__, "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                                     if line.startswith("model name")), platform.machine())
           if os.path.exists("/proc/cpuinfo") else platform.machine(),
           "usable_cpus": len(os.sched_getaffinity(0))}
path = os.path.join(os.environ["NANOPOST_HOME"], "timings.json")
with open(path, "w") as f:
    json.dump(timings, f, indent=2)
print("stage seconds: " + "  ".join(f"{k} {v}" for k, v in timings["stage_s"].items()) + f"  total {total}")
print(f"speed reference: {timings['speed_reference']['matmul_s']} s for 64 products of 512x512 float32 "
      f"matrices ({timings['speed_reference']['threads']} threads) on {timings['cpu']}; training forwards in "
      f"{timings['train_dtype']} -> {path}")
PYEOF
