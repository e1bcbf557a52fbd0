"""lab/goodhart_exact.py: its proxy errs exactly where the start is rare; one step of its exact update against the
REINFORCE update with k1 in the reward, summed answer by answer over the Jacobian (a different computation from
the script's autograd of the closed-form objective); a hand example of the unpenalized path's lookup; and at smoke
size its figure and JSON.

Per answer, REINFORCE with k1 in the reward weighs d log p(y) by p(y) (proxy(y) - beta log(p(y) / p_start(y))), and
sum_y p(y) c d log p(y) = 0 for any constant c, so that sum is the gradient of E[proxy] - beta KL(p || start)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import exact

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "lab"))
import goodhart_exact  # noqa: E402

torch.set_num_threads(1)


def test_the_proxy_is_the_gold_except_on_the_two_rare_answers():
    changed = [n for n, g, p in zip(exact.NAMES, goodhart_exact.GOLD, goodhart_exact.PROXY) if g != p]
    assert changed == ["a b b", "b a b"]  # the start gives them 0.0012 and 0.0016, every other answer >= 0.0082
    assert all(goodhart_exact.GOLD[exact.NAMES.index(n)] == 0 and goodhart_exact.PROXY[exact.NAMES.index(n)] == 1.25
               for n in changed)


@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_one_step_of_the_exact_update_against_reinforce_summed_answer_by_answer(beta):
    policy = exact.perturbed(exact.tiny_policy(), 0.2, seed=5)  # away from the start, so that the KL acts
    start_logp = goodhart_exact.START_PROBS.log()
    value = goodhart_exact.objective(exact.answer_logprobs(policy), start_logp, beta)
    got = exact.flat_grad(value, policy)
    jac = exact.logprob_jacobian(policy).double()
    p = exact.answer_probs(policy).detach().double()
    want = torch.zeros_like(got)
    for y in range(15):
        weight = p[y] * (goodhart_exact.PROXY[y] - beta * (p[y].log() - start_logp[y]))
        want += weight * jac[y].sum(0)  # d log p(y): the sum over its tokens
    assert torch.allclose(got, want, atol=1e-6 * want.norm()) and want.norm() > 1e-3


def test_the_unpenalized_gold_at_a_sqrt_kl():
    path = {"sqrt_kl": [0.0, 1.0, 2.0, 1.5], "gold": [0.0, 1.0, 0.0, 0.2]}
    assert goodhart_exact.gold_on_path(path, 0.5) == pytest.approx(0.5)
    assert goodhart_exact.gold_on_path(path, 1.5) == pytest.approx(0.5)  # the first time it got there
    assert goodhart_exact.gold_on_path(path, 3.0) is None


def test_smoke_writes_the_figure_and_the_json_the_page_quotes(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "goodhart_exact.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "goodhart_exact.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "goodhart_exact.json").read_text())
    assert list(data["runs"]) == ["beta=0", "beta=0.1", "beta=0.2", "beta=0.4"] and data["steps"] == 20
    for r in data["runs"].values():
        assert r["step"][0] == 0 and r["sqrt_kl"][0] == 0.0 and len(r["gold"]) == len(r["proxy"]) == len(r["step"])
    assert {"gold_peak", "gold_peak_sqrt_kl", "gold_end", "proxy_start", "proxy_end"} <= set(data["summary"]["beta=0"])
    assert {"closed_form_gold", "unpenalized_gold_at_this_sqrt_kl"} <= set(data["summary"]["beta=0.2"])
    assert "largest_gold_gap_to_unpenalized" in data["summary"]
    assert len(data["optimum"]) == 60 and data["provenance"]["level"] == "exact"
