#!/usr/bin/env bash
# The main job: the whole nanopost pipeline on the embedded default world, on CPU.
# On a fresh machine it installs what it needs (a .venv next to the code), then runs every stage and
# ends by writing $NANOPOST_HOME/report.json (held-out metrics per stage) and printing it as a table.
#   bash runs/cpu.sh                    # everything under ./out/cpu
#   NANOPOST_HOME=/tmp/np bash runs/cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q -r requirements.txt
PY=.venv/bin/python
export NANOPOST_HOME="${NANOPOST_HOME:-$PWD/out/cpu}"
mkdir -p "$NANOPOST_HOME"
echo "nanopost CPU pipeline -> $NANOPOST_HOME"

stage() {  # stage NAME command...: run one stage, timed
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "=== $name ==="
  "$@"
  echo "=== $name done in $((SECONDS - t0)) s ==="
}

t_all=$SECONDS
stage "tokenizer + base model" $PY base_train.py
stage "SFT" $PY chat_sft.py --tools
stage "reward model" $PY chat_rm.py
stage "DPO" $PY chat_dpo.py --tools
stage "RL (GRPO family, 2 ranks)" $PY -m torch.distributed.run --standalone --nproc_per_node=2 chat_rl.py --tools --time-budget 180
stage "PPO" $PY chat_ppo.py --tools --time-budget 150
echo; echo "pipeline done in $((SECONDS - t_all)) s"
$PY chat_eval.py --report
