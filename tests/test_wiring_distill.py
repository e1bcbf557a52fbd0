"""chat_distill.py's flags reach what they name. Each case is a real run of main (tests/inprocess.py: one step,
tiny student and teacher, the command line parsed by the stage's parser) with one flag changed from the base
command; spies record what the loop handed the update, and the test recomputes it from the definitions: both
models' log-probs of the sampled tokens at --temperature, the per-token reverse-KL reward discounted over the
rest of the answer (--discount), the sampler correction, the clip bounds; --mode kd samples from the teacher
and trains on its tokens; --mode gkd's loss is TRL's generalized JSD over both models' whole logits at --gkd-beta
and --temperature."""
import os

import pytest
import torch

import chat_distill
from checkpoint import save_hf
from inprocess import correction_weights, loaded, logp_of, run_stage, spy
from model import GPT, GPTConfig

BASE = ["--num-prompts", "8", "--steps", "1", "--prompts-per-step", "2", "--samples-per-prompt", "2",
        "--max-new-tokens", "8", "--eval-problems", "0", "--save-every", "100", "--warmup-steps", "0",
        "--minibatches", "1", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def pair(tok, tmp_path_factory):
    """A tiny student and a sharper teacher of the same vocabulary."""
    root = tmp_path_factory.mktemp("distill_wiring")
    config = GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                       intermediate_size=64, max_seq_len=512)
    torch.manual_seed(0)
    save_hf(GPT(config), str(root / "student"), tok)
    torch.manual_seed(1)
    teacher = GPT(config)
    with torch.no_grad():
        teacher.model.embed_tokens.weight.mul_(5)
    save_hf(teacher, str(root / "teacher"), tok)
    return str(root / "student"), str(root / "teacher")


def distill_case(monkeypatch, home, pair, *flags):
    student, teacher = pair
    argv = ["--init", student, "--teacher", teacher, *BASE, *flags]
    rec = {name: spy(monkeypatch, chat_distill, name)
           for name in ("sample", "update_policy", "distill_update", "kd_loss", "gkd_loss")}
    run_stage(monkeypatch, home, chat_distill, *argv)
    return chat_distill.parser.parse_args(argv), rec


def discounted(rewards, discount):
    """A_t = sum over k >= t of discount^(k - t) r_k, along each row."""
    adv = torch.zeros_like(rewards)
    for t in range(rewards.size(1)):
        weights = discount ** torch.arange(rewards.size(1) - t, dtype=rewards.dtype)
        adv[:, t] = (rewards[:, t:] * weights).sum(-1)
    return adv


@pytest.mark.parametrize("flags", [
    [], ["--discount", "0.5"], ["--temperature", "0.7"], ["--eps-low", "0.1"], ["--eps-high", "0.1"],
    ["--tis-cap", "0.5"], ["--correction", "sequence-tis"], ["--samples-per-prompt", "3"], ["--ppo-epochs", "2"],
    ["--minibatches", "2"], ["--micro-batch-tokens", "100"], ["--grad-clip", "0.5"], ["--max-new-tokens", "6"],
    ["--tools"], ["--max-tool-turns", "2"], ["--prompts-per-step", "3"], ["--mode", "kd"],
    ["--mode", "kd", "--temperature", "0.7"], ["--mode", "gkd"], ["--mode", "gkd", "--gkd-beta", "0.2"],
    ["--mode", "gkd", "--temperature", "0.7"], ["--mode", "gkd", "--micro-batch-tokens", "30"],
], ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_each_flag_reaches_the_update(monkeypatch, tmp_path, pair, flags):
    args, rec = distill_case(monkeypatch, tmp_path, pair, *flags)
    student, teacher = (loaded(p) for p in pair)
    rollouts = rec["sample"][0].out
    assert len(rollouts) == args.prompts_per_step * args.samples_per_prompt
    kw = rec["sample"][0].kwargs  # the sampler: at the sampling flags, with the calculator under --tools
    assert (kw["samples_per_prompt"], kw["max_new_tokens"], kw["max_tool_turns"], kw["temperature"]) == \
        (args.samples_per_prompt, args.max_new_tokens, args.max_tool_turns, args.temperature)
    assert (kw["tool_schemas"] is not None) == args.tools == bool(rec["sample"][0].args[0].tools)
    if args.mode != "on-policy":  # kd, gkd: one supervised update
        assert not rec["update_policy"] and len(rec["distill_update"]) == 1
        call = rec["distill_update"][0]
        batch = call.args[2]
        x, y, m = batch.inputs, batch.targets, batch.mask
        update = {k: call.kwargs[k] for k in ("ppo_epochs", "minibatches", "micro_batch_tokens", "grad_clip")}
        assert update == {k: getattr(args, k) for k in update}
        sampler, other = (teacher, "gkd_loss") if args.mode == "kd" else (student, "kd_loss")
        torch.testing.assert_close(batch.engine_logp, logp_of(sampler, x, y, args.temperature) * m,
                                   atol=2e-5, rtol=1e-4)
        assert not rec[other]
        if args.mode == "kd":  # the student's log-probs of the teacher's tokens, at --temperature
            whole = logp_of(student, x, y, args.temperature) * m
            assert abs(sum(float(c.out) for c in rec["kd_loss"]) - float(-whole.sum() / m.sum())) < 1e-5
            return
        # gkd: the passes' losses add up to TRL's generalized JSD over the whole batch's logits (the student
        # is the one at --init: one minibatch, one epoch, so every pass runs before the only optimizer step)
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.gkd import GKDTrainer
        expected = GKDTrainer.generalized_jsd_loss(student(x), teacher(x), labels=y, beta=args.gkd_beta,
                                                   temperature=args.temperature)
        assert all(c.kwargs["beta"] == args.gkd_beta and c.kwargs["temperature"] == args.temperature
                   for c in rec["gkd_loss"])
        assert (len(rec["gkd_loss"]) > 1) == (args.micro_batch_tokens < 100)  # split into passes: the same sum
        assert abs(sum(float(c.out) for c in rec["gkd_loss"]) - float(expected)) < 1e-5
        return
    assert not rec["distill_update"] and len(rec["update_policy"]) == 1
    call = rec["update_policy"][0]
    batch, kw = call.args[2], call.kwargs
    x, y, m = batch.inputs, batch.targets, batch.mask
    s = logp_of(student, x, y, args.temperature) * m
    t = logp_of(teacher, x, y, args.temperature) * m
    torch.testing.assert_close(kw["old_logp"], s, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kw["advantages"], discounted((t - s) * m, args.discount) * m, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kw["weights"], correction_weights(kw["old_logp"], batch.engine_logp, m, args.correction,
                                                                 args.tis_cap, 0.1))
    assert kw["loss_settings"] == {"eps_low": args.eps_low, "eps_high": args.eps_high, "max_len": args.max_new_tokens}
    update = {k: kw[k] for k in ("temperature", "ppo_epochs", "minibatches", "micro_batch_tokens", "grad_clip")}
    assert update == {k: getattr(args, k) for k in update}
