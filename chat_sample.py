"""
Sample and filter: rejection sampling and best-of-n, to turn a model's own graded answers into training data.

For every prompt, sample k answers from a checkpoint with the engine, grade them all with a verifier or a
reward model (--reward, as in chat_rl.py), and keep some:

    --keep verified   answers whose reward is at least --threshold (1.0: the verifier says correct); the
                      rejection sampling of Llama 2 / DeepSeek-R1's second SFT round (R1: "rejection
                      sampling on the RL checkpoint", Guo et al. 2025, https://arxiv.org/abs/2501.12948)
    --keep best       best-of-n: the highest-rewarded answers of each prompt, whatever their reward
                      (with a reward model there is no "correct", only better)
    --keep all        every answer (to inspect, or to filter elsewhere)

at most --max-per-prompt per prompt (highest reward first, ties in sampling order; a text already kept
for the prompt is not kept twice). Answers cut at the length limit are never kept: they have no end, and
the SFT loss would teach the model to stop where it was cut off.

    --out FILE         SFT rows {"messages": prompt + answer} that `chat_sft.py --data FILE` trains on; with
                       --tools an answer is the assistant's turns with their calculator calls and the tool
                       results between them, written only where those messages render back to exactly the
                       tokens that were sampled (a call that does not parse is not written)
    --pairs-out FILE   preference pairs {"prompt", "chosen", "rejected"} that `chat_dpo.py --data FILE`
                       trains on: per prompt, its best answer against its worst, only where they differ
                       in reward (a group whose answers all scored alike gives no pair); with
                       --pairs-judge PATH --rubric FILE, a judge model chooses instead: per prompt, its first
                       two different answers, asked in both orders (rewards.judge_pairs), the pair kept only
                       where both verdicts agree (a judge that picks a position, not an answer, is dropped)

Example: 4 answers with rewards [1, 0, 1, 0] (the third a repeat of the first): --keep verified
--max-per-prompt 2 keeps answer 0 only (answer 2 is the same text); --max-per-prompt 1 keeps answer 0;
--keep best keeps answer 0; the pair is (answer 0, answer 1): the first best against the first worst.

    python chat_sample.py --out rs.jsonl                                  # 1 CPU: the RL run, the embedded world
    python chat_sample.py --tools --out rs.jsonl                          # the calculator offered, as RL had it
    python chat_sample.py --init out/sft/default --samples 4 --keep all --pairs-out pairs.jsonl
    python chat_sample.py --init /models/my-rl --data rl.jsonl --device cuda --out rs.jsonl   # 1 GPU
    torchrun --standalone --nproc_per_node=8 chat_sample.py --init ... --data rl.jsonl --out rs.jsonl  # N GPUs
    python chat_sample.py --reward rm:out/rm/default --keep best --out bon.jsonl      # best-of-n by a reward model
    python chat_sample.py --samples 2 --pairs-out p.jsonl --pairs-judge /models/judge --rubric rubric.txt  # AI labels

Prompts: the embedded world's training problems (--num-prompts), or --data FILE.jsonl with chat_rl.py's
rows ({"prompt", "ground_truth", "verifier"}, or verl's). Under torchrun each rank samples its share of
the prompts (whole batches, each with its own seed: the files do not depend on the number of ranks) and
rank 0 writes them in prompt order.
"""
import argparse
import json
import os
import sys

from checkpoint import load_hf, load_tokenizer, resolve_model_path
from common import (UserError, all_gather_objects, check_flag_ranges, init_dist, nanopost_home, print0, print_config,
                    run_main, seed_everything)
from data import load_rl
from engine import Engine
from rewards import Grader, parse_reward
from sampled_data import KEEP, build_rows, judged_pairs, sample_groups
from tasks import CALCULATOR_SCHEMA, TOOLS, rl_prompts

parser = argparse.ArgumentParser(description="sample k answers per prompt, grade them, keep the verified or the best")
parser.add_argument("--init", default=None, help="model folder or run dir to sample from (default: the RL run)")
parser.add_argument("--device", default="auto")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data", default=None,
                    help="RL JSONL of prompts (default: the embedded world's training problems)")
parser.add_argument("--num-prompts", type=int, default=None, help="prompts: the embedded world's first N (default "
                    "1000); with --data, its first N (default all)")
parser.add_argument("--samples", type=int, default=8, help="answers sampled per prompt (k)")
parser.add_argument("--max-new-tokens", type=int, default=192)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--top-k", type=int, default=None)
parser.add_argument("--top-p", type=float, default=None)
parser.add_argument("--reward", default="verifier", help="graders, weighted and summed, as in chat_rl.py: verifier, "
                    "format, rm:PATH, judge:PATH; e.g. verifier+0.1*format (see rewards.py)")
parser.add_argument("--rubric", default=None, help="the judge's rubric file, with --reward ...judge:PATH")
parser.add_argument("--keep", choices=KEEP, default="verified", help="which answers become SFT rows (see above)")
parser.add_argument("--threshold", type=float, default=1.0, help="--keep verified: the least reward kept")
parser.add_argument("--max-per-prompt", type=int, default=1, help="SFT rows per prompt, at most")
parser.add_argument("--out", default=None, help="SFT JSONL to write (chat_sft.py --data)")
parser.add_argument("--pairs-out", default=None, help="preference-pair JSONL to write (chat_dpo.py --data)")
parser.add_argument("--pairs-judge", default=None, help="with --pairs-out and --rubric: a judge model chooses each "
                    "pair's winner, asked in both orders (default: the reward)")
parser.add_argument("--tools", action="store_true", help="offer the calculator: multi-turn answers, written as "
                    "the assistant and tool messages they are")
parser.add_argument("--max-tool-turns", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=32, help="prompts per engine call")
parser.add_argument("--dist-timeout", type=float, default=30, help="minutes a rank may wait in a collective")


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main():

    args = parser.parse_args()
    check_flag_ranges(args, greedy=True)
    # what to write, the reward and the data first: a mistake stops the run before any model is loaded
    if not args.out and not args.pairs_out:
        raise UserError("nothing to write: pass --out FILE (SFT rows) and/or --pairs-out FILE (preference pairs)")
    if args.samples < 1 or args.max_per_prompt < 1:
        raise UserError(f"--samples {args.samples} and --max-per-prompt {args.max_per_prompt} must be at least 1")
    if args.pairs_out and args.samples < 2:
        raise UserError("--pairs-out needs at least 2 --samples per prompt to compare")
    if args.pairs_judge and not (args.pairs_out and args.rubric):
        raise UserError("--pairs-judge labels the pairs of --pairs-out against a --rubric FILE: pass both")
    parse_reward(args.reward)
    if args.data:
        rows = load_rl(args.data)
        rows = rows[:args.num_prompts] if args.num_prompts is not None else rows
    else:
        rows = rl_prompts("train", 1000 if args.num_prompts is None else args.num_prompts, seed=args.seed)
    if not rows:
        raise UserError(f"--num-prompts {args.num_prompts}: no prompt to sample")
    dist = init_dist(args.device, args.dist_timeout)
    seed_everything(args.seed, dist.rank)
    print_config(args, "chat_sample")
    init = resolve_model_path(args.init or os.path.join(nanopost_home(), "rl", "default"), head="lm")
    model, tok = load_hf(init, device=dist.device), load_tokenizer(init)
    grader = Grader(args.reward, tok, dist.device, rubric=args.rubric)
    print0(f"sampling {len(rows)} prompts x {args.samples} answers from {init} on {dist.world_size} rank(s); "
           f"reward {args.reward}")

    schemas = [CALCULATOR_SCHEMA] if args.tools else None
    groups = sample_groups(Engine(model, tok, tools=TOOLS if args.tools else None), rows, grader, samples=args.samples,
                           batch_size=args.batch_size, seed=args.seed * 1_000_003, rank=dist.rank,
                           world_size=dist.world_size, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, tool_schemas=schemas,
                           max_tool_turns=args.max_tool_turns)
    merged = {}
    for part in all_gather_objects(groups):  # every rank's groups; rank 0 writes
        merged.update(part)
    if dist.is_main:
        sft, pairs, c = build_rows(rows, merged, args.keep, args.max_per_prompt, args.threshold, tools=schemas)
        print(f"{c['answers']} answers to {c['prompts']} prompts: mean reward {c['reward_sum'] / c['answers']:.3f}, "
              f"{c['verified'] / c['answers']:.1%} at least {args.threshold:g}, "
              f"{c['finished'] / c['answers']:.1%} finished"
              + (f", {c['unrenderable']} finished answers not written (their messages do not render back to the "
                 f"tokens sampled)" if c["unrenderable"] else ""))
        # an empty file only fails the next stage, with less to go on: say so here
        if args.out and not sft:
            print(f"warning: --out {args.out} gets no row: --keep {args.keep} kept no answer of {c['prompts']} "
                  f"prompts; "
                  f"sample more (--samples, --num-prompts), --keep best, or a stronger --init", file=sys.stderr)
        if args.pairs_judge:  # the pairs a judge chose, in place of the reward's
            pairs, judged = judged_pairs(rows, merged, args.pairs_judge, args.rubric, schemas)
            print(f"the judge compared {judged['asked']} pairs in both orders: {judged['inconsistent']} inconsistent "
                  f"(its verdict followed the position), {judged['unparseable']} verdicts unreadable, "
                  f"{judged['too_long']} too long to ask; {len(pairs)} kept")
        if args.pairs_out and not pairs:
            print(f"warning: --pairs-out {args.pairs_out} gets no pair: no prompt's finished answers differ in reward; "
                  f"sample more (--samples, --num-prompts) or another --reward", file=sys.stderr)
        if args.out:
            write_jsonl(args.out, sft)
            print(f"{len(sft)} SFT rows ({args.keep}, at most {args.max_per_prompt} per prompt; {c['prompts_kept']} "
                  f"of {c['prompts']} prompts kept an answer) -> {args.out}")
        if args.pairs_out:
            write_jsonl(args.pairs_out, pairs)
            how = "chosen by the judge" if args.pairs_judge else "best vs worst, rewards differing"
            print(f"{len(pairs)} preference pairs ({how}) -> {args.pairs_out}")


if __name__ == "__main__":
    run_main(main)
