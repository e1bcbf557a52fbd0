"""Reward model: the Bradley-Terry table (pairs A-D), shift invariance, and a score that depends only on its sequence."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from chat_rm import attach_vocab_head, lm_regularizer, parse_kinds, render_pairs, reward_loss, rm_example
from rewards import last_token_values, load_reward_model, score
from packing import IGNORE, pack_sequences
from model import GPT, GPTConfig
from tasks import PREFERENCE_KINDS, preference_pairs
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# four pairs: (r_chosen, r_rejected) and each pair's -log sigmoid(margin)
SEED_PAIRS = {"A": (2.10, 0.40, 0.1678), "B": (1.25, 0.90, 0.5334), "C": (0.80, -0.60, 0.2204), "D": (1.40, 0.55, 0.3559)}


def test_bradley_terry_worked_table():
    rc = torch.tensor([v[0] for v in SEED_PAIRS.values()])
    rr = torch.tensor([v[1] for v in SEED_PAIRS.values()])
    for k, (c, r, expect) in SEED_PAIRS.items():
        assert abs(reward_loss(torch.tensor([c]), torch.tensor([r])).item() - expect) < 5e-5, k
    total = 4 * reward_loss(rc, rr).item()  # the table sums; the loss is the mean
    assert abs(total - 1.2775) < 5e-4
    rc_d, rr_d = rc.clone(), rr.clone()
    rc_d[3], rr_d[3] = rr[3], rc[3]  # pair D scored backwards
    assert abs(reward_loss(rc_d[3:], rr_d[3:]).item() - 1.2059) < 5e-5
    backwards = 4 * reward_loss(rc_d, rr_d).item()
    assert abs(backwards - 2.1275) < 5e-4
    assert abs((backwards - total) - 0.85) < 1e-5  # exactly the margin it got wrong


def test_only_the_gap_matters_and_centering_pins_the_mean():
    rc, rr = torch.randn(16), torch.randn(16)
    base = reward_loss(rc, rr)
    for shift in (10.0, -3.5):
        torch.testing.assert_close(reward_loss(rc + shift, rr + shift), base)
    # the centering term is what sees a shift: it grows with it
    assert reward_loss(rc + 10, rr + 10, center_coef=0.01) > reward_loss(rc, rr, center_coef=0.01) > base
    # a margin asks for a bigger gap: same as shifting the chosen score down by it
    torch.testing.assert_close(reward_loss(rc, rr, margin=torch.full((16,), 0.5)), reward_loss(rc - 0.5, rr))


def tiny_rm(tok, seed=0):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                      intermediate_size=64, max_seq_len=1024, head="scalar"))
    torch.nn.init.normal_(m.score.weight, std=1.0)  # a non-zero head, so scores differ
    return m.eval()


def test_score_is_read_at_the_answers_end_of_turn(tok):
    r = preference_pairs("train", 1)[0]
    seq = rm_example(tok, r["prompt"], r["chosen"])[0]
    assert seq[-1] == tok.eos_id
    # the engine's view: the prompt to complete + the sampled answer ending in <|im_end|>
    prompt = tok.render_for_completion(r["prompt"])
    assert seq == prompt + tok.encode(r["chosen"][0]["content"]) + [tok.eos_id]


def test_score_ignores_padding_side_batch_size_and_batch_mates(tok):
    rows = preference_pairs("train", 9)
    pairs, _ = render_pairs(tok, rows, 1024)
    seqs = [s for c, j, *_ in pairs for s in (c, j)]
    m = tiny_rm(tok)
    alone = torch.tensor([score(m, [s])[0] for s in seqs])
    assert alone.std() > 1e-3  # the scores differ, so the comparison means something
    # the reference: the value head's output at the sequence's last token, its <|im_end|>, in a plain forward
    with torch.no_grad():
        at_end = torch.stack([m(torch.tensor([s]))[0, len(s) - 1] for s in seqs])
    assert all(s[-1] == tok.eos_id for s in seqs)
    torch.testing.assert_close(alone, at_end, rtol=1e-4, atol=1e-5)
    for layout in ("right", "left"):
        for bs in (3, 18):
            torch.testing.assert_close(torch.tensor(score(m, seqs, batch_size=bs, layout=layout)), alone,
                                       rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        packed = last_token_values(m, seqs, tok.pad_id, "packed", capacity=1024)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    # pad == eos must not move the read position (trl#2778)
    torch.testing.assert_close(torch.tensor(score(m, seqs[:4])), alone[:4], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(last_token_values(m, seqs[:4], tok.eos_id), alone[:4], rtol=1e-4, atol=1e-5)
    # other batch mates: the same sequence next to different ones scores the same
    torch.testing.assert_close(torch.tensor(score(m, [seqs[0]] + seqs[5:])[0]), alone[0], rtol=1e-4, atol=1e-5)


def test_overlong_pairs_are_dropped_and_counted(tok):
    rows = preference_pairs("train", 12)  # every third a rambling, three times as long
    pairs, dropped = render_pairs(tok, rows, 100)
    assert dropped > 0 and len(pairs) + dropped == 12
    assert all(max(len(c), len(j)) <= 100 for c, j, *_ in pairs)


def test_lm_regularizer_is_the_chat_models_loss_on_the_chosen_answers(tok, tmp_path):
    """At the start the RM trunk is the chat model's, so the regularizer on packed chosen answers must be
    that model's own mean next-token loss over exactly the answers' tokens (and <|im_end|>)."""
    rows = preference_pairs("train", 6)
    pairs, _ = render_pairs(tok, rows, 1024)
    for (c, _, _, targets, _), r in zip(pairs, rows):  # the graded targets are the answer and its end of turn
        graded = [t for t in targets if t != IGNORE]
        assert tok.decode(graded) == r["chosen"][0]["content"] + "<|im_end|>"
        assert all(t == IGNORE or t == c[i + 1] for i, t in enumerate(targets))
    for tie in (True, False):
        torch.manual_seed(0)
        lm = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                           intermediate_size=64, max_seq_len=1024, tie_word_embeddings=tie))
        save_hf(lm, str(tmp_path / str(tie)), tok)
        rm = load_hf(str(tmp_path / str(tie)), head="scalar")
        attach_vocab_head(rm, str(tmp_path / str(tie)))
        assert hasattr(rm, "frozen_lm_head") != tie  # tied: the embeddings, trained along; untied: a frozen copy
        if not tie:
            torch.testing.assert_close(rm.frozen_lm_head, lm.lm_head.weight)
        seqs = [p[0] for p in pairs] + [p[1] for p in pairs]  # rejected answers ride along, ungraded
        ids, docs, targets, _ = pack_sequences(seqs, tok.pad_id, "packed", 1024, [p[3] for p in pairs] + [None] * 6)
        n = int((targets != IGNORE).sum())
        with torch.no_grad():
            _, target_logprobs = rm(ids, targets, doc_ids=docs)
            got = lm_regularizer(target_logprobs, n)
            # the chat model's own summed next-token loss, from its full logits
            want = sum(F.cross_entropy(lm(torch.tensor([c]))[0], torch.tensor(t), ignore_index=IGNORE, reduction="sum")
                       for c, _, _, t, _ in pairs) / n
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kinds_weight_the_training_mix():
    assert parse_kinds("wrong_step=2,rambling=1") == ("wrong_step", "wrong_step", "rambling")
    rows = preference_pairs("train", 30, kinds=parse_kinds("wrong_step=4,missing_answer=1,rambling=1"))
    assert [r["kind"] for r in rows].count("wrong_step") == 20
    with pytest.raises(ValueError, match="kind=weight"):
        parse_kinds("wrong_step")
    with pytest.raises(ValueError, match="must be among"):
        preference_pairs("train", 3, kinds=("typo",))
    assert set(PREFERENCE_KINDS) == {"wrong_step", "missing_answer", "rambling"}


# ------------------------------------------------------------------------------------------------
# Real runs of chat_rm.py: 2 ranks with accumulation equal one big batch; the saved RM loads and scores

@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def rm_run(home, init, *extra, nproc=1):
    args = [os.path.join(REPO, "chat_rm.py"), "--init", init, "--num-train", "48", "--num-val", "12",
            "--steps", "3", "--batch-size", "8", "--eval-every", "1000", "--lr", "1e-2", *extra]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(home, "rm", "default", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


@pytest.mark.slow
def test_ddp_and_accumulation_equal_one_big_batch_and_the_rm_loads(tmp_path, tiny_chat):
    one = rm_run(tmp_path / "one", tiny_chat, "--micro-batch-tokens", "100000", "--lm-coef", "0.5")
    ddp = rm_run(tmp_path / "ddp", tiny_chat, "--micro-batch-tokens", "250", "--lm-coef", "0.5", nproc=2)  # micro-batches of ~1 pair
    assert len(one) == len(ddp) == 3 and abs(one[0]["reward_loss"] - math.log(2)) < 1e-5  # zero head: scores 0
    assert one[0]["lm_loss"] > 0 and abs(one[0]["loss"] - one[0]["reward_loss"] - 0.5 * one[0]["lm_loss"]) < 1e-5
    for a, b in zip(one, ddp):  # the LM regularizer's token mean included
        for k in ("loss", "reward_loss", "lm_loss"):
            assert abs(a[k] - b[k]) < 1e-5, k
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
    with open(tmp_path / "one" / "rm" / "default" / "eval.json") as f:
        assert {"pair_accuracy", "margin", "reward_mean", "reward_min", "reward_max"} <= set(json.load(f))
    model = load_reward_model(str(tmp_path / "one" / "rm" / "default"))
    assert model.config.head == "scalar" and len(score(model, [[1, 2, 3], [4, 5]])) == 2
    with pytest.raises(ValueError, match="not a reward model"):
        load_reward_model(tiny_chat)


def test_the_last_steps_evaluation_is_the_one_written_and_a_finished_run_resumes(tmp_path, tiny_chat):
    """eval.json is the loop's evaluation at the last step (not a second pass); resuming a finished run trains
    nothing and evaluates the saved model once, to the same numbers."""
    rows = rm_run(tmp_path, tiny_chat)
    with open(tmp_path / "rm" / "default" / "eval.json") as f:
        first = json.load(f)
    assert rows[-1]["step"] == 3 and rows[-1]["val/pair_accuracy"] == round(first["pair_accuracy"], 4)
    rm_run(tmp_path, tiny_chat, "--resume")
    with open(tmp_path / "rm" / "default" / "eval.json") as f:
        assert json.load(f) == first
