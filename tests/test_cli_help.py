"""What a person sees in the help: every subcommand on one whole line, the program named as typed."""

from __future__ import annotations

import re

import pytest

from tests.conftest import cli_env, run_cli

SUBCOMMANDS = ("fit", "validate", "test", "predict")
TOOLS = ("prepare", "generate", "consolidate", "report", "dashboard")
PROG = "python -m lightning_train"


def _help(tmp_path, *args: str) -> str:
    result = run_cli(*args, cwd=tmp_path, env=cli_env(COLUMNS="80"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "``" not in result.stdout and "__main__" not in result.stdout, result.stdout
    return result.stdout


def test_top_level_help_lists_every_subcommand_on_one_whole_line(tmp_path):
    lines = _help(tmp_path, "--help").splitlines()
    assert lines[0].startswith(f"usage: {PROG} ")
    for name in SUBCOMMANDS + TOOLS:
        [line] = [line for line in lines if re.match(rf"  {name} +\S", line)]
        assert len(line) <= 80 and line.rstrip().endswith("."), line  # a whole sentence on the line
        follower = lines[lines.index(line) + 1]
        assert not re.match(r" {20,}\S", follower), f"{line!r} continues on {follower!r}"
    text = "\n".join(lines)
    assert f"{PROG} fit --model.help PretrainModule" in text
    assert f"{PROG} fit --data.help TextDataModule" in text


def test_model_help_names_the_program_and_reads_as_plain_text(tmp_path):
    text = _help(tmp_path, "fit", "--model.help", "PretrainModule")
    assert text.startswith(f"usage: {PROG} ")
    assert "--model.learning_rate" in text and '`{"input_ids": (B, T), "labels": (B, T)}`' in text


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help_names_the_program_and_describes_the_tool(tmp_path, tool):
    text = _help(tmp_path, tool, "--help")
    assert text.startswith(f"usage: {PROG} {tool} ")
    description = text.split("\n\n")[1]
    assert description.endswith(".") and "\n" not in description, description


def test_subcommand_help_describes_it(tmp_path):
    text = _help(tmp_path, "validate", "--help")
    assert text.startswith(f"usage: {PROG} [options] validate ")
    assert "Evaluate a checkpoint on the validation split." in text
    words = " ".join(text.split())
    assert "--resume RESUME" in text and "validate, test and predict refuse" in words
