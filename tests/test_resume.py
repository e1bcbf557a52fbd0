"""Every stage is killable: kill -9 mid-run, --resume, and the per-step metrics continue exactly as in the
uninterrupted run (the same data order, RNG, optimizer state, sampling seeds and RL clock). Also under
FSDP2 on 2 ranks, resuming on another number of ranks, and a NaN loss that stops a run cleanly."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from model import GPT, GPTConfig
from safetensors import safe_open

from checkpoint import load_hf, save_hf
from tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--n-kv-head", "2", "--seq-len", "128",
             "--num-docs", "400", "--vocab-size", "400", "--eval-problems", "0", "--eval-every", "1000",
             "--warmup-steps", "2", "--batch-size", "8", "--device-batch-size", "8"]


@pytest.fixture(scope="module")
def tiny_chat(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(path), tok)
    return str(path)


def stage_args(stage, init):
    """(script, arguments, the metrics compared, how many steps, save every) of a short run of each stage."""
    if stage == "base":
        return "base_train.py", BASE_TINY + ["--steps", "12", "--save-every", "3"], ["loss", "grad_norm"], 12, 3
    common = ["--init", init]
    if stage in ("sft", "sft-lora-dropout"):  # LoRA dropout: the only draw from torch's RNG in a step
        lora = ["--lora-rank", "4", "--lora-dropout", "0.1", "--lr", "1e-3"] if stage != "sft" else []
        return "chat_sft.py", common + ["--num-train", "96", "--num-val", "8", "--eval-problems", "0", "--steps", "12",
                                        "--batch-size", "8", "--save-every", "3", *lora], ["loss", "grad_norm"], 12, 3
    if stage == "rm":
        return "chat_rm.py", common + ["--num-train", "96", "--num-val", "8", "--steps", "12", "--batch-size", "8",
                                       "--eval-every", "1000", "--save-every", "3"], ["loss", "grad_norm"], 12, 3
    if stage == "dpo":
        return "chat_dpo.py", common + ["--num-train", "96", "--num-val", "6", "--eval-problems", "0", "--steps", "12",
                                        "--batch-size", "8", "--lr", "1e-3", "--save-every", "3"], ["loss", "grad_norm"], 12, 3
    rollout = ["--num-prompts", "32", "--steps", "8", "--prompts-per-step", "4", "--max-new-tokens", "16",
               "--eval-problems", "0", "--save-every", "2"]
    if stage == "rl":  # the overlong shaping gives an untrained model's answers distinct rewards
        return "chat_rl.py", common + rollout + ["--group-size", "4", "--max-resample", "1", "--overlong-buffer", "16"], \
            ["loss", "reward", "length_mean", "grad_norm"], 8, 2
    # PPO's state beyond the actor: the adaptive KL's beta (--kl-target moves it every step) and the critic's
    # optimizer, which trains only when returns are not all 0: an answer cut at the limit scores -1
    return "chat_ppo.py", common + rollout + ["--samples-per-prompt", "2", "--critic-init", init,
                                              "--freeze-actor-steps", "1", "--truncated-reward", "-1",
                                              "--kl-target", "1.0", "--kl-horizon", "100"], \
        ["policy_loss", "value_loss", "reward", "length_mean", "kl_beta", "explained_var"], 8, 2


def command(script, args, nproc=1):
    path = os.path.join(REPO, script)
    if nproc == 1:
        return [sys.executable, path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path, *args]


def run_env(home):
    return {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}


def metrics_by_step(home, stage, keys):
    """The last logged value of each key at each step (a step re-run after resume overwrites the killed one)."""
    out = {}
    with open(os.path.join(home, stage, "default", "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if keys[0] in row:
                out[row["step"]] = {k: row[k] for k in keys}
    return out


def run_killed(cmd, home, stage, kill_after_step):
    """Start cmd and SIGKILL its whole process group once the checkpoint of kill_after_step exists."""
    proc = subprocess.Popen(cmd, env=run_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    target = home / stage / "default" / "checkpoints" / f"step_{kill_after_step:06d}"
    deadline = time.time() + 240
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank: a real crash, no cleanup
    proc.wait()


def run_killed_then_resumed(cmd, resume_cmd, home, stage, kill_after_step):
    run_killed(cmd, home, stage, kill_after_step)
    r = subprocess.run(resume_cmd, env=run_env(home), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def assert_same(a, b, keys, tol=1e-6):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for step in a:
        for k in keys:
            assert math.isclose(a[step][k], b[step][k], rel_tol=tol, abs_tol=tol), (step, k, a[step][k], b[step][k])


@pytest.mark.parametrize("stage", [pytest.param(s, marks=[] if s == "sft-lora-dropout" else pytest.mark.slow)
                                   for s in ["base", "sft", "sft-lora-dropout", "rm", "dpo", "rl", "ppo"]])
def test_killed_run_resumes_exactly(tmp_path, tiny_chat, stage):  # sft-lora-dropout: the quick tier's
    script, args, keys, steps, every = stage_args(stage, tiny_chat)
    folder = stage.split("-")[0]  # the stage's directory under $NANOPOST_HOME
    r = subprocess.run(command(script, args), env=run_env(tmp_path / "a"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = metrics_by_step(tmp_path / "a", folder, keys)
    assert sorted(reference) == list(range(1, steps + 1))
    home = tmp_path / "b"
    run_killed_then_resumed(command(script, args), command(script, args + ["--resume"]), home, folder, 2 * every)
    resumed = metrics_by_step(home, folder, keys)
    assert_same(reference, resumed, keys)  # every step ran (verl#5725), with identical numbers (verl#7933)
    if stage == "ppo":  # the drill can fail: the critic trained and beta moved before the kill, and after it
        assert all(reference[s]["value_loss"] > 1e-4 for s in reference)
        assert len({reference[s]["kl_beta"] for s in reference}) == steps
    if stage == "rl":  # the training clock is part of the saved state: it continues, it does not restart
        clock = metrics_by_step(home, stage, ["train_seconds"])  # steps to the kill, then the resumed ones
        seconds = [clock[s]["train_seconds"] for s in sorted(clock)]
        assert len(seconds) == steps and all(b > a for a, b in zip(seconds, seconds[1:])), seconds


@pytest.fixture(scope="module")
def bf16_chat(tiny_chat, tmp_path_factory):
    """tiny_chat as a Qwen3 download ships: bfloat16 weights, config.json saying so."""
    path = tmp_path_factory.mktemp("chat_bf16")
    save_hf(load_hf(tiny_chat), str(path), Tokenizer.load(tiny_chat), dtype=torch.bfloat16)
    return str(path)


def tensor_dtypes(folder):
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_bfloat16_input_ships_bfloat16_and_resumes_exactly_from_float32_master_weights(tmp_path, bf16_chat, nproc):
    script, args, keys, steps, every = stage_args("sft", bf16_chat)
    args = args + (["--fsdp", "--device-batch-size", "4"] if nproc == 2 else [])
    r = subprocess.run(command(script, args, nproc), env=run_env(tmp_path / "a"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    final = tmp_path / "a" / "sft" / "default" / "checkpoints" / f"step_{steps:06d}"
    # shipped in the input's dtype: half the bytes of float32, and the only *.safetensors (vLLM loads them all)
    assert tensor_dtypes(final) == {torch.bfloat16}
    assert json.load(open(final / "config.json"))["dtype"] == "bfloat16"
    assert [p.name for p in final.glob("*.safetensors")] == ["model.safetensors"]
    assert (final / ("optimizer" if nproc == 2 else "master_weights.pt")).exists()
    # a resumed run continues from the float32 master weights, not from their bfloat16 rounding
    home = tmp_path / "b"
    run_killed_then_resumed(command(script, args, nproc), command(script, args + ["--resume"], nproc), home, "sft",
                            2 * every)
    assert_same(metrics_by_step(tmp_path / "a", "sft", keys), metrics_by_step(home, "sft", keys), keys,
                tol=1e-6 if nproc == 1 else 1e-5)


def test_save_dtype_overrides_the_inputs(tmp_path, bf16_chat):
    script, args, _, steps, _ = stage_args("sft", bf16_chat)
    r = subprocess.run(command(script, args + ["--steps", "3", "--save-dtype", "float32"]), env=run_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    final = tmp_path / "sft" / "default" / "checkpoints" / "step_000003"
    assert tensor_dtypes(final) == {torch.float32} and not (final / "master_weights.pt").exists()


@pytest.mark.slow
def test_fsdp_run_killed_on_two_ranks_resumes_exactly_and_on_one_rank_continues(tmp_path, tiny_chat):
    from transformers import AutoModelForCausalLM
    script, args, keys, steps, every = stage_args("sft", tiny_chat)
    args = args + ["--fsdp", "--device-batch-size", "4"]
    r = subprocess.run(command(script, args, nproc=2), env=run_env(tmp_path / "a"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = metrics_by_step(tmp_path / "a", "sft", keys)
    home, one = tmp_path / "b", tmp_path / "one"
    run_killed(command(script, args, nproc=2), home, "sft", 2 * every)
    shutil.copytree(home / "sft" / "default" / "checkpoints", one / "sft" / "default" / "checkpoints")
    r = subprocess.run(command(script, args + ["--resume"], nproc=2), env=run_env(home), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(reference, metrics_by_step(home, "sft", keys), keys, tol=1e-5)
    # the Hugging Face folder gathered from the shards loads in transformers with equal logits
    folder = str(home / "sft" / "default" / "checkpoints" / f"step_{steps:06d}")
    ours, theirs = load_hf(folder).eval(), AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(0, ours.config.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, atol=1e-4, rtol=1e-4)
    # the same sharded checkpoint resumes on one rank (the optimizer is resharded): it continues to the end
    r = subprocess.run(command(script, args + ["--resume"]), env=run_env(one), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the random streams start afresh" in r.stdout
    assert max(metrics_by_step(one, "sft", keys)) == steps


def test_a_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, tiny_chat, monkeypatch, capsys):
    """NaN injected into the model's output at the 5th training forward (step 5: one micro-batch a step)."""
    import chat_sft
    from checkpoint import list_checkpoints
    from common import run_main
    calls = {"n": 0}
    forward = GPT.forward

    def poisoned(self, *a, **kw):
        out = forward(self, *a, **kw)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 5:
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", poisoned)
    monkeypatch.setenv("NANOPOST_HOME", str(tmp_path))
    _, args, _, _, _ = stage_args("sft", tiny_chat)
    monkeypatch.setattr(sys, "argv", ["chat_sft.py", *args, "--save-every", "2"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(chat_sft.main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "error: step 5: the loss is nan; not training on it. Lower the learning rate or check the data; "
        "the last checkpoint is intact and --resume restarts from it")
    ckpts = [os.path.basename(p) for p in list_checkpoints(str(tmp_path / "sft" / "default"))]
    assert ckpts == ["step_000002", "step_000004"]  # nothing written after the NaN; the good ones intact
    weights = load_hf(os.path.join(tmp_path, "sft", "default", "checkpoints", "step_000004")).state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_ppo_resumes_its_critics_optimizer_and_its_adaptive_kl(tmp_path, tiny_chat, monkeypatch):
    """The quick tier's PPO resume: the state beyond the actor. A run of 4 steps saving every 2, then its step-4
    checkpoints deleted and the run resumed from step 2: steps 3 and 4 again give the same value loss (the
    critic's AdamW moments came back) and the same beta (the adaptive KL controller's, moved every step by
    --kl-target, came back). An answer cut at the limit scores -1, so the critic has returns to learn."""
    import chat_ppo
    from inprocess import run_stage
    script, args, _, _, _ = stage_args("ppo", tiny_chat)
    args[args.index("--steps") + 1] = "4"
    rows = run_stage(monkeypatch, tmp_path, chat_ppo, *args)
    first = {r["step"]: r for r in rows if "value_loss" in r}
    for folder in ("checkpoints", os.path.join("critic", "checkpoints")):
        shutil.rmtree(tmp_path / "ppo" / "default" / folder / "step_000004")
    rows = run_stage(monkeypatch, tmp_path, chat_ppo, *args, "--resume")
    again = {r["step"]: r for r in rows if "value_loss" in r}  # the resumed steps' rows come last
    assert len({first[s]["kl_beta"] for s in first}) == 4 and min(first[s]["value_loss"] for s in first) > 1e-4
    for step in (3, 4):
        for key in ("value_loss", "kl_beta", "policy_loss"):
            assert math.isclose(again[step][key], first[step][key], rel_tol=1e-6, abs_tol=1e-9), (step, key)
