"""
The enumerable world: a policy small enough that every answer it can give is listed, so that an expectation
is a finite sum and a gradient of one is exact. Tests compare estimators with it (tests/test_exact.py), and
lab/exact_gradient.py measures their bias and variance against it.

The project's own GPT (model.GPT, a tiny config) over a vocabulary of three tokens {a, b, end}. The prompt is
one token, `end` (as GPT-2's <|endoftext|> both ends a text and begins the next); an answer stops at `end` or
is cut off after MAX_LEN = 3 tokens, at temperature 1. That gives 15 answers:

    finished (7):   end | a end, b end | a a end, a b end, b a end, b b end
    cut off (8):    a a a, a a b, a b a, a b b, b a a, b a b, b b a, b b b

Each answer's probability is the product of its tokens' probabilities, exp(sum of the model's per-token
log-probs), and the 15 sum to 1 (to float32 rounding, ~1e-7: the model computes its log-probs in float32,
as in training; every "exact" here means that). A fixed reward table (REWARDS) pays answers of every
length, so that aggregations over tokens differ by more than a constant:

    answer   end  a end  b end  a a end  a b end  b a end  b b end  cut off (each)
    reward   0.0   1.0    0.0     0.5      1.0      0.0      0.5       0.0

From these, exactly: expected_reward (J = sum_y p(y) R(y)) and, through autograd over the sum of all 15,
its gradient; kl (KL(policy || reference) between two such models, sum_y p(y) log p(y) / q(y)) and its
gradient. `sample` draws answers for an estimator, laid out as chat_rl's functions take them (rollout's
TrainingBatch layout: inputs, targets, mask, per-token log-probs). It draws whole answers with
torch.multinomial over the 15 exact probabilities: that is the same distribution as drawing token by token
(p(y) = prod_t p(y_t | y_<t)), so an average over samples converges to the sums here, with no sampler
numerics in between. (The engine is a layer above this module; this world needs none of it.)
logprob_jacobian gives every answer token's log-prob gradient at once, so that the parameter gradient of any
loss on a batch is a product, not a backward pass through the model; group_distribution lists the ways the
other G - 1 answers of a group can fall, for expectations over groups larger than brute force allows.

The lab's exact level follows expected updates for hundreds of steps (lab/*_exact.py, lab/kl_placement.py):
`ascend` takes one optimizer step along an expected update given as coefficients on every answer token's
log-prob; PREFIXES and next_token_logprobs view the answers as the tree they are (7 prefixes, a choice of 3
tokens at each), for closed forms that act prefix by prefix; regularized_optimum is the closed-form maximizer
of E[R] - beta KL(pi || reference); total_variation and entropy measure answer distributions.

This file imports only torch and model.py.
"""
import copy
import itertools
import math
from dataclasses import dataclass

import torch

from model import GPT, GPTConfig

TOKENS = ("a", "b", "end")
A, B, END = 0, 1, 2
PROMPT = [END]
MAX_LEN = 3
IGNORE = -100  # packing.IGNORE: a target that is not graded (the model gives it log-prob 0)

# every answer, finished ones first, by length; then the cut-off ones
ANSWERS = [tuple(prefix) + (END,) for n in range(MAX_LEN) for prefix in itertools.product((A, B), repeat=n)] + \
          [tuple(full) for full in itertools.product((A, B), repeat=MAX_LEN)]
NAMES = [" ".join(TOKENS[t] for t in y) for y in ANSWERS]
LENGTHS = torch.tensor([len(y) for y in ANSWERS])
FINISHED = torch.tensor([y[-1] == END for y in ANSWERS])
REWARD_TABLE = {"end": 0.0, "a end": 1.0, "b end": 0.0, "a a end": 0.5, "a b end": 1.0, "b a end": 0.0,
                "b b end": 0.5}  # every cut-off answer: 0.0
REWARDS = torch.tensor([REWARD_TABLE.get(name, 0.0) for name in NAMES], dtype=torch.float64)


def tiny_policy(seed: int = 0, spread: float = 0.3) -> GPT:
    """A 2-layer, 16-wide GPT over the three tokens, its weights drawn N(0, spread^2) from `seed` (the global
    RNG untouched), so that its answers are far from uniform: GPT's own init (std 0.02) gives each token ~1/3
    everywhere. At the defaults p("end") = 0.424, p("a a a") = 0.151, J = 0.1635, mean length 1.96 tokens."""
    with torch.random.fork_rng():
        model = GPT(GPTConfig(vocab_size=len(TOKENS), n_layer=2, n_head=2, n_kv_head=1, n_embd=16, head_dim=8,
                              intermediate_size=32, max_seq_len=len(PROMPT) + MAX_LEN))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * spread)
    return model


def perturbed(model: GPT, scale: float, seed: int = 1) -> GPT:
    """A copy of `model` with N(0, scale^2) added to every weight: a stale snapshot, or a reference."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


@dataclass
class Batch:
    """Answers laid out as rollout.training_batch lays out rollouts (one row per answer, right-padded):
    inputs[b, t] predicts targets[b, t]; mask is 1 exactly on the answer's tokens.
    Example, the answer "a end": inputs [end, a, end], targets [a, end, IGNORE], mask [1, 1, 0]."""
    answers: torch.Tensor   # (B,) index into ANSWERS
    inputs: torch.Tensor    # (B, MAX_LEN)
    targets: torch.Tensor   # (B, MAX_LEN)
    mask: torch.Tensor      # (B, MAX_LEN) float64
    rewards: torch.Tensor   # (B,) float64, from REWARDS


def batch_of(answers) -> Batch:
    """The Batch of these answer indices (repeats allowed): rows of EVERY."""
    answers = torch.as_tensor(answers, dtype=torch.long)
    return Batch(answers, EVERY.inputs[answers], EVERY.targets[answers], EVERY.mask[answers], REWARDS[answers])


def _every() -> Batch:
    inputs = torch.full((len(ANSWERS), MAX_LEN), END, dtype=torch.long)
    targets = torch.full((len(ANSWERS), MAX_LEN), IGNORE, dtype=torch.long)
    for i, y in enumerate(ANSWERS):
        seq = PROMPT + list(y)
        inputs[i, :len(y)] = torch.tensor(seq[:-1])
        targets[i, :len(y)] = torch.tensor(seq[1:])
    return Batch(torch.arange(len(ANSWERS)), inputs, targets, (targets != IGNORE).double(), REWARDS)


EVERY = _every()  # all 15, in the order of ANSWERS


def token_logprobs(model: GPT, batch: Batch = EVERY) -> torch.Tensor:
    """(B, MAX_LEN) log-prob of each answer token under `model` (0 off the mask), with gradient: the
    trainer's forward, model(inputs, targets), as every stage calls it."""
    return model(batch.inputs, batch.targets).double() * batch.mask


def answer_logprobs(model: GPT) -> torch.Tensor:
    """(15,) log p(y) of every answer: the sum of its tokens' log-probs."""
    return token_logprobs(model).sum(-1)


def answer_probs(model: GPT) -> torch.Tensor:
    """(15,) p(y) of every answer; they sum to 1."""
    return answer_logprobs(model).exp()


def expected_reward(model: GPT, rewards: torch.Tensor = REWARDS) -> torch.Tensor:
    """J = sum over the 15 answers of p(y) R(y): a scalar whose autograd gradient is the exact policy gradient."""
    return (answer_probs(model) * rewards).sum()


def kl(policy: GPT, reference: GPT) -> torch.Tensor:
    """KL(policy || reference) over whole answers, sum_y p(y) (log p(y) - log q(y)), with gradient through
    the policy only (the reference is frozen)."""
    logp = answer_logprobs(policy)
    with torch.no_grad():
        logq = answer_logprobs(reference)
    return (logp.exp() * (logp - logq)).sum()


def flat_grad(value: torch.Tensor, model: GPT, retain_graph: bool = False) -> torch.Tensor:
    """d value / d (every parameter of model), flattened into one float64 vector (zeros where it does not depend)."""
    params = list(model.parameters())
    grads = torch.autograd.grad(value, params, retain_graph=retain_graph, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]).double()


def logprob_jacobian(model: GPT) -> torch.Tensor:
    """(15, MAX_LEN, P): d log p(token t of answer y) / d parameters, for every answer token (0 off the mask).
    A loss that depends on the parameters only through a batch's token log-probs has the gradient
    sum_{b,t} dloss/dlogp[b, t] * J[answers[b], t] (the chain rule), so one backward pass through a
    (B, MAX_LEN) leaf gives its exact parameter gradient without running the model again."""
    logp = token_logprobs(model)
    rows = [flat_grad(logp[y, t], model, retain_graph=True) if EVERY.mask[y, t] else None
            for y in range(len(ANSWERS)) for t in range(MAX_LEN)]
    P = next(r for r in rows if r is not None).numel()
    return torch.stack([torch.zeros(P, dtype=torch.float64) if r is None else r for r in rows]).view(
        len(ANSWERS), MAX_LEN, P)


def sample(sampler_logp: torch.Tensor, n: int, generator: torch.Generator) -> tuple[Batch, torch.Tensor]:
    """n answers drawn iid (torch.multinomial over the 15 exact probabilities, with replacement) from the
    policy whose per-token log-probs of every answer are sampler_logp (15, MAX_LEN), token_logprobs(model)
    computed once: as a Batch, with their per-token log-probs (n, MAX_LEN), the `old_logp` of
    chat_rl.policy_loss."""
    answers = torch.multinomial(sampler_logp.sum(-1).exp(), n, replacement=True, generator=generator)
    return batch_of(answers), sampler_logp[answers]


def group_distribution(class_probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every way n iid draws can fall into K classes, as counts (S, K), with its probability (S,) under
    class_probs (K,): the multinomial, n! / prod(c_k!) prod(q_k^c_k). The others of a group of G answers
    (n = G - 1) matter to one answer's advantage only through such counts, so an expectation over groups
    is a sum over these S rows (C(n + K - 1, K - 1) of them) instead of over 15^n groups.
    Example: n = 2, class_probs [0.25, 0.75]: counts [2, 0], [1, 1], [0, 2] with 0.0625, 0.375, 0.5625."""
    K = len(class_probs)
    counts = torch.tensor([[bars[k + 1] - bars[k] - 1 for k in range(K)]
                           for cut in itertools.combinations(range(n + K - 1), K - 1)
                           for bars in [(-1,) + cut + (n + K - 1,)]], dtype=torch.long).view(-1, K)
    c = counts.double()
    log_prob = math.lgamma(n + 1) - torch.lgamma(c + 1).sum(-1) + torch.xlogy(c, class_probs.double()).sum(-1)
    return counts, log_prob.exp()


def ascend(optimizer, model: GPT, coef: torch.Tensor) -> None:
    """One optimizer step along sum over answers y and tokens t of coef[y, t] * d log p(token t of y): an
    expected update whose coefficients on every answer token's log-prob (15, MAX_LEN) are known. The
    REINFORCE update of a reward table R, for one, is coef[y, t] = p(y) R(y) on every token of y, whose sum is
    exactly the gradient of J (sum_t d log p(token t) = d log p(y))."""
    optimizer.zero_grad()
    (-(coef.detach() * token_logprobs(model)).sum()).backward()  # minus: optimizers descend
    optimizer.step()


# ------------------------------------------------------------------------------------------------
# The answers as a tree: 7 prefixes, at each a choice among the 3 tokens

# every prefix after which a token is chosen: (), a, b, a a, a b, b a, b b
PREFIXES = [tuple(prefix) for n in range(MAX_LEN) for prefix in itertools.product((A, B), repeat=n)]
# PREFIX_OF[y, t]: the index in PREFIXES of the prefix that token t of answer y follows (0 off the mask)
PREFIX_OF = torch.tensor([[PREFIXES.index(y[:t]) if t < len(y) else 0 for t in range(MAX_LEN)] for y in ANSWERS])


def next_token_logprobs(token_logp: torch.Tensor) -> torch.Tensor:
    """(7, 3): log p(token | prefix) for every prefix and token, read off the token log-probs of every answer
    (15, MAX_LEN), as token_logprobs gives them: each (prefix, token) pair is a token of some answer."""
    table = torch.zeros(len(PREFIXES), len(TOKENS), dtype=token_logp.dtype)
    on = EVERY.mask.bool()
    table[PREFIX_OF[on], EVERY.targets[on]] = token_logp[on]
    return table


def answer_logprobs_from(next_logp: torch.Tensor) -> torch.Tensor:
    """(15,) log p(y) of every answer from next-token log-probs (7, 3): the sum along the answer's path.
    Example: uniform next tokens (log 1/3 everywhere) give p("end") = 1/3, p("a end") = 1/9, p("a a a") = 1/27."""
    return (next_logp[PREFIX_OF, EVERY.targets.clamp(min=0)] * EVERY.mask).sum(-1)


def regularized_optimum(reference_logp: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """(15,) the distribution over answers that maximizes E_pi[R] - beta KL(pi || reference), in closed form:
    pi*(y) = pi_ref(y) exp(R(y) / beta) / Z (the KL-regularized optimum; e.g. DPO, arXiv:2305.18290, eq. 4).
    reference_logp: (15,) log pi_ref(y). Example: pi_ref (0.5, 0.5), R (1, 0), beta 0.5: pi* = (e^2, 1) / (e^2 + 1)
    = (0.881, 0.119); as beta -> 0 all mass goes to the best answers, as beta -> infinity pi* -> pi_ref."""
    return torch.softmax(reference_logp.double() + rewards.double() / beta, 0)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """Half the L1 distance between two distributions over answers: the most probability any set of answers
    has under one and not the other (0: equal, 1: disjoint)."""
    return 0.5 * float((p.double() - q.double()).abs().sum())


def entropy(p: torch.Tensor) -> float:
    """-sum p log p of a distribution over answers, in nats (0 log 0 = 0)."""
    p = p.double()
    return float(-torch.xlogy(p, p).sum())
