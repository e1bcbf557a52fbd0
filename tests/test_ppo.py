"""chat_ppo.py: the GAE table (gamma 1, lambda 0.95); the per-token reward shape; the clipped value loss by hand; whitening;
the adaptive KL controller; a second PPO epoch sees exp(new - old snapshot) != 1; 2 gloo ranks with uneven
lengths give one rank's actor and critic gradients; the real loop runs on 1 process and on 2 ranks."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from chat_ppo import (adaptive_kl_beta, explained_variance, gae, ppo_losses, token_rewards, value_loss, whiten)
from common import cleanup_dist
from rollout import training_batch
from engine import Completion
from model import GPT, GPTConfig
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(a, b, tol=5e-6):
    a, b = (v.detach() if isinstance(v, torch.Tensor) else v for v in (a, b))
    return abs(float(a) - float(b)) < tol


# ------------------------------------------------------------------------------------------------
# GAE

SEED_R = [0.0, 0.0, 0.0, 0.0, 1.0]
SEED_V = [0.50, 0.55, 0.60, 0.70, 0.80]
SEED_A = [0.436389, 0.406725, 0.375500, 0.290000, 0.200000]


def test_gae_worked_table():
    adv, ret = gae(torch.tensor([SEED_R]), torch.tensor([SEED_V]), torch.ones(1, 5), gamma=1.0, lam=0.95)
    for got, want in zip(adv[0], SEED_A):
        assert close(got, want)
    for got, a, v in zip(ret[0], SEED_A, SEED_V):
        assert close(got, a + v)
    # lam = 1: every advantage is the final reward minus the value (Monte Carlo); lam = 0: one-step TD
    mc, _ = gae(torch.tensor([SEED_R]), torch.tensor([SEED_V]), torch.ones(1, 5), lam=1.0)
    assert torch.allclose(mc[0], 1 - torch.tensor(SEED_V))
    td, _ = gae(torch.tensor([SEED_R]), torch.tensor([SEED_V]), torch.ones(1, 5), lam=0.0)
    assert torch.allclose(td[0], torch.tensor([0.05, 0.05, 0.10, 0.10, 0.20]))


def test_gae_tokens_outside_the_mask_neither_receive_nor_pass_credit():
    """The GAE table's answer laid out after a 2-token prompt, with 2 forced tool tokens in the middle and
    right padding, next to a shorter answer: the answer tokens get exactly the table's advantages, and
    whatever reward or value sits outside the mask changes nothing."""
    T = 11
    mask = torch.zeros(2, T)
    cols = [2, 3, 4, 7, 8]                      # prompt 0-1, answer 2-4, forced 5-6, answer 7-8, padding 9-10
    mask[0, cols] = 1
    mask[1, 1:3] = 1
    rewards, values = torch.zeros(2, T), torch.zeros(2, T)
    rewards[0, cols], values[0, cols] = torch.tensor(SEED_R), torch.tensor(SEED_V)
    rewards[1, 2], values[1, 1:3] = 0.5, torch.tensor([0.1, 0.2])
    adv, ret = gae(rewards, values, mask)
    assert torch.allclose(adv[0, cols], torch.tensor(SEED_A), atol=1e-6)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    assert torch.allclose(adv[1, 1:3], torch.tensor([0.1 + 0.95 * 0.3, 0.3]), atol=1e-6)
    noisy_r, noisy_v = rewards.clone(), values.clone()
    noisy_r[mask == 0] = torch.randn(int((mask == 0).sum()))
    noisy_v[mask == 0] = torch.randn(int((mask == 0).sum()))
    adv2, ret2 = gae(noisy_r, noisy_v, mask)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


# ------------------------------------------------------------------------------------------------
# Rewards: the score at the last answer token, -beta * KL at every answer token

def test_token_rewards_score_at_last_answer_token_and_kl_everywhere():
    logp = torch.tensor([[-9.0, -1.0, -2.0, -0.5, -7.0, -7.0], [-9.0, -9.0, -1.0, -1.5, -7.0, -7.0]])
    ref = torch.tensor([[-3.0, -1.2, -2.1, -1.3, -1.0, -1.0], [-3.0, -3.0, -1.5, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[0., 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])  # prompt, answer, padding
    scores = torch.tensor([1.0, -0.5])
    r, kl = token_rewards(scores, logp, ref, mask, beta=0.1)
    k1 = (logp - ref) * mask
    assert torch.allclose(kl, k1)
    want = -0.1 * k1
    want[0, 3] += 1.0
    want[1, 3] -= 0.5
    assert torch.allclose(r, want)
    assert torch.all(r[mask == 0] == 0)                       # nothing lands on prompt or padding
    assert close(r[0, 3], 1.0 - 0.1 * 0.8)                    # the last token carries score and its own KL
    # three tokens: k1 0.2, 0.1, 0.8 at beta 0.1 -> -0.02, -0.01, +0.92
    r3, _ = token_rewards(torch.tensor([1.0]), torch.tensor([[0.2, 0.1, 0.8]]), torch.zeros(1, 3), torch.ones(1, 3), 0.1)
    assert torch.allclose(r3, torch.tensor([[-0.02, -0.01, 0.92]]))
    # a row with no trained token gets nothing at all
    r0, _ = token_rewards(torch.tensor([1.0]), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), 0.1)
    assert torch.all(r0 == 0)


def test_rewards_follow_the_training_batch_layout():
    """Through training_batch: the score lands on the position whose target is the answer's last token."""
    prompts = [[5, 6, 7], [8, 9]]
    c0 = Completion(0, tokens=[10, 11, 12, 13], logprobs=[-.1, 0, 0, -.4], mask=[1, 0, 0, 1], finish_reason="stop")
    c1 = Completion(1, tokens=[20, 21], logprobs=[-.2, -.3], mask=[1, 1], finish_reason="stop")
    b = training_batch(prompts, [c0, c1], 0, "cpu")
    m = b.mask
    r, _ = token_rewards(torch.tensor([1.0, 0.5]), torch.zeros_like(m), torch.zeros_like(m), m, 0.1)
    assert b.targets[0, r[0].nonzero().item()] == 13 and b.targets[1, r[1].nonzero().item()] == 21


def test_adaptive_kl_controller():
    assert close(adaptive_kl_beta(0.1, 9.0, 6.0, 10000, 64), 0.100128, 1e-9)   # error +0.5 clipped to +0.2
    assert close(adaptive_kl_beta(0.1, 3.0, 6.0, 10000, 64), 0.099872, 1e-9)   # error -0.5 clipped to -0.2
    assert close(adaptive_kl_beta(0.1, 6.6, 6.0, 1000, 100), 0.1 * (1 + 0.1 * 0.1), 1e-9)
    assert adaptive_kl_beta(0.1, 6.0, 6.0, 10000, 64) == 0.1


# ------------------------------------------------------------------------------------------------
# The clipped value loss, by hand

def test_value_loss_by_hand():
    old, new = torch.tensor([[0.5]]), torch.tensor([[0.9]])
    m = torch.ones(1, 1)
    # R = 1.0: unclipped 0.01, clipped (0.7 - 1)^2 = 0.09 binds; no gradient (the clip froze the value)
    v = new.clone().requires_grad_(True)
    loss, st = value_loss(v, old, torch.tensor([[1.0]]), m, clip=0.2)
    loss.backward()
    assert close(loss, 0.045) and st["clip_frac"] == 1.0 and v.grad.item() == 0
    # R = 0.6: unclipped 0.09 binds over clipped 0.01; gradient V - R = 0.3
    v = new.clone().requires_grad_(True)
    loss, st = value_loss(v, old, torch.tensor([[0.6]]), m, clip=0.2)
    loss.backward()
    assert close(loss, 0.045) and st["clip_frac"] == 0.0 and close(v.grad, 0.3)
    # no clip: plain 0.5 (V - R)^2
    assert close(value_loss(new, old, torch.tensor([[1.0]]), m, clip=0)[0], 0.005)
    # token-mean over the mask, or over a given (global) normalizer
    vals, olds = torch.tensor([[0.9, 0.1, 5.0]]), torch.tensor([[0.5, 0.1, 0.0]])
    rets, mask = torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    want = 0.5 * (0.09 + 0.16)
    assert close(value_loss(vals, olds, rets, mask)[0], want / 2)
    assert close(value_loss(vals, olds, rets, mask, normalizer=10.0)[0], want / 10)


def test_whiten_and_explained_variance():
    a, _ = gae(torch.tensor([SEED_R]), torch.tensor([SEED_V]), torch.ones(1, 5))
    w = whiten(a, torch.ones(1, 5))
    for got, want in zip(w[0], [1.0992, 0.7547, 0.3922, -0.6005, -1.6455]):
        assert close(got, want, 1e-4)
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [5.0, -50.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    w = whiten(x, mask)
    on = w[mask == 1]
    assert close(on.mean(), 0.0, 1e-6) and close(on.var(unbiased=False), 1.0, 1e-5)
    assert torch.all(w[mask == 0] == 0)
    r = torch.tensor([[1.0, 2.0, 3.0]])
    assert close(explained_variance(r, r, torch.ones(1, 3)), 1.0)
    assert close(explained_variance(torch.full((1, 3), 2.0), r, torch.ones(1, 3)), 0.0)


# ------------------------------------------------------------------------------------------------
# Two PPO epochs: the second pass sees exp(new - old snapshot) != 1 (trl#2769, #5413)

def tiny(head="lm", seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, head_dim=8,
                         intermediate_size=32, max_seq_len=64, head=head))


def synthetic_batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (int(n),), generator=g).tolist() for n in (3, 7, 4)]
    comps = []
    for i, n in enumerate((5, 2, 9, 1, 6, 3)):
        toks = torch.randint(1, 50, (n,), generator=g).tolist()
        comps.append(Completion(i // 2, tokens=toks, logprobs=[-1.0] * n, mask=[1] * n, finish_reason="stop"))
    return prompts, comps, torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])


def prepare(actor, critic, ref, prompts, comps, scores, beta=0.1):
    """The loop's steps 2-3: snapshot, rewards, GAE, whitening (global over ranks)."""
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    x, y, m = b.inputs, b.targets, b.mask
    with torch.no_grad():
        old_logp, ref_logp, old_v = actor(x, y), ref(x, y), critic(x) * m
    rewards, _ = token_rewards(scores, old_logp, ref_logp, m, beta)
    adv, ret = gae(rewards, old_v, m)
    return x, y, m, old_logp, old_v, whiten(adv, m), ret


def test_second_epoch_uses_the_snapshot_ratio():
    actor, critic = tiny(), tiny("scalar", 1)
    ref = tiny().requires_grad_(False)
    with torch.no_grad():  # a reference apart from the actor, so the KL term is not zero
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts, comps, scores = synthetic_batch()
    x, y, m, old_logp, old_v, adv, ret = prepare(actor, critic, ref, prompts, comps, scores)
    opt = torch.optim.SGD(list(actor.parameters()) + list(critic.parameters()), lr=0.5)
    ratios = []
    for epoch in range(2):
        pg, vl, st = ppo_losses(actor, critic, x, y, m, old_logp=old_logp, old_values=old_v, advantages=adv,
                                returns=ret, normalizer=float(m.sum()))
        ratios.append(st["ratio_sum"] / m.sum().item())
        (pg + vl).backward()
        opt.step()
        opt.zero_grad()
    assert ratios[0] == 1.0                                   # the first pass: the policy that sampled
    with torch.no_grad():
        want = (torch.exp(actor(x, y) - old_logp) * m).sum() / m.sum()
    assert ratios[1] != 1.0
    # the snapshot is still the one from before the first update: recompute the second pass's ratio
    pg, _, st = ppo_losses(actor, critic, x, y, m, old_logp=old_logp, old_values=old_v, advantages=adv, returns=ret,
                           normalizer=float(m.sum()))
    assert close(st["ratio_sum"] / m.sum().item(), want, 1e-5)


# ------------------------------------------------------------------------------------------------
# DDP: 2 gloo ranks, uneven lengths and an uneven split, give one rank's actor and critic gradients

def grads_of(prompts, comps, scores):
    from common import all_reduce_sum, init_dist, wrap_model
    init_dist("cpu")
    actor, critic, ref = tiny(), tiny("scalar", 1), tiny(seed=2)
    x, y, m, old_logp, old_v, adv, ret = prepare(actor, critic, ref, prompts, comps, scores)
    norm = all_reduce_sum(float(m.sum()))
    old_logp = old_logp - 0.05  # a ratio away from 1, so clipping is exercised
    old_v = old_v + 0.3 * m     # and values away from their snapshot
    ddp_actor, ddp_critic = wrap_model(actor), wrap_model(critic)  # DistributedDataParallel under 2 ranks
    pg, vl, _ = ppo_losses(ddp_actor, ddp_critic, x, y, m, old_logp=old_logp, old_values=old_v,
                           advantages=adv, returns=ret, normalizer=norm, value_clip=0.2, entropy_coef=0.01)
    (pg + vl).backward()
    return [torch.cat([p.grad.flatten() for p in net.parameters()]) for net in (actor, critic)]


def _rank(rank, world, init_file, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    prompts, comps, scores = synthetic_batch()
    mine = [i for i in range(len(comps)) if (i < 2) == (rank == 0)]  # rank 0: 2 answers, rank 1: 4
    g = grads_of(prompts, [comps[i] for i in mine], scores[mine])
    torch.save(g, os.path.join(out_dir, f"grad{rank}.pt"))
    cleanup_dist()  # collects the DDP wrapper first (else gloo can abort at teardown)


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
def test_two_ranks_with_uneven_lengths_equal_one_rank(tmp_path):
    prompts, comps, scores = synthetic_batch()
    single = grads_of(prompts, comps, scores)
    assert all(g.abs().sum() > 0 for g in single)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for r in range(2):
        got = torch.load(tmp_path / f"grad{r}.pt")
        for g, want in zip(got, single):
            torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# The real loop, tiny: one process (critic from an RM, 2 epochs, tools, adaptive KL), and 2 ranks

LOGGED = ["reward", "kl", "kl_beta", "value_loss", "policy_loss", "explained_var", "clip_frac", "value_clip_frac",
          "entropy", "length_mean", "length_max", "sample_tok_per_s", "train_tok_per_s", "tok_per_s",
          "train_seconds", "peak_mem_mb", "ratio_mean"]


@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("sft")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def ppo_run(home, init, *extra, nproc=1):
    args = [os.path.join(REPO, "chat_ppo.py"), "--init", init, "--num-prompts", "32", "--steps", "2",
            "--prompts-per-step", "4", "--samples-per-prompt", "2", "--max-new-tokens", "24",
            "--eval-problems", "4", "--pass-k", "2", "--eval-every", "100", "--save-every", "100", *extra]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(home, "ppo", "default", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], r.stdout


def test_loop_runs_with_critic_from_rm(tmp_path, tiny_chat, tok):
    rm = load_hf(tiny_chat, head="scalar")
    torch.nn.init.normal_(rm.score.weight, std=0.5)  # a trained RM's head is not zero
    save_hf(rm, str(tmp_path / "rm" / "default"), tok)
    rows, out = ppo_run(tmp_path, tiny_chat, "--ppo-epochs", "2", "--tools", "--kl-target", "1.0",
                        "--kl-horizon", "100", "--truncated-reward", "-0.5", "--freeze-actor-steps", "1",
                        "--reward", f"rm:{tmp_path / 'rm' / 'default'}")
    assert f"from {tmp_path / 'rm' / 'default'}" in out
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(k in r and math.isfinite(r[k]) for k in LOGGED), sorted(set(LOGGED) - set(r))
        assert r["logprob_mismatch"] < 1e-4                       # engine and trainer agree
    assert steps[0]["value_mean"] != 0                            # the RM's head, not a fresh one
    # the adaptive controller: after each step, beta <- beta (1 + clip(KL / target - 1, +-0.2) x answers / horizon),
    # KL per answer against the target 1.0, 8 answers per step over a horizon of 100
    beta = 0.05
    for r in steps:
        beta *= 1 + max(-0.2, min(0.2, r["kl_per_answer"] / 1.0 - 1)) * 8 / 100
        assert abs(r["kl_beta"] - beta) < 1e-9, (r["kl_beta"], beta)
    assert steps[1]["kl_beta"] != 0.05
    assert steps[1]["ratio_mean"] != 1.0                          # the actor trained on step 2, 2 epochs
    assert rows[-1]["eval/pass@1"] >= 0 and "eval/pass@1_t1" in rows[-1]
    assert os.path.isfile(tmp_path / "ppo" / "default" / "eval.json")
    assert os.path.isfile(tmp_path / "ppo" / "default" / "critic" / "checkpoints" / "step_000002" / "config.json")


@pytest.mark.slow
def test_no_eval_before_train_skips_step_0_and_changes_nothing_else(tmp_path, tiny_chat):
    """As in GRPO (tests/test_rl.py): without step 0's evaluation every step and the final evaluation are the same."""
    timed = ("time", "seconds", "_per_s", "peak_mem")
    with_eval, _ = ppo_run(tmp_path / "a", tiny_chat, "--freeze-actor-steps", "0")
    without, _ = ppo_run(tmp_path / "b", tiny_chat, "--freeze-actor-steps", "0", "--no-eval-before-train")
    assert [r["step"] for r in with_eval] == [0, 1, 2] and "eval/pass@1" in with_eval[0]
    assert [r["step"] for r in without] == [1, 2]
    numbers = [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in with_eval[1:]]
    assert numbers == [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in without]


@pytest.mark.slow
def test_loop_on_two_ranks_without_rm_and_time_budget(tmp_path, tiny_chat):
    rows, out = ppo_run(tmp_path, tiny_chat, "--time-budget", "0.001", "--freeze-actor-steps", "0", nproc=2)
    assert "no reward model at" in out                            # the fallback is said out loud
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1]                      # the budget stopped it after one step
    assert steps[0]["value_mean"] == 0                            # a fresh value head predicts 0
    assert "eval/pass@1" in steps[0]


@pytest.mark.slow
def test_target_kl_stops_every_rank_at_the_same_update_and_each_reward_part_is_logged(tmp_path, tiny_chat):
    """--target-kl on 2 ranks: each step's first update sees the sampling policy itself (approximate KL 0),
    the second one a policy moved by one step, past 1e-9: the remaining updates are skipped, on both ranks
    alike (the KL is all-reduced, or the ranks would wait in different collectives). A random model's
    answers all score 0, so the entropy bonus is what moves it. --reward's weighted sum is logged part by part."""
    rows, _ = ppo_run(tmp_path, tiny_chat, "--ppo-epochs", "2", "--minibatches", "2", "--freeze-actor-steps", "0", "--warmup-steps", "0", "--entropy-coef", "0.1",
                      "--target-kl", "1e-9", "--reward", "verifier+0.5*format", nproc=2)
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2 and all(r["updates"] == 2 for r in steps)  # of the 4 that 2 epochs x 2 minibatches make
    for r in steps:
        assert math.isclose(r["reward"], r["reward/verifier"] + 0.5 * r["reward/format"], abs_tol=1e-6)
