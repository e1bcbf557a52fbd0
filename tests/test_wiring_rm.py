"""chat_rm.py's flags reach the loss they name. Each case is a real run of main (tests/inprocess.py: two steps, a
tiny model, the command line parsed by the stage's parser, a pair or two per forward pass) with one flag changed
from the base command; spies record each pass's scores, its LM log-probs and the loss it backpropagates, and the
test recomputes that loss from the definitions: Bradley-Terry -log sigmoid(r_c - r_r) plus --center-coef x
(r_c + r_r)^2, a mean over the step's pairs, plus --lm-coef x the chosen answers' NLL divided by the graded
tokens of the whole step (every pass); and --kinds is the mix of pairs it trains on."""
import math

import pytest
import torch
import torch.nn.functional as F

import chat_rm
from checkpoint import save_hf
from inprocess import run_stage, spy
from model import GPT, GPTConfig
from packing import IGNORE

BASE = ["--num-train", "16", "--num-val", "4", "--steps", "2", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps",
        "0", "--eval-every", "100", "--save-every", "100", "--micro-batch-tokens", "400"]


@pytest.fixture(scope="module")
def chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("rm_wiring")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


@pytest.mark.parametrize("flags", [[], ["--center-coef", "0.5"], ["--center-coef", "0"], ["--lm-coef", "0"],
                                   ["--lm-coef", "0.5"], ["--kinds", "rambling=2,wrong_step=1"]],
                         ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_each_flag_reaches_the_loss(monkeypatch, tmp_path, chat, flags):
    argv = ["--init", chat, *BASE, *flags]
    args = chat_rm.parser.parse_args(argv)
    events = []
    packed = spy(monkeypatch, chat_rm, "pack_sequences", before=lambda *a, **k: events.append("pass"))
    bt = spy(monkeypatch, chat_rm, "reward_loss")
    lm = spy(monkeypatch, chat_rm, "lm_regularizer")
    backed = spy(monkeypatch, chat_rm, "check_finite")
    spy(monkeypatch, chat_rm, "optimizer_step", before=lambda *a, **k: events.append("step"))
    drawn = spy(monkeypatch, chat_rm, "preference_pairs")
    run_stage(monkeypatch, tmp_path, chat_rm, *argv)
    # --kinds: the training mix, each kind repeated by its weight; --num-train pairs of it
    mix = tuple(k for part in args.kinds.split(",") for k in [part.split("=")[0]] * int(part.split("=")[1]))
    assert drawn[0].args == ("train", args.num_train) and drawn[0].kwargs["kinds"] == mix

    passes_per_step = [len(s) for s in "".join("p" if e == "pass" else "|" for e in events).split("|")[:-1]]
    assert len(passes_per_step) == 2 and all(n > 1 for n in passes_per_step)  # the step spans several passes
    assert len(lm) == (len(packed) if args.lm_coef else 0)
    first = 0
    for n_passes in passes_per_step:
        step = range(first, first + n_passes)
        first += n_passes
        graded = sum(int((packed[p].out[2] != IGNORE).sum()) for p in step)  # the chosen answers' graded tokens
        for p in step:
            chosen, rejected = bt[p].args
            n = chosen.numel()
            want = -F.logsigmoid(chosen - rejected).mean() + args.center_coef * ((chosen + rejected) ** 2).mean()
            torch.testing.assert_close(bt[p].out, want)
            loss = want * n / args.batch_size
            if args.lm_coef:
                target_logprobs, n_tokens = lm[p].args
                assert n_tokens == graded
                loss = loss - args.lm_coef * target_logprobs.sum() / graded
            torch.testing.assert_close(backed[p].args[0], loss)
    chosen, rejected = bt[-1].args
    assert (chosen + rejected).abs().min() > 1e-4  # step 2: the scores are no longer all 0, centering acts


def test_the_lm_normalizer_counts_the_graded_tokens_of_every_rank(monkeypatch, tmp_path, chat):
    """Run as rank 0 of 2 (start_run's DistInfo says so; no process group, so rank 0 trains its half of each
    step alone): the LM loss's denominator is still the step's graded tokens over both ranks' pairs, more than
    this rank's own. Counted on this rank only, two ranks would weigh the LM term twice as much as one."""
    from common import DistInfo
    real = chat_rm.start_run
    monkeypatch.setattr(chat_rm, "start_run", lambda *a, **k: (DistInfo(0, 2), real(*a, **k)[1]))
    packed = spy(monkeypatch, chat_rm, "pack_sequences")
    lm = spy(monkeypatch, chat_rm, "lm_regularizer")
    run_stage(monkeypatch, tmp_path, chat_rm, "--init", chat, *BASE, "--steps", "1", "--batch-size", "8")
    graded_here = sum(int((p.out[2] != IGNORE).sum()) for p in packed)  # this rank's share of the step
    assert lm and all(call.args[1] > graded_here for call in lm)
    assert all(call.args[1] == lm[0].args[1] for call in lm)  # one denominator for the whole step


def test_a_margin_column_reaches_the_loss(monkeypatch, tmp_path, chat, tok):
    """Graded preferences: each --data row's `margin` is the gap its pair's Bradley-Terry loss asks for,
    -log sigmoid(r_c - r_r - margin). At step 1 the fresh score head scores every answer 0, so each pass's loss
    is the mean of softplus(margin) over its pairs, a number by hand: margin 0 -> log 2 = 0.6931, 1.5 -> 1.7014.
    Every row's margin is used once in the epoch's two steps of 4 pairs."""
    import json

    from tasks import preference_pairs
    margins = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    fits = [r for r in preference_pairs("train", 32, seed=0) if chat_rm.render_pairs(tok, [r], 512)[0]]
    rows = [{**r, "margin": m} for r, m in zip(fits, margins)]
    data = tmp_path / "graded.jsonl"
    data.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected", "margin")}) + "\n"
                            for r in rows))
    bt = spy(monkeypatch, chat_rm, "reward_loss")
    argv = ["--init", chat, *BASE, "--data", str(data), "--eval-data", str(data), "--lm-coef", "0", "--center-coef",
            "0", "--lr", "1e-3"]
    run_stage(monkeypatch, tmp_path, chat_rm, *argv)
    assert sorted(float(m) for call in bt for m in call.kwargs["margin"]) == margins  # each row's margin, once
    for call in bt:
        chosen, rejected = call.args
        torch.testing.assert_close(call.out, -F.logsigmoid(chosen - rejected - call.kwargs["margin"]).mean())
    first = [call for call in bt if not call.args[0].any()]  # step 1: the fresh head scores 0
    assert first and all(abs(c.out.item() - F.softplus(c.kwargs["margin"]).mean().item()) < 1e-6 for c in first)
    assert abs(F.softplus(torch.tensor(1.5)).item() - 1.7014) < 1e-4 and abs(math.log(2) - 0.6931) < 1e-4
