"""Collectives that scale: --dist-timeout bounds how long a rank waits in a collective, a rank with fewer
batches joins the others' passes (rank_passes), a NaN loss on one rank stops every rank naming it, and held-out
evaluation split across 2 gloo ranks (each its share, the sums all-reduced) equals one process, and so do the RL
statistics taken over a whole batch (the 80/20 token mask, REINFORCE++'s whitening, --scale batch), and sums
of names that only some ranks hold (a mixture's sources)."""
import json
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

import verifiers
from evaluation import evaluate_chat
import common
from common import cleanup_dist, init_dist, rank_passes
from packing import heldout_loss
from model import GPT, GPTConfig
from tasks import rl_prompts, sft_conversations
from checkpoint import load_hf, save_hf

torch.set_num_threads(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _late_rank(rank, port, out):
    _env(rank, port)
    init_dist("cpu", timeout_minutes=0.05)  # 3 s
    if rank == 0:
        time.sleep(12)  # busy elsewhere (a long evaluation, a slow checkpoint): never joins the barrier
        return
    t0 = time.time()
    try:
        torch.distributed.barrier()
        outcome = "returned"
    except RuntimeError as e:
        outcome = f"raised: {e}"
    with open(out, "w") as f:
        json.dump({"seconds": time.time() - t0, "outcome": outcome}, f)


@pytest.mark.slow
def test_a_rank_waiting_past_dist_timeout_gives_up_instead_of_hanging(tmp_path):
    ctx, port, out = mp.get_context("spawn"), free_port(), str(tmp_path / "waited.json")
    procs = [ctx.Process(target=_late_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    with open(out) as f:
        waited = json.load(f)
    assert waited["outcome"].startswith("raised") and 2 <= waited["seconds"] < 10, waited


def test_a_rank_with_fewer_batches_runs_idle_passes_until_the_busiest_is_done(monkeypatch):
    """This rank holds 2 batches, the busiest rank 5: it yields its 2, in order, then runs 3 idle forwards
    (one token, no backward), so that each of the other rank's FSDP2 forwards finds it in the collective."""
    monkeypatch.setattr(common, "all_reduce_max", lambda n: max(n, 5))
    forwards = []
    model = lambda x: forwards.append(tuple(x.shape)) or torch.zeros(1, 1, requires_grad=True)  # noqa: E731
    seen = []
    for batch in rank_passes(model, [["a", "b"], ["c"]]):
        seen.append((batch, len(forwards)))  # no idle pass before this rank's own batches are done
    assert seen == [(["a", "b"], 0), (["c"], 0)] and forwards == [(1, 1)] * 3


def even_code_sum(verifier, answer, truth):  # a random model never answers right: grade a property of the text
    return float(sum(map(ord, answer)) % 2 == 0)


def _evaluate(rank, world, port, folder, out):
    from tokenizer import Tokenizer
    if world > 1:  # a spawned rank: patch its own verifiers module (the 1-process call is patched by the test)
        _env(rank, port)
        verifiers.verify = even_code_sum
    init_dist("cpu")
    model, tok = load_hf(folder), Tokenizer.load(folder)
    metrics, correct = evaluate_chat(model, tok, rl_prompts("test", 7), max_new_tokens=10, per_prompt=True)
    from chat_sft import build_rows, render_examples
    examples, _ = render_examples(tok, sft_conversations("val", 9), 512, "drop")
    loss = heldout_loss(model, examples, build_rows(examples, 512, "bfd"), tok.pad_id, 512, "bfd", "cpu", batch_size=2)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"metrics": metrics, "correct": correct, "val_loss": loss}, f)
    cleanup_dist()


def _nan_on_rank_1(rank, port, out):
    """One DDP training step in which rank 1's loss is NaN: what each rank raises, and whether its weights moved."""
    _env(rank, port)
    init_dist("cpu", timeout_minutes=0.2)  # a rank left waiting gives up after 12 s
    torch.manual_seed(0)
    model = common.wrap_model(GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, head_dim=8,
                                            intermediate_size=32, max_seq_len=16)))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = common.make_optimizer(model, 1e-2)
    x = torch.randint(0, 64, (2, 8))
    loss = -model(x, x).sum()
    if rank == 1:
        loss = loss * float("nan")
    try:
        common.check_finite(loss, 3)
        loss.backward()
        common.optimizer_step(model, optimizer, 1.0)
        outcome = "stepped"
    except common.UserError as e:
        outcome = str(e)
    except RuntimeError as e:  # a collective that timed out
        outcome = f"RuntimeError: {e}"
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"outcome": outcome, "moved": moved}, f)
    cleanup_dist()


def test_a_nan_on_one_rank_stops_every_rank_naming_it(tmp_path):
    # rank 1 alone sees a NaN loss: both ranks stop at the step, before the update, with the same line naming rank 1
    # (rank 0 prints it), instead of rank 1 exiting unheard while rank 0 waits in the backward's all-reduce. ~10 s:
    # the quick tier's catcher of mutant nan-stops-one-rank-alone
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_nan_on_rank_1, args=(r, port, str(tmp_path / "out"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for r in range(2):
        got = json.loads((tmp_path / f"out.{r}.json").read_text())
        assert got["outcome"].startswith("step 3: the loss is nan on rank 1 of 2; not training on it."), got
        assert not got["moved"]


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
def test_evaluation_on_two_ranks_equals_one_process(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(verifiers, "verify", even_code_sum)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512))
    with torch.no_grad():  # weights drawn wide, so that greedy answers differ from prompt to prompt
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    save_hf(model, str(tmp_path / "model"), tok)
    _evaluate(0, 1, None, str(tmp_path / "model"), str(tmp_path / "one.json"))
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_evaluate, args=(r, 2, port, str(tmp_path / "model"), str(tmp_path / "two.json")))
             for r in range(2)]  # 7 problems and 9 conversations: uneven shares
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["correct"] == two["correct"] and 0 < sum(one["correct"]) < 7  # the same answers, graded alike
    for k, v in one["metrics"].items():
        assert abs(v - two["metrics"][k]) < 1e-9, k
    assert abs(one["val_loss"] - two["val_loss"]) < 1e-5


def _batch_statistics(rank, port, out):
    """This rank's share of a batch (rank 0: rows 0-1, rank 1: rows 2-5) through the RL statistics taken over the
    whole batch: the 80/20 paper's high-entropy mask, REINFORCE++'s whitening, and --scale batch's std."""
    from chat_rl import group_advantages
    from rollout import high_entropy_mask, whiten
    if rank is not None:
        _env(rank, port)
        init_dist("cpu")
    rows = slice(0, 6) if rank is None else (slice(0, 2) if rank == 0 else slice(2, 6))
    torch.manual_seed(0)
    entropy, mask, rewards = torch.rand(6, 7) * 3, (torch.rand(6, 7) > 0.3).float(), torch.rand(6).round()
    got = {"mask": high_entropy_mask(entropy[rows], mask[rows], 0.3), "whiten": whiten(entropy[rows], mask[rows]),
           "batch_scale": group_advantages(rewards[rows], 2, "batch", "grpo")}
    if rank is None:
        return got
    # names only some ranks have (the sources of a mixture one rank's batch does not hold) count 0 on the others
    got["union"] = common.all_reduce_dict({"source/a/answers": 1.0} if rank == 0 else
                                          {"source/b/answers": 2.0, "source/a/answers": 0.5})
    torch.save(got, f"{out}.{rank}.pt")
    cleanup_dist()


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
def test_rl_batch_statistics_on_two_ranks_equal_one_process(tmp_path):
    # each rank holds a share of the batch, and every statistic ranks or normalizes over all of it: the same numbers
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_batch_statistics, args=(r, port, str(tmp_path / "out"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    single = _batch_statistics(None, None, None)
    ranks = [torch.load(tmp_path / f"out.{r}.pt") for r in range(2)]
    for key, value in single.items():
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), value, atol=1e-6, rtol=1e-6)
    assert all(r["union"] == {"source/a/answers": 1.5, "source/b/answers": 2.0} for r in ranks)
    assert 0 < float(single["mask"].sum()) < float((single["mask"] >= 0).sum())
