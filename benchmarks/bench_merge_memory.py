"""
Peak memory of merge.py: the growth of the merging process's peak resident memory (VmHWM) during a
merge of N model folders of a given size, against the size of its largest tensor and of one folder.
The folders hold random float32 (or bfloat16) tensors written as safetensors, some of them sharded; the
merge runs in a fresh process that measures itself before and after.

    python benchmarks/bench_merge_memory.py [--folders 2] [--mb 400] [--tensor-mb 16] [--dtype float32]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Linux: writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current resident size (VmRSS)
MEASURE = """
import json, sys, time
sys.path.insert(0, {repo!r})
import torch
from merge import FolderTensors, merge

def status_mb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) / 1024

folders, out = {folders!r}, {out!r}
sources = [FolderTensors(f) for f in folders]
open("/proc/self/clear_refs", "w").write("5")
before = status_mb("VmRSS")
t0 = time.time()
merge(sources, [1 / len(folders)] * len(folders), out)
print(json.dumps({{"before_mb": before, "after_mb": status_mb("VmHWM"), "seconds": time.time() - t0}}))
"""


def make_folder(path, megabytes, tensor_mb, dtype, seed, shards):
    """config.json and random tensors of tensor_mb each, split over `shards` safetensors files."""
    os.makedirs(path)
    numel = int(tensor_mb * 2**20) // dtype.itemsize
    count = max(1, int(megabytes // tensor_mb))
    g = torch.Generator().manual_seed(seed)
    names = [f"model.layers.{i}.mlp.weight" for i in range(count)]
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({n: torch.randn(numel // 1024, 1024, generator=g).to(dtype) for n in part}, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    if shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, f)
    return count * numel * dtype.itemsize / 2**20


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--folders", type=int, default=2)
    ap.add_argument("--mb", type=float, default=400, help="size of each folder")
    ap.add_argument("--tensor-mb", type=float, default=16, help="size of each tensor")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [os.path.join(tmp, f"m{i}") for i in range(args.folders)]
        sizes = [make_folder(f, args.mb, args.tensor_mb, dtype, seed=i, shards=1 + i % 2) for i, f in enumerate(folders)]
        code = MEASURE.format(repo=REPO, folders=folders, out=os.path.join(tmp, "merged"))
        result = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)
    growth = result["after_mb"] - result["before_mb"]
    print(f"{args.folders} folders of {sizes[0]:.0f} MB ({args.dtype}, tensors of {args.tensor_mb:g} MB, "
          f"the second one sharded), merged in {result['seconds']:.1f} s")
    print(f"resident before the merge {result['before_mb']:.0f} MB, peak during it {result['after_mb']:.0f} MB: "
          f"growth {growth:.0f} MB = {growth / args.tensor_mb:.1f} tensors = {growth / sizes[0]:.2f} of one folder")
