"""
Training data from a model's own graded answers: sample k answers per prompt with the engine, grade them, and
keep some as SFT rows (rejection sampling, best-of-n) or pair the best with the worst (preference pairs).
chat_sample.py writes them to files; chat_dpo.py and chat_kto.py sample their pairs with it (--pairs on-policy, or
--pairs judge: judged_pairs, a judge's verdict in both orders).
With tools, an answer is the assistant's turns with their calls and the tool results between them, kept only
where those messages render back to exactly the tokens that were sampled.
"""
import re

from rewards import judge_pairs, load_judge, load_rubric
from rollout import sample
from tokenizer import completion_message, parse_tool_calls

KEEP = ("verified", "best", "all")


# ------------------------------------------------------------------------------------------------
# The rules: which answers of one prompt are kept, and which two make a pair

def keep_answers(rewards, texts, finished, keep="verified", max_per_prompt=1, threshold=1.0):
    """Indices of the answers of one prompt to keep as SFT rows, best first.

    rewards, texts, finished: per answer (finished = ended with a stop token, not cut at the limit).
    Candidates: finished answers (and, for "verified", reward >= threshold), in order of reward, highest
    first, ties in sampling order; a text kept once is skipped after; at most max_per_prompt.
    "best" keeps the top candidates whatever their reward (best-of-n); "all" keeps every candidate.
    Example: rewards [1, 0, 1, 0], texts a b c d, all finished: verified, max 1 -> [0]; verified, max 4
    -> [0, 2]; best, max 1 -> [0]; all, max 4 -> [0, 2, 1, 3]; rewards [0.2, 0.9, 0.5], best -> [1]."""
    if keep not in KEEP:
        raise ValueError(f"unknown keep rule {keep!r}; one of {KEEP}")
    order = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    kept, seen = [], set()
    for i in order:
        if len(kept) == max_per_prompt:
            break
        if not finished[i] or texts[i] in seen or (keep == "verified" and rewards[i] < threshold):
            continue
        kept.append(i)
        seen.add(texts[i])
    return kept


def preference_pair(rewards, texts, finished):
    """(chosen, rejected) indices for one prompt: its first best finished answer against its first worst,
    or None when the finished answers all score alike (or say the same thing).
    Example: rewards [0, 1, 1, 0] -> (1, 0); [1, 1, 1, 1] -> None; [0.3, 0.9, 0.1] -> (1, 2)."""
    done = [i for i in range(len(rewards)) if finished[i]]
    if not done:
        return None
    best = min(done, key=lambda i: (-rewards[i], i))
    worst = min(done, key=lambda i: (rewards[i], i))
    if rewards[best] == rewards[worst] or texts[best] == texts[worst]:
        return None
    return best, worst


def two_to_compare(texts, finished):
    """(i, j) for one prompt: its first two finished answers that say different things, the two a pairwise judge
    compares (chat_sample.py --pairs-judge); None with fewer. Example: texts [a, a, b], all finished -> (0, 2)."""
    done = [i for i in range(len(texts)) if finished[i]]
    second = next((j for j in done if texts[j] != texts[done[0]]), None) if done else None
    return None if second is None else (done[0], second)


# ------------------------------------------------------------------------------------------------
# Sampling

_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def answer_messages(tok, completion) -> list[dict] | None:
    """The messages of a finished answer: one assistant message, or with tools the assistant's turns (text and
    calls) and the tool results the engine fed back between them (its forced tokens, mask 0). None when a
    turn's call does not parse. Example: sampled "<tool_call>...12 * 7...</tool_call><|im_end|>", forced
    "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n", sampled
    "#### 84" -> [assistant (the call), tool "84", assistant "#### 84"]. An answer that stopped at once, no token
    before its <|im_end|>, is one empty assistant message (a bad answer, still an answer: a pair's rejected side)."""
    tokens = completion.tokens[:-1]  # the final <|im_end|> (or another stop id) is the renderer's
    messages, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end < len(tokens) and completion.mask[end] == completion.mask[start]:
            continue
        text = tok.decode(tokens[start:end])
        if completion.mask[start] == 0:  # a forced span: the tool results, as one user turn
            messages += [{"role": "tool", "content": c} for c in _TOOL_RESPONSE.findall(text)]
        elif "<tool_call>" in text:
            try:
                calls = parse_tool_calls(text)
            except ValueError:
                return None
            content = text[:text.index("<tool_call>")].removesuffix("\n")
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        else:
            messages.append(completion_message(text))
        start = end
    return messages or [completion_message("")]


def renders_back(tok, messages, tools, tokens) -> bool:
    """Whether the conversation renders to exactly `tokens` (then the final stop token). A call can parse as
    JSON and still not be a message, e.g. {"name": "", ...}: the renderer refuses it, and so do we."""
    try:
        rendered = tok.render_conversation(messages, tools=tools)[0]
    except ValueError:
        return False
    return rendered[:len(tokens)] == tokens


def sample_groups(engine, rows, grader, *, samples, batch_size, seed, rank=0, world_size=1, **sampling):
    """This rank's share of the prompts, sampled and graded: {prompt index: (rewards, texts, finished,
    messages)}: per answer its text (everything after the prompt, tool results included), whether it ended on
    its own, and its messages, or None where they would not render back to exactly the tokens sampled (a
    call that does not parse, JSON not in the template's form: SFT would train other tokens than these).
    Batch b (prompts b*batch_size ...) goes to rank b % world_size, sampled with seed + b*batch_size, so
    that every prompt's answers are the same on any number of ranks."""
    tok = engine.tokenizer
    groups = {}
    with engine.prepared():  # the sampler's weights, built once for every batch
        for start in range(rank * batch_size, len(rows), world_size * batch_size):
            batch = rows[start:start + batch_size]
            rollouts = sample(engine, batch, grader, samples_per_prompt=samples, seed=seed + start, **sampling)
            for j, row in enumerate(batch):
                answers = rollouts.completions[j * samples:(j + 1) * samples]
                prompt = rollouts.prompts[j * samples]
                messages = []
                for c in answers:
                    m = answer_messages(tok, c) if c.finish_reason == "stop" else None
                    if m is not None and (tools := row.get("tools") or sampling.get("tool_schemas")) and \
                            not renders_back(tok, row["prompt"] + m, tools, prompt + c.tokens):
                        m = None
                    messages.append(m)
                groups[start + j] = (rollouts.rewards[j * samples:(j + 1) * samples].tolist(),
                                     [tok.decode(c.tokens[:-1] if c.finish_reason == "stop" else c.tokens)
                                      for c in answers],
                                     [c.finish_reason == "stop" for c in answers], messages)
    return groups


def build_rows(rows, groups, keep="verified", max_per_prompt=1, threshold=1.0, tools=None):
    """SFT rows and preference pairs from the graded groups, in prompt order, and counts. An answer without
    messages (see sample_groups) is never kept nor paired. `tools`: the schemas the answers were offered."""
    sft, pairs = [], []
    counts = {"prompts": len(groups), "answers": 0, "finished": 0, "verified": 0, "reward_sum": 0.0,
              "prompts_kept": 0, "unrenderable": 0}
    for p in sorted(groups):
        rewards, texts, finished, messages = groups[p]
        row = rows[p]
        schemas = row.get("tools") or tools
        extra = {"tools": schemas} if schemas else {}
        counts["answers"] += len(rewards)
        counts["finished"] += sum(finished)
        counts["unrenderable"] += sum(f and m is None for f, m in zip(finished, messages))
        finished = [f and m is not None for f, m in zip(finished, messages)]
        counts["verified"] += sum(r >= threshold for r in rewards)
        counts["reward_sum"] += sum(rewards)
        kept = keep_answers(rewards, texts, finished, keep, max_per_prompt, threshold)
        counts["prompts_kept"] += bool(kept)
        sft += [{"messages": row["prompt"] + messages[i], **extra, "reward": rewards[i]} for i in kept]
        pair = preference_pair(rewards, texts, finished)
        if pair is not None:
            chosen, rejected = pair
            pairs.append({"prompt": row["prompt"], "chosen": messages[chosen], "rejected": messages[rejected], **extra,
                          "chosen_reward": rewards[chosen], "rejected_reward": rewards[rejected]})
    return sft, pairs, counts


def judged_pairs(rows, groups, judge_path, rubric, tools=None):
    """Preference pairs a judge labelled: per prompt its first two different finished answers (two_to_compare),
    asked in both orders; kept where both verdicts agree, the winner chosen. Returns the pairs and the counts."""
    writable = {p: [f and m is not None for f, m in zip(g[2], g[3])] for p, g in groups.items()}  # as build_rows
    asked = [(p, *ij) for p in sorted(groups) if (ij := two_to_compare(groups[p][1], writable[p])) is not None]
    model, tok = load_judge(judge_path)
    prefs, counts = judge_pairs(model, tok, [rows[p]["prompt"] for p, _, _ in asked],
                                [groups[p][1][i] for p, i, _ in asked], [groups[p][1][j] for p, _, j in asked],
                                load_rubric(rubric))
    pairs = []
    for (p, i, j), pref in zip(asked, prefs):
        if pref in (0.0, 1.0):  # both orders agree
            chosen, rejected = (i, j) if pref == 1.0 else (j, i)
            schemas = rows[p].get("tools") or tools
            pairs.append({"prompt": rows[p]["prompt"], "chosen": groups[p][3][chosen],
                          "rejected": groups[p][3][rejected], **({"tools": schemas} if schemas else {})})
    return pairs, {"asked": len(asked), **counts}
