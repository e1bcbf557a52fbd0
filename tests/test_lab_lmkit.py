"""The language-model level's statistics (lab/lmkit.py) and the experiments' own small functions, against values
worked by hand or by brute force: a paired difference and its standard error, a bootstrap interval, the seeds' band;
best-of-n's exact expectation against every subset, KL_bon; a pair's similarity; pass@k curves; the hedged answers
and the "####" lines the lenient verifier's page counts."""
import itertools
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "lab"))
import lmkit  # noqa: E402
import clip_higher  # noqa: E402
import dpo_likelihood  # noqa: E402
import goodhart  # noqa: E402
import lenient_verifier  # noqa: E402
import rejection_vs_rl  # noqa: E402
from verifiers import verify  # noqa: E402


def test_mean_se_and_paired_by_hand():
    assert lmkit.mean_se([1, 0, 1, 1]) == {"mean": 0.75, "se": 0.25, "n": 4}  # std 0.5, / sqrt 4
    assert lmkit.mean_se([3.0])["se"] is None  # one value has no spread
    # b - a problem by problem: differences 0, 1, 0, 0
    assert lmkit.paired([1, 0, 0, 1], [1, 1, 0, 1]) == {"diff": 0.25, "se": 0.25, "n": 4}
    # pairing cancels what the problems share: equal differences give no error at all, however the problems vary
    assert lmkit.paired([0.1, 0.9, 0.5], [0.2, 1.0, 0.6])["se"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        lmkit.paired([1, 0], [1])


def test_seed_mean_band_and_spread():
    assert lmkit.seed_mean([[1, 0, 0.5], [0, 0, 1.0]]) == [0.5, 0.0, 0.75]  # per problem, over seeds
    b = lmkit.band([[1, 2, None], [3, 6, 5]])  # a seed without a value at a point is left out there
    assert b == {"mean": [2, 4, 5], "lo": [1, 2, 5], "hi": [3, 6, 5]}
    assert lmkit.spread([0.4, None, 0.2]) == {"mean": pytest.approx(0.3), "min": 0.2, "max": 0.4, "seeds": 2}
    assert lmkit.spread([None])["seeds"] == 0


def test_bootstrap_covers_the_mean_and_narrows_with_more_problems():
    values = [1, 0] * 50  # mean 0.5, se 0.05: a 95% interval about 0.40 .. 0.60
    lo, hi = lmkit.bootstrap(values, seed=1)
    assert 0.37 < lo < 0.45 and 0.55 < hi < 0.63
    lo4, hi4 = lmkit.bootstrap(values * 4, seed=1)
    assert hi4 - lo4 < (hi - lo) * 0.6  # four times the problems: half the width
    assert lmkit.bootstrap([2.0] * 10) == [2.0, 2.0]


def test_kl_bon_and_best_of_n_against_every_subset():
    assert goodhart.kl_bon(1) == 0.0 and goodhart.kl_bon(64) == pytest.approx(math.log(64) - 63 / 64)
    proxy, gold = [0.1, 0.9, 0.5, 0.3, 0.7], [1, 0, 1, 1, 0]
    for n in range(1, 6):  # the exact expectation is the mean over every n-subset of its top-proxy answer
        subsets = list(itertools.combinations(range(5), n))
        want_gold = sum(gold[max(s, key=proxy.__getitem__)] for s in subsets) / len(subsets)
        want_proxy = sum(max(proxy[i] for i in s) for s in subsets) / len(subsets)
        assert goodhart.best_of(proxy, gold, n) == pytest.approx((want_gold, want_proxy))
    assert goodhart.best_of([0.1, 0.9, 0.5], [1, 0, 1], 2) == pytest.approx((1 / 3, 2.3 / 3))  # the docstring's


def test_similarity_is_one_minus_the_normalized_edit_distance():
    assert dpo_likelihood.similarity([1, 2, 3, 4], [1, 2, 3, 5]) == 0.75
    assert dpo_likelihood.similarity([1, 2, 3], [1, 2, 3]) == 1.0
    assert dpo_likelihood.similarity([1, 2], [1, 2, 3, 4]) == 0.5  # two insertions over 4
    assert dpo_likelihood.similarity([5, 6], [7, 8, 9]) == 0.0


def test_minimal_edit_changes_only_the_final_number():
    for row in dpo_likelihood.pairs_of("minimal_edit", "test", 20):
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        body, last = chosen.rsplit("\n", 1)
        assert rejected.startswith(body + "\n#### ") and rejected != chosen and row["kind"] == "minimal_edit"
        assert int(rejected.rsplit(" ", 1)[1]) >= 0 and verify("gsm8k", rejected, last[5:]) == 0.0


def test_pass_curves_are_unbiased_pass_at_k():
    # 4 samples, 2 right: pass@1 1/2, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 1
    curves = clip_higher.pass_curves([2, 0], 4)
    assert [c[0] for c in curves] == pytest.approx([0.5, 5 / 6, 1.0, 1.0]) and all(c[1] == 0 for c in curves)
    assert rejection_vs_rl.pass_curve([2, 0], 4) == pytest.approx([0.25, 5 / 12, 0.5, 0.5])


def test_hedged_answers_attempt_twice_and_the_lenient_grader_pays_for_the_second():
    rows = lenient_verifier.hedged_conversations(200, 0.1)
    hedged = [r for r in rows if lenient_verifier.lines_of(r["messages"][-1]["content"]) == 2]
    assert 10 <= len(hedged) <= 35
    assert all(lenient_verifier.lines_of(r["messages"][-1]["content"]) in (1, 2) for r in rows)
    firsts_right = 0
    for r in hedged:  # an attempt, then the right one: the lenient grader passes it, the strict one does not
        answer = r["messages"][-1]["content"]
        first, truth = answer.split("#### ", 1)[1].split("\n", 1)[0], answer.rsplit("#### ", 1)[1]
        assert verify("gsm8k_any", answer, truth) == 1.0 and verify("gsm8k", answer, truth) == 0.0
        firsts_right += first == truth
    assert 0.25 * len(hedged) < firsts_right < 0.75 * len(hedged)  # the first attempt right half the time
    assert lenient_verifier.lines_of("a\n#### 3\n  #### 4\nb #### 5") == 2
