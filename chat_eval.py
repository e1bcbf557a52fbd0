"""
Evaluate a chat checkpoint on held-out problems, compare two runs, draw a run's curves, and gather the
pipeline's report. The metrics (pass@k, format_rate, stop_rate, mean_length) are evaluation.py's: each
held-out RL row is rendered as the prompt RL samples from, completed by the engine, and graded by the
row's verifier.

    python chat_eval.py --model out/sft/default                  # greedy pass@1 on 200 held-out problems
    python chat_eval.py --model PATH --samples 8 --temperature 1.0       # pass@1..8 and maj@8
    python chat_eval.py --model PATH --data my_rl.jsonl          # your own rows, each graded by its verifier
    python chat_eval.py --compare out/rl/a out/rl/b --out cmp.json       # did a change help? (paired)
    python chat_eval.py --plot out/rl/default out/ppo/default --out curves.png   # the runs' curves
    python chat_eval.py --report                                 # every stage's eval.json -> report.json
    python chat_eval.py --report sft/r1 rl/r1 --out r1.json      # these runs' eval.json, one row each
    python chat_eval.py --model out/sft/rs --out out/sft/rs/eval.json   # add pass@1 to a run's eval.json

--compare evaluates both runs on the same held-out problems with the same sampling seeds, one model in
memory at a time, and reports each run's greedy pass@1 and sampled pass@1 (--samples answers per problem
at --temperature) with the paired difference B - A and its standard error (paired_change). Pairing
cancels the problems' own difficulty, and the shared seeds make the two runs draw their samples from the
same random numbers, so the difference is far more precise than two separate evaluations.

--plot draws one panel per metric of each run's metrics.jsonl, the runs overlaid, against training
seconds (`train_seconds`, where every run logs it; the step otherwise). Held-out `eval/*` metrics,
logged every few steps, are drawn as points joined by lines. It needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import math
import os

from checkpoint import load_hf, load_tokenizer, resolve_model_path
from common import UserError, check_flag_ranges, init_dist, nanopost_home, print0, run_main
from data import load_rl
from evaluation import evaluate_chat, paired_change
from tasks import rl_prompts

STAGES = ("base", "sft", "rm", "dpo", "rl", "ppo")


def named_run(name: str) -> str:
    """A run as --report, --compare and --model name it: a path relative to $NANOPOST_HOME (sft/r1, rl/default)
    when there is one there, else the path as given (absolute, or relative to here)."""
    under_home = os.path.join(nanopost_home(), name)
    return under_home if not os.path.isabs(name) and os.path.exists(under_home) else name


def report(run: str = "default", runs: list[str] | None = None, out: str | None = None) -> dict:
    """Gather held-out metrics into a JSON file (default $NANOPOST_HOME/report.json) and print a table.
    Without `runs`: every stage's $NANOPOST_HOME/<stage>/<run>/eval.json, one row per stage. With `runs`:
    those run directories, in order, one row each, named as given; a name relative to $NANOPOST_HOME
    (sft/r1, rl/r1-rs) or any path. A recipe's steps: report(runs=["sft/r1", "rl/r1", "sft/r1-rs"])."""
    if runs:
        paths = {name: os.path.join(named_run(name), "eval.json") for name in runs}
        missing = [name for name, path in paths.items() if not os.path.isfile(path)]
        if missing:
            raise UserError(f"--report: no eval.json in {', '.join(missing)} (under {nanopost_home()}); "
                            f"a finished run writes one")
    else:
        paths = {stage: os.path.join(nanopost_home(), stage, run, "eval.json") for stage in STAGES}
    rep = {}
    for name, path in paths.items():
        if os.path.isfile(path):
            with open(path) as f:
                rep[name] = json.load(f)
    out = out or os.path.join(nanopost_home(), "report.json")
    with open(out, "w") as f:
        json.dump(rep, f, indent=2)
    cols = ["pass@1", "pass@1_t1", "tool_use_rate", "format_rate", "stop_rate", "pair_accuracy"]
    width = max([8, *(len(name) + 2 for name in rep)])
    print(f"{'stage' if not runs else 'run':{width}s}" + "".join(f"{c:>15s}" for c in cols) + "  from")
    for name, m in rep.items():  # from: the run and the checkpoint step each row measures (eval.json's head)
        origin = f"{m['run']} @ step {m['step']}" if "run" in m else "?"
        print(f"{name:{width}s}" + "".join(f"{m[c]:15.3f}" if c in m else f"{'-':>15s}" for c in cols) + f"  {origin}")
    print(f"report -> {out}")
    return rep


# ------------------------------------------------------------------------------------------------
# --compare: two runs on the same problems with the same seeds

def compare_runs(run_a: str, run_b: str, problems: int = 500, samples: int = 4, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, use_tools: bool = False,
                 max_new_tokens: int = 256, device="cpu") -> dict:
    """Greedy pass@1 and sampled pass@1 of two runs on the same `problems` held-out problems, and the
    paired change B - A of each with its standard error. A problem's sampled score is the fraction of its
    `samples` answers that are correct; both runs sample with the same seeds (evaluate_chat's seed=0)."""
    if problems < 2:
        raise UserError(f"--problems {problems}: a paired standard error needs at least 2 problems")
    if samples < 1:
        raise UserError(f"--samples {samples}: need at least 1 sampled answer per problem")
    rows = rl_prompts("test", problems)
    paths = {"a": resolve_model_path(named_run(run_a), "--compare", head="lm"),
             "b": resolve_model_path(named_run(run_b), "--compare", head="lm")}
    greedy, sampled = {}, {}
    for side, path in paths.items():  # one model in memory at a time
        model, tok = load_hf(path, device=device), load_tokenizer(path, "--compare")
        _, correct = evaluate_chat(model, tok, rows, max_new_tokens=max_new_tokens, use_tools=use_tools,
                                   per_prompt=True)
        greedy[side] = [float(c) for c in correct]
        _, correct = evaluate_chat(model, tok, rows, num_samples=samples, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=0, use_tools=use_tools,
                                   per_prompt=True)
        sampled[side] = [c / samples for c in correct]
        del model

    def paired(scores):
        change, se = paired_change(scores["a"], scores["b"])
        return {"a": sum(scores["a"]) / problems, "b": sum(scores["b"]) / problems, "change": change, "se": se}

    return {"run_a": run_a, "run_b": run_b, "model_a": paths["a"], "model_b": paths["b"], "problems": problems,
            "samples": samples, "temperature": temperature, "top_k": top_k, "top_p": top_p, "tools": use_tools,
            "greedy_pass@1": paired(greedy), f"pass@1_t{temperature:g}": paired(sampled)}


def verdict(change: float, se: float) -> str:
    """Read a paired change against its standard error: beyond 2 SE it is unlikely to be noise."""
    if se == 0:
        return "identical answers" if change == 0 else "B differs on every problem alike"
    z = change / se
    return f"{z:+.1f} SE: " + ("within noise" if abs(z) < 2 else "B is better" if z > 0 else "A is better")


def print_comparison(result: dict):
    print(f"{result['problems']} held-out problems, the same sampling seeds for both runs"
          f"{' (calculator offered)' if result['tools'] else ''}")
    print(f"  A = {result['run_a']}  ({result['model_a']})")
    print(f"  B = {result['run_b']}  ({result['model_b']})")
    sampled_key = f"pass@1_t{result['temperature']:g}"
    labels = {"greedy_pass@1": "greedy pass@1",
              sampled_key: f"pass@1 at T={result['temperature']:g} ({result['samples']} samples)"}
    print(f"{'':32s}{'A':>8s}{'B':>8s}{'B - A':>9s}{'SE':>8s}")
    for key, label in labels.items():
        r = result[key]
        print(f"{label:32s}{r['a']:8.3f}{r['b']:8.3f}{r['change']:+9.3f}{r['se']:8.3f}   "
              f"{verdict(r['change'], r['se'])}")


# ------------------------------------------------------------------------------------------------
# --plot: a run's metrics.jsonl as curves

# What an RL run is read from (chat_rl.py and chat_ppo.py log these names); --plot draws those that exist.
PLOT_METRICS = ("reward", "accuracy", "entropy", "length_mean", "clip_frac", "kl", "tool_use_rate",
                "eval/pass@1", "eval/pass@1_t1", "eval/tool_use_rate")
PANEL_INCHES, PLOT_DPI, PLOT_COLUMNS = (4.5, 3.0), 100, 3  # each panel is 450 x 300 pixels


def read_metrics(run: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (a run directory or the file), one per step in step order. Rows
    logged at the same step are merged, the later values winning: a resumed run logs again the steps after
    its checkpoint, and an evaluation may be logged as its own row."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise UserError(f"{run}: no metrics.jsonl; pass a run directory (e.g. out/rl/default) or a metrics.jsonl")
    by_step = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise UserError(f"{path}:{lineno}: not a JSON object (a run killed while writing it?)") from None
            if not isinstance(row, dict) or "step" not in row:
                raise UserError(f"{path}:{lineno}: a metrics row needs a 'step'")
            by_step.setdefault(row["step"], {}).update(row)
    if not by_step:
        raise UserError(f"{path}: no rows")
    return [by_step[step] for step in sorted(by_step)]


def run_label(run: str) -> str:
    """out/rl/default or out/rl/default/metrics.jsonl -> rl/default"""
    folder = os.path.dirname(os.path.abspath(run)) if os.path.isfile(run) else os.path.abspath(run)
    return "/".join(folder.split(os.sep)[-2:])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_runs(runs: list[str], out: str, metrics: list[str] | None = None) -> list[str]:
    """Draw the runs' metrics to a PNG at `out`, one panel per metric (up to 3 panels a row), the runs
    overlaid in the same color on every panel. Returns the metrics drawn. Default metrics: PLOT_METRICS
    that some run logged, or every number logged when none of those was (an SFT or DPO run)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no display, no global state
    except ImportError:
        raise UserError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    data = {}
    for run in runs:
        label = run_label(run)
        data[label if label not in data else run] = read_metrics(run)
    logged = {k for rows in data.values() for row in rows for k, v in row.items() if _is_number(v)}
    if metrics:
        unknown = [m for m in metrics if m not in logged]
        if unknown:
            raise UserError(f"--metrics: {', '.join(unknown)} not logged by these runs; they logged: "
                            f"{', '.join(sorted(logged - {'step', 'time'}))}")
    else:
        metrics = [m for m in PLOT_METRICS if m in logged] or sorted(logged - {"step", "time", "train_seconds"})
    # one x axis for all runs: seconds of training where every run logs them, else the step
    x_key = "train_seconds" if all(any("train_seconds" in row for row in rows) for rows in data.values()) else "step"
    columns = min(PLOT_COLUMNS, len(metrics))
    rows_of_panels = math.ceil(len(metrics) / columns)
    fig = Figure(figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows_of_panels), dpi=PLOT_DPI,
                 layout="constrained")
    axes = list(fig.subplots(rows_of_panels, columns, squeeze=False).flat)
    for ax, name in zip(axes, metrics):
        for color, (label, rows) in enumerate(data.items()):
            points = [(row[x_key], row[name]) for row in rows
                      if _is_number(row.get(x_key)) and _is_number(row.get(name))]
            if points:
                style = {"marker": "o", "markersize": 3} if name.startswith("eval/") else {"linewidth": 1}
                ax.plot(*zip(*points), color=f"C{color}", label=label, **style)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("training seconds" if x_key == "train_seconds" else "step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    fig.axes[0].legend(fontsize=7)
    fig.savefig(out)
    return metrics


def main():
    ap = argparse.ArgumentParser(description="evaluate a chat checkpoint, compare two runs, draw curves")
    ap.add_argument("--model", help="model folder or run directory (its latest checkpoint)")
    ap.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"),
                    help="evaluate two runs on the same problems and seeds; prints the paired change B - A")
    ap.add_argument("--plot", nargs="+", metavar="RUN",
                    help="draw these runs' metrics.jsonl (run directories or files)")
    ap.add_argument("--report", nargs="*", metavar="RUN", help="gather every stage's eval.json into report.json; "
                    "or these runs' (e.g. sft/r1 rl/r1, under $NANOPOST_HOME), one row each")
    ap.add_argument("--run-name", default="default", help="run name, with --report")
    ap.add_argument("--data", help="with --model: a JSONL of RL rows (prompt, verifier, ground_truth; chat_rl's "
                    "--data format) to grade instead of the embedded world's held-out problems")
    ap.add_argument("--problems", type=int, default=None,
                    help="held-out problems (default 200; 500 with --compare; with --data: all its rows)")
    ap.add_argument("--samples", type=int, default=None,
                    help="answers per problem (default 1; with --compare 4, for the sampled pass@1)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (default 0, greedy; with --compare 1.0 for the sampled pass@1)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tools", action="store_true", help="offer the calculator tool")
    ap.add_argument("--metrics", help="with --plot: comma-separated metric names (default: the RL curves logged)")
    ap.add_argument("--out", help="with --plot: the PNG (default curves.png); with --compare: a JSON of the numbers; "
                    "with --report: the JSON (default $NANOPOST_HOME/report.json); with --model: a JSON file the "
                    "metrics are added to (a run's eval.json keeps its other keys; sampled: pass@k_tT only)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    check_flag_ranges(args, greedy=True)
    if sum(map(bool, (args.model, args.compare, args.plot, args.report is not None))) != 1:
        ap.error("pass one of --model PATH, --compare RUN_A RUN_B, --plot RUN [RUN ...], --report [RUN ...]")
    if args.data and not args.model:
        ap.error("--data grades a --model on your rows: pass --model PATH with it")
    if args.report is not None:
        report(args.run_name, args.report, args.out)
    elif args.plot:
        out = args.out or "curves.png"
        drawn = plot_runs(args.plot, out, args.metrics.split(",") if args.metrics else None)
        print(f"{len(drawn)} metrics of {len(args.plot)} run(s) -> {out}")
    elif args.compare:
        dist = init_dist(args.device)
        result = compare_runs(*args.compare, problems=args.problems or 500, samples=args.samples or 4,
                              temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
                              top_p=args.top_p, use_tools=args.tools, max_new_tokens=args.max_new_tokens,
                              device=dist.device)
        print_comparison(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            print(f"-> {args.out}")
    else:
        dist = init_dist(args.device)
        path = resolve_model_path(named_run(args.model), "--model", head="lm")
        model, tok = load_hf(path, device=dist.device), load_tokenizer(path, "--model")
        rows = load_rl(args.data)[:args.problems] if args.data else rl_prompts("test", args.problems or 200)
        print0(f"{len(rows)} problems" + (f" of {args.data}" if args.data else " held out from the embedded world"))
        m = evaluate_chat(model, tok, rows, num_samples=args.samples or 1, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p, use_tools=args.tools)
        print0(json.dumps({k: round(v, 4) for k, v in m.items()}, indent=2))
        if args.out and dist.is_main:  # added to what the file holds (a run's eval.json keeps its val_loss)
            held = {}
            if os.path.isfile(args.out):
                with open(args.out) as f:
                    held = json.load(f)
            if not isinstance(held, dict):
                raise UserError(f"--out {args.out}: holds no JSON object to add the metrics to")
            if args.temperature:  # sampled: its pass@k as the RL stages name them (pass@1_t1), greedy keys kept
                m = {f"{k}_t{args.temperature:g}": v for k, v in m.items() if k.startswith(("pass@", "maj@"))}
            held.update({k: round(v, 4) for k, v in m.items()})
            with open(args.out, "w") as f:
                json.dump(held, f, indent=2)
            print0(f"-> {args.out}")


if __name__ == "__main__":
    run_main(main)
