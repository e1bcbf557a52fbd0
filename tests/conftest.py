import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest

# On a CPU with bfloat16 units the stages train under bfloat16 autocast (common.train_dtype), elsewhere in
# float32. The suite pins float32, in this process and in the stages it runs as subprocesses, so that every
# machine checks the same numbers; tests/test_cpu_autocast.py sets bfloat16 where it tests that path.
os.environ["NANOPOST_CPU_AUTOCAST"] = "float32"

# runs/test.sh runs one pytest-xdist worker per usable core. Each worker gets its share of the cores, as
# torchrun's ranks do (common.init_dist): two workers of two threads each on two cores run several times
# slower than two of one. OMP_NUM_THREADS carries the share to the stages that tests run as subprocesses.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch
    from common import usable_cpus
    _threads = max(1, usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


@pytest.fixture(scope="session")
def tok():
    """A small BPE trained on the embedded world, as base_train.py trains the real one."""
    from tasks import pretrain_text, sft_conversations
    from tokenizer import Tokenizer, render_text
    texts = pretrain_text("train", 2000) + [render_text(c["messages"], tools=c.get("tools"))
                                            for c in sft_conversations("train", 500)]
    return Tokenizer.train(texts, vocab_size=512)


@pytest.fixture(autouse=True)
def scripted_models_decode_themselves(monkeypatch):
    """The engine decodes with engine.decode_step over the model's fused weights. A test model that scripts
    its next token (test_engine.ScriptedGPT, test_judge.ScriptedJudge) has no weights to fuse: it defines its
    own decode_step method, which the engine then calls instead."""
    import engine
    fused = engine.decode_step
    monkeypatch.setattr(engine, "decode_step", lambda model, tokens, cache, weights, **kwargs: (
        type(model).decode_step(model, tokens, cache, weights) if hasattr(type(model), "decode_step")
        else fused(model, tokens, cache, weights, **kwargs)))


@pytest.fixture(scope="session")
def lab_home(tmp_path_factory):
    """A $NANOPOST_HOME holding what the lab's experiments start from (runs/cpu.sh's base, SFT and reward-model
    runs), shrunk to seconds as tests/test_pipeline.py shrinks the main job; without the calculator, whose tool
    prompt overflows a 400-token vocabulary's 512 positions."""
    import subprocess
    from test_pipeline import PIPELINE, REPO
    home = tmp_path_factory.mktemp("lab_home")
    env = {**os.environ, "NANOPOST_HOME": str(home), "OMP_NUM_THREADS": "1"}
    for _, script, args in PIPELINE[:3]:  # base, SFT, RM
        r = subprocess.run([sys.executable, os.path.join(REPO, script), *args], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{script}: {r.stderr[-3000:]}"
    return home
