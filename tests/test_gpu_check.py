"""runs/gpu_check.sh, the first contact with a GPU, end to end on CPU at tiny shapes (DEVICE=cpu), and its failure
paths: a call site whose attention kernel is not the expected one, and a stage whose peak memory is over its
estimate's bound, each make it exit 1, naming them, after printing the table."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_check(*flags):
    env = {**os.environ, "DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PY": sys.executable}
    r = subprocess.run(["bash", os.path.join(REPO, "runs", "gpu_check.sh"), *flags], env=env, capture_output=True,
                       text=True, timeout=900)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.slow  # every section: ~2.5 min on 2 cores
def test_gpu_check_runs_end_to_end_on_cpu():
    rc, out = gpu_check()
    assert rc == 0, out[-4000:]
    table = out[out.index("| check | measured"):]
    for row in ("logits against transformers", "attention kernel, training, packed documents",
                "attention kernel, decode", "head float32", "head bf16", "decode tokens/s", "compiled decode step",
                "SFT peak memory", "GRPO engine/trainer log-prob gap", "GRPO peak memory", "resume"):
        assert f"| {row}" in table, row
    assert "FAIL" not in out


def test_a_wrong_kernel_or_memory_over_the_estimate_fails_the_check():
    # fed a wrong expectation for the decode kernel, and a bound under any measured peak (its estimate - 99%): it
    # exits 1 naming both, the call sites whose kernel is right and the resume still passing
    rc, out = gpu_check("--only", "kernels,sft", "--expect-kernel", "decode=cudnn", "--max-over-estimate", "-0.99")
    assert rc == 1, out[-4000:]
    failed = out[out.index("FAILED:"):]
    assert "attention kernel, decode: expected cudnn, the trace shows flash_cpu" in failed
    assert "SFT: peak memory" in failed and "its estimate" in failed
    assert "| attention kernel, training, packed documents | flash_cpu | flash_cpu | ok |" in out
    rc, out = gpu_check("--only", "kernels")
    assert rc == 0 and "FAILED" not in out, out[-4000:]
