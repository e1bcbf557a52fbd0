"""
Merge checkpoints: the weighted average of Hugging Face model folders of one architecture.

    merged[name] = w_1 * folder_1[name] + ... + w_N * folder_N[name]      for every tensor name
    (uniform weights 1/N by default; the sum is taken in float32)

Averaging the weights of fine-tunes that share a start ("model soups", Wortsman et al. 2022,
arXiv:2203.05482) is a step of most published recipes: Llama 3 averaged models trained with different data
and hyperparameters at each stage, OLMo and SmolLM3 average their last checkpoints or runs. Fine-tunes of
one base stay in one basin of the loss, so their average is a model, often better than each. The same tool
mixes a fine-tune back toward an earlier model (WiSE-FT, Wortsman et al. 2021, arXiv:2109.01903): SmolLM3
took 0.9 of its preference-tuned soup and 0.1 of a mid-training checkpoint, to recover the long-context
ability that post-training had worn down.

    python merge.py out/rl/seed0 out/rl/seed1 --out out/merged/rl-soup         # uniform: 0.5 / 0.5
    python merge.py out/rl/default/checkpoints/step_000050 out/rl/default/checkpoints/step_000060 \\
        --out out/merged/last-two                                              # the last checkpoints of a run
    python merge.py out/dpo/default out/sft/default --weights 0.9,0.1 --out out/merged/dpo-sft   # SmolLM3's mix

A folder is a model folder (config.json, model.safetensors or the shards of model.safetensors.index.json)
or a nanopost run directory (its latest checkpoint). All folders must have the same architecture, the same
tensor names and shapes, and the same tokenizer (its vocabulary and special tokens); anything else is
refused with the folder and the tensor named. The weights are used as given: they need not sum to 1
(2,-1 extrapolates away from the second model), and a note is printed when they do not.

Memory: tensors are read, summed and written a chunk of rows at a time (CHUNK_ELEMENTS, 64 MiB of
float32), so the merge holds a few chunks, never a model, nor even a whole large tensor: the output
file's header is written first (every shape is known from the inputs' headers), then the tensors' bytes
in turn. Inputs are read with plain file reads into reused buffers (a memory map would keep every page
it touched resident). `--dtype input` (default) writes each tensor in the first
folder's dtype (a bfloat16 Qwen3 stays bfloat16), `--dtype float32` in float32. config.json,
generation_config.json and the tokenizer files are copied from the first folder; merge.json records the
recipe. The output is one model.safetensors, which transformers and vLLM read at any size.

A LoRA adapter merged into its base (PEFT's folder format, what a `--lora-rank` run checkpoints):

    python merge.py --lora out/rl/lora8 --out out/merged/rl-lora8         # a plain model folder

is one more tensor source (AdaptedTensors), whose rows are W[rows] + (lora_alpha / r) * B[rows] @ A in
float32, cast to the base's dtype when written (a bfloat16 sum would drop every update below half a ulp of
W). An adapter trained on an unmerged adapter (its base_model_name_or_path is an adapter folder) merges the
whole chain. vLLM serves the result as any model; or serves the adapter itself on the base with
--enable-lora (docs/lora.md).
"""
import argparse
import json
import math
import os
import shutil
import struct

import torch

from checkpoint import resolve_model_path, safetensors_files
from common import UserError, run_main
from lora import adapter_chain, merged_updates
from tokenizer import TOKENIZER_FILES

# safetensors' names of the floating dtypes (the only ones an average means anything for)
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SAFETENSORS_NAME = {dtype: name for name, dtype in FLOAT_DTYPES.items()}
# what must agree for the tensors to mean the same thing (the tensor shapes are compared one by one too)
ARCHITECTURE_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "tie_word_embeddings")
CHUNK_ELEMENTS = 2**24  # rows are merged in chunks of about 16M elements (64 MiB of float32)


def read_safetensors_header(file: str) -> tuple[dict, int]:
    """A .safetensors file's header {name: {"dtype", "shape", "data_offsets"}} and where its data starts.
    The format: 8 bytes of header length (little-endian), the JSON header, then the tensors' bytes, each
    at [data_offsets[0], data_offsets[1]) from the data start."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class FolderTensors:
    """The tensors of one model folder (model.safetensors, or the shards named by
    model.safetensors.index.json): names(), dtype_name(name), shape(name), and read(name, rows, buffer),
    which reads some rows of a tensor into a reused buffer."""

    def __init__(self, folder: str):
        self.folder = folder
        self.where = {}  # name -> (file, its header entry, the file's data start)
        for file in safetensors_files(folder):
            header, data_start = read_safetensors_header(file)
            self.where.update({name: (file, entry, data_start) for name, entry in header.items()})

    def names(self) -> list[str]:
        return list(self.where)

    def dtype_name(self, name: str) -> str:
        return self.where[name][1]["dtype"]

    def shape(self, name: str) -> tuple:
        return tuple(self.where[name][1]["shape"])

    def read(self, name: str, rows: slice, buffer: torch.Tensor) -> torch.Tensor:
        """Rows [rows.start, rows.stop) of the tensor (along its first dimension), read from the file into
        `buffer` (a uint8 tensor) and viewed there: no memory map, no new allocation."""
        file, entry, data_start = self.where[name]
        dtype, shape = FLOAT_DTYPES[entry["dtype"]], self.shape(name)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        raw = buffer[:(rows.stop - rows.start) * row_bytes]
        view, done = memoryview(raw.numpy()), 0
        with open(file, "rb") as f:
            f.seek(data_start + entry["data_offsets"][0] + rows.start * row_bytes)
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise UserError(f"{file}: tensor {name!r} is cut short: an incomplete download or copy?")
                done += n
        return raw.view(dtype).view(-1, *shape[1:])


class AdaptedTensors(FolderTensors):
    """The tensors of a LoRA adapter's base with the adapter (and those it was trained on) merged: what
    FolderTensors reads, plus (lora_alpha / r) * B[rows] @ A, summed in float32, for the adapted weights."""

    def __init__(self, adapter: str):
        base, chain = adapter_chain(adapter)
        if not chain:
            raise UserError(f"--lora {adapter}: not a LoRA adapter folder (no adapter_config.json)")
        super().__init__(base)
        self.adapter = adapter
        shapes = {name: torch.empty(self.shape(name), device="meta") for name in self.names()}
        self.deltas, self.replaced = merged_updates(chain, shapes)
        extra = sorted(set(self.replaced) - set(shapes))
        if extra:
            raise UserError(f"--lora {adapter}: the adapter holds {extra}, which its base {base} lacks (a reward "
                            f"model's adapter on a language model): load it with the stages instead")

    def read(self, name: str, rows: slice, buffer: torch.Tensor) -> torch.Tensor:
        if name in self.replaced:
            return self.replaced[name][rows]
        chunk = super().read(name, rows, buffer)
        return chunk.float() + self.deltas[name][rows] if name in self.deltas else chunk


def row_chunks(shape: tuple, chunk_elements: int) -> list[slice]:
    """Slices of whole rows (first dimension) of about chunk_elements elements each; a 0-d tensor is one row.
    row_chunks((10, 4), 12) -> [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]"""
    rows, per_row = (shape[0] if shape else 1), math.prod(shape[1:])
    step = max(1, chunk_elements // max(1, per_row))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{folder}: no config.json; expected a Hugging Face model folder")
    with open(path) as f:
        return json.load(f)


def _token_ids(folder: str):
    """What fixes the meaning of every token id: the vocabulary (and merges) and the added special tokens."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tok = json.load(f)
    return tok.get("model"), tok.get("added_tokens")


def check_compatible(sources: list[FolderTensors]):
    """Raise a UserError naming the folder (and the key or tensor) that differs from the first folder."""
    first = sources[0]
    first_config, first_ids = _config(first.folder), _token_ids(first.folder)
    for src in sources[1:]:
        where = f"{src.folder} (against {first.folder})"
        config = _config(src.folder)
        for key in ARCHITECTURE_KEYS:
            if config.get(key) != first_config.get(key):
                raise UserError(f"{where}: config.json {key} is {config.get(key)!r}, not {first_config.get(key)!r}: "
                                f"not the same architecture")
        missing = [n for n in first.names() if n not in src.where]
        extra = [n for n in src.names() if n not in first.where]
        if missing or extra:
            raise UserError(f"{where}: " + (f"no tensor {missing[0]!r}" if missing else f"an extra tensor {extra[0]!r}")
                            + f" ({len(missing)} missing, {len(extra)} extra): not the same architecture")
        for name in first.names():
            if src.shape(name) != first.shape(name):
                raise UserError(f"{where}: tensor {name!r} has shape {list(src.shape(name))}, not "
                                f"{list(first.shape(name))}")
        if _token_ids(src.folder) != first_ids:
            raise UserError(f"{where}: tokenizer.json differs (vocabulary or special tokens): a token id would not "
                            f"mean the same in both models")
    for src in sources:
        for name in src.names():
            if src.dtype_name(name) not in FLOAT_DTYPES:
                raise UserError(f"{src.folder}: tensor {name!r} is {src.dtype_name(name)}, not floating point: "
                                f"an average of it means nothing")


def write_safetensors(path: str, specs: list[tuple], chunks):
    """Write a .safetensors file from `specs` [(name, dtype, shape)] and `chunks`, an iterable yielding the
    tensors' data in the same order, a few rows at a time. The format: 8 bytes of header length
    (little-endian), the JSON header {name: {dtype, shape, data_offsets}} padded with spaces to a multiple
    of 8, then the tensors' bytes back to back. Specs come sorted by dtype size, largest first (as
    safetensors' own writer does), so that every tensor starts aligned to its element size."""
    header, offset = {}, 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAME[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for chunk in chunks:
            f.write(chunk.reshape(-1).view(torch.uint8).numpy())
        if f.tell() != 8 + len(blob) + offset:
            raise RuntimeError(f"{path}: wrote {f.tell() - 8 - len(blob)} bytes of tensor data, the header says "
                               f"{offset}")
        f.flush()
        os.fsync(f.fileno())


def merge(sources: list, weights: list[float], out: str, dtype: torch.dtype | None = None,
          chunk_elements: int = CHUNK_ELEMENTS) -> dict:
    """Write the weighted average of the sources' tensors to out/model.safetensors, with config.json,
    generation_config.json and the tokenizer files of the first source (an adapter's own, else its base's).
    dtype None keeps each tensor's dtype in the first source. Written to out + ".tmp" and renamed into place when
    complete."""
    if len(sources) < 2 and not any(isinstance(src, AdaptedTensors) for src in sources):
        raise UserError(f"merge needs at least 2 folders (or --lora ADAPTER), got {len(sources)}")
    if len(weights) != len(sources):
        raise UserError(f"--weights has {len(weights)} numbers for {len(sources)} folders; give one per folder")
    if os.path.isdir(out) and os.listdir(out):
        raise UserError(f"--out {out} exists and is not empty; choose a new folder")
    check_compatible(sources)
    first = sources[0]
    specs = sorted(((name, dtype or FLOAT_DTYPES[first.dtype_name(name)], first.shape(name)) for name in first.names()),
                   key=lambda spec: (-spec[1].itemsize, spec[0]))
    # The work goes by chunks of whole rows, through four buffers allocated once and reused: the float32
    # sum, the input as read, the input in float32 (for other input dtypes), the output in its dtype. So
    # the memory a merge needs is a few chunks, whatever the model's size; and nothing is allocated per
    # tensor, which glibc would not give back (measured: a folder's worth of growth on bfloat16 inputs).
    chunk_numel = max(math.prod(shape[1:]) * (r.stop - r.start)
                      for _, _, shape in specs for r in row_chunks(shape, chunk_elements)[:1])
    sum_buffer = torch.empty(chunk_numel, dtype=torch.float32)
    as_float_buffer = torch.empty(chunk_numel, dtype=torch.float32)
    input_itemsize = max(FLOAT_DTYPES[src.dtype_name(name)].itemsize for src in sources for name in src.names())
    input_buffer = torch.empty(chunk_numel * input_itemsize, dtype=torch.uint8)
    output_buffer = torch.empty(chunk_numel * max(d.itemsize for _, d, _ in specs), dtype=torch.uint8)

    def averaged():
        for name, out_dtype, shape in specs:
            for rows in row_chunks(shape, chunk_elements):
                total = None
                for weight, src in zip(weights, sources):
                    chunk = src.read(name, rows, input_buffer)
                    if total is None:
                        total = sum_buffer[:chunk.numel()].view(chunk.shape).zero_()
                    if chunk.dtype != torch.float32:
                        chunk = as_float_buffer[:chunk.numel()].view(chunk.shape).copy_(chunk)
                    total.add_(chunk, alpha=weight)
                if out_dtype == torch.float32:
                    yield total
                else:
                    out = output_buffer[:total.numel() * out_dtype.itemsize].view(out_dtype)
                    yield out.view(total.shape).copy_(total)

    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_safetensors(os.path.join(tmp, "model.safetensors"), specs, averaged())
    config = _config(first.folder)
    if dtype is not None:  # the dtype fields say what the file holds (transformers 4 and 5 names)
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = str(dtype).removeprefix("torch.")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("generation_config.json", *TOKENIZER_FILES):  # an adapter's own (its run's), else its base's
        found = [f for f in (getattr(first, "adapter", None), first.folder)
                 if f and os.path.isfile(os.path.join(f, name))]
        if found:
            shutil.copy2(os.path.join(found[0], name), os.path.join(tmp, name))
    recipe = {"folders": [getattr(src, "adapter", src.folder) for src in sources], "weights": weights,
              "dtype": "input" if dtype is None else str(dtype).removeprefix("torch.")}
    with open(os.path.join(tmp, "merge.json"), "w") as f:
        json.dump(recipe, f, indent=2)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above)
    os.rename(tmp, out)
    return recipe


def parse_weights(text: str | None, n: int) -> list[float]:
    if text is None:
        return [1.0 / n] * n
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise UserError(f"--weights {text!r}: expected comma-separated numbers, e.g. 0.9,0.1") from None


def main():
    ap = argparse.ArgumentParser(description="weighted average of Hugging Face model folders of one architecture")
    ap.add_argument("folders", nargs="*", help="model folders or run directories (their latest checkpoint)")
    ap.add_argument("--lora", action="append", default=[], metavar="ADAPTER",
                    help="a LoRA adapter folder (or its run directory), merged into its base: one more source")
    ap.add_argument("--out", required=True, help="the new model folder")
    ap.add_argument("--weights", help="comma-separated, one per folder (default: uniform, 1/N each)")
    ap.add_argument("--dtype", choices=("input", "float32"), default="input",
                    help="write each tensor in the first folder's dtype (default) or in float32")
    args = ap.parse_args()
    folders = [resolve_model_path(folder) for folder in args.folders + args.lora]
    weights = parse_weights(args.weights, len(folders))
    if abs(sum(weights) - 1) > 1e-6:
        print(f"note: the weights sum to {sum(weights):g}, not 1: the result is not an average")
    sources = [FolderTensors(f) for f in folders[:len(args.folders)]] + \
        [AdaptedTensors(f) for f in folders[len(args.folders):]]
    merge(sources, weights, args.out, None if args.dtype == "input" else torch.float32)
    for folder, weight in zip(folders, weights):
        print(f"  {weight:g} x {folder}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    run_main(main)
