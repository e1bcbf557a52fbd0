"""
Decontamination: training rows that share a word n-gram with the evaluation set.

The usual rule (GPT-3 used 13-grams, others 8 to 13): a training row that shares any n consecutive words
with an evaluation prompt or answer is flagged. Words are lowercased runs of letters and digits; everything
else separates them. A text shorter than n words has no n-gram and is never flagged.

What a flag means depends on the text. Templated data (the embedded world, or any synthetic set made from
templates) share their wording across splits by design, while their problems differ; a leaked problem
shares its wording AND its specifics (names, numbers). Read the examples before dropping rows.

    python decontaminate.py --data sft.jsonl --against test.jsonl [--n 13] [--drop clean.jsonl]

The stages call overlap_warning on their --data and held-out rows and print its one line when they overlap.
"""
import argparse
import json
import re
import time

from common import UserError, run_main
from data import kto_rows, load_jsonl, preference_row, rl_row, sft_row

_WORD = re.compile(r"[^\W_]+")  # letters and digits of any script; punctuation, symbols, spaces and _ split


def words(text: str) -> list[str]:
    """words("Mia has 12 + 7 = 19 apples. Don't!") -> ['mia', 'has', '12', '7', '19', 'apples', 'don', 't']"""
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int) -> list[str]:
    """The word n-grams of a text in order, each its words joined by one space:
    ngrams("Mia has 12 apples.", 3) -> ['mia has 12', 'has 12 apples']"""
    w = words(text)
    return [" ".join(w[i:i + n]) for i in range(len(w) - n + 1)]


def _message_texts(messages: list[dict]) -> list[str]:
    texts = []
    for m in messages:
        texts += [m["content"], m.get("reasoning_content") or ""]
        texts += [f"{c['name']} {json.dumps(c['arguments'])}" for c in m.get("tool_calls") or []]
    return [t for t in texts if t]


def row_texts(row: dict) -> list[str]:
    """Every text of a JSONL row, in any form the loaders read (checked by them, so a bad row raises
    ValueError): the content, thinking and tool calls of each message of an SFT row, of a preference row's
    prompt, chosen and rejected, of a KTO row's prompt and completion, of an RL row's prompt (and its
    ground truth); or a plain {"text": ...} (what `python tasks.py pretrain` writes)."""
    if isinstance(row.get("text"), str):
        return [row["text"]]
    if "messages" in row:
        return _message_texts(sft_row(row)["messages"])
    if "chosen" in row or "rejected" in row:
        pair = preference_row(row)
        return _message_texts(pair["prompt"] + pair["chosen"] + pair["rejected"])
    if "completion" in row:
        return [t for single in kto_rows(row) for t in _message_texts(single["prompt"] + single["completion"])]
    if "prompt" in row:
        rl = rl_row(row)
        return _message_texts(rl["prompt"]) + [rl["ground_truth"]]
    raise ValueError("expected an SFT row ('messages'), a preference row ('prompt', 'chosen', 'rejected'), a KTO "
                     "row ('prompt', 'completion', 'label'), an RL row ('prompt', 'ground_truth') or {'text': ...}")


def _texts(row) -> list[str]:
    return [row] if isinstance(row, str) else row_texts(row) if isinstance(row, dict) else row


def _hashed_ngrams(texts: list[str], n: int) -> set[int]:
    return {hash(gram) for text in texts for gram in ngrams(text, n)}


def ngram_overlap(train_rows: list, eval_rows: list, n: int = 13) -> tuple[dict[int, tuple[int, str]], set[int]]:
    """Which training rows share a word n-gram with an evaluation row, and which evaluation rows share
    one with a training row, in one pass: ({training row index: (an evaluation row index, the first
    n-gram of the training row that it shares)}, {evaluation row indices}). Rows are JSONL rows
    (row_texts), strings, or lists of strings. The evaluation n-grams go into a set of hashes, and each
    training row is one pass over its own n-grams and a set intersection: 100k rows take seconds."""
    first_eval_row = {}  # hash of an evaluation n-gram -> the first evaluation row that has it
    eval_hashes = []
    for j, row in enumerate(eval_rows):
        eval_hashes.append(_hashed_ngrams(_texts(row), n))
        for h in eval_hashes[-1]:
            first_eval_row.setdefault(h, j)
    eval_keys = set(first_eval_row)
    flagged, shared = {}, set()
    for i, row in enumerate(train_rows):
        texts = _texts(row)
        common = _hashed_ngrams(texts, n) & eval_keys
        if common:
            gram = next(g for text in texts for g in ngrams(text, n) if hash(g) in common)
            flagged[i] = (first_eval_row[hash(gram)], gram)
            shared |= common
    return flagged, {j for j, hashes in enumerate(eval_hashes) if hashes & shared}


def overlap_warning(train_rows: list, eval_rows: list, n: int = 13, name: str = "--data") -> str | None:
    """One line for a stage to print when its training rows overlap the rows it evaluates on, or None:
    "warning: --data: 3 of 5,000 rows share a 13-word n-gram with 2 of 200 evaluation rows, e.g. row 17:
    '...'. Shared wording or leaked problems? ...". Rows as for ngram_overlap (the loaders' rows will do)."""
    if not train_rows or not eval_rows:
        return None
    flagged, eval_hit = ngram_overlap(train_rows, eval_rows, n)
    if not flagged:
        return None
    i, (_, gram) = next(iter(flagged.items()))
    return (f"warning: {name}: {len(flagged):,} of {len(train_rows):,} rows share a {n}-word n-gram with "
            f"{len(eval_hit):,} of {len(eval_rows):,} evaluation rows, e.g. row {i + 1}: '{gram}'. Shared "
            f"wording or leaked problems? `python decontaminate.py --data FILE --against EVAL_FILE` "
            f"lists them (--drop writes the rest)")


def decontaminate(data: str, against: str, n: int = 13, drop: str | None = None, examples: int = 5) -> dict:
    """The command `python decontaminate.py`: report the rows of `data` that share a word n-gram with a
    row of `against`, print a few, and with `drop` write the other rows of `data` there, unchanged."""
    if n < 1:
        raise UserError(f"--n {n}: an n-gram needs at least 1 word")
    t0 = time.time()
    train = load_jsonl(data, lambda row: (row, row_texts(row)))
    evals = load_jsonl(against, row_texts, flag="--against")
    flagged, eval_hit = ngram_overlap([texts for _, texts in train], evals, n)
    stats = {"n": n, "rows": len(train), "flagged_rows": len(flagged), "eval_rows": len(evals),
             "eval_rows_shared": len(eval_hit)}
    print(f"{data}: {len(flagged):,} of {len(train):,} rows ({len(flagged) / len(train):.1%}) share a {n}-word "
          f"n-gram with {len(eval_hit):,} of {len(evals):,} rows of {against} ({len(eval_hit) / len(evals):.1%}); "
          f"{time.time() - t0:.1f} s")
    for i, (j, gram) in list(flagged.items())[:examples]:
        print(f"  row {i + 1} and evaluation row {j + 1} share '{gram}'")
    if drop:
        with open(drop, "w") as f:
            for i, (row, _) in enumerate(train):
                if i not in flagged:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{len(train) - len(flagged):,} clean rows -> {drop}")
    return stats


def main():
    ap = argparse.ArgumentParser(description="training rows sharing a word n-gram with an evaluation file")
    ap.add_argument("--data", required=True, help="the training JSONL (any form the loaders read)")
    ap.add_argument("--against", required=True, help="the evaluation JSONL (prompts and answers)")
    ap.add_argument("--n", type=int, default=13, help="words per n-gram (the usual rule: 8 to 13)")
    ap.add_argument("--drop", help="write the rows that share no n-gram here")
    args = ap.parse_args()
    decontaminate(args.data, args.against, n=args.n, drop=args.drop)


if __name__ == "__main__":
    run_main(main)
