"""exact.py, the enumerable world (15 answers of the project's GPT over {a, b, end}), and exact comparisons
through it: every expectation below is a finite sum over answers, or over every group of G answers (15^G of
them), weighted by its probability. chat_rl's functions are taken through the stage module, as the stage
calls them. Exact up to float32 rounding: the model computes its log-probs in float32."""
import itertools
import math

import pytest
import torch

import chat_rl
import exact
import packing
from exact import ANSWERS, END, EVERY, LENGTHS, MAX_LEN, REWARDS

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy():
    return exact.tiny_policy()


@pytest.fixture(scope="module")
def jacobian(policy):
    return exact.logprob_jacobian(policy)


def cosine(u, v):
    return float(u @ v / (u.norm() * v.norm()))


# ------------------------------------------------------------------------------------------------
# The world itself

def test_fifteen_answers_seven_finished_eight_cut_off():
    assert len(ANSWERS) == len(set(ANSWERS)) == 15
    assert int(exact.FINISHED.sum()) == 7 and all(len(y) == MAX_LEN for y in ANSWERS[7:])
    assert all(END not in y[:-1] for y in ANSWERS)  # `end` only ever closes an answer
    assert exact.NAMES[:3] == ["end", "a end", "b end"] and exact.NAMES[-1] == "b b b"
    assert REWARDS.tolist()[:7] == [0.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.5] and REWARDS[7:].abs().sum() == 0
    assert sorted(set(LENGTHS.tolist())) == [1, 2, 3]


def test_the_docstring_numbers(policy):
    """tiny_policy's docstring, and IGNORE is packing's (exact.py may import only model.py)."""
    p = exact.answer_probs(policy).detach()
    assert round(float(p[0]), 3) == 0.424 and round(float(p[7]), 3) == 0.151
    assert round(exact.expected_reward(policy).item(), 4) == 0.1635 and round(float((p * LENGTHS).sum()), 2) == 1.96
    assert exact.IGNORE == packing.IGNORE


def test_batch_layout_is_the_training_batch_layout():
    """The docstring's row: "a end" -> inputs [end, a, end], targets [a, end, IGNORE], mask [1, 1, 0]."""
    b = exact.batch_of([1])
    assert b.inputs.tolist() == [[END, 0, END]] and b.targets.tolist() == [[0, END, exact.IGNORE]]
    assert b.mask.tolist() == [[1.0, 1.0, 0.0]] and b.rewards.tolist() == [1.0]
    assert EVERY.mask.sum(-1).tolist() == LENGTHS.tolist()


def test_answer_probabilities_are_the_product_of_the_next_token_softmax(policy):
    """Each answer's probability, from the model's logits written out token by token (no vocab_logprobs),
    equals exact.answer_probs; the 15 sum to 1."""
    p = exact.answer_probs(policy).detach()
    assert abs(float(p.sum()) - 1) < 1e-6
    with torch.no_grad():
        for i, y in enumerate(ANSWERS):
            seq = torch.tensor([exact.PROMPT + list(y)])
            probs = policy(seq).softmax(-1)[0]  # (len, 3) next-token distributions
            by_hand = math.prod(float(probs[t, tok]) for t, tok in enumerate(y))
            assert abs(by_hand - float(p[i])) < 1e-6, exact.NAMES[i]
    assert exact.expected_reward(policy).item() == pytest.approx(float((p * REWARDS).sum()), abs=1e-7)


def test_expected_reward_gradient_against_a_finite_difference(policy):
    g = exact.flat_grad(exact.expected_reward(policy), policy)
    direction = torch.randn(g.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    direction /= direction.norm()
    eps = 1e-2

    def J_at(t):
        moved = exact.perturbed(policy, 0.0)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(policy.parameters())
                                                + t * direction.float(), moved.parameters())
            return exact.expected_reward(moved).item()

    assert (J_at(eps) - J_at(-eps)) / (2 * eps) == pytest.approx(float(g @ direction), rel=1e-3, abs=1e-5)


def test_kl_is_zero_to_itself_and_its_gradient_the_sum_over_answers(policy):
    assert abs(exact.kl(policy, policy).item()) < 1e-6
    ref = exact.perturbed(policy, 0.3)
    logp, logq = exact.answer_logprobs(policy), exact.answer_logprobs(ref).detach()
    by_hand = sum((lp.exp() * (lp - lq)).item() for lp, lq in zip(logp, logq))
    assert exact.kl(policy, ref).item() == pytest.approx(by_hand, abs=1e-6) and by_hand > 0.05
    # d KL = sum_y p(y) (log p/q + 1) d log p(y); the +1 sums to d(sum p) = 0
    score = exact.flat_grad((logp.exp().detach() * (logp.detach() - logq) * logp).sum(), policy)
    assert torch.allclose(exact.flat_grad(exact.kl(policy, ref), policy), score, atol=1e-6)


def test_jacobian_route_equals_backward_through_the_model(policy, jacobian):
    """The lab's shortcut: a loss's gradient through a (B, T) log-prob leaf and the Jacobian equals the
    gradient through the model itself."""
    batch, old = exact.sample(exact.token_logprobs(policy).detach(), 6, torch.Generator().manual_seed(0))
    adv = chat_rl.group_advantages(batch.rewards, 6, scale="none")
    logp = exact.token_logprobs(policy, batch)
    loss, _ = chat_rl.policy_loss(logp, old, adv.double(), batch.mask, agg="seq-mean-token-mean")
    direct = exact.flat_grad(loss, policy)
    leaf = logp.detach().requires_grad_()
    loss, _ = chat_rl.policy_loss(leaf, old, adv.double(), batch.mask, agg="seq-mean-token-mean")
    (d_logp,) = torch.autograd.grad(loss, leaf)
    assert torch.allclose(torch.einsum("bt,btp->p", d_logp, jacobian[batch.answers].double()), direct.double(),
                          atol=1e-6)


def test_sample_lays_out_answers_with_their_logprobs(policy):
    batch, old = exact.sample(exact.token_logprobs(policy).detach(), 20000, torch.Generator().manual_seed(0))
    assert torch.equal(batch.inputs, EVERY.inputs[batch.answers]) and torch.equal(old, exact.token_logprobs(
        policy).detach()[batch.answers])
    p = exact.answer_probs(policy).detach()
    freq = torch.bincount(batch.answers, minlength=15).double() / 20000
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / 20000).sqrt() + 1e-4).all()  # multinomial sampling


def test_group_distribution_worked_example_and_brute_force():
    counts, prob = exact.group_distribution(torch.tensor([0.25, 0.75]), 2)
    assert dict(zip(map(tuple, counts.tolist()), prob.tolist())) == pytest.approx(
        {(2, 0): 0.0625, (1, 1): 0.375, (0, 2): 0.5625})
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    counts, prob = exact.group_distribution(q, 3)
    brute = {}
    for draw in itertools.product(range(4), repeat=3):
        key = tuple(torch.bincount(torch.tensor(draw), minlength=4).tolist())
        brute[key] = brute.get(key, 0.0) + math.prod(float(q[d]) for d in draw)
    assert len(counts) == math.comb(3 + 3, 3)
    assert dict(zip(map(tuple, counts.tolist()), prob.tolist())) == pytest.approx(brute, abs=1e-12)


# ------------------------------------------------------------------------------------------------
# Advantages and the policy gradient, over every group

def every_group(policy, G):
    """(groups (15^G, G) answer indices, their probabilities) of G iid answers from policy."""
    p = exact.answer_probs(policy).detach()
    groups = torch.tensor(list(itertools.product(range(15), repeat=G)))
    return groups, p[groups].prod(-1)


@pytest.mark.parametrize("G", [2, 3])
def test_expected_advantage_given_the_answer(policy, G):
    """Over every group, E[A_1 | y_1 = y]: RLOO's baseline leaves y out, so R(y) - J exactly; GRPO's mean
    includes y, so (G - 1) / G (R(y) - J) without the std; both average 0 over y."""
    groups, prob = every_group(policy, G)
    J = exact.expected_reward(policy).item()
    for estimator, factor in (("rloo", 1.0), ("grpo", (G - 1) / G)):
        adv = chat_rl.group_advantages(REWARDS[groups].view(-1), G, scale="none", estimator=estimator)
        first = adv.view(-1, G)[:, 0].double()
        p_y = torch.zeros(15, dtype=torch.float64).index_add_(0, groups[:, 0], prob)
        conditional = torch.zeros(15, dtype=torch.float64).index_add_(0, groups[:, 0], prob * first) / p_y
        assert torch.allclose(conditional, factor * (REWARDS - J), atol=1e-6), estimator
        assert abs(float((prob * first).sum())) < 1e-7


def expected_estimate(policy, old, jacobian, G, flags):
    """E over every group of G answers from `old` of the gradient the stage's loss hands the optimizer
    (minus d loss / d parameters at `policy`), with chat_rl.py's settings for `flags`."""
    args = chat_rl.parser.parse_args([*flags, "--max-new-tokens", str(MAX_LEN), "--group-size", str(G)])
    settings = chat_rl.update_settings(args)["loss_settings"]
    groups, prob = every_group(old, G)
    logp_all = exact.token_logprobs(policy).detach()
    old_all = exact.token_logprobs(old).detach()
    coef = torch.zeros(15, MAX_LEN, dtype=torch.float64)
    for group, pr in zip(groups, prob.tolist()):
        batch = exact.batch_of(group)
        adv = chat_rl.group_advantages(batch.rewards, G, scale=args.scale, estimator=args.estimator)
        leaf = logp_all[group].clone().requires_grad_()
        loss, _ = chat_rl.policy_loss(leaf, old_all[group], adv.double(), batch.mask, **settings)
        (d_logp,) = torch.autograd.grad(loss, leaf)
        coef.index_add_(0, group, -pr * d_logp)
    return torch.einsum("yt,ytp->p", coef, jacobian.double())


@pytest.mark.parametrize("G", [2, 3])
def test_rloo_and_dr_grpo_are_unbiased_for_the_gradient_of_expected_reward(policy, jacobian, G):
    """Fresh snapshot (ratio 1), all 15^G groups: RLOO's expected gradient is exactly dJ / max_len (its loss
    divides by the constant max_len); Dr. GRPO's is (G - 1) / G of that (the group mean includes the answer
    itself: a constant shrink, not a bias in direction). Paper GRPO's per-answer token mean and std are not:
    its expectation points elsewhere."""
    dJ = exact.flat_grad(exact.expected_reward(policy), policy).double()
    rloo = expected_estimate(policy, policy, jacobian, G,
                             ["--estimator", "rloo", "--scale", "none", "--agg", "seq-mean-token-sum-norm"])
    assert torch.allclose(rloo, dJ / MAX_LEN, atol=1e-6 * dJ.norm())
    dr_grpo = expected_estimate(policy, policy, jacobian, G, ["--scale", "none", "--agg", "seq-mean-token-sum-norm"])
    assert torch.allclose(dr_grpo, (G - 1) / G * dJ / MAX_LEN, atol=1e-6 * dJ.norm())
    grpo = expected_estimate(policy, policy, jacobian, G, ["--agg", "seq-mean-token-mean"])
    assert cosine(grpo, dJ) < 0.999


def test_a_stale_snapshot_biases_even_rloo(policy, jacobian):
    """Sampled from a perturbed snapshot, the token ratios and the clip make RLOO's expectation depart from
    dJ / max_len at the current policy: why the unbiased claim is for fresh samples only."""
    old = exact.perturbed(policy, 0.3)
    dJ = exact.flat_grad(exact.expected_reward(policy), policy).double()
    rloo = expected_estimate(policy, old, jacobian, 2,
                             ["--estimator", "rloo", "--scale", "none", "--agg", "seq-mean-token-sum-norm"])
    assert (rloo - dJ / MAX_LEN).norm() > 0.05 * (dJ / MAX_LEN).norm()


# ------------------------------------------------------------------------------------------------
# KL estimators, against the exact KL of whole answers

def kl_terms(policy, ref, kind):
    """Per answer, the sum over its tokens of chat_rl's KL estimator (B,), with gradient through the policy."""
    logp, ref_logp = exact.token_logprobs(policy), exact.token_logprobs(ref).detach()
    return (chat_rl.kl_penalty(logp, ref_logp, kind) * EVERY.mask).sum(-1)


def test_k1_and_k3_values_are_unbiased_k2_is_not(policy):
    ref = exact.perturbed(policy, 0.3)
    p = exact.answer_probs(policy).detach()
    true_kl = exact.kl(policy, ref).item()
    assert (p * kl_terms(policy, ref, "k1")).sum().item() == pytest.approx(true_kl, abs=1e-6)
    assert (p * kl_terms(policy, ref, "k3")).sum().item() == pytest.approx(true_kl, abs=1e-6)
    assert abs((p * kl_terms(policy, ref, "k2")).sum().item() - true_kl) > 0.01 * true_kl


def test_kl_estimator_gradients_per_token_and_per_answer(policy):
    """E_{y ~ pi}[d sum_t k(y_t)] with the samples held fixed, as a loss gives it, exactly:
    - k1's is 0;
    - k2's is the gradient of each token's KL with the prefixes' distribution held fixed,
      sum_y p(y) sum_t (log p_t - log q_t) d log p_t: at the first token, exactly d KL of that token's
      distribution (rollout.kl_penalty's claim), but NOT d KL of whole answers, which also moves which
      prefixes are visited (sum_y p(y) sum_t d log p_t * sum_{s >= t} (log p_s - log q_s));
    - k3's is d of the reverse KL, at the first token exactly;
    - k2 of the answer's summed log-ratio is d KL of whole answers exactly."""
    ref = exact.perturbed(policy, 0.3)
    p = exact.answer_probs(policy).detach()
    logp, logq = exact.token_logprobs(policy), exact.token_logprobs(ref).detach()
    delta = (logp - logq).detach()

    def expected(per_answer):
        return exact.flat_grad((p * per_answer).sum(), policy, retain_graph=True)

    dKL = exact.flat_grad(exact.kl(policy, ref), policy)
    assert expected(kl_terms(policy, ref, "k1")).norm() < 1e-6 * dKL.norm()
    prefix_frozen = expected((delta * logp).sum(-1))
    k2 = expected(kl_terms(policy, ref, "k2"))
    assert torch.allclose(k2, prefix_frozen, atol=1e-6 * dKL.norm())
    to_go = delta.flip(-1).cumsum(-1).flip(-1)  # sum over s >= t
    assert torch.allclose(expected((to_go * logp).sum(-1)), dKL, atol=1e-5 * dKL.norm())
    assert cosine(k2, dKL) < 0.99  # per-token k2 is not the whole answers' KL gradient here
    seq_k2 = chat_rl.kl_penalty(logp.sum(-1), logq.sum(-1), "k2")
    assert torch.allclose(expected(seq_k2), dKL, atol=1e-5 * dKL.norm())

    # the first token alone: a categorical over {a, b, end} after the prompt
    first = policy(torch.tensor([exact.PROMPT]))[0, -1].log_softmax(-1)
    first_ref = ref(torch.tensor([exact.PROMPT]))[0, -1].log_softmax(-1).detach()
    pf = first.exp().detach()
    for kind, target in (("k2", (first.exp() * (first - first_ref)).sum()),
                         ("k3", (first_ref.exp() * (first_ref - first)).sum())):
        got = exact.flat_grad((pf * chat_rl.kl_penalty(first, first_ref, kind)).sum(), policy, retain_graph=True)
        assert torch.allclose(got, exact.flat_grad(target, policy, retain_graph=True), atol=1e-6), kind


# ------------------------------------------------------------------------------------------------
# What the lab's exact level adds: a step along an expected update, the tree of prefixes, the closed-form optimum

def test_ascend_is_one_step_along_the_coefficients_times_the_jacobian(policy, jacobian):
    """SGD at lr 0.1 along coefficients c (15, MAX_LEN) moves the weights by 0.1 sum_{y,t} c[y,t] d log p_t(y):
    the Jacobian route, a different computation from ascend's backward pass."""
    moved = exact.perturbed(policy, 0.0)
    coef = torch.randn(15, MAX_LEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * EVERY.mask
    before = torch.nn.utils.parameters_to_vector(moved.parameters()).detach().clone()
    exact.ascend(torch.optim.SGD(moved.parameters(), lr=0.1), moved, coef)
    step = torch.nn.utils.parameters_to_vector(moved.parameters()).detach() - before
    assert torch.allclose(step.double(), 0.1 * torch.einsum("yt,ytp->p", coef, jacobian.double()), atol=1e-6)


def test_prefixes_and_next_token_tables():
    """7 prefixes; uniform next tokens give 1/3, 1/9, 1/27 (the docstring's example); the table read off an
    answer table gives it back."""
    assert exact.PREFIXES == [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert exact.PREFIX_OF[exact.NAMES.index("a b end")].tolist() == [0, 1, 4]
    uniform = torch.full((7, 3), math.log(1 / 3), dtype=torch.float64)
    p = exact.answer_logprobs_from(uniform).exp()
    assert [p[0].item(), p[1].item(), p[7].item()] == pytest.approx([1 / 3, 1 / 9, 1 / 27])
    assert p.sum().item() == pytest.approx(1.0)
    table = torch.log_softmax(torch.randn(7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    token_logp = table[exact.PREFIX_OF, EVERY.targets.clamp(min=0)] * EVERY.mask
    assert torch.allclose(exact.next_token_logprobs(token_logp), table)
    assert torch.allclose(exact.answer_logprobs_from(table), token_logp.sum(-1))


def test_regularized_optimum_worked_example_and_its_optimality():
    """The docstring's example; and pi* beats every nearby distribution at E[R] - beta KL(. || ref)."""
    two = exact.regularized_optimum(torch.tensor([0.5, 0.5]).log(), torch.tensor([1.0, 0.0]), 0.5)
    assert two.tolist() == pytest.approx([math.e ** 2 / (math.e ** 2 + 1), 1 / (math.e ** 2 + 1)])
    ref = torch.softmax(torch.randn(15, generator=torch.Generator().manual_seed(2), dtype=torch.float64), 0)
    star = exact.regularized_optimum(ref.log(), REWARDS, 0.3)

    def value(q):
        return float((q * REWARDS).sum() - 0.3 * (q * (q / ref).log()).sum())
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        other = torch.softmax(star.log() + 0.05 * torch.randn(15, generator=g, dtype=torch.float64), 0)
        assert value(other) < value(star)


def test_total_variation_and_entropy():
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    assert exact.total_variation(p, q) == pytest.approx(0.5) and exact.total_variation(p, p) == 0.0
    assert exact.entropy(p) == pytest.approx(math.log(2)) and exact.entropy(torch.tensor([1.0, 0.0])) == 0.0
