#!/usr/bin/env bash
# The single-GPU check, under 8 minutes on one H100 or H200: the CUDA-only tests (bf16 decode_step against
# the module forward; the engine/trainer log-prob gap under 0.02 nats), then a Qwen3-0.6B-shaped model with
# the real vocabulary through 2 SFT steps at 4k-token rows and 2 GRPO steps (64 prompts x 8 answers x 512
# new tokens): tokens/s, MFU, peak memory against the estimate, and the attention backends.
#   bash runs/gpu_check.sh          # on a CUDA machine whose torch is the CUDA build of torch 2.13.0
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
$PY -m pytest -q tests/test_engine_cuda.py
$PY benchmarks/gpu_check.py
