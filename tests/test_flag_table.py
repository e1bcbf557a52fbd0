"""docs/testing.md's flag table holds every flag of every stage, each with the tests that check it reaches what it
names, or a note saying why it cannot change the numbers a run computes; every test it names exists. A flag added
to a parser fails here, naming the flag and the stage, until the table has its row.

Each stage's parser is read as the stage builds it, without running the stage: the module-level `parser` of a
training stage, or, for a script that builds its parser inside a function (chat_eval, chat_cli and merge in main,
memory in run_estimate), the parser that function builds, caught at its parse_args, before it reads anything."""
import argparse
import ast
import importlib
import os
import re
import sys

import pytest

import lora
import preferences
import rollout
import rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("base_train", "chat_sft", "chat_rm", "chat_dpo", "chat_kto", "chat_rl", "chat_ppo", "chat_distill",
          "chat_sample", "chat_eval", "chat_cli", "merge", "memory")
# a row may name one of these instead of its stages: every stage whose parser holds all of the group's flags
GROUPS = {"add_run_flags": lambda p: rundir.add_run_flags(p, "base"), "add_lora_flags": lora.add_lora_flags,
          "add_sampling_flags": rollout.add_sampling_flags, "add_rollout_flags": rollout.add_rollout_flags,
          "add_preference_flags": lambda p: preferences.add_preference_flags(p, "dpo")}


class _Built(Exception):
    """Raised by parse_args: carries the parser a stage built."""


def parser_of(stage):
    module = importlib.import_module(stage)
    if isinstance(getattr(module, "parser", None), argparse.ArgumentParser):
        return module.parser
    build = module.run_estimate if stage == "memory" else module.main
    original = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def caught(self, *args, **kwargs):
        raise _Built(self)
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = caught
    try:
        build([]) if stage == "memory" else build()
    except _Built as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = original
    raise AssertionError(f"{stage}: no parser found")


def flags_of(parser):
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"}


def table_rows(path=os.path.join(REPO, "docs", "testing.md")):
    """(line number, flags, stage names, test nodes, note) of each row of the flag table: a markdown table row whose
    first cell holds `--flags`; cells split at pipes not escaped as \\|."""
    rows = []
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 4, f"docs/testing.md:{n}: a flag row has 4 cells (flag | stages | tests | note)"
        flags, stages, tests, note = cells
        rows.append((n, re.findall(r"`(--[\w-]+)`", flags), stages.replace(",", " ").split(),
                     re.findall(r"`(tests/[^`]+)`", tests), note))
    return rows


def test_every_flag_of_every_stage_has_a_row_and_every_row_a_real_test():
    parsers = {stage: flags_of(parser_of(stage)) for stage in STAGES}
    members = {}
    for group, add in GROUPS.items():
        p = argparse.ArgumentParser()
        add(p)
        members[group] = [s for s in STAGES if flags_of(p) <= parsers[s]]
    problems, covered = [], {}
    for n, flags, stages, tests, note in table_rows():
        where = f"docs/testing.md:{n}"
        expanded = [s for name in stages for s in members.get(name, [name])]
        for name in stages:
            if name not in STAGES and name not in GROUPS:
                problems.append(f"{where}: {name!r} is neither a stage ({', '.join(STAGES)}) nor a group ({', '.join(GROUPS)})")
        for flag in flags:
            for stage in (s for s in expanded if s in parsers):
                if flag not in parsers[stage]:
                    problems.append(f"{where}: {stage} has no {flag} (remove it from the row)")
                    continue
                if (stage, flag) in covered:
                    problems.append(f"{where}: {stage} {flag} has a row already, at line {covered[stage, flag]}")
                covered[stage, flag] = n
        if not tests and not note:
            problems.append(f"{where}: {' '.join(flags)} names no test and says no reason")
        for node in tests:
            file, _, name = node.partition("::")
            func = name.split("[")[0]
            path = os.path.join(REPO, file)
            if not os.path.isfile(path) or func not in {f.name for f in ast.parse(open(path).read()).body
                                                         if isinstance(f, ast.FunctionDef)}:
                problems.append(f"{where}: {node}: no such test")
    for stage in STAGES:
        for flag in sorted(parsers[stage] - {f for s, f in covered if s == stage}):
            problems.append(f"{stage} {flag}: no row in docs/testing.md's flag table (add one: the test that "
                            f"checks it reaches what it names, or why it cannot change numbers)")
    assert not problems, "\n".join(problems)


def test_the_check_can_fail(tmp_path, monkeypatch):
    """A flag the table lacks, a row naming a stage without the flag, and a test that does not exist are reported."""
    doc = tmp_path / "testing.md"
    doc.write_text("| `--seed` | chat_cli | `tests/test_flag_table.py::test_no_such_test` | |\n"
                   "| `--not-a-flag` | merge | | |\n")
    read = table_rows
    monkeypatch.setattr(sys.modules[__name__], "table_rows", lambda: read(str(doc)))
    with pytest.raises(AssertionError) as e:
        test_every_flag_of_every_stage_has_a_row_and_every_row_a_real_test()
    message = str(e.value)
    assert "test_no_such_test: no such test" in message and "merge has no --not-a-flag" in message
    assert "chat_rl --kl-beta: no row" in message and "names no test and says no reason" in message
