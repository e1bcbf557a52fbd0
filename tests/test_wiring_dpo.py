"""chat_dpo.py's and chat_kto.py's flags reach the loss they name. Each case is a real run of main
(tests/inprocess.py: two steps, a tiny model, the command line parsed by the stage's parser) with one flag changed
from the base command; a spy on the micro-batch loss computes, before each call, the loss from the definitions:
every completion's summed log-prob by a plain forward of the policy as it is at that moment and of the starting
model (the reference), then the paper's formula for --loss with --beta, --label-smoothing and --rpo-alpha (KTO:
the reference point from the mismatched partners, --desirable-weight and --undesirable-weight). Step 2 is the
one that tells the settings apart: at step 1 the policy is the reference and every margin is 0."""
import math

import pytest
import torch
import torch.nn.functional as F

import chat_dpo
import chat_kto
from checkpoint import save_hf
from inprocess import loaded, run_stage, spy
from model import GPT, GPTConfig
from packing import IGNORE
from tasks import preference_pairs

BASE = ["--num-train", "8", "--num-val", "2", "--eval-problems", "0", "--steps", "2", "--batch-size", "2",
        "--max-len", "256", "--lr", "1e-2", "--warmup-steps", "0", "--micro-batch-tokens", "100000", "--save-every", "100"]


@pytest.fixture(scope="module")
def chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("dpo_wiring")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def summed_logp(model, example):
    """log p of an example's graded targets, summed, from one plain forward of that example alone; and their count."""
    x, y = example
    with torch.no_grad():
        lp = model(torch.tensor([x])).float().log_softmax(-1)[0]
    graded = [(t, tgt) for t, tgt in enumerate(y) if tgt != IGNORE]
    return sum(float(lp[t, tgt]) for t, tgt in graded), len(graded)


def pair_loss(args, pc, pr, rc, rr, nc, nr):
    """One pair's loss by --loss, from the policy's and the reference's summed log-probs of the chosen and the
    rejected answer (and their token counts)."""
    b, eps = args.beta, args.label_smoothing
    ls = lambda v: F.logsigmoid(torch.tensor(v)).item()  # noqa: E731
    m = (pc - rc) - (pr - rr)
    norm_m = (pc - rc) / nc - (pr - rr) / nr
    if args.loss == "sigmoid":
        return -(1 - eps) * ls(b * m) - eps * ls(-b * m)
    if args.loss == "robust":
        return (-(1 - eps) * ls(b * m) + eps * ls(-b * m)) / (1 - 2 * eps)
    if args.loss == "hinge":
        return max(0.0, 1 - b * m)
    if args.loss == "ipo":
        return (norm_m - 1 / (2 * b)) ** 2
    if args.loss == "sigmoid_norm":
        return -ls(b * norm_m)
    log_odds = lambda avg: avg - math.log(-math.expm1(avg))  # noqa: E731  (orpo)
    return -b * ls(log_odds(pc / nc) - log_odds(pr / nr))


def dpo_case(monkeypatch, home, chat, *flags):
    argv = ["--init", chat, *BASE, *flags]
    args = chat_dpo.parser.parse_args(argv)
    start = loaded(chat)

    def expected(model, pairs, *rest, pairs_per_step, chosen_tokens_per_step, **kw):
        total, chosen_sum, chosen_tokens = 0.0, 0.0, 0
        for chosen, rejected, _ in pairs:
            (pc, nc), (pr, nr) = summed_logp(model, chosen), summed_logp(model, rejected)
            (rc, _), (rr, _) = summed_logp(start, chosen), summed_logp(start, rejected)
            total += pair_loss(args, pc, pr, rc, rr, nc, nr)
            chosen_sum, chosen_tokens = chosen_sum + pc, chosen_tokens + nc
        assert chosen_tokens_per_step == chosen_tokens and pairs_per_step == args.batch_size  # one pass per step
        nll_weight = 1.0 if args.loss == "orpo" else args.rpo_alpha
        return total / args.batch_size - nll_weight * chosen_sum / chosen_tokens

    name = "orpo_micro_loss" if args.loss == "orpo" else "dpo_micro_loss"
    calls = spy(monkeypatch, chat_dpo, name, before=expected)
    run_stage(monkeypatch, home, chat_dpo, *argv)
    return calls


@pytest.mark.parametrize("flags", [
    [], ["--beta", "0.5"], ["--label-smoothing", "0.2"], ["--loss", "robust", "--label-smoothing", "0.2"],
    ["--loss", "hinge"], ["--loss", "ipo"], ["--loss", "sigmoid_norm"], ["--loss", "orpo"], ["--rpo-alpha", "0.5"],
    ["--ref", "live"],
], ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_dpo_flags_reach_the_loss(monkeypatch, tmp_path, chat, flags):
    calls = dpo_case(monkeypatch, tmp_path, chat, *flags)
    assert len(calls) == 2
    for call in calls:
        assert call.out[0].item() == pytest.approx(call.seen, rel=1e-4, abs=1e-5)


SHIFT = torch.tensor([0.5, 2.0])  # KTO's reference log-probs, lowered: of each answer by 0.5, of its partner by 2


def kto_case(monkeypatch, home, chat, *flags, shift=SHIFT):
    """A KTO run whose reference log-probs sit below the starting policy's (by SHIFT), precomputed or live: the
    reference point (the partners' mean log-ratio, at least 0) is then about 2 rather than clamped at 0, and
    the answers' log-ratios are not 0 at step 1. Seed 3: good and bad answers in step 2's batch of 4."""
    argv = ["--init", chat, *BASE, "--seed", "3", "--lr", "1e-4", "--batch-size", "4", "--num-train", "16", *flags]
    args = chat_kto.parser.parse_args(argv)
    start = loaded(chat)
    real = chat_kto.reference_of
    monkeypatch.setattr(chat_kto, "reference_of", lambda *a, **k: real(*a, **k) - shift)

    def expected(model, answers, ref, *, answers_per_step, kl, **kw):
        # the reference point: the mean log-ratio of the mismatched partners over the step's answers, at least 0
        partners = [summed_logp(model, partner)[0] - (summed_logp(start, partner)[0] - shift[1].item())
                    for _, partner, _ in answers]
        want_kl = max(0.0, sum(partners) / args.batch_size)
        total = 0.0
        for answer, _, good in answers:
            r = summed_logp(model, answer)[0] - (summed_logp(start, answer)[0] - shift[0].item())
            sig = 1 / (1 + math.exp(-args.beta * ((r - want_kl) if good else (want_kl - r))))
            total += (args.desirable_weight if good else args.undesirable_weight) * (1 - sig)
        assert answers_per_step == args.batch_size == len(answers)  # one pass per step
        return want_kl, total / args.batch_size

    calls = spy(monkeypatch, chat_kto, "kto_micro_loss", before=expected)
    run_stage(monkeypatch, home, chat_kto, *argv)
    return calls


@pytest.mark.parametrize("flags", [[], ["--beta", "0.5"], ["--desirable-weight", "2"], ["--undesirable-weight", "0.5"],
                                   ["--ref", "live"]],
                         ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_kto_flags_reach_the_loss_and_the_reference_point(monkeypatch, tmp_path, chat, flags):
    calls = kto_case(monkeypatch, tmp_path, chat, *flags)
    assert len(calls) == 2 and all(call.kwargs["kl"] > 1 for call in calls)
    for call in calls:
        want_kl, want_loss = call.seen
        assert call.kwargs["kl"] == pytest.approx(want_kl, rel=1e-4, abs=1e-6)
        assert call.out[0].item() == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    goods = [g for _, _, g in calls[1].args[1]]
    assert any(goods) and not all(goods)  # both labels in the step the weights are checked on


def test_kto_reference_point_is_clamped_at_zero_where_it_binds(monkeypatch, tmp_path, chat):
    """The partners' reference log-probs 2 above the policy's: their mean log-ratio is about -2, and the
    reference point is 0, not -2 (the KTO paper and TRL clamp it; unclamped it ran to -17.6 in 12 steps)."""
    calls = kto_case(monkeypatch, tmp_path, chat, shift=torch.tensor([0.5, -2.0]))
    assert len(calls) == 2 and all(call.kwargs["kl"] == 0.0 for call in calls)
    for call in calls:
        want_kl, want_loss = call.seen
        assert want_kl == 0.0 and call.out[0].item() == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    assert chat_kto.reference_point(0.8, 8) == pytest.approx(0.1) and chat_kto.reference_point(-3.2, 8) == 0.0


PAIRS_FLAGS = [[], ["--samples", "3"], ["--temperature", "0.7"], ["--max-new-tokens", "9"], ["--num-train", "12"],
               ["--seed", "2"], ["--tools"],
               ["--pairs", "judge", "--judge", "standin:arithmetic", "--rubric", "rubrics/arithmetic.txt"]]


@pytest.mark.parametrize("stage, flags", [("dpo", f) for f in PAIRS_FLAGS] + [("kto", f) for f in PAIRS_FLAGS[:3]],
                         ids=lambda v: v if isinstance(v, str) else "_".join(x.lstrip("-") for x in v) or "defaults")
def test_pairs_on_policy_samples_with_the_flags_and_trains_on_what_it_sampled(monkeypatch, tmp_path, chat, stage,
                                                                              flags):
    """--pairs on-policy: the pairs are sampled from the starting policy, --num-train prompts x --samples answers
    at --temperature and --max-new-tokens (the sampler stands in here: a tiny random model answers nothing right),
    and what it returns is what trains; --pairs judge hands the sampler its --judge and --rubric."""
    module = chat_dpo if stage == "dpo" else chat_kto
    sampled = []

    def fake_sampled_pairs(model, tok, **kw):
        sampled.append(kw)
        return preference_pairs("train", 6, seed=11)
    monkeypatch.setattr(module, "sampled_pairs", fake_sampled_pairs)
    rendered = spy(monkeypatch, module, "pair_items" if stage == "dpo" else "kto_items")
    argv = ["--init", chat, *BASE, "--steps", "1", "--pairs", "on-policy", *flags]
    run_stage(monkeypatch, tmp_path, module, *argv)
    args = module.parser.parse_args(argv)
    assert sampled == [dict(num_prompts=args.num_train, samples=args.samples, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, tools=args.tools, judge=args.judge,
                            rubric=args.rubric)]
    assert (args.judge is not None) == (args.pairs == "judge")
    rows = rendered[0].args[1]
    pairs = preference_pairs("train", 6, seed=11)
    if stage == "dpo":
        assert rows == pairs
    else:  # KTO: each pair's two answers, labeled
        assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == \
            [(p["prompt"], p[side], side == "chosen") for p in pairs for side in ("chosen", "rejected")]
