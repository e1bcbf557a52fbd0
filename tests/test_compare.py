"""chat_eval.py --compare: two runs on the same held-out problems with the same sampling seeds, and their
paired difference. Two tiny random models stand in for two runs; a random model never writes a correct
`#### N`, so the verifier is replaced by one that grades a property of the answer text that varies
between answers (the sum of its character codes is even)."""
import json
import math
import statistics
import sys

import pytest
import torch

import chat_eval
import verifiers
from common import UserError
from engine import Engine
from model import GPT, GPTConfig
from verifiers import answer_text
from tasks import rl_prompts
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)
PROBLEMS, SAMPLES, TEMPERATURE, MAX_NEW = 6, 3, 1.0, 12


def even_code_sum(verifier, answer, truth):
    return float(sum(map(ord, answer)) % 2 == 0)


@pytest.fixture(scope="module")
def two_models(tok, tmp_path_factory):
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                              intermediate_size=64, max_seq_len=256))
        with torch.no_grad():  # weights drawn wide, so that greedy answers differ from prompt to prompt
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.3)
        path = str(tmp_path_factory.mktemp(f"model{seed}"))
        save_hf(model, path, tok)
        paths.append(path)
    return paths


def scores_by_hand(path, tok):
    """Per-problem greedy and sampled scores, generated here with the engine: all problems in one batch, seed 0."""
    model = load_hf(path)
    prompts = [tok.render_for_completion(r["prompt"]) for r in rl_prompts("test", PROBLEMS)]
    engine = Engine(model, tok)
    greedy = [even_code_sum(None, answer_text(tok.decode(o.tokens)), None)
              for o in engine.generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0, seed=0)]
    outs = engine.generate(prompts, num_samples=SAMPLES, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=0)
    sampled = [sum(even_code_sum(None, answer_text(tok.decode(o.tokens)), None)
                   for o in outs[i * SAMPLES:(i + 1) * SAMPLES]) / SAMPLES for i in range(PROBLEMS)]
    return greedy, sampled


def test_compare_two_models(two_models, tok, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(verifiers, "verify", even_code_sum)  # verify_batch grades through it
    out = tmp_path / "compare.json"
    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "--compare", *two_models, "--problems", str(PROBLEMS),
                                      "--samples", str(SAMPLES), "--temperature", str(TEMPERATURE),
                                      "--max-new-tokens", str(MAX_NEW), "--out", str(out)])
    chat_eval.main()
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    (greedy_a, sampled_a), (greedy_b, sampled_b) = (scores_by_hand(p, tok) for p in two_models)
    for key, a, b in (("greedy_pass@1", greedy_a, greedy_b), ("pass@1_t1", sampled_a, sampled_b)):
        diffs = [y - x for x, y in zip(a, b)]
        expected = {"a": sum(a) / PROBLEMS, "b": sum(b) / PROBLEMS, "change": sum(diffs) / PROBLEMS,
                    "se": statistics.stdev(diffs) / math.sqrt(PROBLEMS)}
        assert result[key] == pytest.approx(expected, abs=1e-9), key
        line = next(l for l in printed.splitlines() if l.startswith("greedy" if key.startswith("greedy") else "pass@1"))
        numbers = [float(v) for v in line[32:].split()[:4]]
        assert numbers == pytest.approx([expected[k] for k in ("a", "b", "change", "se")], abs=5e-4), line
    assert any(x != y for x, y in zip(sampled_a, sampled_b))  # the two models really answer differently
    assert result["problems"] == PROBLEMS and result["samples"] == SAMPLES


def test_compare_a_model_with_itself(two_models, monkeypatch):
    """The same model twice: the same seeds give the same samples, so every difference is exactly 0."""
    monkeypatch.setattr(verifiers, "verify", even_code_sum)  # verify_batch grades through it
    result = chat_eval.compare_runs(two_models[0], two_models[0], problems=PROBLEMS, samples=SAMPLES,
                                    temperature=TEMPERATURE, max_new_tokens=MAX_NEW)
    for key in ("greedy_pass@1", "pass@1_t1"):
        assert result[key]["change"] == 0.0 and result[key]["se"] == 0.0
        assert 0 < result[key]["a"] < 1  # not trivially zero: the verifier does pass some answers
    assert chat_eval.verdict(0.0, 0.0) == "identical answers"


def test_compare_refuses_bad_input(two_models, tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        chat_eval.compare_runs(str(tmp_path / "nowhere"), two_models[0], problems=PROBLEMS)
    with pytest.raises(UserError, match="at least 2 problems"):
        chat_eval.compare_runs(*two_models, problems=1)


def test_per_prompt_scores_come_back_in_row_order_from_every_rank(two_models, tok, monkeypatch):
    """evaluate_chat(per_prompt=True) on 2 ranks: rank r grades rows r, r+2, r+4 and the lists are gathered.
    Simulated in one process (each rank's share graded in turn, then the gather handed both): the merged list is
    in row order, as one process gives it, not rank 0's rows then rank 1's, which would pair every paired
    comparison's problems wrongly."""
    import evaluation
    from common import DistInfo
    rows = rl_prompts("test", PROBLEMS)
    wanted = {rows[0]["ground_truth"], rows[1]["ground_truth"]}  # rows 0 and 1 right: rank order would differ
    monkeypatch.setattr(verifiers, "verify", lambda v, answer, truth: float(truth in wanted))
    model = load_hf(two_models[0])
    _, alone = evaluation.evaluate_chat(model, tok, rows, max_new_tokens=4, per_prompt=True)
    assert alone == [1, 1, 0, 0, 0, 0]

    class Gathered(Exception):
        pass

    parts = {}
    monkeypatch.setattr(evaluation, "all_reduce_dict", lambda values, keys=None: values)
    for rank in (0, 1):  # each rank's own share, up to the gather
        monkeypatch.setattr(evaluation, "dist_info", lambda rank=rank: DistInfo(rank, 2))

        def capture(mine, rank=rank):
            parts[rank] = mine
            raise Gathered
        monkeypatch.setattr(evaluation, "all_gather_objects", capture)
        with pytest.raises(Gathered):
            evaluation.evaluate_chat(model, tok, rows, max_new_tokens=4, per_prompt=True)
    assert sorted(parts[0]) == [0, 2, 4] and sorted(parts[1]) == [1, 3, 5]
    monkeypatch.setattr(evaluation, "dist_info", lambda: DistInfo(0, 2))
    monkeypatch.setattr(evaluation, "all_gather_objects", lambda mine: [parts[0], parts[1]])
    _, merged = evaluation.evaluate_chat(model, tok, rows, max_new_tokens=4, per_prompt=True)
    assert merged == alone
