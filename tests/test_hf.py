"""Checkpoints are Hugging Face folders: what transformers writes we load (sharded, bfloat16, its config
forms, its tokenizer files), what we write transformers loads, and our engine decodes what its generate
decodes. The models are tiny random ones built here by transformers itself; nothing is downloaded."""
import json
from collections import Counter
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checkpoint import load_hf, resolve_model_path, save_hf
from common import UserError
from engine import Engine
from model import GPT, GPTConfig
from tokenizer import SPLIT_PATTERN, Tokenizer, render_text

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def hf_model(arch, vocab_size, tie=True, rope_theta=1_000_000.0, rope_scaling=None, seed=0):
    """A random transformers model; weights and norms drawn wide enough that greedy argmaxes are decisive
    (no float32 near-ties that a different summation order could flip)."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
              tie_word_embeddings=tie, rope_theta=rope_theta, initializer_range=0.2)
    if arch == "qwen3":
        m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    else:
        if rope_scaling:
            kw["rope_scaling"] = {**rope_scaling, "rope_theta": rope_theta}
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return m.eval()


def questions(tok):
    qs = ["Hi", "Mia has 12 apples and eats 3. How many are left?", "What is 3 + 4?",
          "Sam has 7 boxes with 6 eggs in each box. He gives 2 boxes away. How many eggs does he have now?"]
    return [tok.render_for_completion([{"role": "user", "content": q}]) for q in qs]


@torch.no_grad()
def hf_greedy(hf, prompt, n, eos):
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                      eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------
# Greedy generation: our batched engine equals transformers' generate, prompt by prompt

class StopAt:
    """The engine's tokenizer interface with a chosen stop id (so that rows really stop mid-batch)."""

    def __init__(self, tok, stop):
        self.pad_id, self.stop_ids, self.decode = tok.pad_id, {stop}, tok.decode


@pytest.mark.parametrize("arch,tie,rope_scaling", [("qwen3", True, None), ("llama", False, LLAMA3_ROPE)])
def test_greedy_generation_equals_transformers(tmp_path, tok, arch, tie, rope_scaling):
    hf = hf_model(arch, tok.vocab_size, tie=tie, rope_scaling=rope_scaling)
    hf.save_pretrained(tmp_path)
    ours = load_hf(str(tmp_path)).eval()
    prompts = questions(tok)
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ: left padding is exercised
    n = 24
    # 1) the tokenizer's own stop ids (<|im_end|>, <|endoftext|>), as in every rollout
    outs = Engine(ours, tok).generate(prompts, max_new_tokens=n, temperature=0.0)
    eos = sorted(tok.stop_ids)
    for p, out in zip(prompts, outs):
        assert out.tokens == hf_greedy(hf, p, n, eos)
    # 2) a stop id that greedy decoding does produce (the one in most rows), so rows leave the batch
    #    at different steps while the others keep decoding
    stop = Counter(t for o in outs for t in set(o.tokens)).most_common(1)[0][0]
    outs = Engine(ours, StopAt(tok, stop)).generate(prompts, max_new_tokens=n, temperature=0.0)
    assert any(o.finish_reason == "stop" for o in outs)
    for p, out in zip(prompts, outs):
        ref = hf_greedy(hf, p, n, stop)
        assert out.tokens == ref
        assert out.finish_reason == ("stop" if ref[-1] == stop else "length")


# ------------------------------------------------------------------------------------------------
# Loading what transformers writes

def test_sharded_checkpoint_loads_with_equal_logits(tmp_path):
    hf = hf_model("llama", 101, tie=False, rope_scaling=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
    ours = load_hf(str(tmp_path)).eval()
    x = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)


def qwen_hub_config(hf_cfg: dict) -> dict:
    """The config.json form of the Qwen3 checkpoints on the hub (written by transformers 4.5x)."""
    keep = ("architectures", "attention_bias", "attention_dropout", "head_dim", "hidden_act", "hidden_size",
            "initializer_range", "intermediate_size", "max_position_embeddings", "model_type",
            "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
            "tie_word_embeddings", "use_cache", "vocab_size")
    cfg = {k: hf_cfg[k] for k in keep}
    cfg.update(bos_token_id=151643, eos_token_id=151643, max_window_layers=28, rope_scaling=None,
               rope_theta=hf_cfg["rope_parameters"]["rope_theta"], sliding_window=None, torch_dtype="bfloat16",
               transformers_version="4.51.0", use_sliding_window=False)
    return cfg


@pytest.mark.parametrize("form", ["transformers5", "hub_qwen3"])
def test_bfloat16_checkpoint_in_both_config_forms(tmp_path, form):
    # real Qwen3 folders: bfloat16 weights, config with torch_dtype + rope_theta (hub), or dtype +
    # rope_parameters (what transformers 5 writes)
    hf = hf_model("qwen3", 101, tie=False).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if form == "transformers5":
        assert "rope_parameters" in cfg and cfg["dtype"] == "bfloat16"
    else:
        (tmp_path / "config.json").write_text(json.dumps(qwen_hub_config(cfg)))
    ours = load_hf(str(tmp_path))  # dtype=None keeps the file's dtype
    assert ours.config.rope_theta == 1_000_000.0 and not ours.config.tie_word_embeddings
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    x = torch.randint(0, 101, (2, 30))
    ours32 = load_hf(str(tmp_path), dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours32(x), ref(x).logits, atol=1e-4, rtol=0)
        # bfloat16 end to end: the same computation up to bfloat16 rounding
        lb = ours.eval()(x).float()
        assert lb.dtype == torch.float32 and (lb - ref(x).logits).abs().max() < 0.1 * ref(x).logits.abs().max()


def test_from_hf_casts_to_bfloat16(tmp_path):
    hf = hf_model("llama", 101, tie=True)
    hf.save_pretrained(tmp_path)
    m = load_hf(str(tmp_path), dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied after the cast
    x = torch.randint(0, 101, (1, 20))
    with torch.no_grad():
        ref = hf(x).logits
        assert (m(x).float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_our_llama_checkpoint_round_trips_through_transformers(tmp_path, tok):
    # config_to_hf in Llama form, rope scaling included, loads in transformers with equal logits
    hf = hf_model("llama", tok.vocab_size, tie=False, rope_scaling=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(str(tmp_path / "hf")).eval()
    save_hf(ours, str(tmp_path / "ours"), tok)
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == cfg["torch_dtype"] == "float32"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto").eval()
    assert again.dtype == torch.float32
    x = torch.randint(0, tok.vocab_size, (2, 50))  # past original_max_position_embeddings: scaling matters
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, hf(x).logits, atol=1e-4, rtol=0)


def test_generation_config_stops_where_the_engine_stops(tmp_path, tok):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, head_dim=16,
                      intermediate_size=64, max_seq_len=64))
    save_hf(m, str(tmp_path), tok)
    gen = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert gen.eos_token_id == [tok.eos_id, tok.endoftext_id] and set(gen.eos_token_id) == tok.stop_ids
    assert gen.pad_token_id == tok.pad_id
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_id and cfg["pad_token_id"] == tok.pad_id
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token_id == tok.pad_id


# ------------------------------------------------------------------------------------------------
# Tokenizers that transformers saved, as real checkpoints ship them

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def qwen_like_tokenizer(texts, specials=QWEN_SPECIALS, tags=QWEN_TAGS):
    """A transformers tokenizer built like Qwen3's: NFC + Qwen's split + byte-level BPE, then the specials
    added after the learned vocabulary (so their ids differ from ours), the think/tool tags as non-special
    added tokens."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer
    raw = RawTokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                                pad_token=specials[0], clean_up_tokenization_spaces=False)


def chat_texts():
    from tasks import sft_conversations
    convs = sft_conversations("train", 40)
    return convs, [render_text(c["messages"], tools=c.get("tools")) for c in convs]


def test_tokenizer_saved_by_transformers_loads_and_encodes_equal(tmp_path):
    convs, texts = chat_texts()
    hf_tok = qwen_like_tokenizer(texts)
    hf_tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    ours = Tokenizer.load(tmp_path)
    assert ours.im_start_id == hf_tok.convert_tokens_to_ids("<|im_start|>") >= 400
    assert ours.eos_id == hf_tok.eos_token_id and ours.pad_id == hf_tok.pad_token_id
    assert ours.stop_ids == {hf_tok.eos_token_id, hf_tok.convert_tokens_to_ids("<|endoftext|>")}
    for text in texts[:20] + ["<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call> café ﬁ 12345"]:
        ids = ours.encode(text)
        assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == hf_tok.decode(ids)
    # and the training render works on it: the mask covers exactly the assistant turns
    ids, mask = ours.render_conversation(convs[0]["messages"], convs[0].get("tools"))
    assert ours.decode(ids).count("<|im_start|>assistant\n") >= 1 and 0 < sum(mask) < len(ids)


def test_tokenizer_without_chatml_is_a_clear_error(tmp_path):
    # Llama 3's tokenizer has <|begin_of_text|>, <|eot_id|>, ... but no <|im_start|>: nanopost renders ChatML only
    _, texts = chat_texts()
    hf_tok = qwen_like_tokenizer(texts, specials=["<|begin_of_text|>", "<|eot_id|>"], tags=[])
    hf_tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"<\|im_start\|>"):
        Tokenizer.load(tmp_path)
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.load(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------------
# Reward models, errors, and --init on a real-shaped folder

def test_reward_model_scalar_head_round_trips(tmp_path, tok):
    torch.manual_seed(0)
    rm = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, head_dim=16,
                       intermediate_size=64, max_seq_len=64, head="scalar")).eval()
    torch.nn.init.normal_(rm.score.weight)
    save_hf(rm, str(tmp_path), tok)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"] and cfg["num_labels"] == 1
    assert not (tmp_path / "generation_config.json").exists()  # nothing to generate with a scalar head
    again = load_hf(str(tmp_path)).eval()
    assert again.config.head == "scalar"
    x = torch.randint(0, tok.vocab_size, (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(again(x), rm(x), atol=0, rtol=0)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == tok.pad_id
    with torch.no_grad():  # transformers scores the last non-pad token
        torch.testing.assert_close(hf(x).logits.squeeze(-1), rm(x)[:, -1], atol=1e-5, rtol=0)


def test_unsupported_or_incomplete_folders_are_clear_errors(tmp_path):
    hf = hf_model("qwen3", 101)
    hf.save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())

    def folder(name, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        return str(d)

    with pytest.raises(ValueError, match="mistral"):
        load_hf(folder("mistral", model_type="mistral", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_hf(folder("swa", use_sliding_window=True))
    with pytest.raises(UserError, match="model.safetensors"):
        load_hf(folder("noweights"))
    d = folder("binonly")
    (tmp_path / "binonly" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="pytorch_model.bin"):
        load_hf(d)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p for p in os.listdir(tmp_path / "sharded") if p.startswith("model-"))
    os.remove(tmp_path / "sharded" / shards[1])
    with pytest.raises(UserError, match=shards[1]):
        load_hf(str(tmp_path / "sharded"))
    with pytest.raises(UserError, match="config.json"):
        resolve_model_path(str(tmp_path / "nowhere"))
    bigger = folder("bigger", num_hidden_layers=3)  # config promises a layer the weights lack
    shutil.copy(tmp_path / "ok" / "model.safetensors", bigger)
    with pytest.raises(ValueError, match="model.layers.2"):
        load_hf(bigger)


MEMORY_PROBE = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from checkpoint import load_hf

def rss_mb():
    fields = dict(line.split(":") for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}

load_hf(sys.argv[3])(torch.zeros(1, 4, dtype=torch.long))  # warm up torch's allocator and thread pools
before = rss_mb()["VmRSS"]
m = load_hf(sys.argv[2], dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[sys.argv[4]])
with torch.no_grad():
    assert all(torch.isfinite(p.sum()) for p in m.parameters())  # touch every weight, no big temporaries
print(rss_mb()["VmHWM"] - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak memory from Linux /proc")
@pytest.mark.slow
def test_loading_does_not_hold_two_copies_of_the_weights(tmp_path):
    # a ~65 MB checkpoint; the peak memory growth of a fresh process that loads it (and reads every weight)
    # is compared with the file size. A state_dict load (load_file + load_state_dict) peaks at ~2x.
    big = GPT(GPTConfig(vocab_size=16000, n_layer=1, n_embd=512, n_head=8, n_kv_head=4, head_dim=64,
                        intermediate_size=512, tie_word_embeddings=False))
    save_hf(big, str(tmp_path / "big"))
    save_hf(GPT(GPTConfig(vocab_size=64, n_layer=1, n_embd=32, head_dim=8, max_seq_len=32)), str(tmp_path / "warm"))
    size_mb = os.path.getsize(tmp_path / "big" / "model.safetensors") / 2**20
    growth = {}
    for dtype in ("float32", "bfloat16"):
        r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, REPO, str(tmp_path / "big"), str(tmp_path / "warm"),
                            dtype], capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        growth[dtype] = float(r.stdout.split()[-1])
    # same dtype: the weights are the file's pages (safetensors maps it), one copy
    assert growth["float32"] < 1.25 * size_mb, (growth, size_mb)
    # cast on load: the file's pages plus the half-size bfloat16 result, never a second float32 copy
    assert growth["bfloat16"] < 1.75 * size_mb, (growth, size_mb)


def test_sft_init_from_a_real_shaped_qwen3_folder(tmp_path):
    # what a downloaded Qwen3 base looks like: hub config (torch_dtype bfloat16, rope_theta), bfloat16 weights,
    # a config vocab larger than the tokenizer's, the tokenizer saved by transformers with the specials after
    # the BPE vocabulary. chat_sft.py --init must train from it and write a checkpoint transformers loads.
    convs, texts = chat_texts()
    hf_tok = qwen_like_tokenizer(texts)
    model_dir = tmp_path / "Qwen3-tiny-Base"
    hf = hf_model("qwen3", len(hf_tok) + 7, tie=True).to(torch.bfloat16)
    hf.save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps(qwen_hub_config(json.loads((model_dir / "config.json").read_text()))))
    hf_tok.save_pretrained(model_dir)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in convs))
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_sft.py"), "--init", str(model_dir), "--data", str(data),
                        "--steps", "2", "--batch-size", "4", "--device-batch-size", "4", "--seq-len", "128",
                        "--eval-problems", "0", "--save-every", "1000", "--device", "cpu"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ckpt = resolve_model_path(str(tmp_path / "home" / "sft" / "default"))
    cfg = json.loads(open(os.path.join(ckpt, "config.json")).read())
    assert cfg["vocab_size"] == len(hf_tok) + 7 and cfg["eos_token_id"] == hf_tok.eos_token_id
    trained = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = load_hf(ckpt, dtype=torch.float32).eval()
    x = torch.tensor([Tokenizer.load(ckpt).render_for_completion(convs[0]["messages"][:-1])])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), trained(x).logits, atol=1e-4, rtol=0)


def test_take_it_elsewhere_snippet_runs(tmp_path, tok, capsys):
    # docs/real-models.md's "Take it elsewhere" code, as written, on a checkpoint of ours (transformers 5's
    # apply_chat_template returns a BatchEncoding: the snippet must pass it as keyword arguments)
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "real-models.md")).read()
    snippet = text.split("## Take it elsewhere", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    path = "out/rl/qwen3-grpo/checkpoints/step_000200"
    assert path in snippet and "max_new_tokens=256" in snippet
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, max_seq_len=128))
    save_hf(model, str(tmp_path), tok)
    exec(snippet.replace(path, str(tmp_path)).replace("max_new_tokens=256", "max_new_tokens=4"), {})
    assert "What is 17 * 23?" in capsys.readouterr().out


def test_the_input_folders_sampling_settings_survive_every_stage_and_merge(tmp_path, tok, monkeypatch):
    """An --init folder's generation_config.json (how its makers meant it sampled) passes through a full run's
    checkpoint, a LoRA adapter's, and merge.py's output; our stop tokens come first in eos_token_id."""
    import chat_sft
    import merge
    from inprocess import run_stage
    torch.manual_seed(0)
    init = tmp_path / "init"
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(init), tok)
    theirs = {"bos_token_id": tok.endoftext_id, "eos_token_id": [tok.endoftext_id, 7], "do_sample": True,
              "temperature": 0.6, "top_p": 0.95, "top_k": 20, "transformers_version": "4.51.0"}
    (init / "generation_config.json").write_text(json.dumps(theirs))
    small = ["--num-train", "64", "--num-val", "2", "--eval-problems", "0", "--batch-size", "8", "--steps", "1"]
    run_stage(monkeypatch, tmp_path, chat_sft, "--init", init, "--run-name", "full", *small)
    run_stage(monkeypatch, tmp_path, chat_sft, "--init", init, "--run-name", "lora", "--lora-rank", "2", *small)
    full, lora = (tmp_path / "sft" / run / "checkpoints" / "step_000001" for run in ("full", "lora"))
    monkeypatch.setattr(sys, "argv", ["merge.py", "--lora", str(lora), "--out", str(tmp_path / "merged")])
    merge.main()
    for folder in (full, lora, tmp_path / "merged"):
        gen = json.loads((folder / "generation_config.json").read_text())
        assert {k: gen[k] for k in ("bos_token_id", "do_sample", "temperature", "top_p", "top_k")} == \
            {"bos_token_id": tok.endoftext_id, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}, folder
        assert gen["eos_token_id"] == [tok.eos_id, tok.endoftext_id, 7], folder
    assert json.loads((full / "config.json").read_text())["bos_token_id"] == tok.endoftext_id
