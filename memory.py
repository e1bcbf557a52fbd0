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
from common import run_main
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
    init = resolve_model_path(own.init)
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    kwargs = dict(world_size=own.nproc, cuda=cuda)
    if own.stage in ROLLOUT_STAGES:
        rows, _ = rl_rows(args.data, args.eval_data, eval_problems=args.eval_problems, num_prompts=args.num_prompts,
                          seed=args.seed)
        kwargs["prompt_len"] = prompt_length(Tokenizer.load(init), rows, [CALCULATOR_SCHEMA] if args.tools else None)
    est = stage.memory_estimate(args, init, **kwargs)
    print(f"{own.stage} from {init}, {own.nproc} rank(s), {'CUDA, bf16' if cuda else 'CPU, float32'} compute: "
          f"estimated peak memory per device {describe(est)}")
    return est


def print_tables() -> None:
    """The README's tables of what fits where, from the estimator."""
    print("GiB per device, one GPU (bf16 compute, float32 master weights, --grad-checkpointing):")
    print(f"{'Qwen3':>6s}  {'params':>7s}" + "".join(f"{s:>9s}" for s in ("SFT", "DPO", "GRPO", "PPO")))
    for name, shape in QWEN3.items():
        est = stage_estimates(shape)
        print(f"{name:>6s}  {shape.params() / 1e9:6.2f}B" + "".join(f"{e['total'] / GiB:9.1f}" for e in est.values()))
    print("\nGiB per device, 8 GPUs with --fsdp:")
    for name, shape in QWEN3.items():
        est = stage_estimates(shape, world_size=8, fsdp=True)
        print(f"{name:>6s}  {shape.params() / 1e9:6.2f}B" + "".join(f"{e['total'] / GiB:9.1f}" for e in est.values()))
    rank = 32
    print(f"\nGiB per device, one GPU, LoRA rank {rank} (bf16 frozen base, float32 adapters, --grad-checkpointing):")
    for name, shape in QWEN3.items():
        est = stage_estimates(shape, lora_rank=rank)
        print(f"{name:>6s}  {shape.lora_params(rank) / 1e6:6.1f}M" + "".join(f"{e['total'] / GiB:9.1f}" for e in est.values()))
    print("\nThe largest Qwen3 each stage trains, by this estimate (GiB of device memory):")
    for label, gpus, fsdp, r in (("1 GPU", 1, False, 0), ("8 GPUs, --fsdp", 8, True, 0), ("1 GPU, LoRA 32", 1, False, 32)):
        for size in (24, 80, 141):
            fits = {stage: "-" for stage in ("SFT", "DPO", "GRPO", "PPO")}
            for name, shape in QWEN3.items():
                for stage, e in stage_estimates(shape, world_size=gpus, fsdp=fsdp, lora_rank=r).items():
                    if e["total"] <= 0.9 * size * GiB:  # 10% for the CUDA allocator and the runtime
                        fits[stage] = name
            print(f"{label:>15s}, {size:3d} GiB:" + "".join(f"  {s} {n:>4s}" for s, n in fits.items()))


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
