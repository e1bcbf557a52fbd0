"""chat_distill.py: the advantage's worked example; exactly 0 when the student is the teacher; by exact
enumeration of every sequence, the expected policy gradient equals the gradient of the analytic reverse KL;
GKD's generalized JSD against its worked example and TRL's, and in chunks equal to whole logits; 2 ranks give
one process's gradient; the real loop lowers the reverse KL to a teacher (on-policy, gkd and kd, on 1 and 2
ranks); a teacher with another tokenizer is refused."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from chat_distill import generalized_jsd, gkd_loss, kd_loss, reverse_kl_advantages
from chat_rl import policy_loss
from common import cleanup_dist
from engine import Completion
from model import GPT, GPTConfig
from rollout import batch_logprobs, training_batch
from checkpoint import save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_advantages_worked_example():
    student = torch.tensor([[-0.10, -2.00, -0.50, 0.0]])
    teacher = torch.tensor([[-0.30, -0.70, -0.50, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last column is padding: no reward, no advantage
    torch.testing.assert_close(reverse_kl_advantages(teacher, student, mask), torch.tensor([[-0.20, 1.30, 0.00, 0.0]]))
    torch.testing.assert_close(reverse_kl_advantages(teacher, student, mask, discount=0.5),
                               torch.tensor([[0.45, 1.30, 0.00, 0.0]]))
    # discount 1: each token's advantage is the sum of its own reward and every later one
    torch.testing.assert_close(reverse_kl_advantages(teacher, student, mask, discount=1.0),
                               torch.tensor([[1.10, 1.30, 0.00, 0.0]]))


def test_kd_loss_worked_example():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    assert abs(float(kd_loss(logp, torch.ones(1, 3), 3.0)) - 0.8026) < 1e-4


def test_generalized_jsd_worked_example():
    student, teacher = torch.tensor([[0.5, 0.5]]).log(), torch.tensor([[0.9, 0.1]]).log()
    for beta, expected in ((0.5, 0.1017), (0.0, 0.3681), (1.0, 0.5108), (0.9, 0.0431)):
        assert abs(float(generalized_jsd(student, teacher, beta)) - expected) < 1e-4, beta
    assert float(generalized_jsd(teacher, teacher, 0.5).abs()) < 1e-7  # the same distribution: no divergence


def trl_gkd_loss(student_logits, teacher_logits, labels, beta, temperature):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (batchmean over the labelled positions)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer
    return GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=beta,
                                           temperature=temperature)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_gkd_loss_equals_trls_in_value_and_gradient(beta):
    """gkd_loss from hidden states and heads, in chunks of 2 positions, against TRL's loss over whole (B, T, V)
    logits with -100 labels where nothing is graded, at temperature 0.7: value and gradients to 1e-6."""
    torch.manual_seed(0)
    B, T, C, V = 2, 5, 8, 11
    h_s, h_t = torch.randn(B, T, C, requires_grad=True), torch.randn(B, T, C)
    w_s, w_t = torch.randn(V, C, requires_grad=True), torch.randn(V, C) * 3
    labels = torch.tensor([[-100, 3, 4, -100, 7], [-100, -100, 1, 2, -100]])
    graded = labels >= 0
    ours = gkd_loss(h_s[graded], w_s, h_t[graded], w_t, beta=beta, normalizer=graded.sum(), temperature=0.7,
                    chunk_elements=2 * V)
    ours_grads = torch.autograd.grad(ours, (h_s, w_s))
    trl = trl_gkd_loss(h_s @ w_s.T, h_t @ w_t.T, labels, beta, 0.7)
    trl_grads = torch.autograd.grad(trl, (h_s, w_s))
    torch.testing.assert_close(ours, trl, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours_grads, trl_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, head_dim=8,
                         intermediate_size=32, max_seq_len=64))


def test_student_equal_to_teacher_gives_exactly_zero_advantage_and_gradient():
    student = tiny_policy()
    teacher = copy.deepcopy(student).eval().requires_grad_(False)  # as the script loads it: frozen, float32 on CPU
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (3, 6)]
    comps = [Completion(i % 2, tokens=torch.randint(1, 50, (n,), generator=g).tolist(), logprobs=[-1.0] * n,
                        mask=[1] * n, finish_reason="stop") for i, n in enumerate((5, 2, 7))]
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    adv = reverse_kl_advantages(batch_logprobs(teacher, b, 64), batch_logprobs(student, b, 64), b.mask, discount=0.9)
    assert torch.equal(adv, torch.zeros_like(adv))
    logp = student(b.inputs, b.targets)
    loss, _ = policy_loss(logp, logp.detach(), adv, b.mask)
    loss.backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in student.parameters())


# ------------------------------------------------------------------------------------------------
# Exact enumeration: answers of 2 tokens over a vocabulary of 3, a tabular student (one softmax for the
# first token, one per first token for the second) and a fixed teacher of the same form

V = 3


def tabular_logps(first_logits, second_logits):
    """log p(a) (V,) and log p(b | a) (V, V)."""
    return torch.log_softmax(first_logits, -1), torch.log_softmax(second_logits, -1)


def expected_policy_gradient(params, teacher, discount):
    """sum over every answer (a, b) of p_student(a, b) * the gradient of its policy loss, with the advantages of
    reverse_kl_advantages, ratio 1 (the first pass): the exact expectation of what a sampled batch estimates."""
    s1, s2 = tabular_logps(*params)
    t1, t2 = teacher
    total = 0
    for a in range(V):
        for b in range(V):
            student_logp = torch.stack([s1[a], s2[a, b]]).view(1, 2)
            teacher_logp = torch.stack([t1[a], t2[a, b]]).view(1, 2)
            mask = torch.ones(1, 2)
            adv = reverse_kl_advantages(teacher_logp, student_logp.detach(), mask, discount)
            loss, _ = policy_loss(student_logp, student_logp.detach(), adv, mask, normalizer=1.0)  # the token sum
            total = total + (s1[a] + s2[a, b]).exp().detach() * loss
    return torch.autograd.grad(total, params)


def test_expected_policy_gradient_equals_the_analytic_reverse_kl_gradient():
    torch.manual_seed(0)
    params = (torch.randn(V, requires_grad=True), torch.randn(V, V, requires_grad=True))
    teacher = tabular_logps(torch.randn(V), torch.randn(V, V))
    s1, s2 = tabular_logps(*params)
    t1, t2 = teacher
    # the sequence-level reverse KL, written out: sum over (a, b) of p(a, b) (log p(a, b) - log q(a, b))
    seq_kl = sum((s1[a] + s2[a, b]).exp() * (s1[a] + s2[a, b] - t1[a] - t2[a, b]) for a in range(V) for b in range(V))
    # each position's KL, the first token's distribution weighting the second position held fixed
    per_position_kl = (s1.exp() * (s1 - t1)).sum() + \
        sum(s1[a].exp().detach() * (s2[a].exp() * (s2[a] - t2[a])).sum() for a in range(V))
    want_seq = torch.autograd.grad(seq_kl, params, retain_graph=True)
    want_pos = torch.autograd.grad(per_position_kl, params)
    got_seq = expected_policy_gradient(params, teacher, discount=1.0)
    got_pos = expected_policy_gradient(params, teacher, discount=0.0)
    for got, want in zip(got_seq, want_seq):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for got, want in zip(got_pos, want_pos):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # and the two differ: discount 0 leaves out how the first token changes what the second one costs
    assert not torch.allclose(got_seq[0], got_pos[0], atol=1e-3)
    torch.testing.assert_close(got_seq[1], got_pos[1])  # the second token has no future: the same


# ------------------------------------------------------------------------------------------------
# DDP: 2 gloo ranks holding uneven shares of the answers (so batches padded to different lengths) give one
# process's gradient of the distillation loss with per-token advantages

def synthetic_answers():
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (3, 7, 4)]
    return prompts, [Completion(i % 3, tokens=torch.randint(1, 50, (n,), generator=g).tolist(), logprobs=[-1.0] * n,
                                mask=[1] * n, finish_reason="stop") for i, n in enumerate((5, 2, 9, 1, 6, 3))]


def distill_grad(answers):
    from common import all_reduce_sum, init_dist, wrap_model
    init_dist("cpu")
    prompts, comps = synthetic_answers()
    comps = [comps[i] for i in answers]
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    student, teacher = tiny_policy(0), tiny_policy(1).requires_grad_(False)
    ddp = wrap_model(student)
    logp = ddp(b.inputs, b.targets)
    adv = reverse_kl_advantages(batch_logprobs(teacher, b, 64), logp.detach(), b.mask, discount=0.5)
    loss, _ = policy_loss(logp, logp.detach(), adv, b.mask, normalizer=all_reduce_sum(float(b.mask.sum())))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in student.parameters()])


def _rank(rank, world, init_file, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.save(distill_grad([0, 1] if rank == 0 else [2, 3, 4, 5]), os.path.join(out_dir, f"grad{rank}.pt"))
    cleanup_dist()  # collects the DDP wrapper first (else gloo can abort at teardown)


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
def test_two_ranks_equal_one(tmp_path):
    import torch.multiprocessing as mp
    single = distill_grad(range(6))
    procs = [mp.get_context("spawn").Process(target=_rank, args=(r, 2, str(tmp_path / "init"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for r in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"grad{r}.pt"), single, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# The real loop, tiny: a near-uniform student and a sharp random teacher

@pytest.fixture(scope="module")
def models(tok, tmp_path_factory):
    """A sharp random teacher, and a student whose matrices are 0.8 of another random model's and 0.2 of the
    teacher's: it starts with a reverse KL to the teacher of ~0.9 nats per token."""
    root = tmp_path_factory.mktemp("distill")
    config = GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                       intermediate_size=64, max_seq_len=512)
    torch.manual_seed(1)
    teacher = GPT(config)
    with torch.no_grad():  # tied embeddings: the logits grow 10x (the inputs are RMS-normed), a sharp teacher
        teacher.model.embed_tokens.weight.mul_(10)
    save_hf(teacher, str(root / "teacher"), tok)
    torch.manual_seed(0)
    student = GPT(config)
    with torch.no_grad():
        for s, t in zip(student.parameters(), teacher.parameters()):
            if s.dim() > 1:
                s.mul_(0.8).add_(0.2 * t)
    save_hf(student, str(root / "student"), tok)
    return str(root / "student"), str(root / "teacher")


def distill_run(home, student, teacher, *extra, nproc=1):
    args = [os.path.join(REPO, "chat_distill.py"), "--init", student, "--teacher", teacher, "--num-prompts", "32",
            "--steps", "30", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--max-new-tokens", "16",
            "--eval-problems", "64", "--pass-k", "1", "--eval-every", "15", "--save-every", "100", "--lr", "1e-2",
            "--warmup-steps", "0", *extra]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(home, "distill", "default", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("mode,nproc", [("on-policy", 1), ("gkd", 1), pytest.param("kd", 1, marks=pytest.mark.slow),
                                       pytest.param("on-policy", 2, marks=pytest.mark.slow)])
def test_distillation_moves_the_student_towards_the_teacher(tmp_path, models, mode, nproc):
    rows = distill_run(tmp_path, *models, "--mode", mode, nproc=nproc)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    evals = [r["eval/reverse_kl"] for r in rows if "eval/reverse_kl" in r]
    assert len(evals) == 3 and all(math.isfinite(x) for x in evals)
    assert "teacher/pass@1" in rows[0]
    # the held-out reverse KL to the teacher, per token of the student's own answers, falls by a third
    assert evals[-1] < 0.67 * evals[0], evals
    name = "forward_kl" if mode == "kd" else "reverse_kl"  # and the training batches' own estimate
    first, last = (sum(r[name] for r in part) / 5 for part in (steps[:5], steps[-5:]))
    assert last < 0.8 * first, [r[name] for r in steps]
    assert os.path.isfile(tmp_path / "distill" / "default" / "eval.json")


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, models, tok):
    from tokenizer import Tokenizer
    other = Tokenizer.train(["a b c 1 2 3"] * 10, vocab_size=300)
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=other.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(tmp_path / "other"), other)
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_distill.py"), "--init", models[0], "--teacher",
                        str(tmp_path / "other")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "tokenizer differs" in r.stderr
