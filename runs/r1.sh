#!/usr/bin/env bash
# DeepSeek-R1's recipe (Guo et al. 2025, https://arxiv.org/abs/2501.12948) on the embedded world, on CPU:
#   0. R1-Zero                   GRPO straight from the base, prompted as it was pretrained (--prompt-format plain),
#                                no SFT, no calculator (R1 used R1-Zero's outputs, cleaned, for its cold start; here
#                                the cold start is the world's own conversations, so R1-Zero is run to be compared)
#   1. cold-start SFT            SFT on 6,000 of the world's conversations (R1: thousands of long CoT examples)
#   2. reasoning GRPO            RL with the verifier and a format reward (verifier+0.1*format: R1's accuracy and
#                                format rewards) and the calculator, from the cold-start model. R1's language-
#                                consistency reward has nothing to measure here: the world has one language
#   3. rejection sampling        chat_sample.py --tools: 4 answers to each of 800 training problems from the
#                                GRPO model, the verified ones kept (one per problem), calls and results included
#   4. rejection-sampling SFT    chat_sft.py --data on them, from the cold-start SFT model
#   5. last GRPO                 RL again, from the rejection-sampled SFT model, graded by rules (the verifier) and
#                                a grader model at a small weight (R1's reward model for general data): here the
#                                stand-in judge (standin_judge.py, rubrics/arithmetic.txt), a program in a model's place
# and a table of each step's held-out pass@1, greedy and at T=1, with the calculator offered, on the same 200 problems
# ($NANOPOST_HOME/r1.json). Reuses the tokenizer and base model when $NANOPOST_HOME has them (e.g. after
# runs/cpu.sh), else trains them first (~3 min more).
#   bash runs/r1.sh                      # everything under ./out/cpu
#   NANOPOST_HOME=/tmp/np bash runs/r1.sh
#   SFT_CONVERSATIONS=3000 RL_STEPS=2 bash runs/r1.sh    # every step in ~8 min, to weaker numbers
# A model trained too little gets no sampled answer right: step 3 then warns that it kept nothing, and step 4 stops.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; .venv/bin/pip install -q -r requirements.txt; fi
PY=.venv/bin/python
TORCHRUN="$PY runs/launch.py --standalone --nproc_per_node=2"
export NANOPOST_HOME="${NANOPOST_HOME:-$PWD/out/cpu}"
H=$NANOPOST_HOME
SFT_CONVERSATIONS=${SFT_CONVERSATIONS:-6000} RL_STEPS=${RL_STEPS:-6}
SAMPLE_PROMPTS=${SAMPLE_PROMPTS:-800} EVAL_PROBLEMS=${EVAL_PROBLEMS:-200}
mkdir -p "$H"
OW=(); if [ "${OVERWRITE:-0}" = 1 ]; then OW=(--overwrite); fi  # OVERWRITE=1: replace this recipe's earlier runs
echo "DeepSeek-R1's recipe on the embedded world -> $H"

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
stage "0. R1-Zero: GRPO from the base" $TORCHRUN chat_rl.py "${OW[@]}" --init "$H/base/default" --prompt-format plain \
  --run-name r1-zero --steps "$RL_STEPS" --eval-problems "$EVAL_PROBLEMS" --eval-every 1000
stage "1. cold-start SFT" $PY chat_sft.py "${OW[@]}" --run-name r1 --num-train "$SFT_CONVERSATIONS" --eval-problems 0
stage "   its held-out pass@1" heldout sft/r1
stage "2. reasoning GRPO" $TORCHRUN chat_rl.py "${OW[@]}" --init "$H/sft/r1" --run-name r1 --tools --steps "$RL_STEPS" \
  --reward verifier+0.1*format \
  --eval-problems "$EVAL_PROBLEMS" --eval-every 1000 --save-every 4
stage "3. rejection sampling from the GRPO model" $TORCHRUN chat_sample.py --init "$H/rl/r1" --tools \
  --num-prompts "$SAMPLE_PROMPTS" --samples 4 --keep verified --max-per-prompt 1 --out "$H/data/r1-rs.jsonl"
stage "4. rejection-sampling SFT" $PY chat_sft.py "${OW[@]}" --init "$H/sft/r1" --data "$H/data/r1-rs.jsonl" --run-name r1-rs \
  --epochs 2 --lr 3e-4 --warmup-steps 3
stage "   its held-out pass@1" heldout sft/r1-rs
stage "5. last GRPO: rules and a grader" $TORCHRUN chat_rl.py "${OW[@]}" --init "$H/sft/r1-rs" --run-name r1-2 --tools \
  --steps "$RL_STEPS" --reward verifier+0.2*judge:standin:arithmetic --rubric rubrics/arithmetic.txt \
  --eval-problems "$EVAL_PROBLEMS" --eval-every 1000
echo; echo "R1 recipe done in $((SECONDS - t_all)) s"
$PY chat_eval.py --report rl/r1-zero sft/r1 rl/r1 sft/r1-rs rl/r1-2 --out "$H/r1.json"
