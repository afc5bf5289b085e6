"""The parsers of every subcommand: a bad argument ends in one ``error:`` line and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser

PROG = "python -m lightning_train"
# Subcommands that are plain functions rather than Trainer methods: lightning_train/cli/<name>.py
TOOLS = ("prepare", "report", "dashboard", "consolidate", "generate")


class _OneLineErrors:
    """Parser mixin: a bad argument or config value ends with one ``error: ...`` line (plus a tip)
    and exit code 2, instead of the full usage text."""

    def error(self, message: str, ex: Exception | None = None) -> None:
        message = " ".join(line.strip(" -") for line in message.splitlines() if line.strip())
        prog = self.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {message}\ntip: run `{prog} --help` for the accepted options\n")
        sys.exit(2)


class LightningParser(_OneLineErrors, LightningArgumentParser):
    pass


class ToolParser(_OneLineErrors, ArgumentParser):
    pass


def parse_tool_args(
    function: Callable[..., Any], args: list[str], name: str, positional: bool = False
) -> dict[str, Any]:
    """``function``'s keyword arguments from the command line of ``python -m lightning_train NAME``
    (its signature and docstring make the options; ``--config FILE`` may hold them)."""
    from jsonargparse._optionals import get_doc_short_description

    parser = ToolParser(prog=f"{PROG} {name}", description=get_doc_short_description(function))
    parser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
    parser.add_function_arguments(function, as_positional=positional, as_group=False, sub_configs=True)
    config = parser.instantiate_classes(parser.parse_args(args))
    return {key: value for key, value in vars(config).items() if key != "config"}
