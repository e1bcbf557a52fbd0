"""
RL from the base, no SFT (DeepSeek-R1-Zero, DeepSeek-AI 2025, https://arxiv.org/abs/2501.12948): GRPO straight
on a pretrained base with a rule-based reward, accuracy plus format, against the usual cold start (SFT, then
the same GRPO). R1-Zero's reasoning format and its long answers emerged from RL alone.

Our base (base_train.py) has read only plain documents, "question\\nsolution" ending at <|endoftext|>, never
ChatML. So it is prompted two ways:
- plain (chat_rl.py --prompt-format plain): "question\\n", as it read its documents. R1-Zero's template is plain
  text too, but an instruction ("A conversation between User and Assistant. ... The reasoning process and
  answer are enclosed within <think> </think> and <answer> </answer> tags ... User: PROMPT. Assistant:") that a
  671B base can follow; ours carries no instruction, and the format rewarded is the "#### N" line its
  pretraining documents end with, not tags it must learn;
- chat: the ChatML prompt every stage uses, tokens this base never saw.
The cold start: the pipeline's SFT run, prompted in ChatML. All three: --reward verifier+0.1*format (1 for a
right answer, 0.1 for a final "#### N" line the verifier can read), GRPO without DAPO's dynamic sampling (as
R1-Zero), no calculator, the same steps and seeds. Then the base (in ChatML) and the SFT run again with the
calculator offered: the one skill RL finds on this world, and one that is in the SFT run's answers, not the base's.

    python lab/r1_zero.py --home /work/runs_out/base0   # ~20 min on 2 cores; docs/lab/r1_zero.{json,png}
    python lab/r1_zero.py --smoke                        # tiny sizes, what tests/test_lab_r1_zero.py runs
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import load_hf, resolve_model_path  # noqa: E402
from data import rl_rows  # noqa: E402
from engine import Engine  # noqa: E402
from labkit import Lab, checkpoint, figure, parser  # noqa: E402
from rewards import Grader  # noqa: E402
from rollout import sample  # noqa: E402
from tasks import CALCULATOR_SCHEMA, TOOLS  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

SHOWN = 3  # held-out answers shown per run, at its start and at its end
SUMMED = ("accuracy", "format_rate", "length", "tool_use")  # averaged over a run's first and last 5 steps

p = parser("r1_zero", __doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=None, help="RL steps per start without the calculator (default: 40; smoke: 2)")
p.add_argument("--tool-steps", type=int, default=20, help="RL steps per start with the calculator (slower steps)")
args = p.parse_args()
lab = Lab("r1_zero", args)
base, sft = checkpoint(args.home, "base"), checkpoint(args.home, "sft")
if args.smoke:  # the tiny home of tests/conftest.py: seconds
    steps, tool_steps, nproc, max_new_tokens = args.steps or 2, 0, 1, 24
    size = ["--prompts-per-step", "4", "--group-size", "4", "--eval-problems", "4", "--eval-every", "1",
            "--num-prompts", "64"]
else:  # half the pipeline's prompts per step (32 x 8 answers), on 2 ranks as runs/cpu.sh runs RL
    steps, tool_steps, nproc, max_new_tokens = args.steps or 40, args.tool_steps, 2, 192
    size = ["--prompts-per-step", "32", "--group-size", "8", "--eval-problems", "100", "--eval-every", "10"]
size += ["--max-new-tokens", max_new_tokens]
REWARD = "verifier+0.1*format"
STARTS = {  # name: (start, prompt format, the calculator offered, what the figure calls it)
    "base-plain": (base, "plain", False, "base, plain prompt (R1-Zero)"),
    "base-chat": (base, "chat", False, "base, ChatML prompt"),
    "sft": (sft, "chat", False, "SFT, then GRPO (cold start)"),
    # the one change of setting: offer the calculator, the one skill RL finds on this world (docs/rl.md), to both
    # starts (ChatML: a plain document has no tools); the tiny smoke vocabulary cannot hold its tools block
    "base-chat-tools": (base, "chat", True, "base, ChatML, calculator"),
    "sft-tools": (sft, "chat", True, "SFT, then GRPO, calculator"),
}
if args.smoke:
    STARTS = {name: start for name, start in STARTS.items() if not start[2]}


def grpo(name, init, prompt_format, tools):
    """One GRPO run, without dynamic sampling as R1-Zero's GRPO (so each step's answers are the policy's own, not
    the groups kept for having mixed rewards): per step the accuracy, format rate and length of the training
    answers, and at the evaluations the held-out greedy pass@1 and the graders' scores at T=1."""
    path = lab.run("chat_rl.py", "--init", init, "--prompt-format", prompt_format, *(["--tools"] if tools else []),
                   "--reward", REWARD, "--no-dynamic-sampling", "--log-kl-to-start", "--steps", tool_steps if tools else steps,
                   "--pass-k", "0", "--save-every", tool_steps if tools else steps, *size, stage="rl",
                   run_name=f"lab-r1-zero-{name}", nproc=nproc)
    rows = lab.metrics(path)
    train = [{"step": r["step"], "accuracy": r["accuracy"], "format_rate": r["reward/format"], "length": r["length_mean"],
              "truncated": r["truncated_frac"], "flat_groups": r["flat_group_frac"], "tool_use": r["tool_use_rate"],
              "kl_to_start": r["kl_to_start"]} for r in rows if "reward" in r]
    heldout = [{"step": r["step"], "pass@1": r["eval/pass@1"], "accuracy_t1": r["eval/reward/verifier"],
                "format_rate_t1": r["eval/reward/format"], "stop_rate": r["eval/stop_rate"]}
               for r in rows if "eval/pass@1" in r]
    first, last = train[:5], train[-5:]
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
    return {"init": os.path.relpath(init, args.home), "prompt_format": prompt_format, "tools": tools, "run": path,
            "steps": train, "heldout": heldout, "first5": {k: mean(first, k) for k in SUMMED},
            "last5": {k: mean(last, k) for k in SUMMED},
            "answers": {"start": answers_of(init, prompt_format, tools), "end": answers_of(path, prompt_format, tools)}}


def answers_of(run, prompt_format, tools):
    """SHOWN held-out answers at T=1 from a run's latest checkpoint, with the prompt as the model saw it, graded."""
    folder = resolve_model_path(run)
    tok = Tokenizer.load(folder).with_prompt_format(prompt_format)
    _, rows = rl_rows(None, None, eval_problems=SHOWN, num_prompts=1, seed=7)  # seed 7: not the runs' own
    r = sample(Engine(load_hf(folder), tok, tools=TOOLS if tools else None), rows, Grader(REWARD, tok),
               samples_per_prompt=1, max_new_tokens=max_new_tokens, seed=1234,
               tool_schemas=[CALCULATOR_SCHEMA] if tools else None)
    return [{"prompt": tok.decode(p), "answer": tok.decode(c.tokens), "reward": float(g)}
            for p, c, g in zip(r.prompts, r.completions, r.rewards)]


runs = {name: grpo(name, init, fmt, tools) for name, (init, fmt, tools, _) in STARTS.items()}

fig, axes = figure(2, 2, height=4.0, layout="constrained")
for (name, run), color in zip(runs.items(), ("C3", "C1", "C0", "C1", "C0")):
    label, style = STARTS[name][3], "--" if run["tools"] else "-"
    x = [s["step"] for s in run["steps"]]
    for ax, key in zip(axes, ("accuracy", "format_rate", "length")):
        ax.plot(x, [s[key] for s in run["steps"]], "." + style, color=color, label=label, markersize=4)
    axes[3].plot([h["step"] for h in run["heldout"]], [h["pass@1"] for h in run["heldout"]], "o" + style, color=color,
                 label=label)
for ax, (title, ylabel) in zip(axes, (("accuracy of each step's answers (T=1)", "verifier accuracy"),
                                      ("format rate of each step's answers", "share with a final '#### N'"),
                                      ("answer length", "tokens (tool results included)"),
                                      ("held-out greedy pass@1", "pass@1"))):
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.legend(fontsize=6)
fig.suptitle(f"GRPO with {REWARD} from the base and from SFT (dashed: the calculator offered)", fontsize=10)
lab.save({"question": "Does GRPO from the base, with an accuracy-plus-format reward, get where SFT-then-GRPO gets?",
          "reward": REWARD, "steps": steps, "tool_steps": tool_steps, "runs": runs}, fig)
