"""chat_rl.py: worked tables (inputs and outputs written in the tests) for advantages, clipping, GSPO, CISPO, KL, truncated IS and pass@k;
the loss mask of a rollout; 2 gloo ranks with uneven lengths equal one rank; the real loop runs."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from evaluation import pass_at_k
from chat_rl import group_advantages, policy_loss
from rollout import overlong_penalty
from common import all_reduce_sum, cleanup_dist
from packing import micro_batches
from rollout import kl_penalty, sampler_correction, training_batch
from engine import Completion
from model import GPT, GPTConfig
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(a, b, tol=5e-5):
    return abs(float(a) - float(b)) < tol


# ------------------------------------------------------------------------------------------------
# Advantages

def test_grpo_and_dr_grpo_advantages_worked_table():
    r = torch.tensor([1., 0, 0, 1, 0, 1, 0, 0])
    a = group_advantages(r, 8)
    assert close(a[0], 1.2910) and close(a[1], -0.7746)
    d = group_advantages(r, 8, scale="none")
    assert close(d[0], 0.6250) and close(d[1], -0.3750)
    loo = group_advantages(r, 8, scale="none", estimator="rloo")
    assert close(loo[0], 1 - 2 / 7) and close(loo[1], -3 / 7)


def test_near_uniform_group_is_sane_and_uniform_group_is_exactly_zero():
    a = group_advantages(torch.tensor([0.35] * 7 + [0.95]), 8)
    assert torch.isfinite(a).all() and a.abs().max() < 3  # 2.6458 and -0.3780, not 4000x (NeMo-RL#4161)
    assert close(a[-1], 0.6 * 7 / 8 / math.sqrt(0.039375), 1e-3)
    for v in (0.35, 0.1, 1.0, 0.0):
        z = group_advantages(torch.tensor([v] * 8 + [0.0, 1.0] * 4), 8)
        assert torch.all(z[:8] == 0.0) and torch.all(z[8:] != 0)
    b = group_advantages(torch.tensor([0.35] * 8), 8, scale="batch")
    assert torch.all(b == 0.0)


def test_equal_rewards_give_exactly_zero_gradient_and_mixed_ones_the_weighted_gradient():
    logp = torch.randn(8, 5, requires_grad=True)
    adv = group_advantages(torch.ones(8), 8)
    loss, _ = policy_loss(logp, logp.detach() + 0.1, adv, torch.ones(8, 5))
    loss.backward()
    assert torch.all(logp.grad == 0)
    # mixed rewards: ratio exp(-0.1) = 0.9048 (inside the clip range), token-mean over 40 tokens, so
    # d loss / d logp[b, t] = -ratio * A_b / 40, with A_b = (r_b - 0.375) / 0.4841 written out here
    r = torch.tensor([1., 0, 0, 1, 0, 1, 0, 0])
    want_adv = (r - 0.375) / math.sqrt(0.375 * 0.625)
    logp.grad = None
    policy_loss(logp, logp.detach() + 0.1, group_advantages(r, 8), torch.ones(8, 5))[0].backward()
    torch.testing.assert_close(logp.grad, (-math.exp(-0.1) * want_adv / 40)[:, None].expand(8, 5), atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Clipping: the clip-higher table (A = +1)

OLD = torch.tensor([[-0.2, -0.5, -2.3, -0.05, -3.0]])      # p_old 0.8187, 0.6065, 0.1003, 0.9512, 0.0498
DELTA = torch.tensor([[0.1, -0.3, 0.4, 0.03, -0.5]])       # ratios 1.1052, 0.7408, 1.4918, 1.0305, 0.6065


def per_token_objectives(eps_high):
    objs = []
    for t in range(5):
        m = torch.zeros(1, 5)
        m[0, t] = 1
        loss, _ = policy_loss(OLD + DELTA, OLD, torch.tensor([1.0]), m, 0.2, eps_high)
        objs.append(-loss.item())
    return objs


def test_clip_higher_table():
    at_02 = per_token_objectives(0.2)
    for got, want in zip(at_02, [1.1052, 0.7408, 1.2000, 1.0305, 0.6065]):
        assert close(got, want, 1e-4)
    at_028 = per_token_objectives(0.28)
    changed = [t for t in range(5) if not close(at_02[t], at_028[t], 1e-9)]
    assert changed == [2] and close(at_028[2], 1.28)       # exactly one token moves: the rare t3


def test_clipped_token_has_no_gradient_in_ppo_but_keeps_it_in_cispo():
    grads = {}
    for kind, cap in (("ppo", 5.0), ("cispo-two-sided", 5.0), ("cispo", 5.0), ("cispo", 1.3)):
        logp = (OLD + DELTA).clone().requires_grad_(True)
        loss, _ = policy_loss(logp, OLD, torch.tensor([1.0]), torch.ones(1, 5), loss_type=kind, cispo_cap=cap)
        loss.backward()
        grads[kind, cap] = logp.grad[0]
    assert grads["ppo", 5.0][2] == 0                            # t3 is above 1.2: PPO drops it
    assert close(grads["cispo-two-sided", 5.0][2], -1.2 / 5)    # CISPO two-sided: clipped weight 1.2, gradient kept
    assert close(grads["cispo", 5.0][2], -1.4918 / 5, 1e-4)     # the paper's: ratio 1.4918 under the cap, kept whole
    assert close(grads["cispo", 1.3][2], -1.3 / 5)              # capped at 1.3


def test_cispo_is_trls_formula_and_has_no_lower_bound():
    """TRL (GRPOTrainer, loss_type="cispo"): per_token_loss = -clamp(coef_1, max=epsilon_high).detach() * A * logp,
    coef_1 = exp(logp - old_logp). nanopost's --loss cispo --cispo-cap c is TRL's loss_type="cispo" with
    epsilon_high=c (an absolute cap, not 1 + eps), and MiniMax-M1's objective with no lower bound on the weight."""
    torch.manual_seed(0)
    old = torch.randn(3, 6) - 2.0
    logp0 = old + torch.tensor([-1.5, -0.4, 0.0, 0.3, 1.2, 2.0])  # ratios 0.22 .. 7.39: under 1 - eps, over the cap
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, 6)
    for cap in (5.0, 1.28):
        logp = logp0.clone().requires_grad_(True)
        loss, stats = policy_loss(logp, old, adv, mask, loss_type="cispo", cispo_cap=cap, eps_low=0.2, eps_high=0.28)
        loss.backward()
        ref_logp = logp0.clone().requires_grad_(True)
        trl = (-torch.clamp(torch.exp(ref_logp - old), max=cap).detach() * adv[:, None] * ref_logp).mean()
        trl.backward()
        assert close(loss.item(), trl.item(), 1e-6) and torch.allclose(logp.grad, ref_logp.grad, atol=1e-7)
        assert stats["clip_frac"] == pytest.approx((1 if cap == 5.0 else 3) / 6)  # the tokens whose weight is capped
    # the ratio 0.22 token keeps its weight 0.22 (no lower bound); two-sided lifts it to 1 - eps_low = 0.8
    for kind, weight in (("cispo", math.exp(-1.5)), ("cispo-two-sided", 0.8)):
        logp = logp0.clone().requires_grad_(True)
        policy_loss(logp, old, torch.ones(3), mask, loss_type=kind, eps_low=0.2, eps_high=0.28)[0].backward()
        assert close(logp.grad[0, 0].item(), -weight / 18, 1e-6)


def test_gspo_with_token_mean_warns(capsys):
    from chat_rl import parser, update_settings
    update_settings(parser.parse_args(["--level", "sequence"]))
    assert "GSPO: seq-mean-token-mean" in capsys.readouterr().out
    update_settings(parser.parse_args(["--level", "sequence", "--agg", "seq-mean-token-mean"]))
    update_settings(parser.parse_args([]))
    assert "warning" not in capsys.readouterr().out


def test_dual_clip_bounds_negative_advantages():
    logp, old = torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1)
    plain, _ = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1))
    dual, _ = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=3.0)
    assert close(plain, 5.0) and close(dual, 3.0)


# ------------------------------------------------------------------------------------------------
# GSPO: the sequence ratio table, and two sequences of different lengths (trl#3823)

def test_gspo_sequence_ratio_worked_table():
    old = torch.tensor([[-0.10, -0.20, -0.05, -2.50, -0.15]])
    new = torch.tensor([[-0.12, -0.18, -0.07, -1.60, -0.16]])
    _, st = policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 5), level="sequence")
    assert close(st["ratio_mean"], 1.1901, 1e-4) and st["clip_frac"] == 0    # exp(0.87 / 5): inside the range
    _, tok_st = policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 5), level="token")
    assert close(tok_st["clip_frac"], 1 / 5)                                 # the 4th token's 2.4596 is clipped


def test_gspo_two_sequences_of_different_lengths():
    old = torch.tensor([[-0.10, -0.20, -0.05, -2.50, -0.15], [-1.0, -1.0, 0, 0, 0]])
    new = torch.tensor([[-0.12, -0.18, -0.07, -1.60, -0.16], [-0.9, -1.3, 0, 0, 0]])
    mask = torch.tensor([[1., 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0])
    r_a, r_b = math.exp(0.87 / 5), math.exp(-0.2 / 2)       # 1.1901 and 0.9048, both inside the clip range
    seq_mean, _ = policy_loss(new, old, adv, mask, level="sequence", agg="seq-mean-token-mean")
    assert close(seq_mean, (-r_a + r_b) / 2)                  # -0.1427, not scaled by the lengths
    tok_mean, _ = policy_loss(new, old, adv, mask, level="sequence", agg="token-mean")
    assert close(tok_mean, (-5 * r_a + 2 * r_b) / 7)
    # and the gradient reaches every token of an answer with the same per-token weight
    logp = new.clone().requires_grad_(True)
    policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean")[0].backward()
    assert torch.allclose(logp.grad[0], torch.full((5,), -r_a / 5 / 2), atol=1e-6)
    assert torch.all(logp.grad[1, 2:] == 0)


def test_aggregations_normalize_as_documented():
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1., 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, 1.0])
    tm, _ = policy_loss(logp, logp, adv, mask, agg="token-mean")
    sm, _ = policy_loss(logp, logp, adv, mask, agg="seq-mean-token-mean")
    dr, _ = policy_loss(logp, logp, adv, mask, agg="seq-mean-token-sum-norm", max_len=10)
    assert close(tm, -1.0) and close(sm, -1.0) and close(dr, -5 / 20)
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(logp, logp, adv, mask, agg="seq-mean-token-sum-norm")


# ------------------------------------------------------------------------------------------------
# KL, truncated importance sampling, overlong shaping, pass@k

def test_kl_worked_table():
    now, start = torch.tensor([-0.10, -0.50, -1.20]), torch.tensor([-0.30, -0.60, -2.00])
    assert close(kl_penalty(now, start, "k1").mean(), 0.3667)


def test_kl_estimator_gradients_against_the_analytic_kl():
    """On a categorical policy, the expected gradient of each estimator used as a loss on samples
    from the policy: k2's is the KL(pi || ref) gradient, k1's is zero, k3's is the reverse KL's."""
    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), 0)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp()
    forward_kl = torch.autograd.grad((p * (logp - ref)).sum(), theta, retain_graph=True)[0]
    reverse_kl = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta, retain_graph=True)[0]

    def expected_grad(kind):  # E_{x ~ pi}[grad k(x)], samples held fixed (no score-function term)
        return torch.autograd.grad((p.detach() * kl_penalty(logp, ref, kind)).sum(), theta, retain_graph=True)[0]

    assert torch.allclose(expected_grad("k2"), forward_kl, atol=1e-6)
    assert torch.allclose(expected_grad("k1"), torch.zeros(6), atol=1e-6)
    assert torch.allclose(expected_grad("k3"), reverse_kl, atol=1e-6)
    assert not torch.allclose(forward_kl, reverse_kl, atol=1e-3)


def test_truncated_importance_sampling_worked_table():
    rollout = torch.tensor([-0.500, -1.200, -0.050, -3.500, -0.900])
    trainer = torch.tensor([-0.520, -1.150, -0.080, -2.600, -1.100])
    ones = torch.ones(1, 5)
    token_tis = lambda cap: sampler_correction(trainer[None], rollout[None], ones, "token-tis", cap=cap)  # noqa: E731
    assert close(token_tis(1e9).prod(), 2.0138, 1e-4)    # uncapped: the sequence ratio
    assert close(token_tis(2.0).prod(), 1.6375, 1e-4)


def test_overlong_penalty():
    assert overlong_penalty(90, 128, 32) == 0.0
    assert close(overlong_penalty(112, 128, 32), -0.5) and overlong_penalty(128, 128, 32) == -1.0
    assert overlong_penalty(128, 128, 0) == 0.0


def test_pass_at_k_worked_table():
    for k, want in ((1, 0.3000), (4, 0.7599), (8, 0.9424), (16, 0.9967)):
        assert close(pass_at_k(10000, 3000, k), want, 2e-3)  # the unbiased estimator agrees for large n
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    for n, c, k in ((10, 3, 1), (10, 3, 4), (16, 5, 8), (20, 1, 19)):  # 1 - C(n - c, k) / C(n, k), Chen et al. 2021
        assert close(pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k), 1e-9)


# ------------------------------------------------------------------------------------------------
# Rollout tensors: the loss mask covers exactly the sampled answer tokens

def test_rollout_mask_covers_exactly_the_sampled_tokens():
    prompts = [[5, 6, 7], [8, 9]]
    c0 = Completion(0, tokens=[10, 11, 12, 13], logprobs=[-.1, 0.0, 0.0, -.4], mask=[1, 0, 0, 1], finish_reason="stop")
    c1 = Completion(1, tokens=[20, 21], logprobs=[-.2, -.3], mask=[1, 1], finish_reason="length")
    b = training_batch(prompts, [c0, c1], pad_id=0, device="cpu")
    assert b.inputs[0].tolist() == [5, 6, 7, 10, 11, 12] and b.targets[0].tolist() == [-100, -100, 10, -100, -100, 13]
    assert b.mask[0].tolist() == [0, 0, 1, 0, 0, 1]            # forced tool tokens (11, 12) are not trained
    assert b.inputs[1].tolist()[:3] == [8, 9, 20] and b.targets[1].tolist() == [-100, 20, 21, -100, -100, -100]
    assert b.mask[1].tolist() == [0, 1, 1, 0, 0, 0] and b.lengths.tolist() == [6, 3]
    assert b.engine_logp[0].tolist() == pytest.approx([0, 0, -.1, 0, 0, -.4])
    b2 = training_batch(prompts, [c0, c1], 0, "cpu", mask_truncated=True)
    assert b2.mask[1].sum() == 0 and b2.mask[0].sum() == 2    # a truncated answer gives no gradient


def test_micro_batches_fit_the_token_budget():
    assert micro_batches([5, 30, 8, 31], 64) == [[0, 2], [1, 3]]
    lengths = [3, 17, 9, 40, 2, 25, 25, 8]
    passes = micro_batches(lengths, 50)
    assert sorted(i for p in passes for i in p) == list(range(8))            # every row exactly once
    assert all(len(p) * max(lengths[i] for i in p) <= 50 for p in passes)    # each pass fits the budget
    assert micro_batches([70, 3], 50) == [[1], [0]]                          # too long: a pass of its own


# ------------------------------------------------------------------------------------------------
# DDP: 2 gloo ranks with uneven lengths and an uneven split give one rank's gradient, and finish

def tiny_policy():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, head_dim=8,
                         intermediate_size=32, max_seq_len=64))


def synthetic_batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (int(n),), generator=g).tolist() for n in (3, 7, 4)]
    comps = []
    for i, n in enumerate((5, 2, 9, 1, 6, 3)):
        toks = torch.randint(1, 50, (n,), generator=g).tolist()
        comps.append(Completion(i // 2, tokens=toks, logprobs=[-1.0] * n, mask=[1] * n, finish_reason="stop"))
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 2)
    return prompts, comps, adv


def grad_of(model, prompts, comps, adv, agg):
    from common import init_dist, wrap_model
    from rollout import minibatches_of
    init_dist("cpu")
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    mb = next(minibatches_of(b, step=0, epochs=1, count=1))  # every rank's counts
    norm = mb.tokens if agg == "token-mean" else mb.answers
    ddp = wrap_model(model)  # DistributedDataParallel under 2 ranks, summing gradients
    old = ddp(b.inputs, b.targets).detach() - 0.05
    loss, _ = policy_loss(ddp(b.inputs, b.targets), old, adv, b.mask, agg=agg, normalizer=norm, max_len=16)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rank(rank, world, init_file, out_dir, agg):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    prompts, comps, adv = synthetic_batch()
    mine = [i for i in range(len(comps)) if (i < 2) == (rank == 0)]  # rank 0: 2 answers, rank 1: 4
    g = grad_of(tiny_policy(), prompts, [comps[i] for i in mine], adv[mine], agg)
    torch.save(g, os.path.join(out_dir, f"grad{rank}.pt"))
    cleanup_dist()  # collects the DDP wrapper first (else gloo can abort at teardown)


@pytest.mark.parametrize("agg", ["token-mean"] + [pytest.param(a, marks=pytest.mark.slow)  # token-mean: quick tier
                                 for a in ("seq-mean-token-mean", "seq-mean-token-sum-norm")])
def test_two_ranks_with_uneven_lengths_equal_one_rank(tmp_path, agg):
    prompts, comps, adv = synthetic_batch()
    single = grad_of(tiny_policy(), prompts, comps, adv, agg)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), str(tmp_path), agg)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)  # uneven lengths must not hang a collective (trl#3933)
        assert p.exitcode == 0
    for r in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"grad{r}.pt"), single, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# The real loop, tiny: one process with 2 PPO epochs and tools, and 2 ranks

@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("sft")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def rl_run(home, init, *extra, nproc=1):
    args = [os.path.join(REPO, "chat_rl.py"), "--init", init, "--num-prompts", "32", "--steps", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-problems", "4",
            "--pass-k", "2", "--eval-every", "100", "--save-every", "100", "--max-resample", "1", *extra]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(home, "rl", "default", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


TIMED = ("time", "seconds", "_per_s", "peak_mem")  # what a run measures of the machine, not of the model


@pytest.mark.slow
def test_no_eval_before_train_skips_step_0_and_changes_nothing_else(tmp_path, tiny_chat):
    """--no-eval-before-train (runs/cpu.sh, whose SFT stage has just evaluated the same model) drops step 0's
    evaluation and nothing else: the evaluation samples from its own generator, so every step's numbers and the
    final evaluation come out the same to the last digit."""
    train = ("--lr", "1e-2", "--overlong-buffer", "24")  # the length penalty: rewards that differ, a gradient
    with_eval = rl_run(tmp_path / "a", tiny_chat, *train)
    without = rl_run(tmp_path / "b", tiny_chat, *train, "--no-eval-before-train")
    assert [r["step"] for r in with_eval] == [0, 1, 2] and "eval/pass@1" in with_eval[0]
    assert [r["step"] for r in without] == [1, 2]
    numbers = [{k: v for k, v in r.items() if not any(t in k for t in TIMED)} for r in with_eval[1:]]
    assert numbers == [{k: v for k, v in r.items() if not any(t in k for t in TIMED)} for r in without]
    assert "eval/pass@1_t1" in without[-1] and with_eval[2]["loss"] != 0


@pytest.mark.parametrize("mode", [[], ["--off-policy", "--correction", "token-mask"],
                                  ["--staleness", "1", "--correction", "sequence-tis", "--tis-cap", "0.5"]],
                         ids=["on-policy", "off-policy", "stale"])
def test_loop_runs_off_policy_and_stale(tmp_path, tiny_chat, mode):
    """--off-policy samples the next batch in a thread from a snapshot; --staleness k samples with the weights
    of k steps back: from the second step on, the batch trains one update behind its sampler. The correction
    the loop applies is the one its flags name, with its cap."""
    rows = rl_run(tmp_path, tiny_chat, "--overlong-buffer", "24", "--steps", "3", "--lr", "1e-2", *mode)
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["staleness"] for r in steps] == ([0, 0, 0] if not mode else [0, 1, 1])
    if mode:  # the sampler's weights are behind the trainer's: their log-probs disagree
        assert steps[0]["logprob_mismatch"] < 1e-4 and steps[2]["logprob_mismatch"] > 1e-4
    # on-policy (step 1, and every step without staleness) the sampler and trainer agree: ratios ~1, so
    # token-tis weighs every token 1, token-mask drops none, and sequence-tis capped at 0.5 weighs each 0.5
    want = 0.5 if "--tis-cap" in mode else 1.0
    for r in (steps[:1] if mode else steps):
        assert abs(r["correction_mean"] - want) < 1e-3 and r["masked_frac"] == 0
    assert all(r["correction_mean"] <= want + 1e-6 for r in steps)
    if "token-mask" in mode:  # a stale batch: token-mask drops the tokens whose probabilities moved by > 0.1
        assert all(r["correction_mean"] == 1 - r["masked_frac"] for r in steps)


def test_off_policy_and_one_step_stale_sample_with_the_same_weights(tmp_path, tiny_chat):
    """--off-policy (the next batch sampled in a thread while this one trains) and --staleness 1 both train each
    batch one update behind the weights that sampled it, the same weights, prompts and seeds: the same answers, so
    the same rewards and the same sampler/trainer gap at every step. (A snapshot that shared the trainer's float32
    weights made them differ: the stale sampler was half current, the thread read weights mid-update;
    docs/lab/sampler_trainer.md.)"""
    train = ("--overlong-buffer", "24", "--steps", "3", "--lr", "1e-2")
    runs = [[r for r in rl_run(tmp_path / name, tiny_chat, *train, *mode) if "reward" in r]
            for name, mode in (("off", ["--off-policy"]), ("stale", ["--staleness", "1"]))]
    off, stale = runs
    assert [r["staleness"] for r in off] == [r["staleness"] for r in stale] == [0, 1, 1]
    for a, b in zip(off, stale):
        assert a["length_mean"] == b["length_mean"] and a["reward"] == b["reward"]
        assert a["logprob_mismatch"] == pytest.approx(b["logprob_mismatch"], rel=1e-4, abs=1e-7)
    assert off[2]["logprob_mismatch"] > 1e-4  # one update behind: a gap there is


def test_loop_runs_with_ppo_epochs_and_tools(tmp_path, tiny_chat):
    # an untrained model never answers right: the soft overlong penalty gives its answers distinct rewards
    rows = rl_run(tmp_path, tiny_chat, "--ppo-epochs", "2", "--minibatches", "1", "--tools", "--eps-high", "0.2",
                  "--overlong-buffer", "24")
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the second pass over a batch sees the snapshot ratio exp(new - old), not a constant 1 (trl#2769)
    assert all(r["ratio_mean"] != 1.0 for r in steps)
    assert all(r["logprob_mismatch"] < 1e-4 for r in steps)  # engine and trainer agree
    assert os.path.isfile(tmp_path / "rl" / "default" / "eval.json")


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.slow
def test_loop_runs_on_two_ranks(tmp_path, tiny_chat, fsdp):
    # FSDP2: the engine samples from weights gathered once per rollout phase, dynamic sampling runs its own
    # rounds on each rank, every rank evaluates its share
    rows = rl_run(tmp_path, tiny_chat, "--eval-every", "1", "--overlong-buffer", "24", *(["--fsdp"] if fsdp else []),
                  nproc=2)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    assert all("eval/pass@1" in r for r in rows if "reward" in r)


def test_loop_runs_with_a_reward_model(tmp_path, tiny_chat):
    torch.manual_seed(1)
    rm = load_hf(tiny_chat, head="scalar")
    torch.nn.init.normal_(rm.score.weight)  # a random scorer: rewards differ from answer to answer
    save_hf(rm, str(tmp_path / "rm"))
    rm_name = f"rm:{tmp_path / 'rm'}"
    rows = rl_run(tmp_path, tiny_chat, "--reward", f"verifier+0.1*format+0.5*{rm_name}")
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["flat_group_frac"] < 1 for r in steps)
    for r in steps:  # each component logged on its own, the reward their weighted sum
        parts = r["reward/verifier"] + 0.1 * r["reward/format"] + 0.5 * r[f"reward/{rm_name}"]
        assert abs(r["reward"] - parts) < 1e-5


# ------------------------------------------------------------------------------------------------
# FSDP2: chat_rl's update on 2 gloo ranks (an uneven split: 2 answers and 4, so uneven numbers of forward
# passes, as dynamic sampling leaves them) equals one process holding the whole batch, for 3 steps

def fsdp_update_run(rank, world, out_dir):
    import chat_rl
    from common import init_dist, make_optimizer, wrap_model
    init_dist("cpu")
    prompts, comps, adv = synthetic_batch()
    mine = list(range(len(comps))) if world == 1 else [i for i in range(len(comps)) if (i < 2) == (rank == 0)]
    model = wrap_model(tiny_policy(), fsdp=True)
    optimizer = make_optimizer(model, 1e-2)
    args = chat_rl.parser.parse_args(["--ppo-epochs", "2", "--minibatches", "1", "--micro-batch-tokens", "16",
                                      "--entropy-coef", "0.01", "--max-new-tokens", "16"])
    b = training_batch([prompts[comps[i].prompt_index] for i in mine], [comps[i] for i in mine], 0, "cpu")
    stats = []
    for step in range(3):
        with torch.no_grad():
            old = model(b.inputs, b.targets) - 0.05  # a ratio away from 1, so the clip is exercised
        totals = chat_rl.update_policy(model, optimizer, b, old_logp=old, advantages=adv[mine], step=step,
                                       **chat_rl.update_settings(args))
        stats.append((all_reduce_sum(totals["loss"]), totals["grad_norm"]))
    from checkpoint import save_checkpoint
    save_checkpoint(str(out_dir), 3, model)
    return stats


def _fsdp_rank(rank, world, init_file, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    stats = fsdp_update_run(rank, world, out_dir)
    torch.save(stats, os.path.join(out_dir, f"stats{rank}.pt"))
    cleanup_dist()  # collects the DDP wrapper first (else gloo can abort at teardown)


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
def test_fsdp_update_on_two_ranks_equals_one_process(tmp_path):
    from safetensors.torch import load_file
    single = fsdp_update_run(0, 1, tmp_path / "one")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_fsdp_rank, args=(r, 2, str(tmp_path / "init"), str(tmp_path / "two"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0
    two = torch.load(tmp_path / "two" / "stats0.pt")
    for (loss1, norm1), (loss2, norm2) in zip(single, two):  # the gradient norm: AdamW would hide a scale
        assert abs(loss1 - loss2) < 1e-5 and abs(norm1 - norm2) < 1e-5 * max(1.0, norm1), (single, two)
    ckpt = "checkpoints/step_000003/model.safetensors"
    want, got = load_file(str(tmp_path / "one" / ckpt)), load_file(str(tmp_path / "two" / ckpt))
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4)


def test_target_kl_stops_the_updates_once_the_policy_has_moved():
    """CleanRL's early stop: the approximate KL to the sampling policy is measured in each minibatch's
    forward; the first minibatch sees the sampling policy itself (KL 0), the second one a policy moved by
    one step: past --target-kl, the remaining updates of the batch are skipped."""
    import chat_rl
    from common import make_optimizer
    prompts, comps, adv = synthetic_batch()
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    counts = {}
    for target in (None, 1e-9):
        model = tiny_policy()
        optimizer = make_optimizer(model, 1e-2)
        flags = ["--ppo-epochs", "2", "--minibatches", "2"] + ([] if target is None else ["--target-kl", str(target)])
        with torch.no_grad():
            old = model(b.inputs, b.targets)
        totals = chat_rl.update_policy(model, optimizer, b, old_logp=old, advantages=adv, step=0,
                                       **chat_rl.update_settings(chat_rl.parser.parse_args(flags)))
        counts[target] = totals["updates"]
    assert counts == {None: 4, 1e-9: 2}


def test_sampler_corrections_on_the_mismatch_table():
    from rollout import sampler_correction
    engine = torch.tensor([[-0.50, -1.20, -0.05, -3.50, -0.90]])
    trainer = torch.tensor([[-0.52, -1.15, -0.08, -2.60, -1.10]])
    mask = torch.ones(1, 5)
    seq = math.exp(sum(t - e for t, e in zip(trainer[0].tolist(), engine[0].tolist())))
    assert close(seq, 2.0138, 1e-4)
    ratios = [math.exp(t - e) for t, e in zip(trainer[0].tolist(), engine[0].tolist())]
    assert close(sampler_correction(trainer, engine, mask, "token-tis", cap=2.0).prod(), 1.6375, 1e-4)
    torch.testing.assert_close(sampler_correction(trainer, engine, mask, "token-tis", cap=2.0)[0],
                               torch.tensor([min(r, 2.0) for r in ratios]))
    assert sampler_correction(trainer, engine, mask, "token-mask", eps=0.04)[0].tolist() == [1, 1, 1, 0, 0]
    assert sampler_correction(trainer, engine, mask, "token-mask", eps=0.1)[0].tolist() == [1] * 5
    assert torch.allclose(sampler_correction(trainer, engine, mask, "sequence-tis", cap=2.0), torch.full((1, 5), 2.0))
    assert torch.allclose(sampler_correction(trainer, engine, mask, "sequence-tis", cap=3.0), torch.full((1, 5), seq))
    assert sampler_correction(trainer, engine, mask, "sequence-mask", cap=2.0).sum() == 0       # 2.0138 > 2
    assert sampler_correction(trainer, engine, mask, "sequence-mask", cap=2.1).sum() == 5
    # tokens outside the mask get weight 0, and do not count in the sequence weight
    half = torch.tensor([[1.0, 1, 1, 0, 0]])
    seq3 = math.exp(sum(t - e for t, e in zip(trainer[0, :3].tolist(), engine[0, :3].tolist())))
    torch.testing.assert_close(sampler_correction(trainer, engine, half, "sequence-tis", cap=5.0)[0],
                               torch.tensor([seq3] * 3 + [0.0, 0.0]))


def test_stale_samples_corrected_by_the_samplers_log_probs_give_the_on_policy_gradient():
    """Answers drawn by stale weights pi_b, trained at pi: the clip's anchor is the snapshot of pi (ratio 1 at
    the first pass), and the sampler correction weights each token by pi / pi_b from the engine's log-probs.
    Enumerating every token of a 6-token vocabulary exactly (no sampling), the expected gradient equals the
    on-policy gradient of E_pi[A]; uncorrected, it does not."""
    from rollout import sampler_correction
    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    logp_all = torch.log_softmax(theta, -1)
    stale_logp = torch.log_softmax(theta.detach() + 0.8 * torch.randn(6), -1)  # pi_b, the sampler's
    A = torch.randn(6)
    want = torch.autograd.grad((logp_all.exp() * A).sum(), theta, retain_graph=True)[0]  # d/dtheta of E_pi[A]
    for correct in (True, False):
        total = 0
        for y in range(6):  # each token as a one-token answer, weighted by its probability under the sampler
            logp = logp_all[y].view(1, 1)
            old = logp.detach()
            w = sampler_correction(old, stale_logp[y].view(1, 1), torch.ones(1, 1), "token-tis", cap=1e9) \
                if correct else None
            loss, _ = policy_loss(logp, old, A[y].view(1), torch.ones(1, 1), weights=w)
            total = total + stale_logp[y].exp() * loss
        got = -torch.autograd.grad(total, theta, retain_graph=True)[0]
        assert torch.allclose(got, want, atol=1e-6) == correct


# ------------------------------------------------------------------------------------------------
# The loop's pieces against references written here from the definitions: the update (which loss, which
# level, which aggregation, which KL estimator reaches the weights), --scale batch, dynamic sampling

class RecordingOptimizer:
    """Stands in for AdamW: keeps each step's gradients, changes nothing."""
    def __init__(self, model):
        self.params, self.steps = list(model.parameters()), []

    def step(self):
        self.steps.append([p.grad.clone() for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def reference_loss(logp, old, adv, mask, *, level, loss, agg, max_len, ref=None, kl_kind=None, kl_beta=0.0,
                   eps_low=0.2, eps_high=0.28, logits=None, entropy_coef=0.0):
    """The objective from the papers, written out: PPO's clipped ratio per token (GRPO), GSPO's sequence ratio
    exp(mean log-ratio) per answer, CISPO's clipped detached weight on log p; then token-mean, mean of
    answers' token means, or sum / (answers x max_len); plus beta x token-mean KL estimator to the reference;
    minus entropy_coef x the token-mean entropy of the whole next-token distribution (from `logits`)."""
    n = mask.sum(-1)
    if level == "sequence":
        s = torch.exp(((logp - old) * mask).sum(-1) / n)                 # (B,) with gradient through every token
        per_seq = -torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)
        per_tok = per_seq[:, None].expand_as(logp)                      # every token of an answer carries it
    else:
        r = torch.exp(logp - old)
        if loss == "cispo":  # MiniMax-M1: the weight capped (at 5, --cispo-cap's default), no lower bound
            per_tok = -r.clamp(max=5.0).detach() * adv[:, None] * logp
        elif loss == "cispo-two-sided":
            per_tok = -r.clamp(1 - eps_low, 1 + eps_high).detach() * adv[:, None] * logp
        else:
            per_tok = -torch.minimum(r * adv[:, None], r.clamp(1 - eps_low, 1 + eps_high) * adv[:, None])
    if agg == "token-mean":
        total = (per_tok * mask).sum() / mask.sum()
    elif agg == "seq-mean-token-mean":
        total = ((per_tok * mask).sum(-1) / n).mean()
    else:
        total = (per_tok * mask).sum() / (mask.size(0) * max_len)
    if kl_beta:
        d = ref - logp  # log(pi_ref / pi) on the sampled tokens
        k = {"k1": -d, "k2": d ** 2 / 2, "k3": d.exp() - 1 - d}[kl_kind]
        total = total + kl_beta * (k * mask).sum() / mask.sum()
    if entropy_coef:
        log_p = logits.float().log_softmax(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)                        # H(pi(. | prefix)) at every position
        total = total - entropy_coef * (entropy * mask).sum() / mask.sum()
    return total


@pytest.mark.parametrize("flags", [
    dict(level="token", loss="ppo", agg="token-mean"),
    dict(level="token", loss="cispo", agg="token-mean"),
    dict(level="token", loss="cispo-two-sided", agg="token-mean"),
    dict(level="sequence", loss="ppo", agg="seq-mean-token-mean"),
    dict(level="sequence", loss="ppo", agg="token-mean"),
    dict(level="token", loss="ppo", agg="seq-mean-token-mean"),
    dict(level="token", loss="ppo", agg="seq-mean-token-sum-norm"),
    dict(level="token", loss="ppo", agg="token-mean", kl_kind="k1"),
    dict(level="token", loss="ppo", agg="token-mean", kl_kind="k2"),
    dict(level="token", loss="ppo", agg="token-mean", kl_kind="k3"),
    dict(level="token", loss="ppo", agg="token-mean", entropy_coef="0.1"),
], ids=lambda f: "-".join(f.values()))
def test_update_applies_the_gradient_of_the_flags_objective(flags):
    """chat_rl.update_policy with --level, --loss, --agg, --kl-kind and --entropy-coef, in several forward passes: the gradient
    it hands the optimizer is that of the reference objective over the whole batch. The snapshot is off by
    up to +-0.6 per token, so some ratios are clipped (PPO drops those tokens, CISPO keeps them)."""
    import chat_rl
    prompts, comps, adv = synthetic_batch()
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    model = tiny_policy()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        logp0 = model(b.inputs, b.targets)
    old = (logp0 + (torch.rand(logp0.shape, generator=g) - 0.5) * 1.2) * b.mask
    ref = (logp0 + (torch.rand(logp0.shape, generator=g) - 0.5) * 2.0) * b.mask
    kl_kind = flags.get("kl_kind")
    argv = ["--ppo-epochs", "1", "--minibatches", "1", "--micro-batch-tokens", "24", "--grad-clip", "0",
            "--max-new-tokens", "16", "--level", flags["level"], "--loss", flags["loss"], "--agg", flags["agg"]]
    if kl_kind:
        argv += ["--kl-beta", "0.5", "--kl-kind", kl_kind]
    entropy_coef = float(flags.get("entropy_coef", 0.0))
    if entropy_coef:
        argv += ["--entropy-coef", flags["entropy_coef"]]
    args = chat_rl.parser.parse_args(argv)
    assert len(micro_batches(b.lengths, 24)) > 1  # the normalizers must span the passes
    opt = RecordingOptimizer(model)
    chat_rl.update_policy(model, opt, b, old_logp=old, advantages=adv, ref_logp=ref if kl_kind else None, step=0,
                          **chat_rl.update_settings(args))
    want = torch.autograd.grad(reference_loss(model(b.inputs, b.targets), old, adv, b.mask, max_len=16,
                                              ref=ref, kl_kind=kl_kind, kl_beta=0.5 if kl_kind else 0.0,
                                              logits=model(b.inputs), entropy_coef=entropy_coef,
                                              **{k: flags[k] for k in ("level", "loss", "agg")}), opt.params)
    assert len(opt.steps) == 1
    for got, w in zip(opt.steps[0], want):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-4)


def sampled_logp(model, inputs, targets, temperature=1.0, top_k=None, top_p=None):
    """log p(target) under the distribution sampled from, written from its definition: logits / temperature;
    top-k keeps the k most likely tokens; top-p keeps, from the most likely down, each token while the tokens
    above it hold less than top_p of the mass. One position at a time, in plain Python."""
    logits = model(inputs).float() / temperature                     # (B, T, V)
    out = torch.zeros(targets.shape)
    for b in range(targets.size(0)):
        for t in range(targets.size(1)):
            if targets[b, t] < 0:
                continue
            row = logits[b, t]
            ranked = sorted(range(row.numel()), key=lambda v: -float(row[v].detach()))
            keep = ranked[:top_k] if top_k else ranked
            if top_p is not None:
                p, mass, kept = row[keep].detach().softmax(-1), 0.0, []
                for v, pv in zip(keep, p.tolist()):
                    if mass >= top_p:
                        break
                    kept.append(v)
                    mass += pv
                keep = kept
            tgt = int(targets[b, t])
            assert tgt in keep, "a sampled token is inside the kept set"
            out[b, t] = row[tgt] - torch.logsumexp(row[keep], -1)
    return out


def greedy_batch(model, n=6):
    """Prompts and completions whose every token is the model's argmax: inside any top-k or top-p set."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (k,), generator=g).tolist() for k in (3, 5, 2)]
    comps = []
    with torch.no_grad():
        for i, length in enumerate((4, 2, 5, 1, 3, 4)[:n]):
            seq = list(prompts[i // 2])
            for _ in range(length):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            toks = seq[len(prompts[i // 2]):]
            comps.append(Completion(i // 2, tokens=toks, logprobs=[-1.0] * length, mask=[1] * length,
                                    finish_reason="stop"))
    return prompts, comps, group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 2)


@pytest.mark.parametrize("argv", [["--temperature", "0.7"], ["--temperature", "0.7", "--top-k", "5"],
                                  ["--top-p", "0.3"], ["--temperature", "1.3", "--top-k", "8", "--top-p", "0.5"],
                                  ["--correction", "token-tis"]], ids=lambda a: "_".join(x.lstrip("-") for x in a))
def test_the_update_trains_the_distribution_sampled_from_with_its_sampler_weights(argv):
    """--temperature, --top-k and --top-p reach the update's log-probs (the snapshot taken there gives a first
    ratio of exactly 1), and non-trivial sampler weights (--correction) multiply each token's term: the
    gradient update_policy hands the optimizer is that of the objective written from the definitions."""
    import chat_rl
    model = tiny_policy()
    prompts, comps, adv = greedy_batch(model)
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    args = chat_rl.parser.parse_args(["--ppo-epochs", "1", "--minibatches", "1", "--micro-batch-tokens", "16",
                                      "--grad-clip", "0", "--max-new-tokens", "8", *argv])
    logits = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    with torch.no_grad():
        old = sampled_logp(model, b.inputs, b.targets, **logits)
    weights = None
    if args.correction != "none":  # an engine that disagrees with the trainer by up to +-0.5 per token
        engine = old + (torch.rand(old.shape, generator=torch.Generator().manual_seed(4)) - 0.5) * b.mask
        weights = sampler_correction(old, engine, b.mask, args.correction, cap=args.tis_cap)
        assert weights[b.mask > 0].std() > 0.1  # not all 1
    assert len(micro_batches(b.lengths, 16)) > 1
    opt = RecordingOptimizer(model)
    totals = chat_rl.update_policy(model, opt, b, old_logp=old, advantages=adv, weights=weights, step=0,
                                   **chat_rl.update_settings(args))
    assert totals["clip_frac"] == 0 and totals["ratio"] == pytest.approx(totals["tokens"], abs=1e-4)  # r = 1
    r = torch.exp(sampled_logp(model, b.inputs, b.targets, **logits) - old)
    per_tok = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.28) * adv[:, None])
    if weights is not None:
        per_tok = per_tok * weights
    want = torch.autograd.grad((per_tok * b.mask).sum() / b.mask.sum(), opt.params)
    for got, w in zip(opt.steps[0], want):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-4)


def test_kl_kinds_give_different_gradients_to_the_weights():
    """So the test above can tell which estimator reached the weights: on the same batch, k1, k2 and k3 differ."""
    prompts, comps, adv = synthetic_batch()
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    model = tiny_policy()
    logp = model(b.inputs, b.targets)
    ref = (logp.detach() + (torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) - 0.5) * 2.0) * b.mask
    w = model.model.layers[0].mlp.up_proj.weight
    grads = {k: torch.autograd.grad((kl_penalty(logp, ref, k) * b.mask).sum(), w, retain_graph=True)[0]
             for k in ("k1", "k2", "k3")}
    assert not torch.allclose(grads["k1"], grads["k2"], atol=1e-5)
    assert not torch.allclose(grads["k2"], grads["k3"], atol=1e-5)


def test_batch_scale_divides_by_the_whole_batchs_std():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    sd = math.sqrt(((r - r.mean()) ** 2).mean())                 # 0.4330, over all four answers
    torch.testing.assert_close(group_advantages(r, 2, "batch", "grpo"), torch.tensor([0.5, -0.5, 0, 0]) / sd,
                               atol=1e-5, rtol=0)
    assert close(group_advantages(r, 2, "batch", "grpo")[0], 1.1547, 1e-4)
    r = torch.tensor([3.0, 1.0, 0.0, 0.0, 2.0, 0.0])            # the group's std differs from the batch's
    assert not torch.allclose(group_advantages(r, 3, "batch", "rloo"), group_advantages(r, 3, "group", "rloo"))


def test_high_entropy_mask_worked_example_and_trls():
    """rollout.high_entropy_mask: the docstring's example, then TRL 1.16's GRPOTrainer.get_high_entropy_mask (its
    top_entropy_quantile = our top) on random entropies over a padded batch, at several fractions."""
    import os
    from rollout import high_entropy_mask
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOTrainer

    class OneProcess:  # TRL gathers over processes with accelerate; one process gathers itself
        class accelerator:
            pad_across_processes = staticmethod(lambda x, dim, pad_index: x)
            gather = staticmethod(lambda x: x)
    entropy = torch.tensor([[0.1, 0.5, 0.9, 2.0, 0.3, 7.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])  # the last is padding: neither ranked nor kept
    assert high_entropy_mask(entropy, mask, 0.4).tolist() == [[0, 0, 1, 1, 0, 0]]
    torch.manual_seed(0)
    entropy, mask = torch.rand(4, 9) * 3, (torch.rand(4, 9) > 0.3).float()
    for top in (0.05, 0.2, 0.5, 0.8, 1.0):
        trl = GRPOTrainer.get_high_entropy_mask(OneProcess(), entropy, mask, 1 - top)
        assert high_entropy_mask(entropy, mask, top).bool().tolist() == trl.tolist(), top
        assert abs(float(high_entropy_mask(entropy, mask, top).sum()) - top * float(mask.sum())) <= 1


def test_reinforce_pp_advantages_by_hand_and_against_verls():
    """REINFORCE++'s pieces (rollout.token_rewards, returns_to_go, whiten), composed as chat_rl composes them,
    against a hand computation and verl's compute_reinforce_plus_plus_outcome_advantage (written out below from
    verl/trainer/ppo/core_algos.py: returns with gamma 1, then masked_whiten, whose variance is Bessel's: verl's
    advantages are sqrt((n - 1) / n) of ours, n the answer tokens of the batch)."""
    from rollout import returns_to_go, token_rewards, whiten
    # two answers, rewards 1 and 0, of 2 tokens and 1; beta * k1 = 0.1, 0.2 and 0.3 at their tokens
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp, ref = torch.tensor([[0.1, 0.2], [0.3, 0.0]]) * 10, torch.zeros(2, 2)
    rewards, _ = token_rewards(torch.tensor([1.0, 0.0]), logp, ref, mask, beta=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8], [-0.3, 0.0]]))  # the score at the last token
    returns = returns_to_go(rewards, mask)
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.8], [-0.3, 0.0]]))
    adv = whiten(returns, mask)  # mean 0.4, population std sqrt(0.74 / 3) = 0.4967
    torch.testing.assert_close(adv, torch.tensor([[0.6040, 0.8054], [-1.4094, 0.0]]), atol=1e-4, rtol=0)

    def verl(token_level_rewards, response_mask):
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + running_return
            returns[:, t] = running_return
            running_return = running_return * response_mask[:, t]
        mean = (returns * response_mask).sum() / response_mask.sum()
        var = ((returns - mean) ** 2 * response_mask).sum() / response_mask.sum()
        var = var * response_mask.sum() / (response_mask.sum() - 1)  # masked_var(unbiased=True)
        return (returns - mean) * torch.rsqrt(var + 1e-8) * response_mask
    torch.manual_seed(0)
    lengths = torch.tensor([5, 3, 7, 1])
    mask = (torch.arange(8)[None] < lengths[:, None]).float()
    logp, ref = -torch.rand(4, 8) * mask, -torch.rand(4, 8) * mask
    rewards, _ = token_rewards(torch.tensor([1.0, 0.0, 0.5, 1.0]), logp, ref, mask, beta=0.05)
    n = mask.sum()
    torch.testing.assert_close(whiten(returns_to_go(rewards, mask), mask) * ((n - 1) / n) ** 0.5, verl(rewards, mask),
                               atol=1e-5, rtol=1e-5)


def test_an_answer_masked_whole_is_in_no_denominator():
    """A flat group kept by dynamic sampling's last round, or an answer cut at the limit under --mask-truncated, is
    masked whole: it counts in no aggregation's denominator, tokens or answers. Example: answers of 2, 0 (masked)
    and 3 tokens: token-mean divides by 5, the two per-answer aggregations by 2 answers, not 3."""
    from rollout import TrainingBatch, flat_answers, minibatches_of
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]])
    batch = TrainingBatch(*(torch.zeros(3, 3),) * 4, torch.tensor([3, 3, 3]))
    batch.mask = mask
    (mb,) = minibatches_of(batch, step=0, epochs=1, count=1)
    assert (mb.tokens, mb.answers) == (5.0, 2.0)
    empty = TrainingBatch(*(torch.zeros(3, 3),) * 4, torch.tensor([3, 3, 3]))
    assert list(minibatches_of(empty, step=0, epochs=1, count=1)) == []  # nothing to train on any rank: skipped

    assert flat_answers(torch.tensor([1.0, 0, 1, 1, 0.5, 0.5]), 2).tolist() == [False, False, True, True, True, True]


def test_dynamic_sampling_drops_flat_groups_and_fills_the_batch():
    from rollout import dynamic_sampling
    from rollout import Rollouts
    # each round's groups (G = 2), named by (round, index); rewards equal within a group = flat
    plan = {0: [(1, 1), (0, 1), (0, 0), (1, 0)], 1: [(0, 0), (1, 0)], 2: [(1, 1)]}
    asked = []

    def sample_round(round_, n):
        asked.append(n)
        groups = plan[round_][:n]
        rows = [{"id": (round_, i)} for i, gr in enumerate(groups) for _ in gr]
        comps = [Completion(0, tokens=[1]) for gr in groups for _ in gr]
        return Rollouts(rows, [[1]] * len(rows), comps, torch.tensor([float(x) for gr in groups for x in gr]),
                        group_size=2)

    out, counts = dynamic_sampling(sample_round, 4, 3)
    kept = [r["id"] for r in out.rows[::2]]
    # round 0 keeps its 2 mixed groups, round 1 its 1 mixed group, the last round keeps what it drew, flat or not
    assert kept == [(0, 1), (0, 3), (1, 1), (2, 0)] and asked == [4, 2, 1]
    assert counts == {"groups": 7, "flat": 4} and out.rewards.tolist() == [0, 1, 1, 0, 1, 0, 1, 1]
    # without dynamic sampling (one round) every group is kept as drawn
    out, counts = dynamic_sampling(sample_round, 4, 1)
    assert [r["id"] for r in out.rows[::2]] == [(0, 0), (0, 1), (0, 2), (0, 3)] and counts["flat"] == 2


def test_rollout_stats_count_tool_use_and_accuracy_with_and_without_a_call():
    from rollout import Rollouts
    comps = [Completion(0, tokens=[1] * n, tool_calls=calls, tool_errors=errors, finish_reason="stop")
             for n, calls, errors in ((5, 2, 0), (3, 0, 0), (7, 3, 1), (4, 0, 0))]
    s = Rollouts(rows=[{}] * 4, prompts=[[0]] * 4, completions=comps, rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]),
                 group_size=4).stats()
    # answers 1 and 3 called the tool (one right, one wrong, one error), answers 2 and 4 did not (one right)
    assert (s["tool_answers"], s["tool_calls"], s["tool_errors"]) == (2.0, 5.0, 1.0)
    assert (s["correct"], s["correct_with_tool"], s["length_sum"]) == (2.0, 1.0, 19.0)


def test_the_paper_grpo_command_computes_the_papers_objective():
    """docs/rl.md's paper GRPO command, its update on the enumerable world: the gradient handed to the optimizer is
    that of DeepSeekMath's equation (3) (arXiv:2402.03300) over a group of G answers, written out here from the
    paper: J = 1/G sum_i 1/|o_i| sum_t [min(r A_i, clip(r, 0.8, 1.2) A_i) - 0.04 (q/p - log(q/p) - 1)], r = p / p_old,
    q the reference, A_i the group-normalized reward (population std), the loss -J."""
    import exact
    from chat_rl import group_advantages, parser, update_policy, update_settings
    from rollout import TrainingBatch
    command = next(line for line in open(os.path.join(REPO, "docs", "rl.md")) if "--kl-kind k3" in line
                   and line.startswith("python chat_rl.py"))
    args = parser.parse_args(command.split()[2:] + ["--ppo-epochs", "1", "--minibatches", "1", "--grad-clip", "0",
                                                     "--max-new-tokens", str(exact.MAX_LEN)])
    assert (args.agg, args.eps_low, args.eps_high, args.kl_beta, args.kl_kind, args.dynamic_sampling,
            args.correction) == ("seq-mean-token-mean", 0.2, 0.2, 0.04, "k3", False, "none")
    model, G = exact.tiny_policy(), 8
    ref = exact.perturbed(model, 0.3, seed=4)
    with torch.no_grad():  # the snapshot that sampled, off the current weights so that some ratios clip
        old_model = exact.perturbed(model, 0.05, seed=5)
        batch, old = exact.sample(exact.token_logprobs(old_model), G, torch.Generator().manual_seed(0))
        ref_logp = exact.token_logprobs(ref, batch).float()
    old, mask = old.float(), batch.mask.float()
    adv = group_advantages(batch.rewards.float(), G, args.scale, args.estimator)
    tb = TrainingBatch(batch.inputs, batch.targets, mask, old, mask.sum(-1).long())
    opt = RecordingOptimizer(model)
    update_policy(model, opt, tb, old_logp=old, advantages=adv, ref_logp=ref_logp, step=0, **update_settings(args))

    logp = model(batch.inputs, batch.targets)
    r, a = torch.exp(logp - old), adv[:, None]
    surrogate = torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    log_q_over_p = ref_logp - logp
    k3 = torch.exp(log_q_over_p) - log_q_over_p - 1
    J = (((surrogate - 0.04 * k3) * mask).sum(-1) / mask.sum(-1)).mean()
    want = torch.autograd.grad(-J, opt.params)
    assert ((r > 1.2) | (r < 0.8))[mask > 0].any() and (adv != 0).any()  # the clip and the advantages act
    assert len(set(mask.sum(-1).tolist())) > 1  # answers of several lengths: per-answer means differ from token-mean
    for got, w in zip(opt.steps[0], want):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-4)


def test_one_ratio_and_one_clip_fraction_for_both_surrogates():
    """rollout.importance_ratio and clipped_surrogate, shared by chat_rl and chat_ppo: the log-ratio clamped to
    [-20, 20] before exp (where the clamp binds), and the clip fraction counting the tokens where the clipped side
    wins (verl's), not every ratio out of range (CleanRL's): a negative advantage with r = 1.5 is out of range,
    but its unclipped side is the larger loss and its gradient flows."""
    from rollout import clipped_surrogate, importance_ratio
    r = importance_ratio(torch.tensor([-25.0, 0.1, 30.0]))
    torch.testing.assert_close(r, torch.tensor([math.exp(-20), math.exp(0.1), math.exp(20)]))
    loss, binds = clipped_surrogate(torch.tensor([1.5, 1.5, 0.5, 1.1]), torch.tensor([1.0, -1.0, -1.0, 1.0]), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 1.5, 0.8, -1.1]))
    assert binds.tolist() == [True, False, True, False]
