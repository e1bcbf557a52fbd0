"""lab/exact_gradient.py (experiment 7): its closed-form expectation over groups equals the brute-force sum
over every group, for every variant, fresh and stale; at smoke size it writes its figure and the JSON keys
docs/lab/exact_gradient.md quotes."""
import json
import os
import subprocess
import sys

import pytest
import torch

import exact
from test_exact import expected_estimate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "lab"))
import exact_dynamics  # noqa: E402
import exact_gradient  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world():
    policy = exact.tiny_policy()
    return policy, exact.perturbed(policy, exact_gradient.STALE_SCALE), exact.logprob_jacobian(policy)


@pytest.mark.parametrize("snapshot,G,names", [("fresh", 2, list(exact_gradient.VARIANTS)), ("fresh", 3, ["CISPO"]),
                                              ("stale", 2, list(exact_gradient.VARIANTS)), ("stale", 3, ["CISPO", "GSPO"])])
def test_closed_form_expectation_equals_the_sum_over_every_group(world, snapshot, G, names):
    """exact_dynamics.expected_update (a sum over the counts of the other G - 1 answers) against expected_estimate
    (a sum over all 15^G groups through chat_rl's loss): the same vector. G = 3 takes the token-mean normalizer
    (CISPO), where the others' lengths matter, and GSPO's sequence ratio."""
    policy, stale, jac = world
    old = policy if snapshot == "fresh" else stale
    policy_logp, old_logp = exact.token_logprobs(policy).detach(), exact.token_logprobs(old).detach()
    for name in names:
        settings = exact_dynamics.stage_settings([*exact_gradient.VARIANTS[name], "--group-size", str(G)])
        closed = exact_dynamics.expected_update(policy_logp, old_logp, rewards=exact.REWARDS, **settings)[0]
        closed = closed.view(-1) @ jac.view(45, -1)
        brute = expected_estimate(policy, old, jac, G, exact_gradient.VARIANTS[name])
        assert torch.allclose(closed, brute, atol=1e-6 * brute.norm()), name


def test_smoke_writes_the_figure_and_the_json_the_page_quotes(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "exact_gradient.py"), "--smoke", "--out",
                        str(tmp_path), "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "exact_gradient.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "exact_gradient.json").read_text())
    assert {"world", "variants", "group_sizes", "fresh", "stale", "kl", "commands", "seconds",
            "speed_reference"} <= set(data)
    assert {"J", "grad_norm", "kl_stale_to_policy", "cosine_dJ_at_stale_to_dJ"} <= set(data["world"])
    for snapshot in ("fresh", "stale"):
        assert set(data[snapshot]) == set(exact_gradient.VARIANTS)
        for row in data[snapshot].values():
            assert all(len(v) == len(data["group_sizes"]) for v in row.values())
    fresh = data["fresh"]
    for G, rloo, dr in zip(data["group_sizes"], fresh["RLOO"]["exact_norm_ratio"], fresh["Dr. GRPO"]["exact_norm_ratio"]):
        assert fresh["RLOO"]["exact_cosine"][0] == pytest.approx(1.0, abs=1e-4)
        assert rloo == pytest.approx(1 / 3, abs=1e-4) and dr == pytest.approx((G - 1) / G / 3, abs=1e-4)
    assert all(c == 0 for c in fresh["GRPO"]["clip_frac"]) and data["stale"]["GRPO"]["clip_frac"][0] > 0
    for kind in exact_gradient.KL_KINDS:
        assert {"value_bias", "value_std", "grad_cosine", "grad_norm_ratio", "grad_relative_error",
                "grad_relative_variance"} <= set(data["kl"][kind])
    n = len(data["kl"]["scales"])
    assert data["kl"]["k1"]["value_bias"] == pytest.approx([0] * n, abs=1e-4)
    assert data["kl"]["k2 of the answer"]["grad_relative_error"] == pytest.approx([0] * n, abs=1e-3)
