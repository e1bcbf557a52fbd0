"""chat_ppo.py's flags reach what they name. Each case is a real run of main (tests/inprocess.py: one step, a
tiny model, the command line parsed by the stage's parser) with one flag changed from the base command; spies
record what the loop handed each function, and the test recomputes it from the definitions, written out here:
the snapshot's log-probs from the models' logits, the per-token rewards (the score at the last answer token,
-beta x the --kl-kind estimator everywhere), GAE's recursion, whitening, the sampler correction, and the actor's
and critic's losses at every forward pass (the clipped surrogate with the entropy bonus, the clipped value
loss), each divided by the minibatch's answer tokens."""
import math

import pytest
import torch

import chat_ppo
import common
from checkpoint import load_hf, save_hf
from inprocess import (LengthGrader, correction_weights, kl_estimate, loaded, logp_of, perturbed_reference, rows_of,
                       run_stage, spy, truncated_logp)
from model import GPT, GPTConfig

BASE = ["--num-prompts", "8", "--steps", "1", "--prompts-per-step", "2", "--samples-per-prompt", "2",
        "--max-new-tokens", "8", "--eval-problems", "0", "--save-every", "100", "--freeze-actor-steps", "0",
        "--warmup-steps", "0", "--ppo-epochs", "2", "--minibatches", "1", "--micro-batch-tokens", "200",
        "--lr", "1e-2", "--critic-lr", "1e-2", "--seed", "5"]  # seed 5: one of the 4 answers stops, 3 are cut


@pytest.fixture(scope="module")
def folders(tok, tmp_path_factory):
    """A tiny chat model, and a reward model on its trunk whose head is random (the critic starts from it: its
    values are not 0, so GAE and the value clip have something to work on)."""
    root = tmp_path_factory.mktemp("ppo_wiring")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          intermediate_size=64, max_seq_len=512)), str(root / "chat"), tok)
    rm = load_hf(str(root / "chat"), head="scalar")
    torch.manual_seed(1)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    save_hf(rm, str(root / "rm"), tok)
    return str(root / "chat"), str(root / "rm")


def reference_gae(rewards, values, mask, gamma, lam):
    """A_t = delta_t + gamma lam A_next over the answer tokens only (a token outside the mask is skipped, the
    recursion steps over it), delta_t = r_t + gamma V_next - V_t; returns A and A + V, 0 off the mask."""
    adv = torch.zeros_like(values)
    for b in range(values.size(0)):
        next_adv, next_value = 0.0, 0.0
        for t in reversed(range(values.size(1))):
            if mask[b, t] == 0:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            adv[b, t] = next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t]
    return adv, (adv + values) * mask


def expected_losses(args, actor, critic, x, y, m, *, old_logp, old_values, advantages, returns, normalizer, weights):
    """The actor's and the critic's losses on one forward pass, from the definitions: -min(r A, clip(r) A) times
    the sampler weight, minus entropy_coef x the entropy of the sampled-from distribution; 0.5 max((V - R)^2,
    (V_clipped - R)^2); each summed over the answer tokens and divided by the minibatch's (normalizer)."""
    with torch.no_grad():
        logits = actor(x).float() / args.temperature
        logp = torch.where(m > 0, sampled(actor, x, y, args), 0.0)  # -inf: a token the moved policy truncates
        r = torch.exp(logp - old_logp)
        surrogate = torch.maximum(-advantages * r, -advantages * r.clamp(1 - args.eps_low, 1 + args.eps_high))
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        actor_loss = ((surrogate * weights - args.entropy_coef * entropy) * m).sum() / normalizer
        v = critic(x).float()
        errors = (v - returns) ** 2
        if args.value_clip:
            clipped = old_values + (v - old_values).clamp(-args.value_clip, args.value_clip)
            errors = torch.maximum(errors, (clipped - returns) ** 2)
        return actor_loss, (0.5 * errors * m).sum() / normalizer


def ppo_case(monkeypatch, home, folders, *flags, steps=1):
    """One run of chat_ppo.main with the base command and `flags`; what its loop handed each function."""
    chat, rm = folders
    monkeypatch.setattr(chat_ppo, "Grader", LengthGrader)
    monkeypatch.setattr(chat_ppo, "reference_model", perturbed_reference(chat_ppo.reference_model))
    monkeypatch.setitem(common.FLAG_RANGES, "mask_eps", ">= -1")  # -1 drops every token: the flag's effect shows
    argv = ["--init", chat, "--critic-init", rm, *BASE, *flags]
    args = chat_ppo.parser.parse_args(argv)
    rec = {name: spy(monkeypatch, chat_ppo, name) for name in ("sample", "training_batch", "token_rewards", "gae")}
    events = []  # the forward passes and the optimizer steps, in order

    def losses_before(actor, critic, x, y, mask, **kw):
        events.append("pass")
        return expected_losses(args, actor, critic, x, y, mask.float(), **{k: kw[k] for k in (
            "old_logp", "old_values", "advantages", "returns", "normalizer", "weights")})

    rec["ppo_losses"] = spy(monkeypatch, chat_ppo, "ppo_losses", before=losses_before)
    rec["optimizer_step"] = spy(monkeypatch, chat_ppo, "optimizer_step", before=lambda *a, **k: events.append("step"))
    refs = spy(monkeypatch, chat_ppo, "reference_model")
    rows = run_stage(monkeypatch, home, chat_ppo, *argv, "--steps", str(steps))
    return args, rec, events, refs, [r for r in rows if "reward" in r]


def sampled(model, x, y, args):
    """log p of the targets under the distribution sampled from (--temperature, --top-k, --top-p)."""
    if args.top_k or args.top_p:
        return truncated_logp(model, x, y, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return logp_of(model, x, y, args.temperature)


def expected_snapshot(args, folders, rollouts, batch, ref_model):
    """Step 1's snapshot from the definitions: the actor's log-probs (still the --init model) under the distribution
    sampled from, the reference's of its whole distribution at the sampling temperature, the critic's values (the
    --critic-init model), each on the answer tokens."""
    chat, rm = folders
    x, y, m = batch.inputs, batch.targets, batch.mask
    old = sampled(loaded(chat), x, y, args) * m
    ref = logp_of(ref_model, x, y, args.temperature) * m  # untruncated: no infinite KL for a token outside its top-k
    with torch.no_grad():
        values = loaded(rm, "scalar")(x).float() * m
    return old, ref, values


@pytest.mark.parametrize("flags", [
    [], ["--kl-kind", "k2"], ["--kl-kind", "k3"], ["--kl-beta", "0.3"], ["--gamma", "0.9"], ["--lam", "0.5"],
    ["--no-whiten"], ["--value-clip", "0.001"], ["--value-clip", "0"], ["--entropy-coef", "0.1"],
    ["--eps-low", "0.01"], ["--eps-high", "0.01"], ["--truncated-reward", "-0.5"], ["--samples-per-prompt", "3"],
    ["--temperature", "0.7"], ["--top-k", "5"], ["--top-p", "0.5"], ["--max-new-tokens", "6"], ["--tools"],
    ["--max-tool-turns", "2"], ["--prompts-per-step", "3"], ["--grad-clip", "0.5"], ["--tis-cap", "0.5"], ["--correction", "sequence-tis", "--tis-cap", "0.5"],
    ["--correction", "token-mask", "--mask-eps", "-1"],
], ids=lambda f: "_".join(x.lstrip("-") for x in f) or "defaults")
def test_each_flag_reaches_the_rewards_advantages_and_losses(monkeypatch, tmp_path, folders, flags):
    args, rec, events, refs, steps = ppo_case(monkeypatch, tmp_path, folders, *flags)
    rollouts, batch = rec["sample"][0].out, rec["training_batch"][0].out
    S = args.samples_per_prompt
    kw = rec["sample"][0].kwargs  # the sampler: at the sampling flags, with the calculator under --tools
    assert (kw["samples_per_prompt"], kw["max_new_tokens"], kw["max_tool_turns"], kw["temperature"], kw["top_k"],
            kw["top_p"]) == (S, args.max_new_tokens, args.max_tool_turns, args.temperature, args.top_k, args.top_p)
    assert (kw["tool_schemas"] is not None) == args.tools == bool(rec["sample"][0].args[0].tools)
    assert all(c.args[2] == args.grad_clip for c in rec["optimizer_step"])
    assert len(rollouts) == args.prompts_per_step * S                          # --samples-per-prompt answers each
    assert all(rollouts.prompts[i] == rollouts.prompts[i - i % S] for i in range(len(rollouts)))
    m = batch.mask
    old, ref, values = expected_snapshot(args, folders, rollouts, batch, refs[0].out)

    # the rewards: the grade (or --truncated-reward for an answer cut at the limit) at the last answer token,
    # -beta x the estimator of --kl-kind at every answer token
    scores = torch.tensor([args.truncated_reward if args.truncated_reward is not None and c.finish_reason == "length"
                           else float(r) for c, r in zip(rollouts.completions, rollouts.rewards)])
    want_rewards = -args.kl_beta * kl_estimate(old, ref, args.kl_kind) * m
    for b in range(m.size(0)):
        want_rewards[b, int(m[b].nonzero().max())] += scores[b]
    rewards, got_values, got_mask = rec["gae"][0].args[:3]
    torch.testing.assert_close(rewards, want_rewards, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_values, values, atol=1e-5, rtol=1e-4)

    # GAE with --gamma and --lam, then whitened over the answer tokens (--whiten)
    adv, returns = reference_gae(want_rewards, values, m, args.gamma, args.lam)
    if args.whiten:
        on = adv[m > 0]
        adv = (adv - on.mean()) / (on.var(unbiased=False) + 1e-8) ** 0.5 * m
    weights = correction_weights(old, batch.engine_logp, m, args.correction, args.tis_cap, args.mask_eps)

    # every forward pass: its slices of the snapshot, the advantages, the returns and the weights, and the losses
    passes = rec["ppo_losses"]
    assert len(passes) >= 2 * args.ppo_epochs and events.count("step") == 2 * args.ppo_epochs  # critic and actor
    for call in passes:
        x, y = call.args[2], call.args[3]
        i, cols = rows_of(batch.inputs, batch.targets, x, y), x.size(1)
        kw = call.kwargs
        assert kw["normalizer"] == float(m.sum())                         # one minibatch: every answer token
        for name, want in (("old_logp", old), ("old_values", values), ("advantages", adv), ("returns", returns),
                           ("weights", weights)):
            torch.testing.assert_close(kw[name], want[i, :cols], atol=2e-5, rtol=1e-4, msg=name)
        actor_loss, critic_loss = call.seen
        torch.testing.assert_close(call.out[0], actor_loss, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(call.out[1], critic_loss, atol=1e-6, rtol=1e-4)
    # the settings a case is about did act: tokens clipped, values clipped, a sampler correction not all 1
    if "--eps-low" in flags or "--eps-high" in flags:
        assert steps[0]["clip_frac"] > 0
    if "--value-clip" in flags:
        assert (steps[0]["value_clip_frac"] > 0) == (args.value_clip > 0)
    if "--truncated-reward" in flags:
        assert {c.finish_reason for c in rollouts.completions} == {"stop", "length"}
    if {"--temperature", "--top-k", "--top-p"} & set(flags):  # the snapshot is of the distribution sampled from
        assert steps[0]["logprob_mismatch"] < 1e-4


def test_the_adaptive_kl_controllers_beta_is_the_next_steps_penalty(monkeypatch, tmp_path, folders):
    """--kl-target and --kl-horizon: after each step beta <- beta (1 + clip(KL per answer / target - 1, +-0.2)
    x answers / horizon); step 2's per-token rewards carry that beta, not --kl-beta."""
    args, rec, _, _, steps = ppo_case(monkeypatch, tmp_path, folders, "--kl-target", "0.01", "--kl-horizon", "20",
                                      steps=2)
    beta = args.kl_beta
    for step, call in zip(steps, rec["token_rewards"]):
        scores, logp, ref_logp, mask, used_beta, kind = call.args
        assert used_beta == pytest.approx(beta, rel=1e-12)
        kl_per_answer = float((kl_estimate(logp, ref_logp, kind) * mask).sum()) / mask.size(0)
        beta *= 1 + max(-0.2, min(0.2, kl_per_answer / args.kl_target - 1)) * mask.size(0) / args.kl_horizon
        assert step["kl_beta"] == pytest.approx(beta, rel=1e-9)
    assert steps[1]["kl_beta"] != args.kl_beta


@pytest.mark.parametrize("flags, updates", [(["--ppo-epochs", "3"], 3), (["--minibatches", "2"], 4),
                                            (["--ppo-epochs", "3", "--target-kl", "1e-9"], 2)],
                         ids=["ppo-epochs", "minibatches", "target-kl"])
def test_epochs_minibatches_and_target_kl_set_the_updates(monkeypatch, tmp_path, folders, flags, updates):
    """--ppo-epochs passes of --minibatches optimizer steps (each of the critic and of the actor), each minibatch's
    losses divided by its own answer tokens; --target-kl stops the step's updates once the approximate KL to the
    sampling policy exceeds it: the first update sees the sampling policy itself (KL 0), the second one a policy
    moved by a step, and the third is skipped."""
    args, rec, events, _, steps = ppo_case(monkeypatch, tmp_path, folders, *flags)
    assert steps[0]["updates"] == updates and events.count("step") == 2 * updates
    batch = rec["training_batch"][0].out
    groups, current, passes = [], [], iter(rec["ppo_losses"])
    for e in events:  # the passes between two optimizer steps make one minibatch
        if e == "pass":
            current.append(next(passes))
        elif current:
            groups.append(current)
            current = []
    for group in groups:
        rows = [r for call in group for r in rows_of(batch.inputs, batch.targets, call.args[2], call.args[3])]
        assert all(call.kwargs["normalizer"] == float(batch.mask[rows].sum()) for call in group)


@pytest.mark.parametrize("freeze", [0, 1])
def test_freeze_actor_steps_trains_only_the_critic(monkeypatch, tmp_path, folders, freeze):
    _, rec, _, _, _ = ppo_case(monkeypatch, tmp_path, folders, "--freeze-actor-steps", str(freeze))
    actor_steps = [c for c in rec["optimizer_step"] if c.args[0].config.head == "lm"]
    assert len(actor_steps) == (0 if freeze else 2)
    saved = load_hf(str(tmp_path / "ppo" / "default" / "checkpoints" / "step_000001"))
    start = loaded(folders[0])
    same = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), start.state_dict().values()))
    assert same == bool(freeze)


def test_lr_and_critic_lr_are_each_optimizers(monkeypatch, tmp_path, folders):
    """--lr steps the actor, --critic-lr the critic (constant after warmup, PPO's schedule)."""
    lrs = spy(monkeypatch, chat_ppo, "set_lr")
    _, _, _, _, steps = ppo_case(monkeypatch, tmp_path, folders, "--lr", "3e-3", "--critic-lr", "7e-3")
    assert [c.args[1] for c in lrs] == [3e-3, 7e-3] and steps[0]["lr"] == 3e-3
    assert math.isclose(lrs[0].args[0].param_groups[0]["lr"], 3e-3)
