"""Every number a lab page (docs/lab/*.md) quotes through a mark equals its JSON's, rounded as the page writes it:
a page cannot drift from the JSON its experiment wrote (labkit's convention: after `<!--json NAME.json-->`, a
number written `0.44<!--=a/b/0-->` is the JSON's ["a"]["b"][0]). And the checker itself: a drifted number, a
missing path, a mark before any JSON are caught; refresh_page rewrites the numbers from the JSON."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs", "lab")
sys.path.insert(0, os.path.join(REPO, "lab"))
import labkit  # noqa: E402

PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
# the JSONs whose numbers their pages must quote through marks (the exact level's, so far), at least this many
MARKED = {"kl_placement.json": 10, "length_bias_exact.json": 5, "clip_higher_exact.json": 5, "goodhart_exact.json": 5}


@pytest.mark.parametrize("page", PAGES)
def test_every_marked_number_is_its_jsons(page):
    wrong = [f"docs/lab/{page}:{n['line']}: {n['written']} where {n['json']} at {n['path']} holds {n['expected']}"
             for n in labkit.page_numbers(os.path.join(DOCS, page)) if n["written"] != n["expected"]]
    assert not wrong, "\n".join(wrong) + "\n(labkit.refresh_page rewrites them from the JSON; lab/run_all.py calls it)"


def test_the_exact_level_pages_quote_through_marks():
    quoted = {}
    for page in PAGES:
        for n in labkit.page_numbers(os.path.join(DOCS, page)):
            quoted[n["json"]] = quoted.get(n["json"], 0) + 1
    for name, least in MARKED.items():
        assert quoted.get(name, 0) >= least, f"the pages quote {quoted.get(name, 0)} marked numbers of {name}"


def test_format_like_the_docstring_examples():
    assert labkit.format_like(0.43719, "0.44") == "0.44"
    assert labkit.format_like(1191.6, "1,000") == "1,192"
    assert labkit.format_like(0.001834, "2.0e-3") == "1.8e-3"
    assert labkit.format_like(-0.25, "−0.10") == "−0.25"
    assert labkit.format_like(12, "3") == "12"
    assert labkit.format_like(0.0621, "5.0%") == "6.2%"
    with pytest.raises(ValueError):
        labkit.format_like("0.5", "0.5")


def test_a_drifted_number_is_caught_and_refreshed(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"runs": {"a": [0.1234, 0.5678]}, "n": 1234}))
    (tmp_path / "y.json").write_text(json.dumps({"runs": {"a": [9.0]}}))
    page = tmp_path / "x.md"
    page.write_text("<!--json x.json-->\nfrom 0.12<!--=runs/a/0--> to 0.57<!--=runs/a/-1--> in 1,234<!--=n--> steps;\n"
                    "<!--json y.json-->then 9.0<!--=runs/a/0-->\n")
    assert [n["written"] == n["expected"] for n in labkit.page_numbers(str(page))] == [True] * 4
    page.write_text(page.read_text().replace("0.57<", "0.58<"))  # the page drifts
    drifted = [n for n in labkit.page_numbers(str(page)) if n["written"] != n["expected"]]
    assert [(n["line"], n["written"], n["expected"], n["json"]) for n in drifted] == [(2, "0.58", "0.57", "x.json")]
    assert labkit.refresh_page(str(page)) == 1 and "to 0.57<!--=runs/a/-1-->" in page.read_text()
    assert labkit.refresh_page(str(page)) == 0
    page.write_text("<!--json x.json-->\n0.1<!--=runs/b/0-->\n")
    with pytest.raises(ValueError, match="x.md:2: x.json has nothing at 'runs/b/0'"):
        labkit.page_numbers(str(page))
    page.write_text("0.1<!--=runs/a/0-->\n<!--json x.json-->\n")
    with pytest.raises(ValueError, match="before any"):
        labkit.page_numbers(str(page))
    page.write_text("<!--json x.json-->\n0.1 <!--=runs/a/0-->\n")  # a mark the checker would not see
    with pytest.raises(ValueError, match="not right after a number"):
        labkit.page_numbers(str(page))
