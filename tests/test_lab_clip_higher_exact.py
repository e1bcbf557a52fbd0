"""lab/clip_higher_exact.py: one optimizer step of its exact expected update off-policy (the ratio away from 1, the
clip binding), against values computed by hand at --eps-high 0.2 and 0.28, with the clip fraction; the clip
fraction against a brute-force sum over every group; and at smoke size its figure and JSON.

The hand world (tests/test_lab_length_bias_exact.py's): every next token at 1/3 under the snapshot; right "a end",
"a b end" (reward 1), the rest wrong; J = 4/27. G = 2 with chat_rl's defaults: the group's std, so a mixed group's
advantages are +1 and -1 (0 in a flat group), token-mean (each token weighs 1 / (|y_1| + |y_2|)), eps_low 0.2. The
current policy: both tokens of "a end" at ratio 1.25, the token of "end" at 0.75, every other ratio 1. PPO's
per-token loss -min(r A, clip(r) A) has gradient -A r on a token the clip leaves alone, and 0 where it binds: for
A > 0 above 1 + eps_high, for A < 0 below 1 - eps_low. So the coefficient on a token of y is
2 p(y) sum_{y2} p(y2) sign(R(y) - R(y2)) r / (|y| + |y2|), or 0 where the clip binds:
    "a end" (A > 0, r 1.25): clipped at eps_high 0.2 -> 0; at 0.28: 2 (1/9) 1.25 ((1/3)/3 + (1/9)/4 + (11/27)/5)
    "end" (A < 0, r 0.75 < 0.8): clipped -> 0 at both
    "b end", "a b end", "a a a" (r 1): 2 (1/9) (-(1/9)/4 - (1/27)/5), 2 (1/27) ((1/3)/4 + (1/9)/5 + (11/27)/6),
        2 (1/27) (-(1/9)/5 - (1/27)/6)
The clip fraction: E[tokens where it binds] / E[tokens]; E[tokens] = 2 E|y| = 38/9; where it binds, per group:
2 ((1/9) (23/27) 2 tokens of "a end" with A > 0 + (1/3) (4/27) 1 token of "end" with A < 0) = 116/243 at 0.2,
and without "a end"'s 24/243 at 0.28."""
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import chat_rl
import exact

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "lab"))
import clip_higher_exact  # noqa: E402
from exact_dynamics import expected_update, stage_settings  # noqa: E402

torch.set_num_threads(1)

RIGHT = (exact.REWARDS == 1.0).double()
OLD = torch.full((15, exact.MAX_LEN), math.log(1 / 3), dtype=torch.float64) * exact.EVERY.mask
NOW = OLD.clone()
NOW[exact.NAMES.index("a end"), :2] += math.log(1.25)
NOW[exact.NAMES.index("end"), :1] += math.log(0.75)


@pytest.mark.parametrize("eps_high,a_end,clip_frac", [(0.2, 0.0, (116 / 243) / (38 / 9)),
                                                      (0.28, 2 / 9 * 1.25 * 119 / 540, (24 / 243) / (38 / 9))])
def test_one_off_policy_step_against_the_hand_values(eps_high, a_end, clip_frac):
    settings = stage_settings(["--eps-high", str(eps_high), "--group-size", "2"])
    coef, got_clip = expected_update(NOW, OLD, rewards=RIGHT, **settings)
    hand = {"a end": a_end, "end": 0.0, "b end": -2 / 9 * 19 / 540, "a b end": 2 / 27 * 281 / 1620,
            "a a a": -2 / 27 * 23 / 810}
    for name, value in hand.items():
        row = exact.NAMES.index(name)
        n = int(exact.LENGTHS[row])
        assert coef[row, :n].tolist() == pytest.approx([value] * n, rel=1e-5), name  # rel: the std's eps 1e-6
    assert got_clip == pytest.approx(clip_frac, rel=1e-6)


def test_the_clip_fraction_is_the_one_over_every_group():
    """exact_dynamics' clip fraction (each answer alone, per sign, weighed by its rate) against a sum over all 15^3
    groups of G = 3, each group's clipped tokens counted by chat_rl.policy_loss itself: E[clipped] / E[tokens],
    off-policy."""
    policy = exact.tiny_policy()
    old_logp = exact.token_logprobs(exact.perturbed(policy, 0.3)).detach()
    logp = exact.token_logprobs(policy).detach()
    rewards = clip_higher_exact.rewards_of(clip_higher_exact.WORLDS["rare+common"])
    settings = stage_settings(["--eps-high", "0.2", "--group-size", "3"])
    _, clip_frac = expected_update(logp, old_logp, rewards=rewards, **settings)
    p = old_logp.sum(-1).exp()
    clipped = tokens = 0.0
    for group in itertools.product(range(15), repeat=3):
        prob = float(p[list(group)].prod())
        batch = exact.batch_of(list(group))
        adv = chat_rl.group_advantages(rewards[list(group)], 3)
        _, stats = chat_rl.policy_loss(logp[list(group)], old_logp[list(group)], adv.double(), batch.mask,
                                       **settings["loss_settings"])
        n = float(batch.mask.sum())
        clipped += prob * stats["clip_frac"] * n
        tokens += prob * n
    assert clip_frac == pytest.approx(clipped / tokens, rel=1e-6) and clip_frac > 0.01


def test_the_worlds():
    p = exact.answer_probs(exact.tiny_policy()).detach()
    assert round(float(p[exact.NAMES.index(clip_higher_exact.RARE)]), 4) == 0.0082  # p ~ 0.01: the rare right answer
    assert round(float(p[exact.NAMES.index(clip_higher_exact.COMMON)]), 3) == 0.424  # the start's likeliest answer


def test_smoke_writes_the_figure_and_the_json_the_page_quotes(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "clip_higher_exact.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "clip_higher_exact.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "clip_higher_exact.json").read_text())
    assert list(data["runs"]) == ["rare", "rare+common"] and data["provenance"]["level"] == "exact"
    for world in data["runs"].values():
        assert list(world) == ["eps_high=0.2", "eps_high=0.28"]
        for run in world.values():
            assert len(run["p_rare"]) == len(run["entropy"]) == 4 and len(run["clip_frac"]) == 3
            assert run["p_rare"][0] == pytest.approx(0.0082, abs=1e-4) and run["max_clip_frac"] > 0
    # one step per batch: every ratio 1, the clip never binds, and eps_high changes nothing
    assert all(c == {"max_clip_frac": 0.0, "max_p_rare_difference": 0.0} for c in data["control"].values())
    assert {"batch", "p_rare_0.2", "p_rare_0.28", "ratio"} <= set(data["compare"]["rare"])
    for world in data["sweep"].values():  # the other learning rates, each eps_high
        assert list(world) == ["lr=0.0001", "lr=0.001"]
        assert all(set(r) == {"batch_rare_passes_half", "max_clip_frac", "min_entropy", "min_p_rare"}
                   for pair in world.values() for r in pair.values())
