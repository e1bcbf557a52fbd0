"""Majority voting (maj@k, self-consistency: Wang et al. 2022, arXiv:2203.11171) and chat_eval.py --data: a
checkpoint graded on the user's own rows. The vote's rule is checked on hand-made cases; the whole path (a JSONL
of rows -> the engine's samples -> votes -> maj@k) against a vote counted here by hand over the same samples."""
import json
import sys
from collections import Counter

import torch

import chat_eval
import evaluation
import verifiers
from checkpoint import load_hf
from engine import Engine
from evaluation import majority_correct
from test_compare import even_code_sum, two_models  # noqa: F401 (a fixture: two tiny random models)
from verifiers import answer_text, final_answer

torch.set_num_threads(1)


def test_the_vote_rule_on_hand_made_cases():
    assert majority_correct([12, 15, 12, None], [1.0, 0.0, 1.0, 0.0])  # 12 has 2 votes, and is right
    assert not majority_correct([15, 12], [0.0, 1.0])  # a tie: the answer drawn first, 15, wins
    assert not majority_correct([None, None], [0.0, 0.0])  # no answer, no vote
    assert not majority_correct([7, 7, 3], [0.0, 0.0, 1.0])  # one right answer is pass@3, not maj@3
    assert majority_correct([None, 3, 7, 3], [0.0, 1.0, 0.0, 1.0])


def test_answers_the_verifier_reads_alike_vote_together():
    assert final_answer("gsm8k", "so 12.\n#### 12.0") == final_answer("gsm8k", "#### 12")
    assert final_answer("gsm8k", "#### 12\n#### 13") is None  # no one final answer: no vote
    assert final_answer("boxed", r"\boxed{\frac{1}{2}}") == final_answer("boxed", r"\boxed{0.5}")
    assert final_answer("boxed", r"\boxed{0}") == final_answer("boxed", r"\boxed{0.0}")  # a falsy 0 still votes
    assert final_answer("json", '{"b": 1, "a": 2}') == final_answer("json", 'x {"a":2,"b":1}')
    assert final_answer("code", "```python\nx = 1\n```") == final_answer("code", "```\nx = 1\n\n```")


def test_chat_eval_data_grades_your_rows_and_counts_the_votes(two_models, tok, tmp_path, monkeypatch, capsys):
    """A hand-written file of 5 rows: --problems 4 takes its first 4; maj@6 equals the vote counted here over the
    engine's own samples (answers one token long, so that some repeat; a random model's answers are graded by
    the parity of their character codes, and vote as their text)."""
    monkeypatch.setattr(verifiers, "verify", even_code_sum)  # verify_batch grades through it
    monkeypatch.setattr(evaluation, "final_answer", lambda verifier, answer: answer.strip() or None)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "verifier": "gsm8k",
             "ground_truth": str(2 * a)} for a in range(5)]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "--model", two_models[0], "--data", str(data), "--problems",
                                      "4", "--samples", "6", "--temperature", "1", "--max-new-tokens", "1",
                                      "--out", str(out)])
    chat_eval.main()
    assert "4 problems of" in capsys.readouterr().out
    got = json.load(open(out))
    prompts = [tok.render_for_completion(r["prompt"]) for r in rows[:4]]
    outs = Engine(load_hf(two_models[0]), tok).generate(prompts, num_samples=6, max_new_tokens=1, temperature=1.0,
                                                        seed=0)
    right, repeats = 0, 0
    for i in range(4):
        answers = [answer_text(tok.decode(o.tokens)).strip() for o in outs[i * 6:(i + 1) * 6]]
        votes = Counter(a for a in answers if a)  # an empty answer casts no vote
        if votes:
            winner = next(a for a in answers if a and votes[a] == max(votes.values()))  # ties: the first drawn
            right += even_code_sum(None, winner, None) == 1.0
            repeats += max(votes.values()) > 1
    assert repeats  # some answers repeat: the vote is not always the first sample's
    assert got["maj@6_t1"] == round(right / 4, 4)
    assert got["maj@6_t1"] <= got["pass@6_t1"]  # a right majority has a right sample
