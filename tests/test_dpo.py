"""DPO and its variants: the beta table (margins +1.40, -0.20, -2.60), each loss at a hand-computed point, the reference, truncation,
log-prob sums under padding and packing, and real runs (2 ranks = 1 rank, live = precomputed reference)."""
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from chat_dpo import dpo_loss, dpo_micro_loss, orpo_loss, orpo_micro_loss
from chat_kto import kto_items, kto_loss, kto_micro_loss, pairs_of_singles
from evaluation import paired_change
from packing import IGNORE
from preferences import completion_example, completion_logps, on_policy_rows, pair_items, reference_logps
from model import GPT, GPTConfig
from data import kto_rows, load_kto
from tasks import CALCULATOR_SCHEMA, preference_pairs, rl_prompts
from checkpoint import save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = torch.tensor


def test_dpo_beta_worked_table():
    # (chosen log-ratio, rejected log-ratio) -> margin +1.40, -0.20, -2.60
    examples = [(0.80, -0.60), (-0.10, 0.10), (-1.20, 1.40)]
    table = {0.1: ([0.6256, 0.7032, 0.8316], [0.0465, 0.0505, 0.0565]),
             0.5: ([0.4032, 0.7444, 1.5410], [0.1659, 0.2625, 0.3929])}
    push = {}
    for beta, (losses, grads) in table.items():
        pc = T([c for c, _ in examples], requires_grad=True)
        out, rc, rr = dpo_loss(pc, T([r for _, r in examples]), torch.zeros(3), torch.zeros(3), beta=beta)
        torch.testing.assert_close(out, T(losses), atol=5e-5, rtol=0)
        out.sum().backward()  # d loss / d log pi(chosen) = d loss / d margin: the table's |gradient|
        torch.testing.assert_close(pc.grad.abs(), T(grads), atol=5e-5, rtol=0)
        torch.testing.assert_close(rc - rr, beta * T([1.4, -0.2, -2.6]))
        push[beta] = pc.grad.abs()
    # within a beta, the backwards pair is pushed 1.21x (0.1) or 2.37x (0.5) harder than the right one; the
    # backwards pair at 0.5 is pushed 8.45x harder than the right one at 0.1
    assert abs(push[0.1][2] / push[0.1][0] - 1.214) < 0.01 and abs(push[0.5][2] / push[0.5][0] - 2.368) < 0.01
    assert abs(push[0.5][2] / push[0.1][0] - 8.45) < 0.02


# one pair: policy log-probs -5 / -9, reference -6 / -7 -> log-ratios +1 / -2, margin 3; lengths 10 / 20
POINT = dict(policy_chosen_logps=T([-5.0]), policy_rejected_logps=T([-9.0]), ref_chosen_logps=T([-6.0]),
             ref_rejected_logps=T([-7.0]), chosen_lengths=T([10.0]), rejected_lengths=T([20.0]))


@pytest.mark.parametrize("loss_type, kwargs, expect", [
    ("sigmoid", {}, 0.554355),                         # -log sigmoid(0.3)
    ("sigmoid", {"label_smoothing": 0.1}, 0.584355),   # -0.9 log sigmoid(0.3) - 0.1 log sigmoid(-0.3)
    ("robust", {"label_smoothing": 0.1}, 0.516855),    # (-0.9 log sigmoid(0.3) + 0.1 log sigmoid(-0.3)) / 0.8
    ("hinge", {}, 0.7),                                # relu(1 - 0.3)
    ("hinge", {"beta": 0.5}, 0.0),                     # relu(1 - 1.5): past the margin, no push
    ("ipo", {}, 23.04),                                # (1/10 + 2/20 - 1/(2*0.1))^2 = (0.2 - 5)^2
    ("sigmoid_norm", {}, 0.683197),                    # -log sigmoid(0.1 * 0.2)
])
def test_each_loss_type_at_a_hand_computed_point(loss_type, kwargs, expect):
    losses, rc, rr = dpo_loss(**POINT, loss_type=loss_type, **{"beta": 0.1, **kwargs})
    assert abs(losses.item() - expect) < 1e-5
    assert abs(rc.item() - kwargs.get("beta", 0.1) * 1.0) < 1e-6 and abs(rr.item() + kwargs.get("beta", 0.1) * 2.0) < 1e-6


def test_orpo_and_kto_at_hand_computed_points():
    # mean token log-probs -0.5 and -1.0: log odds 0.43275 - (-0.54132) = 0.97408
    losses, _, _ = orpo_loss(T([-5.0]), T([-20.0]), T([10.0]), T([20.0]), beta=0.1)
    assert abs(losses.item() - 0.1 * math.log1p(math.exp(-0.974077))) < 1e-6 and abs(losses.item() - 0.032030) < 1e-5
    losses, rewards = kto_loss(T([-4.5, -4.5]), T([-5.0, -5.0]), T([True, False]), kl=0.1, beta=0.1)
    torch.testing.assert_close(losses, T([0.490001, 0.509999]), atol=1e-5, rtol=0)
    torch.testing.assert_close(rewards, T([0.05, 0.05]))
    losses, _ = kto_loss(T([-4.5]), T([-5.0]), T([False]), kl=0.1, undesirable_weight=2.0)
    assert abs(losses.item() - 2 * 0.509999) < 1e-5
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(T([-1.0]), T([-2.0]), T([-1.0]), T([-2.0]), loss_type="ipo")


def test_label_smoothing_zero_is_dpo_and_half_gives_zero_gradient():
    pc, pr = torch.randn(8, requires_grad=True), torch.randn(8)
    rc, rr = torch.randn(8), torch.randn(8)
    plain = dpo_loss(pc, pr, rc, rr)[0]
    for lt in ("sigmoid", "robust"):
        torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, loss_type=lt, label_smoothing=0.0)[0], plain)
    # trl#1655: at 0.5 the labels carry no information; from the start (policy = reference) nothing moves
    start = pc.detach().clone().requires_grad_(True)
    losses = dpo_loss(start, pr, start.detach(), pr, label_smoothing=0.5)[0]
    losses.sum().backward()
    assert torch.all(start.grad == 0)
    torch.testing.assert_close(losses, torch.full((8,), math.log(2)))
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, loss_type="robust", label_smoothing=0.5)


def test_changing_the_reference_changes_the_loss():
    # trl#1962: precomputed reference values silently ignored left the loss at log 2
    pc, pr = T([-5.0, -7.0]), T([-9.0, -6.0])
    a = dpo_loss(pc, pr, T([-6.0, -7.0]), T([-7.0, -7.0]))[0]
    b = dpo_loss(pc, pr, T([-4.0, -8.0]), T([-9.0, -5.0]))[0]
    assert (a - b).abs().min() > 0.05


# ------------------------------------------------------------------------------------------------
# Data and log-probs on a tiny model

def tiny_model(tok, seed=0, max_seq_len=1024):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                         intermediate_size=64, max_seq_len=max_seq_len))


def test_completion_targets_are_exactly_the_answer_tokens(tok):
    r = preference_pairs("train", 1)[0]
    x, y = completion_example(tok, r["prompt"], r["chosen"], None, 1024)
    prompt = tok.render_for_completion(r["prompt"])
    answer = tok.encode(r["chosen"][0]["content"]) + [tok.eos_id] + tok.encode("\n")
    assert x[:len(prompt)] == prompt
    # the first graded target is the answer's first token (OpenRLHF#973: an off-by-one drops it)
    assert [t for t in y if t != IGNORE] == answer and y[len(prompt) - 2] == IGNORE and y[len(prompt) - 1] == answer[0]


def test_a_multi_turn_prompts_earlier_assistant_turns_are_context_not_graded(tok):
    """A preference prompt that already holds an assistant turn (a follow-up question): only the completion is
    graded. The training render marks every assistant turn 1; the prompt's must be 0 here, or DPO compares the
    two answers plus a shared earlier turn, and KTO and the judge read it as part of the answer."""
    prompt = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "It is 7."},
              {"role": "user", "content": "And 7 + 5?"}]
    x, y = completion_example(tok, prompt, [{"role": "assistant", "content": "It is 12."}], None, 1024)
    graded = [t for t in y if t != IGNORE]
    assert graded == tok.encode("It is 12.") + [tok.eos_id] + tok.encode("\n")


def test_truncation_leaves_both_answers_non_empty_and_the_prompts_identical(tok):
    rows = preference_pairs("train", 6)
    prompt_lens = [len(tok.render_for_completion(r["prompt"])) for r in rows]
    cap = max(prompt_lens) + 3  # room for only a few answer tokens
    items, counts = pair_items(tok, rows, cap)
    assert items and len(items) + sum(counts.values()) == 6
    for (cx, cy), (jx, jy), _ in items:
        assert len(cx) <= cap and len(jx) <= cap  # the rejected answer does not escape the cap (LlamaFactory#4402)
        assert any(t != IGNORE for t in cy) and any(t != IGNORE for t in jy)  # never empty (trl#6548)
        p = cy.index(next(t for t in cy if t != IGNORE))
        assert cx[:p + 1] == jx[:p + 1] and all(t == IGNORE for t in jy[:p])
    # a prompt that leaves no room drops the pair, counted
    items, counts = pair_items(tok, rows, min(prompt_lens) - 5)
    assert not items and counts["dropped_prompt_too_long"] == 6


def test_padded_and_packed_logp_sums_equal_unpadded_sums(tok):
    items, _ = pair_items(tok, preference_pairs("train", 6), 1024)
    examples = [e for c, j, _ in items for e in (c, j)]
    m = tiny_model(tok).eval()
    with torch.no_grad():
        alone = torch.stack([m(T([x]), T([y]))[0].sum() for x, y in examples])
        for layout in ("right", "left", "packed"):
            sums, counts = completion_logps(m, examples, tok.pad_id, layout, capacity=1024)
            torch.testing.assert_close(sums, alone, rtol=1e-4, atol=1e-3)
            assert counts.tolist() == [sum(t != IGNORE for t in y) for _, y in examples]
    # gradients too: what the trainer uses
    grads = []
    for layout in ("right", "packed"):
        m.zero_grad()
        completion_logps(m, examples, tok.pad_id, layout, capacity=1024)[0].sum().backward()
        grads.append(m.model.layers[0].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_reference_logps_deterministic_shuffle_independent_and_rng_free(tok):
    items, _ = pair_items(tok, preference_pairs("train", 10), 1024)
    examples = [e for c, j, _ in items for e in (c, j)]
    m = tiny_model(tok).train()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    a = reference_logps(m, examples, tok.pad_id, 1024, batch_size=4)
    b = reference_logps(m, examples, tok.pad_id, 1024, batch_size=4)
    assert torch.equal(torch.get_rng_state(), rng) and m.training  # RNG untouched, mode restored
    assert torch.equal(a, b)
    perm = list(range(len(examples)))
    random.Random(0).shuffle(perm)
    shuffled = reference_logps(m, [examples[i] for i in perm], tok.pad_id, 1024, batch_size=4)
    torch.testing.assert_close(shuffled, a[perm], rtol=1e-4, atol=1e-3)


def test_kto_items_split_pairs_with_mismatched_partners(tok):
    rows = preference_pairs("train", 3)
    items, _ = kto_items(tok, [single for r in rows for single in kto_rows(r)], 1024)
    assert [g for _, _, g in items] == [True, False] * 3
    # the partner of answer i is its own prompt with answer i + 1
    x0, _ = items[0][1]
    expect, _ = completion_example(tok, rows[0]["prompt"], rows[0]["rejected"], None, 1024)
    assert x0 == expect


def test_on_policy_pairs_a_correct_with_an_incorrect_answer(tok, monkeypatch):
    prompts = rl_prompts("train", 3)
    answers = {0: [f"#### {int(prompts[0]['ground_truth']) + 1}", f"#### {prompts[0]['ground_truth']}"],  # wrong, right
               1: [f"#### {prompts[1]['ground_truth']}"] * 2,                                         # all right: skipped
               2: ["#### 0", f"#### {prompts[2]['ground_truth']}"]}
    from engine import Completion

    def fake_generate(self, prompt_ids, num_samples, **kw):
        return [Completion(i, tokens=(t := tok.encode(answers[i][j]) + [tok.eos_id]), mask=[1] * len(t),
                           finish_reason="stop") for i in range(len(prompt_ids)) for j in range(num_samples)]
    monkeypatch.setattr("engine.Engine.generate", fake_generate)
    rows = on_policy_rows(tiny_model(tok), tok, prompts, samples=2, temperature=1.0, max_new_tokens=8, seed=0)
    assert len(rows) == 2
    assert rows[0]["chosen"][0]["content"] == answers[0][1] and rows[0]["rejected"][0]["content"] == answers[0][0]
    assert rows[1]["prompt"] == prompts[2]["prompt"]


def test_on_policy_pairs_with_tools_are_sampled_and_trained_with_the_calculator_offered(tok, monkeypatch):
    """--pairs on-policy --tools: the engine samples from prompts that offer the calculator, and the pairs carry
    the schemas, so DPO trains on exactly the prompt the answers were sampled from."""
    prompts = rl_prompts("train", 1)
    seen = []
    from engine import Completion

    def fake_generate(self, prompt_ids, num_samples, **kw):
        seen.extend(prompt_ids)
        texts = [f"#### {prompts[0]['ground_truth']}", "#### 0"]
        return [Completion(0, tokens=(t := tok.encode(texts[j]) + [tok.eos_id]), mask=[1] * len(t),
                           finish_reason="stop") for j in range(num_samples)]
    monkeypatch.setattr("engine.Engine.generate", fake_generate)
    rows = on_policy_rows(tiny_model(tok), tok, prompts, samples=2, temperature=1.0, max_new_tokens=8, seed=0,
                          tools=True)
    assert seen == [tok.render_for_completion(prompts[0]["prompt"], tools=[CALCULATOR_SCHEMA])]
    assert len(rows) == 1 and rows[0]["tools"] == [CALCULATOR_SCHEMA]
    [(chosen, _, _)], _ = pair_items(tok, rows, 1024)
    assert chosen[0][:len(seen[0])] == seen[0]  # the training prompt is the sampling prompt


def summed_logps(m, examples):
    """Each example alone: log softmax of the full logits, summed over its graded targets, and their count
    (written here, not with completion_logps)."""
    sums, counts = [], []
    for x, y in examples:
        logp = torch.log_softmax(m(T([x]))[0].float(), -1)
        graded = [(t, tgt) for t, tgt in enumerate(y) if tgt != IGNORE]
        sums.append(torch.stack([logp[t, tgt] for t, tgt in graded]).sum())
        counts.append(float(len(graded)))
    return torch.stack(sums), T(counts)


def test_orpo_micro_loss_is_the_odds_ratio_term_plus_the_chosen_answers_nll(tok):
    items, _ = pair_items(tok, preference_pairs("train", 4), 1024)
    m = tiny_model(tok)
    chosen, n_c = summed_logps(m, [c for c, _, _ in items])
    rejected, n_r = summed_logps(m, [j for _, j, _ in items])
    log_odds = [(lp / n) - torch.log(1 - torch.exp(lp / n)) for lp, n in ((chosen, n_c), (rejected, n_r))]
    odds_term = -0.1 * torch.nn.functional.logsigmoid(log_odds[0] - log_odds[1]).mean()   # Hong et al. 2024, eq. 6
    nll = -chosen.sum() / n_c.sum()                                                        # SFT on the chosen answers
    loss, stats = orpo_micro_loss(m, items, pad_id=tok.pad_id, capacity=1024, pairs_per_step=len(items),
                                  chosen_tokens_per_step=float(n_c.sum()), beta=0.1)
    assert abs(loss.item() - (odds_term + nll).item()) < 1e-4 and nll.item() > 10 * odds_term.item()
    assert abs(stats["logps/chosen"] - chosen.sum().item()) < 1e-3


def test_kto_micro_loss_follows_each_answers_label(tok):
    rows = preference_pairs("train", 3)
    items, _ = kto_items(tok, [single for r in rows for single in kto_rows(r)], 1024)
    m = tiny_model(tok)
    logps, _ = summed_logps(m, [a for a, _, _ in items])
    ref = torch.stack([logps.detach() + T([0.8, -0.5, 0.3, -1.2, 0.6, 0.9]), torch.zeros(6)], 1)  # log-ratios -0.8 ...
    kl, beta = 0.2, 0.1
    ratio = logps - ref[:, 0]
    good = T([g for _, _, g in items])
    assert good.tolist() == [True, False] * 3
    want = torch.where(good, 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio)))
    loss, stats = kto_micro_loss(m, items, ref, pad_id=tok.pad_id, capacity=1024, answers_per_step=6, kl=kl, beta=beta,
                                 desirable_weight=1.0, undesirable_weight=1.0)
    assert abs(loss.item() - want.mean().item()) < 1e-5 and stats["good"] == 3 and stats["bad"] == 3
    assert abs(stats["rewards/chosen"] - beta * ratio[good].sum().item()) < 1e-4


@pytest.mark.parametrize("loss_type", ["sigmoid", "kto", "orpo"])
def test_a_few_steps_on_a_separable_toy_push_the_margin_the_right_way(tok, loss_type):
    """Two pairs, trained on alone for a few AdamW steps with the loop's micro-batch loss: every chosen
    (good) answer's log-ratio to the start must end above its rejected (bad) partner's."""
    from common import make_optimizer
    items, _ = pair_items(tok, preference_pairs("train", 2), 1024)
    m = tiny_model(tok)
    start = [summed_logps(m, [c for c, _, _ in items])[0].detach(), summed_logps(m, [j for _, j, _ in items])[0].detach()]
    ref = torch.stack(start, 1)
    singles, _ = kto_items(tok, [s for r in preference_pairs("train", 2) for s in kto_rows(r)], 1024)
    kto_ref = torch.stack([ref.flatten(), ref.flatten()], 1)  # answers in the order chosen, rejected, chosen, ...
    opt = make_optimizer(m, 3e-3)
    for _ in range(8):
        if loss_type == "kto":
            loss, _ = kto_micro_loss(m, singles, kto_ref, pad_id=tok.pad_id, capacity=1024, answers_per_step=4, kl=0.0,
                                     beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
        elif loss_type == "orpo":
            loss, _ = orpo_micro_loss(m, items, pad_id=tok.pad_id, capacity=1024, pairs_per_step=2,
                                      chosen_tokens_per_step=100.0, beta=1.0)
        else:
            loss, _ = dpo_micro_loss(m, items, ref, pad_id=tok.pad_id, capacity=1024, pairs_per_step=2,
                                     chosen_tokens_per_step=1.0, beta=0.1, loss_type="sigmoid")
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        chosen = summed_logps(m, [c for c, _, _ in items])[0] - start[0]
        rejected = summed_logps(m, [j for _, j, _ in items])[0] - start[1]
    assert torch.all(chosen - rejected > 0.1), (chosen, rejected)
    if loss_type == "orpo":  # the NLL term raises the chosen answers themselves
        assert torch.all(chosen > 0)


# ------------------------------------------------------------------------------------------------
# Real runs of chat_dpo.py

@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    save_hf(tiny_model(tok, max_seq_len=512), str(path), tok)
    return str(path)


def dpo_run(home, init, *extra, nproc=1, stage="dpo"):
    """A short run of chat_dpo.py (stage "dpo") or chat_kto.py ("kto"): (its step rows, its eval.json)."""
    args = [os.path.join(REPO, f"chat_{stage}.py"), "--init", init, "--num-train", "32", "--num-val", "6",
            "--eval-problems", "0", "--steps", "2", "--batch-size", "8", "--lr", "1e-2", *extra]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(home, stage, "default", "eval.json")) as f:
        return [row for row in rows if "loss" in row], json.load(f)


@pytest.mark.slow
def test_ddp_accumulation_and_live_reference_equal_one_big_batch(tmp_path, tiny_chat):
    one, ev = dpo_run(tmp_path / "one", tiny_chat, "--micro-batch-tokens", "100000", "--rpo-alpha", "0.5")
    ddp, _ = dpo_run(tmp_path / "ddp", tiny_chat, "--micro-batch-tokens", "300", "--rpo-alpha", "0.5", nproc=2)
    live, ev_live = dpo_run(tmp_path / "live", tiny_chat, "--micro-batch-tokens", "100000", "--rpo-alpha", "0.5", "--ref", "live")
    assert len(one) == 2 and one[0]["rewards/margins"] == 0  # step 0: the policy is the reference
    for other in (ddp, live):
        for a, b in zip(one, other):
            for k in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
                assert abs(a[k] - b[k]) < 1e-4, (k, a[k], b[k])
    assert {"pair_accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(ev)
    assert "peak_memory_mb" not in ev  # eval.json feeds report.json: held-out figures only, no machine figure
    assert ev["ref"] == "precompute" and ev_live["ref"] == "live"


@pytest.mark.slow
def test_fsdp_on_two_ranks_equals_one_process(tmp_path, tiny_chat):
    from safetensors.torch import load_file
    runs = {}
    for name, nproc, extra in (("one", 1, ()), ("fsdp", 2, ("--fsdp", "--micro-batch-tokens", "300"))):
        runs[name] = dpo_run(tmp_path / name, tiny_chat, "--steps", "3", "--save-every", "3", *extra, nproc=nproc)[0]
    assert len(runs["one"]) == 3
    for a, b in zip(runs["one"], runs["fsdp"]):
        for k in ("loss", "grad_norm", "rewards/margins"):
            assert abs(a[k] - b[k]) < 1e-4, (k, a[k], b[k])
    weights = [load_file(str(tmp_path / name / "dpo" / "default" / "checkpoints" / "step_000003" / "model.safetensors"))
               for name in ("one", "fsdp")]
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("loss", ["orpo", "kto"])
def test_orpo_and_kto_train(tmp_path, tiny_chat, tok, loss):
    # kto: lr 1e-2 / 3, then 2e-2 / 3 (as the default 3-step warmup gave before it was fitted to 2-step runs)
    schedule = ("--warmup-steps", "2", "--lr", str(2e-2 / 3)) if loss == "kto" else ("--loss", loss)
    rows, ev = dpo_run(tmp_path, tiny_chat, *schedule, "--micro-batch-tokens", "100000",
                       stage="kto" if loss == "kto" else "dpo")
    assert len(rows) == 2
    if loss == "kto":
        # step 1: the policy is the reference, every log-ratio and the reference point are 0, each answer loses
        # 1 - sigmoid(0) = 0.5; one AdamW step later the good answers' rewards are above the bad ones', on the
        # next batch and on held-out pairs (the next batch's loss also moves with its reference point, z0)
        assert abs(rows[0]["loss"] - 0.5) < 1e-6 and rows[0]["kl"] < 1e-4
        assert rows[1]["rewards/chosen"] > rows[1]["rewards/rejected"] and ev["rewards/margins"] > 0
    else:
        # ORPO's loss is the chosen answers' NLL plus the odds-ratio term (<= beta log 2 at the start): an
        # untrained model's NLL is near log(vocabulary)
        assert rows[0]["loss"] > 0.5 * math.log(tok.vocab_size)


def test_kto_reads_unpaired_answers(tmp_path, tiny_chat):
    # TRL's unpaired rows; the held-out tail answers its prompts both ways, so it yields pairs to measure
    singles = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
               for r in preference_pairs("train", 60) for side in ("chosen", "rejected")]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(s) + "\n" for s in singles))
    rows, ev = dpo_run(tmp_path, tiny_chat, "--micro-batch-tokens", "100000", "--data", str(data), stage="kto")
    assert len(rows) == 2 and abs(rows[0]["loss"] - 0.5) < 1e-6  # the policy starts as the reference
    # 2 held-out answers (2% of 120): one good, one bad, same prompt; the file's labels followed, the good one
    # ends above the bad one (inverted labels: -6.5)
    assert ev["rewards/margins"] > 0 and ev["pair_accuracy"] == 1.0


def test_load_kto_and_held_out_pairs(tmp_path):
    pair = {"prompt": "q1", "chosen": "good", "rejected": "bad"}
    rows = [pair, {"prompt": "q2", "completion": "fine", "label": True}, {"prompt": "q2", "completion": "no", "label": False},
            {"prompt": "q3", "completion": "alone", "label": False}]
    path = tmp_path / "k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    singles = load_kto(str(path))
    assert [(s["completion"][0]["content"], s["label"]) for s in singles] == \
        [("good", True), ("bad", False), ("fine", True), ("no", False), ("alone", False)]
    pairs = pairs_of_singles(singles)
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [("good", "bad"), ("fine", "no")]
    path.write_text(json.dumps({"prompt": "q", "completion": "a", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"k.jsonl:1: 'label' must be true"):
        load_kto(str(path))


def test_paired_change_of_pass_at_1():
    # d = after - before = [0, 1, -1, 0, 1]: mean 0.2, sample std sqrt(2.8 / 4) = 0.83666, se 0.37417
    change, se = paired_change([1, 0, 1, 1, 0], [1, 1, 0, 1, 1])
    assert abs(change - 0.2) < 1e-12 and abs(se - 0.37417) < 1e-5


def test_judge_pairs_are_the_judges_choices_asked_in_both_orders(tok, monkeypatch):
    """--pairs judge --judge standin:arithmetic: each prompt's first two different answers go to the judge in both
    orders; the one it prefers both times is chosen, whatever the verifier says (the stand-in has no answer key),
    and a pair it ties on (a preference only for the position) is dropped."""
    import os
    prompts = rl_prompts("train", 2)
    worked = ["Mia has 12 + 17 = 29 apples.\n#### 29", "Mia has 12 + 17 = 28 apples.\n#### 28"]  # 10 and 7
    tied = ["#### 5", "#### 6"]  # no work shown: 3 and 3
    from engine import Completion

    def fake_generate(self, prompt_ids, num_samples, **kw):
        texts = [worked[::-1], tied]
        return [Completion(i, tokens=(t := tok.encode(texts[i][j]) + [tok.eos_id]), mask=[1] * len(t),
                           finish_reason="stop") for i in range(len(prompt_ids)) for j in range(num_samples)]
    monkeypatch.setattr("engine.Engine.generate", fake_generate)
    rubric = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rubrics", "arithmetic.txt")
    rows = on_policy_rows(tiny_model(tok), tok, prompts, samples=2, temperature=1.0, max_new_tokens=8, seed=0,
                          judge="standin:arithmetic", rubric=rubric)
    assert len(rows) == 1 and rows[0]["prompt"] == prompts[0]["prompt"]
    assert rows[0]["chosen"][0]["content"] == worked[0] and rows[0]["rejected"][0]["content"] == worked[1]


def test_pairs_judge_needs_its_judge_and_rubric():
    from chat_dpo import parser
    from common import UserError
    from preferences import check_pair_flags
    for argv, message in ((["--pairs", "judge"], "pass both"), (["--pairs", "judge", "--judge", "standin:arithmetic"],
                                                                "pass both"),
                          (["--judge", "standin:arithmetic"], "add --pairs judge"),
                          (["--pairs", "judge", "--judge", "x", "--rubric", "nowhere.txt"], "no such rubric")):
        with pytest.raises(UserError, match=message):
            check_pair_flags(parser.parse_args(argv))
