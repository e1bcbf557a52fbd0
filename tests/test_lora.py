"""LoRA (model.LoRALinear): the adapter's arithmetic against a hand-written W + (alpha/r) B A, step 0 equal to
the base, the reference as "adapters off", folders PEFT loads (and PEFT's folders loaded here), the engine
sampling what the trainer scores in bfloat16, merge.py --lora, the bad inputs, and 2 ranks equal to 1."""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from checkpoint import load_hf, load_model, save_hf
from common import UserError, autocast
from lora import lora_options, save_adapter
from engine import Engine
from lora import LoRALinear, adapters_off
from model import GPT, GPTConfig

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(vocab_size, head="lm"):
    return GPTConfig(vocab_size=vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                     intermediate_size=96, max_seq_len=256, head=head)


@pytest.fixture(scope="module")
def base_dir(tok, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base"))
    torch.manual_seed(0)
    save_hf(GPT(tiny_config(tok.vocab_size)), path, tok)
    return path


def options(path, rank=4, alpha=8.0, targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", resume=False,
            dropout=0.0):
    class A:
        lora_rank, lora_alpha, lora_dropout, lora_targets, seed = rank, alpha, dropout, targets, 0
    return lora_options(A, path, resume=resume)


def randomize_adapters(model, std=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


def test_merged_equals_hand_written_update_and_step0_is_the_base():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5, bias=False)
    layer = LoRALinear(lin, rank=2, alpha=3.0)
    x = torch.randn(4, 6)
    assert torch.equal(layer(x), x @ lin.weight.T)  # B = 0 at the start: the base layer exactly
    bound = 1 / math.sqrt(6)  # PEFT's init of A: kaiming_uniform_(a=sqrt(5)) is uniform in +-1/sqrt(in)
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.abs().max() > bound / 2
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(5, 2))
    A, B = layer.lora_A.weight.detach(), layer.lora_B.weight.detach()
    merged = lin.weight.detach() + (3.0 / 2) * B @ A  # written out here, not taken from the code
    torch.testing.assert_close(layer(x), x @ merged.T)
    torch.testing.assert_close(layer.delta(), (3.0 / 2) * B @ A)
    # the worked example of the docstring
    w = torch.nn.Linear(2, 2, bias=False)
    ex = LoRALinear(w, rank=1, alpha=2.0)
    with torch.no_grad():
        w.weight.zero_()
        ex.lora_A.weight.copy_(torch.tensor([[1.0, 1.0]]))
        ex.lora_B.weight.copy_(torch.tensor([[0.5], [0.0]]))
    assert ex(torch.tensor([1.0, 3.0])).tolist() == [4.0, 0.0]


def test_model_step0_adapters_off_and_trainable_set(tok, base_dir):
    base = load_model(base_dir)
    model = load_model(base_dir, lora=options(base_dir))
    x = torch.randint(0, tok.vocab_size, (2, 12))
    with torch.no_grad():
        ref = base(x)
        assert torch.equal(model(x), ref)  # step 0: the base
        randomize_adapters(model)
        assert (model(x) - ref).abs().max() > 1e-3
        with adapters_off(model):
            assert torch.equal(model(x), ref)  # the reference for free
        assert (model(x) - ref).abs().max() > 1e-3  # and back on
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # 7 layers x (A, B) x 2 blocks
    assert all(p.dtype == torch.float32 for p in model.parameters())  # CPU: the compute dtype is float32


def test_peft_loads_ours_and_we_load_peft(tok, base_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    lora = options(base_dir, rank=4, alpha=8.0, targets="q_proj,v_proj,down_proj")
    model = load_model(base_dir, lora=lora)
    randomize_adapters(model)
    out = str(tmp_path / "ours")
    save_adapter(model, out, lora, tok)
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["base_model_name_or_path"] == os.path.abspath(base_dir)
    from safetensors.torch import load_file
    keys = set(load_file(os.path.join(out, "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 2 * 3 * 2
    x = torch.randint(0, tok.vocab_size, (2, 10))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x).logits, model(x), atol=1e-5, rtol=1e-5)
        # PEFT's own: made by peft on the transformers model, loaded here merged (--init) and unmerged (resume);
        # rsLoRA scales by alpha / sqrt(r) (at r = 4 half of alpha / r's 2x), which a plain LoRA load would miss
        for rslora in (False, True):
            hf2 = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            made = peft.get_peft_model(hf2, peft.LoraConfig(r=4, lora_alpha=5, target_modules=["k_proj", "up_proj"],
                                                            task_type="CAUSAL_LM", use_rslora=rslora))
            for n, p in made.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn_like(p) * 0.05)
            theirs = str(tmp_path / f"theirs{'-rslora' * rslora}")
            made.save_pretrained(theirs)
            want = made(x).logits
            for resume in (False, True):
                ours = load_model(theirs, lora=options(theirs, resume=True)) if resume else load_model(theirs)
                torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


def test_engine_equals_trainer_in_bfloat16_on_a_small_update(tok, tmp_path):
    """An update whose median element is 2^-9 of its weight: a bfloat16 W + (alpha/r) B A rounds most of it
    away (half a ulp is 2^-9 to 2^-8 of |W|), but the trainer, applying the adapters unmerged, sees it. The
    engine applies them unmerged too: its log-probs match the trainer's to bfloat16 noise, more closely than
    those of a bfloat16 merged copy. (Weights drawn wide, std 0.15, so the logits are decisive.)"""
    torch.manual_seed(0)
    m0 = GPT(tiny_config(tok.vocab_size))
    with torch.no_grad():
        for p in m0.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    save_hf(m0, str(tmp_path / "wide"), tok)
    wide = str(tmp_path / "wide")
    model = load_hf(wide, dtype=torch.bfloat16, lora=options(wide, rank=8, alpha=16.0))
    merged = load_hf(str(tmp_path / "wide"), dtype=torch.bfloat16)
    g, lost = torch.Generator().manual_seed(3), []
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g))
                w = m.weight.float()
                m.lora_B.weight.mul_(2.0 ** -9 / float((m.delta().abs() / w.abs()).flatten().median()))
                update = m.lora_B.weight.float() @ m.lora_A.weight.float() * m.scaling  # written out here
                merged.get_submodule(name).weight.copy_((w + update).bfloat16())
                lost.append(float(((w + update).bfloat16() == m.weight).float().mean()))
    assert sum(lost) / len(lost) > 0.5  # merged in bfloat16, most elements of the update vanish
    prompts = [tok.render_for_completion([{"role": "user", "content": q}]) for q in ("What is 3 + 4?", "Hi")]
    outs = Engine(model, tok, dtype=torch.bfloat16).generate(prompts, num_samples=2, max_new_tokens=12, seed=0)
    engine_gap, merged_gap, effect = [], [], []
    for i, o in enumerate(outs):
        p = prompts[i // 2]
        ids = torch.tensor([p + o.tokens])
        tgt = torch.full_like(ids, -100)
        tgt[0, len(p) - 1:-1] = ids[0, len(p):]
        with torch.no_grad(), autocast("cpu", torch.bfloat16):
            lp = model(ids, tgt)[0, len(p) - 1:-1]
            with adapters_off(model):
                effect.append((lp - model(ids, tgt)[0, len(p) - 1:-1]).abs())
            merged_gap.append((lp - merged(ids, tgt)[0, len(p) - 1:-1]).abs())
        engine_gap.append((lp - torch.tensor(o.logprobs)).abs())
    engine_gap, merged_gap, effect = (torch.cat(x).mean() for x in (engine_gap, merged_gap, effect))
    assert engine_gap < 0.7 * merged_gap and engine_gap < effect


def test_bad_inputs(tok, base_dir, tmp_path):
    with pytest.raises(UserError, match=r"--lora-rank 100 does not fit layer q_proj \(64 x 64\)"):
        load_model(base_dir, lora=options(base_dir, rank=100))
    with pytest.raises(UserError, match="valid names: q_proj, k_proj"):
        load_model(base_dir, lora=options(base_dir, targets="qkv"))
    # an adapter trained on another base: refused, both shapes named
    other = str(tmp_path / "other")
    torch.manual_seed(0)
    cfg = tiny_config(tok.vocab_size)
    cfg.intermediate_size = 128
    save_hf(GPT(cfg), other, tok)
    lora = replace(options(other, targets="gate_proj"), base=base_dir)
    m = load_model(other, lora=lora)
    save_adapter(m, str(tmp_path / "ad"), lora, tok)
    with pytest.raises(UserError, match=r"128 x 64 .* the base has 96 x 64"):
        load_model(str(tmp_path / "ad"))
    with pytest.raises(UserError, match=r"is \(128, 4\), the model .* needs \(96, 4\)"):
        load_model(str(tmp_path / "ad"), lora=options(str(tmp_path / "ad"), resume=True))


# ------------------------------------------------------------------------------------------------
# The stages: checkpoints are adapters, resume, a chain SFT adapter -> RL adapter, merge.py, 2 ranks = 1

SFT = ["--num-train", "96", "--num-val", "8", "--eval-problems", "0", "--batch-size", "8", "--device-batch-size", "4",
       "--lora-rank", "4", "--lr", "3e-2"]


def run(script, args, home, nproc=1):
    cmd = [sys.executable, os.path.join(REPO, script), *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         os.path.join(REPO, script), *args]
    p = subprocess.run(cmd, env={**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def losses(home, stage, run_name="default", key="loss"):
    with open(os.path.join(home, stage, run_name, "metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def adapter_tensors(ckpt):
    from safetensors.torch import load_file
    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def sft_home(tok, tmp_path_factory):
    """A 4-step LoRA SFT run on a 1-layer model, checkpoints at steps 2 and 4."""
    home = tmp_path_factory.mktemp("home")
    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                  intermediate_size=64, max_seq_len=512)), str(home / "base"), tok)
    run("chat_sft.py", ["--init", str(home / "base"), "--steps", "4", "--save-every", "2", *SFT], home)
    return home


def test_sft_checkpoint_is_an_adapter_and_resumes(sft_home, tmp_path):
    ckpt = os.path.join(sft_home, "sft", "default", "checkpoints", "step_000004")
    assert not os.path.exists(os.path.join(ckpt, "config.json"))  # the base is not copied
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))
    n_adapter = sum(t.numel() for t in adapter_tensors(ckpt).values())
    assert n_adapter == 2 * 4 * (32 + 32) + 2 * 4 * (32 + 16) + 3 * 4 * (32 + 64)  # q,o; k,v; gate,up,down
    opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False)
    assert sum(s["exp_avg"].numel() for s in opt["state"].values()) == n_adapter  # adapter-only optimizer state
    # resume from step 2: steps 3 and 4 as in the uninterrupted run
    import shutil
    home = tmp_path / "h"
    shutil.copytree(os.path.join(sft_home, "sft"), home / "sft")
    shutil.rmtree(home / "sft" / "default" / "checkpoints" / "step_000004")
    run("chat_sft.py", ["--init", str(sft_home / "base"), "--steps", "4", "--save-every", "2", "--resume", *SFT], home)
    want, got = losses(sft_home, "sft"), losses(home, "sft")
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    resumed = adapter_tensors(home / "sft" / "default" / "checkpoints" / "step_000004")
    assert all(torch.equal(resumed[k], v) for k, v in adapter_tensors(ckpt).items())


def test_rl_on_an_sft_adapter_then_merge(sft_home, tok, tmp_path):
    """RL with LoRA and a KL term from the unmerged SFT adapter: the SFT adapter is merged into the frozen
    base (so "adapters off" is the SFT model), the RL checkpoint names the SFT adapter as its base, and
    merge.py --lora writes the plain model base + SFT update + RL update (checked against the sum written
    out here from the safetensors files)."""
    sft = os.path.join(sft_home, "sft", "default", "checkpoints", "step_000004")
    out = run("chat_rl.py", ["--init", sft, "--num-prompts", "16", "--steps", "2", "--prompts-per-step", "2",
                             "--group-size", "4", "--max-new-tokens", "12", "--eval-problems", "0", "--save-every", "2",
                             "--overlong-buffer", "12", "--kl-beta", "0.5", "--lora-rank", "2", "--lr", "3e-2"], tmp_path)
    assert "trainable" in out
    kl = losses(tmp_path, "rl", key="kl")
    assert all(math.isfinite(v) for v in kl.values()) and max(kl.values()) > 0  # the KL term is live
    x = torch.randint(0, tok.vocab_size, (2, 9))
    policy = load_model(sft, lora=options(sft, rank=2))  # as chat_rl.py loads it
    randomize_adapters(policy)
    with torch.no_grad(), adapters_off(policy):  # the reference is the SFT model, not the pre-SFT base
        torch.testing.assert_close(policy(x), load_model(sft)(x))
        assert (policy(x) - load_model(str(sft_home / "base"))(x)).abs().max() > 1e-3
    rl = os.path.join(tmp_path, "rl", "default", "checkpoints", "step_000002")
    assert json.load(open(os.path.join(rl, "adapter_config.json")))["base_model_name_or_path"] == sft
    merged = str(tmp_path / "merged")
    subprocess.run([sys.executable, os.path.join(REPO, "merge.py"), "--lora", rl, "--out", merged], check=True,
                   capture_output=True)
    from safetensors.torch import load_file
    w = load_file(os.path.join(sft_home, "base", "model.safetensors"))
    for ad, r, alpha in ((sft, 4, 8.0), (rl, 2, 4.0)):  # the default alpha: 2 x rank
        t = adapter_tensors(ad)
        for k in [k for k in t if ".lora_A." in k]:
            name = k.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            w[name] = w[name] + alpha / r * t[k.replace("lora_A", "lora_B")] @ t[k]
    got = load_file(os.path.join(merged, "model.safetensors"))
    assert set(got) == set(w) and all(torch.allclose(got[k], w[k], atol=1e-6) for k in w)
    with torch.no_grad():
        torch.testing.assert_close(load_model(merged)(x), load_model(rl)(x))  # --init ADAPTER: merged the same way


ROLLOUT = ["--num-prompts", "16", "--prompts-per-step", "2", "--max-new-tokens", "12", "--eval-problems", "0"]
STAGE_RUNS = {  # a 2-step LoRA run of each other stage, from the SFT adapter: (script, flags, the run's folder)
    "rm": ("chat_rm.py", ["--num-train", "32", "--num-val", "4", "--batch-size", "8", "--eval-every", "1000"], "rm"),
    "dpo": ("chat_dpo.py", ["--num-train", "32", "--num-val", "4", "--batch-size", "8", "--eval-problems", "0"],
            "dpo"),
    "kto": ("chat_kto.py", ["--num-train", "32", "--num-val", "4", "--batch-size", "8", "--eval-problems", "0"],
            "kto"),
    "ppo": ("chat_ppo.py", [*ROLLOUT, "--samples-per-prompt", "2", "--truncated-reward", "-1"], "ppo"),
}


@pytest.mark.parametrize("stage", [s if s in ("rm", "dpo") else pytest.param(s, marks=pytest.mark.slow)
                                   for s in STAGE_RUNS])  # kto and ppo as dpo and rl: runs/test.sh --all
def test_every_stage_saves_its_adapter_and_resumes_it(sft_home, tmp_path, stage):
    """The LoRA settings a stage resolves (lora_options) reach its checkpoint and its resume: each checkpoint is
    an adapter folder over the stage's --init (PPO's critic one over --critic-init), and a run killed after step 1
    and resumed logs step 2 as the whole run did (rank, alpha and targets read back from the adapter)."""
    script, flags, folder = STAGE_RUNS[stage]
    sft = os.path.join(sft_home, "sft", "default", "checkpoints", "step_000004")
    flags = ["--init", sft, "--steps", "2", "--save-every", "1", "--lora-rank", "2", "--lora-alpha", "3",
             "--lr", "1e-3", *flags] + (["--critic-init", sft] if stage == "ppo" else [])
    run(script, flags, tmp_path / "whole")
    run_dir = tmp_path / "whole" / folder / "default"
    for ckpt in [run_dir / "checkpoints" / "step_000002"] + ([run_dir / "critic" / "checkpoints" / "step_000002"]
                                                           if stage == "ppo" else []):
        assert not (ckpt / "config.json").exists() and not (ckpt / "model.safetensors").exists()
        cfg = json.load(open(ckpt / "adapter_config.json"))
        assert (cfg["base_model_name_or_path"], cfg["r"], cfg["lora_alpha"]) == (sft, 2, 3.0), cfg
    import shutil
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / folder / "default" / "checkpoints" / "step_000002")
    if stage == "ppo":
        shutil.rmtree(tmp_path / "resumed" / folder / "default" / "critic" / "checkpoints" / "step_000002")
    run(script, flags + ["--resume"], tmp_path / "resumed")
    key = "policy_loss" if stage == "ppo" else "loss"
    assert losses(tmp_path / "resumed", folder, key=key)[2] == losses(tmp_path / "whole", folder, key=key)[2]
    resumed = tmp_path / "resumed" / folder / "default" / "checkpoints" / "step_000002" / "adapter_config.json"
    assert json.load(open(resumed))["base_model_name_or_path"] == sft  # the resumed adapter builds on --init still


@pytest.mark.slow  # a multi-rank equivalence: runs/test.sh --all
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_equal_one(sft_home, tmp_path, fsdp):
    run("chat_sft.py", ["--init", str(sft_home / "base"), "--steps", "2", "--save-every", "2", *SFT]
        + ["--fsdp"] * fsdp, tmp_path, nproc=2)
    one = losses(sft_home, "sft")
    two = losses(tmp_path, "sft")
    assert all(abs(two[s] - one[s]) < 1e-5 for s in (1, 2))
    ckpt = "checkpoints/step_000002"
    a, b = adapter_tensors(os.path.join(sft_home, "sft", "default", ckpt)), adapter_tensors(tmp_path / "sft" / "default" / ckpt)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_reward_model_adapter_loads_in_peft(tok, tmp_path):
    """A reward model's adapter (task_type SEQ_CLS, the score head whole as modules_to_save) on the
    transformers sequence classifier: equal scores."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    rm = GPT(tiny_config(tok.vocab_size, head="scalar"))
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.5)
    save_hf(rm, str(tmp_path / "rm"), tok)
    lora = options(str(tmp_path / "rm"), rank=4)
    model = load_model(str(tmp_path / "rm"), head="scalar", lora=lora)
    randomize_adapters(model)
    with torch.no_grad():
        model.score.weight.add_(0.1)  # the score head trains too
    save_adapter(model, str(tmp_path / "ad"), lora, tok)
    assert json.load(open(tmp_path / "ad" / "adapter_config.json"))["task_type"] == "SEQ_CLS"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    x = torch.randint(0, tok.vocab_size, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(pm(x).logits[0, 0], model(x)[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(load_model(str(tmp_path / "ad"), head="scalar")(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_shares_a_lora_base_instead_of_fused_copies(tok, base_dir, dtype):
    # the frozen base of a loaded LoRA model keeps q/k/v and gate/up as one tensor each (lora.fuse_projections):
    # the engine's fused decode weights are that memory itself, not copies (9 GB at Qwen3-8B, #51), with the base
    # frozen in the engine's dtype (float32 on CPU, bfloat16 on CUDA) or in another (its own copy, fused too)
    model = load_hf(base_dir, dtype=dtype, lora=options(base_dir, rank=4))
    prep = Engine(model, tok, dtype=dtype).prepare()
    layer, fused = model.model.layers[0], prep.weights["layers"][0]
    same = lambda a, b: a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert same(fused[1], layer.self_attn.q_proj.weight) and same(fused[5], layer.mlp.gate_proj.weight)
    assert torch.equal(fused[1], torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                            layer.self_attn.v_proj.weight]))
    assert torch.equal(fused[5], torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))
    copy = Engine(load_model(base_dir), tok, dtype=torch.bfloat16).prepare()  # a full model's bf16 copy: fused too
    copied = copy.model.model.layers[0]
    assert same(copy.weights["layers"][0][1], copied.self_attn.q_proj.weight)
    assert same(copy.weights["layers"][0][5], copied.mlp.gate_proj.weight)


@pytest.mark.parametrize("llama,dropout", [(False, 0.0), (True, 0.0), (False, 0.3)],
                         ids=["qwen3", "llama", "qwen3-dropout"])
def test_the_engine_samples_what_the_trainer_computes_with_random_adapters(tok, tmp_path, llama, dropout):
    """Adapters with a random B (not PEFT's zero start) on every layer, in the engine's fused decode step and
    in the trainer's forward, float32: the engine's log-probs of its own samples equal the trainer's. A Llama
    shape (no QK-norm, untied head, Llama-3 rope scaling) takes other paths through both than Qwen3's. With
    --lora-dropout the model trains in train mode, dropout on: the engine must sample without it, the function
    the trainer's evaluation-mode forward scores, or every sample would come from a random other model."""
    extra = dict(arch="llama", qk_norm=False, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}) if llama else {}
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                       intermediate_size=96, max_seq_len=256, **extra)
    save_hf(GPT(config), str(tmp_path / "base"), tok)
    base = str(tmp_path / "base")
    model = load_hf(base, lora=options(base, rank=4, alpha=8.0, dropout=dropout)).train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    prompts = [tok.render_for_completion([{"role": "user", "content": q}]) for q in ("What is 3 + 4?", "Hi")]
    outs = Engine(model, tok).generate(prompts, num_samples=2, max_new_tokens=12, seed=0)
    for i, o in enumerate(outs):
        p = prompts[i // 2]
        ids = torch.tensor([p + o.tokens])
        tgt = torch.full_like(ids, -100)
        tgt[0, len(p) - 1:-1] = ids[0, len(p):]
        with torch.no_grad():
            lp = model.eval()(ids, tgt)[0, len(p) - 1:-1]
            with adapters_off(model):
                assert (lp - model(ids, tgt)[0, len(p) - 1:-1]).abs().max() > 1e-2  # the adapters matter
            if dropout:  # dropout on would be another function
                assert (lp - model.train()(ids, tgt)[0, len(p) - 1:-1]).abs().max() > 1e-2
        model.train()
        torch.testing.assert_close(torch.tensor(o.logprobs), lp, atol=2e-4, rtol=1e-4)
