"""--data as a mixture of files (data.mixture_rows): the weights, each file's own held-out rows, a seeded sample
that repeats no row, each row's source; the source reaching the metrics: SFT's held-out loss of each source, and
the sampling stages' accuracy and reward by source (rollout_metrics), summed over ranks that hold different
sources (common.all_reduce_dict: tests/test_dist.py)."""
import json
import math

import pytest
import torch

import chat_sft
from checkpoint import save_hf
from common import UserError
from data import load_rl, load_sft, mixture_rows, parse_mixture
from inprocess import run_stage
from packing import heldout_loss
from model import GPT, GPTConfig
from rollout import Rollouts, rollout_metrics
from tasks import code_conversations, rl_prompts, sft_conversations


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def conversation(i, tag):
    return {"messages": [{"role": "user", "content": f"{tag} {i}?"}, {"role": "assistant", "content": f"{i}"}]}


def test_parse_mixture():
    assert parse_mixture("a.jsonl") == [("a.jsonl", 1.0)]
    assert parse_mixture("a.jsonl:0.7,b.jsonl:0.3") == [("a.jsonl", 0.7), ("b.jsonl", 0.3)]
    assert parse_mixture("a.jsonl:2, dir/b.jsonl") == [("a.jsonl", 2.0), ("dir/b.jsonl", 1.0)]
    for spec, message in (("a.jsonl:x,b.jsonl:1", "must be a number"), ("a.jsonl:0,b.jsonl:1", "must be > 0"),
                          ("a.jsonl:-1,b.jsonl:1", "must be > 0"), ("a.jsonl:nan,b.jsonl:1", "must be > 0")):
        with pytest.raises(UserError, match=message):
            parse_mixture(spec)


def test_mixture_rows_keep_the_weights_and_each_files_held_out_rows(tmp_path):
    """The docstring's example: new.jsonl (1,000 rows) at 0.7 and old.jsonl (5,000) at 0.3 give new's first 980
    and 420 of old's first 4,900; each file's last 2% is held out, and every row is of its file's source."""
    new = write(tmp_path / "new.jsonl", [conversation(i, "new") for i in range(1000)])
    old = write(tmp_path / "old.jsonl", [conversation(i, "old") for i in range(5000)])
    train, val = mixture_rows(f"{new}:0.7,{old}:0.3", load_sft, seed=0)
    by_source = {s: [r for r in train if r["source"] == s] for s in ("new", "old")}
    assert (len(by_source["new"]), len(by_source["old"]), len(train)) == (980, 420, 1400)
    held = {s: [r for r in val if r["source"] == s] for s in ("new", "old")}
    assert (len(held["new"]), len(held["old"])) == (20, 100)
    assert {r["messages"][1]["content"] for r in held["old"]} == {str(i) for i in range(4900, 5000)}
    trained_old = {int(r["messages"][1]["content"]) for r in by_source["old"]}
    assert len(trained_old) == 420 and max(trained_old) < 4900  # no row twice, none of the held-out ones
    assert {int(r["messages"][1]["content"]) for r in by_source["new"]} == set(range(980))  # the scarce file whole
    again, _ = mixture_rows(f"{new}:0.7,{old}:0.3", load_sft, seed=0)
    other, _ = mixture_rows(f"{new}:0.7,{old}:0.3", load_sft, seed=1)
    assert again == train and other != train  # a seeded sample
    # --eval-data replaces the files' own held-out rows; a file given alone is read whole, as before
    assert mixture_rows(f"{new}:0.7,{old}:0.3", load_sft, [conversation(0, "eval")])[1] == [conversation(0, "eval")]
    alone, alone_val = mixture_rows(new, load_sft)
    assert len(alone) == 980 and len(alone_val) == 20 and "source" not in alone[0]
    # the weights, not the files' sizes: old scarce for its weight now, used whole
    train, _ = mixture_rows(f"{new}:0.1,{old}:0.9", load_sft, seed=0)
    assert sum(r["source"] == "old" for r in train) == 4900 and sum(r["source"] == "new" for r in train) == 544


def test_a_rows_own_source_wins_and_verls_data_source_is_one(tmp_path):
    rows = [{**conversation(i, "a"), **({"source": "tulu/flan"} if i % 2 else {})} for i in range(100)]
    path_a, path_b = write(tmp_path / "a.jsonl", rows), write(tmp_path / "b.jsonl", rows)
    train, _ = mixture_rows(f"{path_a}:1,{path_b}:1", load_sft)
    assert {r["source"] for r in train} == {"tulu/flan", "a", "b"}
    verl = write(tmp_path / "verl.jsonl", [{"prompt": "1 + 1?", "data_source": "openai/gsm8k",
                                             "reward_model": {"ground_truth": "2"}}])
    assert load_rl(verl)[0]["source"] == "openai/gsm8k"
    with pytest.raises(UserError, match="share a name"):
        mixture_rows(f"{path_a}:1,{tmp_path}/../{tmp_path.name}/a.jsonl:1", load_sft)


def test_rollout_metrics_by_source():
    """Accuracy and reward of each source's answers, by hand: a's answers score 1, 0, 1 (accuracy 2/3, reward
    2/3), b's 0.5 (accuracy 0: below 1) and 0; a row naming no source counts in the totals only."""
    rows = [{"source": "a"}, {"source": "a"}, {"source": "b"}, {"source": "a"}, {"source": "b"}, {}]
    rollouts = Rollouts(rows, [[1]] * 6, [type("C", (), {"tokens": [1, 2], "finish_reason": "stop", "tool_calls": 0,
                                                         "tool_errors": 0})()] * 6,
                        torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0]))
    metrics = rollout_metrics(rollouts.stats())
    assert math.isclose(metrics["source/a/accuracy"], 2 / 3) and math.isclose(metrics["source/a/reward"], 2 / 3)
    assert metrics["source/b/accuracy"] == 0.0 and metrics["source/b/reward"] == 0.25
    assert metrics["accuracy"] == 0.5 and not any(k.startswith("source/") for k in rollout_metrics(
        Rollouts([{}] * 2, [[1]] * 2, rollouts.completions[:2], torch.tensor([1.0, 0.0])).stats()))


@pytest.fixture(scope="module")
def chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("mixture")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def loaded_run(run_dir):
    """The last checkpoint of a run directory, loaded."""
    from checkpoint import load_hf, resolve_model_path
    return load_hf(resolve_model_path(str(run_dir), head="lm")).eval()


def test_sft_logs_the_held_out_loss_of_each_source(monkeypatch, tmp_path, chat, tok):
    """A mixture of the world's arithmetic and code conversations: the held-out loss of each source beside the
    whole's, at every evaluation and in eval.json; each equal to the loss of that source's held-out rows alone."""
    arith = write(tmp_path / "arith.jsonl", sft_conversations("train", 100))
    code = write(tmp_path / "code.jsonl", code_conversations("train", 100))
    argv = ["--init", chat, "--data", f"{arith}:0.5,{code}:0.5", "--steps", "2", "--batch-size", "4",
            "--device-batch-size", "2", "--seq-len", "256", "--save-every", "100", "--warmup-steps", "0",
            "--eval-every", "1"]
    rows = run_stage(monkeypatch, tmp_path, chat_sft, *argv)
    evals = [r for r in rows if "val_loss" in r]
    assert len(evals) == 2 and all({"val_loss/arith", "val_loss/code"} <= set(r) for r in evals)
    assert evals[0]["val_loss/arith"] != evals[0]["val_loss/code"]
    final = json.loads((tmp_path / "sft" / "default" / "eval.json").read_text())
    assert {"val_loss", "val_loss/arith", "val_loss/code"} <= set(final)
    # the code source's loss is the trained model's loss on code.jsonl's last 2 rows (its 2%), computed here
    args = chat_sft.parser.parse_args(argv)
    model = loaded_run(tmp_path / "sft" / "default")
    ex, _ = chat_sft.render_examples(tok, code_conversations("train", 100)[-2:], args.seq_len, args.overlong)
    loss = heldout_loss(model, ex, chat_sft.build_rows(ex, args.seq_len, args.packing), tok.pad_id, args.seq_len,
                        args.packing, "cpu")
    assert math.isclose(loss, final["val_loss/code"], rel_tol=1e-5)


def test_rl_rows_mix_too(tmp_path):
    from data import rl_rows
    a = write(tmp_path / "arith.jsonl", rl_prompts("train", 50))
    b = write(tmp_path / "more.jsonl", rl_prompts("train", 50, seed=1))
    rows, held = rl_rows(f"{a}:3,{b}:1", None, eval_problems=10, num_prompts=0, seed=0)
    assert sum(r["source"] == "arith" for r in rows) == 49 and sum(r["source"] == "more" for r in rows) == 16
    assert len(held) == 2 and {r["source"] for r in held} == {"arith", "more"}
