"""SFT: the worked twelve-token loss, the mask against the tokens it covers, packing, and the global normalizer."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from chat_sft import build_rows, render_examples, sft_loss
from packing import IGNORE, collate, make_batch, pack_bfd, sft_example
from model import GPT, GPTConfig
from tasks import sft_conversations
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_twelve_token_example():
    # five graded answer tokens at p = 0.40, 0.85, 0.92, 0.78, 0.96; seven prompt tokens whose mean
    # penalty is 0.7715. The model's log-probs are 0 where the target is not graded.
    graded = torch.tensor([0.40, 0.85, 0.92, 0.78, 0.96])
    prompt_penalty = torch.full((7,), 0.7715)
    answer_only = torch.cat([torch.zeros(7), torch.log(graded)])
    assert abs(sft_loss(answer_only, 5).item() - 0.2903) < 5e-5
    assert abs(sft_loss(answer_only, 5).item() - (-math.log(0.40 * 0.85 * 0.92 * 0.78 * 0.96) / 5)) < 1e-6
    everything = torch.cat([-prompt_penalty, torch.log(graded)])
    assert abs(sft_loss(everything, 12).item() - 0.5710) < 5e-5


def test_all_zero_mask_raises():
    with pytest.raises(ValueError, match="all zero"):
        sft_example([1, 2, 3], [0, 0, 0])


def tiny_model(tok, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                         intermediate_size=64, max_seq_len=1024))


def test_labels_are_exactly_the_assistant_tokens(tok):
    rows = sft_conversations("train", 40)
    for r in rows:
        ids, mask = tok.render_conversation(r["messages"], tools=r.get("tools"))
        x, y = sft_example(ids, mask)
        assert [t for t in y if t != IGNORE] == [ids[j] for j in range(1, len(ids)) if mask[j]]
        # the end-of-turn token is a label, so the model learns to stop (trl#5988)
        assert tok.eos_id in y


def test_prompt_gets_exactly_zero_gradient(tok):
    r = sft_conversations("train", 3)[2]
    ids, mask = tok.render_conversation(r["messages"], tools=r.get("tools"))
    x, y = sft_example(ids, mask)
    m = tiny_model(tok)
    logits = m(torch.tensor([x]))
    logits.retain_grad()
    per_tok = F.cross_entropy(logits[0], torch.tensor(y), ignore_index=IGNORE, reduction="none")
    sft_loss(-per_tok, sum(t != IGNORE for t in y)).backward()
    ignored = torch.tensor(y) == IGNORE
    assert ignored.any() and (~ignored).any()
    assert torch.all(logits.grad[0, ignored] == 0)
    assert torch.all(logits.grad[0, ~ignored].abs().sum(-1) > 0)


def test_pad_equal_to_eos_keeps_the_end_of_turn_label(tok):
    # trl#1623: with pad == eos, a collator that masks "pad" tokens masks the real end of turn too
    r = sft_conversations("train", 1)[0]
    ex = [sft_example(*tok.render_conversation(r["messages"]))]
    x, y, _ = collate(ex, [0], pad_id=tok.eos_id, length=len(ex[0][0]) + 5)
    true_end = len(ex[0][1]) - 2  # the label of <|im_end|> (the last label is the "\n" after it)
    assert y[true_end] == tok.eos_id
    assert y[-5:] == [IGNORE] * 5 and x[-5:] == [tok.eos_id] * 5


def test_packing_keeps_labels_positions_and_isolation(tok):
    rows = sft_conversations("train", 30)
    examples, counts = render_examples(tok, rows, seq_len=1024, overlong="drop")
    packed = build_rows(examples, 1024, "bfd")
    assert sorted(i for row in packed for i in row) == list(range(len(examples)))
    assert len(packed) < len(examples) / 2  # it really packs
    assert all(sum(len(examples[i][0]) for i in row) <= 1024 for row in packed)
    x, y, d = make_batch(examples, packed, tok.pad_id, 1024, "bfd", "cpu")
    # after packing, the labels are exactly the mask-1 labels of each conversation, in order (nanochat#570)
    for r, row in enumerate(packed):
        expect = [t for i in row for t in examples[i][1]]
        assert y[r, :len(expect)].tolist() == expect and torch.all(y[r, len(expect):] == IGNORE)
    # each conversation is a document of its own: its doc id is its index in the row, padding the row's count
    for r, row in enumerate(packed):
        want = [j for j, i in enumerate(row) for _ in examples[i][0]]
        assert d[r, :len(want)].tolist() == want and torch.all(d[r, len(want):] == len(row))
    # the packed loss equals the sum of per-conversation losses (verl#6475), token by token
    m = tiny_model(tok).eval()
    with torch.no_grad():
        lp = m(x, y, doc_ids=d)
        for r, row in enumerate(packed):
            col = 0
            for i in row:
                n = len(examples[i][0])
                alone_lp = m(torch.tensor([examples[i][0]]), torch.tensor([examples[i][1]]))[0]
                torch.testing.assert_close(lp[r, col:col + n], alone_lp, atol=1e-5, rtol=0)
                col += n
        packed_sum = -lp.sum()
        alone = sum(F.cross_entropy(m(torch.tensor([ex[0]]))[0], torch.tensor(ex[1]), ignore_index=IGNORE,
                                    reduction="sum") for ex in examples)
    torch.testing.assert_close(packed_sum, alone, rtol=1e-4, atol=1e-3)


def test_bfd_is_best_fit():
    rows = pack_bfd([6, 5, 4, 3, 2], capacity=10)
    # 6 -> row0 (4 left); 5 -> row1 (5 left); 4 -> row0 is the tightest fit (0 left); 3 -> row1; 2 -> row1
    assert rows == [[0, 2], [1, 3, 4]]


def test_overlong_is_dropped_or_cropped_and_counted(tok):
    rows = sft_conversations("train", 20)
    lens = [len(tok.render_conversation(r["messages"], tools=r.get("tools"))[0]) - 1 for r in rows]
    cap = sorted(lens)[len(lens) // 2]
    ex, counts = render_examples(tok, rows, cap, "drop")
    assert counts["dropped"] == sum(n > cap for n in lens) > 0 and len(ex) == counts["kept"]
    ex, counts = render_examples(tok, rows, cap, "crop")
    assert counts["cropped"] + counts["dropped_empty_after_crop"] == sum(n > cap for n in lens)
    assert all(len(x) <= cap for x, _ in ex)


def test_padded_and_packed_batches_give_the_same_gradient(tok):
    rows = sft_conversations("train", 12)
    examples, _ = render_examples(tok, rows, 512, "drop")
    grads = []
    for packing in ("bfd", "none"):
        m = tiny_model(tok)
        batch_rows = build_rows(examples, 512, packing)
        x, y, d = make_batch(examples, batch_rows, tok.pad_id, 512, packing, "cpu")
        n = (y != IGNORE).sum()
        sft_loss(m(x, y, doc_ids=d), n).backward()
        grads.append(m.model.layers[1].mlp.down_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Real runs of chat_sft.py: accumulation and 2 ranks equal one big batch; the empty batch is skipped

@pytest.fixture(scope="module")
def tiny_base(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_hf(tiny_model(tok), str(path), tok)
    return str(path)


def sft_run(home, base, *extra, nproc=1):
    args = [os.path.join(REPO, "chat_sft.py"), "--init", base, "--num-train", "64", "--num-val", "8",
            "--eval-problems", "0", "--steps", "3", "--batch-size", "8", "--save-every", "1000", *extra]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    with open(os.path.join(home, "sft", "default", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def final_weights(home):
    from safetensors.torch import load_file
    return load_file(os.path.join(home, "sft", "default", "checkpoints", "step_000003", "model.safetensors"))


def assert_same_training(one, other):
    assert len(one) == len(other) == 3
    for a, b in zip(one, other):
        assert a["trained_tokens"] == b["trained_tokens"]
        # the gradient norm too: AdamW would hide a gradient scaled by the number of micro-batches or ranks
        assert abs(a["loss"] - b["loss"]) < 1e-4 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-3


def test_accumulation_equals_one_big_batch(tmp_path, tiny_base):
    """4 micro-batches of 2 rows train what one batch of 8 trains: each is divided by the step's token count."""
    one = sft_run(tmp_path / "one", tiny_base, "--device-batch-size", "8")
    assert_same_training(one, sft_run(tmp_path / "accum", tiny_base, "--device-batch-size", "2"))
    want, got = final_weights(tmp_path / "one"), final_weights(tmp_path / "accum")
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4)


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
def test_ddp_and_fsdp_equal_one_big_batch(tmp_path, tiny_base):
    one = sft_run(tmp_path / "one", tiny_base, "--device-batch-size", "8")
    ddp = sft_run(tmp_path / "ddp", tiny_base, "--device-batch-size", "2", nproc=2)
    fsdp = sft_run(tmp_path / "fsdp", tiny_base, "--device-batch-size", "2", "--fsdp", nproc=2)
    for other in (ddp, fsdp):
        assert_same_training(one, other)
    want = final_weights(tmp_path / "one")
    for name in ("ddp", "fsdp"):
        got = final_weights(tmp_path / name)  # the FSDP2 folder is gathered tensor by tensor from the shards
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_grad_checkpointing_gives_the_plain_runs_losses_and_gradients(tmp_path, tiny_base):
    """--grad-checkpointing recomputes each block's activations in backward: the same numbers, less memory."""
    plain = sft_run(tmp_path / "plain", tiny_base)
    recomputed = sft_run(tmp_path / "recomputed", tiny_base, "--grad-checkpointing")
    assert len(plain) == len(recomputed) == 3
    for a, b in zip(plain, recomputed):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, (a, b)


def test_eval_data_is_the_validation_set(tmp_path, tiny_base, tok):
    """--data with --eval-data FILE: the reported validation loss is the final model's mean loss over exactly the
    assistant tokens of that file's conversations, recomputed here one conversation at a time with a plain forward."""
    import json
    train, val = sft_conversations("train", 64), sft_conversations("val", 6)
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft_run(tmp_path, tiny_base, "--data", str(tmp_path / "train.jsonl"), "--eval-data", str(tmp_path / "val.jsonl"))
    with open(tmp_path / "sft" / "default" / "eval.json") as f:
        reported = json.load(f)["val_loss"]
    model = load_hf(str(tmp_path / "sft" / "default" / "checkpoints" / "step_000003")).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in val:
            ids, mask = tok.render_conversation(r["messages"], tools=r.get("tools"))
            log_p = model(torch.tensor([ids[:-1]]))[0].float().log_softmax(-1)
            for i in range(len(ids) - 1):
                if mask[i + 1]:  # the assistant's tokens, as targets
                    total -= log_p[i, ids[i + 1]].item()
                    count += 1
    assert abs(reported - total / count) < 1e-4, (reported, total / count)
