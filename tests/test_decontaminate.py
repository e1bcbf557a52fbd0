"""Decontamination: training rows sharing a word n-gram with evaluation rows, checked against a brute-force
recomputation written here (its own tokenizer, sets of word tuples, every pair of rows compared)."""
import json
import os
import subprocess
import sys

import pytest

from common import UserError
from decontaminate import decontaminate, ngram_overlap, ngrams, overlap_warning, row_texts, words
from tasks import preference_pairs, rl_prompts, sft_conversations

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def brute_words(text):
    """Lowercase; every character that is not a letter or a digit separates words."""
    return "".join(c if c.isalnum() else " " for c in text.lower()).split()


def brute_texts(row):
    """The texts of an embedded-world row, gathered here by hand: every message's content, thinking and
    tool calls (SFT), the prompt, chosen and rejected messages (pairs), the prompt and answer (RL)."""
    messages = row.get("messages") or [*row.get("prompt", []), *row.get("chosen", []), *row.get("rejected", [])]
    texts = [row["ground_truth"]] if "ground_truth" in row else []
    for m in messages:
        texts += [m["content"], m.get("reasoning_content", "")]
        texts += [call["name"] + " " + json.dumps(call["arguments"]) for call in m.get("tool_calls", [])]
    return texts


def brute_grams(row, n):
    grams = set()
    for text in brute_texts(row):
        w = brute_words(text)
        grams |= {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    return grams


def test_words_and_ngrams():
    assert words("Mia HAS 12, apples! (x_y) don't") == ["mia", "has", "12", "apples", "x", "y", "don", "t"]
    assert ngrams("Mia has 12 apples.", 3) == ["mia has 12", "has 12 apples"]
    assert ngrams("Mia has 12 apples.", 5) == []  # shorter than n words: no n-gram


@pytest.mark.parametrize("n", [8, 13])
def test_counts_match_brute_force(n):
    train = sft_conversations("train", 150) + preference_pairs("train", 60) + rl_prompts("train", 60)
    evals = rl_prompts("test", 40) + sft_conversations("test", 20)
    flagged, eval_hit = ngram_overlap(train, evals, n)
    train_grams = [brute_grams(r, n) for r in train]
    eval_grams = [brute_grams(r, n) for r in evals]
    all_eval = set().union(*eval_grams)
    all_train = set().union(*train_grams)
    assert set(flagged) == {i for i, g in enumerate(train_grams) if g & all_eval}
    assert eval_hit == {j for j, g in enumerate(eval_grams) if g & all_train}
    assert 0 < len(flagged) < len(train) and 0 < len(eval_hit) < len(evals)  # both kinds of row occur
    for i, (j, gram) in flagged.items():  # each example really is shared by the two rows it names
        assert tuple(gram.split()) in train_grams[i] & eval_grams[j]
    assert ngram_overlap(train, evals, n)[0] == flagged


def test_boundary_and_disjoint_texts():
    question = "Mia has 12 apples. She buys 7 more apples at the market. How many apples does Mia have now?"
    shifted = "Yesterday " + " ".join(question.split()[:12]) + " and then she went home."  # 12 words shared
    assert ngram_overlap([shifted], [question], n=13)[0] == {}
    assert ngram_overlap([shifted], [question], n=12)[0] == {0: (0, "mia has 12 apples she buys 7 more apples at the market")}
    disjoint = ["The weather was cold and windy all week, so the children stayed inside and read books.",
                "A train leaves the station at noon and arrives in the city two hours later."]
    assert ngram_overlap(disjoint, rl_prompts("test", 50), n=8)[0] == {}
    assert overlap_warning(disjoint, rl_prompts("test", 50)) is None
    assert ngram_overlap(["MIA has 12 apples; she BUYS 7 more apples -- at the market... HOW"], [question], n=13)[0]  # case, punctuation


def test_planted_leak_is_found_and_dropped(tmp_path):
    leaked = rl_prompts("test", 30)[17]
    # a training file that is clean of the evaluation questions (none of these texts are templated) + one leak
    clean = [{"messages": [{"role": "user", "content": f"Write a short poem about the number {k} and the sea."},
                           {"role": "assistant", "content": f"Waves count to {k}, the tide forgets, the moon remembers."}]}
             for k in range(20)]
    leak = {"messages": [*leaked["prompt"], {"role": "assistant", "content": "#### " + leaked["ground_truth"]}]}
    rows = clean[:5] + [leak] + clean[5:]
    data, against, drop = tmp_path / "train.jsonl", tmp_path / "test.jsonl", tmp_path / "clean.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    against.write_text("".join(json.dumps(r) + "\n" for r in rl_prompts("test", 30)))

    stats = decontaminate(str(data), str(against), n=13, drop=str(drop))
    assert stats == {"n": 13, "rows": 21, "flagged_rows": 1, "eval_rows": 30, "eval_rows_shared": 1}
    assert [json.loads(line) for line in drop.read_text().splitlines()] == clean  # the rest, unchanged
    warning = overlap_warning(rows, rl_prompts("test", 30))
    assert warning.startswith("warning: --data: 1 of 21 rows share a 13-word n-gram with 1 of 30 evaluation rows, e.g. row 6:")

    # the command line, and a malformed row named by file:line
    p = subprocess.run([sys.executable, "decontaminate.py", "--data", str(data), "--against", str(against)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "1 of 21 rows" in p.stdout and "row 6 and evaluation row 18 share" in p.stdout
    data.write_text(json.dumps(clean[0]) + "\n" + json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(UserError, match=r"train.jsonl:2: 'messages' must be a list"):
        decontaminate(str(data), str(against))


def test_row_texts_of_every_form():
    sft = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "", "reasoning_content": "think",
                         "tool_calls": [{"name": "calculator", "arguments": {"expression": "1 + 2"}}]},
                        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "a"}]}
    assert row_texts(sft) == ["q", "think", 'calculator {"expression": "1 + 2"}', "3", "a"]
    assert row_texts({"prompt": "p", "chosen": "c", "rejected": "r"}) == ["p", "c", "r"]
    assert row_texts({"prompt": "p", "completion": "c", "label": True}) == ["p", "c"]
    assert row_texts({"prompt": "p", "ground_truth": "42", "verifier": "gsm8k"}) == ["p", "42"]
    assert row_texts({"text": "plain"}) == ["plain"]
    with pytest.raises(ValueError, match="expected an SFT row"):
        row_texts({"question": "q"})


def test_a_stage_given_data_warns_when_its_held_out_rows_overlap(tmp_path):
    """chat_rl.py --data FILE: a held-out row (the file's last 2%) that repeats a training row is reported
    before any model is loaded (the run then stops on the missing --init, which is fine here)."""
    rows = [{"prompt": f"Mia has {i} apples and buys {i + 3} more apples at the market today. How many now?",
             "ground_truth": str(2 * i + 3), "verifier": "gsm8k"} for i in range(60)]
    rows.append(rows[5])  # the last row (held out) repeats a training row
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "NANOPOST_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_rl.py"), "--data", str(data), "--init",
                        str(tmp_path / "missing")], env=env, capture_output=True, text=True, timeout=300)
    assert "warning: --data: " in r.stdout and "evaluation rows" in r.stdout
    assert r.returncode == 2  # the missing model, after the warning
