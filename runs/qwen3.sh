#!/usr/bin/env bash
# Post-train a Qwen3 checkpoint on your data: SFT -> DPO -> GRPO, each stage from the last.
# Nothing is downloaded: MODEL is a local Hugging Face folder (huggingface-cli download, elsewhere).
#   MODEL=/models/Qwen3-1.7B-Base SFT=sft.jsonl PREFS=prefs.jsonl RL=rl.jsonl NGPU=8 bash runs/qwen3.sh
#   FSDP=1 ... shards parameters, gradients and optimizer state across the GPUs (needed past ~1.7B on 80 GB)
#   OVERWRITE=1 ... replaces this script's earlier runs (without it a second run refuses); a switch is on at 1 only
# The defaults fit an 80 GB GPU with 10% to spare by the memory estimate (prompts of up to 1,024 tokens; #51):
# GRPO samples 64 answers a GPU of up to 2,048 new tokens (the KV cache of 256 would be 75 GB at 0.6B).
# Learning rates: every stage takes the real-model preset unless LR_SFT / LR_DPO / LR_RL are set (the
# stage prints which it uses). Each stage prints its estimated peak memory per device before it starts.
# Try it small, or on CPU, before renting GPUs: every size below is a variable, e.g.
#   DEVICE=cpu NGPU=1 SEQ_LEN=512 BATCH=4 DEVICE_BATCH=2 PROMPTS=2 MAX_NEW_TOKENS=16 RL_STEPS=1 MODEL=... SFT=... bash runs/qwen3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to a Qwen3 folder}" "${SFT:?set SFT to a {messages} JSONL}"
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then NGPU=${NGPU:-$($PY -c "import torch; print(max(1, torch.cuda.device_count()))")}; fi
NGPU=${NGPU:-1}
SEQ_LEN=${SEQ_LEN:-4096} BATCH=${BATCH:-64} DEVICE_BATCH=${DEVICE_BATCH:-2}
PROMPTS=${PROMPTS:-$((8 * NGPU))} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-2048} RL_STEPS=${RL_STEPS:-200}
RUN=${RUN:-qwen3}
FLAGS=(--device "$DEVICE" --run-name "$RUN" --grad-checkpointing)
if [ "${FSDP:-0}" = 1 ]; then FLAGS+=(--fsdp); fi            # switches are on at 1 only: FSDP=0 is off
if [ "${OVERWRITE:-0}" = 1 ]; then FLAGS+=(--overwrite); fi  # OVERWRITE=1 replaces this script's earlier runs
# torchrun, minus its traceback when a stage stops on a mistake of ours (the stage's one error line stays visible)
launch() { $PY runs/launch.py --standalone --nproc_per_node="$NGPU" "$@"; }
export NANOPOST_HOME=${NANOPOST_HOME:-$PWD/out/qwen3}

launch chat_sft.py --init "$MODEL" --data "$SFT" "${FLAGS[@]}" --seq-len "$SEQ_LEN" --batch-size "$BATCH" \
    --device-batch-size "$DEVICE_BATCH" --epochs 2 --eval-problems 0 ${LR_SFT:+--lr $LR_SFT}
INIT=$NANOPOST_HOME/sft/$RUN
if [ -n "${PREFS:-}" ]; then
  launch chat_dpo.py --init "$INIT" --data "$PREFS" "${FLAGS[@]}" --max-len "$SEQ_LEN" --batch-size "$BATCH" \
      --micro-batch-tokens $((2 * SEQ_LEN)) --eval-problems 0 ${LR_DPO:+--lr $LR_DPO}
  INIT=$NANOPOST_HOME/dpo/$RUN
fi
if [ -n "${RL:-}" ]; then
  launch chat_rl.py --init "$INIT" --data "$RL" "${FLAGS[@]}" --prompts-per-step "$PROMPTS" --group-size 8 \
      --max-new-tokens "$MAX_NEW_TOKENS" --micro-batch-tokens $((4 * SEQ_LEN)) --steps "$RL_STEPS" \
      --eval-every 20 ${LR_RL:+--lr $LR_RL}
fi
