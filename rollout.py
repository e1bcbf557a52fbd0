"""
Rollouts: sample answers on the training device, grade them, and lay them out for training.

Every stage that learns from its own samples (chat_rl.py, chat_ppo.py) does the same three things, and
they live here once:

    rollouts = sample(engine, rows, grader, samples_per_prompt=8, ...)   # generate and grade
    batch = training_batch(rollouts.prompts, rollouts.completions, pad_id, device)   # tensors to train on
    for idx in micro_batches(batch.lengths[mb], max_tokens): ...          # forward passes that fit

`sample` returns every answer with the prompt it answers, its data row and its grade, answer by answer:
nothing is rewritten afterwards, and a subset is a plain selection (`Rollouts.select`). The sampler and
the trainer disagree a little (kernels, precision, batch composition), and off-policy answers were sampled
by older weights: `sampler_correction` corrects for that; `kl_penalty` measures how far the policy moved from a
reference on the tokens it sampled, and `kl_to_start` per answer, as the over-optimization plots do.
"""
import argparse
import collections
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common import (Default, UserError, all_gather_objects, all_reduce_dict, autocast, dist_info, global_mean_var,
                    idle_pass, no_sync, print0)
from packing import IGNORE, micro_batches


def add_sampling_flags(parser):
    """The flags every stage that samples its policy shares (chat_rl.py, chat_ppo.py, chat_distill.py): data,
    steps, sampling, the calculator, the sampler correction, held-out evaluation."""
    parser.add_argument("--data", default=None, help="RL JSONL, or a mixture of files, a.jsonl:0.7,b.jsonl:0.3 "
                        "(default: the embedded world's problems)")
    parser.add_argument("--eval-data", default=None, help="held-out RL JSONL (default with --data: its last 2%%)")
    parser.add_argument("--num-prompts", type=int, default=4000, help="embedded-world training prompts")
    parser.add_argument("--steps", type=int, default=60, help="rollout batches (each followed by optimizer steps)")
    parser.add_argument("--time-budget", type=float, default=0, help="stop after this many seconds of training, "
                        "evaluation excluded (0: off)")
    parser.add_argument("--prompts-per-step", type=int, default=64,
                        help="prompts per rollout batch, all ranks together")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tools", action="store_true", help="offer the calculator: multi-turn tool rollouts")
    parser.add_argument("--max-tool-turns", type=int, default=6)
    parser.add_argument("--correction", choices=CORRECTIONS, default="token-tis", help="for answers the sampler drew "
                        "from another distribution (its numerics, or stale weights): reweight or mask "
                        "(rollout.sampler_correction)")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="the cap of token-tis and sequence-tis; "
                        "sequence-mask keeps [1/cap, cap]")
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems, at most (0: no evaluation)")
    parser.add_argument("--pass-k", type=int, default=4, help="pass@1..k at --temperature, besides greedy pass@1")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per forward pass (padding "
                        "included); bounds activation memory")
    parser.add_argument("--warmup-steps", type=int, default=Default(3), help="at most a tenth of the run unless given")
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--save-every", type=int, default=20)


def add_rollout_flags(parser):
    """The flags of the stages that sample their policy and grade the answers (chat_rl.py, chat_ppo.py):
    add_sampling_flags's, top-k and top-p sampling, the graders, token-mask's threshold."""
    add_sampling_flags(parser)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--reward", default="verifier", help="graders, weighted and summed: verifier (the row's), "
                        "format, rm:PATH, judge:PATH; e.g. verifier+0.1*format (see rewards.py)")
    parser.add_argument("--rubric", default=None, help="the judge's rubric file, with --reward ...judge:PATH (e.g. "
                        "rubrics/flattery.txt)")
    parser.add_argument("--mask-eps", type=float, default=0.1, help="token-mask drops a token whose probabilities "
                        "differ by more than this")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-before-train", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate the starting model at step 0 (verl's val_before_train)")


# chat_rl.py --engine-dtype: the dtype of the sampler's weights and KV cache (None: the compute dtype, what the
# trainer computes in). bfloat16 on CPU makes the sampler's numerics differ from the float32 trainer's on purpose
ENGINE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Rollouts:
    """Answers in prompt-major groups of `group_size` (answers i*G .. i*G+G-1 share a prompt)."""
    rows: list[dict]                 # per answer: the data row it answers
    prompts: list[list[int]]         # per answer: the prompt's token ids (shared lists, not copies)
    completions: list                # per answer: the engine's Completion (tokens, logprobs, mask, ...)
    rewards: torch.Tensor            # (N,) float32: the grade, the weighted sum of the --reward graders
    reward_parts: dict = field(default_factory=dict)  # grader name -> (N,) its own score
    errors: list = field(default_factory=list)        # verifier errors (each scored 0)
    group_size: int = 1
    counts: dict = field(default_factory=dict)        # the graders' counts (code outcomes, missing verdicts)

    def __len__(self):
        return len(self.completions)

    def select(self, answers) -> "Rollouts":
        """The rollouts of these answer indices (whole groups, to keep groups intact)."""
        answers = list(answers)
        return Rollouts([self.rows[i] for i in answers], [self.prompts[i] for i in answers],
                        [self.completions[i] for i in answers], self.rewards[answers],
                        {k: v[answers] for k, v in self.reward_parts.items()}, self.errors, self.group_size,
                        self.counts)

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        first = parts[0]
        return Rollouts([r for p in parts for r in p.rows], [x for p in parts for x in p.prompts],
                        [c for p in parts for c in p.completions], torch.cat([p.rewards for p in parts]),
                        {k: torch.cat([p.reward_parts[k] for p in parts]) for k in first.reward_parts},
                        [e for p in parts for e in p.errors], first.group_size,
                        {k: sum(p.counts.get(k, 0) for p in parts) for k in {k for p in parts for k in p.counts}})

    def stats(self) -> dict:
        """Sums over this rank's answers (divide by the global answer count after an all-reduce). An answer is
        correct when its verifier passed it: the verifier's own score where --reward has a verifier term (so
        that accuracy stays the verifier's beside a reward model: rm:PATH+0*verifier), else a reward >= 1."""
        lengths = [len(c.tokens) for c in self.completions]
        correct = self.reward_parts.get("verifier", self.rewards) >= 1.0
        return {"answers": float(len(lengths)), "length_sum": float(sum(lengths)),
                "length_sum_correct": float(sum(n for n, ok in zip(lengths, correct.tolist()) if ok)),
                "truncated": float(sum(c.finish_reason == "length" for c in self.completions)),
                "tool_answers": float(sum(c.tool_calls > 0 for c in self.completions)),
                "tool_calls": float(sum(c.tool_calls for c in self.completions)),
                "tool_errors": float(sum(c.tool_errors for c in self.completions)),
                "correct": float(correct.sum()), "reward_sum": float(self.rewards.sum()),
                "verifier_errors": float(len(self.errors)),  # answers a verifier raised on, scored 0
                "correct_with_tool": float(sum(bool(ok) and c.tool_calls > 0
                                               for ok, c in zip(correct, self.completions))),
                **{f"reward/{k}": float(v.sum()) for k, v in self.reward_parts.items()},
                **{f"count/{k}": float(v) for k, v in self.counts.items()}, **self.source_stats(correct)}

    def source_stats(self, correct) -> dict:
        """Answers, right answers and reward summed by the source of their rows (data.mixture_rows), for the rows
        that name one: source/<name>/answers, .../correct, .../reward_sum."""
        sums = collections.defaultdict(float)
        for row, ok, reward in zip(self.rows, correct.tolist(), self.rewards.tolist()):
            if "source" in row:
                for key, value in (("answers", 1.0), ("correct", float(ok)), ("reward_sum", reward)):
                    sums[f"source/{row['source']}/{key}"] += value
        return dict(sums)


def rollout_metrics(sums: dict) -> dict:
    """What a sampling stage logs of its rollouts, from Rollouts.stats() summed over ranks: the reward and
    its parts per answer, accuracy, lengths, and the tools' use (per answer; accuracy with and without).
    length_correct and length_wrong: the mean length of the right answers (as accuracy counts them
    them) and of the others, each left out of a step that has none (a mean of nothing is not 0); the length
    bias of per-answer normalization shows in them (Dr. GRPO, arXiv:2503.20783; lab/length_bias.py).
    Example: answers of 10 and 30 tokens right, 50 wrong: length_mean 30, length_correct 20, length_wrong 50."""
    n = sums["answers"]
    with_tool = sums["tool_answers"]
    wrong = n - sums["correct"]
    by_outcome = {**({"length_correct": sums["length_sum_correct"] / sums["correct"]} if sums["correct"] else {}),
                  **({"length_wrong": (sums["length_sum"] - sums["length_sum_correct"]) / wrong} if wrong else {})}
    by_source = {}  # source/<name>/accuracy and .../reward, of the rows that name a source (data.mixture_rows)
    for key in sums:
        if key.startswith("source/") and key.endswith("/answers") and sums[key]:
            prefix = key[:-len("answers")]
            by_source[prefix + "accuracy"] = sums[prefix + "correct"] / sums[key]
            by_source[prefix + "reward"] = sums[prefix + "reward_sum"] / sums[key]
    return {"reward": sums["reward_sum"] / n, "accuracy": sums["correct"] / n, **by_outcome,
            **{k: v / n for k, v in sums.items() if k.startswith("reward/")},
            **{k: v for k, v in sums.items() if k.startswith("count/")},
            "length_mean": sums["length_sum"] / n, "truncated_frac": sums["truncated"] / n,
            "verifier_errors": sums["verifier_errors"],  # answers, not a share
            "tool_use_rate": with_tool / n,             # answers that called a tool
            "tool_turns": sums["tool_calls"] / n,       # tool-calling turns per answer
            "tool_errors": sums["tool_errors"] / n,     # tool results that were errors, per answer
            "accuracy_with_tool": sums["correct_with_tool"] / max(1.0, with_tool),
            "accuracy_without_tool": (sums["correct"] - sums["correct_with_tool"]) / max(1.0, n - with_tool),
            **by_source}

def sample(engine, rows, grader, *, samples_per_prompt, max_new_tokens, temperature=1.0, top_k=None,
           top_p=None, seed=0, tool_schemas=None, max_tool_turns=4) -> Rollouts:
    """Render each row's prompt, sample `samples_per_prompt` answers to each with the engine (tool calls
    run mid-rollout when the engine has tools; their results are forced tokens with mask 0), and grade
    every answer with `grader` (rewards.Grader) in one batched call."""
    tok = engine.tokenizer
    prompt_ids = [tok.render_for_completion(r["prompt"], tools=r.get("tools") or tool_schemas) for r in rows]
    completions = engine.generate(prompt_ids, num_samples=samples_per_prompt, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                  max_tool_turns=max_tool_turns)
    answer_rows = [r for r in rows for _ in range(samples_per_prompt)]
    answer_prompts = [p for p in prompt_ids for _ in range(samples_per_prompt)]
    grades = grader(answer_rows, answer_prompts, completions)
    return Rollouts(answer_rows, answer_prompts, completions, grades.total, grades.parts, grades.errors,
                    samples_per_prompt, grades.counts)


def heldout_rewards(engine, rows, grader, *, seed=0, batch_size=64, **sampling) -> dict:
    """The --reward graders on held-out problems: one answer to each row, sampled as training samples (the
    `sampling` settings of `sample`), graded as a training answer is. Returns {"reward": the mean reward,
    "reward/<grader>": the mean of each grader's own score}: against a learned grader, the proxy (a reward
    model's score) and the gold (a verifier term weighted 0: --reward rm:PATH+0*verifier) on the same
    held-out answers, which pass@1 alone cannot show. Under torchrun every rank grades its share
    (rows[rank::world_size]) and the sums are reduced: every rank must call it."""
    info = dist_info()
    mine = rows[info.rank::info.world_size]
    sums = {"answers": 0.0, "reward": 0.0, **{f"reward/{name}": 0.0 for _, name in grader.terms}}
    with engine.prepared():  # a collective under FSDP2: every rank, even one without rows
        for i in range(0, len(mine), batch_size):
            part = sample(engine, mine[i:i + batch_size], grader, samples_per_prompt=1, seed=seed + i, **sampling)
            sums["answers"] += len(part)
            sums["reward"] += float(part.rewards.sum())
            for name, scores in part.reward_parts.items():
                sums[f"reward/{name}"] += float(scores.sum())
    sums = all_reduce_dict(sums, keys=list(sums))
    n = max(1.0, sums.pop("answers"))
    return {k: v / n for k, v in sums.items()}


def prompts_per_rank(prompts_per_step: int, world_size: int, num_prompts: int) -> int:
    """Each rank's share of a step's prompts; the step must split evenly. A step draws its prompts with
    replacement from the num_prompts there are: more per step than there are repeats prompts within a step,
    which the run says."""
    if prompts_per_step % world_size:
        raise UserError(f"--prompts-per-step {prompts_per_step} must be a multiple of the number of ranks "
                        f"({world_size})")
    if prompts_per_step > num_prompts:
        print0(f"warning: --prompts-per-step {prompts_per_step} with only {num_prompts} training prompts: every step "
               f"draws its prompts with replacement, so each prompt comes ~{prompts_per_step / num_prompts:.1f} times "
               f"a step; lower --prompts-per-step or add prompts")
    return prompts_per_step // world_size


def prompt_length(tok, rows, tool_schemas=None, n=256) -> int:
    """The longest rendered prompt among the first n rows: what a rollout stage sizes its engine and its
    memory estimate for."""
    return max(len(tok.render_for_completion(r["prompt"], tools=r.get("tools") or tool_schemas)) for r in rows[:n])


def draw_prompts(rows, n, *, seed, step, rank, round_=0):
    """n rows drawn with replacement for this rank's share of a step, and the seed to sample their answers
    with: a pure function of (seed, step, round, rank), so a resumed run samples what the uninterrupted one
    would, and ranks draw different prompts."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + round_ * 17 + rank)
    return [rows[i] for i in torch.randint(len(rows), (n,), generator=g).tolist()], int(g.initial_seed()) % 2**31


# ------------------------------------------------------------------------------------------------
# DAPO's sampling side: dynamic sampling and the overlong shaping (chat_rl.py)

def dynamic_sampling(sample_round, need, max_rounds):
    """Groups whose answers all scored the same teach nothing (their advantages are all 0, and with no KL
    term their loss is exactly 0: trl#2703). DAPO samples more instead: sample_round(round, n) returns the
    Rollouts of n prompts' groups; flat groups are dropped and more are sampled, up to max_rounds rounds;
    the last round keeps everything it needs, flat or not, so the batch keeps its shape. A flat group kept so
    must not train: its tokens would enter token-mean's denominator and shrink every other token's step
    (DAPO and verl never train on one): the caller masks them (flat_answers).
    Returns (rollouts of `need` groups, {"groups": groups sampled, "flat": flat groups among them})."""
    kept, have, groups, flat = [], 0, 0, 0
    for round_ in range(max_rounds):
        if have == need:
            break
        rollouts = sample_round(round_, need - have)
        G = rollouts.group_size
        rewards = rollouts.rewards.view(-1, G)
        is_flat = (rewards.max(1).values == rewards.min(1).values).tolist()
        groups += len(is_flat)
        flat += sum(is_flat)
        last = round_ == max_rounds - 1
        keep = [g for g, f in enumerate(is_flat) if last or not f]
        kept.append(rollouts.select([g * G + j for g in keep for j in range(G)]))
        have += len(keep)
    return Rollouts.concat(kept), {"groups": groups, "flat": flat}


def flat_answers(rewards, group_size):
    """(N,) bool: the answers of groups whose rewards are all equal. Example: rewards [1, 0, 1, 1] in groups of 2
    -> [False, False, True, True]."""
    r = rewards.view(-1, group_size)
    return (r.max(1).values == r.min(1).values).repeat_interleave(group_size)


IDLE_PATIENCE = 3  # steps in a row with no gradient before the run says so


def idle_warning(steps: int, ungradable_frac: float) -> str:
    """What a run that learns nothing is told: every group's answers scored alike (so every advantage is 0)."""
    return (f"warning: {steps} steps in a row learned nothing: in every group all answers got the same reward, so "
            f"every advantage is 0 and so is the gradient. {ungradable_frac:.0%} of the answers had no final answer "
            f"the verifier can read (count/ungradable). Try: SFT on answers in the verifier's format first, "
            f"--reward verifier+0.1*format, a larger --group-size or --temperature, or easier prompts")


def overlong_penalty(length, max_len, buffer, penalty=1.0):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linear down to -penalty at max_len."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    return -penalty * min(1.0, (length - (max_len - buffer)) / buffer)


def add_overlong_penalty(rollouts, max_len, buffer, penalty):
    """The soft overlong punishment of each answer (overlong_penalty) added to its reward, and kept as a reward
    part of its own ("overlong"), so that the log shows it beside the graders'."""
    shaping = torch.tensor([overlong_penalty(len(c.tokens), max_len, buffer, penalty) for c in rollouts.completions])
    rollouts.reward_parts["overlong"] = shaping
    rollouts.rewards = rollouts.rewards + shaping

class StaleSampler:
    """Rollouts sampled by older weights than the ones they train: the two departures from on-policy RL
    (chat_rl.py --off-policy, --staleness). sample_step(engine, step) -> (rollouts, counts) draws one step's
    batch with an engine. off_policy: the next step's batch is sampled in a thread, from a snapshot of the
    weights, while this one trains (one update behind). staleness=k: each step samples with a snapshot of
    the weights of k steps back. Called once per step: (rollouts, counts, how many updates behind). A resumed
    run (resumed=True) says what its checkpoint lacks: the older weights its first steps would have sampled with."""

    def __init__(self, engine, sample_step, *, off_policy=False, staleness=0, steps, resumed=False):
        self.engine, self.sample_step, self.off_policy, self.staleness, self.steps = \
            engine, sample_step, off_policy, staleness, steps
        self.snapshots = collections.deque()  # staleness: engines over the weights of the last steps, oldest first
        self.pending = None                   # off_policy: the next step's rollouts, being sampled in a thread
        self.thread = ThreadPoolExecutor(max_workers=1) if off_policy else None
        if resumed:
            print0(f"note: a resumed {'--off-policy' if off_policy else f'--staleness {staleness}'} run samples its "
                   f"first {1 if off_policy else staleness} step(s) with weights fresher than the uninterrupted run "
                   f"would have: its numbers from here differ from that run's")

    def __call__(self, step):
        if self.off_policy:  # this batch was sampled while the last one trained, by the weights before it
            rollouts, counts = self.pending.result() if self.pending is not None else \
                self.sample_step(self.engine, step)
            behind = int(self.pending is not None)
            self.pending = self.thread.submit(self.sample_step, self.engine.snapshot(), step + 1) \
                if step + 1 < self.steps else None
            return rollouts, counts, behind
        self.snapshots.append(self.engine.snapshot())
        if len(self.snapshots) > self.staleness + 1:
            self.snapshots.popleft()
        return (*self.sample_step(self.snapshots[0], step), len(self.snapshots) - 1)

    def close(self):
        if self.thread is not None:
            self.thread.shutdown(wait=True)


@dataclass
class TrainingBatch:
    inputs: torch.Tensor       # (B, T) prompt + answer, right-padded
    targets: torch.Tensor      # (B, T) the next token where the model sampled it, IGNORE elsewhere
    mask: torch.Tensor         # (B, T) float: 1 on the answer tokens the model sampled (the loss mask)
    engine_logp: torch.Tensor  # (B, T) the engine's log-prob of each sampled token, 0 elsewhere
    lengths: torch.Tensor      # (B,) tokens of each row (prompt + answer - 1)


def training_batch(prompts, completions, pad_id, device, mask_truncated=False) -> TrainingBatch:
    """Right-padded tensors of prompt + answer, one row per answer. The loss mask is 1 exactly on the
    answer tokens the model sampled: never the prompt, never a forced tool-result token, never padding;
    targets are IGNORE wherever the mask is 0, so the trainer computes log-probs only where they count.
    mask_truncated: an answer cut at the length limit gives no gradient (DAPO's overlong filtering).
    Example: prompt [5, 6, 7], answer [10, 11, 12, 13] with 11, 12 a forced tool result
        inputs  5  6  7 10 11 12          targets  -  - 10  -  - 13          mask 0 0 1 0 0 1"""
    seqs = [p + c.tokens for p, c in zip(prompts, completions)]
    B, T = len(seqs), max(len(s) for s in seqs) - 1
    x = torch.full((B, T), pad_id, dtype=torch.long)
    y = torch.full((B, T), IGNORE, dtype=torch.long)
    m = torch.zeros(B, T)
    eng = torch.zeros(B, T)
    for b, (s, p, c) in enumerate(zip(seqs, prompts, completions)):
        n, start = len(s) - 1, len(p) - 1  # inputs[start] is the last prompt token: it predicts the answer
        x[b, :n] = torch.tensor(s[:-1])
        if not (mask_truncated and c.finish_reason == "length"):
            m[b, start:n] = torch.tensor(c.mask, dtype=torch.float)
        y[b, :n] = torch.tensor(s[1:]).masked_fill(m[b, :n] == 0, IGNORE)
        eng[b, start:n] = torch.tensor(c.logprobs) * m[b, start:n]
    lengths = torch.tensor([len(s) - 1 for s in seqs])
    return TrainingBatch(x.to(device), y.to(device), m.to(device), eng.to(device), lengths)


# ------------------------------------------------------------------------------------------------
# The update: minibatches of a rollout batch, each in forward passes that fit (chat_rl, chat_ppo, chat_distill)

@dataclass
class Pass:
    """One forward pass of a minibatch: its rows of the batch and the columns they need (the longest one's
    length). Calling it slices a batch tensor to the pass: (B, T) -> (rows, cols), (B,) -> (rows,), None -> None."""
    rows: torch.Tensor
    cols: int

    def __call__(self, t):
        if t is None:
            return None
        return t[self.rows] if t.dim() == 1 else t[self.rows, :self.cols]


@dataclass
class Minibatch:
    """A minibatch of a rollout batch: its rows, and the GLOBAL counts (every pass, every rank) its losses are
    divided by, so that the split into passes and ranks cannot change the gradient (open-instruct#1137)."""
    batch: TrainingBatch
    rows: torch.Tensor
    tokens: float    # loss-mask tokens: token-mean's denominator, and the entropy's, KL's
    answers: float   # answers with a token to train: the per-answer aggregations' denominator

    def passes(self, models, max_tokens):
        """The forward passes of at most max_tokens tokens (padding included), each a Pass. Every rank runs as many
        (each is a collective under DDP and FSDP2): a rank whose rows ran out runs an idle pass of every model,
        training nothing, and yields nothing. DDP sums the gradients over ranks only at the last pass, the rest
        under no_sync; the caller's forward and backward run inside that context (the generator is paused there)."""
        parts = micro_batches(self.batch.lengths[self.rows], max_tokens)
        for j, part in enumerate(parts):
            with contextlib.ExitStack() as stack:
                for model in models:
                    stack.enter_context(no_sync(model, last=j == len(parts) - 1))
                if not part:
                    for model in models:
                        idle_pass(model)
                    continue
                rows = self.rows[part].to(self.batch.mask.device)
                yield Pass(rows, int(self.batch.lengths[self.rows[part]].max()))


def minibatches_of(batch: TrainingBatch, *, step, epochs, count):
    """`epochs` passes over the batch, each cut into `count` minibatches (the same number on every rank), in an
    order drawn from `step` alone (a resumed run draws the same); a minibatch with no token to train on any rank
    is skipped. Example: 6 answers, 2 epochs of 2: the rows of a permutation, [p0 p1 p2] and [p3 p4 p5], twice."""
    order = torch.randperm(len(batch.mask), generator=torch.Generator().manual_seed(step))
    for _ in range(epochs):
        for rows in order.tensor_split(count):
            mask = batch.mask[rows]
            counts = all_reduce_dict({"tokens": float(mask.sum()), "answers": float((mask.sum(-1) > 0).sum())},
                                     keys=("tokens", "answers"))
            if counts["tokens"]:
                yield Minibatch(batch, rows, counts["tokens"], counts["answers"])


# ------------------------------------------------------------------------------------------------
# The clipped surrogate's pieces, one definition each (chat_rl.policy_loss, chat_ppo.ppo_losses)

def importance_ratio(log_ratio):
    """exp(log_ratio), the log-ratio clamped to [-20, 20] first (verl): a token the policy has all but left
    cannot underflow its ratio to 0, nor one it grabbed overflow it. Example: log-ratios -25, 0.1, 30 ->
    2.06e-9, 1.1052, 4.85e8."""
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def clipped_surrogate(ratio, advantages, eps_low, eps_high):
    """PPO's pessimistic per-token loss max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A) = -min(r A, clip(r) A),
    and where the clip binds: the clipped side is the larger loss, so the token gives no gradient. The share of
    such tokens is the clip fraction as verl defines it (pg_clipfrac); CleanRL counts a ratio outside the range
    instead, which also counts tokens whose unclipped side wins. Example, eps 0.2: A = +1, r = 1.5: loss -1.2,
    binds; A = -1, r = 1.5: loss 1.5 (the unclipped side, the gradient flows), out of range but not bound."""
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


CORRECTIONS = ("token-tis", "token-mask", "sequence-tis", "sequence-mask", "none")


def sampler_correction(trainer_logp, engine_logp, mask, kind="token-tis", cap=2.0, eps=0.1):
    """Per-token weights (B, T), detached, that correct for answers sampled by another distribution than
    the trainer's: other numerics (the engine's kernels and precision), or older weights (off-policy).
    The trainer's log-probs are the snapshot taken before the update; only tokens in `mask` count.
      token-tis      min(p_trainer / p_engine, cap) per token: truncated importance sampling
      token-mask     1, or 0 for a token whose probabilities differ by more than eps, |p_trainer - p_engine|
                     > eps (prime-rl's rule, eps 0.1): a disagreement is dropped, not reweighted
      sequence-tis   one weight per answer, min(prod over its tokens of p_trainer / p_engine, cap)
      sequence-mask  1, or 0 for a whole answer whose sequence weight lies outside [1 / cap, cap]
      none           1 everywhere
    Example, one answer with log-probs engine / trainer (-0.50 / -0.52), (-1.20 / -1.15), (-0.05 / -0.08),
    (-3.50 / -2.60), (-0.90 / -1.10): token-tis gives 0.9802, 1.0513, 0.9704, 2.4596 -> 2.0 (the cap), 0.8187
    (product 1.6375); the sequence weight is exp(0.70) = 2.0138 (sequence-tis at cap 2: 2.0; sequence-mask:
    0, the answer dropped); the probability gaps are 0.012, 0.015, 0.028, 0.044, 0.074,
    so token-mask at eps 0.04 drops the 4th and 5th tokens, and at eps 0.1 none."""
    mask = mask.to(trainer_logp.dtype)
    log_ratio = (trainer_logp - engine_logp) * mask
    if kind == "token-tis":
        weights = log_ratio.exp().clamp(max=cap)
    elif kind == "token-mask":
        weights = ((trainer_logp.exp() - engine_logp.exp()).abs() <= eps).to(mask.dtype)
    elif kind in ("sequence-tis", "sequence-mask"):
        seq = log_ratio.sum(-1, keepdim=True).exp()
        if kind == "sequence-tis":
            weights = seq.clamp(max=cap).expand_as(mask)
        else:
            weights = ((seq >= 1 / cap) & (seq <= cap)).to(mask.dtype).expand_as(mask)
    elif kind == "none":
        weights = torch.ones_like(mask)
    else:
        raise ValueError(f"unknown correction {kind!r}; one of {CORRECTIONS}")
    return (weights * mask).detach()


def high_entropy_mask(entropy, mask, top):
    """1 on the `top` fraction of the batch's trained tokens with the highest entropy, every rank's tokens ranked
    together, 0 elsewhere (B, T): Wang et al. 2025, "Beyond the 80/20 Rule" (https://arxiv.org/abs/2506.01939)
    train on the top 20% only, the forking tokens where the policy hesitates between paths. As TRL's
    get_high_entropy_mask (top_entropy_quantile = top): a token is kept when its entropy is >= the (1 - top)
    quantile of all the batch's, linearly interpolated (torch.quantile's rule, written out: torch.quantile
    refuses more than 2^24 values). Example: entropies 0.1, 0.5, 0.9, 2.0, 0.3 at top 0.4: sorted 0.1, 0.3,
    0.5, 0.9, 2.0, the 0.6 quantile at position 0.6 * 4 = 2.4 is 0.5 + 0.4 * (0.9 - 0.5) = 0.66: 0.9 and 2.0 train."""
    mine = entropy[mask.bool()].float().cpu()
    values = torch.cat(all_gather_objects(mine)).sort().values
    if values.numel() == 0:
        return torch.zeros_like(mask)
    pos = (1 - top) * (values.numel() - 1)
    lo = int(pos)
    threshold = values[lo] + (values[min(lo + 1, values.numel() - 1)] - values[lo]) * (pos - lo)
    return ((entropy >= threshold.to(entropy.device)) & mask.bool()).to(mask.dtype)


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token estimators of KL(policy || reference) from tokens sampled by the policy
    (Schulman, "Approximating KL divergence", 2020). With log r = ref_logp - logp:
        k1 = -log r                   unbiased value; its gradient is zero in expectation
        k2 = (log r)^2 / 2            biased value; its gradient is exactly the KL gradient
        k3 = (r - 1) - log r          unbiased, low-variance value; its gradient is that of the
                                      REVERSE KL(reference || policy) (trl#4637)
    So a loss uses k2 (tested against the analytic gradient); k3 is the number to log.
    Example: log p now - log p at the start = +0.20, +0.10, +0.80 over three tokens: k1 = 0.20, 0.10,
    0.80, mean +0.3667."""
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}")


def token_rewards(scores, logp, ref_logp, mask, beta, kind="k1"):
    """Per-token rewards (B, T) and the per-token KL (B, T), OpenRLHF's compute_reward shape:
    -beta * KL(actor || reference) at every answer token, plus the answer's score at its LAST answer
    token (the last position of the mask: found from the mask, never by searching for a pad or eos id).
    k1 = log p_actor - log p_ref is the unbiased per-token KL (it may be negative on a single token). chat_ppo.py's
    rewards, and REINFORCE++'s (chat_rl.py --estimator reinforce++); ref_logp None: no reference, no penalty.
    Worked numbers: score 1.0, k1 = 0.2, 0.1, 0.8 over three tokens, beta 0.1 -> -0.02, -0.01, +0.92."""
    mask = mask.to(logp.dtype)
    kl = kl_penalty(logp, ref_logp, kind) * mask if ref_logp is not None else torch.zeros_like(logp)
    rewards = -beta * kl
    last = mask.size(1) - 1 - mask.flip(1).argmax(1)      # index of each row's last answer token
    has_answer = (mask.sum(1) > 0).to(rewards.dtype)      # a row with no trained token gets nothing
    rewards[torch.arange(mask.size(0)), last] += scores.to(rewards.dtype) * has_answer
    return rewards, kl


def returns_to_go(rewards, mask):
    """Each answer token's return at discount 1: its own reward and every later one of its answer (B, T), 0
    outside the mask (GAE with no critic and lambda 1). Example: rewards -0.02, -0.01, +0.92 -> 0.89, 0.91, 0.92."""
    mask = mask.to(rewards.dtype)
    return (rewards * mask).flip(1).cumsum(1).flip(1) * mask


def whiten(advantages, mask, eps=1e-8):
    """Advantages to mean 0, std 1 over the answer tokens of the global batch (every rank's, so a rank
    with only wrong answers is not told they were average). Zero outside the mask. PPO's, and REINFORCE++'s
    global normalization (population variance; verl's masked_whiten divides by Bessel's).
    Example: A = 0.436389, 0.406725, 0.375500, 0.290000, 0.200000 (gae's example; mean 0.341723,
    std 0.086126) -> +1.0992, +0.7547, +0.3922, -0.6005, -1.6455."""
    mean, var = global_mean_var(advantages, mask)
    return (advantages - mean) * (var + eps) ** -0.5 * mask.to(advantages.dtype)


def kl_to_start(logp, ref_logp, mask):
    """How far the policy that sampled each answer has moved from the start, as Gao et al. 2022 measure it
    (arXiv:2210.10760, whose plots put sqrt(KL) on the x-axis): KL(policy || start) over the whole answer,
    the sum over its sampled tokens of k3 (kl_penalty), an unbiased estimate of the sequence's KL that is
    never negative. (B,); the run logs its mean over answers as kl_to_start. Forced tokens (tool results) and
    padding are outside the mask: the policy never chose them.
    Example: an answer whose three tokens moved by log p - log p_start = +0.20, +0.10, +0.80 has k3 0.018731,
    0.004837, 0.249329: 0.272897; a one-token answer at -0.50 has 0.148721; their mean is 0.210809, sqrt 0.4591.
    (k1 would give 1.10 and -0.50: unbiased too, but a single answer can go negative.)"""
    return (kl_penalty(logp, ref_logp, "k3") * mask).sum(-1)


@torch.no_grad()
def batch_logprobs(model, batch: TrainingBatch, max_tokens, *, temperature=1.0, top_k=None, top_p=None,
                   with_entropy=False):
    """Log-probs (B, T) of every sampled token under `model`, in forward passes of at most max_tokens
    tokens, without gradient: the snapshot of the policy that sampled (the "old" policy of the importance
    ratio) or of a frozen reference. with_entropy also returns each token's entropy (B, T)."""
    logp = torch.zeros_like(batch.mask)
    entropy = torch.zeros_like(batch.mask)
    for idx in micro_batches(batch.lengths, max_tokens):
        if not idx:  # this rank has no rows left: join the other ranks' passes (an FSDP2 forward is a collective)
            idle_pass(model, backward=False)
            continue
        idx_t, cols = torch.tensor(idx, device=batch.mask.device), int(batch.lengths[idx].max())
        with autocast(batch.inputs.device):
            out = model(batch.inputs[idx_t, :cols], batch.targets[idx_t, :cols], temperature=temperature,
                        top_k=top_k, top_p=top_p, with_entropy=with_entropy)
        lp, ent = out if with_entropy else (out, None)
        logp[idx_t, :cols] = lp
        if with_entropy:
            entropy[idx_t, :cols] = ent
    return (logp, entropy) if with_entropy else logp
