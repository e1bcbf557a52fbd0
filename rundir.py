"""
A run's directory, $NANOPOST_HOME/<stage>/<run>, and what every training stage does with it: the flags of its
plumbing (add_run_flags), claiming it before any model is loaded (start_run: a directory that holds another
run is refused, --resume checks the flags against the run's), opening it once every input is checked
(open_run: only then does --overwrite replace the old run), its checkpoints (list_checkpoints; the ones
another run's LoRA adapters are built on are pinned), its metrics log (MetricsLogger, metrics.jsonl) and its
held-out figures (write_eval, eval.json).
"""
import importlib.util
import json
import os
import re
import shutil
import time

import numpy as np
import torch

from common import (UserError, barrier, check_flag_ranges, dist_info, init_dist, nanopost_home, print0, print_config,
                    seed_everything, train_dtype)


def add_run_flags(parser, stage: str):
    """The flags of a run's plumbing, the same in every training stage (a stage's own flags are its method's)."""
    parser.add_argument("--run-name", default="default", help=f"output goes to $NANOPOST_HOME/{stage}/<run>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="clear the run directory first, when it holds another "
                        "run (without it a fresh run refuses to mix with an old one's checkpoints)")
    parser.add_argument("--wandb", metavar="PROJECT", help="also log to this Weights & Biases project "
                        "(WANDB_MODE=offline: no network)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="recompute each block's activations in "
                        "backward")
    parser.add_argument("--head-precision", default="float32", choices=("float32", "tf32", "bf16"),  # HEAD_PRECISIONS
                        help="the LM head's matmul, in training and sampling alike (tf32: CUDA only; float32 on CPU)")
    parser.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state across "
                        "ranks (FSDP2)")
    parser.add_argument("--dist-timeout", type=float, default=30, help="minutes a rank may wait in a collective")
    parser.add_argument("--save-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the dtype checkpoints ship in (auto: the --init folder's; training stays float32)")
    if stage != "base":  # base_train trains its own tokenizer, with our template
        parser.add_argument("--chat-template", default="check", choices=("check", "ours", "theirs"),
                            help="the template checkpoints ship: check (the --init folder's, if it renders the data "
                            "as nanopost trains it; else stop), ours (nanopost's Qwen3 template), theirs (the "
                            "folder's)")


def start_run(args, stage: str, title: str):
    """What every training stage does first: this rank and its device (init_dist), per-rank seeds, the config
    printed, and the run directory $NANOPOST_HOME/<stage>/<run> claimed (check_run_dir): a run it may not use
    stops here, before any model is loaded. Nothing in the directory changes yet: the stage checks its inputs
    (model folder, tokenizer, data, flags), then calls open_run. Returns (DistInfo, the run directory)."""
    check_flag_ranges(args)
    if args.wandb and importlib.util.find_spec("wandb") is None:  # said now, not after the models are loaded
        raise UserError(f"--wandb {args.wandb}: the wandb package is not installed; pip install wandb (or drop "
                        f"--wandb: metrics.jsonl has the same numbers)")
    info = init_dist(args.device, args.dist_timeout)
    seed_everything(args.seed, info.rank)
    print_config(args, title)
    print0(f"training forwards compute in {str(train_dtype(info.device)).removeprefix('torch.')} "
           f"(float32 master weights{'; $NANOPOST_CPU_AUTOCAST chooses' if info.device.type == 'cpu' else ''})")
    out_dir = os.path.join(nanopost_home(), stage, args.run_name)
    check_run_dir(out_dir, args)
    return info, out_dir


def open_run(args, out_dir: str, stage: str):
    """Once the stage has checked every input: --overwrite replaces the old run now, never before (a run whose
    tokenizer turns out to be missing must not cost the old one), a fresh run's leftover metrics.jsonl and
    eval.json are removed (none of an old run's figures may pass for its own), and the metrics log opens (a
    fresh run starts a fresh log; --resume appends). Returns the MetricsLogger."""
    held = list_checkpoints(out_dir)
    barrier()  # every rank has read the directory before rank 0 changes it
    if args.overwrite and os.path.isdir(out_dir) and dist_info().is_main:
        shutil.rmtree(out_dir)
        print0(f"--overwrite: replaced {out_dir}" + (f" (it held checkpoints up to {os.path.basename(held[-1])})"
                                                   if held else ""))
    elif not args.resume and dist_info().is_main:
        for name in ("metrics.jsonl", "eval.json"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    barrier()
    os.makedirs(out_dir, exist_ok=True)
    return MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), wandb_project=args.wandb,
                         run_name=f"{stage}/{args.run_name}", config=vars(args))


_STEP_DIR = re.compile(r"^step_(\d+)$")


def list_checkpoints(run_path) -> list[str]:
    """The complete checkpoints of a run directory (a step_XXXXXX folder with its trainer_state.json; a folder
    still being written, step_*.tmp, is none), oldest first."""
    root = os.path.join(run_path, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := _STEP_DIR.match(d))]
    return [p for _, p in sorted(found) if os.path.isfile(os.path.join(p, "trainer_state.json"))]


def latest_checkpoint(run_path):
    ckpts = list_checkpoints(run_path)
    return ckpts[-1] if ckpts else None


PINS = "pinned_by.json"  # in a checkpoint: the run directories whose LoRA adapters name it as their base


def live_dependents(ckpt: str) -> list[str]:
    """The run directories pinned to a checkpoint (checkpoint.pin_bases) that still hold checkpoints: an adapter
    there needs this folder to load, so neither rotation nor --overwrite may delete it."""
    try:
        with open(os.path.join(ckpt, PINS)) as f:
            runs = json.load(f)
    except (FileNotFoundError, ValueError):
        return []
    return [r for r in runs if list_checkpoints(r)]


# --resume continues a run as it was started; a flag given another value on the command line is, by its kind:
RESUME_QUIET = {  # where and how the run executes, what it evaluates and logs: the trained numbers do not change
    "run_name", "device", "resume", "overwrite", "wandb", "dist_timeout", "fsdp", "grad_checkpointing", "compile",
    "save_dtype", "chat_template", "save_every", "eval_every", "sample_every", "eval_problems", "eval_data",
    "num_val", "pass_k", "eval_before_train", "log_kl_to_start", "micro_batch_tokens", "device_batch_size"}
RESUME_NOTED = {  # how long and how fast the run goes on (a lower --lr is how a diverged run is rescued): said
    "steps", "epochs", "time_budget", "lr", "critic_lr", "warmup_steps", "final_lr_ratio", "grad_clip"}
# Every other flag changes what is trained (the data, the model, the batch, the method): refused.


def check_resume_flags(args, run_path: str):
    """--resume with the flags of the run it continues (its latest checkpoint's trainer_state.json): a changed
    flag of RESUME_NOTED goes on with the new value and says so, one of RESUME_QUIET goes on silently, any
    other stops the run naming the old and new values."""
    ckpt = latest_checkpoint(run_path)
    if ckpt is None:
        return  # resume_checkpoint says so
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        stored = json.load(f).get("run_config", {})
    now = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()}
    changed = {k: (stored[k], v) for k, v in now.items() if k in stored and stored[k] != v and k not in RESUME_QUIET}
    refused = [f"--{k.replace('_', '-')} {new} (the run's: {old})" for k, (old, new) in changed.items()
               if k not in RESUME_NOTED]
    if refused:
        raise UserError(f"--resume continues the run in {run_path} as it was started, and "
                        f"{', '.join(refused)} would change what it trains; pass the run's values, or start a new "
                        f"run with --run-name NAME (or --overwrite)")
    for k, (old, new) in changed.items():
        print0(f"--resume: --{k.replace('_', '-')} {new} (the run's: {old}); the run goes on with the new value")


def check_run_dir(path: str, args):
    """A run directory belongs to one run. A fresh run (no --resume) refuses a directory that holds another
    run's checkpoints, which a later --init or --resume would mistake for its own; --overwrite will replace it
    (open_run), unless one of the run's inputs lies inside it or another run's LoRA adapters are built on one
    of its checkpoints. --resume checks the flags against the run's (check_resume_flags)."""
    held = list_checkpoints(path)
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in its directory and --overwrite clears it: pass one of them")
    if held and not args.resume and not args.overwrite:
        raise UserError(f"{path} holds another run's checkpoints (up to {os.path.basename(held[-1])}): continue it "
                        f"with --resume, start a new one with --run-name NAME, or replace it with --overwrite")
    if args.resume:
        check_resume_flags(args, path)
    if args.overwrite and os.path.isdir(path):
        inputs = [getattr(args, k, None) for k in ("init", "critic_init", "teacher", "data", "eval_data")]
        inputs += re.findall(r"(?:rm|judge):([^+]+)", getattr(args, "reward", None) or "")
        inside = [p for p in inputs if p and (os.path.realpath(p) + os.sep).startswith(os.path.realpath(path) + os.sep)]
        if inside:
            raise UserError(f"--overwrite would delete {inside[0]}, an input of this run, with {path}; "
                            f"copy it elsewhere or pick another --run-name")
        for ckpt in held:
            others = [r for r in live_dependents(ckpt) if os.path.realpath(r) != os.path.realpath(path)]
            if others:
                raise UserError(f"--overwrite would delete {ckpt}, the base of the LoRA adapters of {others[0]} "
                                f"({PINS}); merge them into a model folder first (merge.py), or pick another "
                                f"--run-name")


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
        self.enabled = dist_info().is_main
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
    """A stage's held-out metrics, which --report gathers: eval.json, written by rank 0, atomically, headed by
    the run (relative to $NANOPOST_HOME) and the step of its latest checkpoint, the model they measure."""
    if not dist_info().is_main:
        return
    path = os.path.join(run_path, "eval.json")
    latest = latest_checkpoint(run_path)
    head = {"run": os.path.relpath(run_path, nanopost_home()),
            "step": int(_STEP_DIR.match(os.path.basename(latest)).group(1)) if latest else None}
    with open(path + ".tmp", "w") as f:
        json.dump({**head, **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}}, f, indent=2)
    os.replace(path + ".tmp", path)
