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
