"""
Direct preference optimization (DPO): learn from (prompt, chosen, rejected) pairs without a reward model.

DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) shows that the KL-regularized RLHF objective
has a closed-form optimum, so the policy can be trained on preference pairs directly: raise the log-prob
of the chosen answer relative to a frozen reference copy of the starting model, and lower the rejected
one's, through -log sigmoid(beta * margin). The reference stops the model from winning by collapsing
onto short, safe text: every gain is measured from where it started. Variants (--loss), each a few
lines of dpo_loss: ipo (Azar et al. 2023), hinge (SLiC), sigmoid_norm (length-normalized, SimPO's
idea), robust (Chowdhury et al. 2024); and, with their own data handling, orpo (Hong et al. 2024: no
reference, an odds-ratio term added to the SFT loss) and kto (Ethayarajh et al. 2024: single answers
labeled good or bad). --rpo-alpha adds the NLL of the chosen answer (Iterative RPO, Pang et al. 2024).

    python chat_dpo.py                                             # 1 CPU, the embedded world's pairs
    python chat_dpo.py --pairs on-policy                           # pairs sampled from the policy itself
    python chat_dpo.py --data prefs.jsonl --init /models/my-sft --device cuda     # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_dpo.py --data prefs.jsonl --init ...   # N GPUs

The log-prob of a completion is the sum of its tokens' log-probs: prompt + completion rendered by
tokenizer.render_conversation, graded where the mask is 1 after the prompt (the assistant's tokens and
its <|im_end|>). Reference log-probs are computed once before training (--ref precompute; the
policy is the reference at step 0, so no second model is ever loaded) or by a frozen copy kept in
memory (--ref live). --loss kto --data also reads unpaired rows {"prompt", "completion", "label"}.
Writes $NANOPOST_HOME/dpo/<run>/ (checkpoints/, metrics.jsonl, eval.json with the held-out
implicit-reward accuracy, pass@1 of the start and the end on the same problems, and the paired change).
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from chat_sft import sft_example
from common import (AdaptersOff, IGNORE, MetricsLogger, UserError, add_lora_flags, all_gather_objects, all_reduce_dict,
                    all_reduce_max, all_reduce_sum, autocast, check_finite, dist_info, epoch_batch,
                    idle_pass, init_dist, learning_rate, load_model, load_training_state, lora_options, lr_at,
                    make_optimizer, micro_batches, nanopost_home, no_sync, optimizer_step, pack_sequences,
                    peak_memory_mb, print0, print_config, progress, reference_model, resolve_model_path,
                    resume_checkpoint, run_dir, run_main, save_checkpoint, seed_everything, set_lr, unwrap, wrap_model,
                    write_eval)

LOSSES = ("sigmoid", "ipo", "hinge", "sigmoid_norm", "robust", "orpo", "kto")

parser = argparse.ArgumentParser(description="direct preference optimization and its variants")
parser.add_argument("--init", default=None, help="chat model folder or run dir to start from (default: the SFT run)")
parser.add_argument("--run-name", default="default", help="run name: output goes to $NANOPOST_HOME/dpo/<run>")
parser.add_argument("--wandb", metavar="PROJECT", help="also log to this Weights & Biases project (WANDB_MODE=offline: no network)")
parser.add_argument("--device", default="auto")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data", default=None, help="JSONL of {prompt, chosen, rejected} rows (default: the embedded world)")
parser.add_argument("--eval-data", default=None, help="held-out rows of the same form (default: the last 2%% of --data)")
parser.add_argument("--pairs", choices=["embedded", "on-policy"], default="embedded",
                    help="without --data: the world's pairs, or pairs sampled from the policy (a verified-correct vs an incorrect answer)")
parser.add_argument("--num-train", type=int, default=600, help="embedded pairs, or prompts to sample for --pairs on-policy")
parser.add_argument("--num-val", type=int, default=300, help="held-out pairs (embedded test split; else the file's last 2%%)")
parser.add_argument("--samples", type=int, default=4, help="--pairs on-policy: answers sampled per prompt")
parser.add_argument("--temperature", type=float, default=1.0, help="--pairs on-policy: sampling temperature")
parser.add_argument("--max-len", type=int, default=512, help="prompt + completion tokens; completions are cropped to fit")
parser.add_argument("--loss", choices=LOSSES, default="sigmoid")
parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta; ORPO's lambda (weight of the odds-ratio term)")
parser.add_argument("--label-smoothing", type=float, default=0.0, help="sigmoid (cDPO) and robust: the assumed label-flip rate")
parser.add_argument("--rpo-alpha", type=float, default=0.0, help="weight of the NLL of the chosen answer (Iterative RPO); 0: off")
parser.add_argument("--desirable-weight", type=float, default=1.0, help="kto: weight of the good answers' loss")
parser.add_argument("--undesirable-weight", type=float, default=1.0, help="kto: weight of the bad answers' loss")
parser.add_argument("--ref", choices=["precompute", "live"], default="precompute",
                    help="reference log-probs computed once before training, or by a frozen copy of the model")
parser.add_argument("--batch-size", type=int, default=32, help="pairs (kto: answers) per optimizer step, all ranks together")
parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per forward pass (both answers of a pair count)")
parser.add_argument("--grad-checkpointing", action="store_true", help="recompute each block's activations in backward")
parser.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state across ranks (FSDP2)")
parser.add_argument("--dist-timeout", type=float, default=30, help="minutes a rank may wait in a collective")
parser.add_argument("--epochs", type=float, default=1.0)
parser.add_argument("--steps", type=int, default=0, help="optimizer steps (overrides --epochs when > 0)")
parser.add_argument("--lr", type=float, default=None, help="default: 2e-5 on the embedded world (2e-4 took pass@1 from 0.60 to 0.33), 5e-7 for a real model")
parser.add_argument("--warmup-steps", type=int, default=3)
parser.add_argument("--final-lr-ratio", type=float, default=0.1)
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out pair evaluations")
parser.add_argument("--eval-problems", type=int, default=500, help="embedded-world held-out problems sampled greedily at the start and the end (0: none)")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--tools", action="store_true", help="evaluate pass@1 with the calculator offered (as chat_rl.py --tools)")
parser.add_argument("--save-every", type=int, default=200)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--compile", action="store_true")
add_lora_flags(parser)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets


# ------------------------------------------------------------------------------------------------
# The losses: per pair (or per answer for KTO), on log-probs summed over each completion's tokens

def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None):
    """-> (losses, chosen_rewards, rejected_rewards), each (B,). The rewards are DPO's implicit rewards
    beta * (log pi - log pi_ref) of each completion, detached, for logging.

    Example, sigmoid: margins +1.40 / -0.20 / -2.60 (already right / near tie / backwards)
    lose 0.6256 / 0.7032 / 0.8316 at beta 0.1, with |d loss / d margin| = beta * sigmoid(-beta * margin)
    = 0.0465 / 0.0505 / 0.0565: all near log 2, the backwards pair barely pushed harder. At beta 0.5:
    0.4032 / 0.7444 / 1.5410 and 0.1659 / 0.2625 / 0.3929: the backwards pair pushed 2.4x harder than the right
    one (1.2x at beta 0.1), and 8.4x harder than the right one at beta 0.1."""
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    margin = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type == "sigmoid":  # DPO; label_smoothing > 0 is conservative DPO (cDPO): eps of the labels flipped
        losses = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    elif loss_type == "robust":  # an unbiased estimate of the clean loss under flip rate eps
        if not 0 <= eps < 0.5:
            raise ValueError(f"robust needs 0 <= label_smoothing < 0.5, got {eps}")
        losses = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    elif loss_type == "hinge":  # SLiC: no loss once beta * margin passes 1
        losses = F.relu(1 - beta * margin)
    elif loss_type in ("ipo", "sigmoid_norm"):  # on length-averaged log-probs, so long answers don't dominate
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"{loss_type} needs chosen_lengths and rejected_lengths")
        norm_margin = chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths
        if loss_type == "ipo":  # a squared error to a target margin 1/(2 beta): never pushes past it
            losses = (norm_margin - 1 / (2 * beta)) ** 2
        else:  # beta acts on a per-token margin here: Tulu 3 used beta = 5
            losses = -F.logsigmoid(beta * norm_margin)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; one of {LOSSES[:5]}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def orpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_lengths, rejected_lengths, beta=0.1):
    """ORPO's odds-ratio term (added to the chosen answer's NLL by the training loop; no reference).
    odds(y) = p / (1 - p) with p the length-averaged probability exp(mean token log-prob);
    loss = -beta * log sigmoid(log odds(chosen) - log odds(rejected)).
    Worked point: mean log-probs -0.5 and -1.0 give log odds 0.43275 and -0.54132, loss 0.1 * 0.32031."""
    avg_c = (policy_chosen_logps / chosen_lengths).clamp(max=-1e-6)  # p < 1, so log(1 - p) is finite
    avg_r = (policy_rejected_logps / rejected_lengths).clamp(max=-1e-6)
    log_odds = (avg_c - torch.log(-torch.expm1(avg_c))) - (avg_r - torch.log(-torch.expm1(avg_r)))
    return -beta * F.logsigmoid(log_odds), beta * avg_c.detach(), beta * avg_r.detach()


def kto_loss(policy_logps, ref_logps, desirable, kl, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    """KTO on single answers labeled good (desirable) or bad: a good answer's reward
    beta * (log-ratio) should rise above the reference point beta * kl, a bad one's fall below it.
    kl: the batch's KL estimate (mean log-ratio of mismatched prompt/answer pairs, clamped at 0, detached).
    -> (losses, rewards). Worked point: log-ratio +0.5, kl 0.1, beta 0.1: good 1 - sigmoid(0.04) = 0.49000."""
    logratios = policy_logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, good, bad), beta * logratios.detach()


# ------------------------------------------------------------------------------------------------
# One micro-batch of each loss family: its share of the global batch's loss, and statistics summed over
# it (TRL's names). Each loss term is divided by its global count (pairs, answers or tokens of the whole
# step, every micro-batch and rank), so accumulation and DDP give the one-batch gradient (common.py).

def pair_stats(chosen_logps, rejected_logps, chosen_rewards, rejected_rewards):
    return {"rewards/chosen": chosen_rewards.sum().item(), "rewards/rejected": rejected_rewards.sum().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).sum().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).sum().item(),
            "logps/chosen": chosen_logps.detach().sum().item(), "logps/rejected": rejected_logps.detach().sum().item()}


def dpo_micro_loss(model, pairs, ref, *, pad_id, capacity, pairs_per_step, chosen_tokens_per_step, beta, loss_type,
                   label_smoothing=0.0, rpo_alpha=0.0):
    """DPO and its reference-based variants on a micro-batch of pairs; ref: (n, 2) reference log-probs.
    rpo_alpha adds the chosen answers' NLL, per chosen token of the step (Iterative RPO)."""
    logps, lengths = completion_logps(model, [e for pair in pairs for e in pair[:2]], pad_id, "packed", capacity)
    chosen, rejected = logps[0::2], logps[1::2]
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=beta,
                                                        loss_type=loss_type, label_smoothing=label_smoothing,
                                                        chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])
    loss = losses.sum() / pairs_per_step
    if rpo_alpha:
        loss = loss - rpo_alpha * chosen.sum() / chosen_tokens_per_step
    return loss, pair_stats(chosen, rejected, chosen_rewards, rejected_rewards)


def orpo_micro_loss(model, pairs, *, pad_id, capacity, pairs_per_step, chosen_tokens_per_step, beta):
    """ORPO: the SFT loss on the chosen answers (per chosen token of the step) plus the odds-ratio term
    (per pair of the step); no reference."""
    logps, lengths = completion_logps(model, [e for pair in pairs for e in pair[:2]], pad_id, "packed", capacity)
    chosen, rejected = logps[0::2], logps[1::2]
    losses, chosen_rewards, rejected_rewards = orpo_loss(chosen, rejected, lengths[0::2], lengths[1::2], beta)
    loss = losses.sum() / pairs_per_step - chosen.sum() / chosen_tokens_per_step
    return loss, pair_stats(chosen, rejected, chosen_rewards, rejected_rewards)


def kto_micro_loss(model, answers, ref, *, pad_id, capacity, answers_per_step, kl, beta, desirable_weight,
                   undesirable_weight):
    """KTO on a micro-batch of single answers (answer example, partner example, desirable); ref: (n, 2)
    reference log-probs of the answers and partners; kl: the step's reference point."""
    logps, _ = completion_logps(model, [a for a, _, _ in answers], pad_id, "packed", capacity)
    good = torch.tensor([g for _, _, g in answers], device=logps.device)
    losses, rewards = kto_loss(logps, ref[:, 0], good, kl, beta, desirable_weight, undesirable_weight)
    g = good.float()
    stats = {"rewards/chosen": (rewards * g).sum().item(), "rewards/rejected": (rewards * (1 - g)).sum().item(),
             "logps/chosen": (logps.detach() * g).sum().item(), "logps/rejected": (logps.detach() * (1 - g)).sum().item(),
             "good": g.sum().item(), "bad": (1 - g).sum().item()}
    return losses.sum() / answers_per_step, stats


# ------------------------------------------------------------------------------------------------
# Sequence log-probs

def completion_logps(model, examples, pad_id, layout="packed", capacity=None):
    """Sum of log-probs over each example's graded targets, and their count: ((N,), (N,)) float32.
    examples are (inputs, targets) with IGNORE on the prompt, laid out right, left or packed
    (common.pack_sequences), all giving the same sums."""
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
    """Log-probs of every example under the reference, computed once before training, in the data's
    order: in eval mode, with no gradient, and without touching the global RNG (trl#5542, #7084), so
    they are the same on every call and however the data is later shuffled. Under torchrun each rank
    computes every world-th chunk (as many passes on every rank: an FSDP2 forward is a collective) and a
    sum all-reduce hands every rank all of them."""
    info = dist_info()
    was_training = model.training
    model.eval()
    out = torch.zeros(len(examples), device=next(model.parameters()).device)
    chunks = list(range(0, len(examples), batch_size))[info.rank::info.world_size]
    with torch.random.fork_rng(devices=[]):
        for c in range(int(all_reduce_max(len(chunks)))):
            if c >= len(chunks):
                idle_pass(model, backward=False)
                continue
            s = chunks[c]
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


def kto_items(tok, singles, max_len):
    """KTO's data: single answers {"prompt", "completion", "label"} (tasks.kto_rows), each with a mismatched
    partner (its prompt, the next answer's completion) whose log-ratio estimates the KL reference point.
    -> (answer example, partner example, desirable)."""
    items, counts = [], {"dropped_prompt_too_long": 0}
    for i, s in enumerate(singles):
        a = completion_example(tok, s["prompt"], s["completion"], s.get("tools"), max_len)
        b = completion_example(tok, s["prompt"], singles[(i + 1) % len(singles)]["completion"], s.get("tools"), max_len)
        if a is None or b is None:
            counts["dropped_prompt_too_long"] += 1
        else:
            items.append((a, b, s["label"]))
    return items, counts


def pairs_of_singles(singles):
    """Held-out pairs from labeled single answers: a good and a bad answer to the same prompt (none when
    the file never answers a prompt both ways; the implicit-reward accuracy is then not measured)."""
    by_prompt = {}
    for s in singles:
        by_prompt.setdefault(json.dumps(s["prompt"]), {}).setdefault(s["label"], s["completion"])
    return [{"prompt": json.loads(p), "chosen": d[True], "rejected": d[False]} for p, d in by_prompt.items() if len(d) == 2]


def on_policy_rows(model, tok, prompt_rows, samples, temperature, max_new_tokens, seed, batch_size=32):
    """Preference pairs from the policy itself: sample `samples` answers per prompt, grade each with the
    row's verifier, pair the first correct one with the first incorrect one. Prompts where all answers
    agree teach nothing and are skipped; answers cut at the length limit are not used. Each rank samples
    its share of the prompts, and every rank gets all the pairs."""
    from engine import Engine
    from rewards import answer_text, verify
    from tokenizer import completion_message
    info = dist_info()
    engine = Engine(unwrap(model), tok)
    rows = []
    with engine.prepared():  # the sampler's weights, once (a collective under FSDP2: every rank calls it)
        outputs = [(s, engine.generate([tok.render_for_completion(r["prompt"]) for r in prompt_rows[s:s + batch_size]],
                                       num_samples=samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                       seed=seed + s))
                   for s in list(range(0, len(prompt_rows), batch_size))[info.rank::info.world_size]]
    for s, outs in outputs:
        chunk = prompt_rows[s:s + batch_size]
        for i, r in enumerate(chunk):
            good, bad = [], []
            for o in outs[i * samples:(i + 1) * samples]:
                if o.finish_reason != "stop":
                    continue
                text = tok.decode(o.tokens[:-1])  # without the final <|im_end|>
                (good if verify(r["verifier"], answer_text(text), r["ground_truth"]) == 1.0 else bad).append(text)
            if good and bad:
                rows.append({"prompt": r["prompt"], "chosen": [completion_message(good[0])],
                             "rejected": [completion_message(bad[0])], "kind": "on-policy"})
    return [row for part in all_gather_objects(rows) for row in part]


# ------------------------------------------------------------------------------------------------
# Held-out evaluation

@torch.no_grad()
def evaluate_pairs(model, items, ref, pad_id, capacity, beta, batch_size=64):
    """Implicit-reward metrics on held-out pairs under TRL's names (accuracy: chosen reward strictly
    above rejected, so 0 at step 0 where every margin is 0). Under torchrun every rank computes its share
    (as many passes on every rank) and the log-probs are summed over ranks."""
    info = dist_info()
    was_training = model.training
    model.eval()
    logps = torch.zeros(len(items), 2, device=next(model.parameters()).device)
    chunks = list(range(0, len(items), batch_size))[info.rank::info.world_size]
    for c in range(int(all_reduce_max(len(chunks)))):
        if c >= len(chunks):
            idle_pass(model, backward=False)
            continue
        chunk = items[chunks[c]:chunks[c] + batch_size]
        lp, _ = completion_logps(model, [e for item in chunk for e in item[:2]], pad_id, "packed", capacity)
        logps[chunks[c]:chunks[c] + len(chunk)] = lp.view(-1, 2)
    model.train(was_training)
    logps = all_reduce_sum(logps).cpu()
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


def main():
    import memory
    from chat_eval import evaluate_chat, paired_change
    from model import load_config
    from tasks import kto_rows, load_kto, load_preferences, overlap_warning, preference_pairs, rl_prompts
    from tokenizer import Tokenizer

    args = parser.parse_args()
    kto, orpo = args.loss == "kto", args.loss == "orpo"
    if args.rpo_alpha and (kto or orpo):
        raise UserError(f"--rpo-alpha adds the chosen answer's NLL to a reference-based pair loss; --loss {args.loss} "
                        f"{'has it already' if orpo else 'has no chosen answer'}")
    if args.ref == "live" and orpo:
        raise UserError("--ref live: ORPO has no reference model")
    # the data first: a malformed row stops the run at once, naming file:line, before any model is looked for
    val_rows = None
    if args.data:
        load = load_kto if kto else load_preferences  # kto also reads unpaired rows
        rows = load(args.data)
        if args.eval_data:
            train_rows, val_rows = rows, load(args.eval_data)
        else:  # a user file: hold out its last 2%
            n_val = max(1, len(rows) // 50)
            train_rows, val_rows = rows[:-n_val], rows[-n_val:]
        if kto:
            val_rows = pairs_of_singles(val_rows)
    else:
        train_rows = preference_pairs("train", args.num_train, seed=args.seed) if args.pairs == "embedded" else None
        val_rows = preference_pairs("test", args.num_val, seed=args.seed)
    dist = init_dist(args.device, args.dist_timeout)
    device = dist.device
    seed_everything(args.seed, dist.rank)
    print_config(args, "chat_dpo")
    if args.data and (warning := overlap_warning(train_rows, val_rows)):  # the held-out rows should be new to training
        print0(warning)
    out_dir = run_dir("dpo", args.run_name)
    log = MetricsLogger(os.path.join(out_dir, "metrics.jsonl"), wandb_project=args.wandb, run_name=f"dpo/{args.run_name}",
                        config=vars(args))
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "sft", "default"))
    tok = Tokenizer.load(init)

    ckpt = resume_checkpoint(out_dir) if args.resume else None
    policy = memory.Shape.of(load_config(init))  # know before you OOM
    memory.check(memory.estimate(trained=[policy], frozen=[policy] * (args.ref == "live" and not orpo and not args.lora_rank),
                                 lora_rank=args.lora_rank,
                                 micro_batch_tokens=args.micro_batch_tokens, world_size=dist.world_size, fsdp=args.fsdp,
                                 cuda=device.type == "cuda", grad_checkpointing=args.grad_checkpointing,
                                 sample_rows=32 * args.samples if args.pairs == "on-policy" else 0,
                                 sample_tokens=args.max_len), device)
    # float32 master weights; under torchrun wrapped in DDP, or sharded with --fsdp
    model = wrap_model(load_model(init, fsdp=args.fsdp, lora=lora_options(args)), fsdp=args.fsdp)
    if args.pairs == "on-policy" and not args.data:  # sampled from the starting policy, before any update
        prompts = rl_prompts("train", args.num_train, seed=args.seed)
        train_rows = on_policy_rows(model, tok, prompts, samples=args.samples, temperature=args.temperature,
                                    max_new_tokens=args.max_new_tokens, seed=args.seed)
        print0(f"on-policy: {len(train_rows)} pairs from {len(prompts)} prompts x {args.samples} samples")
        if not train_rows:
            raise UserError("--pairs on-policy: no prompt had both a correct and an incorrect answer, nothing to "
                            "pair; raise --samples or --temperature")
    if kto and "label" not in train_rows[0]:  # pairs (the embedded world's, or sampled): two labeled answers each
        train_rows = [single for r in train_rows for single in kto_rows(r)]
    items, counts = (kto_items if kto else pair_items)(tok, train_rows, args.max_len)
    val_items, _ = pair_items(tok, val_rows, args.max_len)
    if not items:
        raise UserError(f"no training example fits in --max-len {args.max_len}: {counts}")
    print0(f"data: {len(items)} training {'answers' if kto else 'pairs'}, {len(val_items)} held-out pairs; {counts}"
           + ("" if val_items else " (no held-out pair: the implicit-reward accuracy is not measured)"))

    # the reference: the starting model's log-probs of both completions of every item, computed now
    # (the policy IS the reference at step 0), or a frozen copy (compute dtype) kept for live forwards
    pad, cap = tok.pad_id, args.max_len
    both = lambda its: [e for it in its for e in it[:2]]  # noqa: E731  [a0, b0, a1, b1, ...]
    val_ref = reference_logps(model, both(val_items), pad, cap).view(-1, 2)
    ref_model, ref = None, None
    if orpo:
        pass  # ORPO has no reference in its loss (val_ref serves only the held-out implicit reward)
    elif args.ref == "precompute":
        ref = reference_logps(model, both(items), pad, cap).view(-1, 2)
    else:
        ref_model = reference_model(model, init, args.fsdp)  # LoRA: the policy, adapters off
    start_scores, start_correct = {}, None
    # greedy pass@1 on held-out problems: the embedded world's (a user's pairs have no answer key)
    eval_rows = rl_prompts("test", args.eval_problems) if not args.data else []
    if eval_rows and not ckpt:  # the SFT start, measured the same way as the end (every rank its share)
        start_scores, start_correct = evaluate_chat(model, tok, eval_rows, max_new_tokens=args.max_new_tokens,
                                                    use_tools=args.tools, per_prompt=True)
        print0("start, held-out greedy: " + "  ".join(f"{k} {v:.3f}" for k, v in start_scores.items()))
    if ckpt:
        model = wrap_model(load_model(ckpt, fsdp=args.fsdp, lora=lora_options(args, resume=True)), fsdp=args.fsdp)
        if isinstance(ref_model, AdaptersOff):  # the reloaded policy's adapters off
            ref_model = reference_model(model, init, args.fsdp)
    unwrap(model).grad_checkpointing = args.grad_checkpointing

    per_step = args.batch_size
    if per_step < dist.world_size:
        raise UserError(f"--batch-size {per_step} must be at least the number of ranks ({dist.world_size})")
    steps_per_epoch = math.ceil(len(items) / per_step)
    total_steps = args.steps or max(1, round(args.epochs * steps_per_epoch))
    args.lr = learning_rate(args.lr, "dpo", unwrap(model).config)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    start_step = 0
    if ckpt:
        start_step = load_training_state(ckpt, optimizer, model)["step"]
        print0(f"resumed from {ckpt} at step {start_step}")
    elif dist.is_main and os.path.exists(log.path):
        os.remove(log.path)
    print0(f"model: {unwrap(model).num_params():,} parameters from {init}; loss {args.loss}, beta {args.beta}, ref "
           f"{'none' if orpo else args.ref}; {total_steps} steps ({steps_per_epoch} per epoch)")
    fwd = torch.compile(model) if args.compile else model
    model.train()

    def ref_of(idx):  # (n, 2) reference log-probs of these items
        if ref is not None:
            return ref[idx]
        with torch.no_grad():
            return completion_logps(ref_model, both([items[i] for i in idx]), pad, "packed", cap)[0].view(-1, 2)

    bar = progress(range(start_step, total_steps), initial=start_step, total=total_steps, desc=args.loss)
    for step in bar:
        lr = lr_at(step, total_steps, args.lr, args.warmup_steps, args.final_lr_ratio)
        set_lr(optimizer, lr)
        mine = epoch_batch(len(items), step, per_step, args.seed)[dist.rank::dist.world_size]
        lengths = [len(items[i][0][0]) + (0 if kto else len(items[i][1][0])) for i in mine]
        micros = [[mine[j] for j in part] for part in micro_batches(lengths, args.micro_batch_tokens, packed=True)]
        # the global normalizer of the chosen answers' NLL (ORPO, RPO): their tokens in the whole step
        chosen_tokens = all_reduce_sum(float(sum(sum(t != IGNORE for t in items[i][0][1]) for i in mine)))
        kl = 0.0
        if kto:  # KTO's reference point: the mean log-ratio of mismatched answers over the global batch
            kl_sum = 0.0
            with torch.no_grad():
                for m in micros:
                    if not m:
                        idle_pass(fwd, backward=False)
                        if ref_model is not None:
                            idle_pass(ref_model, backward=False)
                        continue
                    partners = completion_logps(fwd, [items[i][1] for i in m], pad, "packed", cap)[0]
                    kl_sum += (partners - ref_of(m)[:, 1]).sum().item()
            kl = max(0.0, all_reduce_sum(kl_sum) / per_step)
        totals = {"loss": 0.0}
        for j, m in enumerate(micros):
            # DDP sums gradients over ranks only at the last pass of the step (forward and backward)
            with no_sync(model, last=j == len(micros) - 1):
                if not m:  # this rank has nothing left: join the other ranks' collectives, train nothing
                    idle_pass(fwd)
                    if ref_model is not None:
                        idle_pass(ref_model, backward=False)
                    continue
                micro = [items[i] for i in m]
                if kto:
                    loss, stats = kto_micro_loss(fwd, micro, ref_of(m), pad_id=pad, capacity=cap,
                                                 answers_per_step=per_step, kl=kl, beta=args.beta,
                                                 desirable_weight=args.desirable_weight,
                                                 undesirable_weight=args.undesirable_weight)
                elif orpo:
                    loss, stats = orpo_micro_loss(fwd, micro, pad_id=pad, capacity=cap, pairs_per_step=per_step,
                                                  chosen_tokens_per_step=chosen_tokens, beta=args.beta)
                else:
                    loss, stats = dpo_micro_loss(fwd, micro, ref_of(m), pad_id=pad, capacity=cap,
                                                 pairs_per_step=per_step, chosen_tokens_per_step=chosen_tokens,
                                                 beta=args.beta, loss_type=args.loss,
                                                 label_smoothing=args.label_smoothing, rpo_alpha=args.rpo_alpha)
                check_finite(loss, step + 1)
                loss.backward()
            totals["loss"] += loss.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        grad_norm = optimizer_step(model, optimizer, args.grad_clip)
        totals = all_reduce_dict(totals, keys=["loss", *((
            ["rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "good", "bad"]) if kto else
            ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected"])])
        if kto:  # per good answer, per bad answer
            n_good, n_bad = max(totals["good"], 1), max(totals["bad"], 1)
            metrics = {"rewards/chosen": totals["rewards/chosen"] / n_good, "kl": kl,
                       "rewards/rejected": totals["rewards/rejected"] / n_bad,
                       "logps/chosen": totals["logps/chosen"] / n_good, "logps/rejected": totals["logps/rejected"] / n_bad}
        else:  # per pair
            metrics = {k: v / per_step for k, v in totals.items() if k != "loss"}
        metrics = {"loss": round(totals["loss"], 6), **{k: round(v, 5) for k, v in metrics.items()}, "lr": lr,
                   "grad_norm": round(grad_norm, 4), "peak_mem_mb": round(peak_memory_mb(device))}
        if ((step + 1) % args.eval_every == 0 or step + 1 == total_steps) and val_items:
            ev = evaluate_pairs(model, val_items, val_ref, pad, cap, args.beta)
            metrics.update({f"val/{k}": round(v, 4) for k, v in ev.items()})
            if dist.is_main:
                bar.write(f"step {step + 1}: loss {metrics['loss']:.4f}  held-out accuracy {ev['pair_accuracy']:.3f}  "
                          f"margin {ev['rewards/margins']:.3f}  logps/chosen {ev['logps/chosen']:.2f}")
        log.log(step + 1, **metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == total_steps:
            save_checkpoint(out_dir, step + 1, model, tok, optimizer, {"run_config": vars(args)})

    # held-out, every rank its share: the implicit-reward metrics, and greedy pass@1 before and after
    ev = evaluate_pairs(model, val_items, val_ref, pad, cap, args.beta) if val_items else {}
    if eval_rows:
        scores, correct = evaluate_chat(model, tok, eval_rows, max_new_tokens=args.max_new_tokens, use_tools=args.tools,
                                        per_prompt=True)
        ev.update(scores)
        if start_correct is not None:  # the same problems before and after: the change and its error
            ev["pass@1_change"], ev["pass@1_change_se"] = paired_change(start_correct, correct)
    ev.update({f"start/{k}": v for k, v in start_scores.items() if k in ("pass@1", "format_rate", "stop_rate", "tool_use_rate")})
    ev["peak_memory_mb"] = peak_memory_mb(device)
    ev["ref"] = "none" if orpo else args.ref
    print0("held-out: " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in ev.items()))
    log.log(total_steps, **{f"final/{k}": v for k, v in ev.items()})
    if dist.is_main:
        write_eval(out_dir, ev)
    log.close()


if __name__ == "__main__":
    run_main(main)
