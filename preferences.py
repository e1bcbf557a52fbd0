"""
What the preference stages share (chat_dpo.py, chat_kto.py): a completion's summed log-prob, the reference's
log-probs computed once, prompt + completion examples cropped to fit, preference pairs sampled from the
policy itself, and the held-out implicit-reward accuracy.

A completion's log-prob is the sum of its tokens' log-probs: prompt + completion rendered by
tokenizer.render_conversation, graded where the mask is 1 after the prompt (the assistant's tokens and its
<|im_end|>).
"""
import torch

from checkpoint import reference_model
from common import (Default, UserError, all_gather_objects, all_reduce_sum, autocast, dist_info, print0, rank_passes,
                    unwrap)
from engine import Engine
from evaluation import evaluate_chat, paired_change, scores_line
from lora import adapters_off, add_lora_flags
from packing import IGNORE, pack_sequences, sft_example
from rewards import Grader, load_rubric
from rundir import add_run_flags
from sampled_data import build_rows, judged_pairs, sample_groups
from tasks import CALCULATOR_SCHEMA, TOOLS, rl_prompts


def add_preference_flags(parser, stage):
    """The flags DPO and KTO share: sampled pairs, crop, reference, schedule, evaluation."""
    parser.add_argument("--pairs", choices=["embedded", "on-policy", "judge"], default="embedded",
                        help="without --data: the world's pairs, or pairs sampled from the policy (a verified-correct "
                        "vs an incorrect answer; judge: two answers the --judge prefers one of, in both orders)")
    parser.add_argument("--judge", default=None, help="--pairs judge: a judge model folder (or standin:arithmetic, a "
                        "program in its place), grading against --rubric")
    parser.add_argument("--rubric", default=None, help="--pairs judge: the judge's rubric file")
    parser.add_argument("--num-train", type=int, default=600, help="embedded pairs, or prompts to sample for --pairs "
                        "on-policy")
    parser.add_argument("--num-val", type=int, default=300, help="held-out pairs (embedded test split; else the file's "
                        "last 2%%)")
    parser.add_argument("--samples", type=int, default=4, help="--pairs on-policy: answers sampled per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="--pairs on-policy: sampling temperature")
    parser.add_argument("--max-len", type=int, default=512, help="prompt + completion tokens; completions are cropped "
                        "to fit")
    parser.add_argument("--ref", choices=["precompute", "live"], default="precompute",
                        help="reference log-probs computed once before training, or by a frozen copy of the model")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per forward pass")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (overrides --epochs when > 0)")
    parser.add_argument("--warmup-steps", type=int, default=Default(3), help="at most a tenth of the run unless given")
    parser.add_argument("--final-lr-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out pair evaluations")
    parser.add_argument("--eval-problems", type=int, default=500, help="embedded-world held-out problems sampled "
                        "greedily at the start and the end (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tools", action="store_true", help="the calculator offered: in the pass@1 evaluation and in "
                        "--pairs on-policy sampling (as chat_rl.py --tools)")
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--compile", action="store_true")
    add_run_flags(parser, stage)  # --run-name, --seed, --device, --resume, --wandb, --grad-checkpointing, --fsdp, ...
    add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# Sequence log-probs

def completion_logps(model, examples, pad_id, layout="packed", capacity=None):
    """Sum of log-probs over each example's graded targets, and their count: ((N,), (N,)) float32.
    examples are (inputs, targets) with IGNORE on the prompt, laid out right, left or packed
    (packing.pack_sequences), all giving the same sums."""
    ids, docs, tgt, (rows, ends) = pack_sequences([x for x, _ in examples], pad_id, layout, capacity,
                                                  [y for _, y in examples])
    dev = next(model.parameters()).device  # model may be a DDP wrapper: call it, so its hooks see the forward
    with autocast(dev):
        lp = model(ids.to(dev), tgt.to(dev), doc_ids=None if layout == "right" else docs.to(dev))
    sums = torch.stack([lp[r, e + 1 - len(x):e + 1].sum()
                        for (x, _), r, e in zip(examples, rows.tolist(), ends.tolist())])
    counts = torch.tensor([sum(t != IGNORE for t in y) for _, y in examples], dtype=torch.float32, device=dev)
    return sums, counts


@torch.no_grad()
def reference_logps(model, examples, pad_id, capacity, batch_size=64):
    """Log-probs of every example under `model` (the reference's, computed once before training; the held-out
    pairs' in evaluate_pairs), in the data's order: in eval mode, with no gradient, and without touching the
    global RNG (trl#5542, #7084), so they are the same on every call and however the data is later shuffled.
    Under torchrun each rank computes every world-th chunk (as many passes on every rank: an FSDP2 forward is a
    collective) and a sum all-reduce hands every rank all of them."""
    info = dist_info()
    was_training = model.training
    model.eval()
    out = torch.zeros(len(examples), device=next(model.parameters()).device)
    chunks = list(range(0, len(examples), batch_size))[info.rank::info.world_size]
    with torch.random.fork_rng(devices=[]):
        for s in rank_passes(model, chunks):
            out[s:s + batch_size] = completion_logps(model, examples[s:s + batch_size], pad_id, "packed", capacity)[0]
    model.train(was_training)
    return all_reduce_sum(out)


# ------------------------------------------------------------------------------------------------
# Data: prompt + completion, the prompt identical on both sides, completions cropped but never empty

def completion_example(tok, prompt, completion, tools, max_len):
    """(inputs, targets) of prompt + completion with targets only on the completion's mask-1 tokens,
    the completion cropped so that inputs fit in max_len; None when nothing of it fits. The prompt is
    exactly render_for_completion(prompt), the ids the engine samples from."""
    p = tok.render_for_completion(prompt, tools=tools)
    ids, mask = tok.render_conversation(prompt + completion, tools=tools)
    if ids[:len(p)] != p:
        raise ValueError("the prompt does not render as a prefix of prompt + completion")
    mask = [0] * len(p) + mask[len(p):]  # an assistant turn inside the prompt is context, not graded
    ids, mask = ids[:max_len + 1], mask[:max_len + 1]  # inputs are ids[:-1]
    if not any(mask[1:]):
        return None  # the prompt leaves no room: an empty completion would be NaN or 0 (trl#6548)
    return sft_example(ids, mask)


def pair_items(tok, rows, max_len):
    """Rows -> (chosen example, rejected example, kind); both cropped to the same cap. Returns the items
    and the counts of dropped pairs (prompt too long; identical once cropped)."""
    items, counts = [], {"dropped_prompt_too_long": 0, "dropped_identical_after_crop": 0}
    for r in rows:
        c = completion_example(tok, r["prompt"], r["chosen"], r.get("tools"), max_len)
        j = completion_example(tok, r["prompt"], r["rejected"], r.get("tools"), max_len)
        if c is None or j is None:
            counts["dropped_prompt_too_long"] += 1
        elif c == j:
            counts["dropped_identical_after_crop"] += 1
        else:
            items.append((c, j, r.get("kind", "all")))
    return items, counts


def on_policy_rows(model, tok, prompt_rows, *, samples, temperature, max_new_tokens, seed, tools=False, judge=None,
                   rubric=None):
    """Preference pairs from the policy itself: sample `samples` answers per prompt (with the calculator when
    `tools`), grade each with the row's verifier, and pair the first correct finished answer with the first
    incorrect one (sampled_data.preference_pair). Prompts whose answers all agree teach nothing and are
    skipped; answers cut at the length limit are not used. With a `judge` (a path, with its `rubric` file) the
    judge chooses instead: each prompt's first two different answers, asked in both orders, the pair kept where
    the two verdicts agree (sampled_data.judged_pairs; every rank asks it the same, greedily). Each rank samples
    its share of the prompts, and every rank gets all the pairs, in prompt order."""
    info = dist_info()
    schemas = [CALCULATOR_SCHEMA] if tools else None
    engine = Engine(unwrap(model), tok, tools=TOOLS if tools else None)
    groups = sample_groups(engine, prompt_rows, Grader("verifier", tok), samples=samples, batch_size=32,
                           seed=seed, rank=info.rank, world_size=info.world_size, max_new_tokens=max_new_tokens,
                           temperature=temperature, tool_schemas=schemas)
    merged = {p: g for part in all_gather_objects(groups) for p, g in part.items()}
    if judge:
        pairs, counts = judged_pairs(prompt_rows, merged, judge, rubric, schemas)
        print0(f"the judge compared {counts['asked']} pairs in both orders: {counts['inconsistent']} inconsistent, "
               f"{counts['unparseable']} verdicts unreadable; {len(pairs)} kept")
    else:
        _, pairs, _ = build_rows(prompt_rows, merged, tools=schemas)
    return [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"], "kind": "on-policy",
             **({"tools": p["tools"]} if "tools" in p else {})} for p in pairs]


# ------------------------------------------------------------------------------------------------
# Held-out evaluation

@torch.no_grad()
def evaluate_pairs(model, items, ref, pad_id, capacity, beta):
    """Implicit-reward metrics on held-out pairs under TRL's names (accuracy: chosen reward strictly
    above rejected, so 0 at step 0 where every margin is 0). Under torchrun every rank computes its share
    (as many passes on every rank) and the log-probs are summed over ranks."""
    logps = reference_logps(model, both(items), pad_id, capacity, batch_size=128).view(-1, 2).cpu()  # 64 pairs a pass
    chosen, rejected = logps[:, 0], logps[:, 1]
    chosen_rewards, rejected_rewards = beta * (chosen - ref[:, 0].cpu()), beta * (rejected - ref[:, 1].cpu())
    right = (chosen_rewards > rejected_rewards).float()
    m = {"pair_accuracy": right.mean().item(), "rewards/chosen": chosen_rewards.mean().item(),
         "rewards/rejected": rejected_rewards.mean().item(),
         "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
         "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}
    for kind in sorted({k for _, _, k in items}):
        sel = torch.tensor([k == kind for _, _, k in items])
        m[f"accuracy/{kind}"] = right[sel].mean().item()
    return m



# ------------------------------------------------------------------------------------------------
# What DPO's and KTO's loops share

def sampled_pairs(model, tok, *, num_prompts, samples, temperature, max_new_tokens, seed, tools=False, judge=None,
                  rubric=None):
    """--pairs on-policy (or judge): pairs sampled from the starting policy, before any update (on_policy_rows)."""
    prompts = rl_prompts("train", num_prompts, seed=seed)
    rows = on_policy_rows(model, tok, prompts, samples=samples, temperature=temperature,
                          max_new_tokens=max_new_tokens, seed=seed, tools=tools, judge=judge, rubric=rubric)
    print0(f"{'judge' if judge else 'on-policy'}: {len(rows)} pairs from {len(prompts)} prompts x {samples} samples")
    if not rows:
        raise UserError("--pairs judge: the judge preferred no answer in both orders, nothing to pair; raise "
                        "--samples or --temperature" if judge else "--pairs on-policy: no prompt had both a correct "
                        "and an incorrect answer, nothing to pair; raise --samples or --temperature")
    return rows


def check_pair_flags(args):
    """--pairs judge needs its --judge and --rubric, and they mean nothing without it."""
    if args.pairs == "judge" and not (args.judge and args.rubric):
        raise UserError("--pairs judge asks a --judge (a model folder, or standin:arithmetic) against a --rubric FILE: "
                        "pass both")
    if args.pairs != "judge" and (args.judge or args.rubric):
        raise UserError("--judge and --rubric label --pairs judge's pairs: add --pairs judge")
    if args.rubric:
        load_rubric(args.rubric)  # a missing or malformed rubric stops the run now, not after the sampling


def both(items):
    """The two examples of every item, flat: [a0, b0, a1, b1, ...]."""
    return [e for it in items for e in it[:2]]


def reference_of(idx, items, ref, ref_model, pad_id, capacity):
    """(n, 2) reference log-probs of items[idx]: precomputed (ref), or by the frozen copy (ref_model; a LoRA
    policy with its adapters off)."""
    if ref is not None:
        return ref[idx]
    with torch.no_grad(), adapters_off(ref_model):
        return completion_logps(ref_model, both([items[i] for i in idx]), pad_id, "packed", capacity)[0].view(-1, 2)


def pair_references(model, items, val_items, *, ref, init, fsdp, lora, pad_id, capacity):
    """The reference, as (held-out [n_val, 2], training [n, 2] or None, frozen model or None). The starting
    policy's log-probs of both answers of every held-out item are computed now (the policy IS the reference
    at step 0). ref "precompute": the training items' too; "live": a frozen copy kept for live forwards
    (checkpoint.reference_model: with LoRA settings `lora`, the policy itself with its adapters off); "none"
    (ORPO): only the held-out implicit reward has one."""
    val_ref = reference_logps(model, both(val_items), pad_id, capacity).view(-1, 2)
    if ref == "precompute":
        return val_ref, reference_logps(model, both(items), pad_id, capacity).view(-1, 2), None
    return val_ref, None, reference_model(model, init, fsdp, lora) if ref == "live" else None


def pass_at_start(model, tok, rows, *, max_new_tokens, tools):
    """Greedy pass@1 on the held-out problems at the start, measured as final_scores measures the end
    (every rank its share): (scores, per-problem correct), or ({}, None) without problems."""
    if not rows:
        return {}, None
    start = evaluate_chat(model, tok, rows, max_new_tokens=max_new_tokens, use_tools=tools, per_prompt=True)
    print0("start, held-out greedy: " + scores_line(start[0], len(rows)))
    return start


def pair_eval_line(step, loss, ev):
    """The line a loop prints after evaluate_pairs."""
    return (f"step {step}: loss {loss:.4f}  held-out accuracy {ev['pair_accuracy']:.3f}  "
            f"margin {ev['rewards/margins']:.3f}  logps/chosen {ev['logps/chosen']:.2f}")


def final_scores(model, tok, val_items, val_ref, eval_rows, start, *, pad_id, capacity, beta, max_new_tokens, tools):
    """The end of a run, every rank its share: the implicit-reward metrics on the held-out pairs, and greedy
    pass@1 before and after on the held-out problems; both printed."""
    ev = evaluate_pairs(model, val_items, val_ref, pad_id, capacity, beta) if val_items else {}
    print0("held-out pairs: " + scores_line(ev, len(val_items)))
    if eval_rows:  # start = (scores, per-problem correct) at the start of the run (({}, None) when resumed)
        scores, correct = evaluate_chat(model, tok, eval_rows, max_new_tokens=max_new_tokens, use_tools=tools,
                                        per_prompt=True)
        start_scores, start_correct = start
        if start_correct is not None:  # the same problems before and after: the change and its error
            scores["pass@1_change"], scores["pass@1_change_se"] = paired_change(start_correct, correct)
        keep = ("pass@1", "format_rate", "stop_rate", "tool_use_rate")
        scores.update({f"start/{k}": v for k, v in start_scores.items() if k in keep})
        print0("held-out problems: " + scores_line(scores, len(eval_rows)))
        ev.update(scores)
    return ev
