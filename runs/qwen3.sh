#!/usr/bin/env bash
# Post-train a Qwen3 checkpoint on your data, on GPUs: SFT -> DPO -> GRPO, each stage from the last.
# Nothing is downloaded: MODEL is a local Hugging Face folder (huggingface-cli download, elsewhere).
#   MODEL=/models/Qwen3-1.7B-Base SFT=sft.jsonl PREFS=prefs.jsonl RL=rl.jsonl NGPU=8 bash runs/qwen3.sh
#   FSDP=1 ... shards parameters, gradients and optimizer state across the GPUs (needed past ~1.7B on 80 GB)
# Learning rates: every stage takes the real-model preset unless LR_SFT / LR_DPO / LR_RL are set (the
# stage prints which it uses). Each stage prints its estimated peak memory per GPU before it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to a Qwen3 folder}" "${SFT:?set SFT to a {messages} JSONL}"
NGPU=${NGPU:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
RUN=${RUN:-qwen3}
FLAGS=(--device cuda --run-name "$RUN" ${FSDP:+--fsdp} --grad-checkpointing)
launch() { torchrun --standalone --nproc_per_node="$NGPU" "$@"; }
export NANOPOST_HOME=${NANOPOST_HOME:-$PWD/out/qwen3}

launch chat_sft.py --init "$MODEL" --data "$SFT" "${FLAGS[@]}" --seq-len 4096 --batch-size 64 \
    --device-batch-size 2 --epochs 2 --eval-problems 0 ${LR_SFT:+--lr $LR_SFT}
INIT=$NANOPOST_HOME/sft/$RUN
if [ -n "${PREFS:-}" ]; then
  launch chat_dpo.py --init "$INIT" --data "$PREFS" "${FLAGS[@]}" --max-len 4096 --batch-size 64 \
      --micro-batch-tokens 8192 --eval-problems 0 ${LR_DPO:+--lr $LR_DPO}
  INIT=$NANOPOST_HOME/dpo/$RUN
fi
if [ -n "${RL:-}" ]; then
  launch chat_rl.py --init "$INIT" --data "$RL" "${FLAGS[@]}" --prompts-per-step $((32 * NGPU)) --group-size 8 \
      --max-new-tokens 2048 --micro-batch-tokens 16384 --steps 200 --eval-every 20 ${LR_RL:+--lr $LR_RL}
fi
