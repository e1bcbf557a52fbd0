"""The GPT: packing isolation, the KV cache, log-probs, the scalar head, and equality with transformers."""
import argparse
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from common import UserError
from rundir import add_run_flags
from model import (GPT, HEAD_PRECISIONS, GPTConfig, KVCache, PackedDocuments, head_logits, positions_from_doc_ids,
                   process_logits, vocab_logprobs)
from checkpoint import load_hf, save_hf
from engine import decode_step, decode_weights

torch.set_num_threads(1)


def tiny(**kw):
    base = dict(vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, head_dim=8, intermediate_size=64,
                max_seq_len=64)
    base.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**base)).eval()


def test_positions_restart_per_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert positions_from_doc_ids(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_packed_row_equals_documents_alone():
    m = tiny()
    a, b, c = torch.randint(0, 97, (1, 11)), torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 9))
    packed = torch.cat([a, b, c], 1)
    doc = torch.tensor([[0] * 11 + [1] * 6 + [2] * 9])
    with torch.no_grad():
        lp = m(packed, doc_ids=doc)
        for x, s in ((a, 0), (b, 11), (c, 17)):
            torch.testing.assert_close(lp[:, s:s + x.size(1)], m(x), atol=1e-5, rtol=0)


def test_attention_never_crosses_documents():
    # change every token of document A: the logits of document B must not move at all
    m = tiny()
    b = torch.randint(0, 97, (1, 8))
    doc = torch.tensor([[0] * 5 + [1] * 8])
    with torch.no_grad():
        out1 = m(torch.cat([torch.randint(0, 97, (1, 5)), b], 1), doc_ids=doc)[:, 5:]
        out2 = m(torch.cat([torch.randint(0, 97, (1, 5)), b], 1), doc_ids=doc)[:, 5:]
    assert torch.equal(out1, out2)


def test_packed_documents_batch_each_document_alone():
    # the docstring's example: documents of 3, 2, 1 (row 0) and 4, 2 (row 1) tokens
    layout = PackedDocuments.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]))
    assert [b.tolist() for b in layout.batches] == [[[6, 7, 8, 9], [0, 1, 2, 2]], [[3, 4], [10, 11]], [[5]]]
    assert layout.inverse.tolist() == [4, 5, 6, 8, 9, 12, 0, 1, 2, 3, 10, 11]


def dense_document_mask(doc_ids):
    """The path PackedDocuments replaced (issue #51): a (B, 1, T, T) mask of same-document causal pairs."""
    T = doc_ids.size(1)
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]


def test_packed_documents_equal_the_dense_mask(monkeypatch):
    # per-document batches against the dense mask, on rows whose documents fall into several batches (a long
    # one, one half its length, one-token documents, a row that is one document): logits within 1e-5 (measured:
    # 6e-8), the log-probs' gradients within 1e-4 relative (measured: 3e-7)
    m = tiny().train()
    lengths = [[11, 1, 20, 8, 24], [64], [3, 3, 3, 30, 1, 24], [32, 16, 9, 7]]
    doc = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    x, y = torch.randint(0, 97, doc.shape), torch.randint(0, 97, doc.shape)
    results = []
    for layout in (PackedDocuments.from_doc_ids, dense_document_mask):
        monkeypatch.setattr(PackedDocuments, "from_doc_ids", layout)
        m.zero_grad()
        with torch.no_grad():
            logits = m(x, doc_ids=doc)
        logp = m(x, y, doc_ids=doc)
        logp.sum().backward()
        results.append((logits, logp.detach(), [p.grad.clone() for p in m.parameters()]))
    (logits, logp, grads), (dense_logits, dense_logp, dense_grads) = results
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(logp, dense_logp, atol=1e-5, rtol=0)
    for g, dense in zip(grads, dense_grads):
        torch.testing.assert_close(g, dense, atol=1e-4 * float(dense.abs().max()), rtol=0)


def test_kv_cache_decoding_equals_full_recompute():
    m = tiny()
    x = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        full = m(x)
        cache = KVCache(m.config, 3, 32, "cpu", torch.float32)
        steps = [m(x[:, :8], kv_cache=cache)]
        for t in range(8, 20):
            steps.append(m(x[:, t:t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3 and Llama
def test_decode_step_equals_the_cached_forward(qk_norm):
    # left-padded prompts (the padding is its own document, so the isolating mask is on), each prefilled
    # into 2 rows and rows dropped mid-way as the engine does: the fused step gives the module forward's numbers
    m = tiny(qk_norm=qk_norm)
    with torch.no_grad():
        for p in m.parameters():  # non-trivial norm gains, so a wrongly fused gain table would show
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(1, 97, (2, 9))
    doc = torch.tensor([[0] * 4 + [1] * 5, [1] * 9])
    caches = [KVCache(m.config, 4, 24, "cpu", torch.float32) for _ in range(2)]
    weights = decode_weights(m)
    with torch.no_grad():
        for cache in caches:
            m(ids, doc_ids=doc, kv_cache=cache)
        assert caches[0].isolated
        alone = KVCache(m.config, 2, 24, "cpu", torch.float32)  # the cache's rows 2i and 2i+1 are prompt i's
        m(ids, doc_ids=doc, kv_cache=alone)
        torch.testing.assert_close(caches[0].k[:, ::2], alone.k)
        torch.testing.assert_close(caches[0].v[:, 1::2], alone.v)
        x = torch.randint(0, 97, (4,))
        for t in range(10):
            if t == 4:
                for cache in caches:
                    cache.keep_rows(torch.tensor([0, 1, 3]))
                x = x[[0, 1, 3]]
            want = m(x[:, None], kv_cache=caches[0])[:, -1]
            got = decode_step(m, x, caches[1], weights)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            x = want.argmax(-1)
    assert caches[1].length == caches[0].length and torch.equal(caches[1].next_pos, caches[0].next_pos)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=0)


def test_a_step_over_a_length_bucket_equals_the_exact_step():
    # the compiled decode step attends over a power-of-two bucket of the cache (engine.length_bucket), its positions
    # past the new token empty: masked, they change nothing. Prompts without doc_ids (every position document 0,
    # as the empty ones are) and rows dropped mid-way; the bucketed step run eagerly
    m = tiny()
    ids = torch.randint(1, 97, (3, 5))
    caches = [KVCache(m.config, 3, 40, "cpu", torch.float32) for _ in range(2)]
    weights = decode_weights(m)
    with torch.no_grad():
        for cache in caches:
            m(ids, kv_cache=cache)
        x = torch.randint(0, 97, (3,))
        for t in range(30):  # cache lengths 6 to 35: buckets 8, 16, 32 and 40
            if t == 10:
                for cache in caches:
                    cache.keep_rows(torch.tensor([2, 0]))
                x = x[[2, 0]]
            want = decode_step(m, x, caches[0], weights)
            got = decode_step(m, x, caches[1], weights, bucketed=True)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            x = want.argmax(-1)


def reference_logprobs(logits, y, temperature=1.0, top_k=None, top_p=None):
    """log softmax of the full (B, T, V) logits, written from the definition (not model.process_logits):
    top-k keeps the k largest; top-p keeps, largest first, each token whose larger tokens hold less than p."""
    z = logits.float() / temperature
    if top_k is not None:
        kth = z.sort(-1, descending=True).values[..., top_k - 1:top_k]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None:
        p_sorted, order = torch.softmax(z, -1).sort(-1, descending=True)
        keep_sorted = (p_sorted.cumsum(-1) - p_sorted) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        z = z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, y.clamp(min=0)[..., None]).squeeze(-1).masked_fill(y < 0, 0)
    p = logp.exp()
    entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(-1).masked_fill(y < 0, 0)
    return lp, entropy


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 5, None), (1.0, None, 0.8)])
def test_logprobs_and_entropy_in_chunks_match_the_full_softmax_and_gradients(temperature, top_k, top_p):
    m = tiny().train()
    x = torch.randint(0, 97, (2, 30))
    y = torch.randint(0, 97, (2, 30))
    y[1, 3] = y[0, :4] = -100
    # chunks of 7 positions: uneven on purpose
    lp, ent = m.head_logprobs(m.hidden_states(x), y, temperature=temperature, top_k=top_k, top_p=top_p,
                              with_entropy=True, chunk_elements=97 * 7)
    ref_lp, ref_ent = reference_logprobs(m(x), y, temperature, top_k, top_p)
    if top_k or top_p:  # the truncation really cut tokens (-inf logits), where a naive p log p is 0 x -inf = NaN
        assert torch.isinf(ref_lp).any()
    assert torch.isfinite(ent).all() and torch.all(lp[0, :4] == 0) and torch.all(ent[0, :4] == 0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(m(x, y, temperature=temperature, top_k=top_k, top_p=top_p), lp)  # forward = the same path
    w = m.model.layers[0].mlp.up_proj.weight
    for ours, ref in ((lp, ref_lp), (ent, ref_ent)):
        g1 = torch.autograd.grad(ours.sum(), w, retain_graph=True)[0]
        g2 = torch.autograd.grad(ref.sum(), w, retain_graph=True)[0]
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


class MatmulPrecisions(TorchDispatchMode):
    """The CUDA float32 matmul setting in force at each matrix product run inside it, by the product's output width."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen.append((out.size(-1), torch.backends.cuda.matmul.fp32_precision))
        return out


def test_head_precisions_compute_what_they_name_with_float32_logits():
    torch.manual_seed(0)
    h, w = torch.randn(6, 32), torch.randn(97, 32) / 6
    exact = h.double() @ w.double().T
    for precision, dtype, err in (("float32", torch.float32, 1e-5), ("tf32", torch.float32, 1e-5),
                                  ("bf16", torch.bfloat16, 3e-2)):
        logits = head_logits(h, w.to(dtype), precision)
        assert logits.dtype == torch.float32  # so every log-sum-exp after it accumulates in float32
        assert (logits.double() - exact).abs().max() < err
    bf16 = head_logits(h, w.bfloat16(), "bf16")  # bf16 inputs and output: what a bf16 matmul gives, no more
    assert torch.equal(bf16, F.linear(h.bfloat16(), w.bfloat16()).float())
    assert (bf16 - head_logits(h, w, "float32")).abs().max() > 1e-3
    parser = argparse.ArgumentParser()
    add_run_flags(parser, "sft")  # --head-precision offers exactly these
    assert set(next(a for a in parser._actions if a.dest == "head_precision").choices) == set(HEAD_PRECISIONS)


def test_tf32_is_set_for_the_heads_matmuls_alone_forward_and_backward():
    # the CUDA TF32 setting is on for the head's product and its two backward products (vocabulary-wide
    # outputs, or the gradient of the hidden states), off for the trunk's, and restored after; on CPU the
    # numbers are float32's, gradients included
    m = tiny().train()
    x, y = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    before = torch.backends.cuda.matmul.fp32_precision
    with MatmulPrecisions() as rec:
        m.head_precision = "tf32"
        lp = m(x, y)
        lp.sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    assert torch.backends.cuda.matmul.fp32_precision == before
    head = [setting for width, setting in rec.seen if width in (97, m.config.n_embd) and setting == "tf32"]
    assert len(head) >= 3 and {s for _, s in rec.seen if s == "tf32"} and any(s != "tf32" for _, s in rec.seen)
    assert all(width in (97, m.config.n_embd) for width, s in rec.seen if s == "tf32")
    m.zero_grad()
    m.head_precision = "float32"
    torch.testing.assert_close(lp, m(x, y), atol=0, rtol=0)
    m(x, y).sum().backward()
    for got, want in zip(grads, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_bf16_head_logprobs_are_its_logits_log_softmax_in_float32():
    # vocab_logprobs in bf16: the log-softmax of head_logits's float32 logits (not a bf16 log-sum-exp)
    torch.manual_seed(0)
    h, w, t = torch.randn(1, 5, 32), torch.randn(97, 32) / 3, torch.randint(0, 97, (1, 5))
    lp = vocab_logprobs(h, w, t, precision="bf16")
    want = head_logits(h[0], w.bfloat16(), "bf16").log_softmax(-1).gather(-1, t[0][:, None]).squeeze(-1)
    torch.testing.assert_close(lp[0], want, atol=1e-6, rtol=0)


def test_process_logits_top_k_top_p_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top-k keeps exactly k tokens, the k largest (a `<=` for `<` keeps k - 1), and renormalizes over them
    for k, want in ((1, [True, False, False, False]), (2, [True, True, False, False]), (3, [True, True, True, False])):
        assert (~torch.isinf(process_logits(logits, top_k=k))).tolist() == [want]
    lp = process_logits(logits, top_k=2).log_softmax(-1)[0, 1]
    assert abs(lp.item() - math.log(0.3 / 0.8)) < 1e-6
    kept = ~torch.isinf(process_logits(logits, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    lp = process_logits(logits, top_p=0.7).log_softmax(-1)[0, 1]
    assert abs(lp.item() - torch.log(torch.tensor(0.3 / 0.8)).item()) < 1e-6


def test_scalar_head_shares_the_trunk():
    m = tiny()
    m_rm = GPT(GPTConfig(**{**m.config.__dict__, "head": "scalar"})).eval()
    m_rm.model.load_state_dict(m.model.state_dict())
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        v = m_rm(x)
        h = m.hidden_states(x)
    assert v.shape == (2, 9)
    torch.testing.assert_close(v, (h @ m_rm.score.weight.T).squeeze(-1))


def test_sequence_longer_than_context_is_a_clear_error():
    m = tiny()
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 65, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# Equality with the reference implementation (transformers builds the random models; nothing downloaded)

transformers = pytest.importorskip("transformers")

HF_CASES = [
    ("qwen3", dict(tie_word_embeddings=True, rope_theta=10000.0), None),
    ("qwen3", dict(tie_word_embeddings=False, rope_theta=1_000_000.0), None),
    ("llama", dict(tie_word_embeddings=False, rope_theta=500000.0),
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}),
    ("llama", dict(tie_word_embeddings=True, rope_theta=10000.0), None),
]


def hf_model(arch, kw, rope_scaling):
    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, **kw)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common)
        m = transformers.Qwen3ForCausalLM(cfg)
    else:
        if rope_scaling:
            common["rope_scaling"] = {**rope_scaling, "rope_theta": kw["rope_theta"]}
        cfg = transformers.LlamaConfig(**common)
        m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random norms too, so a missing or misplaced gain would show
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("arch,kw,rope_scaling", HF_CASES)
def test_logits_equal_transformers(tmp_path, arch, kw, rope_scaling):
    hf = hf_model(arch, kw, rope_scaling)
    hf.save_pretrained(tmp_path)
    ours = load_hf(str(tmp_path)).eval()
    assert ours.config.arch == arch and ours.config.tie_word_embeddings == kw["tie_word_embeddings"]
    x = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("head", ["lm", "scalar"])
def test_our_checkpoint_loads_in_transformers(tmp_path, head):
    m = tiny(head=head, vocab_size=101)
    if head == "scalar":
        torch.nn.init.normal_(m.score.weight)
    save_hf(m, str(tmp_path))
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    x = torch.randint(0, 101, (2, 10))
    with torch.no_grad():
        if head == "lm":
            assert cfg["architectures"] == ["Qwen3ForCausalLM"]
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            torch.testing.assert_close(hf(x).logits, m(x), atol=1e-5, rtol=0)
        else:
            assert cfg["architectures"] == ["Qwen3ForSequenceClassification"] and cfg["num_labels"] == 1
            hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
            # transformers pools the score at the last token (no pad id configured, so one row at a time)
            for row in x:
                torch.testing.assert_close(hf(row[None]).logits.squeeze(-1), m(row[None])[:, -1], atol=1e-5, rtol=0)
    again = load_hf(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(again(x), m(x))


def test_from_hf_errors_name_the_problem(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_hf(str(tmp_path))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    x, y = torch.randint(0, 97, (2, 20)), torch.randint(0, 97, (2, 20))
    d = torch.tensor([[0] * 8 + [1] * 12, [0] * 20])  # packed documents too
    grads = []
    for recompute in (False, True):
        m = tiny().train()
        m.grad_checkpointing = recompute
        loss = -m(x, y, doc_ids=d).sum()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=0, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


ROPE_IN_A_FRESH_PROCESS = """
import sys, torch
sys.path.insert(0, {repo!r})
torch.set_num_threads(2)
from model import GPT, GPTConfig, rope_inv_freq
config = GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=64, head_dim=32, intermediate_size=64,
                   max_seq_len=512)
with torch.device("meta"):  # as load_hf builds a model: the tables are then the process's first parallel work
    m = GPT(config)
m._init_rope("cpu")
angles = torch.outer(torch.arange(512, dtype=torch.float32), rope_inv_freq(config)).double()  # the model's, exact
print(float((m.rope_cos[:, :16].double() - angles.cos()).abs().max()),
      float((m.rope_signed_sin[:, 16:].double() - angles.sin()).abs().max()))
"""


@pytest.mark.slow
def test_rope_tables_are_precise_in_every_fresh_process():
    """The cos and sin tables, built in a fresh process on 2 threads as load_hf builds them, match float64 to
    float32 rounding. torch's float32 cos, in a process's first parallel call, could compute the new worker
    thread's half of the table imprecisely (errors ~1.5e-4 at positions 256-511, in one fresh process in four to
    twelve here), so the same command trained differently from one run to the next. Sixteen fresh processes,
    one after the other: the old code got through all sixteen about one time in ten."""
    import subprocess
    import sys
    code = ROPE_IN_A_FRESH_PROCESS.format(repo=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for _ in range(16):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
        cos_err, sin_err = map(float, out.split())
        assert cos_err < 1e-6 and sin_err < 1e-6, f"rope table off by {cos_err:.2e} (cos), {sin_err:.2e} (sin)"
