"""
Model folders: Hugging Face folders in, Hugging Face folders out, and nanopost's training state beside them.

- `load_hf` / `save_hf`: a folder transformers and vLLM read (config.json in the Qwen3 or Llama form,
  model.safetensors or its shards, the tokenizer files), loaded tensor by tensor without two copies of the
  weights; under FSDP2 each rank reads only its own slice. A LoRA adapter folder (lora.py) loads as its base
  with the adapters merged, or, for training, with the adapters on top.
- `load_model`: what a stage trains, on this rank's device (whole, or sharded with --fsdp);
  `reference_model`: the frozen start its loss compares with.
- `save_checkpoint` / `load_training_state`: run_dir/checkpoints/step_XXXXXX/, the model folder plus the
  optimizer, the step and every rank's random state, written to a .tmp folder and renamed into place, so a
  crash mid-save leaves the previous checkpoint intact; `--resume` continues from the latest.
"""
import errno
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import distribute_tensor

from common import UserError, barrier, compute_dtype, dist_info, print0, reshard, shard_model, unwrap
from lora import (adapter_chain, add_lora, fuse_projections, lora_init_tensors, merged_updates, read_adapter,
                  save_adapter)
from model import GPT, GPTConfig, rope_inv_freq
from rundir import PINS, latest_checkpoint, list_checkpoints, live_dependents
from tokenizer import Tokenizer

# ------------------------------------------------------------------------------------------------
# config.json in the Hugging Face form

_HF_ARCH = {("qwen3", "lm"): "Qwen3ForCausalLM", ("qwen3", "scalar"): "Qwen3ForSequenceClassification",
            ("llama", "lm"): "LlamaForCausalLM", ("llama", "scalar"): "LlamaForSequenceClassification"}


def config_to_hf(c: GPTConfig, dtype, tokenizer=None) -> dict:
    hf = {
        "architectures": [_HF_ARCH[(c.arch, c.head)]],
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),  # what transformers 4.x (and vLLM with it) reads
        "dtype": str(dtype).removeprefix("torch."),        # what transformers 5 writes and reads
        "use_cache": True,
    }
    if c.arch == "llama":
        hf["mlp_bias"] = False
    if c.head == "scalar":
        hf["num_labels"] = 1
    if tokenizer is not None:
        hf["eos_token_id"] = tokenizer.eos_id
        hf["pad_token_id"] = tokenizer.pad_id
        hf["bos_token_id"] = tokenizer.generation_defaults.get("bos_token_id")  # the --init folder's, if it had one
    else:
        hf["eos_token_id"] = None
    return hf


def config_from_hf(hf: dict, where="config.json") -> GPTConfig:
    arch = hf.get("model_type")
    if arch not in ("qwen3", "llama"):
        raise UserError(f"{where}: model_type {arch!r} is not supported (supported: qwen3, llama)")
    archs = hf.get("architectures") or []
    head = "scalar" if any(a.endswith("ForSequenceClassification") for a in archs) else "lm"
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UserError(f"{where}: biases in attention/MLP are not supported")
    if hf.get("use_sliding_window"):
        raise UserError(f"{where}: sliding-window attention (use_sliding_window) is not supported")
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    n_head = hf["num_attention_heads"]
    stored = hf.get("dtype") or hf.get("torch_dtype")  # GPTConfig.dtype: a dtype as is; "auto" or none: None
    try:  # the model raises ValueError on a shape or a RoPE it cannot build: the user's folder is named
        config = GPTConfig(
            vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
            n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=hf["hidden_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
            intermediate_size=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta), rope_scaling=rope_scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            qk_norm=(arch == "qwen3"), tie_word_embeddings=hf.get("tie_word_embeddings", arch == "qwen3"),
            arch=arch, head=head, dtype=stored if stored in ("float32", "bfloat16", "float16") else None,
        )
        rope_inv_freq(config)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    return config


def load_config(path, head=None) -> GPTConfig:
    """The GPTConfig of a Hugging Face folder (its config.json; an adapter folder: its base's), without
    loading any weight."""
    path = adapter_chain(path)[0]
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"{path}: no config.json; expected a Hugging Face model folder (config.json + "
                        f"model.safetensors)")
    with open(cfg_path) as f:
        config = config_from_hf(json.load(f), path)
    if head is not None:
        config.head = head
    return config


# ------------------------------------------------------------------------------------------------
# Reading and writing model folders

def safetensors_files(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise UserError(f"{index} names shards that are not in the folder: {missing}")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        other = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                 if os.path.isfile(os.path.join(path, f))]
        hint = f"; found {other[0]}: re-save it with save_pretrained(safe_serialization=True)" if other else ""
        raise UserError(f"{path}: no model.safetensors (or model.safetensors.index.json){hint}")
    return [single]


def load_hf(path, dtype=None, device="cpu", head=None, shard=None, lora=None):
    """Load a Hugging Face folder (ours or a downloaded Qwen3 / Llama) tensor by tensor, without
    holding two copies of the weights. head="scalar" on an LM checkpoint starts a reward model or
    critic from it (the vocabulary head is dropped, the score head freshly initialized at 0).
    shard: a function that shards a model in place (common.shard_model, FSDP2). The model is then
    built on the meta device, sharded, allocated, and each rank copies only its own slice of each
    tensor from the memory-mapped files: no rank ever holds the whole model.
    `path` may be a LoRA adapter folder (PEFT's format; adapter_chain): its base is loaded and every
    adapter of the chain merged into each weight in float32, then cast to `dtype`.
    lora: LoRA training (a lora.LoRA as lora_options resolves it for `path`): the base frozen in `dtype`,
    adapters (float32) on top: fresh ones (seeded), or with resume=True the adapter of `path` itself,
    unmerged, to continue training it (the adapters below it in the chain are merged)."""
    base, chain = adapter_chain(path)
    own = None
    if lora and lora.resume:
        chain, own = chain[:-1], read_adapter(chain[-1])
    config = load_config(base, head)
    files = safetensors_files(base)
    with torch.device("meta"):
        model = GPT(config)
    if lora:
        if dtype is not None:
            model.to(dtype)  # the frozen base in the compute dtype; the adapters float32 (add_lora)
        add_lora(model, lora)
    if shard is not None:  # every parameter is a fresh object after these: build the optimizer later
        if dtype is not None and not lora:
            model.to(dtype)
        shard(model)
        model.to_empty(device=device)
    params = dict(model.named_parameters())  # a tied head appears once, as model.embed_tokens.weight
    expected = set(params) if shard is not None else set(model.state_dict().keys())
    deltas, replaced = merged_updates(chain, params)  # float32 updates of the adapters merged below

    def put(key, t):  # into the parameter, in its dtype (a LoRA model's or a sharded one's is set already)
        t = t.to(params[key].dtype if lora or shard is not None else dtype or t.dtype)
        if shard is not None:  # this rank's slice of the full tensor, without communication
            with torch.no_grad():
                params[key].copy_(distribute_tensor(t, params[key].device_mesh, params[key].placements,
                                                    src_data_rank=None))
        else:
            _set_tensor(model, key, t.to(device))

    loaded = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu" if shard is not None or deltas else str(device)) as f:
            for key in f.keys():
                if key not in expected:
                    if key in ("lm_head.weight", "score.weight"):
                        continue  # the other head (e.g. an RM started from an LM checkpoint)
                    raise UserError(f"{file}: unexpected tensor {key!r} for {config.arch}")
                t = replaced.get(key, f.get_tensor(key))
                if key in deltas:  # merge in float32, then cast: a bfloat16 sum would drop small updates
                    t = t.float() + deltas[key]
                put(key, t)
                loaded.add(key)
    for key in set(replaced) - loaded:  # a score head an adapter holds, on an LM checkpoint
        if key in expected:
            put(key, replaced[key])
            loaded.add(key)
    if lora:  # the adapters: the checkpoint's own, or fresh (the same on every rank)
        tensors = own[1] if own else lora_init_tensors(model, lora.seed)
        for key, t in tensors.items():
            if key not in expected:
                raise UserError(f"{path}: adapter tensor {key!r} has no layer in the model {base}")
            if tuple(t.shape) != tuple(params[key].shape):
                raise UserError(f"{path}: adapter tensor {key} is {tuple(t.shape)}, the model {base} needs "
                                f"{tuple(params[key].shape)}: the adapter was trained on another base")
            put(key, t)
            loaded.add(key)
    if config.head == "lm" and config.tie_word_embeddings:
        if shard is None:
            model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = expected - loaded
    if config.head == "scalar" and missing == {"score.weight"}:  # fresh score head: every reward 0
        put("score.weight", torch.zeros(1, config.n_embd, dtype=model.model.embed_tokens.weight.dtype))
        missing = set()
    if missing:
        raise UserError(f"{path}: checkpoint lacks tensors {sorted(missing)[:5]}...")
    model._init_rope(device)
    if lora and shard is None:  # the frozen base's q/k/v and gate/up in one tensor each, which the engine shares
        fuse_projections(model)
    return model if shard is not None else model.to(device)  # (.to would replace FSDP's sharded parameters)


def _set_tensor(model, key, tensor):
    mod_name, _, attr = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    trainable = getattr(mod, attr).requires_grad and tensor.is_floating_point()  # a frozen LoRA base stays frozen
    setattr(mod, attr, nn.Parameter(tensor, requires_grad=trainable))


def load_lm_head(path, device="cpu"):
    """The untied lm_head.weight of the LM checkpoint at `path`, read alone (float32)."""
    for file in safetensors_files(adapter_chain(path)[0]):  # adapters never touch the head
        with safe_open(file, framework="pt", device=str(device)) as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").float()
    raise ValueError(f"{path}: no lm_head.weight (a tied checkpoint's head is its embed_tokens.weight)")


def save_hf(model, path, tokenizer=None, dtype=None, max_shard_bytes=5 * 2**30):
    """Write a folder that transformers loads: config.json, the weights in `dtype` (default: the dtype of
    the folder the model came from, model.config.dtype, else its parameters'; model.safetensors, or files
    of at most max_shard_bytes with model.safetensors.index.json, as transformers shards them),
    generation_config.json and the tokenizer files. Not atomic by itself (save_checkpoint is).
    Under FSDP2 every rank must call it: each tensor is gathered on its own (full_tensor) and rank 0
    writes, so no rank ever holds more than one file's worth of full tensors."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    state = model.state_dict()
    if model.config.head == "lm" and model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # tied: transformers re-ties it from embed_tokens
    dtype = dtype or (getattr(torch, model.config.dtype) if model.config.dtype else None)  # the input's, by default
    out_dtype = dtype or next(model.parameters()).dtype
    files, current, size = [], [], 0  # consecutive tensors, a file at most max_shard_bytes
    for key, value in state.items():
        nbytes = value.numel() * (dtype or value.dtype).itemsize
        if current and size + nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    files.append(current)
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    if writer:
        os.makedirs(path, exist_ok=True)
    for name, keys in zip(names, files):
        tensors = {}
        for key in keys:
            value = state[key].detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value  # a DTensor shard
            if writer:
                tensors[key] = value.to(dtype or value.dtype).cpu().contiguous()
        if writer:
            save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    if not writer:
        return
    if len(files) > 1:
        total = sum(state[k].numel() * (dtype or state[k].dtype).itemsize for k in state)
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, ks in zip(names, files) for k in ks}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    hf = config_to_hf(model.config, out_dtype, tokenizer)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if model.config.head == "lm":  # the input's sampling settings, and generate() stopping where our engine stops
        gen = tokenizer.generation_config() if tokenizer else {"eos_token_id": None, "pad_token_id": None,
                                                               "bos_token_id": None}
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(path)


# ------------------------------------------------------------------------------------------------
# What a stage trains, and the start it is compared with

def load_model(path, dtype=torch.float32, head=None, fsdp=False, lora=None, save_dtype="auto",
               head_precision="float32"):
    """A model folder loaded for this rank, on its device: whole, or with fsdp=True under torchrun built
    sharded (FSDP2, shard_model), each rank reading only its own slice of each tensor. `path` may be a
    LoRA adapter folder (merged into its base in float32). lora (lora_options(args, path)): LoRA training, the base
    frozen in the compute dtype with float32 adapters on top (lora.add_lora). save_dtype (--save-dtype):
    the dtype its checkpoints ship in; "auto", the folder's own (bfloat16 for a Qwen3 download).
    head_precision (--head-precision): the LM head's matmul, in training and in the engine (model.head_logits)."""
    shard = shard_model if fsdp and dist_info().world_size > 1 else None
    if lora:
        dtype = compute_dtype(dist_info().device)
    model = load_hf(path, dtype=dtype, device=dist_info().device, head=head, shard=shard, lora=lora)
    if save_dtype != "auto":
        model.config.dtype = save_dtype
    model.head_precision = head_precision
    if lora:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print0(f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {','.join(lora.targets)}: "
               f"{trainable:,} trainable parameters of {model.num_params():,} ({trainable / model.num_params():.2%}); "
               f"the base frozen in {str(dtype).removeprefix('torch.')}")
    return model


def reference_model(model, init, fsdp=False, lora=None):
    """The frozen start a loss compares with: for a LoRA run (lora: its settings) the policy itself, to be called under
    lora.adapters_off (an --init adapter was merged into the base, so the base IS the start, and nothing is
    loaded twice); else `init` loaded again, frozen, in the compute dtype. A no-op adapters_off on it
    costs nothing, so a stage writes `with adapters_off(ref): ref(...)` for both. Its head runs in the
    policy's head precision: the two log-probs of a KL or a DPO margin are then the same function."""
    if lora:
        return unwrap(model)
    return load_model(init, dtype=compute_dtype(dist_info().device), fsdp=fsdp,
                      head_precision=unwrap(model).head_precision).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# Checkpoints: a model folder plus the training state, written atomically

def save_checkpoint(run_path, step, model, tokenizer=None, optimizer=None, state=None, keep=2, lora=None):
    """Write run_path/checkpoints/step_XXXXXX/ : a Hugging Face folder (config.json, the safetensors
    weights, tokenizer files: what transformers reads; a LoRA run's (lora: its settings, lora_options): its
    adapter folder in PEFT's format, what peft reads), plus nanopost's training state: the optimizer
    (optimizer.pt, or under FSDP2 the sharded optimizer/ folder of torch.distributed.checkpoint, which a
    run on another number of ranks can load), trainer_state.json and rng_rank{r}.pt. The weights ship in the
    input's dtype (model.config.dtype: bfloat16 for a Qwen3 download); when that is not the float32 the model
    trains in, a resumable checkpoint also keeps the float32 master weights, under a name no loader of
    *.safetensors picks up: master_weights.pt (or the "model" entry of the optimizer/ folder under FSDP2), so
    that --resume continues exactly. Everything goes to
    a .tmp folder renamed into place only when complete, so a process killed mid-save leaves the previous
    checkpoint intact; a full disk is a UserError naming the folder. The `keep` newest are kept, and any that
    another run's LoRA adapters are built on (pin_bases). Every rank calls it."""
    root = os.path.join(run_path, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    gpt, sharded = unwrap(model), reshard(model)
    try:
        if dist_info().is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        if sharded or dist_info().is_main:  # sharded weights are gathered tensor by tensor, with every rank
            # a LoRA run saves its adapter only (PEFT's format), which names the frozen base it applies to
            save_adapter(gpt, tmp, lora, tokenizer) if lora else save_hf(gpt, tmp, tokenizer)
        shipped = getattr(torch, gpt.config.dtype) if gpt.config.dtype else None
        master = optimizer is not None and not lora and shipped not in (
            None, next(gpt.parameters()).dtype)
        if optimizer is not None and sharded:
            dcp.save({"optimizer": get_optimizer_state_dict(gpt, optimizer),
                      **({"model": get_model_state_dict(gpt)} if master else {})},
                     checkpoint_id=os.path.join(tmp, "optimizer"))
        if dist_info().is_main:
            if optimizer is not None and not sharded:
                _save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
                if master:
                    _save(gpt.state_dict(), os.path.join(tmp, "master_weights.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"step": step, "world_size": dist_info().world_size, "master_weights": master,
                           **(state or {})}, f, indent=2)
        barrier()
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        _save(rng, os.path.join(tmp, f"rng_rank{dist_info().rank}.pt"))
        barrier()
        if dist_info().is_main:
            for folder, _, names in os.walk(tmp):  # make the bytes durable before the rename publishes them
                for name in names:
                    with open(os.path.join(folder, name), "rb") as f:
                        os.fsync(f.fileno())
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            if lora:  # the folders its adapter builds on must outlive their runs' rotation
                pin_bases(lora.base, run_path)
            for old in list_checkpoints(run_path)[:-keep]:
                if not live_dependents(old):  # a checkpoint another run's adapters are built on stays
                    shutil.rmtree(old, ignore_errors=True)
    except Exception as e:
        if _disk_full(e):
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"no room to write the checkpoint {final} ({e}); the previous checkpoint is intact: "
                            f"free disk space, then continue with --resume") from None
        raise
    barrier()
    return final


def pin_bases(path, run_path):
    """Pin every checkpoint a LoRA adapter of run_path builds on: its base `path` and, when that is itself an
    adapter, each folder down its chain (lora.adapter_chain). A run keeps only its newest checkpoints, so an
    adapter trained on another run's checkpoint would break the day that run goes on; a pinned checkpoint
    (pinned_by.json: the dependent run directories) is kept by rotation and refused by --overwrite for as long
    as a dependent run still holds checkpoints (rundir.live_dependents)."""
    base, chain = adapter_chain(path)
    for folder in (base, *chain):
        if os.path.basename(os.path.dirname(os.path.abspath(folder))) != "checkpoints":
            continue  # a model folder of its own (a download, merge.py's output): nothing rotates it
        pins_path = os.path.join(folder, PINS)
        runs = json.load(open(pins_path)) if os.path.isfile(pins_path) else []
        if os.path.abspath(run_path) not in runs:
            with open(pins_path + ".tmp", "w") as f:
                json.dump(runs + [os.path.abspath(run_path)], f, indent=2)
            os.replace(pins_path + ".tmp", pins_path)


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


def resolve_model_path(path: str, flag: str = "--init", head: str | None = None) -> str:
    """A model folder (config.json) or LoRA adapter folder (adapter_config.json) as is; a run directory ->
    its latest checkpoint. flag: what named it, for the error ("--critic-init", or "rm:" for --reward rm:PATH).
    head: what the caller needs, "lm" (a language model: the generative stages, the judge) or "scalar" (a reward
    model): a folder with the other head stops here, in one line, before anything is loaded."""
    named = f"{flag}{'' if flag.endswith(':') else ' '}{path}"
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise UserError(f"{named}: neither a model folder (config.json) nor a run directory with checkpoints; "
                            f"run the stage that makes it first, or pass {flag}{'' if flag.endswith(':') else ' '}PATH")
        print0(f"{path}: loading its latest checkpoint, {os.path.basename(ckpt)}")
        path = ckpt
    found = load_config(path).head
    if head == "lm" and found == "scalar":
        raise UserError(f"{named} is a reward model or critic (*ForSequenceClassification: one score per token), "
                        f"and this needs a language model (*ForCausalLM), e.g. the SFT run's")
    if head == "scalar" and found == "lm":
        raise UserError(f"{named} is a language model, not a reward model (*ForSequenceClassification); train one "
                        f"with chat_rm.py")
    return path


def load_tokenizer(path: str, flag: str = "--init") -> Tokenizer:
    """The tokenizer of a model folder, checked against the model: every id it can produce must have a row in
    the model's embedding (config.json's vocab_size), or the first step would index past it (a Llama folder
    holding another family's tokenizer files)."""
    tok = Tokenizer.load(path)
    vocab = load_config(path).vocab_size
    if tok.largest_id >= vocab:
        raise UserError(f"{flag}{'' if flag.endswith(':') else ' '}{path}: its tokenizer has ids up to "
                        f"{tok.largest_id:,} and its model {vocab:,} embedding rows (config.json vocab_size): the "
                        f"tokenizer files belong to another model; copy the model's own tokenizer files into the "
                        f"folder")
    return tok


def resume_checkpoint(run_path: str) -> str:
    """The checkpoint --resume continues from: the run's latest complete one (a folder still being
    written, step_*.tmp, is never picked up)."""
    ckpt = latest_checkpoint(run_path)
    if ckpt is None:
        raise UserError(f"--resume: no checkpoint in {run_path}; start the run without --resume")
    return ckpt


def load_training_state(ckpt, optimizer, model) -> dict:
    """Restore the optimizer, the float32 master weights of a checkpoint that shipped in a lower precision
    (into `model`, loaded from its shipped weights), and this rank's RNG; returns trainer_state.json.
    Call it AFTER any seeding, so the restored RNG is the one that continues. A sharded (FSDP2) model's
    optimizer comes from the checkpoint's optimizer/ folder, resharded to however many ranks run now. On
    another number of ranks the per-rank RNG streams cannot be restored: the run continues from the
    saved weights and optimizer with fresh per-rank seeds (its losses will differ from the original's)."""
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    sharded = reshard(model)
    if os.path.isdir(os.path.join(ckpt, "optimizer")):  # saved sharded: any layout now
        osd = get_optimizer_state_dict(unwrap(model), optimizer)
        msd = get_model_state_dict(unwrap(model)) if state.get("master_weights") else None
        dcp.load({"optimizer": osd, **({"model": msd} if msd is not None else {})},
                 checkpoint_id=os.path.join(ckpt, "optimizer"))
        set_optimizer_state_dict(unwrap(model), optimizer, osd)
        if msd is not None:
            set_model_state_dict(unwrap(model), msd)
    elif sharded:
        raise UserError(f"{ckpt} was saved without --fsdp (optimizer.pt); resume it without --fsdp")
    else:
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location="cpu",
                                             weights_only=False))
        if state.get("master_weights"):  # mmap: no second copy of the weights in memory
            unwrap(model).load_state_dict(torch.load(os.path.join(ckpt, "master_weights.pt"), map_location="cpu",
                                                     mmap=True, weights_only=True))
    if state.get("world_size", dist_info().world_size) != dist_info().world_size:
        print0(f"note: {ckpt} was saved by {state['world_size']} rank(s), this run has {dist_info().world_size}: "
               f"weights and optimizer resume, the random streams start afresh")
        return state
    s = torch.load(os.path.join(ckpt, f"rng_rank{dist_info().rank}.pt"), weights_only=False)
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    return state


def resume_state(ckpt, optimizer, model) -> dict:
    """The trainer state a run continues from: step 0 and no training seconds for a fresh run (ckpt None), else
    the checkpoint's, its optimizer and RNG restored (load_training_state)."""
    if not ckpt:
        return {"step": 0, "train_seconds": 0.0}
    state = load_training_state(ckpt, optimizer, model)
    print0(f"resumed from {ckpt} at step {state['step']}"
           + (f" ({state['train_seconds']:.0f} s of training)" if "train_seconds" in state else ""))
    return state
