"""A stage's main() run in this process on a tiny model, with spies on the functions its loop calls: what the
wiring tests (tests/test_wiring_*.py) use to check that a flag reaches what it names. The run is built from a
command line exactly as a user's is (sys.argv, then the stage's own parser and main), so a flag dropped or
swapped at a call site in main fails the test; a spy records every call (its arguments and its result, tensors
copied at that moment) and returns the result unchanged, so the run is the real one.

    calls = spy(monkeypatch, chat_ppo, "gae")                 # chat_ppo.main now calls the spy
    rows = run_stage(monkeypatch, tmp_path, chat_ppo, "--init", folder, "--gamma", "0.9")
    rewards, values, mask = calls[0].args[:3]                 # what main handed gae at step 1

A spy's `before` hook runs before each call with the same arguments; what it returns is kept as the call's
`seen`: a reference computed from the state of the models at that moment (before the optimizer steps)."""
import dataclasses
import functools
import json
import os
import sys
from typing import Any, NamedTuple

import torch

from checkpoint import load_hf
from rewards import Grades

STAGE_DIRS = {"base_train": "base", "chat_sft": "sft", "chat_rm": "rm", "chat_dpo": "dpo", "chat_kto": "kto",
              "chat_rl": "rl", "chat_ppo": "ppo", "chat_distill": "distill"}


class Call(NamedTuple):
    args: tuple
    kwargs: dict
    out: Any
    seen: Any


def snapshot(x):
    """A copy of x as it is now: tensors detached and cloned, containers and dataclasses copied field by
    field; models (and other objects) kept as they are."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(snapshot(v) for v in x) if not hasattr(x, "_fields") else type(x)(*map(snapshot, x))
    if isinstance(x, dict):
        return {k: snapshot(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x)(**{f.name: snapshot(getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x


class Spy:
    def __init__(self, fn, before=None):
        self.fn, self.before, self.calls = fn, before, []

    def __call__(self, *args, **kwargs):
        seen = self.before(*args, **kwargs) if self.before else None
        out = self.fn(*args, **kwargs)
        self.calls.append(Call(snapshot(args), snapshot(kwargs), snapshot(out), seen))
        return out


def spy(monkeypatch, module, name, before=None):
    """Replace module.name by a Spy of it for this test; returns the list its calls are recorded in."""
    s = Spy(getattr(module, name), before)
    monkeypatch.setattr(module, name, s)
    return s.calls


def run_stage(monkeypatch, home, module, *argv):
    """module.main() as `python module.py ARGV` would run it, under $NANOPOST_HOME=home; returns the rows of
    the run's metrics.jsonl (none for a stage that writes no run directory)."""
    monkeypatch.setenv("NANOPOST_HOME", str(home))
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *map(str, argv)])
    module.main()
    run = argv[argv.index("--run-name") + 1] if "--run-name" in argv else "default"
    path = os.path.join(str(home), STAGE_DIRS.get(module.__name__, ""), run, "metrics.jsonl")
    if module.__name__ not in STAGE_DIRS or not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


@functools.lru_cache(maxsize=8)
def loaded(path, head="lm"):
    """The model folder at path, loaded once per test session (a reference: never train or change it)."""
    return load_hf(path, head=head).eval().requires_grad_(False)


def logp_of(model, inputs, targets, temperature=1.0):
    """log p(target) at every position whose target is not IGNORE (0 elsewhere), from the model's logits
    divided by the temperature and a plain log-softmax: the trainer's log-probs written out."""
    with torch.no_grad():
        logits = model(inputs).float() / temperature
    lp = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return torch.where(targets >= 0, lp, 0.0)


def truncated_logp(model, inputs, targets, temperature=1.0, top_k=None, top_p=None):
    """log p(target) under the distribution sampled from, written from its definition, one position at a time:
    logits / temperature; top-k keeps the k most likely tokens; top-p keeps, from the most likely down, each token
    while the tokens above it hold less than top_p of the mass; -inf for a target outside the kept set (a policy
    that moved since it sampled), 0 where the target is IGNORE."""
    with torch.no_grad():
        logits = model(inputs).float() / temperature
    out = torch.zeros(targets.shape)
    for b, t in (targets >= 0).nonzero().tolist():
        row = logits[b, t]
        ranked = sorted(range(row.numel()), key=lambda v: -float(row[v]))
        keep = ranked[:top_k] if top_k else ranked
        if top_p is not None:
            p, mass, kept = row[keep].softmax(-1), 0.0, []
            for v, pv in zip(keep, p.tolist()):
                if mass >= top_p:
                    break
                kept.append(v)
                mass += pv
            keep = kept
        tgt = int(targets[b, t])
        out[b, t] = row[tgt] - torch.logsumexp(row[keep], -1) if tgt in keep else float("-inf")
    return out


def rows_of(batch_inputs, batch_targets, inputs, targets):
    """The rows of a batch that a micro-batch's (inputs, targets) are, found by content (each must be one)."""
    cols = inputs.size(1)
    found = []
    for x, y in zip(inputs, targets):
        same = [b for b in range(batch_inputs.size(0)) if torch.equal(batch_inputs[b, :cols], x)
                and torch.equal(batch_targets[b, :cols], y)]
        assert len(same) == 1, "a micro-batch row matches no row of the batch, or several"
        found.append(same[0])
    return found


# ------------------------------------------------------------------------------------------------
# Stand-ins and references written from the definitions, shared by the wiring tests

class LengthGrader:
    """Stands in for the verifier, which scores a random model's answers 0: the fraction of even token ids, so
    that the scores differ from answer to answer."""
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, rows, prompts, completions):
        return Grades(total=torch.tensor([sum(t % 2 == 0 for t in c.tokens) / max(1, len(c.tokens))
                                          for c in completions]))


def perturbed_reference(real):
    """The reference model, moved away from the actor so that the KL term is not 0."""
    def build(*args, **kwargs):
        ref = real(*args, **kwargs)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        return ref
    return build


def kl_estimate(logp, ref_logp, kind):
    d = ref_logp - logp  # log(p_ref / p) on the sampled tokens
    return {"k1": -d, "k2": d ** 2 / 2, "k3": d.exp() - 1 - d}[kind]


def correction_weights(old, engine, mask, kind, cap, eps):
    """rollout.sampler_correction's definitions, per token: the ratio p_trainer / p_engine truncated at cap,
    or a 0/1 mask; per answer: the product of its tokens' ratios."""
    ratio = torch.exp((old - engine) * mask)
    seq = ratio.prod(-1, keepdim=True).expand_as(mask)
    w = {"token-tis": ratio.clamp(max=cap), "token-mask": ((old.exp() - engine.exp()).abs() <= eps).float(),
         "sequence-tis": seq.clamp(max=cap), "sequence-mask": ((seq >= 1 / cap) & (seq <= cap)).float(),
         "none": torch.ones_like(mask)}[kind]
    return w * mask
