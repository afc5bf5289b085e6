"""The parsers of every subcommand: a bad argument ends in one ``error:`` line and exit code 2.

Lightning is not imported here: the tools' parsers and the top-level help answer without it (its
import alone takes seconds); ``LightningParser``, for the Trainer subcommands, lives in ``trainer.py``."""

from __future__ import annotations

import re
import sys
from argparse import Action
from collections.abc import Callable
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

from lightning_train._compat import subcommand_actions
from lightning_train.cli._failure import first_process_of_node

PROG = "python -m lightning_train"
DESCRIPTION = "Train language models with Lightning."
# The top-level help's line for each Trainer subcommand (Lightning's are its docstrings' first lines,
# cut mid-sentence); each fits one 80-column line.
SUBCOMMANDS = {
    "fit": "Train a model (--resume auto continues a run).",
    "validate": "Evaluate a checkpoint on the validation split.",
    "test": "Evaluate on the test split (needs test_step).",
    "predict": "Run a model's predict_step (for text, use generate).",
}
# Subcommands that are plain functions rather than Trainer methods, each in lightning_train/cli/<name>.py,
# with the line the help shows for it (each fits one 80-column line).
TOOLS = {
    "prepare": "Tokenize text files into token shards for training.",
    "generate": "Print a model's completions of prompts.",
    "export": "Export a checkpoint as a Hugging Face model folder or peft adapters.",
    "consolidate": "The older name of `export --format safetensors`.",
    "report": "Plot a run's metrics to PNGs and report.html.",
    "dashboard": "Save a run's W&B dashboard and its JSON spec.",
}


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's, for text written as reStructuredText docstrings: ``x`` reads as `x`, and a
    description or epilog keeps its own line breaks."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            line if line.startswith("  ") else super(HelpFormatter, self)._fill_text(line, width, indent)
            for line in _plain(text).splitlines()
        )

    def _get_help_string(self, action: Action) -> str:
        return _plain(super()._get_help_string(action))

    def _format_action(self, action: Action) -> str:
        subactions = subcommand_actions(action)
        if subactions is not None:  # the subcommands one a line, without a header line
            return "".join(self._format_action(choice) for choice in subactions)
        return super()._format_action(action)

    def start_section(self, heading: str | None) -> None:
        super().start_section(_plain(heading).rstrip(";,.") if heading else heading)


def _plain(text: str) -> str:
    return text.replace("``", "`")


class _OneLineErrors:
    """Parser mixin: a bad argument or config value ends with one ``error: ...`` line (plus a tip)
    and exit code 2, instead of the full usage text."""

    def error(self, message: str, ex: Exception | None = None) -> None:
        message = " ".join(line.strip(" -") for line in message.splitlines() if line.strip())
        message = _short_type_error(message) or message
        prog = self.prog.replace(" [options]", "")
        if first_process_of_node():  # every process of a launch parses the same command line
            sys.stderr.write(f"error: {message}\ntip: run `{prog} --help` for the accepted options\n")
        sys.exit(2)


class _Defaults:
    """Parser mixin: our help formatter, and the program named as users type it (jsonargparse makes
    parsers of its own, e.g. for ``--model.help``, which would otherwise say ``__main__.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prog", PROG)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


_UNION_ERROR = re.compile(
    r'Parser key "(?P<key>[^"]+)":\s*Does not validate against any of the Union subtypes\s*'
    r"Subtypes: \[(?P<types>.*?)\]\s*Errors:.*Given value: (?P<value>\S*)"
)


_NESTED_ERROR = re.compile(
    r'Parser key "(?P<key>[^"]+)":.*Expected a dot import path string: (?P<name>\S+) .*'
    r"Given value: NestedArg\(key='(?P<option>[^']+)', val=(?P<value>.*)\)"
)


_TYPE_ERROR = re.compile(
    r'^Parser key "(?P<key>[^"]+)": Expected a <class \'(?:[\w.]+\.)?(?P<type>\w+)\'>\. '
    r"Got value: (?P<value>\S*)"
)


def _with_article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _short_type_error(message: str) -> str | None:
    """jsonargparse's message for a value of the wrong type (many lines for an option of several
    types) as one line: the option, the value and what it accepts."""
    nested = _NESTED_ERROR.search(message)
    if nested:  # an option of a class given by a registry name such as lt_fsdp, which takes none
        value = nested["value"].strip("'")
        return (
            f"--{nested['key']}.{nested['option']}={value} needs the class named, not "
            f"--{nested['key']}={nested['name']}; pass --{nested['key']}=CLASS_PATH (e.g. "
            "lightning_train.strategies.DataParallelStrategy) and its options after it"
        )
    single = _TYPE_ERROR.search(message)
    if single:
        wanted = "true or false" if single["type"] == "bool" else _with_article(single["type"])
        return f"--{single['key']}={single['value']} is not accepted; use {wanted}"
    match = _UNION_ERROR.search(message)
    if match is None:
        return None
    accepted = []
    for literal, name in re.findall(r"Literal\[(.*?)\]|<class '(?:[\w.]+\.)?(\w+)'>", match["types"]):
        if literal:
            accepted += [item.strip("'\"") for item in literal.split(", ")]
        else:
            accepted.append("null" if name == "NoneType" else _with_article(name))
    choices = ", ".join(dict.fromkeys(accepted))  # in order, without repeats
    return f"--{match['key']}={match['value']} is not accepted; use one of {choices}"


class ParserConventions(_OneLineErrors, _Defaults):
    """Mixin for any jsonargparse parser of this CLI: one-line errors, our help text and program name."""


class ToolParser(ParserConventions, ArgumentParser):
    pass


def parse_tool_args(
    function: Callable[..., Any], args: list[str], name: str, positional: bool = False
) -> dict[str, Any]:
    """``function``'s keyword arguments from the command line of ``python -m lightning_train NAME``
    (its signature and docstring make the options; ``--config FILE`` may hold them)."""
    parser = ToolParser(prog=f"{PROG} {name}", description=TOOLS[name])
    parser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
    parser.add_function_arguments(function, as_positional=positional, as_group=False, sub_configs=True)
    config = parser.instantiate_classes(parser.parse_args(args))
    return {key: value for key, value in vars(config).items() if key != "config"}


def top_level_help() -> str:
    """``python -m lightning_train --help``: the subcommands and tools, one line each (the subcommands'
    own options come with ``fit --help``, which builds the Trainer's parser)."""
    parser = ToolParser(prog=PROG, description=DESCRIPTION, epilog=_top_level_epilog())
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="Path to a configuration file in "
                        "json or yaml format.")
    subcommands = parser.add_subcommands(title="subcommands", description=None, metavar="SUBCOMMAND")
    for name, summary in SUBCOMMANDS.items():
        subcommands.add_subcommand(name, ToolParser(prog=f"{PROG} {name}"), help=summary)
    return parser.format_help()


def _top_level_epilog() -> str:
    tools = "\n".join(f"  {name:<22}{summary}" for name, summary in TOOLS.items())
    return (
        f"tools ({PROG} TOOL --help):\n{tools}\n\n"
        "options of a subcommand, the model and the data:\n"
        f"  {PROG} fit --help\n"
        f"  {PROG} fit --model.help PretrainModule   (or FinetuneModule)\n"
        f"  {PROG} fit --data.help TextDataModule    (or SFTDataModule)"
    )
