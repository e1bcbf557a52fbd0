"""lab/sampler_trainer.py and lab/staleness.py (the two halves of docs/lab/sampler_trainer.md) at smoke size on
conftest.lab_home: each writes its figure and the JSON keys the page quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_sampler_trainer_smoke(lab_home, tmp_path):
    data = run_lab("sampler_trainer", lab_home, tmp_path)
    batch = data["one_batch"]
    # one batch: the float32 sampler at the trainer's temperature is the trainer to float noise; the others are not,
    # and the hotter one is further off
    assert batch["float32, T=1.0"]["gap_max"] < 1e-5 < batch["bfloat16, T=1.0"]["gap_mean"]
    assert batch["float32, T=1.1"]["gap_mean"] < batch["float32, T=1.3"]["gap_mean"]
    for b in batch.values():
        assert sum(b["gap_histogram"]) == b["tokens"]
    names = ["on-policy", "T1.1-none", "T1.1-tis", "T1.1-mask", "T1.3-none", "T1.3-tis", "T1.3-mask"]
    assert list(data["runs"]) == names
    runs = {n: data["runs"][n][0] for n in names}
    assert max(runs["on-policy"]["logprob_mismatch"]) < 1e-5 < min(runs["T1.3-none"]["logprob_mismatch"])
    assert all(w == 1.0 for w in runs["T1.3-none"]["correction_mean"])  # none weighs every token 1
    for name in names:
        assert runs[name]["step"] == [1, 2] and len(runs[name]["per_problem"]) == data["eval_problems"]
        assert data["summary"][name]["minus_on_policy"]["n"] == data["eval_problems"]
    assert "--sampler-temperature 1.3 --correction token-mask" in data["commands"][-1]["command"]


@pytest.mark.xdist_group("lab_home")
def test_staleness_smoke(lab_home, tmp_path):
    data = run_lab("staleness", lab_home, tmp_path)
    runs = {n: rs[0] for n, rs in data["runs"].items()}
    assert list(runs) == ["k0-tis", "k1-tis", "offpolicy-tis", "k4-none", "k4-tis"]
    # the staleness each run trained at, step by step (k = 4 reaches 4 only after 4 steps: the smoke runs 3)
    assert runs["k0-tis"]["staleness_steps"] == {"0": 3} and runs["k1-tis"]["staleness_steps"] == {"0": 1, "1": 2}
    assert runs["k4-tis"]["staleness_steps"] == {"0": 1, "1": 1, "2": 1}
    # --off-policy and --staleness 1: the same weights, prompts and seeds, so the same answers and gaps
    assert runs["offpolicy-tis"]["reward"] == runs["k1-tis"]["reward"]
    for row in data["summary"]["offpolicy_vs_k1_mismatch"]:
        assert row["offpolicy"] == pytest.approx(row["k1"], rel=1e-4, abs=1e-7)
    for name in runs:
        assert {"reward_2nd_half", "pass@1", "logprob_mismatch", "correction_mean", "clip_frac", "minus_k0"} <= \
            data["summary"][name].keys()
