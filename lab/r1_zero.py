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
right answer, 0.1 for a final "#### N" line the verifier can read), no calculator, the same steps and seeds.

    python lab/r1_zero.py --home /work/runs_out/base0   # ~15 min on 2 cores; docs/lab/r1_zero.{json,png}
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
from tokenizer import Tokenizer  # noqa: E402

SHOWN = 3  # held-out answers shown per run, at its start and at its end

p = parser("r1_zero", __doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=None, help="RL steps per start (default: 40; smoke: 2)")
args = p.parse_args()
lab = Lab("r1_zero", args)
base, sft = checkpoint(args.home, "base"), checkpoint(args.home, "sft")
if args.smoke:  # the tiny home of tests/conftest.py: seconds
    steps, nproc, max_new_tokens = args.steps or 2, 1, 24
    size = ["--prompts-per-step", "4", "--group-size", "4", "--eval-problems", "4", "--eval-every", "1",
            "--num-prompts", "64"]
else:  # half the pipeline's prompts per step (32 x 8 answers), on 2 ranks as runs/cpu.sh runs RL
    steps, nproc, max_new_tokens = args.steps or 40, 2, 192
    size = ["--prompts-per-step", "32", "--group-size", "8", "--eval-problems", "100", "--eval-every", "10"]
size += ["--max-new-tokens", max_new_tokens]
REWARD = "verifier+0.1*format"
STARTS = {  # name: (start, prompt format, what the figure calls it)
    "base-plain": (base, "plain", "base, plain prompt (R1-Zero)"),
    "base-chat": (base, "chat", "base, ChatML prompt"),
    "sft": (sft, "chat", "SFT, then GRPO (cold start)"),
}


def grpo(name, init, prompt_format):
    """One GRPO run; per step the accuracy, format rate and answer length of the training answers, and the
    held-out greedy pass@1, format and stop rates at the evaluations."""
    path = lab.run("chat_rl.py", "--init", init, "--prompt-format", prompt_format, "--reward", REWARD, "--steps", steps,
                   "--pass-k", "0", "--save-every", steps, *size, stage="rl", run_name=f"lab-r1-zero-{name}", nproc=nproc)
    rows = lab.metrics(path)
    train = [{"step": r["step"], "accuracy": r["reward/verifier"], "format_rate": r["reward/format"],
              "length": r["length_mean"], "truncated": r["truncated_frac"], "flat_groups": r["flat_group_frac"],
              "kl_to_start": r["kl_to_start"]} for r in rows if "reward" in r]
    heldout = [{"step": r["step"], "pass@1": r["eval/pass@1"], "format_rate": r["eval/format_rate"],
                "stop_rate": r["eval/stop_rate"]} for r in rows if "eval/pass@1" in r]
    return {"init": os.path.relpath(init, args.home), "prompt_format": prompt_format, "run": path, "steps": train,
            "heldout": heldout, "first": {k: train[0][k] for k in ("accuracy", "format_rate", "length")},
            "last": {k: sum(s[k] for s in train[-5:]) / len(train[-5:]) for k in ("accuracy", "format_rate", "length")},
            "answers": {"start": answers_of(init, prompt_format), "end": answers_of(path, prompt_format)}}


def answers_of(run, prompt_format):
    """SHOWN held-out answers at T=1 from a run's latest checkpoint, as its prompts rendered them, graded."""
    folder = resolve_model_path(run)
    tok = Tokenizer.load(folder).with_prompt_format(prompt_format)
    _, rows = rl_rows(None, None, eval_problems=SHOWN, num_prompts=1, seed=7)  # seed 7: not the runs' own
    r = sample(Engine(load_hf(folder), tok), rows, Grader(REWARD, tok), samples_per_prompt=1,
               max_new_tokens=max_new_tokens, seed=1234)
    return [{"prompt": tok.decode(p), "answer": tok.decode(c.tokens), "reward": float(g)}
            for p, c, g in zip(r.prompts, r.completions, r.rewards)]


runs = {name: grpo(name, init, fmt) for name, (init, fmt, _) in STARTS.items()}

fig, axes = figure(2, 2)
for (name, run), color in zip(runs.items(), ("C3", "C1", "C0")):
    label = STARTS[name][2]
    x = [s["step"] for s in run["steps"]]
    for ax, key in zip(axes, ("accuracy", "format_rate", "length")):
        ax.plot(x, [s[key] for s in run["steps"]], ".-", color=color, label=label)
    axes[3].plot([h["step"] for h in run["heldout"]], [h["pass@1"] for h in run["heldout"]], "o-", color=color,
                 label=label)
for ax, (title, ylabel) in zip(axes, (("accuracy of the training answers (T=1)", "verifier accuracy"),
                                      ("format rate of the training answers", "share with a '#### N' line"),
                                      ("answer length", "tokens"),
                                      ("held-out greedy pass@1", "pass@1"))):
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.legend(fontsize=7)
fig.suptitle(f"GRPO with {REWARD}, no calculator: from the base, and from SFT", fontsize=10)
lab.save({"question": "Does GRPO from the base, with an accuracy-plus-format reward, get where SFT-then-GRPO gets?",
          "reward": REWARD, "tools": False, "steps": steps, "runs": runs}, fig)
