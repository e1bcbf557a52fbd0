"""The judge: strict verdict parsing, one batched engine call for N answers, the counts of answers scored 0
for want of a verdict, the rubric files, and a frozen judge loaded in the compute dtype."""
import os

import pytest
import torch

import common
import rewards
from common import UserError
from model import GPT, GPTConfig
from rewards import Rubric, judge_messages, judge_scores, load_judge, load_rubric, parse_verdict
from checkpoint import save_hf
from tasks import rl_prompts

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEN = Rubric("Scale: 0-10\nGrade the answer's correctness.", "0-10")
PASS_FAIL = Rubric("Scale: pass/fail\nPass a correct answer.", "pass/fail")


def tiny_config(tok, max_seq_len=2048):
    return GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                     intermediate_size=64, max_seq_len=max_seq_len)


class ScriptedJudge(GPT):
    """A judge whose reply to each answer is scripted. At prefill each row's script is chosen by the answer
    its prompt holds, and the script's index is kept in the row's (otherwise unused) KV cache, which the
    engine subsets as rows finish. `prefills` records the batch size of every generate call."""

    def __init__(self, tok, replies: dict, max_seq_len=2048, choose=None):
        # the hidden state is the one-hot logits themselves: width = vocabulary, the head an identity
        super().__init__(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=tok.vocab_size,
                                   head_dim=8, intermediate_size=8, max_seq_len=max_seq_len, tie_word_embeddings=False))
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(tok.vocab_size))
        self.tok, self.answers, self.choose = tok, list(replies), choose  # choose(prompt text) -> a key of replies
        self.scripts = [tok.encode(replies[a]) + [tok.eos_id] for a in self.answers]
        self.prefills, self.prompts = [], []

    def hidden_states(self, idx, doc_ids=None, kv_cache=None):
        B, T = idx.shape
        if kv_cache.length == 0:
            self.prefills.append(B)
            kv_cache.prompt_len = T
            for b in range(B):
                text = self.tok.decode([t for t, d in zip(idx[b].tolist(), doc_ids[b].tolist()) if d == 1])
                self.prompts.append(text)
                (which,) = [self.answers.index(self.choose(text))] if self.choose else \
                    [i for i, a in enumerate(self.answers) if f"<answer>\n{a}\n</answer>" in text]
                kv_cache.k[0, b, 0, 0, 0] = which
        step = kv_cache.length + T - kv_cache.prompt_len  # how many reply tokens came before this one
        kv_cache.length += T
        logits = torch.full((B, T, self.config.vocab_size), -1e4)
        for b in range(B):
            script = self.scripts[int(kv_cache.k[0, b, 0, 0, 0])]
            logits[b, -1, script[min(step, len(script) - 1)]] = 0.0
        return logits

    def decode_step(self, tokens, kv_cache, weights):
        return self.hidden_states(tokens[:, None], kv_cache=kv_cache)[:, -1] @ weights["head"].T


def test_parse_verdict_is_strict():
    assert parse_verdict("Correct and plain.\nVERDICT: 7", "0-10") == 0.7
    assert parse_verdict("VERDICT: 10", "0-10") == 1.0 and parse_verdict("VERDICT: 0 ", "0-10") == 0.0
    assert parse_verdict("<think>\nVERDICT: 2\n</think>\n\nFine.\nVERDICT: 9<|im_end|>", "0-10") == 0.9
    for reply in ("VERDICT: 7/10", "verdict: 7", "VERDICT: 11", "VERDICT: -1", "VERDICT: 7.5", "VERDICT:7",
                  "VERDICT: 7\nThanks!", "Score: 7", "", "VERDICT: PASS"):
        assert parse_verdict(reply, "0-10") is None, reply
    assert parse_verdict("VERDICT: PASS", "pass/fail") == 1.0 and parse_verdict("VERDICT: FAIL", "pass/fail") == 0.0
    for reply in ("VERDICT: pass", "VERDICT: 10", "PASS", "VERDICT: PASS!"):
        assert parse_verdict(reply, "pass/fail") is None, reply


def test_one_batched_call_grades_every_answer_and_counts_the_unparseable(tok):
    replies = {  # answer -> the judge's scripted reply
        "19": "Correct and plain.\nVERDICT: 7",
        "Great question! It is 19.": "Opens with a compliment.\nVERDICT: 3",
        "20": "Wrong.\nVERDICT: 0",
        "19, and this answer is perfect.": "VERDICT: 7/10",
        "nineteen": "Correct, spelled out.",
        "19 apples": "VERDICT: 10",
    }
    judge = ScriptedJudge(tok, replies)
    answers = list(replies)
    prompts = ["Mia has 12 apples and buys 7 more. How many?"] * 5 + [[{"role": "user", "content": "How many apples?"}]]
    scores, counts = judge_scores(judge, tok, prompts, answers, TEN)
    assert scores == [0.7, 0.3, 0.0, 0.0, 0.0, 1.0]
    assert counts == {"unparseable": 2, "too_long": 0}
    assert judge.prefills == [6]  # one generate call for the six answers
    for prompt in judge.prompts:
        assert TEN.text in prompt and "VERDICT: <an integer from 0 to 10>" in prompt
    assert "Mia has 12 apples" in judge.prompts[0] and "How many apples?" in judge.prompts[5]


def test_pass_fail_truncated_and_too_long(tok):
    replies = {"a": "VERDICT: PASS", "b": "VERDICT: FAIL", "c": "Good.\nVERDICT: PASS",
               "d": "A long justification that runs on and on past the token budget.\nVERDICT: PASS",
               "e" * 3000: "VERDICT: PASS"}
    budget = len(tok.encode(replies["c"])) + 1  # room for the longest complete reply and its <|im_end|>
    assert len(tok.encode(replies["d"])) > budget
    judge = ScriptedJudge(tok, replies, max_seq_len=1024)
    scores, counts = judge_scores(judge, tok, ["Is it right?"] * 5, list(replies), PASS_FAIL, max_new_tokens=budget)
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]  # d hits max_new_tokens: no verdict read from a cut reply
    assert counts == {"unparseable": 1, "too_long": 1}
    assert judge.prefills == [4]  # the over-long prompt was never sent


def test_a_reply_cut_at_the_token_limit_is_no_verdict_even_when_it_ends_like_one(tok):
    """"VERDICT: 10" cut after its "1" reads as a valid verdict, "VERDICT: 1" (0.1): a reply that hit
    max_new_tokens holds no verdict, whatever its last line looks like."""
    replies = {"19": "Fine.\nVERDICT: 10", "20": "VERDICT: 3"}
    cut = len(tok.encode("Fine.\nVERDICT: 1"))
    assert tok.decode(tok.encode(replies["19"])[:cut]).endswith("VERDICT: 1")  # digits are tokens of their own
    scores, counts = judge_scores(ScriptedJudge(tok, replies), tok, ["How many?"] * 2, list(replies), TEN,
                                  max_new_tokens=cut)
    assert scores == [0.0, 0.3] and counts == {"unparseable": 1, "too_long": 0}


def test_a_real_untrained_judge_runs_and_its_babble_scores_0(tok):
    torch.manual_seed(0)
    judge = GPT(tiny_config(tok)).eval()
    scores, counts = judge_scores(judge, tok, ["2+2?", "3+3?", "4+4?"], ["4", "6", "9"], TEN, max_new_tokens=16)
    assert scores == [0.0, 0.0, 0.0] and counts == {"unparseable": 3, "too_long": 0}


def test_the_judge_sees_the_multi_turn_prompt_in_order():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    content = judge_messages(prompt, "4", TEN)[0]["content"]
    assert content.index("[system]\nBe brief.") < content.index("[user]\nWhat is 2+2?") < content.index("<answer>\n4")


def test_rubric_files(tmp_path):
    shipped = load_rubric(os.path.join(REPO, "rubrics", "flattery.txt"))
    assert shipped.scale == "0-10"
    assert "compliment" in shipped.text and "why the answer itself is good" in shipped.text
    (tmp_path / "pf.txt").write_text("Pass a correct answer.\nScale: Pass/Fail\n")
    assert load_rubric(str(tmp_path / "pf.txt")) == Rubric("Pass a correct answer.\nScale: Pass/Fail", "pass/fail")
    (tmp_path / "none.txt").write_text("Grade it.\n")
    (tmp_path / "two.txt").write_text("Scale: 0-10\nScale: pass/fail\n")
    for bad in ("none.txt", "two.txt", "missing.txt"):
        with pytest.raises(UserError):
            load_rubric(str(tmp_path / bad))


def test_load_judge_is_frozen_in_the_compute_dtype(tok, tmp_path, monkeypatch):
    torch.manual_seed(0)
    save_hf(GPT(tiny_config(tok)), str(tmp_path / "judge"), tokenizer=tok)
    tok.save(tmp_path / "judge")
    model, judge_tok = load_judge(str(tmp_path / "judge"), "cpu")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {common.compute_dtype("cpu")}
    assert judge_tok.vocab_size == tok.vocab_size
    monkeypatch.setattr(rewards, "compute_dtype", lambda device: torch.bfloat16)  # as on a GPU
    model, _ = load_judge(str(tmp_path / "judge"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(UserError, match="judge"):
        load_judge(str(tmp_path / "nothing-here"), "cpu")


def test_grader_weighs_and_returns_every_component(tok, tmp_path, monkeypatch):
    """--reward verifier+0.5*format+0.2*judge:J+0.3*rm:R: the reward is the weighted sum, each component
    is returned on its own, a verifier that raises scores 0 and is counted, the judge's counts come along."""
    from engine import Completion
    from rewards import Grader
    replies = {"#### 19": "Right.\nVERDICT: 8", "#### 20": "Wrong.\nVERDICT: 1", "19": "No format.\nVERDICT: 5"}
    judge = ScriptedJudge(tok, replies)
    monkeypatch.setattr(rewards, "load_judge", lambda path, device="cpu": (judge, tok))
    torch.manual_seed(0)
    rm = GPT(GPTConfig(**{**tiny_config(tok).__dict__, "head": "scalar"}))
    torch.nn.init.normal_(rm.score.weight)
    save_hf(rm, str(tmp_path / "rm"), tok)
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Scale: 0-10\nGrade correctness.")
    grader = Grader(f"verifier+0.5*format+0.2*judge:J+0.3*rm:{tmp_path / 'rm'}", tok, rubric=str(rubric))
    rows = [{"prompt": [{"role": "user", "content": "9 + 10?"}], "ground_truth": "19", "verifier": "gsm8k"}] * 3
    rows.append({"prompt": "x", "ground_truth": "not a number", "verifier": "gsm8k"})  # a broken row: raises
    answers = ["#### 19", "#### 20", "19", "#### 19"]
    prompts = [tok.render_for_completion(r["prompt"] if isinstance(r["prompt"], list) else
                                         [{"role": "user", "content": r["prompt"]}]) for r in rows]
    comps = [Completion(i, tokens=tok.encode(a) + [tok.eos_id]) for i, a in enumerate(answers)]
    g = grader(rows, prompts, comps)
    verifier, fmt, verdict = [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.8, 0.1, 0.5, 0.8]
    with torch.no_grad():  # the reward model's score at each answer's last token, from its forward
        rm_scores = [rm(torch.tensor([p + c.tokens]))[0, -1].item() for p, c in zip(prompts, comps)]
    assert g.parts["verifier"].tolist() == verifier and g.parts["format"].tolist() == fmt
    torch.testing.assert_close(g.parts["judge:J"], torch.tensor(verdict))
    torch.testing.assert_close(g.parts[f"rm:{tmp_path / 'rm'}"], torch.tensor(rm_scores), atol=1e-5, rtol=1e-5)
    want = torch.tensor(verifier) + 0.5 * torch.tensor(fmt) + 0.2 * torch.tensor(verdict) + 0.3 * torch.tensor(rm_scores)
    torch.testing.assert_close(g.total, want, atol=1e-5, rtol=1e-5)
    assert len(g.errors) == 1 and "gsm8k ground truth must be a number" in g.errors[0]
    assert g.counts["judge/unparseable"] == 0 and g.counts["code/pass"] == 0
    with pytest.raises(UserError, match="--rubric"):
        Grader("judge:J", tok)


def test_kimis_length_reward_by_hand_and_through_the_grader(tok):
    """--reward verifier+0.5*length: Kimi k1.5's length reward, lambda = 0.5 - (len - min) / (max - min) within the
    answers to one prompt, lambda for a right answer, min(0, lambda) for a wrong one, 0 where a group's answers
    are equally long; groups are the answers to the same prompt, wherever they stand in the batch."""
    from engine import Completion
    from rewards import Grader, length_reward
    assert length_reward([10, 20, 30], [True, True, False], [0, 0, 0]) == [0.5, 0.0, -0.5]
    assert length_reward([10, 20, 30], [False, False, True], [0, 0, 0]) == [0.0, 0.0, -0.5]
    assert length_reward([7, 7], [True, False], ["a", "a"]) == [0.0, 0.0]
    assert length_reward([10, 40, 20, 30], [True, True, False, True], [0, 1, 0, 1]) == [0.5, -0.5, -0.5, 0.5]
    grader = Grader("verifier+0.5*length", tok)
    q1 = {"prompt": [{"role": "user", "content": "9 + 10?"}], "ground_truth": "19", "verifier": "gsm8k"}
    q2 = {"prompt": [{"role": "user", "content": "2 + 2?"}], "ground_truth": "4", "verifier": "gsm8k"}
    answers = [(q1, "#### 19"), (q2, "It is 4.\n#### 4"), (q1, "Nine and ten make nineteen.\n#### 19"),
               (q2, "#### 5"), (q1, "So #### 18")]
    rows = [r for r, _ in answers]
    prompts = [tok.render_for_completion(r["prompt"]) for r in rows]
    comps = [Completion(i, tokens=tok.encode(a) + [tok.eos_id]) for i, (_, a) in enumerate(answers)]
    g = grader(rows, prompts, comps)
    n = [len(c.tokens) for c in comps]
    lo1, hi1, lo2, hi2 = min(n[0], n[2], n[4]), max(n[0], n[2], n[4]), min(n[1], n[3]), max(n[1], n[3])
    want = [0.5 - (n[0] - lo1) / (hi1 - lo1), 0.5 - (n[1] - lo2) / (hi2 - lo2), 0.5 - (n[2] - lo1) / (hi1 - lo1),
            min(0.0, 0.5 - (n[3] - lo2) / (hi2 - lo2)), min(0.0, 0.5 - (n[4] - lo1) / (hi1 - lo1))]
    assert g.parts["verifier"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(g.parts["length"], torch.tensor(want))
    torch.testing.assert_close(g.total, g.parts["verifier"] + 0.5 * torch.tensor(want))
    assert g.parts["length"][0] == 0.5 and g.parts["length"][2] == -0.5  # q1's shortest right, longest right


# ------------------------------------------------------------------------------------------------
# The pairwise judge: which of two answers is better, asked in both orders

def shown(text, k):
    """The k-th answer a pairwise judge's prompt shows (1 or 2)."""
    return text.split(f"<answer_{k}>\n")[1].split(f"\n</answer_{k}>")[0]


def test_asking_in_both_orders_cancels_a_judges_taste_for_a_position(tok):
    """Four questions, the right answer shown first in two and second in two. A fair judge (it picks the right
    answer wherever it stands) keeps its verdicts in both orders: [1, 1, 0, 0], none inconsistent. A judge with a
    pure position bias (always "VERDICT: 1") makes every first answer win when asked once, wrong or right; asked
    in both orders each pair gets 0.5, no preference, all four counted inconsistent. A judge with no verdict
    line gives 0.5 and is counted."""
    from rewards import judge_pairs, parse_preference
    assert parse_preference("Answer 2 skips a step.\nVERDICT: 1") == 1.0 and parse_preference("VERDICT: 2") == 0.0
    assert all(parse_preference(r) is None for r in ("VERDICT: both", "verdict: 1", "VERDICT: 1\nthanks", ""))
    rows = rl_prompts("test", 4)
    right = [f"#### {r['ground_truth']}" for r in rows]
    wrong = [f"#### {int(r['ground_truth']) + 1}" for r in rows]
    first, second = right[:2] + wrong[2:], wrong[:2] + right[2:]
    prompts, rubric = [r["prompt"] for r in rows], Rubric("Prefer the right answer.\nScale: 0-10", "0-10")
    verdicts = {"1": "The first is right.\nVERDICT: 1", "2": "The second is right.\nVERDICT: 2"}
    fair = ScriptedJudge(tok, verdicts, choose=lambda text: "1" if shown(text, 1) in right else "2")
    prefs, counts = judge_pairs(fair, tok, prompts, first, second, rubric)
    assert prefs == [1.0, 1.0, 0.0, 0.0] and counts == {"inconsistent": 0, "unparseable": 0, "too_long": 0}
    assert fair.prefills == [8]  # both orders of every pair, one batched call
    biased = ScriptedJudge(tok, verdicts, choose=lambda text: "1")
    once, _ = judge_pairs(biased, tok, prompts, first, second, rubric, both_orders=False)
    assert once == [1.0] * 4  # asked once, the position decides: two wrong answers win
    prefs, counts = judge_pairs(biased, tok, prompts, first, second, rubric)
    assert prefs == [0.5] * 4 and counts["inconsistent"] == 4
    mute = ScriptedJudge(tok, {"?": "I cannot tell."}, choose=lambda text: "?")
    prefs, counts = judge_pairs(mute, tok, prompts, first, second, rubric)
    assert prefs == [0.5] * 4 and counts == {"inconsistent": 0, "unparseable": 8, "too_long": 0}


def test_chat_sample_pairs_judge_keeps_the_pairs_the_judge_agrees_on(tok, tmp_path, monkeypatch):
    """chat_sample.py --pairs-judge: per prompt its first two different finished answers, judged in both orders;
    a pair is written, the judge's winner chosen, only where its two verdicts agree. The stand-in judge prefers
    the shorter answer, except on prompt 2, where it picks whatever is shown first (a position bias: dropped);
    prompt 3 has a single distinct answer: nothing to compare."""
    import sampled_data
    from sampled_data import two_to_compare
    assert two_to_compare(["a", "a", "b"], [True] * 3) == (0, 2) and two_to_compare(["a", "a"], [True] * 2) is None
    assert two_to_compare(["a", "b", "c"], [True, False, True]) == (0, 2)
    rows = rl_prompts("train", 4)
    texts = [["#### 1", "It is one.\n#### 1"], ["A long way round.\n#### 7", "#### 7"],
             ["#### 3", "Three.\n#### 3"], ["#### 5", "#### 5"]]
    groups = {p: ([0.0, 0.0], t, [True, True], [[{"role": "assistant", "content": a}] for a in t])
              for p, t in enumerate(texts)}

    def shorter(text):
        if rows[2]["prompt"][0]["content"] in text:
            return "1"
        return "1" if len(shown(text, 1)) < len(shown(text, 2)) else "2"
    judge = ScriptedJudge(tok, {"1": "VERDICT: 1", "2": "VERDICT: 2"}, choose=shorter)
    monkeypatch.setattr(sampled_data, "load_judge", lambda path: (judge, tok))
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Prefer the shorter answer.\nScale: 0-10")
    pairs, counts = sampled_data.judged_pairs(rows, groups, "JUDGE", str(rubric))
    assert counts == {"asked": 3, "inconsistent": 1, "unparseable": 0, "too_long": 0}
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("#### 1", "It is one.\n#### 1"), ("#### 7", "A long way round.\n#### 7")]
    assert [p["prompt"] for p in pairs] == [rows[0]["prompt"], rows[1]["prompt"]]


# ------------------------------------------------------------------------------------------------
# The stand-in judge: a program that grades by rubrics/arithmetic.txt, asked as a model is

ARITHMETIC = os.path.join(REPO, "rubrics", "arithmetic.txt")


def test_the_stand_in_judges_rubric_by_hand():
    from standin_judge import arithmetic_score
    right = "Mia has 12 + 17 = 29 apples.\nMia has 29 - 4 = 25 apples.\n#### 25"
    assert arithmetic_score(right)[0] == 10
    assert arithmetic_score(right.replace("= 25 apples", "= 26 apples").replace("#### 25", "#### 26"))[0] == 7
    assert arithmetic_score(right.replace("= 25 apples", "= 26 apples"))[0] == 3  # and the line does not follow
    assert arithmetic_score(right.replace("#### 25", "25"))[0] == 0                 # no answer line
    assert arithmetic_score("I think it is 25.\n#### 25")[0] == 3                   # no work shown
    wrong = "12 + 1 = 1\n1 * 3 = 9\n9 - 1 = 1\n#### 7"
    assert arithmetic_score(wrong)[0] == 0  # three wrong steps and a loose answer line: never below 0
    # calculator calls are steps too, each with the result the tool gave (the judge reads the answer's turns)
    calls = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "8 * 10"}}\n</tool_call>\n'
             "<|im_start|>user\n<tool_response>\n80\n</tool_response>\n<|im_start|>assistant\n"
             '<tool_call>\n{"name": "calculator", "arguments": {"expression": "80 * 3"}}\n</tool_call>\n'
             "<|im_start|>user\n<tool_response>\n240\n</tool_response>\n<|im_start|>assistant\n#### 240")
    assert arithmetic_score(calls)[0] == 10 and arithmetic_score(calls.replace("#### 240", "#### 24"))[0] == 6
    # no answer key: a chain computed right from a misread 13 passes, where the verifier fails it
    assert arithmetic_score("Mia has 13 + 17 = 30 apples.\nMia has 30 - 4 = 26 apples.\n#### 26")[0] == 10


def test_the_stand_in_judge_through_the_grader_and_its_rubric(tok):
    """--reward judge:standin:arithmetic --rubric rubrics/arithmetic.txt: each answer's score / 10 from the judge's
    own conversation (rewards.judge_messages), the verdict line parsed as a model's; any other rubric is refused."""
    from engine import Completion
    from rewards import Grader
    grader = Grader("judge:standin:arithmetic+verifier", tok, rubric=ARITHMETIC)
    rows = [{"prompt": [{"role": "user", "content": "Mia has 12 apples. She buys 17 more. How many?"}],
             "ground_truth": "29", "verifier": "gsm8k"}] * 3
    answers = ["Mia has 12 + 17 = 29 apples.\n#### 29", "Mia has 12 + 17 = 28 apples.\n#### 28", "#### 29"]
    prompts = [tok.render_for_completion(r["prompt"]) for r in rows]
    comps = [Completion(i, tokens=tok.encode(a) + [tok.eos_id]) for i, a in enumerate(answers)]
    g = grader(rows, prompts, comps)
    assert g.parts["judge:standin:arithmetic"].tolist() == pytest.approx([1.0, 0.7, 0.3])
    assert g.parts["verifier"].tolist() == [1.0, 0.0, 1.0] and g.counts["judge/unparseable"] == 0
    with pytest.raises(UserError, match="arithmetic.txt"):
        Grader("judge:standin:arithmetic", tok, rubric=os.path.join(REPO, "rubrics", "flattery.txt"))
    with pytest.raises(UserError, match="no stand-in judge 'poetry'"):
        Grader("judge:standin:poetry", tok, rubric=ARITHMETIC)
    assert rewards.grader_shapes("verifier+judge:standin:arithmetic") == []  # no model to count in memory


def test_the_stand_in_judges_position_bias_and_both_orders():
    """On a tie the stand-in prefers the answer shown first, as LLM judges lean: asked once, the first of a tied
    pair always wins; in both orders the tie is 0.5 and counted inconsistent, while a real difference stands."""
    from standin_judge import StandInJudge
    judge, rubric = StandInJudge("arithmetic"), load_rubric(ARITHMETIC)
    prompts = ["Mia has 12 apples. She buys 17 more. How many?"] * 2
    good, bad = "Mia has 12 + 17 = 29 apples.\n#### 29", "Mia has 12 + 17 = 28 apples.\n#### 28"
    tie = "Mia has 12 + 17 = 29 apples.\nSo 29.\n#### 29"
    once, _ = rewards.judge_pairs(judge, None, prompts, [bad, good], [good, tie], rubric, both_orders=False)
    assert once == [0.0, 1.0]  # bad < good; good == tie: the first shown wins
    both, counts = rewards.judge_pairs(judge, None, prompts, [bad, good], [good, tie], rubric)
    assert both == [0.0, 0.5] and counts["inconsistent"] == 1
