"""
Know before you OOM, from the command line: the peak memory per device of a run, without starting it.

    python memory.py --init FOLDER STAGE [the stage's flags]    this run's estimate, by component
    python memory.py                                            the tables of what fits where (README)

STAGE is sft, rm, dpo, kto, rl, ppo or distill; the flags are the stage's own (python chat_rl.py --help),
read by its parser and passed to its memory_estimate, the function the stage prints before it loads a model.
--nproc N: the ranks of a torchrun (per-device figures; with --fsdp, 1/N of the sharded state). The compute
dtype follows --device: bf16 on CUDA (cuda, or auto where torch has CUDA), float32 on CPU. For example:

    python memory.py --init ~/models/Qwen3-8B rl --device cuda --lora-rank 32 --grad-checkpointing
"""
import argparse
import sys

import torch

import chat_distill
import chat_dpo
import chat_kto
import chat_ppo
import chat_rl
import chat_rm
import chat_sft
from checkpoint import resolve_model_path
from common import check_flag_ranges, run_main, train_dtype
from data import rl_rows
from peak_memory import GiB, QWEN3, describe, stage_estimates
from rollout import prompt_length
from tasks import CALCULATOR_SCHEMA
from tokenizer import Tokenizer

STAGES = {"sft": chat_sft, "rm": chat_rm, "dpo": chat_dpo, "kto": chat_kto, "rl": chat_rl, "ppo": chat_ppo,
          "distill": chat_distill}
ROLLOUT_STAGES = ("rl", "ppo", "distill")  # they size their engine for the longest prompt of their data


def run_estimate(argv: list[str]) -> dict:
    """The estimate a stage prints for `argv` (memory.py's own flags, the stage, the stage's flags)."""
    ap = argparse.ArgumentParser(description="the peak memory per device of a run", add_help=False)
    ap.add_argument("--init", required=True, help="the model folder the run starts from")
    ap.add_argument("--nproc", type=int, default=1, help="ranks, as torchrun's --nproc_per_node")
    ap.add_argument("stage", choices=sorted(STAGES))
    own, rest = ap.parse_known_args(argv)
    stage = STAGES[own.stage]
    args = stage.parser.parse_args([*rest, "--init", own.init])
    check_flag_ranges(own)
    check_flag_ranges(args)
    init = resolve_model_path(own.init)
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    kwargs = dict(world_size=own.nproc, cuda=cuda)
    if own.stage in ROLLOUT_STAGES:
        rows, _ = rl_rows(args.data, args.eval_data, eval_problems=args.eval_problems, num_prompts=args.num_prompts,
                          seed=args.seed)
        kwargs["prompt_len"] = prompt_length(Tokenizer.load(init), rows, [CALCULATOR_SCHEMA] if args.tools else None)
    est = stage.memory_estimate(args, init, **kwargs)
    dtype = str(train_dtype("cpu")).removeprefix("torch.")  # CPU: the stages' choice (common.train_dtype)
    compute = "CUDA, bf16 compute" if cuda else f"CPU, training forwards in {dtype}" + (
        " (estimated at float32: an upper bound)" if dtype != "float32" else "")
    print(f"{own.stage} from {init}, {own.nproc} rank(s), {compute}: estimated peak memory per device {describe(est)}")
    return est


STAGE_NAMES = ("SFT", "DPO", "GRPO", "PPO")  # peak_memory.stage_estimates' keys
LORA_RANK = 32
SETUPS = {"1 GPU": dict(world_size=1, fsdp=False, lora_rank=0), "8 GPUs, --fsdp": dict(world_size=8, fsdp=True,
                                                                                      lora_rank=0),
          "1 GPU, LoRA 32": dict(world_size=1, fsdp=False, lora_rank=LORA_RANK)}


def tables() -> dict:
    """What fits where, from the estimator: {setup: {Qwen3 size: {stage: GiB per device}}} for SETUPS, and
    "fits": {(setup, GiB of device memory): {stage: the largest Qwen3 it trains}}, 10% kept for the CUDA allocator
    and the runtime. What `python memory.py` prints, and what docs/real-models.md and docs/lora.md quote (a test
    holds them equal)."""
    out = {setup: {name: {stage: e["total"] / GiB for stage, e in stage_estimates(shape, **kw).items()}
                   for name, shape in QWEN3.items()} for setup, kw in SETUPS.items()}
    out["fits"] = {(setup, size): {stage: max([name for name in QWEN3 if out[setup][name][stage] <= 0.9 * size],
                                              key=list(QWEN3).index, default="-") for stage in STAGE_NAMES}
                   for setup in SETUPS for size in (24, 80, 141)}
    return out


def print_tables() -> None:
    """The tables of what fits where (tables())."""
    t = tables()
    headings = {"1 GPU": "one GPU (bf16 compute, float32 master weights, --grad-checkpointing)",
                "8 GPUs, --fsdp": "8 GPUs with --fsdp",
                "1 GPU, LoRA 32": f"one GPU, LoRA rank {LORA_RANK} (bf16 frozen base, float32 adapters, "
                                  f"--grad-checkpointing)"}
    for setup, heading in headings.items():
        lora = SETUPS[setup]["lora_rank"]
        print(f"GiB per device, {heading}:")
        print(f"{'Qwen3':>6s}  {'adapters' if lora else 'params':>8s}" + "".join(f"{s:>9s}" for s in STAGE_NAMES))
        for name, shape in QWEN3.items():
            size = f"{shape.lora_params(lora) / 1e6:6.1f}M" if lora else f"{shape.params() / 1e9:6.2f}B"
            print(f"{name:>6s}  {size:>8s}" + "".join(f"{t[setup][name][s]:9.1f}" for s in STAGE_NAMES))
        print()
    print("The largest Qwen3 each stage trains, by this estimate (GiB of device memory):")
    for (setup, size), fits in t["fits"].items():
        print(f"{setup:>15s}, {size:3d} GiB:" + "".join(f"  {s} {n:>4s}" for s, n in fits.items()))


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        print_tables()
    elif argv[0] in ("-h", "--help"):
        print(__doc__.strip())
    else:
        run_estimate(argv)


if __name__ == "__main__":
    run_main(main)
