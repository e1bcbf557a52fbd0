"""
Users' data: JSONL files in the forms people export from the Hugging Face hub, each row normalized to the
dicts the embedded world's generators produce (tasks.py), so a stage never knows which it reads.

    SFT           {"messages": [...], "tools": [...]?}                                     load_sft
    preferences   {"prompt", "chosen", "rejected"} (strings or message lists; TRL's        load_preferences
                  implicit prompt too: chosen and rejected sharing their first messages)
    KTO           {"prompt", "completion", "label"}, or preference pairs                   load_kto
    RL            {"prompt", "ground_truth", "verifier"}, or verl's rows (data_source      load_rl
                  naming the verifier, reward_model.ground_truth)

SFT and RL rows may name their `source` (verl's data_source is one), and --data may mix several files in
proportion, "a.jsonl:0.7,b.jsonl:0.3" (mixture_rows): each row of a mixture is of its file's source, and the
stages' metrics are broken down by source (val_loss/<source>, source/<source>/accuracy).

A malformed line is a UserError naming the file and the line ("rl.jsonl:17: missing key 'ground_truth'");
nothing is skipped silently. An RL row's ground truth is checked against its verifier up front.
"""
import json
import math
import os
import random
from typing import Callable

from common import UserError, print0
from verifiers import VERIFIERS, check_ground_truth
from tasks import rl_prompts

ROLES = ("system", "user", "assistant", "tool")


def _require(row: dict, *keys: str) -> None:
    for key in keys:
        if key not in row:
            raise ValueError(f"missing key {key!r} (row has {sorted(row)})")


def _tool_call(call: object, where: str) -> dict:
    if isinstance(call, dict) and isinstance(call.get("function"), dict):  # OpenAI form
        call = call["function"]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f"{where} must be {{'name': str, 'arguments': {{...}}}} or the OpenAI function form")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError(f"{where}.arguments is a string but not valid JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.arguments must be a JSON object")
    return {"name": call["name"], "arguments": arguments}


def _message(m: object, where: str) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object {{'role': ..., 'content': ...}}, got {type(m).__name__}")
    if m.get("role") not in ROLES:
        raise ValueError(f"{where} has unknown role {m.get('role')!r}; use one of {ROLES}")
    out = {"role": m["role"], "content": m.get("content")}
    if out["content"] is None and m.get("tool_calls"):  # OpenAI writes null content beside tool calls
        out["content"] = ""
    if not isinstance(out["content"], str):
        raise ValueError(f"{where}.content must be a string, got {type(out['content']).__name__}")
    if m.get("reasoning_content") is not None:
        if m["role"] != "assistant" or not isinstance(m["reasoning_content"], str):
            raise ValueError(f"{where}.reasoning_content must be a string on an assistant message")
        out["reasoning_content"] = m["reasoning_content"]
    if m.get("tool_calls"):
        if m["role"] != "assistant" or not isinstance(m["tool_calls"], list):
            raise ValueError(f"{where}.tool_calls must be a list on an assistant message")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(m["tool_calls"])]
    return out


def _messages(value: object, field: str, role: str) -> list[dict]:
    """A message list, or a bare string taken as one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field!r} must be a string or a non-empty list of messages, got {value!r:.80}")
    return [_message(m, f"{field}[{i}]") for i, m in enumerate(value)]


def _holds_chatml(value) -> bool:
    """Whether any string inside a row is already rendered chat text (Qwen's ChatML markers)."""
    if isinstance(value, str):
        return "<|im_start|>" in value or "<|im_end|>" in value
    if isinstance(value, dict):
        return any(_holds_chatml(v) for v in value.values())
    return isinstance(value, list) and any(_holds_chatml(v) for v in value)


def load_jsonl(path: str, normalize: Callable[[dict], object] = dict, flag: str = "--data") -> list:
    """One JSON object per line (blank lines allowed), each passed through normalize. flag: the flag that named
    the file, for the error when there is none."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file")
    rows, wrapped = [], []  # wrapped: the lines whose text is already rendered ChatML
    with open(path, "rb") as f:  # bytes, so that bad UTF-8 is reported with its line too
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{lineno}: invalid JSON ({e}); write one JSON object per line") from None
            try:
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                rows.append(normalize(row))
                if _holds_chatml(row):
                    wrapped.append(lineno)
            except ValueError as e:
                raise UserError(f"{path}:{lineno}: {e}") from None
    if not rows:
        raise UserError(f"{path}: no rows; expected one JSON object per line")
    if wrapped:
        print0(f"warning: {path}:{wrapped[0]}: a message already holds ChatML (<|im_start|> or <|im_end|>), and "
               f"{len(wrapped)} row(s) like it: nanopost renders every message as a turn of its own, so this text "
               f"is wrapped a second time. Pass the turns as a list of messages instead (docs/real-models.md, "
               f"data formats: TRL takes a string row as raw text, nanopost as one turn)")
    return rows


def _tools(row: dict) -> dict:
    """{"tools": [...]} when the row offers tools (JSON schemas, as the chat template lists them), else {}."""
    if row.get("tools") is None:
        return {}
    if not isinstance(row["tools"], list) or not all(isinstance(t, dict) for t in row["tools"]):
        raise ValueError("'tools' must be a list of JSON schemas")
    return {"tools": row["tools"]}


def sft_row(row: dict) -> dict:
    _require(row, "messages")
    if not isinstance(row["messages"], list):
        raise ValueError("'messages' must be a list of messages")
    out = {"messages": _messages(row["messages"], "messages", "user")}
    if not any(m["role"] == "assistant" for m in out["messages"]):
        raise ValueError("no assistant message, so nothing to train on")
    return {**out, **_tools(row), **_source(row.get("source"))}


def _source(source: object) -> dict:
    """A row's source, kept when it names one (a string), for the metrics broken down by source."""
    return {"source": source} if isinstance(source, str) and source else {}


def preference_row(row: dict) -> dict:
    _require(row, "chosen", "rejected")
    chosen = _messages(row["chosen"], "chosen", "assistant")
    rejected = _messages(row["rejected"], "rejected", "assistant")
    if "prompt" in row:
        prompt = _messages(row["prompt"], "prompt", "user")
    else:  # TRL's implicit prompt: chosen and rejected are whole conversations sharing the prompt
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        if not prompt:
            raise ValueError("no 'prompt' key, and chosen/rejected share no leading messages to take it from")
    for field, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[0]["role"] != "assistant":
            raise ValueError(f"{field!r} must start with an assistant message after the prompt")
    if chosen == rejected:
        raise ValueError("'chosen' and 'rejected' are identical")
    margin = row.get("margin", 0.0)  # graded preferences: how much surer the labelers were (Llama 2's margin)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"'margin' must be a finite number (the gap the reward model's loss asks for), got {margin!r}")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **_tools(row),
            **({"margin": float(margin)} if "margin" in row else {})}


def kto_rows(row: dict) -> list[dict]:
    """KTO's single answers: {"prompt", "completion", "label"} (TRL's unpaired form, label true for a good
    answer), or a preference pair, which gives its chosen answer as good and its rejected one as bad."""
    if "label" not in row:
        pair = preference_row(row)
        return [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True, **_tools(row)},
                {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False, **_tools(row)}]
    _require(row, "prompt", "completion")
    if not isinstance(row["label"], bool):
        raise ValueError(f"'label' must be true (a good answer) or false (a bad one), got {row['label']!r}")
    completion = _messages(row["completion"], "completion", "assistant")
    if completion[0]["role"] != "assistant":
        raise ValueError("'completion' must start with an assistant message")
    return [{"prompt": _messages(row["prompt"], "prompt", "user"), "completion": completion, "label": row["label"],
             **_tools(row)}]


# verl names the reward function by the data set (verl.utils.reward_score.default_compute_score): its names,
# matched exactly, onto our verifiers; any other data_source is an error asking for a "verifier" key, never a
# guess by substring (a name that merely contains "math" or "code" may be anything)
VERL_SOURCES = {"openai/gsm8k": "gsm8k", "gsm8k": "gsm8k", "lighteval/MATH": "boxed",
                "DigitalLearningGmbH/MATH-lighteval": "boxed", "HuggingFaceH4/MATH-500": "boxed",
                "math_dapo": "boxed", "numina_aops_forum": "boxed", "numina_synthetic_math": "boxed",
                "numina_amc_aime": "boxed", "numina_synthetic_amc": "boxed", "numina_cn_k12": "boxed",
                "numina_olympiads": "boxed",
                "codecontests": "code", "apps": "code", "codeforces": "code", "taco": "code",
                # the code sets' own names on the hub, as open-instruct and prime-rl export them
                "codeparrot/apps": "code", "BAAI/TACO": "code", "deepmind/code_contests": "code", "mbpp": "code",
                "openai_humaneval": "code", "livecodebench": "code",
                "PrimeIntellect/verifiable-coding-problems": "code"}


def _verifier_for(data_source: object) -> str:
    """The verifier of a verl row: our verifier names, verl's data-set names (VERL_SOURCES), and verl's aime*."""
    source = str(data_source)
    if source in VERIFIERS:
        return source
    if source in VERL_SOURCES:
        return VERL_SOURCES[source]
    if source.startswith("aime"):  # verl grades aime2024, aime2025, ... as math_dapo
        return "boxed"
    raise ValueError(f"data_source {data_source!r} is not one nanopost knows how to grade (verl's: "
                     f"{', '.join(sorted(VERL_SOURCES))}, aime*); add a 'verifier' key, one of {list(VERIFIERS)}")


def rl_row(row: dict) -> dict:
    _require(row, "prompt")
    prompt = _messages(row["prompt"], "prompt", "user")
    if prompt[-1]["role"] == "assistant":
        raise ValueError("'prompt' ends with an assistant message; it must end where the model answers")
    if "verifier" in row:
        verifier = row["verifier"]
        if not isinstance(verifier, str) or verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; known: {', '.join(VERIFIERS)}")
    elif "data_source" in row:
        verifier = _verifier_for(row["data_source"])
    else:
        raise ValueError(f"missing key 'verifier' (one of {list(VERIFIERS)}) or verl's 'data_source'")
    reward_model = row.get("reward_model")
    if "ground_truth" in row:
        truth = row["ground_truth"]
    elif isinstance(reward_model, dict) and "ground_truth" in reward_model:
        truth = reward_model["ground_truth"]
    else:
        raise ValueError("missing key 'ground_truth' (or verl's 'reward_model': {'ground_truth': ...})")
    if verifier == "code" and isinstance(truth, list) and all(isinstance(t, str) for t in truth):
        truth = "\n".join(truth)  # a list of asserts (open-instruct's code rows)
    elif isinstance(truth, (list, dict)):
        truth = json.dumps(truth)  # the json verifier's required keys; a code row's input/output pairs
    elif isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str):
        raise ValueError(f"ground_truth must be a string or a number, got {type(truth).__name__}")
    check_ground_truth(verifier, truth)  # ValueError if it cannot be graded against; runs nothing
    return {"prompt": prompt, "ground_truth": truth, "verifier": verifier,
            **_source(row.get("source", row.get("data_source")))}


def load_sft(path: str, flag: str = "--data") -> list[dict]:
    return load_jsonl(path, sft_row, flag)


def load_preferences(path: str, flag: str = "--data") -> list[dict]:
    return load_jsonl(path, preference_row, flag)


def load_kto(path: str, flag: str = "--data") -> list[dict]:
    """Single answers labeled good or bad, from unpaired rows or preference pairs (see kto_rows)."""
    return [single for singles in load_jsonl(path, kto_rows, flag) for single in singles]


def load_rl(path: str, flag: str = "--data") -> list[dict]:
    return load_jsonl(path, rl_row, flag)


# ------------------------------------------------------------------------------------------------
# Held-out rows

def split_heldout(rows: list, held_out: list | None = None) -> tuple[list, list]:
    """(training rows, held-out rows): all of `rows` and the --eval-data rows when given, else the file's
    last 2% (at least one row) held out."""
    if held_out is not None:
        return rows, held_out
    n = max(1, len(rows) // 50)
    return rows[:-n], rows[-n:]


def parse_mixture(spec: str, flag: str = "--data") -> list[tuple[str, float]]:
    """--data's files and their weights: "a.jsonl:0.7,b.jsonl:0.3" -> [("a.jsonl", 0.7), ("b.jsonl", 0.3)]; a
    file without ":weight" weighs 1 (so "a.jsonl" alone is [("a.jsonl", 1.0)])."""
    parts = []
    for item in spec.split(","):
        path, colon, weight = item.strip().rpartition(":")
        if not colon:
            path, weight = weight, "1"
        try:
            w = float(weight)
        except ValueError:
            raise UserError(f"{flag} {spec}: in {item.strip()!r}, the weight after ':' must be a number "
                            "(a mixture is FILE:WEIGHT,FILE:WEIGHT)") from None
        if not (math.isfinite(w) and w > 0):
            raise UserError(f"{flag} {spec}: the weight of {path} must be > 0")
        parts.append((path, w))
    return parts


def mixture_rows(spec: str, load: Callable[[str, str], list], held_out: list | None = None, *, seed: int = 0,
                 flag: str = "--data") -> tuple[list, list]:
    """(training rows, held-out rows) of --data: one file, or several mixed in proportion, "a.jsonl:0.7,
    b.jsonl:0.3" (open-instruct's dataset_mixer; the seeds' defence against forgetting: keep some of the old
    data in). Held out: --eval-data's rows (held_out) when given, else each file's last 2%. A mixture keeps
    the weights with the most rows that repeats none: the file with the fewest training rows for its weight
    is used whole, and each other gives a seeded random sample of its rows. Each row of a mixture is of its
    file's source (its name without .jsonl), unless it names a source of its own.
    Example: new.jsonl (1,000 rows) : 0.7 and old.jsonl (5,000) : 0.3 -> new's first 980 (its last 20 held
    out) and 420 of old's first 4,900 (its last 100 held out): 1,400 rows, 70% new."""
    parts = parse_mixture(spec, flag)
    if len(parts) == 1:
        return split_heldout(load(parts[0][0], flag), held_out)
    names = [os.path.splitext(os.path.basename(path))[0] for path, _ in parts]
    if len(set(names)) < len(names):
        raise UserError(f"{flag} {spec}: two files of the mixture share a name ({names}): each names a source")
    train, val = [], []
    for (path, _), name in zip(parts, names):
        file_train, file_val = split_heldout([{"source": name, **row} for row in load(path, flag)])
        train.append(file_train)
        val += file_val
    total = sum(w for _, w in parts)
    size = min(len(rows) * total / w for rows, (_, w) in zip(train, parts))  # the mixture's rows
    rng = random.Random(seed)
    mixed = [row for rows, (_, w) in zip(train, parts)
             for row in rng.sample(rows, min(len(rows), round(size * w / total)))]
    return mixed, held_out if held_out is not None else val


def rl_rows(data, eval_data, *, eval_problems, num_prompts, seed) -> tuple[list, list]:
    """The prompts of a sampling stage (RL, PPO, distillation) and its held-out problems (at most
    eval_problems): --data's rows (one file, or a mixture: mixture_rows), else the embedded world's training
    problems; --eval-data's rows, else --data's last 2% (of each file), else the embedded world's test problems.
    (--eval-data without --data once fell to the world's test problems, drawn by --seed: runs of two seeds were
    evaluated on different problems.)"""
    held_out = load_rl(eval_data, "--eval-data") if eval_data else None
    if data:
        rows, eval_rows = mixture_rows(data, load_rl, held_out, seed=seed)
    else:
        rows = rl_prompts("train", num_prompts, seed=seed)
        eval_rows = held_out or rl_prompts("test", eval_problems, seed=seed)
    return rows, eval_rows[:eval_problems]
