import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest


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
    monkeypatch.setattr(engine, "decode_step", lambda model, tokens, cache, weights: (
        type(model).decode_step(model, tokens, cache, weights) if hasattr(type(model), "decode_step")
        else fused(model, tokens, cache, weights)))
