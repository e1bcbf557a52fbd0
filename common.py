"""
Run plumbing every stage shares, and nothing of the method: errors for people, ranks and collectives from
torchrun's environment, DDP and FSDP2 wrapping, rank-0 printing, seeds and dtypes, the flags and start of a
run (its directory, config and JSONL metrics), the optimizer and the learning-rate schedule. It imports
nothing of nanopost's: every other module may import it.

Distributed training is an equivalence, not a different program: each rank computes the SUM of its token
losses divided by the GLOBAL token count (all micro-batches, all ranks), and the wrappers SUM gradients
across ranks (wrap_model). N ranks with batch B/N then produce exactly the gradient of one rank with
batch B, with torch's DistributedDataParallel or with FSDP2 (--fsdp).
"""
import contextlib
import datetime
import gc
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

REPO = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------
# Errors for people

class UserError(ValueError):
    """A mistake in what the user asked for: a malformed data row (file:line), a missing checkpoint, flags
    that do not go together, a full disk. The run stops with this one line and exit code 2, no traceback
    (run_main). Anything else is a bug of ours and keeps its traceback."""


def run_main(main):
    """Run a stage's main(). A UserError prints one line (rank 0 only under torchrun, whose launcher then
    prints its own summary) and exits with code 2."""
    try:
        main()
    except UserError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    cleanup_dist()


# What each numeric flag can mean, by name, in every script: a value outside is refused at start, in one line
# (check_flag_ranges; the training stages call it through start_run). Conditions joined by "," all hold; after
# a ";" the reason, when the bound is not obvious.
FLAG_RANGES = {
    # optimization
    "lr": "> 0", "critic_lr": "> 0", "weight_decay": ">= 0", "grad_clip": ">= 0", "warmup_steps": ">= 0",
    "final_lr_ratio": ">= 0, <= 1", "steps": ">= 0", "epochs": "> 0", "time_budget": ">= 0",
    "freeze_actor_steps": ">= 0",
    # sizes
    "batch_size": ">= 1", "device_batch_size": ">= 1", "seq_len": ">= 2", "max_len": ">= 2", "max_seq_len": ">= 2",
    "micro_batch_tokens": ">= 1", "max_new_tokens": ">= 1", "prompts_per_step": ">= 1", "num_prompts": ">= 1",
    "num_train": ">= 1", "num_val": ">= 0", "num_docs": ">= 1", "samples": ">= 1", "samples_per_prompt": ">= 1",
    "group_size": ">= 2; a group of one answer has nothing to be compared with, so its advantage is always 0",
    "minibatches": ">= 1", "ppo_epochs": ">= 1", "max_resample": ">= 0",
    "max_tool_turns": ">= 0", "max_per_prompt": ">= 1", "problems": ">= 1", "nproc": ">= 1", "staleness": ">= 0",
    "overlong_buffer": ">= 0", "vocab_size": ">= 16", "n_layer": ">= 1", "n_head": ">= 1", "n_kv_head": ">= 1",
    "n_embd": ">= 1", "lora_rank": ">= 0", "lora_alpha": "> 0", "lora_dropout": ">= 0, < 1",
    # evaluation, checkpoints, processes
    "eval_every": ">= 1", "save_every": ">= 1", "sample_every": ">= 0", "eval_problems": ">= 0", "pass_k": ">= 0",
    "dist_timeout": "> 0",
    # sampling (chat_cli, chat_eval and chat_sample take --temperature 0 as greedy: check_flag_ranges(greedy=True))
    "temperature": "> 0", "sampler_temperature": "> 0", "top_k": ">= 1", "top_p": "> 0, <= 1",
    # the losses
    "eps_low": ">= 0, < 1", "eps_high": ">= 0", "dual_clip": "> 1", "cispo_cap": "> 0", "tis_cap": "> 0",
    "mask_eps": "> 0",
    "kl_beta": ">= 0", "kl_target": "> 0", "kl_horizon": "> 0", "target_kl": "> 0", "mask_kl_coef": ">= 0",
    "gamma": ">= 0, <= 1", "lam": ">= 0, <= 1", "value_clip": ">= 0", "discount": ">= 0, <= 1", "beta": "> 0",
    "gkd_beta": ">= 0, <= 1", "top_entropy": "> 0, <= 1; the fraction of the batch's tokens trained",
    "label_smoothing": ">= 0, < 0.5", "rpo_alpha": ">= 0", "desirable_weight": ">= 0",
    "undesirable_weight": ">= 0", "center_coef": ">= 0", "lm_coef": ">= 0",
}
FREE_NUMBERS = {"seed", "entropy_coef", "overlong_penalty", "truncated_reward", "threshold"}  # any value is meant
_COMPARE = {">": float.__gt__, ">=": float.__ge__, "<": float.__lt__, "<=": float.__le__}


def check_flag_ranges(args, greedy=False):
    """Refuse, in one line, a numeric flag whose value it cannot mean (FLAG_RANGES), e.g. --lr -1 or
    --group-size 1. greedy: --temperature 0 means greedy decoding (chat_cli, chat_eval, chat_sample)."""
    for name, value in vars(args).items():
        spec = ">= 0" if greedy and name == "temperature" else FLAG_RANGES.get(name)
        if spec is None or value is None or isinstance(value, bool):
            continue
        spec, _, why = spec.partition(";")
        conditions = [c.split() for c in spec.split(",")]
        if not all(_COMPARE[op](float(value), float(bound)) for op, bound in conditions):
            raise UserError(f"--{name.replace('_', '-')} {value}: must be {spec.replace(',', ' and')}"
                            + (f" ({why.strip()})" if why else ""))


# ------------------------------------------------------------------------------------------------
# Processes: ranks, devices, collectives

@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self):
        return self.rank == 0


_DIST = DistInfo()


def usable_cpus() -> int:
    """The cores this process may run on: its affinity mask (taskset, cgroup cpusets), which os.cpu_count()
    ignores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def init_dist(device: str = "auto", timeout_minutes: float = 30) -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE (a single process when absent): gloo on CPU, nccl on CUDA.
    On CPU each rank gets cores / local ranks threads: oversubscribed ranks run several times slower.
    timeout_minutes (--dist-timeout): how long a rank may wait inside a collective before the process
    group gives up (NCCL's watchdog default is 10 minutes; a slow checkpoint can take longer)."""
    global _DIST
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):  # mps, xpu, ...: autocast, collectives and kernels untested
        raise UserError(f"--device {device}: nanopost runs on cpu or cuda (or auto: cuda when this torch sees a GPU)")
    if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available() \
            and dev.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} visible GPU(s); under "
                        f"torchrun pass --device cuda (each rank takes its LOCAL_RANK's GPU)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise UserError(f"--device cuda: this torch ({torch.__version__}) is a CPU build, without CUDA; install "
                            f"the CUDA build of the same version (pip install torch=={torch.__version__.split('+')[0]} "
                            f"--index-url https://download.pytorch.org/whl/cu126, for CUDA 12.6) or use --device cpu")
        raise UserError("--device cuda: no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), or use "
                        "--device cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world > 1:
        if dev.type == "cpu":  # the cores this process may use, shared among the ranks of this machine
            torch.set_num_threads(max(1, usable_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(minutes=timeout_minutes))
    _DIST = DistInfo(rank, world, dev)
    return _DIST


def dist_info() -> DistInfo:
    return _DIST


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(x):
    """Sum a tensor (in place) or a Python number across ranks; returns the result."""
    if not dist.is_initialized():
        return x
    if isinstance(x, torch.Tensor):
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x
    t = torch.tensor(float(x), dtype=torch.float64, device=_DIST.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item()


def all_reduce_dict(values: dict, keys=None) -> dict:
    """Sum named numbers across ranks in one collective. keys: the names, in the same order on every rank
    (default: every rank's names, gathered and sorted: a name a rank does not have counts 0 there, e.g. the
    sources of a mixture that one rank's batch happens not to hold)."""
    if keys is None:
        keys = sorted({key for names in all_gather_objects(sorted(values)) for key in names})
    keys = list(keys)
    t = torch.tensor([float(values.get(k, 0.0)) for k in keys], dtype=torch.float64, device=_DIST.device)
    return dict(zip(keys, all_reduce_sum(t).tolist()))


def all_gather_objects(obj) -> list:
    """Every rank's picklable object, in rank order (a list of one without torchrun)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(x):
    """The maximum of a Python number across ranks."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(float(x), dtype=torch.float64, device=_DIST.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def global_mean_var(x, mask=None):
    """Mean and (population) variance of x (over the mask's 1s) across the WHOLE batch, all ranks."""
    mask = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    n = max(1.0, all_reduce_sum(float(mask.sum())))
    mean = all_reduce_sum(float((x * mask).sum())) / n
    var = all_reduce_sum(float((((x - mean) * mask) ** 2).sum())) / n
    return mean, var


def broadcast_parameters(model):
    """Every rank starts from rank 0's weights (per-rank seeds would otherwise initialize them apart)."""
    if dist.is_initialized():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)


# ------------------------------------------------------------------------------------------------
# Printing, seeds, dtypes

def print0(*args, **kwargs):
    if _DIST.is_main:
        print(*args, **kwargs, flush=True)


def seed_everything(seed: int, rank: int = 0):
    """Per-rank seeds: ranks must not draw the same samples."""
    s = seed + 1000 * rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def compute_dtype(device) -> torch.dtype:
    """The dtype every forward computes in: bfloat16 on CUDA (where supported), float32 on CPU. Weights that
    an optimizer updates stay float32 (AdamW updates at lr 1e-6 vanish in bfloat16); the KV cache, the
    engine's weights and every frozen model (reference, reward model, judge, teacher) live in this dtype."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AVX-512 BF16 or AMX): there bfloat16 autocast
    beats float32 (a base step x0.64 on a 2-core AMD EPYC, docs/speed.md); elsewhere it only adds casts."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))


def train_dtype(device) -> torch.dtype:
    """The dtype a training forward autocasts to from its float32 master weights: the compute dtype on CUDA;
    on CPU bfloat16 where the CPU has bfloat16 units, else float32. The engine and frozen models stay in
    compute_dtype (float32 on CPU). $NANOPOST_CPU_AUTOCAST=float32 or bfloat16 overrides the CPU's choice
    (the tests pin float32, so that every machine checks the same numbers)."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return compute_dtype(dev)
    choice = os.environ.get("NANOPOST_CPU_AUTOCAST", "auto")
    if choice not in ("auto", "float32", "bfloat16"):
        raise UserError(f"NANOPOST_CPU_AUTOCAST={choice}: expected auto, float32 or bfloat16")
    if choice == "auto":
        return torch.bfloat16 if cpu_has_bf16_units() else torch.float32
    return getattr(torch, choice)


def autocast(device, dtype=None):
    """Autocast to `dtype` (default: train_dtype(device)) around a training forward of float32 master
    weights; a no-op when that dtype is float32."""
    dev = torch.device(device)
    dtype = dtype or train_dtype(dev)
    if dtype == torch.float32:
        return torch.autocast(dev.type, enabled=False)
    return torch.autocast(dev.type, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# Distributed training: torch's DistributedDataParallel, or FSDP2 (--fsdp)

def _sum_allreduce_hook(state, bucket):
    """DDP averages gradients by default; the losses here are already divided by the global normalizer,
    so the buckets are summed instead."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def shard_model(model, param_dtype=None):
    """FSDP2 in place (torch.distributed.fsdp.fully_shard): each decoder block, then the root, so that
    parameters, gradients and AdamW state are split across ranks and a block's weights are gathered only
    for its own forward and backward. The forward computes in param_dtype (default: the compute dtype, bf16
    on CUDA) from float32 master shards, and gradients are reduced in float32 (engine.fsdp_param_dtype reads
    it back: the engine samples with the weights as the trainer's forward sees them). Gradients are SUMMED
    (the loss is already divided by the global normalizer): set_gradient_divide_factor(1.0) on every FSDP
    module (the call is not recursive) and, on gloo, set_force_sum_reduction_for_comms(True). Returns the
    model (its class becomes FSDP<class>)."""
    if isinstance(model, FSDPModule):
        return model
    dev = _DIST.device
    low = param_dtype or compute_dtype(dev)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low != torch.float32 else \
        MixedPrecisionPolicy()
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if dev.type == "cpu":
                module.set_force_sum_reduction_for_comms(True)
    return model


def wrap_model(model, fsdp=False):
    """The module that training calls (so that the wrapper's hooks see every forward). One process: the
    model itself. N ranks: FSDP2 (shard_model) with fsdp=True, else DistributedDataParallel, each rank a
    full replica, gradients summed in buckets overlapped with the backward pass (_sum_allreduce_hook)."""
    if _DIST.world_size == 1:
        return model
    if fsdp:
        return shard_model(model)
    ddp = DDP(model, device_ids=[_DIST.device.index] if _DIST.device.type == "cuda" else None,
              forward_sync_buffers=False, gradient_as_bucket_view=True)  # rank 0's weights broadcast here
    ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


def unwrap(model):
    """The GPT inside a DDP wrapper (an FSDP2 model is its own module, with sharded parameters)."""
    return getattr(model, "module", model)


def reshard(model) -> bool:
    """Put an FSDP2 model's parameters back in their sharded form (the root keeps its own gathered after a
    forward with no backward, e.g. an evaluation; the optimizer and checkpoints know the shards); returns
    whether the model is sharded at all."""
    modules = [m for m in unwrap(model).modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.reshard()
    return bool(modules)


def no_sync(model, last: bool):
    """Gradient accumulation: DDP skips its all-reduce on every micro-batch but the last of an optimizer
    step. FSDP2 reduce-scatters every micro-batch: holding unsharded float32 gradients across micro-
    batches would cost their full size (32 GB at 8B parameters)."""
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def idle_pass(model, backward=True):
    """A forward (and backward) of one token that trains nothing, for a rank that has no data left in a
    pass the other ranks run: under DDP every rank must join each gradient all-reduce, under FSDP2 every
    forward and backward gathers and scatters weights with all ranks."""
    x = torch.zeros(1, 1, dtype=torch.long, device=_DIST.device)
    out = model(x)
    if backward:
        (out.float().sum() * 0.0).backward()


def rank_passes(model, mine):
    """Yield this rank's batches (`mine`, one a pass), then run idle passes until it has run as many passes as the
    rank with the most: every forward of an FSDP2 model is a collective that all ranks join."""
    for c in range(int(all_reduce_max(len(mine)))):
        if c < len(mine):
            yield mine[c]
        else:
            idle_pass(model, backward=False)


def cleanup_dist():
    """Tear the process group down. A DistributedDataParallel wrapper still alive then (its hooks make
    reference cycles that only the collector frees) aborts the process one time in ~15 on gloo with
    "terminate called without an active exception" (torch 2.13): collect it first. run_main calls this
    after main() has returned, when its models are garbage."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()  # no rank tears the process group down while another still talks to it
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Runs: where they write, what they print, what they cost

def nanopost_home() -> str:
    return os.environ.get("NANOPOST_HOME") or os.path.join(REPO, "out")


def print_config(args, title: str):
    print0(f"== {title} ==")
    for k, v in sorted(vars(args).items()):
        print0(f"  {k:24s} {v}")


with open("/proc/self/statm") as f:  # the interpreter, torch and the libraries: what no estimate counts
    _RSS_AT_START = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory_mb(device):
    """Peak memory of this run, in MiB: on CUDA the peak device memory the caching allocator reserved (what runs
    out); on CPU the peak resident memory of the process above what it held once torch was imported (comparable
    to peak_memory.estimate)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    with open("/proc/self/status") as f:  # VmHWM: ru_maxrss would start at the size of a parent that launched us
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))  # KiB
    return (hwm * 1024 - _RSS_AT_START) / 2**20


_NONFINITE = {}  # this rank's first NaN/inf loss since its last optimizer step: "row" = (step, value)
_NOT_TRAINED = "Lower the learning rate or check the data; the last checkpoint is intact and --resume restarts from it"


def check_finite(loss, step):
    """A NaN/inf loss is never trained on: the run stops with one line naming the step (and the ranks), the last
    checkpoint intact. One process stops here, before the backward; under torchrun a rank stopping alone would
    leave the others waiting in a collective, and go unheard (only rank 0 prints): it notes the loss and runs
    its backward, and optimizer_step stops every rank."""
    if not torch.isfinite(loss).all():
        if _DIST.world_size == 1:
            raise UserError(f"step {step}: the loss is {loss.item()}; not training on it. {_NOT_TRAINED}")
        _NONFINITE.setdefault("row", (step, loss.item()))


# ------------------------------------------------------------------------------------------------
# Optimization


def make_optimizer(model, lr, weight_decay=0.0, betas=(0.9, 0.95)):
    """AdamW; weight decay on matrices only (not on norms' gains). Fused (one kernel for every tensor) on
    CUDA; the plain loop on CPU."""
    reshard(model)  # an FSDP2 root left gathered by an evaluation would hand over its gathered parameters
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=_DIST.device.type == "cuda")


# Learning rates: the embedded world trains 1M-parameter models from scratch-like starts and wants large
# ones; a real checkpoint is wrecked by them. Without --lr a stage takes the one that fits the model:
LEARNING_RATES = {  # stage: (the embedded world's, a real model's, from the literature)
    "sft": (1e-3, 1e-5),     # Tulu 3 SFT: 5e-6 (8B), 2e-6 (70B); Qwen/Llama recipes 1e-5 to 2e-5
    "rm": (3e-3, 1e-5),      # InstructGPT's RM 9e-6; OpenRLHF's default 9e-6
    "dpo": (2e-5, 5e-7),     # Tulu 3 DPO 5e-7 (8B); Zephyr 5e-7
    "rl": (1e-4, 1e-6),      # DAPO and TRL's GRPO 1e-6
    "ppo": (1e-4, 1e-6),     # the actor; OpenRLHF 5e-7, Tulu 3 RLVR 3e-7
    "critic": (5e-4, 1e-5),  # PPO's critic; OpenRLHF 9e-6
}


def learning_rate(flag, stage, model, name="--lr"):
    """The learning rate a run uses: the flag as given, else the embedded world's default for its small
    models or the literature's for a real checkpoint (LEARNING_RATES), said out loud."""
    if flag is not None:
        return flag
    small, real = LEARNING_RATES[stage]
    # a model from outside the embedded world: a real vocabulary, or more than 50M parameters
    lr = real if model.config.vocab_size >= 32000 or model.num_params() >= 50_000_000 else small
    print0(f"{name} {lr:g}: the {'real-model' if lr == real else 'embedded-world'} default for {stage} "
           f"({model.config.vocab_size:,}-token vocabulary); pass {name} to choose")
    return lr


class Default(int):
    """An int flag's default, told apart from the same number typed on the command line (see fit_warmup)."""


def fit_warmup(warmup_steps: int, total_steps: int) -> int:
    """--warmup-steps that fits the run, so that its learning rate reaches --lr: a default (Default) longer than a
    tenth of the run is cut to that tenth; a value the user gave is kept unless it is longer than the run."""
    if warmup_steps <= (total_steps // 10 if isinstance(warmup_steps, Default) else total_steps):
        return int(warmup_steps)
    fitted = max(1, total_steps // 10)
    print0(f"--warmup-steps {warmup_steps} does not fit a run of {total_steps} steps (its lr would not reach --lr "
           f"in time): warming up for {fitted}")
    return fitted


def lr_at(step, total_steps, base_lr, warmup_steps=0, final_ratio=0.1):
    """The learning rate of step (0-based): linear warmup to base_lr over warmup_steps steps, then cosine decay
    toward final_ratio * base_lr, reached at step total_steps (one past the last; final_ratio 1: constant).
    Example: total 5, base 1, warmup 2, final 0.1 -> steps 0-4: 0.5, 1.0, 1.0, 0.775, 0.325 (step 5: 0.1)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + np.cos(np.pi * min(1.0, progress))))


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def progress(iterable, **kwargs):
    """A tqdm bar on rank 0; in a log file (no terminal) it updates every 30 s instead of flooding it."""
    return tqdm(iterable, disable=not _DIST.is_main, dynamic_ncols=True,
                mininterval=0.1 if sys.stderr.isatty() else 30, **kwargs)


def optimizer_step(model, optimizer, grad_clip):
    """Clip, step, zero (DDP and FSDP2 have already summed the gradients over ranks in backward); under
    torchrun first stop every rank if any rank's loss was not finite (check_finite). Returns the gradient norm
    before clipping (over all ranks' shards under FSDP2)."""
    if _DIST.world_size > 1:  # every rank stops together if any rank's loss was NaN/inf (check_finite)
        seen = torch.zeros(_DIST.world_size, 2, dtype=torch.float64, device=_DIST.device)
        seen[_DIST.rank] = torch.tensor(_NONFINITE.pop("row", (0, 0)), dtype=torch.float64)
        dist.all_reduce(seen)  # one row per rank, the others' 0 (nan + 0 is nan)
        if bad := [(r, step, value) for r, (step, value) in enumerate(seen.tolist()) if step > 0]:
            raise UserError(f"step {int(bad[0][1])}: the loss is {', '.join(f'{v} on rank {r}' for r, _, v in bad)} "
                            f"of {_DIST.world_size}; not training on it. {_NOT_TRAINED}")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor: the norm of the sharded gradients
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        raise UserError(f"the gradient norm is {norm.item()}; not stepping on it. Lower the learning rate; the last "
                        f"checkpoint is intact and --resume restarts from it")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()
