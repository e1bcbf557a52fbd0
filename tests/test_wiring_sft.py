"""chat_sft.py's and base_train.py's flags reach what they name, and common.py's optimizer does what the flags
say. Each case is a real run of main (tests/inprocess.py: a tiny model, the command line parsed by the stage's
parser) with one flag changed from the base command; spies record what the loop built, and the test checks it
against the definitions: AdamW decays the matrices by --weight-decay and nothing else, the gradient is clipped to
--grad-clip, --overlong crop keeps the long conversations cut to --seq-len, --packing none gives each conversation
a padded row of its own, --epochs sets the number of steps, the --lora-* flags shape the adapters; base_train
builds the model its flags describe."""
import copy
import math

import pytest
import torch

import base_train
import chat_sft
from checkpoint import load_hf, save_hf
from common import optimizer_step
from inprocess import run_stage, spy
from lora import LORA_TARGETS, LoRALinear
from model import GPT, GPTConfig

BASE = ["--num-train", "24", "--num-val", "4", "--eval-problems", "0", "--steps", "2", "--batch-size", "4",
        "--device-batch-size", "2", "--seq-len", "200", "--save-every", "100", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_wiring")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def assert_decays_only_matrices(optimizer, model, weight_decay):
    """AdamW's weight decay: --weight-decay on every matrix, 0 on the vectors (the norms' gains)."""
    group_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(group_of) == len(trained) and any(p.dim() < 2 for p in trained)
    for p in trained:
        assert group_of[id(p)] == (weight_decay if p.dim() >= 2 else 0.0)


@pytest.mark.parametrize("flags", [[], ["--weight-decay", "0.1"], ["--grad-clip", "0.5"], ["--overlong", "crop"],
                                   ["--packing", "none"], ["--steps", "0", "--epochs", "0.5"]],
                         ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_sft_flags_reach_the_optimizer_and_the_data(monkeypatch, tmp_path, chat, tok, flags):
    argv = ["--init", chat, *BASE, *flags]
    args = chat_sft.parser.parse_args(argv)
    opt = spy(monkeypatch, chat_sft, "make_optimizer")
    steps = spy(monkeypatch, chat_sft, "optimizer_step")
    rendered = spy(monkeypatch, chat_sft, "render_examples")
    batches = spy(monkeypatch, chat_sft, "make_batch")
    packed = spy(monkeypatch, chat_sft, "build_rows")
    rows = [r for r in run_stage(monkeypatch, tmp_path, chat_sft, *argv) if "loss" in r]
    assert_decays_only_matrices(opt[0].out, opt[0].args[0], args.weight_decay)
    assert all(c.args[2] == args.grad_clip for c in steps)
    # --num-train and --num-val embedded conversations; --overlong: a training conversation longer than --seq-len is
    # dropped, or cropped to it and kept
    conversations = rendered[0].args[1]
    assert len(conversations) == args.num_train and len(rendered[1].args[1]) == args.num_val
    lengths = [len(tok.render_conversation(c["messages"], tools=c.get("tools"))[0]) - 1 for c in conversations]
    long = sum(n > args.seq_len for n in lengths)
    examples, counts = rendered[0].out
    assert long > 0 and counts["kept"] == len(examples) and all(len(x) <= args.seq_len for x, _ in examples)
    if args.overlong == "crop":
        assert counts["dropped"] == 0 and counts["cropped"] + counts["dropped_empty_after_crop"] == long
    else:
        assert counts["dropped"] == long and counts["cropped"] == 0
    # --packing: bfd packs several conversations into rows of --seq-len; none pads one conversation per row
    for call in batches:
        assert call.args[4] == args.packing
        x, y, doc_ids = call.out
        if args.packing == "none":
            assert doc_ids is None and all(len(row) == 1 for row in call.args[1])
        else:
            assert x.size(1) == args.seq_len
    if args.packing == "bfd":
        assert any(len(row) > 1 for call in batches for row in call.args[1])
    # --epochs (with --steps 0): the steps of that many passes over the rows, --batch-size rows a step
    n_rows = len(packed[0].out)
    assert len(rows) == (args.steps or max(1, round(args.epochs * math.ceil(n_rows / args.batch_size))))


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_optimizer_step_clips_the_gradient_to_grad_clip(grad_clip):
    """The gradient is scaled to norm --grad-clip when its norm is larger (0: never), before the step."""
    w = torch.nn.Parameter(torch.zeros(2, 2))
    w.grad = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # norm 5
    model = torch.nn.Module()
    model.w = w
    norm = optimizer_step(model, torch.optim.SGD([w], lr=1.0), grad_clip)
    assert norm == pytest.approx(5.0)
    want = 5.0 if grad_clip == 0 else min(5.0, grad_clip)
    assert w.detach().norm().item() == pytest.approx(want) and w.grad is None


def test_base_train_builds_the_model_its_flags_describe(monkeypatch, tmp_path, tok):
    """base_train's flags: the model's shape (its config, field by field), the documents, the rows of --seq-len,
    AdamW's decay; and the loss of step 1 is each packed document's own, recomputed here one document at a time."""
    tok.save(tmp_path / "tok")
    argv = ["--tokenizer", str(tmp_path / "tok"), "--n-layer", "2", "--n-embd", "48", "--n-head", "4", "--n-kv-head",
            "2", "--max-seq-len", "256", "--num-docs", "60", "--seq-len", "256", "--batch-size", "4",
            "--device-batch-size", "4", "--steps", "1", "--eval-problems", "0", "--warmup-steps", "1"]
    args = base_train.parser.parse_args(argv)
    start = spy(monkeypatch, base_train, "make_optimizer", before=lambda model, *a: copy.deepcopy(model.state_dict()))
    docs = spy(monkeypatch, base_train, "documents")
    batches = spy(monkeypatch, base_train, "make_batch")
    rows = run_stage(monkeypatch, tmp_path / "home", base_train, *argv)
    c = load_hf(str(tmp_path / "home" / "base" / "default" / "checkpoints" / "step_000001")).config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.max_seq_len) == (2, 48, 4, 2, 256)
    assert c.head_dim == 48 // 4 and c.intermediate_size == 4 * 48 and c.vocab_size == tok.vocab_size
    assert_decays_only_matrices(start[0].out, start[0].args[0], args.weight_decay)  # 0.1 by default
    assert docs[0].args[2] == args.num_docs and len(docs[0].out) <= args.num_docs
    assert all(len(x) <= args.seq_len for x, _ in docs[0].out)
    assert all(call.out[0].shape == (args.device_batch_size, args.seq_len) for call in batches)
    # step 1's loss: every document of its rows alone (positions from 0, attending to nothing else), the mean
    # next-token loss over all their tokens, under the model as it started
    model = GPT(c)
    model.load_state_dict(start[0].seen)
    examples, step_rows = batches[0].args[:2]
    assert any(len(row) > 1 for row in step_rows)  # packed rows: documents side by side
    total, count = 0.0, 0
    with torch.no_grad():
        for i in (i for row in step_rows for i in row):
            x, y = examples[i]
            total -= model(torch.tensor([x]))[0].log_softmax(-1).gather(-1, torch.tensor(y)[:, None]).sum().item()
            count += len(y)
    assert rows[0]["loss"] == pytest.approx(total / count, abs=2e-5)


@pytest.mark.parametrize("flags", [[], ["--lora-alpha", "16"], ["--lora-dropout", "0.25"],
                                   ["--lora-targets", "q_proj,down_proj"]],
                         ids=lambda f: "_".join(x.lstrip("-") for x in f) or "rank-only")
def test_lora_flags_reach_the_adapters(monkeypatch, tmp_path, chat, flags):
    """--lora-rank r adapts every layer of --lora-targets with y = W x + (alpha / r) B A dropout(x): alpha
    --lora-alpha (2 r by default), dropout --lora-dropout; nothing else is trained."""
    argv = ["--init", chat, *BASE, "--steps", "1", "--lora-rank", "4", *flags]
    args = chat_sft.parser.parse_args(argv)
    loaded = spy(monkeypatch, chat_sft, "load_model")
    run_stage(monkeypatch, tmp_path, chat_sft, *argv)
    model = loaded[0].out
    targets = args.lora_targets.split(",")
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == set(targets) and set(targets) <= set(LORA_TARGETS)
    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_rank
    for m in model.modules():
        if isinstance(m, LoRALinear):
            assert m.scaling == alpha / 4 and m.lora_A.weight.shape[0] == 4
            assert (m.dropout.p if isinstance(m.dropout, torch.nn.Dropout) else 0.0) == args.lora_dropout
    assert all(("lora_" in name) == p.requires_grad for name, p in model.named_parameters())
