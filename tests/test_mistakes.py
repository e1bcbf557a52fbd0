"""The mistake tally: what a new user gets wrong, one row each, and what nanopost must answer. Every row ends in
exactly one line saying what and where (exit 2, no traceback), or in the right behaviour (a warning line and a run
that goes on). Each runs the script's main() in this process, as `python SCRIPT ARGS` would, on tiny folders made
here, so the whole table takes seconds; stages that fail only after training are not in it.

A row: (id, script, argv, what the line must say, setup). In argv, {chat} is a tiny chat model folder, {rm} a reward
model folder, {home} the run's $NANOPOST_HOME, {tmp} a scratch folder, and {name.jsonl} a file of DATA written
there. A `setup` callable prepares the home (an earlier run's checkpoints, a folder with something broken).
Rows whose `what` starts with "warn:" must run to the end and print that line."""
import json
import os
import shutil
import sys

import pytest
import torch

from checkpoint import save_hf
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Q = [{"role": "user", "content": "What is 2 + 2?"}]
A = [{"role": "assistant", "content": "#### 4"}]
SFT_ROW = {"messages": Q + A}
DATA = {  # name -> the lines of a JSONL file (a str is written as is, a dict as JSON)
    "sft.jsonl": [SFT_ROW] * 40,
    "few.jsonl": [SFT_ROW] * 30,
    "chatml.jsonl": [{"messages": [{"role": "user", "content": "<|im_start|>user\nhi<|im_end|>"}] + A}] * 40,
    "bad_json.jsonl": [SFT_ROW, "{not json"],
    "not_object.jsonl": ["[1, 2]"],
    "no_messages.jsonl": [{"conversation": []}],
    "messages_str.jsonl": [{"messages": "hi"}],
    "robot.jsonl": [{"messages": [{"role": "robot", "content": "x"}] + A}],
    "content_number.jsonl": [{"messages": [{"role": "user", "content": 4}] + A}],
    "no_assistant.jsonl": [{"messages": Q}],
    "user_tool_calls.jsonl": [{"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}] + A}],
    "bad_arguments.jsonl": [{"messages": Q + [{"role": "assistant", "content": "",
                                              "tool_calls": [{"name": "calc", "arguments": "{2+2"}]}]}],
    "user_reasoning.jsonl": [{"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}] + A}],
    "empty.jsonl": ["", ""],
    "tools_not_list.jsonl": [{**SFT_ROW, "tools": "calculator"}],
    "same_pair.jsonl": [{"prompt": Q, "chosen": A, "rejected": A}],
    "no_rejected.jsonl": [{"prompt": Q, "chosen": A}],
    "pair_user_first.jsonl": [{"prompt": Q, "chosen": Q, "rejected": A}],
    "no_shared_prompt.jsonl": [{"chosen": A, "rejected": [{"role": "assistant", "content": "5"}]}],
    "label_yes.jsonl": [{"prompt": Q, "completion": A, "label": "yes"}],
    "completion_user.jsonl": [{"prompt": Q, "completion": Q, "label": True}],
    "only_good.jsonl": [{"prompt": Q, "completion": A, "label": True}] * 16,
    "rl_regex.jsonl": [{"prompt": Q, "ground_truth": "4", "verifier": "regex"}],
    "rl_no_truth.jsonl": [{"prompt": Q, "verifier": "gsm8k"}],
    "rl_word_truth.jsonl": [{"prompt": Q, "ground_truth": "four", "verifier": "gsm8k"}],
    "rl_ends_assistant.jsonl": [{"prompt": Q + A, "ground_truth": "4", "verifier": "gsm8k"}],
    "rl_unknown_source.jsonl": [{"data_source": "my/poetry", "prompt": Q, "reward_model": {"ground_truth": "4"}}],
    "rl_math_in_name.jsonl": [{"data_source": "my-math-poems", "prompt": Q, "reward_model": {"ground_truth": "4"}}],
    "rl_bad_json_truth.jsonl": [{"prompt": Q, "ground_truth": "{oops", "verifier": "json"}],
    "rl_bad_code_truth.jsonl": [{"prompt": Q, "ground_truth": "assert f(1) ==", "verifier": "code"}],
    "rl.jsonl": [{"prompt": Q, "ground_truth": "4", "verifier": "gsm8k"}] * 8,
    "bad_utf8.jsonl": [b"\xff\xfe{}".decode("latin-1")],
}
TINY_SFT = ["--num-train", "64", "--num-val", "2", "--eval-problems", "0", "--batch-size", "8", "--steps", "1"]
TINY_RL = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems",
           "0", "--num-prompts", "8"]
TINY_PREF = ["--num-train", "8", "--num-val", "2", "--eval-problems", "0", "--batch-size", "4", "--steps", "1"]


def held_checkpoint(stage, **run_config):
    """A setup: $NANOPOST_HOME/<stage>/default holds a finished run's checkpoint, its run_config as given."""
    def setup(home, folders):
        ckpt = os.path.join(home, stage, "default", "checkpoints", "step_000001")
        shutil.copytree(folders["chat"], ckpt)
        with open(os.path.join(ckpt, "trainer_state.json"), "w") as f:
            json.dump({"step": 1, "run_config": run_config}, f)
    return setup


def sft_flags(**changed):
    """chat_sft.py's flags as parsed from TINY_SFT and --init {chat}, some changed: a run_config."""
    import chat_sft
    flags = vars(chat_sft.parser.parse_args(["--init", "CHAT", *TINY_SFT]))
    return {**flags, **changed}


def broken(name, edit):
    """A setup: folders[name] is a copy of the chat folder with `edit(path)` applied."""
    def setup(home, folders):
        path = os.path.join(home, name)
        shutil.copytree(folders["chat"], path)
        edit(path)
        folders[name] = path
    return setup


def drop(*files):
    return lambda path: [os.remove(os.path.join(path, f)) for f in files]


def write(file, text):
    return lambda path: open(os.path.join(path, file), "w").write(text)


def retype(model_type):
    def edit(path):
        config = json.load(open(os.path.join(path, "config.json")))
        config["model_type"] = model_type
        json.dump(config, open(os.path.join(path, "config.json"), "w"))
    return edit


def shrink_vocab(path):  # the tokenizer of a larger model: its ids run past this model's embedding
    config = json.load(open(os.path.join(path, "config.json")))
    config["vocab_size"] = 100
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


def pytorch_bin(path):
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))


def rubric(text):
    def setup(home, folders):
        with open(os.path.join(home, "rubric.txt"), "w") as f:
            f.write(text)
    return setup


MISTAKES = [
    # ---- data files: the file and line named, before any model is looked for
    ("sft-data-missing", "chat_sft", ["--data", "{tmp}/nowhere.jsonl"], "--data"),
    ("sft-eval-data-missing", "chat_sft", ["--data", "{sft.jsonl}", "--eval-data", "{tmp}/nowhere.jsonl"],
     "--eval-data"),
    ("sft-invalid-json", "chat_sft", ["--data", "{bad_json.jsonl}"], "bad_json.jsonl:2: invalid JSON"),
    ("sft-row-not-object", "chat_sft", ["--data", "{not_object.jsonl}"], "expected a JSON object"),
    ("sft-no-messages", "chat_sft", ["--data", "{no_messages.jsonl}"], "missing key 'messages'"),
    ("sft-messages-string", "chat_sft", ["--data", "{messages_str.jsonl}"], "'messages' must be a list"),
    ("sft-unknown-role", "chat_sft", ["--data", "{robot.jsonl}"], "unknown role 'robot'"),
    ("sft-content-number", "chat_sft", ["--data", "{content_number.jsonl}"], ".content must be a string"),
    ("sft-no-assistant", "chat_sft", ["--data", "{no_assistant.jsonl}"], "no assistant message"),
    ("sft-tool-calls-on-user", "chat_sft", ["--data", "{user_tool_calls.jsonl}"], "tool_calls must be a list on an"),
    ("sft-tool-arguments-not-json", "chat_sft", ["--data", "{bad_arguments.jsonl}"], "not valid JSON"),
    ("sft-reasoning-on-user", "chat_sft", ["--data", "{user_reasoning.jsonl}"], "reasoning_content must be a string"),
    ("sft-empty-file", "chat_sft", ["--data", "{empty.jsonl}"], "no rows"),
    ("sft-tools-not-list", "chat_sft", ["--data", "{tools_not_list.jsonl}"], "'tools' must be a list"),
    ("sft-bad-utf8", "chat_sft", ["--data", "{bad_utf8.jsonl}"], "bad_utf8.jsonl:1"),
    ("dpo-identical-pair", "chat_dpo", ["--data", "{same_pair.jsonl}"], "identical"),
    ("dpo-no-rejected", "chat_dpo", ["--data", "{no_rejected.jsonl}"], "missing key 'rejected'"),
    ("rm-chosen-starts-with-user", "chat_rm", ["--data", "{pair_user_first.jsonl}"], "must start with an assistant"),
    ("dpo-implicit-prompt-none", "chat_dpo", ["--data", "{no_shared_prompt.jsonl}"], "no 'prompt' key"),
    ("kto-label-not-bool", "chat_kto", ["--data", "{label_yes.jsonl}"], "'label' must be true"),
    ("kto-completion-user", "chat_kto", ["--data", "{completion_user.jsonl}"], "must start with an assistant"),
    ("rl-unknown-verifier", "chat_rl", ["--data", "{rl_regex.jsonl}"], "unknown verifier 'regex'"),
    ("rl-no-ground-truth", "chat_rl", ["--data", "{rl_no_truth.jsonl}"], "missing key 'ground_truth'"),
    ("rl-word-ground-truth", "chat_rl", ["--data", "{rl_word_truth.jsonl}"], "must be a number"),
    ("rl-prompt-ends-with-assistant", "chat_ppo", ["--data", "{rl_ends_assistant.jsonl}"], "ends with an assistant"),
    ("rl-unknown-data-source", "chat_rl", ["--data", "{rl_unknown_source.jsonl}"], "add a 'verifier' key"),
    ("rl-data-source-by-substring", "chat_rl", ["--data", "{rl_math_in_name.jsonl}"], "'my-math-poems' is not one"),
    ("rl-json-truth", "chat_rl", ["--data", "{rl_bad_json_truth.jsonl}"], "JSON list of required keys"),
    ("rl-code-truth", "chat_distill", ["--data", "{rl_bad_code_truth.jsonl}"], "rl_bad_code_truth.jsonl:1"),
    ("sample-data-missing", "chat_sample", ["--data", "{tmp}/nowhere.jsonl", "--out", "{tmp}/o.jsonl"], "no such file"),
    # ---- model folders: the flag that named it, in one line, before a weight is read
    ("sft-init-missing", "chat_sft", ["--init", "{tmp}/nowhere"], "--init"),
    ("sft-init-empty-dir", "chat_sft", ["--init", "{tmp}"], "neither a model folder"),
    ("sft-init-reward-model", "chat_sft", ["--init", "{rm}"], "is a reward model or critic"),
    ("dpo-init-reward-model", "chat_dpo", ["--init", "{rm}"], "is a reward model or critic"),
    ("kto-init-reward-model", "chat_kto", ["--init", "{rm}"], "is a reward model or critic"),
    ("rl-init-reward-model", "chat_rl", ["--init", "{rm}"], "is a reward model or critic"),
    ("ppo-init-reward-model", "chat_ppo", ["--init", "{rm}"], "is a reward model or critic"),
    ("distill-teacher-reward-model", "chat_distill", ["--init", "{chat}", "--teacher", "{rm}"], "--teacher"),
    ("eval-model-reward-model", "chat_eval", ["--model", "{rm}"], "--model"),
    ("cli-init-reward-model", "chat_cli", ["--init", "{rm}"], "is a reward model or critic"),
    ("sample-init-reward-model", "chat_sample", ["--init", "{rm}", "--out", "{tmp}/o.jsonl"], "reward model"),
    ("ppo-critic-init-missing", "chat_ppo", ["--init", "{chat}", "--critic-init", "{tmp}/nowhere"], "--critic-init"),
    ("distill-teacher-missing", "chat_distill", ["--init", "{chat}", "--teacher", "{tmp}/nowhere"], "--teacher"),
    ("rl-reward-rm-is-a-chat-model", "chat_rl", ["--init", "{chat}", "--reward", "rm:{chat}"], "not a reward model"),
    ("rl-reward-rm-missing", "chat_rl", ["--init", "{chat}", "--reward", "rm:{tmp}/nowhere"], "rm:"),
    ("rl-reward-judge-is-a-reward-model", "chat_rl", ["--init", "{chat}", "--reward", "judge:{rm}", "--rubric",
                                                       "{home}/rubric.txt"], "judge:", rubric("Scale: 0-10\nGrade.")),
    ("sft-tokenizer-of-another-model", "chat_sft", ["--init", "{small_vocab}", *TINY_SFT], "embedding rows",
     broken("small_vocab", shrink_vocab)),
    ("rl-no-tokenizer", "chat_rl", ["--init", "{no_tok}"], "no tokenizer.json",
     broken("no_tok", drop("tokenizer.json"))),
    ("sft-malformed-tokenizer", "chat_sft", ["--init", "{bad_tok}", *TINY_SFT], "not a tokenizer.json",
     broken("bad_tok", write("tokenizer.json", "{oops"))),
    ("dpo-unsupported-model-type", "chat_dpo", ["--init", "{gpt2}"], "model_type 'gpt2'",
     broken("gpt2", retype("gpt2"))),
    ("sft-no-weights", "chat_sft", ["--init", "{no_weights}", *TINY_SFT], "no model.safetensors",
     broken("no_weights", drop("model.safetensors"))),
    ("sft-pytorch-bin", "chat_sft", ["--init", "{bin}", *TINY_SFT], "re-save it", broken("bin", pytorch_bin)),
    # ---- flags: a value no flag of its name can mean
    ("sft-negative-lr", "chat_sft", ["--lr", "-1"], "--lr -1.0: must be > 0"),
    ("sft-batch-size-0", "chat_sft", ["--batch-size", "0"], "--batch-size 0: must be >= 1"),
    ("sft-epochs-0", "chat_sft", ["--epochs", "0"], "--epochs 0.0: must be > 0"),
    ("rl-group-size-1", "chat_rl", ["--group-size", "1"], "has nothing to be compared with"),
    ("rl-temperature-0", "chat_rl", ["--temperature", "0"], "--temperature 0.0: must be > 0"),
    ("rl-top-p-1.5", "chat_rl", ["--top-p", "1.5"], "--top-p 1.5: must be > 0 and <= 1"),
    ("ppo-eps-low-1.5", "chat_ppo", ["--eps-low", "1.5"], "--eps-low 1.5"),
    ("rl-negative-kl-beta", "chat_rl", ["--kl-beta", "-0.1"], "--kl-beta -0.1"),
    ("distill-gkd-beta-1.5", "chat_distill", ["--mode", "gkd", "--gkd-beta", "1.5"],
     "--gkd-beta 1.5: must be >= 0 and <= 1"),
    ("rl-top-entropy-0", "chat_rl", ["--top-entropy", "0"], "--top-entropy 0.0: must be > 0 and <= 1"),
    ("distill-gkd-fsdp", "chat_distill", ["--mode", "gkd", "--fsdp"], "use DDP"),
    ("rl-max-new-tokens-0", "chat_rl", ["--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("sft-seq-len-1", "chat_sft", ["--seq-len", "1"], "--seq-len 1"),
    ("sft-lora-dropout-1", "chat_sft", ["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout 1.0"),
    ("dpo-label-smoothing-half", "chat_dpo", ["--label-smoothing", "0.5"], "--label-smoothing 0.5"),
    ("rl-dual-clip-below-1", "chat_rl", ["--dual-clip", "0.5"], "--dual-clip 0.5"),
    ("ppo-gamma-above-1", "chat_ppo", ["--gamma", "1.5"], "--gamma 1.5"),
    ("rm-warmup-negative", "chat_rm", ["--warmup-steps", "-3"], "--warmup-steps -3"),
    ("base-zero-layers", "base_train", ["--n-layer", "0"], "--n-layer 0"),
    ("eval-negative-temperature", "chat_eval", ["--model", "{chat}", "--temperature", "-1"], "--temperature -1.0"),
    ("sample-top-k-0", "chat_sample", ["--top-k", "0", "--out", "{tmp}/o.jsonl"], "--top-k 0"),
    ("cli-max-new-tokens-0", "chat_cli", ["--init", "{chat}", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("sft-device-mps", "chat_sft", ["--init", "{chat}", "--device", "mps"], "--device mps"),
    ("rl-device-typo", "chat_rl", ["--init", "{chat}", "--device", "gpu"], "--device gpu"),
    ("sft-packing-typo", "chat_sft", ["--packing", "greedy"], "invalid choice: 'greedy'"),
    ("rl-unknown-flag", "chat_rl", ["--lerning-rate", "1e-5"], "unrecognized arguments: --lerning-rate"),
    ("sft-batch-not-multiple", "chat_sft", ["--init", "{chat}", *TINY_SFT, "--batch-size", "6", "--device-batch-size",
                                            "4"], "--batch-size 6 must be a multiple"),
    ("sft-batch-larger-than-data", "chat_sft", ["--init", "{chat}", "--num-train", "4", "--packing", "none",
                                                "--batch-size", "8", "--steps", "1", "--eval-problems", "0"],
     "larger than the data"),
    ("rl-dual-clip-with-cispo", "chat_rl", ["--loss", "cispo", "--dual-clip", "3"], "CISPO has none to bound"),
    ("rl-lora-dropout", "chat_rl", ["--init", "{chat}", *TINY_RL, "--lora-rank", "4", "--lora-dropout", "0.1"],
     "--lora-dropout 0.1"),
    ("ppo-lora-dropout", "chat_ppo", ["--init", "{chat}", "--critic-init", "{chat}", "--steps", "1", "--lora-rank", "4",
                                      "--lora-dropout", "0.1"], "--lora-dropout 0.1"),
    ("dpo-orpo-with-live-ref", "chat_dpo", ["--loss", "orpo", "--ref", "live"], "ORPO has no reference"),
    ("dpo-rpo-with-orpo", "chat_dpo", ["--loss", "orpo", "--rpo-alpha", "1"], "--loss orpo has it already"),
    ("rl-reward-typo", "chat_rl", ["--init", "{chat}", "--reward", "verifier+0.1*vibes"], "cannot read '0.1*vibes'"),
    ("rl-reward-twice", "chat_rl", ["--init", "{chat}", "--reward", "verifier+verifier"], "names a grader twice"),
    ("ppo-judge-without-rubric", "chat_ppo", ["--init", "{chat}", "--critic-init", "{chat}", "--reward",
                                              "judge:{chat}"], "pass --rubric"),
    ("rl-rubric-missing", "chat_rl", ["--init", "{chat}", "--reward", "judge:{chat}", "--rubric", "{tmp}/no.txt"],
     "no such rubric file"),
    ("rl-rubric-without-scale", "chat_rl", ["--init", "{chat}", "--reward", "judge:{chat}", "--rubric",
                                            "{home}/rubric.txt"], "exactly one line 'Scale", rubric("Grade it.")),
    ("sft-wandb-not-installed", "chat_sft", ["--init", "{chat}", *TINY_SFT, "--wandb", "proj"], "pip install wandb"),
    ("eval-compare-one-problem", "chat_eval", ["--compare", "{chat}", "{chat}", "--problems", "1"],
     "at least 2 problems"),
    ("eval-two-modes", "chat_eval", ["--model", "{chat}", "--report"], "pass one of"),
    ("decontaminate-n-0", "decontaminate", ["--data", "{sft.jsonl}", "--against", "{sft.jsonl}", "--n", "0"],
     "at least 1 word"),
    ("decontaminate-against-missing", "decontaminate", ["--data", "{sft.jsonl}", "--against", "{tmp}/no.jsonl"],
     "--against"),
    ("merge-weights-count", "merge", ["{chat}", "{chat}", "--out", "{tmp}/m", "--weights", "1"], "one per folder"),
    ("merge-one-folder", "merge", ["{chat}", "--out", "{tmp}/m"], "at least 2 folders"),
    # ---- run directories: nothing lost
    ("sft-resume-without-checkpoint", "chat_sft", ["--init", "{chat}", "--resume", *TINY_SFT],
     "--resume: no checkpoint"),
    ("sft-resume-and-overwrite", "chat_sft", ["--init", "{chat}", "--resume", "--overwrite"], "pass one of them"),
    ("sft-run-dir-taken", "chat_sft", ["--init", "{chat}", *TINY_SFT], "holds another run's checkpoints",
     held_checkpoint("sft")),
    ("sft-overwrite-deletes-input", "chat_sft", ["--init", "{home}/sft/default/checkpoints/step_000001", "--overwrite",
                                                 *TINY_SFT], "an input of this run", held_checkpoint("sft")),
    ("sft-resume-with-another-seq-len", "chat_sft", ["--init", "{chat}", *TINY_SFT, "--resume", "--seq-len", "256"],
     "--seq-len 256 (the run's: 512)", held_checkpoint("sft", **sft_flags(init="{chat}"))),
    ("sft-resume-with-another-seed", "chat_sft", ["--init", "{chat}", *TINY_SFT, "--resume", "--seed", "3"],
     "--seed 3 (the run's: 0)", held_checkpoint("sft", **sft_flags(init="{chat}"))),
    ("sft-overwrite-without-tokenizer", "chat_sft", ["--init", "{no_tok}", "--overwrite", *TINY_SFT],
     "no tokenizer.json", lambda home, folders: (held_checkpoint("sft")(home, folders),
                                                 broken("no_tok", drop("tokenizer.json"))(home, folders))),
    ("cpu-autocast-typo", "chat_sft", ["--init", "{chat}", *TINY_SFT], "NANOPOST_CPU_AUTOCAST=float16",
     lambda home, folders: os.environ.__setitem__("NANOPOST_CPU_AUTOCAST", "float16")),
    # ---- accepted, and said: the run goes on
    ("sft-data-already-chatml", "chat_sft", ["--init", "{chat}", "--data", "{chatml.jsonl}", "--steps", "1",
                                             "--packing", "none", "--batch-size", "8"],
     "warn:chatml.jsonl:1: a message already holds ChatML"),
    ("sft-few-held-out-rows", "chat_sft", ["--init", "{chat}", "--data", "{few.jsonl}", "--steps", "1", "--packing",
                                           "none", "--batch-size", "8"],
     "warn:the held-out loss rests on 1 conversation"),
    ("kto-only-desirable", "chat_kto", ["--init", "{chat}", "--data", "{only_good.jsonl}", "--steps", "1",
                                        "--batch-size", "4"], "warn:is labelled true"),
    ("rl-more-prompts-per-step-than-prompts", "chat_rl", ["--init", "{chat}", "--data", "{rl.jsonl}", *TINY_RL[:2],
                                                          "--prompts-per-step", "12", "--group-size", "2",
                                                          "--max-new-tokens", "4", "--eval-problems", "0"],
     "warn:--prompts-per-step 12 with only 7 training prompts"),
]


@pytest.fixture(scope="module")
def folders(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("mistake_folders")
    out = {}
    for name, head in (("chat", "lm"), ("rm", "scalar")):
        torch.manual_seed(0)
        save_hf(GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                              intermediate_size=64, max_seq_len=512, head=head)), str(root / name), tok)
        out[name] = str(root / name)
    return out


def fill(arg, home, tmp, folders):
    for name in DATA:
        arg = arg.replace("{" + name + "}", os.path.join(tmp, name))
    for name, path in folders.items():
        arg = arg.replace("{" + name + "}", path)
    return arg.replace("{home}", home).replace("{tmp}", tmp)


def test_the_table_has_80_mistakes_each_once():
    assert len(MISTAKES) >= 80 and len({m[0] for m in MISTAKES}) == len(MISTAKES)


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_gets_one_clean_line_or_the_right_behaviour(mistake, folders, tmp_path, monkeypatch, capsys):
    name, script, argv, what, *setup = mistake
    home, tmp = str(tmp_path / "home"), str(tmp_path / "tmp")
    os.makedirs(home)
    os.makedirs(tmp)
    for file, lines in DATA.items():
        with open(os.path.join(tmp, file), "w", encoding="latin-1" if "utf8" in file else "utf-8") as f:
            f.write("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    folders = dict(folders)
    monkeypatch.setenv("NANOPOST_CPU_AUTOCAST", "float32")
    if setup:
        setup[0](home, folders)
        for root, _, files in os.walk(home):  # a held checkpoint's run_config names the chat folder as {chat}
            for f in files:
                if f == "trainer_state.json":
                    path = os.path.join(root, f)
                    text = open(path).read()
                    open(path, "w").write(fill(text, home, tmp, folders))
    monkeypatch.setenv("NANOPOST_HOME", home)
    import importlib
    from common import run_main
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *(fill(a, home, tmp, folders) for a in argv)])
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # chat_cli reads its turns: none come
    try:
        with pytest.raises(SystemExit) as ended:
            run_main(module.main)
        code = ended.value.code
    except pytest.fail.Exception:
        code = 0  # main returned: the run went to its end
    finally:
        os.environ.pop("NANOPOST_CPU_AUTOCAST", None)
    out, err = capsys.readouterr()
    if what.startswith("warn:"):
        assert code in (0, None), err[-2000:]
        assert what[5:] in out + err, (out + err)[-3000:]
        return
    assert code == 2, (code, err[-2000:])
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1, err[-2000:]
    assert what in errors[0], errors[0]


def test_every_numeric_flag_has_a_range_or_is_free():
    """Each int or float flag of every script is in common.FLAG_RANGES (values it cannot mean are refused) or in
    FREE_NUMBERS (any value means something): a new flag fails here until it is placed."""
    from common import FLAG_RANGES, FREE_NUMBERS
    from test_flag_table import STAGES, parser_of
    numeric = {a.dest for stage in STAGES for a in parser_of(stage)._actions if a.type in (int, float)}
    assert numeric - set(FLAG_RANGES) - FREE_NUMBERS == set()
    assert not (set(FLAG_RANGES) & FREE_NUMBERS) and FREE_NUMBERS <= numeric
