"""
A machine-speed reference: a fixed float32 matmul workload, timed, so that a reader of a pipeline's stage
times can tell a slow machine (or a busy one) from a slow change. runs/cpu.sh records it in timings.json
beside report.json.

    python benchmarks/speed_reference.py            # prints {"matmul_s": ..., "threads": ...}

The workload: 64 products of two 512 x 512 float32 matrices, the fastest of 5 repeats (the minimum is the
figure least disturbed by other processes), on the threads torch uses by default.
"""
import json
import time

import torch


def speed_reference(repeats: int = 5, size: int = 512, products: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(products):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return {"matmul_s": round(best, 4), "threads": torch.get_num_threads()}


if __name__ == "__main__":
    print(json.dumps(speed_reference()))
