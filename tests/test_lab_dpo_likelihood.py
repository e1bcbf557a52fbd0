"""lab/dpo_likelihood.py at smoke size on conftest.lab_home: its figure and the JSON keys docs/lab/dpo_likelihood.md
quotes."""
import pytest

from lab_smoke import run_lab


@pytest.mark.xdist_group("lab_home")  # one worker builds the session's lab_home, not each
def test_dpo_likelihood_smoke(lab_home, tmp_path):
    data = run_lab("dpo_likelihood", lab_home, tmp_path)
    kinds = ["minimal_edit", "wrong_step", "missing_answer", "rambling"]
    assert data["kinds"] == kinds and list(data["runs"]) == kinds
    sim = data["similarity"]
    assert min(sim["minimal_edit"]) > max(sim["rambling"])  # one number apart against a threefold answer
    for kind in kinds:
        run = data["runs"][kind][0]
        assert len(run["delta_chosen"]) == len(run["delta_rejected"]) == len(sim[kind]) == data["val_pairs"]
        assert run["eval_step"] == [0, 1, 2] and run["val_delta_chosen"][0] == 0.0
        assert sum(run["at_split"].values()) == pytest.approx(1.0)
        s = data["summary"][kind]
        assert {"similarity", "delta_chosen", "delta_rejected", "fell", "at_split_start", "at_split_end"} <= s.keys()
    assert data["summary"]["trend"]["pairs"] == 4 * data["val_pairs"]
    assert [c["command"].split()[1] for c in data["commands"]] == ["chat_dpo.py"] * 4
