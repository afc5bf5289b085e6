"""The parsers of every subcommand: a bad argument ends in one ``error:`` line and exit code 2.

Lightning is not imported here: the tools' parsers and the top-level help answer without it (its
import alone takes seconds); ``LightningParser``, for the Trainer subcommands, lives in ``trainer.py``."""

from __future__ import annotations

import os
import re
import sys
from argparse import Action, ArgumentError
from collections.abc import Callable
from contextvars import ContextVar
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
    "evaluate": "Score a checkpoint on lm-evaluation-harness tasks.",
    "export": "Export a checkpoint as a Hugging Face model folder or peft adapters.",
    "consolidate": "The older name of `export --format safetensors`.",
    "report": "Plot a run's metrics to PNGs and report.html.",
    "dashboard": "Save a run's W&B dashboard and its JSON spec.",
    "plan": "Print one rank's memory under a config's full layout.",
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
    """Parser mixin: a bad argument, config file or config value ends with one ``error: ...`` line
    (plus a tip) and exit code 2, instead of the full usage text."""

    def error(self, message: str, ex: Exception | None = None) -> None:
        if not self.exit_on_error:  # a parser jsonargparse made for a class's arguments: its caller
            raise ArgumentError(None, message) from ex  # reports, naming the whole option
        prog = self.prog.replace(" [options]", "")
        message = _one_line(message, prog, ex)
        if first_process_of_node():  # every process of a launch parses the same command line
            sys.stderr.write(f"error: {message}\ntip: run `{prog} --help` for the accepted options\n")
        sys.exit(2)

    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        """jsonargparse's, with the file named in its errors (they say "<unicode string>"); a file that
        is not UTF-8 is refused here, as jsonargparse would raise UnicodeDecodeError past its errors."""
        if os.path.isfile(path):
            with open(path, "rb") as file:
                content = file.read()
            try:
                content.decode("utf-8")
            except UnicodeDecodeError as error:
                self.error(
                    f"config file {path} is not UTF-8 text (byte 0x{content[error.start]:02x} at offset "
                    f"{error.start}); save it as UTF-8", error,
                )
        reading = _CONFIG_FILE.set(str(path))
        try:
            return super().parse_path(path, *args, **kwargs)
        finally:
            _CONFIG_FILE.reset(reading)


class _Defaults:
    """Parser mixin: our help formatter, and the program named as users type it (jsonargparse makes
    parsers of its own, e.g. for ``--model.help``, which would otherwise say ``__main__.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prog", PROG)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


# ---- jsonargparse's messages as one line ----------------------------------------------------------
# A message may span many lines: an option of several types lists each type's error, and a class's
# argument (--model.init_args.config.n_layer) nests its class's message inside the option's, once a level.

_CONFIG_FILE: ContextVar[str | None] = ContextVar("config_file", default=None)  # the file being parsed
_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":')
_GIVEN = re.compile(
    r"Given value: (?:NestedArg\(key='(?P<sub>[^']*)', val=(?P<nested>.*)\)|(?P<value>.*))$", re.M
)
_GOT = re.compile(r"Got value: (?P<value>.*)$", re.M)
_CLASS_PROBLEM = re.compile(r"^(?P<indent> *)- Problem with given class_path '(?P<cls>[^']+)':$", re.M)
_SUBTYPES = re.compile(r"Subtypes: \[(?P<types>.*)\]$", re.M)
_EXPECTED = re.compile(r"Expected an? (?P<type>.+?)\. Got value:")
_UNKNOWN_OPTION = re.compile(r"Option '(?P<name>[^']+)' is not accepted")
_NOT_A_CLASS = "Expected a dot import path string"
_NOT_UTF8 = re.compile(r"codec can't encode character '\\udc(?P<byte>[0-9a-f]{2})'")
_MISSING_FILE = re.compile(r"(?P<problem>File does not exist|Path is not a file): '(?P<path>.*)'")
# lines of a message that say where the error is, not what it is
_STRUCTURE = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Given value", "Problem with given",
              "Expected a")

_NESTED_ERROR = re.compile(
    r'Parser key "(?P<key>[^"]+)":.*Expected a dot import path string: (?P<name>\S+)\s.*'
    r"Given value: NestedArg\(key='(?P<option>[^']+)', val=(?P<value>.*)\)",
    re.S,
)


def _one_line(message: str, prog: str, error: BaseException | None) -> str:
    """jsonargparse's ``message`` as one line naming the option (or config file), the value and what
    is accepted; ``prog`` is the subcommand as typed, for the help it points to."""
    config_file = _CONFIG_FILE.get()
    if config_file is not None and message.startswith(("Problems parsing config", "Unexpected config")):
        return _config_file_error(config_file, message, error)
    key = _KEY.match(message)
    line = _option_error(key["key"], message, prog) if key else None
    if line is None:
        unknown = _UNKNOWN_OPTION.fullmatch(message.strip())  # a tool's config file with a key it lacks
        if unknown:
            return f"option {unknown['name']!r} of a config file is not accepted; `{prog} --help` lists them"
    return line or " ".join(part.strip(" -") for part in message.splitlines() if part.strip())


def _config_file_error(path: str, message: str, error: BaseException | None) -> str:
    content = message.partition(": ")[2]
    if message.startswith("Unexpected config"):  # YAML, but not a mapping of options
        if not content.strip():
            return f"config file {path} is empty; write its options as `key: value` lines"
        first = content.strip().splitlines()[0]
        return f"config file {path} holds no options (it starts {first!r}); write `key: value` lines"
    yaml_error = error.__cause__ if error is not None else None
    mark, problem = getattr(yaml_error, "problem_mark", None), getattr(yaml_error, "problem", None)
    if mark is not None and problem:
        content = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    content = " ".join(content.replace('in "<unicode string>", ', "at ").split())
    return f"config file {path} is not valid YAML ({content}); correct it"


def _option_error(key: str, message: str, prog: str) -> str | None:
    """The line for an error of option ``--key`` (None: one this does not know)."""
    nested = _NESTED_ERROR.search(message)
    if nested:  # an option of a class given by a registry name such as lt_fsdp, which takes none
        return (
            f"--{key}.{nested['option']}={_unquoted(nested['value'])} needs the class named, not "
            f"--{key}={nested['name']}; pass --{key}=CLASS_PATH (e.g. "
            "lightning_train.strategies.DataParallelStrategy) and its options after it"
        )
    missing = _MISSING_FILE.search(message)
    if missing:
        what = "does not exist" if missing["problem"].startswith("File") else "is not a file"
        return f"--{key} {missing['path']} {what}; pass the path of a YAML file of options"
    not_utf8 = _NOT_UTF8.search(message)
    if not_utf8:
        return (
            f"--{key} holds a byte that is not UTF-8 (0x{not_utf8['byte']}); pass UTF-8 text (rename a file "
            "whose name is not UTF-8)"
        )
    problems = list(_CLASS_PROBLEM.finditer(message))  # one a level of class arguments, outermost first
    inner_keys = (_KEY.match(message[problem.end():].lstrip()) for problem in problems)
    path = [key, *(inner["key"] for inner in inner_keys if inner)]  # the option, level by level
    reason = _item_text(message, problems[-1]) if problems else message  # the innermost class's message
    givens = list(_GIVEN.finditer(message))
    given = givens[-1] if givens else None  # the outermost: a nested class's message comes first
    if given is not None and given["sub"] is not None:  # --key.sub=value, of the class that --key names
        option, value = f"{key}.{given['sub']}", _unquoted(given["nested"])
    else:  # a value from a config file, or of an option that is not a class
        option = ".".join(path)
        got = _GOT.search(reason) or _GIVEN.search(reason)
        value = got["value"] if got else None
    unknown = _UNKNOWN_OPTION.search(reason)
    if unknown and problems:
        if given is None or given["sub"] is None:
            option = f"{option}.{unknown['name']}"
        return (
            f"--{option} is not an option of {problems[-1]['cls']}; "
            f"`{prog} --{key.split('.')[0]}.help {problems[0]['cls']}` lists them"
        )
    accepted = _accepted(reason, option) or _accepted(message, option)
    if value is None or accepted is None:
        return None
    return f"--{option}={value} is not accepted{_detail(reason)}; use {accepted}"


def _item_text(message: str, item: re.Match) -> str:
    """The lines under ``item``'s line that are indented deeper: its part of a message's list."""
    lines = []
    for line in message[item.end():].splitlines()[1:]:
        if len(line) - len(line.lstrip(" ")) <= len(item["indent"]):
            break
        lines.append(line.strip())
    return "\n".join(lines)


def _accepted(reason: str, option: str) -> str | None:
    """What the option accepts, from the types jsonargparse tried: "an int", "one of hf, peft, null"."""
    subtypes = _SUBTYPES.search(reason)
    expected = _EXPECTED.search(reason)
    types = _split_types(subtypes["types"]) if subtypes else [expected["type"]] if expected else []
    if option.endswith(".class_path") and types:
        return f"the import path of a {_type_name(types[0])} subclass"
    names = list(dict.fromkeys(name for kind in types for name in _type_names(kind)))  # no repeats
    if not names:
        return None
    return names[0] if len(names) == 1 else f"one of {', '.join(names)}"


def _split_types(text: str) -> list[str]:
    """``list[str], <class 'NoneType'>`` -> each type, split at the commas outside brackets."""
    types, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "[(" or -(char in "])")
        if char == "," and depth == 0:
            types.append(text[start:i].strip())
            start = i + 1
    return [*types, text[start:].strip()]


def _type_names(kind: str) -> list[str]:
    """How the help names what a type accepts: the choices of a Literal, else one phrase."""
    literal = re.fullmatch(r"(?:typing\.)?Literal\[(?P<items>.*)\]", kind)
    if literal:
        return [item.strip("'\"") for item in _split_types(literal["items"])]
    container = re.fullmatch(r"(?:[\w.]+\.)?(?P<name>\w+)\[(?P<args>.*)\]", kind)
    if container and container["name"].lower() in ("list", "sequence", "iterable", "tuple", "set"):
        return [f"a list of {_type_name(_split_types(container['args'])[0])} such as [a, b]"]
    if container and container["name"].lower() in ("dict", "mapping"):
        key, value = (_type_name(arg) for arg in _split_types(container["args"])[:2])
        return [f"a mapping of {key} to {value} such as {{a: 1}}"]
    name = _type_name(kind)
    return ["null" if name == "NoneType" else "true or false" if name == "bool" else _with_article(name)]


def _type_name(kind: str) -> str:
    """``<class 'lightning.pytorch.core.module.LightningModule'>`` -> ``LightningModule``."""
    match = re.fullmatch(r"<class '(?:[\w.]+\.)?(?P<name>\w+)'>|(?:[\w.]+\.)?(?P<plain>\w+)", kind.strip())
    return (match["name"] or match["plain"]) if match else kind


def _with_article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _detail(reason: str) -> str:
    """What a message says about the value beyond its type (" (No module named 'no')"), if anything."""
    if _NOT_A_CLASS in reason:
        return " (not the import path of a class)"
    for line in reason.splitlines():
        line = line.strip(" -")
        if line and not line.startswith(_STRUCTURE):
            return f" ({line})"
    return ""


def _unquoted(value: str) -> str:
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value


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
