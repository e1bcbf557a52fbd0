#!/usr/bin/env bash
# The first contact with a GPU, under 10 minutes on one H100 or H200 (issue #51): the CUDA-only tests
# (tests/test_engine_cuda.py), then benchmarks/gpu_check.py at Qwen3-0.6B's shape with the real vocabulary.
# It checks, and exits non-zero naming what failed: our bf16 logits against transformers', the attention kernel
# each call site gets (read from a profiler trace: flash for training, memory-efficient for the engine, never
# cuDNN), each stage's peak memory against its estimate (at most 25% over), a resume. It measures, against floors
# it prints without failing on them: each head precision's speed and engine/trainer gap, decode tokens/s at 64 and
# 256 rows, the compiled decode step against eager, SFT and GRPO MFU. It ends with one table for docs/LOG.md.
#   bash runs/gpu_check.sh                   # on a CUDA machine whose torch is the CUDA build of torch 2.13.0
#   DEVICE=cpu bash runs/gpu_check.sh        # tiny shapes on CPU: checks the script itself (tests/test_gpu_check.py)
#   bash runs/gpu_check.sh --only kernels    # benchmarks/gpu_check.py's flags after
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device (DEVICE=cpu checks the script on CPU)'"
  $PY -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py
fi
exec $PY benchmarks/gpu_check.py --device "$DEVICE" "$@"
