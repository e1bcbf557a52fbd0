"""What the lab's RL experiments (lab/goodhart.py, lab/r1_zero.py) need chat_rl.py to log or do, each against
numbers written out here: kl_to_start (the KL to the start per answer, at every --kl-beta), accuracy as the
verifier's beside a reward model, the graders on held-out answers, and --prompt-format plain."""
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from checkpoint import save_hf
from common import UserError
from engine import Completion
from model import GPT, GPTConfig
from rewards import Grader
from rollout import Rollouts, heldout_rewards, kl_to_start, sample
from tasks import generate_problems, pretrain_text

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kl_to_start_sums_k3_over_each_answers_sampled_tokens():
    # answer 1 moved by log p - log p_start = +0.20, +0.10, +0.80 on its three sampled tokens (a forced tool
    # token between them moved by 5.0, outside the mask); answer 2 by -0.50 on its one token, then padding
    logp = torch.tensor([[-1.0, -0.8, 4.0, -0.9, -0.2], [-2.0, 0.0, 0.0, 0.0, 0.0]])
    start = torch.tensor([[-1.2, -0.9, -1.0, -1.7, -0.2], [-1.5, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    # k3 per token is exp(-d) - 1 + d: 0.018731 + 0.004837 + 0.249329 = 0.272897, and 0.148721
    kl = kl_to_start(logp, start, mask)
    torch.testing.assert_close(kl, torch.tensor([0.272897, 0.148721]), atol=2e-6, rtol=0)
    assert abs(kl.mean().item() - 0.210809) < 2e-6
    assert kl_to_start(start, start, mask).tolist() == [0.0, 0.0]  # the start itself: exactly 0


def test_accuracy_is_the_verifiers_beside_a_reward_model():
    # --reward rm:PATH+0*verifier: the reward is the RM's score; an answer is correct when the verifier passed it
    comps = [Completion(0, tokens=[1, 2], finish_reason="stop") for _ in range(4)]
    rm, verifier = torch.tensor([2.0, 1.5, 0.3, -1.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])
    s = Rollouts(rows=[{}] * 4, prompts=[[0]] * 4, completions=comps, rewards=rm,
                 reward_parts={"rm:x": rm, "verifier": verifier}, group_size=4).stats()
    assert s["correct"] == 2.0  # answers 1 and 3; a reward >= 1 would have said answers 1 and 2
    # without a verifier term a reward >= 1 still counts as correct (verifier+0.1*format: 1.1 and 1.0)
    s = Rollouts(rows=[{}] * 4, prompts=[[0]] * 4, completions=comps, rewards=torch.tensor([1.1, 1.0, 0.1, 0.0]),
                 group_size=4).stats()
    assert s["correct"] == 2.0


class ScriptedEngine:
    """Answers each prompt with the next text of a script; records the prompts it was given."""

    def __init__(self, tok, texts):
        self.tokenizer, self.texts, self.prompts = tok, list(texts), []

    @contextmanager
    def prepared(self):
        yield self

    def generate(self, prompts, num_samples=1, **_):
        self.prompts += prompts
        out = []
        for i in range(len(prompts) * num_samples):
            ids = self.tokenizer.encode(self.texts.pop(0)) + [self.tokenizer.eos_id]
            out.append(Completion(i // num_samples, tokens=ids, logprobs=[0.0] * len(ids), mask=[1] * len(ids),
                                  finish_reason="stop"))
        return out


def test_heldout_rewards_are_each_graders_mean_over_one_answer_per_row(tok):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": "5", "verifier": "gsm8k"}
            for i in range(3)]
    answers = ["5 + 0 = 5\n#### 5", "#### 7", "I do not know"]  # right; wrong, in format; no final answer
    grader = Grader("0.5*format+0*verifier", tok)
    for batch_size in (64, 2):  # one batch, or two: the same means
        got = heldout_rewards(ScriptedEngine(tok, answers), rows, grader, max_new_tokens=8, batch_size=batch_size)
        assert got.keys() == {"reward", "reward/format", "reward/verifier"}
        assert abs(got["reward/verifier"] - 1 / 3) < 1e-6 and abs(got["reward/format"] - 2 / 3) < 1e-6
        assert abs(got["reward"] - 0.5 * 2 / 3) < 1e-6  # the verifier's weight is 0: logged, not rewarded


def test_plain_prompts_are_how_the_base_read_its_documents(tok):
    plain = tok.with_prompt_format("plain")
    assert tok.prompt_format == "chat" and plain.prompt_format == "plain"  # a copy: tok still renders ChatML
    for doc in pretrain_text("test", 20):
        if doc.startswith("Problem 1."):
            continue  # a worksheet; a lone problem reads "question\nsolution"
        question, solution = doc.split("\n", 1)
        prompt = plain.render_for_completion([{"role": "user", "content": question}])
        assert plain.decode(prompt) == question + "\n"
        # a true token prefix of the document as base_train.py tokenized it: the base continues where it read
        assert tok.encode(doc)[:len(prompt)] == prompt
    chat = tok.render_for_completion([{"role": "user", "content": "hi"}])
    assert tok.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(UserError, match="no tool calls"):
        plain.render_for_completion([{"role": "user", "content": "hi"}], tools=[{"name": "calculator"}])
    with pytest.raises(UserError, match="one user message"):
        plain.render_for_completion([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    with pytest.raises(UserError, match="unknown prompt format"):
        tok.with_prompt_format("alpaca")


def test_the_rollout_path_prompts_in_the_tokenizers_format(tok):
    p = generate_problems("test", 1)[0]
    rows = [{"prompt": [{"role": "user", "content": p.question}], "ground_truth": str(p.answer), "verifier": "gsm8k"}]
    engine = ScriptedEngine(tok.with_prompt_format("plain"), [f"#### {p.answer}"] * 2)
    r = sample(engine, rows, Grader("verifier", engine.tokenizer), samples_per_prompt=2, max_new_tokens=8)
    assert engine.prompts == [tok.encode(p.question + "\n")] and r.prompts[0] == engine.prompts[0]
    assert r.rewards.tolist() == [1.0, 1.0]


@pytest.fixture(scope="module")
def tiny_base(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def rl(home, init, *extra):
    cmd = [sys.executable, os.path.join(REPO, "chat_rl.py"), "--init", init, "--num-prompts", "32", "--steps", "2",
           "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-problems", "4",
           "--pass-k", "0", "--eval-every", "100", "--save-every", "100", "--max-resample", "1", *extra]
    return subprocess.run(cmd, env={**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)


def metrics_of(home):
    with open(home / "rl" / "default" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_log_kl_to_start_at_beta_0_with_plain_prompts_and_held_out_rewards(tmp_path, tiny_base):
    # an untrained model never answers right: the soft overlong penalty gives its answers distinct rewards
    r = rl(tmp_path, tiny_base, "--prompt-format", "plain", "--reward", "verifier+0.1*format", "--overlong-buffer",
           "24", "--lr", "3e-2", "--log-kl-to-start")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics_of(tmp_path)
    steps = [row for row in rows if "reward" in row]
    # step 1 samples with the start's own weights: exactly 0; step 2 with the weights one update later
    assert steps[0]["kl_to_start"] == 0.0 and steps[1]["kl_to_start"] > 0
    assert all("kl" not in row for row in steps)  # no penalty, so no penalty term to log
    # at the evaluations, each grader on held-out answers beside pass@1 (not a plain verifier reward)
    for row in (rows[0], rows[-1]):
        assert {"eval/pass@1", "eval/reward", "eval/reward/verifier", "eval/reward/format"} <= row.keys()
    # the same run without the flag (and with the plain verifier) loads no reference: no kl_to_start, no eval/reward
    r = rl(tmp_path / "default", tiny_base, "--prompt-format", "plain", "--overlong-buffer", "24")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics_of(tmp_path / "default")
    assert len([row for row in rows if "reward" in row]) == 2
    assert not any(key.startswith(("kl", "eval/reward")) for row in rows for key in row)


def test_plain_prompts_refuse_the_calculator_in_one_line(tmp_path, tiny_base):
    # the prompts are plain: with --tools (a ChatML tools block) the run stops at once, in one line
    r = rl(tmp_path / "tools", tiny_base, "--prompt-format", "plain", "--tools")
    assert r.returncode != 0 and "--prompt-format plain prompts a base model" in r.stderr
    assert "Traceback" not in r.stderr
