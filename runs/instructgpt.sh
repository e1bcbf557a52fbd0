#!/usr/bin/env bash
# InstructGPT's recipe (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155) on the embedded world, on CPU:
#   1. SFT                 SFT on 6,000 of the world's conversations
#   2. a reward model      chat_rm.py from the SFT model on the world's preference pairs (InstructGPT's: labelers'
#                          rankings of the SFT model's answers)
#   3. PPO against it      chat_ppo.py from the SFT model, rewarded by the reward model alone, with the per-token
#                          KL to the SFT model in the reward and the critic started from the reward model; the
#                          verifier grades the same answers with weight 0 (reward/verifier in metrics.jsonl), the
#                          gold the reward model stands for (Gao et al.'s over-optimization: docs/lab/goodhart.md)
# PPO-ptx, InstructGPT's pretraining gradients mixed into PPO's, is left out: this world's SFT data is its
# pretraining data's kind, and no stage mixes losses.
# Then a table of each step's held-out pass@1 by the verifier, greedy and at T=1, on the same 200 problems, no
# calculator ($NANOPOST_HOME/instructgpt.json). Reuses the tokenizer and base model when $NANOPOST_HOME has them
# (e.g. after runs/cpu.sh), else trains them first (~3 min more).
#   bash runs/instructgpt.sh                  # everything under ./out/cpu
#   NANOPOST_HOME=/tmp/np bash runs/instructgpt.sh
#   SFT_CONVERSATIONS=3000 PPO_STEPS=4 bash runs/instructgpt.sh    # quicker, to weaker numbers
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; .venv/bin/pip install -q -r requirements.txt; fi
PY=.venv/bin/python
export NANOPOST_HOME="${NANOPOST_HOME:-$PWD/out/cpu}"
H=$NANOPOST_HOME
SFT_CONVERSATIONS=${SFT_CONVERSATIONS:-6000} PPO_STEPS=${PPO_STEPS:-24} EVAL_PROBLEMS=${EVAL_PROBLEMS:-200}
mkdir -p "$H"
OW=(); if [ "${OVERWRITE:-0}" = 1 ]; then OW=(--overwrite); fi  # OVERWRITE=1: replace this recipe's earlier runs
echo "InstructGPT's recipe on the embedded world -> $H"

stage() {  # stage NAME command...: run one stage, timed
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "=== $name ==="
  "$@"
  echo "=== $name done in $((SECONDS - t0)) s ==="
}

heldout() {  # heldout RUN: add the verifier's greedy pass@1 and pass@1 at T=1 (4 samples) to RUN's eval.json
  $PY chat_eval.py --model "$H/$1" --problems "$EVAL_PROBLEMS" --max-new-tokens 192 --out "$H/$1/eval.json"
  $PY chat_eval.py --model "$H/$1" --problems "$EVAL_PROBLEMS" --max-new-tokens 192 --samples 4 --temperature 1 \
    --out "$H/$1/eval.json"
}

t_all=$SECONDS
if [ -d "$H/base/default/checkpoints" ] && [ -d "$H/tokenizer" ]; then
  echo "reusing $H/tokenizer and $H/base/default"
else
  stage "tokenizer + base model" $PY base_train.py "${OW[@]}"
fi
stage "1. SFT" $PY chat_sft.py "${OW[@]}" --run-name instructgpt --num-train "$SFT_CONVERSATIONS" --eval-problems 0
stage "   its held-out pass@1" heldout sft/instructgpt
stage "2. a reward model" $PY chat_rm.py "${OW[@]}" --init "$H/sft/instructgpt" --run-name instructgpt
stage "3. PPO against the reward model, the verifier logged as the gold" $PY chat_ppo.py "${OW[@]}" \
  --init "$H/sft/instructgpt" --critic-init "$H/rm/instructgpt" --reward "rm:$H/rm/instructgpt+0*verifier" \
  --run-name instructgpt --steps "$PPO_STEPS" --eval-problems "$EVAL_PROBLEMS" --eval-every 1000
echo; echo "InstructGPT recipe done in $((SECONDS - t_all)) s"
$PY chat_eval.py --report sft/instructgpt rm/instructgpt ppo/instructgpt --out "$H/instructgpt.json"
