"""
Shared machinery for every stage: distributed setup from torchrun's environment, rank-0 printing,
seeding, device and dtype, run directories, JSONL metrics, and atomic checkpoints with resume.

DDP here is an equivalence, not a different program: each rank computes the SUM of its token losses
divided by the GLOBAL token count (all micro-batches, all ranks), and `sync_gradients` all-reduces
gradients with SUM. N ranks with batch B/N then produce exactly the gradient of one rank with batch B.
"""
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


def init_dist(device: str = "auto") -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE (a single process when absent): gloo on CPU, nccl on CUDA.
    On CPU each rank gets cores / local ranks threads: oversubscribed ranks run several times slower."""
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
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
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


def broadcast_parameters(model):
    """Every rank starts from rank 0's weights (per-rank seeds would otherwise initialize them apart)."""
    if dist.is_initialized():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)


def sync_gradients(model):
    """All-reduce (SUM) every gradient in one flat buffer. Losses are already divided by the global
    normalizer, so the sum is the full-batch gradient."""
    if not dist.is_initialized():
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def cleanup_dist():
    if dist.is_initialized():
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


def peak_memory_mb(device):
    """Peak resident memory of this process (CPU) or peak allocated device memory (CUDA), in MiB."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def check_finite(loss, step):
    """A NaN/inf loss is caught, never trained on."""
    if not torch.isfinite(loss).all():
        raise FloatingPointError(f"step {step}: loss is {loss.item()}; not training on it. Lower the learning "
                                 f"rate or check the data (the last checkpoint is intact; --resume restarts there)")


# ------------------------------------------------------------------------------------------------
# Checkpoints: Hugging Face folders plus nanopost's training state, written atomically

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(run_path, step, model, tokenizer=None, optimizer=None, state=None, keep=2):
    """Write run_path/checkpoints/step_XXXXXX/ : config.json, model.safetensors, tokenizer files
    (what transformers reads), plus optimizer.pt, trainer_state.json and rng_rank{r}.pt (what --resume
    reads). Everything goes to a .tmp folder that is renamed into place only when complete, so a
    process killed mid-save leaves the previous checkpoint intact. The `keep` newest are kept."""
    root = os.path.join(run_path, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if _DIST.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_hf(tmp, tokenizer)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, **(state or {})}, f, indent=2)
    barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{_DIST.rank}.pt"))
    barrier()
    if _DIST.is_main:
        for name in os.listdir(tmp):  # make the bytes durable before the rename publishes them
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in list_checkpoints(run_path)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


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
    """A model folder (has config.json) as is; a run directory -> its latest checkpoint."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither a model folder (config.json) nor a run directory with "
                                f"checkpoints; run the previous stage first or pass --init PATH")
    return ckpt


def rng_state():
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def load_training_state(ckpt, optimizer=None) -> dict:
    """Restore optimizer and this rank's RNG from a checkpoint; returns trainer_state.json.
    Call it AFTER any seeding, so the restored RNG is the one that continues."""
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location="cpu",
                                             weights_only=False))
    rng_file = os.path.join(ckpt, f"rng_rank{_DIST.rank}.pt")
    if not os.path.isfile(rng_file):
        raise FileNotFoundError(f"{rng_file} missing: resume with the same number of ranks as the saved run")
    s = torch.load(rng_file, weights_only=False)
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        return json.load(f)


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
    """AdamW; weight decay on matrices only (not on norms' gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=False)


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
    """Sum gradients over ranks, clip, step, zero. Returns the gradient norm before clipping."""
    sync_gradients(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if not torch.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm.item()}; not stepping on it. Lower the learning rate")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()
