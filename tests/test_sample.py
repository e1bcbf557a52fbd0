"""chat_sample.py: the keep rules and pairs against hand-computed expectations, the files it writes read by
chat_sft's and chat_dpo's loaders (and rendering back to the very tokens sampled), errors, and real runs."""
import json
import os
import subprocess
import sys

import pytest
import torch

from chat_sample import write_jsonl
from sampled_data import build_rows, keep_answers, preference_pair, sample_groups
from model import GPT, GPTConfig
from data import load_preferences, load_sft
from tasks import rl_prompts
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------
# The rules, by hand

def test_verified_keeps_at_most_max_per_prompt():
    texts, done = ["a", "b", "c", "d"], [True] * 4
    assert keep_answers([1, 0, 1, 0], texts, done, "verified", max_per_prompt=1) == [0]
    assert keep_answers([1, 0, 1, 0], texts, done, "verified", max_per_prompt=4) == [0, 2]
    assert keep_answers([0, 0, 0, 0], texts, done, "verified", max_per_prompt=4) == []
    # the threshold: a weighted reward 1.1 = verifier + 0.1 * format passes 1.0, 0.1 does not
    assert keep_answers([0.1, 1.1, 1.0], ["a", "b", "c"], [True] * 3, "verified", 3, threshold=1.0) == [1, 2]


def test_best_picks_the_highest_and_all_keeps_everything_best_first():
    texts, done = ["a", "b", "c"], [True] * 3
    assert keep_answers([0.2, 0.9, 0.5], texts, done, "best", max_per_prompt=1) == [1]
    assert keep_answers([0.2, 0.9, 0.5], texts, done, "best", max_per_prompt=2) == [1, 2]
    assert keep_answers([0.0, 0.0, 0.0], texts, done, "best", max_per_prompt=1) == [0]  # best-of-n keeps one anyway
    assert keep_answers([1, 0, 1, 0], ["a", "b", "c", "d"], [True] * 4, "all", max_per_prompt=4) == [0, 2, 1, 3]


def test_cut_off_and_repeated_answers_are_not_kept():
    # answer 0 scored 1 but hit the length limit; answer 2 repeats answer 1's text
    assert keep_answers([1, 1, 1, 0], ["a", "b", "b", "d"], [False, True, True, True], "verified", 4) == [1]
    assert keep_answers([1, 0], ["a", "b"], [False, False], "all", 4) == []


def test_pairs_only_from_groups_with_differing_rewards():
    done = [True] * 4
    assert preference_pair([0, 1, 1, 0], ["a", "b", "c", "d"], done) == (1, 0)
    assert preference_pair([1, 1, 1, 1], ["a", "b", "c", "d"], done) is None
    assert preference_pair([0, 0, 0, 0], ["a", "b", "c", "d"], done) is None
    assert preference_pair([0.3, 0.9, 0.1], ["a", "b", "c"], [True] * 3) == (1, 2)
    assert preference_pair([1, 0], ["a", "b"], [True, False]) is None   # the only wrong one was cut off
    assert preference_pair([1, 0], ["a", "a"], [True, True]) is None    # the same text cannot be both


def test_unknown_keep_rule():
    with pytest.raises(ValueError, match="keep rule"):
        keep_answers([1], ["a"], [True], "most")


# ------------------------------------------------------------------------------------------------
# Sampling with a scripted engine, and the round trip through the loaders

def tiny_model(tok, max_seq_len=512):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                         intermediate_size=64, max_seq_len=max_seq_len))


def scripted(monkeypatch, tok, answers, truncated=()):
    """Engine.generate answers the p-th prompt it is given (counting across calls) with answers[p][j] for
    its sample j; (p, j) in truncated is cut at the length limit (no <|im_end|>)."""
    from engine import Completion
    seen = []

    def fake_generate(self, prompt_ids, num_samples, **kw):
        out = []
        for i in range(len(prompt_ids)):
            p = len(seen)
            seen.append(p)
            for j in range(num_samples):
                cut = (p, j) in truncated
                tokens = tok.encode(answers[p][j]) + ([] if cut else [tok.eos_id])
                out.append(Completion(i, tokens=tokens, logprobs=[0.0] * len(tokens), mask=[1] * len(tokens),
                                      finish_reason="length" if cut else "stop"))
        return out
    monkeypatch.setattr("engine.Engine.generate", fake_generate)


def test_files_load_in_the_sft_and_dpo_loaders_and_render_the_sampled_tokens(tok, monkeypatch, tmp_path):
    from engine import Engine
    from rewards import Grader
    rows = rl_prompts("train", 3)
    right = [f"The answer.\n#### {r['ground_truth']}" for r in rows]
    wrong = [f"The answer.\n#### {int(r['ground_truth']) + 1}" for r in rows]
    answers = [[wrong[0], right[0], right[0], wrong[0]],   # rewards 0 1 1 0: one row, one pair (1, 0)
               [wrong[1]] * 4,                             # all wrong: no row, no pair
               [right[2], wrong[2], right[2], wrong[2]]]   # answer 0 cut off: row from answer 2, pair (2, 1)
    scripted(monkeypatch, tok, answers, truncated={(2, 0)})
    groups = sample_groups(Engine(tiny_model(tok), tok), rows, Grader("verifier", tok), samples=4, batch_size=2,
                           seed=0, max_new_tokens=16)
    assert [g[0] for g in (groups[0], groups[1], groups[2])] == [[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]]
    sft, pairs, counts = build_rows(rows, groups, "verified", max_per_prompt=2)
    assert counts["prompts"] == 3 and counts["answers"] == 12 and counts["prompts_kept"] == 2 and counts["finished"] == 11
    assert [r["messages"][-1]["content"] for r in sft] == [right[0], right[2]]  # the repeat of right[0] is dropped
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [(right[0], wrong[0]),
                                                                                         (right[2], wrong[2])]
    write_jsonl(tmp_path / "rs.jsonl", sft)
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    loaded, loaded_pairs = load_sft(str(tmp_path / "rs.jsonl")), load_preferences(str(tmp_path / "pairs.jsonl"))
    assert len(loaded) == 2 and len(loaded_pairs) == 2
    assert loaded_pairs[0]["prompt"] == rows[0]["prompt"]
    # what SFT trains on is exactly what was sampled: the prompt as the engine saw it, the answer, <|im_end|>
    ids, mask = tok.render_conversation(loaded[0]["messages"])
    prompt = tok.render_for_completion(rows[0]["prompt"])
    answer = tok.encode(right[0]) + [tok.eos_id]
    assert ids[:len(prompt) + len(answer)] == prompt + answer
    assert [i for i, m in zip(ids, mask) if m][:len(answer)] == answer
    from preferences import completion_example
    x, y = completion_example(tok, loaded_pairs[0]["prompt"], loaded_pairs[0]["chosen"], None, 1024)
    assert [t for t in y if t >= 0][:len(answer)] == answer


def test_an_answer_that_stops_at_once_is_an_empty_message_the_loaders_take(tok, monkeypatch, tmp_path):
    """A sampled answer of no token but its <|im_end|> is a wrong answer like any other: its pair is written with an
    empty assistant message as the rejected side, which load_preferences reads (lab/goodhart.py's seed 1 once wrote
    "rejected": [] there, and chat_rm.py refused the file), and which renders back to the tokens sampled."""
    from engine import Engine
    from rewards import Grader
    rows = rl_prompts("train", 1)
    right = f"The answer.\n#### {rows[0]['ground_truth']}"
    scripted(monkeypatch, tok, [[right, ""]])
    groups = sample_groups(Engine(tiny_model(tok), tok), rows, Grader("verifier", tok), samples=2, batch_size=2,
                           seed=0, max_new_tokens=16)
    _, pairs, _ = build_rows(rows, groups, "verified")
    assert [(p["chosen"][0]["content"], p["rejected"]) for p in pairs] == [(right, [{"role": "assistant",
                                                                                     "content": ""}])]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    (loaded,) = load_preferences(str(tmp_path / "pairs.jsonl"))
    from preferences import completion_example
    _, y = completion_example(tok, loaded["prompt"], loaded["rejected"], None, 1024)
    assert [t for t in y if t >= 0][:1] == [tok.eos_id]  # the answer is its end of turn, as it was sampled


def test_best_of_n_with_best_keeps_one_per_prompt_even_when_none_is_right(tok, monkeypatch):
    from engine import Engine
    from rewards import Grader
    rows = rl_prompts("train", 2)
    answers = [["no answer here", "#### 0", "still nothing", "#### 1"]] * 2
    scripted(monkeypatch, tok, answers)
    groups = sample_groups(Engine(tiny_model(tok), tok), rows, Grader("format", tok), samples=4, batch_size=8, seed=0,
                           max_new_tokens=16)
    sft, pairs, _ = build_rows(rows, groups, "best", max_per_prompt=1)
    assert [r["messages"][-1]["content"] for r in sft] == ["#### 0", "#### 0"]  # format 1 beats 0; first of the tie
    assert [p["rejected"][0]["content"] for p in pairs] == ["no answer here"] * 2


# ------------------------------------------------------------------------------------------------
# Errors, and real runs of chat_sample.py

@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    save_hf(tiny_model(tok), str(path), tok)
    return str(path)


def sample_run(home, *args, nproc=1):
    script = os.path.join(REPO, "chat_sample.py")
    cmd = [sys.executable, script, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bad_reward_or_data_line_errors_naming_what_and_where(tmp_path):
    r = sample_run(tmp_path, "--reward", "verifier+bogus", "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "--reward 'verifier+bogus'" in r.stderr and "'bogus'" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "2+2?", "ground_truth": "4", "verifier": "gsm8k"}\n{"prompt": "3+3?", "ground_truth": "6"}\n')
    r = sample_run(tmp_path, "--data", str(bad), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and f"{bad}:2:" in r.stderr and "verifier" in r.stderr
    r = sample_run(tmp_path)
    assert r.returncode == 2 and "--out" in r.stderr


@pytest.mark.slow
def test_two_ranks_write_what_one_rank_writes(tmp_path, tiny_chat):
    # batches of 2 prompts: rank 0 samples prompts 0-1 and 4-5, rank 1 prompts 2-3, each batch with its own seed
    torch.manual_seed(1)
    rm = load_hf(tiny_chat, head="scalar")
    torch.nn.init.normal_(rm.score.weight)  # a random scorer: every answer its own reward
    save_hf(rm, str(tmp_path / "rm"))
    common = ["--init", tiny_chat, "--num-prompts", "6", "--samples", "3", "--max-new-tokens", "6",
              "--batch-size", "2", "--keep", "all", "--reward", f"verifier+0.5*format+rm:{tmp_path / 'rm'}"]
    one = sample_run(tmp_path / "one", *common, "--out", str(tmp_path / "one.jsonl"),
                     "--pairs-out", str(tmp_path / "one_pairs.jsonl"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = sample_run(tmp_path / "two", *common, "--out", str(tmp_path / "two.jsonl"),
                     "--pairs-out", str(tmp_path / "two_pairs.jsonl"), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = [line for line in one.stdout.splitlines() if "mean reward" in line]
    assert summary and "18 answers to 6 prompts" in summary[0]
    assert "mean reward 0.000" not in summary[0] and "mean reward -0.000" not in summary[0]  # the same 18 answers
    assert summary == [line for line in two.stdout.splitlines() if "mean reward" in line]
    assert (tmp_path / "one.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()
    assert (tmp_path / "one_pairs.jsonl").read_bytes() == (tmp_path / "two_pairs.jsonl").read_bytes()
    for line in (tmp_path / "one.jsonl").read_text().splitlines():
        assert json.loads(line)["messages"][-1]["role"] == "assistant"


# ------------------------------------------------------------------------------------------------
# The recipes' table: chat_eval --report over a list of runs

def test_report_of_a_list_of_runs_keeps_their_order_and_names_a_missing_one(tmp_path, monkeypatch, capsys):
    from chat_eval import report
    from common import UserError
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    for name, m in {"sft/r1": {"pass@1": 0.5, "val_loss": 1.0}, "rl/r1": {"pass@1": 0.625, "pass@1_t1": 0.25},
                    "sft/r1-rs": {"pass@1": 0.75}}.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "eval.json").write_text(json.dumps(m))
    rep = report(runs=["sft/r1", "rl/r1", "sft/r1-rs"], out=str(tmp_path / "r1.json"))
    assert list(rep) == ["sft/r1", "rl/r1", "sft/r1-rs"] and rep["rl/r1"]["pass@1_t1"] == 0.25
    assert json.loads((tmp_path / "r1.json").read_text()) == rep
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["sft/r1", "0.500", "-", "-", "-", "-", "-", "?"]  # ?: an eval.json without its run
    assert lines[2].split() == ["rl/r1", "0.625", "0.250", "-", "-", "-", "-", "?"]
    with pytest.raises(UserError, match="rl/r1-2"):
        report(runs=["sft/r1", "rl/r1-2"])


@pytest.mark.slow
def test_eval_out_adds_to_a_runs_eval_json(tmp_path, tiny_chat):
    (tmp_path / "eval.json").write_text(json.dumps({"val_loss": 1.5}))
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_eval.py"), "--model", tiny_chat, "--problems", "2",
                        "--max-new-tokens", "4", "--out", str(tmp_path / "eval.json")],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert ev["val_loss"] == 1.5 and ev["pass@1"] == 0.0 and "stop_rate" in ev
    r = subprocess.run([sys.executable, os.path.join(REPO, "chat_eval.py"), "--model", tiny_chat, "--problems", "2",
                        "--max-new-tokens", "4", "--samples", "2", "--temperature", "1", "--out", str(tmp_path / "eval.json")],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ev2 = json.loads((tmp_path / "eval.json").read_text())  # sampled: pass@k_t1 and maj@2_t1 added, greedy kept
    assert set(ev2) == set(ev) | {"pass@1_t1", "pass@2_t1", "maj@2_t1"} and ev2["stop_rate"] == ev["stop_rate"]


@pytest.mark.slow
def test_data_file_prompts_are_all_sampled_and_num_prompts_takes_the_first(tmp_path, tiny_chat):
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rl_prompts("train", 3, seed=5)))
    for extra, expect in (([], "12 answers to 3 prompts"), (["--num-prompts", "2"], "8 answers to 2 prompts")):
        r = sample_run(tmp_path, "--init", tiny_chat, "--data", str(data), "--samples", "4", "--max-new-tokens", "4",
                       "--keep", "all", "--out", str(tmp_path / "o.jsonl"), *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        assert expect in r.stdout
        empty = not (tmp_path / "o.jsonl").read_text()  # 4 tokens: a random model rarely stops in time
        assert ("warning: --out" in r.stderr) == empty, r.stderr[-3000:]


def test_tool_answers_become_the_messages_that_render_back_to_the_tokens_sampled(tok, tmp_path):
    """--tools: a scripted model writes a two-call conversation, the engine runs the calls; the SFT row holds
    the assistant's turns and the tool results as messages, which render back to exactly the prompt the engine
    saw and the tokens it sampled and forced. A call that does not parse is not written."""
    from engine import Engine
    from rewards import Grader
    from tasks import CALCULATOR_SCHEMA, TOOLS
    from test_engine import ScriptedGPT
    from test_multiturn import call
    row = {"prompt": [{"role": "user", "content": "Sam has 12 boxes with 7 eggs in each. He breaks 5. How many are left?"}],
           "ground_truth": "79", "verifier": "gsm8k"}
    answer = [{"role": "assistant", "content": "", "tool_calls": [call("12 * 7")]}, {"role": "tool", "content": "84"},
              {"role": "assistant", "content": "Now the eggs that broke.", "tool_calls": [call("84 - 5")]},
              {"role": "tool", "content": "79"}, {"role": "assistant", "content": "#### 79"}]
    tools = [CALCULATOR_SCHEMA]
    full, _ = tok.render_conversation(row["prompt"] + answer, tools=tools)
    groups = sample_groups(Engine(ScriptedGPT(tok.vocab_size, full), tok, tools=TOOLS), [row], Grader("verifier", tok),
                           samples=1, batch_size=1, seed=0, max_new_tokens=len(full), temperature=0.0,
                           tool_schemas=tools)
    sft, _, counts = build_rows([row], groups, "verified", tools=tools)
    assert counts["verified"] == 1 and counts["unrenderable"] == 0
    assert sft[0]["messages"] == row["prompt"] + answer and sft[0]["tools"] == tools
    write_jsonl(tmp_path / "rs.jsonl", sft)
    (loaded,) = load_sft(str(tmp_path / "rs.jsonl"))
    assert tok.render_conversation(loaded["messages"], tools=loaded["tools"])[0] == full
    # a call that is not JSON: the engine hands back an error and the answer goes on to the right number, but
    # its messages cannot say what was called: scored, not written
    from engine import run_tool_calls
    bad = "<tool_call>\n{not json}\n</tool_call>"
    prompt = tok.render_for_completion(row["prompt"], tools=tools)
    script = prompt + tok.encode(bad) + [tok.eos_id] + tok.render_tool_responses(run_tool_calls(bad, TOOLS)) + \
        tok.encode("#### 79") + [tok.eos_id]
    groups = sample_groups(Engine(ScriptedGPT(tok.vocab_size, script), tok, tools=TOOLS), [row], Grader("verifier", tok),
                           samples=1, batch_size=1, seed=0, max_new_tokens=len(script), temperature=0.0, tool_schemas=tools)
    sft, _, counts = build_rows([row], groups, "verified", tools=tools)
    assert groups[0][0] == [1.0] and groups[0][2] == [True] and groups[0][3] == [None]
    assert sft == [] and counts["unrenderable"] == 1
    # a call that is JSON but names no tool: the renderer refuses the message, so it is not written either
    nameless = '<tool_call>\n{"name": "", "arguments": {"expression": "84 - 5"}}\n</tool_call>'
    script = prompt + tok.encode(nameless) + [tok.eos_id] + tok.render_tool_responses(run_tool_calls(nameless, TOOLS)) + \
        tok.encode("#### 79") + [tok.eos_id]
    groups = sample_groups(Engine(ScriptedGPT(tok.vocab_size, script), tok, tools=TOOLS), [row], Grader("verifier", tok),
                           samples=1, batch_size=1, seed=0, max_new_tokens=len(script), temperature=0.0, tool_schemas=tools)
    assert groups[0][0] == [1.0] and groups[0][3] == [None]
