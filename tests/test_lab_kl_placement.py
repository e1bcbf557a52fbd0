"""lab/kl_placement.py: one step of each variant's exact expected update against values computed by hand; the
closed-form fixed points against the update itself (it vanishes there, on a policy that is a table of next-token
logits); k1 in the loss moves nothing; and at smoke size its figure and JSON.

The hand world: the reference draws every next token at 1/3. The policy differs at two prefixes: after the prompt
a 1/2, b 1/4, end 1/4; after "a": a 1/3, b 1/6, end 1/2; elsewhere 1/3. So "a end" has p = 1/2 * 1/2 = 1/4 and
both its tokens 1.5 times as likely as under the reference (log-ratio l = log 1.5 = 0.405465 each), reward 1;
"a a a" has p = 1/2 * 1/3 * 1/3 = 1/18, log-ratios l, 0, 0, reward 0. With beta 0.5 the coefficient on each token
(d surrogate / d log p_t) is p(y) (R(y) - beta * g_t), where g_t is, per variant:
    none              0
    k1 in the reward  the log-ratios of this token and the ones after it: "a end" 2l, l; "a a a" l, 0, 0
    k1 in the loss    d k1 / d log p = 1 on every token
    k2 in the loss    d k2 / d log p = the token's log-ratio: "a end" l, l; "a a a" l, 0, 0
    k3 in the loss    d k3 / d log p = 1 - p_ref / p: "a end" 1/3, 1/3; "a a a" 1/3, 0, 0
    k2 of the answer  the answer's summed log-ratio on every token: "a end" 2l, 2l; "a a a" l, l, l"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import exact

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "lab"))
import kl_placement  # noqa: E402

torch.set_num_threads(1)

L = math.log(1.5)
BY_HAND = {  # kind: (coefficients on the tokens of "a end", of "a a a")
    "none": ([0.25, 0.25], [0.0, 0.0, 0.0]),
    "k1_reward": ([0.25 * (1 - 0.5 * 2 * L), 0.25 * (1 - 0.5 * L)], [-0.5 * L / 18, 0.0, 0.0]),
    "k1_loss": ([0.25 * 0.5, 0.25 * 0.5], [-0.5 / 18] * 3),
    "k2_loss": ([0.25 * (1 - 0.5 * L)] * 2, [-0.5 * L / 18, 0.0, 0.0]),
    "k3_loss": ([0.25 * (1 - 0.5 / 3)] * 2, [-0.5 / 3 / 18, 0.0, 0.0]),
    "k2_answer": ([0.25 * (1 - 0.5 * 2 * L)] * 2, [-0.5 * L / 18] * 3),
}


def token_logprobs_of(next_probs):
    """(15, MAX_LEN) token log-probs of a policy given as next-token probabilities (7, 3)."""
    return torch.tensor(next_probs, dtype=torch.float64).log()[exact.PREFIX_OF, exact.EVERY.targets.clamp(min=0)] * \
        exact.EVERY.mask


UNIFORM = [[1 / 3] * 3] * 7
POLICY = [[1 / 2, 1 / 4, 1 / 4], [1 / 3, 1 / 6, 1 / 2]] + [[1 / 3] * 3] * 5


@pytest.mark.parametrize("kind", list(BY_HAND))
def test_one_step_of_each_variant_against_the_hand_values(kind):
    assert list(BY_HAND) == list(kl_placement.VARIANTS)
    leaf = token_logprobs_of(POLICY).requires_grad_()
    value = kl_placement.surrogate(leaf, token_logprobs_of(UNIFORM), rewards=exact.REWARDS, beta=0.5, kind=kind)
    (coef,) = torch.autograd.grad(value, leaf)
    a_end, a_a_a = exact.NAMES.index("a end"), exact.NAMES.index("a a a")
    assert coef[a_end, :2].tolist() == pytest.approx(BY_HAND[kind][0], abs=1e-12)
    assert coef[a_a_a].tolist() == pytest.approx(BY_HAND[kind][1], abs=1e-12)
    assert (coef * (1 - exact.EVERY.mask)).abs().sum() == 0  # nothing off the answers' tokens


def update_on_a_table(logits, ref_logp, kind, beta):
    """The expected update of `kind` on a policy that is a table of next-token logits (7, 3), in float64: its
    gradient with respect to the logits."""
    logits = logits.clone().requires_grad_()
    token_logp = torch.log_softmax(logits, -1)[exact.PREFIX_OF, exact.EVERY.targets.clamp(min=0)] * exact.EVERY.mask
    (grad,) = torch.autograd.grad(kl_placement.surrogate(token_logp, ref_logp, rewards=exact.REWARDS, beta=beta,
                                                         kind=kind), logits)
    return grad


def test_each_closed_form_fixed_point_is_where_its_update_vanishes():
    """The soft recursion gives exactly pi* = ref exp(R / beta) / Z; at pi* the updates of k1 in the reward and k2 of
    the answer vanish, those of k2 and k3 in the loss do not; at their own fixed points those two vanish."""
    ref_next = torch.log_softmax(torch.randn(7, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    ref_logp = ref_next[exact.PREFIX_OF, exact.EVERY.targets.clamp(min=0)] * exact.EVERY.mask
    beta = 0.3
    star = exact.regularized_optimum(ref_logp.sum(-1), exact.REWARDS, beta)
    assert torch.allclose(kl_placement.fixed_point(ref_next, exact.REWARDS, beta, "optimum"), star, atol=1e-12)
    for rule, vanish, stay in (("optimum", ("k1_reward", "k2_answer"), ("k2_loss", "k3_loss")),
                               ("k2_loss", ("k2_loss",), ("k1_reward", "k3_loss")),
                               ("k3_loss", ("k3_loss",), ("k1_reward", "k2_loss"))):
        p = kl_placement.fixed_point(ref_next, exact.REWARDS, beta, rule)
        table = next_token_table(p)
        for kind in vanish:
            assert update_on_a_table(table, ref_logp, kind, beta).abs().max() < 1e-9, (rule, kind)
        for kind in stay:
            assert update_on_a_table(table, ref_logp, kind, beta).abs().max() > 1e-3, (rule, kind)


def next_token_table(p):
    """The next-token log-probs (7, 3) of a distribution over the answers p (15,): each prefix's next token, in
    proportion to the mass of the answers through it."""
    table = torch.zeros(7, 3, dtype=torch.float64)
    for i, prefix in enumerate(exact.PREFIXES):
        through = [sum(float(p[y]) for y, ans in enumerate(exact.ANSWERS) if ans[:len(prefix) + 1] == prefix + (x,))
                   for x in range(3)]
        table[i] = torch.tensor(through, dtype=torch.float64).log() - math.log(sum(through))
    return table


def test_k1_in_the_loss_moves_nothing_and_k1_in_the_reward_does():
    """On a table of logits in float64, k1 in the loss adds exactly nothing to E[R]'s update: -beta sum_y p(y)
    d log p(y) = -beta d(sum_y p(y)) = 0. k1 in the reward does."""
    ref_next = torch.log_softmax(torch.randn(7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    ref_logp = ref_next[exact.PREFIX_OF, exact.EVERY.targets.clamp(min=0)] * exact.EVERY.mask
    logits = torch.randn(7, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    none = update_on_a_table(logits, ref_logp, "none", 0.5)
    assert (update_on_a_table(logits, ref_logp, "k1_loss", 0.5) - none).abs().max() < 1e-14
    assert (update_on_a_table(logits, ref_logp, "k1_reward", 0.5) - none).abs().max() > 1e-2


def test_smoke_writes_the_figure_and_the_json_the_page_quotes(tmp_path):
    """Run as lab/run_all.py runs it (--only kl_placement --smoke): the JSON and figure only, no page refreshed."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "run_all.py"), "--only", "kl_placement", "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["kl_placement.json", "kl_placement.png"] and "docs/lab/" not in r.stdout
    assert (tmp_path / "kl_placement.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "kl_placement.json").read_text())
    assert list(data["variants"]) == list(kl_placement.VARIANTS) and data["steps"] == 20
    for r in data["variants"].values():
        assert len(r["step"]) == len(r["tv_to_optimum"]) == len(r["kl_to_reference"]) == len(r["J"]) == 5
        assert {"tv_to_optimum", "kl_to_optimum", "kl_to_reference", "J"} <= set(r["end"]) and len(r["probs"]) == 15
    assert {"tv_to_fixed_point"} <= set(data["variants"]["k2_loss"]["end"]) & set(data["variants"]["k3_loss"]["end"])
    assert set(data["fixed_points"]) == {"k2_loss", "k3_loss"} and data["optimum"]["tv_prefix_by_prefix"] < 1e-9
    checks = data["variants"]["k1_reward"]["kl_terms"]
    assert checks["step"] == [20] and checks["k1_loss"][0] < 1e-5 < 0.1 < checks["k1_reward"][0]
    assert data["reference"]["tv_to_optimum"] > 0.5 and data["provenance"]["level"] == "exact"
