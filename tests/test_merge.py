"""merge.py: the weighted average of model folders, checked against averages computed here from the
folders' tensors; refusals of folders that do not match; a streamed merge's memory."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint import load_hf, save_hf
from common import UserError
from merge import FolderTensors, merge, row_chunks
from model import GPT, GPTConfig
from tokenizer import Tokenizer

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_tiny(path, tok, seed, dtype=None, tie=False, intermediate_size=64):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=intermediate_size, max_seq_len=64, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms too, so that no tensor is equal across the folders
    save_hf(model, str(path), tok, dtype=dtype)
    return str(path)


def merged(tmp_path, folders, weights, name="merged", **kw):
    out = str(tmp_path / name)
    merge([FolderTensors(f) for f in folders], weights, out, **kw)
    return out


def test_average_equals_hand_average_and_loads(tok, tmp_path):
    a, b, c = (save_tiny(tmp_path / f"m{i}", tok, seed=i) for i in range(3))
    out = merged(tmp_path, [a, b, c], [0.5, 0.3, 0.2])
    ta, tb, tc, tm = (load_file(os.path.join(f, "model.safetensors")) for f in (a, b, c, out))
    assert set(tm) == set(ta)
    for name in ta:
        torch.testing.assert_close(tm[name], 0.5 * ta[name] + 0.3 * tb[name] + 0.2 * tc[name], rtol=1e-6, atol=1e-7)
    # it loads, and computes what a model built from the averaged state dicts computes
    sds = [load_hf(f).state_dict() for f in (a, b, c)]
    reference = GPT(load_hf(a).config)
    reference.load_state_dict({k: 0.5 * sds[0][k] + 0.3 * sds[1][k] + 0.2 * sds[2][k] for k in sds[0]})
    ids = torch.randint(tok.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(out)(ids), reference(ids), rtol=1e-5, atol=1e-5)
    assert Tokenizer.load(out).encode("Mia has 12 apples.") == tok.encode("Mia has 12 apples.")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(a, name)).read()
    assert json.load(open(os.path.join(out, "merge.json")))["weights"] == [0.5, 0.3, 0.2]


def test_weights_one_zero_is_the_first_model(tok, tmp_path):
    a, b = save_tiny(tmp_path / "a", tok, seed=0), save_tiny(tmp_path / "b", tok, seed=1)
    out = merged(tmp_path, [a, b], [1.0, 0.0], chunk_elements=100)  # many chunks per tensor
    ta, tm = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(tm[k], ta[k]) for k in ta)


def test_bfloat16_and_sharded_inputs(tok, tmp_path):
    """A bfloat16 folder and a sharded one: summed in float32, written in the inputs' dtype or float32."""
    a = save_tiny(tmp_path / "a", tok, seed=0, dtype=torch.bfloat16)
    b = save_tiny(tmp_path / "b", tok, seed=1, dtype=torch.bfloat16)
    tb = load_file(os.path.join(b, "model.safetensors"))
    names = sorted(tb)  # re-save b as two shards with an index, as transformers writes large models
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tb[k] for k in part}, os.path.join(b, file))
    json.dump({"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}},
              open(os.path.join(b, "model.safetensors.index.json"), "w"))
    os.remove(os.path.join(b, "model.safetensors"))
    ta = load_file(os.path.join(a, "model.safetensors"))

    out = merged(tmp_path, [a, b], [0.5, 0.5])
    tm = load_file(os.path.join(out, "model.safetensors"))
    for k in ta:
        assert tm[k].dtype == torch.bfloat16
        assert torch.equal(tm[k], (0.5 * ta[k].float() + 0.5 * tb[k].float()).bfloat16())
    out32 = merged(tmp_path, [a, b], [0.5, 0.5], name="merged32", dtype=torch.float32)
    tm = load_file(os.path.join(out32, "model.safetensors"))
    for k in ta:
        torch.testing.assert_close(tm[k], 0.5 * ta[k].float() + 0.5 * tb[k].float(), rtol=0, atol=0)
    config = json.load(open(os.path.join(out32, "config.json")))
    assert config["torch_dtype"] == config["dtype"] == "float32"
    load_hf(out32)


def test_refusals(tok, tmp_path):
    a, b = save_tiny(tmp_path / "a", tok, seed=0), save_tiny(tmp_path / "b", tok, seed=1)
    with pytest.raises(UserError, match="2 numbers for 3 folders"):
        merged(tmp_path, [a, b, b], [0.5, 0.5])
    with pytest.raises(UserError, match="at least 2 folders"):
        merged(tmp_path, [a], [1.0])
    with pytest.raises(UserError, match="not empty"):
        merge([FolderTensors(a), FolderTensors(b)], [0.5, 0.5], a)

    wide = save_tiny(tmp_path / "wide", tok, seed=1, intermediate_size=96)
    with pytest.raises(UserError, match="wide.*intermediate_size is 96"):
        merged(tmp_path, [a, wide], [0.5, 0.5])
    tied = save_tiny(tmp_path / "tied", tok, seed=1, tie=True)
    with pytest.raises(UserError, match="tied.*tie_word_embeddings"):
        merged(tmp_path, [a, tied], [0.5, 0.5])

    # the same config, one tensor of another shape: named
    odd = shutil.copytree(b, tmp_path / "odd")
    tensors = load_file(os.path.join(odd, "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1].contiguous()
    save_file(tensors, os.path.join(odd, "model.safetensors"))
    with pytest.raises(UserError, match=r"odd.*'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[63, 32\]"):
        merged(tmp_path, [a, str(odd)], [0.5, 0.5])
    # one tensor missing: named
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(odd, "model.safetensors"))
    with pytest.raises(UserError, match=r"odd.*no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        merged(tmp_path, [a, str(odd)], [0.5, 0.5])

    # another tokenizer (the same size, other merges): refused
    from tasks import pretrain_text
    other_tok = Tokenizer.train(pretrain_text("train", 300, seed=7)[::-1], vocab_size=tok.vocab_size)
    other = save_tiny(tmp_path / "other", other_tok, seed=1)
    assert other_tok.vocab_size == tok.vocab_size and other_tok.encode("Mia has 12 apples.") != tok.encode("Mia has 12 apples.")
    with pytest.raises(UserError, match="other.*tokenizer.json differs"):
        merged(tmp_path, [a, other], [0.5, 0.5])
    assert not os.path.exists(tmp_path / "merged") and not os.path.exists(tmp_path / "merged.tmp")


def test_command_line(tok, tmp_path):
    a, b = save_tiny(tmp_path / "a", tok, seed=0), save_tiny(tmp_path / "b", tok, seed=1)
    run = lambda *args: subprocess.run([sys.executable, "merge.py", *args], cwd=REPO, capture_output=True,
                                       text=True, timeout=120)
    p = run(a, b, "--out", str(tmp_path / "soup"), "--weights", "0.9,0.1")
    assert p.returncode == 0, p.stderr
    ta, tb = (load_file(os.path.join(f, "model.safetensors")) for f in (a, b))
    tm = load_file(str(tmp_path / "soup" / "model.safetensors"))
    torch.testing.assert_close(tm["lm_head.weight"], 0.9 * ta["lm_head.weight"] + 0.1 * tb["lm_head.weight"])
    p = run(a, b, "--out", str(tmp_path / "x"), "--weights", "0.5")
    assert p.returncode == 2 and p.stderr.strip() == "error: --weights has 1 numbers for 2 folders; give one per folder"


def test_row_chunks():
    assert row_chunks((10, 4), 12) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert row_chunks((10, 4), 1) == [slice(i, i + 1) for i in range(10)]  # at least one row
    assert row_chunks((), 5) == [slice(0, 1)]


MEASURE = """
import json, sys
sys.path.insert(0, {repo!r})
from merge import FolderTensors, merge

def status_mb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) / 1024

growth = []
for chunk_elements, out in ((2**24, "whole"), (2**18, "chunked")):
    sources = [FolderTensors(f) for f in {folders!r}]
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the current size
    before = status_mb("VmRSS")
    merge(sources, [0.5, 0.5], {tmp!r} + "/" + out, chunk_elements=chunk_elements)
    growth.append(status_mb("VmHWM") - before)
print(json.dumps(growth))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures the peak with Linux's /proc")
@pytest.mark.slow  # a memory drill
def test_memory_stays_near_one_tensor(tmp_path):
    """Two folders of 128 MB (8 float32 tensors of 16 MB): a merge's peak resident memory grows by about the
    float32 sum and the input of one tensor (32 MB), not a folder; with chunks of 1 MB rows, by 2 chunks."""
    tensor_mb, count = 16, 8
    folders = []
    for i in range(2):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        save_file({f"layer.{j}.weight": torch.full((tensor_mb * 2**18 // 1024, 1024), float(i + j)) for j in range(count)},
                  str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
        folders.append(str(folder))
    code = MEASURE.format(repo=REPO, folders=folders, tmp=str(tmp_path))
    whole, chunked = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True, timeout=300).stdout)
    print(f"peak RSS growth: {whole:.1f} MB (one tensor {tensor_mb} MB, a folder {tensor_mb * count} MB); "
          f"with 1 MB chunks {chunked:.1f} MB")
    assert whole < 2 * tensor_mb + 12  # the sum and the input of one tensor, and a little
    assert chunked < 12
    merged = load_file(str(tmp_path / "chunked" / "model.safetensors"))
    assert all(torch.equal(merged[f"layer.{j}.weight"], torch.full_like(merged["layer.0.weight"], j + 0.5))
               for j in range(count))
