"""The house's shape: every import of nanopost's own modules runs down the layers (the README's Layout table),
no module imports inside a function (a hidden dependency is still a dependency), nothing imports in a circle,
and no file outgrows its budget. Read from the source with ast, so an import inside a function, under an `if`
or through importlib counts like any other."""
import ast
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Library modules by layer: a module imports only from layers below its own. The stage scripts sit on top
# (STAGE_LAYER): they import any library module, and one another's functions, never in a circle.
LAYERS = {
    "model": 0, "common": 0, "tasks": 0, "sandbox": 0,    # import nothing of ours
    "verifiers": 1, "standin_judge": 1,
    "lora": 1, "rundir": 1, "tokenizer": 1, "peak_memory": 1, "packing": 1, "exact": 1,
    "checkpoint": 2, "engine": 2,
    "rewards": 3, "rollout": 3,
    "data": 4, "evaluation": 4, "sampled_data": 4,
    "decontaminate": 5, "preferences": 5,
}
STAGE_LAYER = 6
STAGES = ("base_train", "chat_cli", "chat_distill", "chat_dpo", "chat_eval", "chat_kto", "chat_ppo", "chat_rl",
          "chat_rm", "chat_sample", "chat_sft", "memory", "merge")
# Imports allowed inside a function, by module: sandbox.py's child process runs the file itself, and a
# top-level subprocess or ctypes would be loaded into the untrusted program's interpreter; optional
# dependencies are imported where they are used, so that a user without them never needs them.
FUNCTION_IMPORTS = {
    "sandbox": {"operator", "ctypes", "builtins", "select", "secrets", "shutil", "subprocess", "tempfile",
                "concurrent.futures"},
    "rundir": {"wandb"},
    "chat_eval": {"matplotlib.figure"},
}
STAGE_LINES, LIBRARY_LINES, COLUMNS = 500, 600, 120  # a budget counts what a reader reads: lines of at most 120
OVER_BUDGET_BY_CHOICE = {"sandbox"}  # a leaf a reader skips: shrinking it would weaken the sandbox's defenses


def modules():
    return sorted(f[:-3] for f in os.listdir(REPO) if f.endswith(".py"))


def imports(name):
    """[(imported module, line, inside a function?)] of REPO/name.py: import statements and importlib calls."""
    tree = ast.parse(open(os.path.join(REPO, name + ".py"), encoding="utf-8").read())
    return imports_of_tree(tree)


def imports_of_tree(tree):
    found = []

    def visit(node, in_function):
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno, in_function))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if called in ("import_module", "__import__"):
                found.append((node.args[0].value, node.lineno, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def layer(name):
    return STAGE_LAYER if name in STAGES else LAYERS[name]


def test_every_file_has_a_place_in_the_layout():
    unplaced = [m for m in modules() if m not in LAYERS and m not in STAGES]
    assert not unplaced, f"add {unplaced} to LAYERS or STAGES here, and to the README's Layout table"
    assert set(LAYERS) | set(STAGES) <= set(modules()), "LAYERS or STAGES names a file that is gone"


@pytest.mark.parametrize("name", modules())
def test_imports_run_down_the_layers_and_none_hides_in_a_function(name):
    ours = set(modules())
    for target, line, in_function in imports(name):
        top = target.split(".")[0]
        if in_function:
            allowed = FUNCTION_IMPORTS.get(name, set())
            assert target in allowed or top in allowed, \
                f"{name}.py:{line} imports {target} inside a function; import it at the top of the file"
        if top in ours and top != name:
            assert layer(top) < layer(name) or (name in STAGES and top in STAGES), \
                f"{name}.py:{line} imports {top} (layer {layer(top)}) from layer {layer(name)}: against the order"


def test_no_circle():
    graph = {m: {t.split(".")[0] for t, _, _ in imports(m)} & set(modules()) - {m} for m in modules()}
    state = {}

    def walk(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", "a circle: " + " -> ".join(path + [m, n])
            if n not in state:
                walk(n, path + [m])
        state[m] = "done"

    for m in modules():
        if m not in state:
            walk(m, [])


@pytest.mark.parametrize("name", modules())
def test_files_stay_within_their_budget(name):
    """A file's lines under its budget, and each line at most COLUMNS wide: a line budget alone rewards packing."""
    if name in OVER_BUDGET_BY_CHOICE:
        return
    with open(os.path.join(REPO, name + ".py"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    budget = STAGE_LINES if name in STAGES else LIBRARY_LINES
    assert len(lines) <= budget, \
        f"{name}.py has {len(lines)} lines, over its budget of {budget}: split out what a reader can skip"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > COLUMNS]
    assert not wide, f"{name}.py: lines {wide[:10]} are over {COLUMNS} characters; wrap them"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """The reader above sees an import inside a function, one through importlib, and a circle."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    (tmp_path / "a.py").write_text("def f():\n    import b\n")
    (tmp_path / "b.py").write_text("import importlib\nx = importlib.import_module('a')\n")
    assert imports("a") == [("b", 2, True)]
    assert ("a", 2, False) in imports("b")
    with pytest.raises(AssertionError, match="circle"):
        test_no_circle()
    (tmp_path / "c.py").write_text("x = 1  # " + "w" * 121 + "\n")  # one line of 130 characters
    with pytest.raises(AssertionError, match="over 120 characters"):
        test_files_stay_within_their_budget("c")
    (tmp_path / "data.py").write_text("import engine\n")
    (tmp_path / "engine.py").write_text("")
    with pytest.raises(AssertionError, match="data"):
        test_the_low_floors_stay_pure()


LAB = os.path.join(REPO, "lab")


def lab_scripts():
    return sorted(f[:-3] for f in os.listdir(LAB) if f.endswith(".py")) if os.path.isdir(LAB) else []


@pytest.mark.parametrize("name", lab_scripts())
def test_lab_scripts_sit_on_top(name):
    """lab/ is above the stages: an experiment imports any module of ours and lab/labkit.py, nothing of ours
    imports lab/, and each experiment stays a short script (a stage's budget)."""
    with open(os.path.join(LAB, name + ".py"), encoding="utf-8") as f:
        source = f.read()
    for target, line, in_function in imports_of_tree(ast.parse(source)):
        assert not in_function or target.split(".")[0] == "matplotlib", \
            f"lab/{name}.py:{line} imports {target} inside a function; import it at the top of the file"
    assert source.count("\n") <= STAGE_LINES, f"lab/{name}.py is over {STAGE_LINES} lines: a lab script is short"
    for m in modules():
        for target, line, _ in imports(m):
            assert target.split(".")[0] not in set(lab_scripts()), f"{m}.py:{line} imports lab/{target}"


def reaches(name, seen=None):
    """Every module of ours that `name` imports, directly or through another."""
    seen = set() if seen is None else seen
    for module, _, _ in imports(name):
        top = module.split(".")[0]
        if top in LAYERS or top in STAGES:
            if top not in seen:
                seen.add(top)
                reaches(top, seen)
    return seen


def test_the_low_floors_stay_pure():
    """A JSONL loader and the verifiers are plain code: loading a data file never imports the engine, a checkpoint
    or a model (data.py once reached them through rewards.py, for the verifiers)."""
    for name in ("data", "verifiers"):
        assert not reaches(name) & {"engine", "checkpoint", "rewards", "model", "lora"}, (name, reaches(name))
