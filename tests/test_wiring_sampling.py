"""chat_sample.py's and chat_eval.py's flags reach what they name. Each case is a real run of main
(tests/inprocess.py, the command line parsed by the stage's parser) with one flag changed from the base command.
chat_sample's engine is scripted (its answers chosen here, its arguments recorded): the engine is asked for what
the flags say, and the files hold what the keep rule and the pair rule say of the graded answers, recomputed
here from their definitions. chat_eval's evaluation receives the sampling settings its flags name."""
import json

import pytest
import torch

import chat_eval
import chat_sample
from checkpoint import save_hf
from engine import Completion
from inprocess import run_stage, spy
from model import GPT, GPTConfig
from tasks import CALCULATOR_SCHEMA, rl_prompts

PROMPTS = 3


@pytest.fixture(scope="module")
def chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("sample_wiring")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def script(monkeypatch, tok, rows):
    """Engine.generate answers the p-th prompt (counting across calls) with, for its samples j = 0, 1, ...: the
    right answer, a wrong one, a wrong one without the '#### ' format, the right one cut at the length limit,
    then the right one again and wrong ones. Returns the list its calls' arguments are recorded in."""
    calls = []

    def generate(self, prompt_ids, num_samples=1, **kw):
        calls.append(dict(prompt_ids=prompt_ids, num_samples=num_samples, **kw))
        out = []
        for i in range(len(prompt_ids)):
            truth = int(rows[sum(len(c["prompt_ids"]) for c in calls[:-1]) + i]["ground_truth"])
            texts = [f"So #### {truth}", f"So #### {truth + 1}", f"maybe {truth + 2}", f"So #### {truth}",
                     f"Hence #### {truth}", f"Or #### {truth + 3}", f"Or #### {truth + 4}", f"Or #### {truth + 5}"]
            for j in range(num_samples):
                cut = j == 3
                tokens = tok.encode(texts[j]) + ([] if cut else [tok.eos_id])
                out.append(Completion(i, tokens=tokens, logprobs=[0.0] * len(tokens), mask=[1] * len(tokens),
                                      finish_reason="length" if cut else "stop"))
        return out
    monkeypatch.setattr("engine.Engine.generate", generate)
    return calls


def kept(rewards, texts, finished, keep, max_per_prompt, threshold):
    """The keep rule: finished answers (and, for verified, reward >= threshold), best first (ties: sampling order),
    each text once, at most max_per_prompt."""
    order = sorted((i for i in range(len(rewards)) if finished[i] and (keep != "verified" or rewards[i] >= threshold)),
                   key=lambda i: (-rewards[i], i))
    out = []
    for i in order:
        if len(out) < max_per_prompt and texts[i] not in [texts[k] for k in out]:
            out.append(i)
    return out


@pytest.mark.parametrize("flags", [
    [], ["--samples", "6"], ["--temperature", "0.7"], ["--top-k", "5"], ["--top-p", "0.5"], ["--max-new-tokens", "9"],
    ["--seed", "2"], ["--batch-size", "2"], ["--threshold", "0.5"], ["--keep", "best"], ["--keep", "all"],
    ["--max-per-prompt", "1"], ["--reward", "verifier"], ["--tools", "--max-tool-turns", "2"], ["--data", "{data}"],
], ids=lambda f: "_".join(x.lstrip("-") for x in f if "{" not in x) or "defaults")
def test_sample_flags_reach_the_engine_and_the_files(monkeypatch, tmp_path, chat, tok, flags):
    data = tmp_path / "prompts.jsonl"  # --data: a file of RL rows, its first --num-prompts sampled
    data.write_text("".join(json.dumps(r) + "\n" for r in rl_prompts("train", 5, seed=7)))
    argv = ["--init", chat, "--num-prompts", str(PROMPTS), "--samples", "4", "--max-per-prompt", "3",
            "--reward", "verifier+0.5*format",
            "--out", str(tmp_path / "sft.jsonl"), "--pairs-out", str(tmp_path / "pairs.jsonl"),
            *[f.format(data=data) for f in flags]]
    args = chat_sample.parser.parse_args(argv)
    rows = rl_prompts("train", 5, seed=7)[:PROMPTS] if args.data else rl_prompts("train", PROMPTS, seed=args.seed)
    calls = script(monkeypatch, tok, rows)
    run_stage(monkeypatch, tmp_path, chat_sample, *argv)
    tools = [CALCULATOR_SCHEMA] if args.tools else None
    assert [p for c in calls for p in c["prompt_ids"]] == [tok.render_for_completion(r["prompt"], tools=tools)
                                                           for r in rows]
    for start, c in zip(range(0, PROMPTS, args.batch_size), calls):  # one engine call per --batch-size prompts
        assert len(c["prompt_ids"]) == min(args.batch_size, PROMPTS - start)
        assert (c["num_samples"], c["temperature"], c["top_k"], c["top_p"], c["max_new_tokens"], c["seed"]) == \
            (args.samples, args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed * 1_000_003 + start)
        assert c.get("max_tool_turns", args.max_tool_turns) == args.max_tool_turns
    sft = [json.loads(line) for line in open(tmp_path / "sft.jsonl")]
    pairs = [json.loads(line) for line in open(tmp_path / "pairs.jsonl")]
    want_sft, want_pairs = [], []
    for r in rows:  # the grades of the scripted answers: verifier 1 if right; format 1 if '#### <number>'
        truth = int(r["ground_truth"])
        texts = [f"So #### {truth}", f"So #### {truth + 1}", f"maybe {truth + 2}", f"So #### {truth}",
                 f"Hence #### {truth}", f"Or #### {truth + 3}", f"Or #### {truth + 4}", f"Or #### {truth + 5}"]
        texts = texts[:args.samples]
        right = [t.endswith(f"#### {truth}") for t in texts]
        fmt = ["####" in t for t in texts]
        rewards = [float(ok) + (0.5 * f if "format" in args.reward else 0.0) for ok, f in zip(right, fmt)]
        finished = [j != 3 for j in range(len(texts))]
        want_sft += [(texts[i], rewards[i]) for i in kept(rewards, texts, finished, args.keep, args.max_per_prompt,
                                                         args.threshold)]
        done = [i for i in range(len(texts)) if finished[i]]
        best, worst = min(done, key=lambda i: (-rewards[i], i)), min(done, key=lambda i: (rewards[i], i))
        if rewards[best] != rewards[worst]:
            want_pairs.append((texts[best], texts[worst]))
    assert [(s["messages"][-1]["content"], s["reward"]) for s in sft] == want_sft
    assert [(p["chosen"][-1]["content"], p["rejected"][-1]["content"]) for p in pairs] == want_pairs


EVAL_DEFAULTS = dict(num_samples=1, temperature=0.0, top_k=None, top_p=None, max_new_tokens=4, use_tools=False)


@pytest.mark.parametrize("flags, changed", [
    ([], {}), (["--samples", "2"], {"num_samples": 2}), (["--temperature", "0.7"], {"temperature": 0.7}),
    (["--top-k", "5"], {"top_k": 5}), (["--top-p", "0.5"], {"top_p": 0.5}), (["--max-new-tokens", "6"],
    {"max_new_tokens": 6}), (["--tools"], {"use_tools": True}), (["--problems", "3"], {"problems": 3}),
], ids=["defaults", "samples", "temperature", "top-k", "top-p", "max-new-tokens", "tools", "problems"])
def test_eval_flags_reach_the_evaluation(monkeypatch, tmp_path, chat, flags, changed):
    """chat_eval.py --model: the held-out problems and the sampling settings of the evaluation are the flags'."""
    calls = spy(monkeypatch, chat_eval, "evaluate_chat")
    run_stage(monkeypatch, tmp_path, chat_eval, "--model", chat, "--problems", "2", "--max-new-tokens", "4", *flags)
    want = {**EVAL_DEFAULTS, **changed}
    (_, _, problems), kw = calls[0].args, calls[0].kwargs
    assert problems == rl_prompts("test", want.pop("problems", 2))
    assert {k: kw[k] for k in want} == want
