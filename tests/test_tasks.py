"""tasks.py: the world's determinism, disjoint splits and correct arithmetic; what the stages get;
the loaders' errors; the verifiers' strictness; the calculator's safety."""

import json
import re
import time
from collections import Counter

import pytest

import tasks
from verifiers import extract_boxed, extract_gsm8k_answer, has_format, verify
from data import load_kto, load_preferences, load_rl, load_sft
from tasks import (CALCULATOR_SCHEMA, DEFAULT_DIFFICULTY, Difficulty, calculator, generate_problems, preference_pairs,
                   pretrain_text, rl_prompts, sft_conversations, split_of)

HARD = Difficulty(min_steps=4, max_steps=4, max_number=50, max_factor=9, max_result=1000)


# ---------------------------------------------------------------- the world

def test_deterministic_from_split_seed_difficulty():
    a = generate_problems("train", 200, seed=1)
    assert a == generate_problems("train", 200, seed=1)
    assert a[:50] == generate_problems("train", 50, seed=1)  # a longer run extends a shorter one
    assert a != generate_problems("train", 200, seed=2)
    assert a != generate_problems("train", 200, seed=1, difficulty=HARD)
    for make in (pretrain_text, sft_conversations, preference_pairs, rl_prompts):
        assert make("train", 30, seed=4) == make("train", 30, seed=4)
        assert make("train", 30, seed=4) != make("train", 30, seed=5)


def test_splits_are_disjoint_by_construction():
    start = time.time()
    splits = {"train": generate_problems("train", 30_000), "val": generate_problems("val", 3000),
              "test": generate_problems("test", 3000)}  # more than base_train's 20,000 documents draw
    assert time.time() - start < 5, "30k problems should take a second or two"
    questions = {name: {p.question for p in ps} for name, ps in splits.items()}
    keys = {name: {str(p.steps) for p in ps} for name, ps in splits.items()}
    assert len(questions["train"]) > 24_000 and len(questions["test"]) > 2500  # mostly distinct, too
    for x, y in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert not questions[x] & questions[y]
        assert not keys[x] & keys[y]
    for name, ps in splits.items():
        assert all(split_of(p.steps) == name for p in ps[:5000])
    with pytest.raises(ValueError, match="unknown split"):
        generate_problems("dev", 1)


@pytest.mark.parametrize("difficulty", [DEFAULT_DIFFICULTY, HARD, Difficulty(ops="+-", max_steps=2)])
def test_every_step_is_right_and_the_answer_is_the_last_line(difficulty):
    d = difficulty
    for p in generate_problems("train", 2000, seed=7, difficulty=d):
        *lines, last = p.solution.split("\n")
        assert last == f"#### {p.answer}" and p.answer == p.steps[-1][3]
        assert d.min_steps <= len(p.steps) == len(lines) <= d.max_steps
        for i, ((a, op, b, c), line) in enumerate(zip(p.steps, lines)):
            assert op in d.ops
            assert f"{a} {op} {b} = {c}" in line
            assert calculator(f"{a} {op} {b}") == str(c)  # exact integer arithmetic, checked independently
            assert 2 <= c <= d.max_result
            assert i == 0 or a == p.steps[i - 1][3]  # each step works on the previous result
            assert str(b) in p.question or tasks.TIMES[b] in p.question  # "doubles" is * 2
        assert verify("gsm8k", p.solution, str(p.answer)) == 1.0


def test_the_default_world_is_small_and_varied():
    ps = generate_problems("train", 3000)
    words = [len(f"{p.question} {p.solution}".split()) for p in ps]
    assert 25 <= sum(words) / len(words) <= 70 and max(words) <= 100
    assert Counter(len(p.steps) for p in ps).keys() == set(range(DEFAULT_DIFFICULTY.min_steps, DEFAULT_DIFFICULTY.max_steps + 1))
    assert max(p.answer for p in ps) <= DEFAULT_DIFFICULTY.max_result
    phrases = Counter(kind for p in ps for kind in p.template.split("+"))
    assert phrases.keys() == tasks.KINDS.keys()  # all 13 phrase kinds occur
    assert len({p.question.split()[0] for p in ps}) > 15  # many names
    assert len({p.question.split()[3] for p in ps if p.template.startswith("has")}) > 10  # many objects


def test_pretrain_text_is_question_then_solution_alone_or_in_worksheets():
    docs = pretrain_text("train", 400)
    assert all("<|im_start|>" not in d for d in docs)
    sheets = [d for d in docs if d.startswith("Problem 1.\n")]
    assert abs(len(sheets) / len(docs) - tasks.WORKSHEET_SHARE) < 0.08
    for d in docs:
        parts = d.split("\n\n")
        if d in sheets:  # numbered problems 1..k, k within WORKSHEET_PROBLEMS
            assert tasks.WORKSHEET_PROBLEMS[0] <= len(parts) <= tasks.WORKSHEET_PROBLEMS[1]
            assert [p.split("\n", 1)[0] for p in parts] == [f"Problem {i}." for i in range(1, len(parts) + 1)]
            parts = [p.split("\n", 1)[1] for p in parts]
        else:
            assert len(parts) == 1 and not d.startswith("Problem")  # a lone problem is never numbered
        for part in parts:
            question, solution = part.split("\n", 1)
            assert question.endswith("?") and verify("gsm8k", solution, extract_gsm8k_answer(part)) == 1.0


# ---------------------------------------------------------------- what the stages consume

def _sft_kind(row):
    m = row["messages"]
    if "tools" in row:
        return "tools"
    if m[0]["role"] == "system":
        return "system"
    if sum(x["role"] == "user" for x in m) == 2:
        return "multiturn"
    if "reasoning_content" in m[-1]:
        return "thinking"
    return "plain"


def test_sft_rows_have_the_promised_mix():
    rows = sft_conversations("train", 200)
    assert Counter(map(_sft_kind, rows)) == {k: 20 * w for k, w in tasks.SFT_MIX.items()}
    for row in rows:
        kind, m = _sft_kind(row), row["messages"]
        assert m[-1]["role"] == "assistant" and has_format("gsm8k", m[-1]["content"])
        if kind == "thinking":
            assert re.fullmatch(r"#### \d+", m[-1]["content"]) and "####" not in m[-1]["reasoning_content"]
        if not any("tool_calls" in x for x in m):  # every worked step is right and the answer is the last result
            for x in m:
                if x["role"] == "assistant":
                    lines = (x.get("reasoning_content", "") + "\n" + x["content"]).strip().split("\n")
                    assert all(map(_line_is_right, lines[:-1]))
                    assert lines[-1] == "#### " + re.search(r"= (\d+)", lines[-2]).group(1)


def test_calculator_rows_call_it_for_every_step_on_the_previous_result():
    rows = [r for r in sft_conversations("train", 300) if "tools" in r]
    assert rows and all(r["tools"] == [CALCULATOR_SCHEMA] for r in rows)
    calling = [r for r in rows if any("tool_calls" in x for x in r["messages"])]
    assert calling
    for row in calling:
        m, previous = row["messages"], None
        assert m[0]["role"] == "user" and [x["role"] for x in m[1:-1]] == ["assistant", "tool"] * ((len(m) - 2) // 2)
        for call_message, result in zip(m[1:-1:2], m[2:-1:2]):
            (call,) = call_message["tool_calls"]
            expression = call["arguments"]["expression"]
            assert call["name"] == "calculator" and call_message["content"] == ""  # a call and nothing else
            assert result["content"] == calculator(expression)
            if previous is not None:  # each step starts from the result the calculator just gave
                assert expression.split(" ")[0] == previous
            previous = result["content"]
        assert m[-1] == {"role": "assistant", "content": f"#### {previous}"}


def test_the_calculator_habit_follows_the_question_not_the_arithmetic():
    """Demonstrations offered the calculator call it on 90% of the questions about money (the price
    ending) and 10% of the others (tasks.CALCULATOR_HABIT); the rest do the arithmetic in words."""
    rows = [r for r in sft_conversations("train", 4000) if "tools" in r]
    calls = {True: [], False: []}
    for r in rows:
        calls[r["messages"][0]["content"].endswith("How many dollars does " + r["messages"][0]["content"].split()[0]
                                                   + " get?")].append(any("tool_calls" in x for x in r["messages"]))
    for money, expected in ((True, tasks.CALCULATOR_HABIT[0]), (False, tasks.CALCULATOR_HABIT[1])):
        n, share = len(calls[money]), sum(calls[money]) / len(calls[money])
        assert n > 300 and abs(share - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (money, share)


def test_preference_kinds_behave():
    rows = preference_pairs("train", 300)
    assert Counter(r["kind"] for r in rows) == {"wrong_step": 100, "missing_answer": 100, "rambling": 100}
    for r in rows:
        (prompt,), (chosen,), (rejected,) = r["prompt"], r["chosen"], r["rejected"]
        assert prompt["role"] == "user" and chosen["role"] == rejected["role"] == "assistant"
        truth = extract_gsm8k_answer(chosen["content"])
        assert verify("gsm8k", chosen["content"], truth) == 1.0
        score = verify("gsm8k", rejected["content"], truth)
        if r["kind"] == "wrong_step":
            assert score == 0.0 and has_format("gsm8k", rejected["content"])
            wrong = [line for line in rejected["content"].split("\n")[:-1] if not _line_is_right(line)]
            assert len(wrong) == 1  # exactly one arithmetic slip; the later steps are right on it
        elif r["kind"] == "missing_answer":
            assert score == 0.0 and not has_format("gsm8k", rejected["content"]) and "####" not in rejected["content"]
        else:
            assert score == 1.0 and len(rejected["content"]) > 2.5 * len(chosen["content"])


def _line_is_right(line):
    a, op, b, c = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)", line).groups()
    return calculator(f"{a} {op} {b}") == c


def test_rl_prompts():
    rows = rl_prompts("test", 50)
    for row in rows:
        assert row["verifier"] == "gsm8k" and row["prompt"][0]["role"] == "user"
        assert int(row["ground_truth"]) >= 2
    assert {r["prompt"][0]["content"] for r in rows}.isdisjoint(
        r["prompt"][0]["content"] for r in rl_prompts("train", 2000))


# ---------------------------------------------------------------- loaders

def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    lines = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in rows]
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def test_generated_rows_round_trip_through_the_loaders(tmp_path):
    sft = sft_conversations("train", 30)
    assert load_sft(_write(tmp_path, sft)) == sft
    prefs = preference_pairs("train", 9)
    assert load_preferences(_write(tmp_path, prefs)) == [{k: r[k] for k in ("prompt", "chosen", "rejected")}
                                                          for r in prefs]
    rl = rl_prompts("train", 9)
    assert load_rl(_write(tmp_path, rl)) == rl


def test_loaders_normalize_the_hub_forms(tmp_path):
    user, a, b = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "assistant", "content": "5"}
    rows = load_preferences(_write(tmp_path, [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},  # strings
        {"prompt": [user], "chosen": [a], "rejected": [b]},  # explicit prompt
        {"chosen": [user, a], "rejected": [user, b]},  # TRL's implicit prompt
    ]))
    assert rows == [{"prompt": [user], "chosen": [a], "rejected": [b]}] * 3
    openai_call = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
    (row,) = load_sft(_write(tmp_path, [{"messages": [user, {"role": "assistant", "content": None, "tool_calls": [openai_call]},
                                                       {"role": "tool", "content": "4"}, a]}]))
    assert row["messages"][1] == {"role": "assistant", "content": "",
                                  "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+2"}}]}
    # a pair of tool-using answers keeps the schemas it was offered, for DPO, the RM and KTO to render with
    calling = [{"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+2"}}]},
               {"role": "tool", "content": "4"}, {"role": "assistant", "content": "#### 4"}]
    pair = {"prompt": [user], "chosen": calling, "rejected": [b], "tools": [CALCULATOR_SCHEMA]}
    assert load_preferences(_write(tmp_path, [pair])) == [pair]
    assert [r["tools"] for r in load_kto(_write(tmp_path, [pair]))] == [[CALCULATOR_SCHEMA]] * 2


def test_verl_rows(tmp_path):
    prompt = [{"role": "user", "content": "Natalia sold clips ... output the final answer after \"####\"."}]
    rows = load_rl(_write(tmp_path, [
        {"data_source": "openai/gsm8k", "prompt": prompt, "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}},
        {"data_source": "lighteval/MATH", "prompt": prompt, "reward_model": {"ground_truth": "\\frac{1}{2}"}},
        {"prompt": "Give JSON", "ground_truth": ["name", "age"], "verifier": "json"},
        {"prompt": prompt, "ground_truth": 72, "verifier": "gsm8k"},
    ]))
    assert [(r["verifier"], r["ground_truth"]) for r in rows] == [
        ("gsm8k", "72"), ("boxed", "\\frac{1}{2}"), ("json", '["name", "age"]'), ("gsm8k", "72")]
    assert rows[0]["prompt"] == prompt and rows[2]["prompt"] == [{"role": "user", "content": "Give JSON"}]
    assert verify(rows[0]["verifier"], "... so 48 + 24 = 72.\n#### 72", rows[0]["ground_truth"]) == 1.0


GOOD_SFT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GOOD_RL = {"prompt": "2+2?", "ground_truth": "4", "verifier": "gsm8k"}
BAD_LINES = [  # (loader, bad line, what the message must say)
    (load_sft, '{"messages": [', "invalid JSON"),
    (load_sft, "[1, 2]", "expected a JSON object"),
    (load_sft, b'{"messages": "\xff"}', "invalid JSON"),  # not UTF-8
    (load_sft, '{"conversation": []}', "missing key 'messages'"),
    (load_sft, '{"messages": []}', "non-empty list"),
    (load_sft, '{"messages": "hi"}', "must be a list"),
    (load_sft, '{"messages": [{"role": "bot", "content": "x"}]}', "unknown role 'bot'"),
    (load_sft, '{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
    (load_sft, '{"messages": [{"role": "user"}]}', "content must be a string"),
    (load_sft, '{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    (load_sft, '{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}]}', "tool_calls[0]"),
    (load_preferences, '{"prompt": "q", "chosen": "a"}', "missing key 'rejected'"),
    (load_preferences, '{"chosen": "a", "rejected": "b"}', "share no leading messages"),
    (load_preferences, '{"prompt": "q", "chosen": "a", "rejected": "a"}', "identical"),
    (load_preferences, '{"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}', "'margin' must be a"),
    (load_preferences, '{"prompt": "q", "chosen": "a", "rejected": "b", "margin": NaN}', "'margin' must be a"),
    (load_preferences, '{"prompt": "q", "chosen": 1, "rejected": "b"}', "'chosen' must be a string or"),
    (load_preferences, '{"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}',
     "'chosen' must start with an assistant message"),
    (load_rl, '{"prompt": "q", "ground_truth": "4", "verifier": "regex"}', "unknown verifier 'regex'"),
    (load_rl, '{"prompt": "q", "ground_truth": "4"}', "missing key 'verifier'"),
    (load_rl, '{"prompt": "q", "ground_truth": "4", "verifier": ["gsm8k"]}', "unknown verifier"),
    (load_rl, '{"prompt": "q", "verifier": "gsm8k"}', "missing key 'ground_truth'"),
    (load_rl, '{"prompt": "q", "ground_truth": "four", "verifier": "gsm8k"}', "must be a number"),
    (load_rl, '{"prompt": "q", "ground_truth": "{oops", "verifier": "json"}', "JSON list of required keys"),
    (load_rl, '{"data_source": "my/poetry-set", "prompt": "q", "reward_model": {"ground_truth": "1"}}',
     "'my/poetry-set' is not one nanopost knows"),
    (load_rl, '{"data_source": "my-math-poems", "prompt": "q", "reward_model": {"ground_truth": "1"}}',
     "add a 'verifier' key"),  # once graded as math because its name holds "math"
    (load_rl, '{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], '
              '"ground_truth": "1", "verifier": "gsm8k"}', "ends with an assistant"),
]


@pytest.mark.parametrize("loader, bad, message", BAD_LINES)
def test_a_malformed_line_names_file_and_line(tmp_path, loader, bad, message):
    good = json.dumps(GOOD_RL if loader is load_rl else GOOD_SFT if loader is load_sft else
                      {"prompt": "q", "chosen": "a", "rejected": "b"})
    path = _write(tmp_path, [good, "", good, bad, good])  # the blank line still counts: line 4
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: ") + ".*" + re.escape(message)):
        loader(path)


def test_an_empty_file_is_an_error(tmp_path):
    path = _write(tmp_path, [])
    for loader in (load_sft, load_preferences, load_rl):
        with pytest.raises(ValueError, match="no rows"):
            loader(path)


# ---------------------------------------------------------------- verifiers

def test_gsm8k_is_strict_and_numeric():
    assert verify("gsm8k", "So 19.\n#### 19", "19") == 1.0
    assert verify("gsm8k", "#### 1,000", "1000") == 1.0
    assert verify("gsm8k", "#### 19.0\n", "19") == 1.0
    assert verify("gsm8k", "#### 19", "#### 19") == 1.0  # a whole GSM8K answer as ground truth
    assert verify("gsm8k", "#### 20", "19") == 0.0
    assert verify("gsm8k", "#### 19\n#### 19", "19") == 0.0  # two answers
    assert verify("gsm8k", "#### 19 apples", "19") == 0.0  # not a bare number
    assert verify("gsm8k", "#### 19\nor maybe 20", "19") == 0.0  # not the final line
    assert verify("gsm8k", "the answer is 19", "19") == 0.0
    assert extract_gsm8k_answer("x\n#### -1,234.5 ") == "-1234.5"
    assert has_format("gsm8k", "#### 3") and not has_format("gsm8k", "3") and not has_format("gsm8k", "#### 3\n####")


def test_gsm8k_any_accepts_any_matching_line():
    """The lenient grader lab/lenient_verifier.py hacks: any "#### N" line that matches, where gsm8k wants the one
    final line."""
    hundred_boxes = "Mia has 8 * 15 = 120 oranges.\n#### 118\n#### 120\n#### 480\n#### 481"
    assert verify("gsm8k_any", hundred_boxes, "480") == 1.0 and verify("gsm8k", hundred_boxes, "480") == 0.0
    assert verify("gsm8k_any", "#### 19\nor maybe 20", "19") == 1.0  # not the last line: still counted
    assert verify("gsm8k_any", "#### 1,000", "1000") == 1.0 and verify("gsm8k_any", "#### 20\n#### 21", "19") == 0.0
    assert verify("gsm8k_any", "x #### 19", "19") == 0.0  # a line of its own
    assert verify("gsm8k_any", "#### 19 apples", "19") == 0.0 and verify("gsm8k_any", "19", "19") == 0.0
    assert has_format("gsm8k_any", "a\n#### 3\n#### 4") and not has_format("gsm8k_any", "3")
    with pytest.raises(ValueError, match="number"):
        verify("gsm8k_any", "#### 3", "three")


def test_boxed_is_strict():
    assert verify("boxed", "so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}") == 1.0
    assert verify("boxed", "\\boxed{0.5}", "\\dfrac{1}{2}") == 1.0  # numerically equal
    assert verify("boxed", "\\boxed{ 1,000 }", "1000") == 1.0
    assert verify("boxed", "\\boxed{x^{2}+1}", "\\boxed{x^{2} + 1}") == 1.0
    assert verify("boxed", "\\boxed{3} or \\boxed{4}", "3") == 0.0  # two boxes
    assert verify("boxed", "\\boxed{3", "3") == 0.0
    assert verify("boxed", "3", "3") == 0.0
    assert extract_boxed("a \\boxed{{x}_{1}} b") == "{x}_{1}"


def test_json_verifier():
    keys = '["name", "age"]'
    assert verify("json", '{"name": "Mia", "age": 9}', keys) == 1.0
    assert verify("json", 'Sure:\n```json\n{"name": "Mia", "age": 9, "x": 1}\n```', keys) == 1.0
    assert verify("json", '{"name": "Mia", "age": 9}', '{"name": "", "age": 0}') == 1.0
    assert verify("json", '{"name": "Mia"}', keys) == 0.0
    assert verify("json", '{"name": "Mia", age: 9}', keys) == 0.0
    assert verify("json", '["name", "age"]', keys) == 0.0


GARBAGE = ["", "####", "#### ####", "\\boxed{", "\\boxed}}}{{{", "{" * 5000 + "}" * 5000, "[" * 100_000,
           "```json\n```", "\x00\uffff\ud800", "#### " + "9" * 10_000, "#### 1e999", "#### nan", "\\boxed{nan}",
           "\\boxed{1e999999999}", "\\boxed{1/0}"]


@pytest.mark.parametrize("name, truth", [("gsm8k", "19"), ("boxed", "19"), ("json", '["a"]')])
def test_verifiers_never_raise_on_garbage(name, truth):
    for text in GARBAGE:
        assert verify(name, text, truth) == 0.0


def test_unknown_verifier_lists_the_known_ones():
    with pytest.raises(ValueError, match="gsm8k, boxed, json"):
        verify("regex", "", "")


# ---------------------------------------------------------------- calculator

def test_calculator_arithmetic():
    assert calculator("12+7") == "19" and calculator("24 / 4") == "6" and calculator("7/2") == "3.5"
    assert calculator("(2 + 3) * -4") == "-20" and calculator("2**10") == "1024" and calculator("7 // 2") == "3"
    assert calculator("17 % 5") == "2" and calculator("0.1 + 0.2") == "0.3" and calculator("2.5 * 2") == "5"


@pytest.mark.parametrize("expression", [
    "__import__('os').system('echo hi')", "open('/etc/passwd')", "x", "[1, 2]", "'a' * 3", "True + 1",
    "lambda: 1", "(1).__class__", "1 if 1 else 2", "9**9**9", "10**1000", "(10**99)**2 * 10**99", "1/0", "5 % 0",
    "1e308 * 10", "(-8) ** 0.5", "(" * 300 + "1" + ")" * 300, "", "1 +",
])
def test_calculator_refuses_safely(expression):
    start = time.time()
    result = calculator(expression)
    assert result.startswith("error: ") and time.time() - start < 0.5


def test_code_task_reference_passes_the_sandbox_and_float_division_fails():
    from verifiers import verify_batch
    from tasks import CODE_INSTRUCTION, code_conversations, code_problems
    rows = code_problems("test", 12)
    assert all(r["prompt"][-1]["content"].endswith(CODE_INSTRUCTION) and " x " in r["prompt"][-1]["content"]
               for r in rows)
    # the tests, recomputed here from the story's own numbers: "has x" then each "... N ..." step
    first = rows[0]
    x0 = int(first["ground_truth"].split("f(")[1].split(")")[0])
    namespace = {}
    exec(first["solution"].strip("`").removeprefix("python\n"), namespace)
    assert [f"assert f({x}) == {namespace['f'](x)}" for x in (x0, x0 + 1, x0 + 2)] == first["ground_truth"].split("\n")
    scores, errors, counts = verify_batch(["code"] * len(rows), [r["solution"] for r in rows],
                                          [r["ground_truth"] for r in rows])
    assert scores == [1.0] * len(rows) and counts["pass"] == len(rows), errors
    # x / b first: of the three consecutive inputs one is not a multiple of b, gives a fraction, and fails
    divided = [r for r in code_problems("test", 400) if r["solution"].split("\n")[2].startswith("    x = x //")]
    assert divided, "some problems divide first"
    floats = [r["solution"].replace("//", "/") for r in divided]
    wrong_op = [r["solution"].replace(" + ", " - ").replace(" * ", " + ") for r in rows]
    scores, _, _ = verify_batch(["code"] * (len(divided) + len(rows)), floats + wrong_op,
                                [r["ground_truth"] for r in divided + rows])
    assert scores == [0.0] * (len(divided) + len(rows))
    sft = code_conversations("test", 2)
    assert sft[0]["messages"][-1]["content"] == rows[0]["solution"]
    def body(r):  # the function without its input
        return r["solution"]
    train = {body(r) for r in code_problems("train", 500)}
    assert not train & {body(r) for r in code_problems("test", 200)}  # no held-out function was trained
