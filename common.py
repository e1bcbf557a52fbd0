"""
Shared machinery for every stage: distributed setup from torchrun's environment, DDP and FSDP2 wrapping,
rank-0 printing, seeding, device and dtype, run directories, JSONL metrics, packing and token-budget
micro-batches, and atomic checkpoints with resume.

Distributed training is an equivalence, not a different program: each rank computes the SUM of its token
losses divided by the GLOBAL token count (all micro-batches, all ranks), and the wrappers SUM gradients
across ranks (wrap_model). N ranks with batch B/N then produce exactly the gradient of one rank with
batch B, with torch's DistributedDataParallel or with FSDP2 (--fsdp).
"""
import contextlib
import datetime
import errno
import gc
import json
import os
import random
import re
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

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


# ------------------------------------------------------------------------------------------------
# Processes, devices, seeds

@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self):
        return self.rank == 0


_DIST = DistInfo()


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
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world > 1:
        if dev.type == "cpu":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(minutes=timeout_minutes))
    _DIST = DistInfo(rank, local_rank, world, dev)
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
    (default: sorted names; a name a rank does not have counts 0 there)."""
    keys = list(keys) if keys is not None else sorted(values)
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
# Distributed training: torch's DistributedDataParallel, or FSDP2 (--fsdp)

def _sum_allreduce_hook(state, bucket):
    """DDP averages gradients by default; the losses here are already divided by the global normalizer,
    so the buckets are summed instead."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def shard_model(model):
    """FSDP2 in place (torch.distributed.fsdp.fully_shard): each decoder block, then the root, so that
    parameters, gradients and AdamW state are split across ranks and a block's weights are gathered only
    for its own forward and backward. On CUDA the forward computes in bf16 from float32 master shards and
    gradients are reduced in float32. Gradients are SUMMED (the loss is already divided by the global
    normalizer): set_gradient_divide_factor(1.0) on every FSDP module (the call is not recursive) and, on
    gloo, set_force_sum_reduction_for_comms(True). Returns the model (its class becomes FSDP<class>)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    if isinstance(model, FSDPModule):
        return model
    dev = _DIST.device
    low = compute_dtype(dev)
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
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[_DIST.device.index] if _DIST.device.type == "cuda" else None,
              forward_sync_buffers=False, gradient_as_bucket_view=True)  # rank 0's weights broadcast here
    ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


def load_model(path, dtype=torch.float32, head=None, fsdp=False, lora=None):
    """A model folder loaded for this rank, on its device: whole, or with fsdp=True under torchrun built
    sharded (FSDP2, shard_model), each rank reading only its own slice of each tensor. `path` may be a
    LoRA adapter folder (merged into its base in float32). lora (lora_options): LoRA training, the base
    frozen in the compute dtype with float32 adapters on top (model.add_lora)."""
    from model import GPT
    shard = shard_model if fsdp and _DIST.world_size > 1 else None
    if lora:
        dtype = compute_dtype(_DIST.device)
    model = GPT.from_hf(path, dtype=dtype, device=_DIST.device, head=head, shard=shard, lora=lora)
    if lora:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print0(f"LoRA rank {model.lora['r']} (alpha {model.lora['alpha']:g}) on {','.join(model.lora['targets'])}: "
               f"{trainable:,} trainable parameters of {model.num_params():,} ({trainable / model.num_params():.2%}); "
               f"the base frozen in {str(dtype).removeprefix('torch.')}")
    return model


# ------------------------------------------------------------------------------------------------
# LoRA: the same flags in every stage

def add_lora_flags(parser):
    """--lora-rank and its companions (see model.LoRALinear and the README's LoRA section)."""
    from model import LORA_TARGETS
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base "
                        "(0: full fine-tuning); RL wants ~10x the full fine-tuning --lr")
    parser.add_argument("--lora-alpha", type=float, default=None, help="the update is scaled by alpha / rank (default: 2 x rank)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    parser.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                        help="comma-separated linear layers to adapt (default: every one in attention and MLP)")


def lora_options(args, resume=False):
    """The LoRA options of a run (None without --lora-rank): resume=True continues the adapter of the
    checkpoint being loaded instead of starting fresh ones."""
    if not getattr(args, "lora_rank", 0):
        return None
    return {"r": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "seed": args.seed,
            "targets": [t.strip() for t in args.lora_targets.split(",") if t.strip()], "resume": resume}


class AdaptersOff:
    """A LoRA model with its adapters switched off, callable like a model: the reference policy for free
    (DPO's reference log-probs, GRPO's KL term, PPO's reference). It runs the very weights of the policy,
    so nothing is loaded or kept twice. Call it under no_grad (the reference never trains)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        from model import adapters_off
        gpt = unwrap(self.model)  # no DDP hooks: nothing to reduce (FSDP2's model is its own module)
        with adapters_off(gpt):
            return gpt(*args, **kwargs)

    def parameters(self):
        return self.model.parameters()

    def eval(self):
        return self

    def train(self, mode=True):
        return self


def reference_model(model, init, fsdp=False):
    """The frozen start a loss compares with: for a LoRA run the policy with its adapters off (AdaptersOff;
    an --init adapter was merged into the base, so that IS the start), else `init` loaded again, frozen, in
    the compute dtype."""
    from model import lora_layers
    if lora_layers(unwrap(model)):
        return AdaptersOff(model)
    return load_model(init, dtype=compute_dtype(_DIST.device), fsdp=fsdp).eval().requires_grad_(False)


def unwrap(model):
    """The GPT inside a DDP wrapper (an FSDP2 model is its own module, with sharded parameters)."""
    return getattr(model, "module", model)


def reshard(model) -> bool:
    """Put an FSDP2 model's parameters back in their sharded form (the root keeps its own gathered after a
    forward with no backward, e.g. an evaluation; the optimizer and checkpoints know the shards); returns
    whether the model is sharded at all."""
    from torch.distributed.fsdp import FSDPModule
    modules = [m for m in unwrap(model).modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.reshard()
    return bool(modules)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(unwrap(model), FSDPModule)


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


def cleanup_dist():
    """Tear the process group down. A DistributedDataParallel wrapper still alive then (its hooks make
    reference cycles that only the collector frees) aborts the process one time in ~15 on gloo with
    "terminate called without an active exception" (torch 2.13): collect it first. run_main calls this
    after main() has returned, when its models are garbage."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()  # no rank tears the process group down while another still talks to it
        dist.destroy_process_group()


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


def autocast(device, dtype=None):
    """Autocast to `dtype` (default: compute_dtype(device)) around a training forward of float32 master
    weights; a no-op when that dtype is float32."""
    dev = torch.device(device)
    dtype = dtype or compute_dtype(dev)
    if dtype == torch.float32:
        return torch.autocast(dev.type, enabled=False)
    return torch.autocast(dev.type, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# Runs, configs, metrics

def nanopost_home() -> str:
    return os.environ.get("NANOPOST_HOME") or os.path.join(REPO, "out")


def run_dir(stage: str, run: str) -> str:
    path = os.path.join(nanopost_home(), stage, run)
    os.makedirs(path, exist_ok=True)
    return path


def print_config(args, title: str):
    print0(f"== {title} ==")
    for k, v in sorted(vars(args).items()):
        print0(f"  {k:24s} {v}")


class MetricsLogger:
    """Appends one JSON object per line to run_dir/metrics.jsonl (rank 0 only): {"step", "time", metrics...}.

    With wandb_project, every row also goes to Weights & Biases (the same metric names, `step` as wandb's
    step; `time` is left out, wandb records its own). wandb is optional (`pip install wandb`). Offline
    mode is wandb's own switch: WANDB_MODE=offline writes the run under run_dir/wandb/ without an account
    or a network, and `wandb sync run_dir/wandb/offline-run-*` uploads it later. A resumed run starts a
    new wandb run, whose steps go on from the checkpoint's. close() finishes the wandb run."""

    def __init__(self, path: str, wandb_project: str | None = None, run_name: str | None = None,
                 config: dict | None = None):
        self.path = path
        self.enabled = _DIST.is_main
        self.wandb_run = None
        if self.enabled and wandb_project:
            try:
                import wandb
            except ImportError:
                raise UserError(f"--wandb {wandb_project}: the wandb package is not installed; pip install wandb "
                                f"(or drop --wandb: metrics.jsonl has the same numbers)") from None
            self.wandb_run = wandb.init(project=wandb_project, name=run_name, config=config,
                                        dir=os.path.dirname(os.path.abspath(path)))

    def log(self, step: int, **metrics):
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: (float(v) if isinstance(v, (torch.Tensor, np.floating)) else v) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k not in ("step", "time")}, step=step)

    def close(self):
        """Finish the wandb run (the JSONL file needs nothing: every row is written when logged)."""
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def write_eval(run_path: str, metrics: dict):
    """A stage's held-out metrics, which --report gathers."""
    with open(os.path.join(run_path, "eval.json"), "w") as f:
        json.dump({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}, f, indent=2)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_RSS_AT_START = _rss_bytes()  # the interpreter, torch and the libraries: what no estimate counts


def peak_memory_mb(device):
    """Peak memory of this run, in MiB: on CUDA the peak allocated device memory; on CPU the peak resident
    memory of the process above what it held once torch was imported (comparable to memory.estimate)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - _RSS_AT_START) / 2**20  # Linux: KiB


def check_finite(loss, step):
    """A NaN/inf loss is caught before its backward, never trained on: the run stops with one line naming
    the step, and the last checkpoint, written before it, is intact."""
    if not torch.isfinite(loss).all():
        raise UserError(f"step {step}: the loss is {loss.item()}; not training on it. Lower the learning rate or "
                        f"check the data; the last checkpoint is intact and --resume restarts from it")


# ------------------------------------------------------------------------------------------------
# Checkpoints: Hugging Face folders plus nanopost's training state, written atomically

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(run_path, step, model, tokenizer=None, optimizer=None, state=None, keep=2):
    """Write run_path/checkpoints/step_XXXXXX/ : a Hugging Face folder (config.json, the safetensors
    weights, tokenizer files: what transformers reads; a LoRA run's: its adapter folder in PEFT's format,
    what peft reads), plus nanopost's training state: the optimizer
    (optimizer.pt, or under FSDP2 the sharded optimizer/ folder of torch.distributed.checkpoint, which a
    run on another number of ranks can load), trainer_state.json and rng_rank{r}.pt. Everything goes to
    a .tmp folder renamed into place only when complete, so a process killed mid-save leaves the previous
    checkpoint intact; a full disk is a UserError naming the folder. The `keep` newest are kept. Every
    rank calls it."""
    root = os.path.join(run_path, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    gpt, sharded = unwrap(model), reshard(model)
    try:
        if _DIST.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        if sharded or _DIST.is_main:  # sharded weights are gathered tensor by tensor, with every rank
            # a LoRA run saves its adapter only (PEFT's format), which names the frozen base it applies to
            (gpt.save_adapter if getattr(gpt, "lora", None) else gpt.save_hf)(tmp, tokenizer)
        if optimizer is not None and sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
            dcp.save({"optimizer": get_optimizer_state_dict(gpt, optimizer)},
                     checkpoint_id=os.path.join(tmp, "optimizer"))
        if _DIST.is_main:
            if optimizer is not None and not sharded:
                _save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"step": step, "world_size": _DIST.world_size, **(state or {})}, f, indent=2)
        barrier()
        _save(rng_state(), os.path.join(tmp, f"rng_rank{_DIST.rank}.pt"))
        barrier()
        if _DIST.is_main:
            for folder, _, names in os.walk(tmp):  # make the bytes durable before the rename publishes them
                for name in names:
                    with open(os.path.join(folder, name), "rb") as f:
                        os.fsync(f.fileno())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            for old in list_checkpoints(run_path)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except Exception as e:
        if _disk_full(e):
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"no room to write the checkpoint {final} ({e}); the previous checkpoint is intact: "
                            f"free disk space, then continue with --resume") from None
        raise
    barrier()
    return final


def _disk_full(e) -> bool:
    """Whether a failed checkpoint write means a full disk (or quota, or file-size limit): an OSError, or the
    same error as torch.save wraps it (its __context__) or as safetensors reports it (in its message)."""
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if any(isinstance(err, OSError) and err.errno in codes for err in (e, e.__context__)):
        return True
    return any(f"(os error {code})" in str(e) for code in codes)


def _save(obj, path):
    """torch.save through a Python file, so that a full disk surfaces as an OSError."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def list_checkpoints(run_path) -> list[str]:
    root = os.path.join(run_path, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := _STEP_DIR.match(d))]
    return [p for _, p in sorted(found) if os.path.isfile(os.path.join(p, "trainer_state.json"))]


def latest_checkpoint(run_path):
    ckpts = list_checkpoints(run_path)
    return ckpts[-1] if ckpts else None


def resolve_model_path(path: str) -> str:
    """A model folder (config.json) or LoRA adapter folder (adapter_config.json) as is; a run directory ->
    its latest checkpoint."""
    if any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise UserError(f"{path}: neither a model folder (config.json) nor a run directory with checkpoints; "
                        f"run the previous stage first or pass --init PATH")
    return ckpt


def resume_checkpoint(run_path: str) -> str:
    """The checkpoint --resume continues from: the run's latest complete one (a folder still being
    written, step_*.tmp, is never picked up)."""
    ckpt = latest_checkpoint(run_path)
    if ckpt is None:
        raise UserError(f"--resume: no checkpoint in {run_path}; start the run without --resume")
    return ckpt


def rng_state():
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def load_training_state(ckpt, optimizer=None, model=None) -> dict:
    """Restore the optimizer and this rank's RNG from a checkpoint; returns trainer_state.json.
    Call it AFTER any seeding, so the restored RNG is the one that continues. A sharded (FSDP2) model's
    optimizer comes from the checkpoint's optimizer/ folder, resharded to however many ranks run now. On
    another number of ranks the per-rank RNG streams cannot be restored: the run continues from the
    saved weights and optimizer with fresh per-rank seeds (its losses will differ from the original's)."""
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    sharded = model is not None and reshard(model)
    if optimizer is not None and os.path.isdir(os.path.join(ckpt, "optimizer")):  # saved sharded: any layout now
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        if model is None:
            raise ValueError("load_training_state needs the model to restore a sharded optimizer")
        osd = get_optimizer_state_dict(unwrap(model), optimizer)
        dcp.load({"optimizer": osd}, checkpoint_id=os.path.join(ckpt, "optimizer"))
        set_optimizer_state_dict(unwrap(model), optimizer, osd)
    elif optimizer is not None:
        if sharded:
            raise UserError(f"{ckpt} was saved without --fsdp (optimizer.pt); resume it without --fsdp")
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location="cpu",
                                             weights_only=False))
    if state.get("world_size", _DIST.world_size) != _DIST.world_size:
        print0(f"note: {ckpt} was saved by {state['world_size']} rank(s), this run has {_DIST.world_size}: "
               f"weights and optimizer resume, the random streams start afresh")
        return state
    s = torch.load(os.path.join(ckpt, f"rng_rank{_DIST.rank}.pt"), weights_only=False)
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    return state


# ------------------------------------------------------------------------------------------------
# Packing: examples are (inputs, targets) pairs built per document, so a label never crosses documents

IGNORE = -100  # the target of a position that is not trained


def pack_bfd(lengths, capacity):
    """Best-fit decreasing: longest first, each into the open row with the least room that still fits
    it (a new row when none does). Returns rows as lists of example indices. O(n * capacity)."""
    rows, by_room = [], defaultdict(list)  # room left -> rows with exactly that much room
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"example {i} has {n} tokens, more than the row capacity {capacity}")
        room = next((r for r in range(n, capacity + 1) if by_room[r]), None)
        if room is None:
            rows.append([i])
            r, left = len(rows) - 1, capacity - n
        else:
            r = by_room[room].pop()
            rows[r].append(i)
            left = room - n
        by_room[left].append(r)
    return rows


def pack_sequences(seqs, pad_id, layout="right", capacity=None, targets=None):
    """Lay whole sequences out in rows for one forward: (ids, doc_ids, targets, ends), ends being the
    (rows, columns) of each sequence's last token. targets (per sequence, or None for none) are laid out
    alongside, IGNORE elsewhere. Layouts, all giving each sequence the same outputs:
      right   one sequence per row, padded after it: no mask needed (causal attention never looks right)
      left    one per row, padded before it: the padding is a document of its own, so nothing attends to it
      packed  best-fit packed into rows of `capacity` tokens, each sequence its own document (positions
              restart, attention never crosses): no padding compute, the training default."""
    if layout == "packed":
        rows = pack_bfd([len(s) for s in seqs], capacity or max(len(s) for s in seqs))
    elif layout in ("right", "left"):
        rows = [[i] for i in range(len(seqs))]
    else:
        raise ValueError(f"layout must be 'right', 'left' or 'packed', got {layout!r}")
    T = max(sum(len(seqs[i]) for i in row) for row in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    docs = torch.zeros((len(rows), T), dtype=torch.long)
    tgt = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    where = [None] * len(seqs)  # (row, column) of each sequence's last token
    for r, row in enumerate(rows):
        col = T - len(seqs[row[0]]) if layout == "left" else 0
        docs[r, :col] = -1  # left padding: a document before the sequence
        for d, i in enumerate(row):
            n = len(seqs[i])
            ids[r, col:col + n] = torch.tensor(seqs[i])
            if targets is not None and targets[i] is not None:
                tgt[r, col:col + n] = torch.tensor(targets[i])
            docs[r, col:col + n] = d
            col += n
            where[i] = (r, col - 1)
        docs[r, col:] = len(row)  # right padding: a document after them
    return ids, docs, tgt, tuple(torch.tensor(where).T)


def collate(examples, row, pad_id, length=None):
    """One row of packed examples -> inputs, targets, doc_ids (padding is a document of its own)."""
    inputs, targets, docs = [], [], []
    for d, i in enumerate(row):
        x, y = examples[i]
        inputs += x
        targets += y
        docs += [d] * len(x)
    pad = (length or len(inputs)) - len(inputs)
    return inputs + [pad_id] * pad, targets + [IGNORE] * pad, docs + [len(row)] * pad


def make_batch(examples, rows, pad_id, seq_len, packing, device):
    """Tensors for a list of rows. Packed rows are seq_len long with document ids; padded rows are
    as long as the longest in the batch, right-padded, no document ids needed (causal attention never
    looks right)."""
    length = seq_len if packing == "bfd" else max(sum(len(examples[i][0]) for i in row) for row in rows)
    cols = [collate(examples, row, pad_id, length) for row in rows]
    x, y, d = (torch.tensor([c[k] for c in cols], device=device) for k in range(3))
    return x, y, (d if packing == "bfd" else None)


def micro_batches(lengths, max_tokens: int, packed=False) -> list[list[int]]:
    """Sequences grouped into forward passes of at most max_tokens tokens each, so that long sequences
    cannot blow up a fixed row count. Padded (packed=False): a pass is as long as its longest sequence, so
    it costs count x longest; sequences are sorted by length first (little padding). Packed: a pass costs
    the sum of its lengths; the order is kept. A sequence longer than max_tokens is a pass of its own.
    Every rank must run as many passes as the others (a collective per pass under DDP/FSDP): the count is
    agreed over ranks with an all-reduce, and a rank with fewer pads its list with empty passes ([]).
    Example: lengths [5, 30, 8, 31], max_tokens 64 -> [[0, 2], [1, 3]] (2 x 8 and 2 x 31 tokens);
    packed -> [[0, 1, 2], [3]] (43 and 31 tokens)."""
    order = range(len(lengths)) if packed else sorted(range(len(lengths)), key=lambda i: int(lengths[i]))
    passes, current, cost = [], [], 0
    for i in order:
        n = int(lengths[i])
        new_cost = cost + n if packed else (len(current) + 1) * n
        if current and new_cost > max_tokens:
            passes.append(current)
            current, new_cost = [], n
        current.append(i)
        cost = new_cost
    if current:
        passes.append(current)
    n = int(all_reduce_max(len(passes)))
    return passes + [[] for _ in range(n - len(passes))]



@torch.no_grad()
def heldout_loss(model, examples, rows, pad_id, seq_len, packing, device, batch_size=16):
    """Mean next-token loss over the trained tokens of held-out rows (make_batch's rows of examples).
    Each rank computes its share
    (rows[rank::world]) in as many passes as the others (an FSDP2 forward is a collective), then the sums
    are added up."""
    info = _DIST
    mine = rows[info.rank::info.world_size]
    n_passes = int(all_reduce_max(-(-len(mine) // batch_size)))
    model.eval()
    total, count = 0.0, 0
    for i in range(0, n_passes * batch_size, batch_size):
        if i >= len(mine):
            idle_pass(model, backward=False)
            continue
        x, y, d = make_batch(examples, mine[i:i + batch_size], pad_id, seq_len, packing, device)
        with autocast(device):
            total -= model(x, y, doc_ids=d).sum().item()
        count += (y != IGNORE).sum().item()
    model.train()
    sums = all_reduce_dict({"total": total, "count": count}, keys=["total", "count"])
    return sums["total"] / max(1, sums["count"])



# ------------------------------------------------------------------------------------------------
# Optimization

def epoch_batch(num_rows, step, batch_size, seed):
    """Indices of the global batch at `step`: a fresh permutation every epoch, a pure function of
    (seed, step), so that a resumed run reads exactly the rows an uninterrupted one would, epoch
    boundaries included."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_rows)
        perm = np.random.RandomState(seed + epoch).permutation(num_rows)
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return out


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


def is_real_model(config) -> bool:
    """A model from outside the embedded world: a real vocabulary, or more than 50M parameters."""
    from memory import Shape
    return config.vocab_size >= 32000 or Shape.of(config).params() >= 50_000_000


def learning_rate(flag, stage, config, name="--lr"):
    """The learning rate a run uses: the flag as given, else the embedded world's default for its small
    models or the literature's for a real checkpoint (LEARNING_RATES), said out loud."""
    if flag is not None:
        return flag
    small, real = LEARNING_RATES[stage]
    lr = real if is_real_model(config) else small
    print0(f"{name} {lr:g}: the {'real-model' if lr == real else 'embedded-world'} default for {stage} "
           f"({config.vocab_size:,}-token vocabulary); pass {name} to choose")
    return lr


def lr_at(step, total_steps, base_lr, warmup_steps=0, final_ratio=0.1):
    """Linear warmup, then cosine decay to final_ratio * base_lr at the last step."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + np.cos(np.pi * min(1.0, progress))))


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def progress(iterable, **kwargs):
    """A tqdm bar on rank 0; in a log file (no terminal) it updates every 30 s instead of flooding it."""
    from tqdm import tqdm
    return tqdm(iterable, disable=not _DIST.is_main, dynamic_ncols=True,
                mininterval=0.1 if sys.stderr.isatty() else 30, **kwargs)


def optimizer_step(model, optimizer, grad_clip):
    """Clip, step, zero (DDP and FSDP2 have already summed the gradients over ranks in backward).
    Returns the gradient norm before clipping (over all ranks' shards under FSDP2)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor: the norm of the sharded gradients
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        raise UserError(f"the gradient norm is {norm.item()}; not stepping on it. Lower the learning rate; the last "
                        f"checkpoint is intact and --resume restarts from it")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()
