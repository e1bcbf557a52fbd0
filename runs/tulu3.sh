#!/usr/bin/env bash
# Tulu 3's recipe (Lambert et al. 2024, https://arxiv.org/abs/2411.15124) on the embedded world, on CPU:
#   1. SFT                          SFT on 6,000 of the world's conversations
#   2. on-policy preference pairs   chat_sample.py --tools: 4 answers to each of 800 training problems from the
#                                   SFT model, judged by the verifier; per problem its best answer against its
#                                   worst, where they differ (Tulu 3 judged with an LLM; any --reward works)
#   3. DPO                          chat_dpo.py --data on those pairs, from the SFT model
#   4. a reward model               chat_rm.py from the SFT model on the world's preference pairs: the value
#                                   model's start (Tulu 3 starts PPO's value model from its general reward model)
#   5. RLVR with PPO                chat_ppo.py --tools from the DPO model, rewarded by the verifier, its critic
#                                   started from that reward model
# and a table of each step's held-out pass@1, greedy and at T=1, with the calculator offered, on the same 200 problems
# ($NANOPOST_HOME/tulu3.json). Reuses the tokenizer and base model when $NANOPOST_HOME has them (e.g.
# after runs/cpu.sh), else trains them first (~3 min more).
#   bash runs/tulu3.sh                   # everything under ./out/cpu
#   NANOPOST_HOME=/tmp/np bash runs/tulu3.sh
#   SFT_CONVERSATIONS=3000 PPO_STEPS=2 bash runs/tulu3.sh    # quicker, to weaker numbers
# A model trained too little gets no pair of differing answers: step 2 then warns that it wrote none, and step 3 stops.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; .venv/bin/pip install -q -r requirements.txt; fi
PY=.venv/bin/python
TORCHRUN="$PY runs/launch.py --standalone --nproc_per_node=2"
export NANOPOST_HOME="${NANOPOST_HOME:-$PWD/out/cpu}"
H=$NANOPOST_HOME
SFT_CONVERSATIONS=${SFT_CONVERSATIONS:-6000} PPO_STEPS=${PPO_STEPS:-24}
SAMPLE_PROMPTS=${SAMPLE_PROMPTS:-800} EVAL_PROBLEMS=${EVAL_PROBLEMS:-200}
mkdir -p "$H"
OW=(); if [ "${OVERWRITE:-0}" = 1 ]; then OW=(--overwrite); fi  # OVERWRITE=1: replace this recipe's earlier runs
echo "Tulu 3's recipe on the embedded world -> $H"

stage() {  # stage NAME command...: run one stage, timed
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "=== $name ==="
  "$@"
  echo "=== $name done in $((SECONDS - t0)) s ==="
}

heldout() {  # heldout RUN: add greedy pass@1 and pass@1 at T=1 (4 samples), with the calculator offered, to
  # RUN's eval.json, measured as the RL stages measure them (a stage trained on --data has no answer key to grade)
  $PY chat_eval.py --model "$H/$1" --tools --problems "$EVAL_PROBLEMS" --max-new-tokens 192 --out "$H/$1/eval.json"
  $PY chat_eval.py --model "$H/$1" --tools --problems "$EVAL_PROBLEMS" --max-new-tokens 192 --samples 4 \
    --temperature 1 --out "$H/$1/eval.json"
}

t_all=$SECONDS
if [ -d "$H/base/default/checkpoints" ] && [ -d "$H/tokenizer" ]; then
  echo "reusing $H/tokenizer and $H/base/default"
else
  stage "tokenizer + base model" $PY base_train.py "${OW[@]}"
fi
stage "1. SFT" $PY chat_sft.py "${OW[@]}" --run-name tulu3 --num-train "$SFT_CONVERSATIONS" --eval-problems 0
stage "   its held-out pass@1" heldout sft/tulu3
stage "2. on-policy pairs judged by the verifier" $TORCHRUN chat_sample.py --init "$H/sft/tulu3" --tools \
  --num-prompts "$SAMPLE_PROMPTS" --samples 4 --pairs-out "$H/data/tulu3-pairs.jsonl"
stage "3. DPO" $PY chat_dpo.py "${OW[@]}" --init "$H/sft/tulu3" --data "$H/data/tulu3-pairs.jsonl" --run-name tulu3 --tools
stage "   its held-out pass@1" heldout dpo/tulu3
stage "4. a reward model, the value model's start" $PY chat_rm.py "${OW[@]}" --init "$H/sft/tulu3" --run-name tulu3
stage "5. RLVR with PPO" $PY chat_ppo.py "${OW[@]}" --init "$H/dpo/tulu3" --critic-init "$H/rm/tulu3" --run-name tulu3 --tools \
  --steps "$PPO_STEPS" --eval-problems "$EVAL_PROBLEMS" --eval-every 1000
echo; echo "Tulu 3 recipe done in $((SECONDS - t_all)) s"
$PY chat_eval.py --report sft/tulu3 dpo/tulu3 rm/tulu3 ppo/tulu3 --out "$H/tulu3.json"
