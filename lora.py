"""
LoRA: a frozen base and trainable low-rank adapters (Hu et al. 2021, https://arxiv.org/abs/2106.09685), in
every stage with the same flags (--lora-rank, --lora-alpha, --lora-dropout, --lora-targets), and adapter
folders in PEFT's format, which peft and vLLM (--enable-lora) load and which we load from them.

- `lora_options(args, path)`: a run's settings (LoRA), resolved against the folder it loads; the stage holds them
  and passes them to each reader: the loader, the reference, the checkpoint (`save_adapter`).
- `add_lora(model, lora)` freezes a GPT and wraps each targeted linear layer of its blocks in a `LoRALinear`.
- `adapters_off(model)`: the base model for a block's duration. A LoRA run's reference policy (DPO, the
  GRPO KL term, PPO) is the policy with its adapters off, so no second model is ever loaded.
- `save_adapter` / `read_adapter`: PEFT folders (adapter_config.json + adapter_model.safetensors); an
  adapter names the folder of its base, which may itself be an adapter (`adapter_chain`); `merged_updates`
  is what merging a chain adds to each base weight.
A reader who trains full models never needs this file.
"""
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from common import UserError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRA:
    """A LoRA run's settings, each under one name from its flag (--lora-rank: rank) to every reader: the
    loader (checkpoint.load_hf), add_lora, the reference (checkpoint.reference_model), the adapter folder
    (save_adapter; PEFT names rank "r" in adapter_config.json, the only other name it has). lora_options makes
    them from the flags and resolves them against the folder the run loads; the stage passes them on, explicitly.
    The engine reads no settings: it copies the LoRALinear layers it finds, each with its rank and alpha."""
    rank: int
    alpha: float | None = None   # the update's scale is alpha / rank; None (the flag's default): 2 * rank
    targets: tuple = LORA_TARGETS
    dropout: float = 0.0         # on the adapters' input, in training only
    seed: int = 0                # draws fresh adapters' A
    resume: bool = False         # continue the adapter of the folder being loaded, not fresh ones
    base: str | None = None      # the folder the adapters apply to (lora_options resolves it)


class LoRALinear(nn.Module):
    """A frozen linear layer W (out, in) plus a trainable low-rank update:

        y = W x + (alpha / r) * B(A(dropout(x)))        A: (r, in), B: (out, r), both float32

    A starts as PEFT's (kaiming_uniform_, a = sqrt(5): uniform in +-1/sqrt(in)) and B at zero, so at step 0
    the layer IS the base layer. The names (weight, lora_A.weight, lora_B.weight) are PEFT's, so an adapter
    file's keys map onto these one to one. `enabled = False` switches the update off (adapters_off).
    Example: W = 0, in = 2, out = 2, r = 1, alpha = 2, A = [[1, 1]], B = [[0.5], [0]], x = [1, 3]:
    A x = 4, B A x = [2, 0], y = (2 / 1) * [2, 0] = [4, 0]; the merged weight W + (alpha/r) B A = [[1, 1], [0, 0]]
    gives the same y."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        # on the base's device: the meta device when a model folder loads (lora_init_tensors fills them in);
        # elsewhere nn.Linear's own init, kaiming_uniform_(a = sqrt(5)), is PEFT's init of A, and B starts at 0
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=base.weight.device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=base.weight.device, dtype=torch.float32)
        nn.init.zeros_(self.lora_B.weight)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x):
        y = F.linear(x, self.weight)
        if not self.enabled:
            return y
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def delta(self):
        """The update as a full matrix, (alpha / r) * B @ A in float32: what merging adds to W."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())


def lora_init_tensors(model, seed=0) -> dict:
    """Fresh adapter tensors for every LoRALinear of `model` ({name: float32 CPU tensor}, drawn in module
    order from one generator seeded by `seed`): the same on every rank, whatever the model's device."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            a = torch.empty(m.lora_A.weight.shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
            out[f"{name}.lora_A.weight"] = a
            out[f"{name}.lora_B.weight"] = torch.zeros(m.lora_B.weight.shape)
    return out


def add_lora(model, lora: LoRA):
    """Freeze every parameter of `model` and wrap each targeted linear layer of every block in a LoRALinear
    (in place; on the meta device too). A reward model's or critic's score head stays trainable (it is
    new). `lora` as lora_options resolves it (alpha filled in).
    Errors: a rank above a layer's smaller side (the update could not be low-rank); a target naming no
    layer."""
    rank, targets, dropout = lora.rank, list(lora.targets), lora.dropout
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise UserError(f"--lora-targets {','.join(unknown) or '(none)'}: no such layer; valid names: "
                        f"{', '.join(LORA_TARGETS)}")
    alpha = float(lora.alpha)
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in targets:
                lin = getattr(parent, name, None)
                if not isinstance(lin, nn.Linear):
                    continue
                if not 0 < rank <= min(lin.in_features, lin.out_features):
                    raise UserError(f"--lora-rank {rank} does not fit layer {name} ({lin.out_features} x "
                                    f"{lin.in_features}): the rank must be at most "
                                    f"{min(lin.in_features, lin.out_features)}")
                setattr(parent, name, LoRALinear(lin, rank, alpha, dropout))
    if model.config.head == "scalar":
        model.score.float().weight.requires_grad_(True)  # trained, so float32 like the adapters


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def copy_lora_layers(source, model):
    """Wrap each linear layer of `model` (a copy of `source`'s architecture: the engine's, on the meta device)
    that is a LoRALinear in `source` in one of its own, with the same rank and alpha and no dropout (a sampler
    is not trained). The adapters' weights are copied afterwards, by name, with every other parameter."""
    for name, m in source.named_modules():
        if isinstance(m, LoRALinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, LoRALinear(model.get_submodule(name), m.rank, m.alpha))


@contextmanager
def adapters_off(model):
    """The base model, for the block's duration: every adapter of `model` switched off. A LoRA run's
    reference policy (DPO, the GRPO KL term, PPO) is this, so no second model is ever loaded."""
    layers = lora_layers(model)
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True

@torch.no_grad()
def fuse_projections(model):
    """Store each block's q, k, v weights as the row blocks of one tensor, and gate, up likewise: the parameters
    become views of it, their values unchanged, so that the engine's fused matmuls read them in place
    (stacked_rows) instead of keeping fused copies (9 GB at Qwen3-8B). For frozen weights: a LoRA base (at load,
    checkpoint.load_hf) and the engine's own copy; an optimizer or FSDP wants each trained parameter apart."""
    for block in model.model.layers:
        for group in ((block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj),
                      (block.mlp.gate_proj, block.mlp.up_proj)):
            fused = stacked_rows([m.weight for m in group])  # already one tensor (a shared LoRA base): kept
            row = 0
            for m in group:
                rows = m.weight.size(0)
                m.weight = nn.Parameter(fused[row:row + rows], requires_grad=m.weight.requires_grad)
                row += rows


def stacked_rows(weights):
    """The matrices (rows_i, C) stacked by rows into one: a view, with no copy, when they already lie so in one
    tensor (GPT.fuse_projections: a LoRA base, the engine's own copy), else torch.cat (engine.decode_weights;
    Llama's q is scaled there first, a new tensor, so its q, k, v are copied)."""
    first = weights[0]
    offset = first.storage_offset()
    for w in weights:
        if not (w.is_contiguous() and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and w.storage_offset() == offset and w.dtype == first.dtype):
            return torch.cat(weights)
        offset += w.numel()
    return first.as_strided((sum(w.size(0) for w in weights), first.size(1)), first.stride())


# ------------------------------------------------------------------------------------------------
# The flags every stage shares

def add_lora_flags(parser):
    """--lora-rank and its companions (see LoRALinear and docs/lora.md)."""
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base "
                        "(0: full fine-tuning); RL wants ~10x the full fine-tuning --lr")
    parser.add_argument("--lora-alpha", type=float, default=None, help="the update is scaled by alpha / rank (default: "
                        "2 x rank)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    parser.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                        help="comma-separated linear layers to adapt (default: every one in attention and MLP)")


def lora_options(args, path, resume=False, scores_samples=False):
    """The LoRA settings of a run that loads the folder `path` (None without --lora-rank), resolved: alpha filled
    in (2 * rank by default) and `base`, the folder the adapters apply to, set to `path`. resume=True continues
    the adapter of `path` (the checkpoint being loaded) instead of starting fresh ones: rank, alpha, targets and
    base are then the adapter's own. scores_samples: the stage trains on answers its own engine sampled and
    recomputes their log-probs (RL, PPO), where dropout would make the trainer a random function unlike the
    sampler (the ratio is not 1 at the start): --lora-dropout is refused there, as TRL's GRPO and PPO turn
    dropout off."""
    if not getattr(args, "lora_rank", 0):
        return None
    if scores_samples and args.lora_dropout:
        raise UserError(f"--lora-dropout {args.lora_dropout}: this stage scores the answers its engine sampled, and "
                        f"dropout would make the trainer's log-probs differ from the sampler's at random; drop it")
    lora = LoRA(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout, seed=args.seed,
                targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()), resume=resume)
    if not resume:
        return replace(lora, alpha=float(2 * lora.rank if lora.alpha is None else lora.alpha),
                       base=os.path.abspath(path))
    if not adapter_chain(path)[1]:
        raise UserError(f"{path}: not a LoRA adapter folder; resume it without --lora-rank")
    own = read_adapter(path)[0]  # (rsLoRA's scale folded into its alpha)
    return replace(lora, rank=own["r"], alpha=own["lora_alpha"], targets=tuple(own["target_modules"]),
                   base=own["base_model_name_or_path"])


# ------------------------------------------------------------------------------------------------
# Adapter folders in PEFT's format

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # PeftModel -> its base (the *ForCausalLM) -> our names


def read_adapter(path):
    """(adapter_config.json as a dict, {our tensor name: float32 tensor}) of a PEFT LoRA folder. What
    PEFT can write and we cannot apply (DoRA, per-layer ranks, biases, transposed weights) is refused;
    rsLoRA's scaling alpha / sqrt(r) is applied by folding it into lora_alpha (alpha' = alpha sqrt(r))."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform")
                   if cfg.get(k)] + (["bias"] if cfg.get("bias", "none") != "none" else [])
    if unsupported:
        raise UserError(f"{path}: adapter options {unsupported} are not supported (plain LoRA only)")
    if cfg.get("use_rslora"):
        cfg = {**cfg, "lora_alpha": cfg["lora_alpha"] * math.sqrt(cfg["r"]), "use_rslora": False}
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # PEFT's "all-linear", or a regex
        targets = list(LORA_TARGETS) if targets == "all-linear" else [t for t in LORA_TARGETS if t in targets]
    cfg["target_modules"] = targets
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise UserError(f"{path}: no {ADAPTER_WEIGHTS}")
    tensors = {}
    for key, t in load_file(weights).items():
        name = key.removeprefix(_PEFT_PREFIX).replace(".default.", ".").replace(".modules_to_save.", ".")
        tensors[name] = t.float()
    return cfg, tensors


def adapter_chain(path):
    """(the plain model folder at the bottom, [adapter folders from the base up]) of a model or adapter
    folder: an adapter names its base (base_model_name_or_path), which may itself be an adapter (an RL
    adapter trained on an unmerged SFT adapter). A plain model folder: (path, [])."""
    chain = []
    # an adapter folder: adapter_config.json and no config.json (a folder with both is a model)
    while os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(os.path.join(path, "config.json")):
        chain.insert(0, path)
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            base = json.load(f).get("base_model_name_or_path")
        found = next((c for c in ([os.path.join(path, base), base] if base else []) if os.path.isdir(c)), None)
        if found is None:  # e.g. a hub name ("Qwen/Qwen3-8B") of an adapter trained elsewhere
            raise UserError(f"{path}: its base_model_name_or_path {base!r} is not a folder here; set it (in "
                            f"{ADAPTER_CONFIG}) to the local folder of the model the adapter was trained on")
        path = found
        if len(chain) > 16:
            raise UserError(f"{chain[0]}: adapters chained more than 16 deep (a cycle?)")
    return path, chain


def merged_updates(chain, params):
    """The float32 updates that merging the adapters of `chain` adds to each base weight, summed
    ({weight name: delta}), and the tensors they replace whole ({name: tensor}: a score head). Each
    adapter's shapes are checked against the model's (params: its parameters by name)."""
    deltas, replaced = {}, {}
    for folder in chain:
        cfg, tensors = read_adapter(folder)
        scaling = cfg["lora_alpha"] / cfg["r"]
        for name, t in tensors.items():
            if ".lora_A." not in name:
                if ".lora_B." not in name:
                    replaced[name] = t  # modules_to_save: the score head
                continue
            layer = name.split(".lora_A.")[0]
            b = tensors.get(f"{layer}.lora_B.weight")
            key = f"{layer}.weight"
            if b is None or key not in params:
                raise UserError(f"{folder}: adapter tensor {name} has no {'lora_B' if b is None else 'layer'} "
                                f"in the model")
            want = tuple(params[key].shape)
            if (b.size(0), t.size(1)) != want or b.size(1) != t.size(0):
                raise UserError(f"{folder}: adapter of {layer} is {b.size(0)} x {t.size(1)} (B {tuple(b.shape)}, "
                                f"A {tuple(t.shape)}), the base has {want[0]} x {want[1]}: the adapter was "
                                f"trained on another base")
            deltas[key] = deltas.get(key, 0) + scaling * (b @ t)
    return deltas, replaced


def save_adapter(model, path, lora, tokenizer=None):
    """Write a LoRA model's adapter (lora: its settings, lora_options) as a PEFT folder (adapter_config.json,
    adapter_model.safetensors: what peft.PeftModel.from_pretrained and vLLM's --enable-lora load) plus the
    tokenizer files; the frozen base is not written: adapter_config.json names it (lora.base). Keys are PEFT's:
    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight; a reward model's or critic's score
    head is saved whole (PEFT's modules_to_save). Under FSDP2 every rank calls it (rank 0 writes)."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    tensors = {}
    for name, p in model.named_parameters():
        if "lora_" in name or (name == "score.weight" and model.config.head == "scalar"):
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            tensors[_PEFT_PREFIX + name] = t.float().cpu().contiguous()
    if not writer:
        return
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if model.config.head == "lm" else "SEQ_CLS",
           "base_model_name_or_path": lora.base, "r": lora.rank, "lora_alpha": lora.alpha,
           "lora_dropout": lora.dropout, "target_modules": list(lora.targets), "bias": "none",
           "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
           "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
           "layers_pattern": None, "modules_to_save": ["score"] if model.config.head == "scalar" else None,
           "revision": None}
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(path)
        if model.config.head == "lm":  # the base's sampling settings pass on through the adapter (and merge.py)
            with open(os.path.join(path, "generation_config.json"), "w") as f:
                json.dump(tokenizer.generation_config(), f, indent=2)
