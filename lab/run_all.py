"""
Regenerate the whole lab: every experiment's script in turn (EXPERIMENTS), each writing its JSON and figure to
docs/lab/, the model-level ones from the checkpoints of runs/cpu.sh in $NANOPOST_HOME; then every page's marked
numbers rewritten from the JSONs (labkit.refresh_page), so that a page says what its JSON holds.

    bash runs/cpu.sh && python lab/run_all.py     # the whole lab, experiment by experiment (hours on 2 cores)
    python lab/run_all.py --exact-only            # the exact level alone: no checkpoint, a few minutes
    python lab/run_all.py --only goodhart kl_placement
    python lab/run_all.py --smoke --home /tmp/np --out /tmp/lab   # every experiment at its smallest size

Each experiment runs as `python lab/NAME.py FLAGS --home HOME --out OUT` (a user's command, printed first); the
first that fails stops the regeneration with its output. Pages are refreshed only when OUT is docs/lab and the
sizes are the real ones (not --smoke).
"""
import argparse
import os
import subprocess
import sys
import time

from labkit import REPO, page_numbers, refresh_page, require_matplotlib

# name: (level, the script's own flags). The order: the exact level first (seconds), then the runs.
EXPERIMENTS = {
    "exact_gradient": ("exact", []),
    "length_bias_exact": ("exact", []),
    "clip_higher_exact": ("exact", []),
    "goodhart_exact": ("exact", []),
    "kl_placement": ("exact", []),
    "goodhart": ("model", []),
    "r1_zero": ("model", []),
    "dpo_likelihood": ("model", []),
    "length_bias": ("model", []),
    "clip_higher": ("model", []),
    "sampler_trainer": ("model", []),
    "staleness": ("model", []),
    "rejection_vs_rl": ("model", []),
    "lenient_verifier": ("model", []),
    "forgetting": ("model", []),
    "grid": ("model", []),
}
DOCS = os.path.join(REPO, "docs", "lab")


def main():
    p = argparse.ArgumentParser(prog="lab/run_all.py", description="regenerate the lab, experiment by experiment")
    p.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="NAME", help="these experiments only")
    p.add_argument("--exact-only", action="store_true", help="the exact-level experiments only (no checkpoint)")
    p.add_argument("--smoke", action="store_true", help="each at its smallest size (a check that all of them run)")
    p.add_argument("--home", type=os.path.abspath,
                   default=os.environ.get("NANOPOST_HOME", os.path.join(REPO, "out", "cpu")),
                   help="the $NANOPOST_HOME of runs/cpu.sh, whose checkpoints the model-level experiments start from")
    p.add_argument("--out", type=os.path.abspath, default=DOCS, help="where the JSONs and figures go")
    args = p.parse_args()
    require_matplotlib()  # before the first experiment, not after it
    names = [n for n in (args.only or EXPERIMENTS) if not args.exact_only or EXPERIMENTS[n][0] == "exact"]
    if any(EXPERIMENTS[n][0] == "model" for n in names) and not os.path.isdir(os.path.join(args.home, "sft")):
        raise SystemExit(f"error: no runs/cpu.sh checkpoints in {args.home}: run `NANOPOST_HOME={args.home} bash "
                         f"runs/cpu.sh` first (or pass --home, or --exact-only)")
    times = {}
    for name in names:
        cmd = [sys.executable, os.path.join(REPO, "lab", f"{name}.py"), *EXPERIMENTS[name][1], "--home", args.home,
               "--out", args.out] + (["--smoke"] if args.smoke else [])
        print(f"[run_all] {name}: python lab/{name}.py {' '.join(cmd[2:])}", flush=True)
        t = time.time()
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            raise SystemExit(f"[run_all] {name} failed: the lab is regenerated up to it")
        times[name] = time.time() - t
    if args.out == DOCS and not args.smoke:
        for page in sorted(f for f in os.listdir(DOCS) if f.endswith(".md")):
            path = os.path.join(DOCS, page)
            if page_numbers(path):
                print(f"[run_all] docs/lab/{page}: {refresh_page(path)} marked number(s) rewritten from the JSONs")
    for name, seconds in times.items():
        print(f"[run_all] {name:20s} {seconds:7.0f} s")


if __name__ == "__main__":
    main()
