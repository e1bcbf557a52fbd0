"""chat_rl.py's loop flags reach what they name (update_policy's own settings are test_rl.py's
test_update_applies_the_gradient_of_the_flags_objective). Each case is a real run of main (tests/inprocess.py:
one step, a tiny model, the command line parsed by the stage's parser) with one flag changed from the base
command; spies record what the loop handed the update, and the test recomputes it from the definitions: the
rewards with DAPO's overlong shaping, the group advantages (GRPO's mean or RLOO's leave-one-out baseline, over
the group's std, the batch's, or none; REINFORCE++'s per-token returns with the KL in the reward, or the
group-centred reward, whitened over the batch's tokens), the loss mask (--mask-truncated), the snapshot's and the
reference's log-probs of the distribution sampled from, and the sampler correction (times the 80/20 paper's
high-entropy token mask under --top-entropy)."""
import pytest
import torch
import torch.nn.functional as F

import chat_rl
import common
from checkpoint import save_hf
from inprocess import (LengthGrader, correction_weights, loaded, logp_of, perturbed_reference, run_stage, spy,
                       truncated_logp)
from model import GPT, GPTConfig
from rollout import kl_penalty, training_batch
from test_rl import RecordingOptimizer, synthetic_batch, tiny_policy

BASE = ["--num-prompts", "8", "--steps", "1", "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "8",
        "--eval-problems", "0", "--save-every", "100", "--warmup-steps", "0", "--minibatches", "1",
        "--overlong-buffer", "5", "--max-resample", "1", "--seed", "5"]


@pytest.fixture(scope="module")
def chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("rl_wiring")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def rl_case(monkeypatch, home, chat, *flags):
    monkeypatch.setattr(chat_rl, "Grader", LengthGrader)
    monkeypatch.setattr(chat_rl, "reference_model", perturbed_reference(chat_rl.reference_model))
    # --mask-eps -1 drops every token: no user means that (common.FLAG_RANGES refuses it), this test does, to see
    # the flag reach the weights whatever the float noise between engine and trainer
    monkeypatch.setitem(common.FLAG_RANGES, "mask_eps", ">= -1")
    argv = ["--init", chat, *BASE, *flags]
    rec = {name: spy(monkeypatch, chat_rl, name) for name in ("sample", "dynamic_sampling", "update_policy",
                                                                 "reference_model")}
    rows = run_stage(monkeypatch, home, chat_rl, *argv)
    return chat_rl.parser.parse_args(argv), rec, [r for r in rows if "reward" in r]


def reference_advantages(rewards, G, estimator, scale):
    """One per answer: the reward minus its group's mean (grpo) or the mean of the group's other answers (rloo),
    divided by the group's population std (+1e-6), the whole batch's, or nothing; exactly 0 in a group whose
    rewards are all equal."""
    out = []
    for g in range(0, len(rewards), G):
        group = [float(r) for r in rewards[g:g + G]]
        mean = sum(group) / G
        std = (sum((r - mean) ** 2 for r in group) / G) ** 0.5
        for r in group:
            base = mean if estimator == "grpo" else (sum(group) - r) / (G - 1)
            out.append(0.0 if max(group) == min(group) else (r - base) / (std + 1e-6 if scale == "group" else 1.0))
    adv = torch.tensor(out)
    if scale == "batch":
        r = torch.tensor([float(x) for x in rewards])
        adv = adv / (((r - r.mean()) ** 2).mean() ** 0.5 + 1e-6)
    return adv


def reference_reinforce_pp(rewards, mask, G, baseline, kl):
    """Per token: the answer's reward (minus its group's mean with the baseline) minus the KL of this and every
    later answer token (kl: (B, T) already weighted by beta, or zeros), then to mean 0, population std 1 over every
    answer token of the batch (verl's compute_reinforce_plus_plus(_baseline)_outcome_advantage, written out)."""
    values = torch.zeros_like(mask, dtype=torch.float64)
    for b in range(mask.size(0)):
        group = [float(r) for r in rewards[b // G * G:(b // G + 1) * G]]
        score = float(rewards[b]) - (sum(group) / G if baseline else 0.0)
        answer = [t for t in range(mask.size(1)) if mask[b, t] > 0]
        for t in answer:
            values[b, t] = score - sum(float(kl[b, s]) for s in answer if s >= t)
    tokens = values[mask > 0]
    mean, var = tokens.mean(), ((tokens - tokens.mean()) ** 2).mean()
    return ((values - mean) / (var + 1e-8) ** 0.5 * mask).float()


def entropy_of(model, x, mask, temperature):
    """The entropy of the next-token distribution at `temperature` at each position (B, T), 0 outside the mask."""
    logp = F.log_softmax(model(x).float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1) * mask


def overlong(length, max_len, buffer, penalty):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer tokens, then down linearly to -penalty at max_len."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    return -penalty * min(1.0, (length - max_len + buffer) / buffer)


@pytest.mark.parametrize("flags", [
    [], ["--overlong-buffer", "0"], ["--overlong-penalty", "0.5"], ["--mask-truncated"], ["--estimator", "rloo"],
    ["--scale", "batch"], ["--scale", "none"], ["--group-size", "2"], ["--tis-cap", "0.5"],
    ["--correction", "sequence-tis", "--tis-cap", "0.5"], ["--correction", "token-mask", "--mask-eps", "-1"],
    ["--correction", "none"], ["--temperature", "0.7"], ["--top-k", "5"], ["--top-p", "0.5"], ["--kl-beta", "0.1"],
    ["--kl-beta", "0.1", "--temperature", "0.7"], ["--kl-beta", "0.1", "--top-k", "5"], ["--no-dynamic-sampling"], ["--max-resample", "0"],
    ["--max-new-tokens", "6"], ["--tools"], ["--max-tool-turns", "2"], ["--prompts-per-step", "3"],
    ["--estimator", "reinforce++"], ["--estimator", "reinforce++", "--kl-beta", "0.1", "--kl-kind", "k1"],
    ["--estimator", "reinforce++", "--kl-beta", "0.1", "--kl-kind", "k3"], ["--estimator", "reinforce++-baseline"],
    ["--estimator", "reinforce++-baseline", "--no-dynamic-sampling"], ["--top-entropy", "0.3"],
    ["--top-entropy", "0.5", "--temperature", "0.7"],
], ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_each_flag_reaches_the_update(monkeypatch, tmp_path, chat, flags):
    args, rec, steps = rl_case(monkeypatch, tmp_path, chat, *flags)
    # the sampler: --group-size answers to each prompt, at the sampling flags, with the calculator under --tools
    for call in rec["sample"]:
        kw = call.kwargs
        assert (kw["samples_per_prompt"], kw["max_new_tokens"], kw["max_tool_turns"], kw["temperature"], kw["top_k"],
                kw["top_p"]) == (args.group_size, args.max_new_tokens, args.max_tool_turns, args.temperature,
                                 args.top_k, args.top_p)
        assert (kw["tool_schemas"] is not None) == args.tools == bool(call.args[0].tools)
    # dynamic sampling's rounds: 1 + --max-resample, or 1 without it
    assert rec["dynamic_sampling"][0].args[2] == 1 + (args.max_resample if args.dynamic_sampling else 0)
    kept = rec["dynamic_sampling"][0].out[0]
    G = args.group_size
    assert len(kept) == args.prompts_per_step * G and kept.group_size == G
    # the rewards: the grade plus the soft overlong penalty of --overlong-buffer and --overlong-penalty
    grades = LengthGrader()(kept.rows, kept.prompts, kept.completions).total
    rewards = grades + torch.tensor([overlong(len(c.tokens), args.max_new_tokens, args.overlong_buffer,
                                              args.overlong_penalty) for c in kept.completions])
    torch.testing.assert_close(kept.rewards, rewards)
    if args.overlong_buffer:
        assert any(len(c.tokens) > args.max_new_tokens - args.overlong_buffer for c in kept.completions)

    call = rec["update_policy"][0]
    batch, kw = call.args[2], call.kwargs
    if not args.estimator.startswith("reinforce++"):
        torch.testing.assert_close(kw["advantages"], reference_advantages(rewards, G, args.estimator, args.scale),
                                   atol=1e-5, rtol=1e-5)
    # the loss mask: the answer's sampled tokens, none of an answer cut at the limit under --mask-truncated, none
    # of a group whose rewards are all equal under dynamic sampling (kept by its last round: DAPO trains none)
    flat = [bool(rewards[b // G * G:(b // G + 1) * G].unique().numel() == 1) for b in range(len(rewards))]
    m = torch.zeros_like(batch.mask)
    for b, (p, c) in enumerate(zip(kept.prompts, kept.completions)):
        if not (args.mask_truncated and c.finish_reason == "length") and not (args.dynamic_sampling and flat[b]):
            m[b, len(p) - 1:len(p) - 1 + len(c.tokens)] = torch.tensor(c.mask, dtype=torch.float)
    torch.testing.assert_close(batch.mask, m)
    if args.mask_truncated:
        assert any(c.finish_reason == "length" for c in kept.completions)
    # the snapshot: log p of the sampled tokens under the distribution they were sampled from
    model = loaded(chat)
    x, y = batch.inputs, batch.targets
    settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    old = truncated_logp(model, x, y, **settings) if args.top_k or args.top_p else logp_of(model, x, y, args.temperature)
    torch.testing.assert_close(kw["old_logp"], old * m, atol=2e-5, rtol=1e-4)
    assert steps[0]["logprob_mismatch"] < 1e-4  # and the engine sampled from that distribution
    ref = logp_of(rec["reference_model"][0].out, x, y, args.temperature) * m if args.kl_beta else None
    if args.kl_beta and args.estimator != "reinforce++":  # the reference's, of its whole distribution at the
        torch.testing.assert_close(kw["ref_logp"], ref, atol=2e-5, rtol=1e-4)  # temperature (no infinite KL: top-k)
    else:  # REINFORCE++ puts the KL in the reward, not the loss
        assert kw["ref_logp"] is None and bool(rec["reference_model"]) == bool(args.kl_beta)
    if args.estimator.startswith("reinforce++"):
        kl = args.kl_beta * kl_penalty(old * m, ref, args.kl_kind) * m if args.kl_beta else torch.zeros_like(m)
        expected = reference_reinforce_pp(rewards, m, G, args.estimator == "reinforce++-baseline", kl)
        torch.testing.assert_close(kw["advantages"], expected, atol=1e-4, rtol=1e-4)
        assert kw["advantages"].dim() == 2 and bool((kw["advantages"][m > 0] != 0).any())
    weights = correction_weights(kw["old_logp"], batch.engine_logp, m, args.correction, args.tis_cap, args.mask_eps)
    if args.top_entropy < 1:  # only the tokens whose entropy reaches the batch's (1 - top) quantile train
        entropy = entropy_of(model, x, m, args.temperature)
        kept = (entropy >= torch.quantile(entropy[m > 0], 1 - args.top_entropy)) & (m > 0)
        assert 0 < int(kept.sum()) < int(m.sum())
        weights = weights * kept
    torch.testing.assert_close(kw["weights"], weights)


class FlatFirstGroup(LengthGrader):
    """LengthGrader, but every answer of the batch's first prompt scores 1: one flat group per step."""
    def __call__(self, rows, prompts, completions):
        grades = super().__call__(rows, prompts, completions)
        grades.total[[i for i, p in enumerate(prompts) if p == prompts[0]]] = 1.0
        return grades


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-sampling", "no-dynamic-sampling"])
def test_a_flat_group_kept_by_the_last_round_trains_nothing_and_counts_in_no_denominator(monkeypatch, tmp_path,
                                                                                         chat, dynamic):
    """With --max-resample 0 dynamic sampling's one round keeps its flat group (the batch keeps its shape): its
    tokens are out of the loss mask, so token-mean divides by the other groups' tokens only (DAPO, verl), and the
    run logs how many were kept. Without dynamic sampling paper GRPO trains the flat group at advantage 0, its
    tokens in the denominator."""
    monkeypatch.setattr(chat_rl, "Grader", FlatFirstGroup)
    rec = {name: spy(monkeypatch, chat_rl, name) for name in ("update_policy", "dynamic_sampling")}
    flags = ["--overlong-buffer", "0", *(["--max-resample", "0"] if dynamic else ["--no-dynamic-sampling"])]
    steps = [r for r in run_stage(monkeypatch, tmp_path, chat_rl, "--init", chat, *BASE, *flags) if "loss" in r]
    kept = rec["dynamic_sampling"][0].out[0]
    G = kept.group_size
    first = [i for i, p in enumerate(kept.prompts) if p == kept.prompts[0]]
    batch = rec["update_policy"][0].args[2]
    assert len(batch.mask) == len(kept) and len(first) % G == 0  # the batch keeps its shape
    assert (batch.mask[first].sum() == 0) == dynamic and (batch.mask.sum(-1) > 0).sum() >= len(kept) - len(first)
    assert steps[0]["flat_groups_kept"] == (len(first) / G if dynamic else 0)


def test_head_precision_reaches_the_trainer_the_engine_and_the_reference(monkeypatch, tmp_path, chat):
    # --head-precision bf16: the snapshot's log-probs (the trainer's) and the reference's are those of a bf16 head
    # (bf16 hidden states and weight, a float32 log-softmax of its logits), not the float32 head's; the engine
    # sampled through the same head (the logged engine/trainer gap stays at float rounding)
    args, rec, steps = rl_case(monkeypatch, tmp_path, chat, "--head-precision", "bf16", "--kl-beta", "0.1")
    call = rec["update_policy"][0]
    batch, kw = call.args[2], call.kwargs
    x, y, m = batch.inputs, batch.targets, batch.mask

    def bf16_head_logp(model):
        with torch.no_grad():
            logits = F.linear(model.hidden_states(x).bfloat16(), model.lm_head.weight.bfloat16()).float()
        return torch.where(y >= 0, logits.log_softmax(-1).gather(-1, y.clamp(min=0)[..., None])[..., 0], 0.0) * m

    model = loaded(chat)
    torch.testing.assert_close(kw["old_logp"], bf16_head_logp(model), atol=2e-5, rtol=1e-4)
    assert (kw["old_logp"] - logp_of(model, x, y) * m).abs().max() > 2e-4  # the float32 head's differ
    torch.testing.assert_close(kw["ref_logp"], bf16_head_logp(rec["reference_model"][0].out), atol=2e-5, rtol=1e-4)
    assert steps[0]["logprob_mismatch"] < 1e-5


def one_update(argv):
    """One optimizer step of update_policy, with these chat_rl flags, on the synthetic batch of a tiny policy whose
    old log-probs sit up to 0.6 nats from its own (so that clips bind); returns what the objective is checked on."""
    prompts, comps, adv = synthetic_batch()
    b = training_batch([prompts[c.prompt_index] for c in comps], comps, 0, "cpu")
    model = tiny_policy()
    with torch.no_grad():
        logp0 = model(b.inputs, b.targets)
    old = (logp0 + (torch.rand(logp0.shape, generator=torch.Generator().manual_seed(2)) - 0.5) * 1.2) * b.mask
    args = chat_rl.parser.parse_args(["--ppo-epochs", "1", "--minibatches", "1", "--grad-clip", "0",
                                      "--max-new-tokens", "16", *argv])
    opt = RecordingOptimizer(model)
    chat_rl.update_policy(model, opt, b, old_logp=old, advantages=adv, step=0, **chat_rl.update_settings(args))
    return args, model, opt, b, old, adv


@pytest.mark.parametrize("argv", [["--eps-low", "0.05"], ["--eps-high", "0.05"], ["--dual-clip", "1.5"],
                                  ["--correction", "token-mask", "--mask-kl-coef", "0.5"], ["--mask-kl-coef", "0.5"]],
                         ids=lambda a: "_".join(x.lstrip("-") for x in a))
def test_clip_bounds_dual_clip_and_mask_kl_reach_the_objective(argv):
    """update_settings (what main passes update_policy) with --eps-low, --eps-high, --dual-clip and --mask-kl-coef:
    the gradient handed to the optimizer is that of the objective written out here: -min(r A, clip(r, 1 - eps_low,
    1 + eps_high) A), bounded by -c A for a negative advantage (dual clip), token-mean, plus --mask-kl-coef x the
    token-mean squared log-ratio to the sampler (only with --correction token-mask)."""
    args, model, opt, b, old, adv = one_update(["--micro-batch-tokens", "24", *argv])
    logp, m = model(b.inputs, b.targets), b.mask
    r, a = torch.exp(logp - old), adv[:, None].expand_as(logp)
    per_token = torch.maximum(-a * r, -a * r.clamp(1 - args.eps_low, 1 + args.eps_high))
    if args.dual_clip is not None:
        per_token = torch.where(a < 0, torch.minimum(per_token, -a * args.dual_clip), per_token)
    loss = (per_token * m).sum() / m.sum()
    if args.correction == "token-mask":
        loss = loss + args.mask_kl_coef * ((logp - b.engine_logp) ** 2 * m).sum() / m.sum()
    want = torch.autograd.grad(loss, opt.params)
    clipped = ((r < 1 - args.eps_low) | (r > 1 + args.eps_high)) & (m > 0)
    assert clipped.any() and (not args.dual_clip or ((-a * r > -a * args.dual_clip) & (m > 0)).any())
    for got, w in zip(opt.steps[0], want):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-4)


def test_sampler_temperature_samples_apart_from_the_trainer(monkeypatch, tmp_path, chat):
    """--sampler-temperature 1.5 beside --temperature 1.0 (lab/sampler_trainer.py's mismatch of known size): the
    engine samples at 1.5 and records those log-probs; the snapshot the update trains from, and the correction's
    weights, are of the trainer's distribution at 1.0. The logged gap is theirs, |log p_1.0 - log p_1.5| per token."""
    args, rec, steps = rl_case(monkeypatch, tmp_path, chat, "--sampler-temperature", "1.5")
    assert all(call.kwargs["temperature"] == 1.5 for call in rec["sample"])
    call = rec["update_policy"][0]
    batch, kw = call.args[2], call.kwargs
    model, m = loaded(chat), batch.mask
    trainer = logp_of(model, batch.inputs, batch.targets, 1.0) * m
    sampler = logp_of(model, batch.inputs, batch.targets, 1.5) * m
    torch.testing.assert_close(kw["old_logp"], trainer, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(batch.engine_logp, sampler, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kw["weights"], correction_weights(trainer, sampler, m, "token-tis", 2.0, 0.1),
                               atol=1e-4, rtol=1e-4)
    gap = float(((trainer - sampler).abs() * m).sum() / m.sum())
    assert gap > 1e-2 and steps[0]["logprob_mismatch"] == pytest.approx(gap, rel=1e-3)


@pytest.mark.parametrize("cap", [1.1, 1.5])
def test_cispo_cap_reaches_the_loss(cap):
    """--loss cispo --cispo-cap through update_settings: the gradient handed to the optimizer is that of
    -min(r, cap).detach() A log p, token-mean, with the old log-probs far enough that some weights are capped."""
    args, model, opt, b, old, adv = one_update(["--loss", "cispo", "--cispo-cap", str(cap)])
    logp, m = model(b.inputs, b.targets), b.mask
    r = torch.exp(logp - old).detach()
    assert ((r > cap) & (m > 0)).any()
    loss = (-r.clamp(max=cap) * adv[:, None] * logp * m).sum() / m.sum()
    for got, w in zip(opt.steps[0], torch.autograd.grad(loss, opt.params)):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-4)
