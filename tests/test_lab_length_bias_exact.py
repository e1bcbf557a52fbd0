"""lab/length_bias_exact.py: one step of its exact expected update against values computed by hand, for each of
chat_rl's aggregations; and at smoke size it writes its figure and the JSON keys docs/lab/length_bias.md quotes.

The hand world: every next token at 1/3, so p(end) = 1/3, p of each 2-token answer 1/9, of each 3-token one 1/27;
right ("a end", "a b end") with reward 1, the other 13 wrong. J = P(right) = 1/9 + 1/27 = 4/27. Groups of G = 2,
advantages R - mean (--scale none): A_1 = (R_1 - R_2) / 2. On-policy every ratio is 1, so the loss's gradient on a
token of answer i is -A_i times its weight: 1 / (G |y_i|) for seq-mean-token-mean, 1 / (G max_len) for
seq-mean-token-sum-norm, 1 / (|y_1| + |y_2|) for token-mean. The coefficient on each token of y is then
G p(y) E[A_1 * weight | y_1 = y]:
    seq-mean-token-mean       p(y) (R(y) - J) / (2 |y|)
    seq-mean-token-sum-norm   p(y) (R(y) - J) / 6
    token-mean                p(y) sum_{y2} p(y2) (R(y) - R(y2)) / (|y| + |y2|)
The wrong answers' mass by length: 1/3 (1 token), 1/9 (2), 11/27 (3); the right ones': 1/9 (2), 1/27 (3)."""
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
import length_bias_exact  # noqa: E402
from exact_dynamics import expected_update, stage_settings  # noqa: E402

torch.set_num_threads(1)

UNIFORM = torch.full((15, exact.MAX_LEN), math.log(1 / 3), dtype=torch.float64) * exact.EVERY.mask
# the coefficient on each token of: end, a end, b end, a b end, a wrong 3-token answer (a a a)
BY_HAND = {
    "seq-mean-token-mean": [-2 / 81, 23 / 972, -1 / 243, 23 / 4374, -2 / 2187],
    "seq-mean-token-sum-norm": [-2 / 243, 23 / 1458, -2 / 729, 23 / 4374, -2 / 2187],
    # end: (1/3) (-(1/9)/3 - (1/27)/4); a end: (1/9) ((1/3)/3 + (1/9)/4 + (11/27)/5);
    # b end: (1/9) (-(1/9)/4 - (1/27)/5); a b end: (1/27) ((1/3)/4 + (1/9)/5 + (11/27)/6);
    # a a a: (1/27) (-(1/9)/5 - (1/27)/6)
    "token-mean": [-5 / 324, 119 / 4860, -19 / 4860, 281 / 43740, -23 / 21870],
}


@pytest.mark.parametrize("agg", list(BY_HAND))
def test_one_step_of_the_exact_update_against_the_hand_values(agg):
    settings = stage_settings(["--agg", agg, "--scale", "none", "--group-size", "2"])
    coef, clip_frac = expected_update(UNIFORM, UNIFORM, rewards=length_bias_exact.RIGHT, **settings)
    for name, value in zip(("end", "a end", "b end", "a b end", "a a a"), BY_HAND[agg]):
        row = exact.NAMES.index(name)
        n = int(exact.LENGTHS[row])
        assert coef[row, :n].tolist() == pytest.approx([value] * n, rel=1e-6), name
    assert clip_frac == 0.0  # on-policy: every ratio is 1


def test_the_right_answers_and_the_lengths_it_logs():
    assert [n for n, r in zip(exact.NAMES, length_bias_exact.RIGHT) if r] == ["a end", "a b end"]
    got = length_bias_exact.lengths(UNIFORM.sum(-1).exp())
    # wrong: (1/3 * 1 + 1/9 * 2 + 11/27 * 3) / (23/27) = 48/23; right: (1/9 * 2 + 1/27 * 3) / (4/27) = 9/4
    assert got == pytest.approx({"length_wrong": 48 / 23, "length_right": 9 / 4, "accuracy": 4 / 27})


def test_smoke_writes_the_figure_and_the_json_the_page_quotes(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "lab", "length_bias_exact.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "length_bias_exact.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "length_bias_exact.json").read_text())
    assert data["provenance"]["level"] == "exact" and data["provenance"]["home_report_sha256"] is None
    assert list(data["runs"]) == ["scale-none", "scale-group"] and data["steps"] == 10
    for run in data["runs"]["scale-none"].values():
        assert len(run["length_wrong"]) == len(run["length_right"]) == len(run["accuracy"]) == 11
        assert run["length_wrong"][0] == pytest.approx(data["start"]["length_wrong"])
    for run in data["runs"]["scale-group"].values():
        assert {"end", "longest_wrong"} <= set(run) and "length_wrong" not in run
    assert list(data["runs"]["scale-none"]) == ["grpo", "token_mean", "dr_grpo"]
    assert set(data["summary"]) == {"grpo", "token_mean", "dr_grpo_lowest_wrong", "std_scaling_largest_end_change"}
    assert {"widest_gap", "widest_gap_step", "length_wrong_there", "dr_grpo_length_wrong_there", "accuracy_there",
            "end_gap"} <= set(data["summary"]["grpo"])
