"""``python -m lightning_train consolidate``: the older name of ``export --format safetensors``."""

from __future__ import annotations

from lightning_train.checkpoint.consolidate import consolidate
from lightning_train.cli._parsers import parse_tool_args


def main(args: list[str]) -> None:
    options = parse_tool_args(consolidate, args, "consolidate")
    from lightning_train.checkpoint.model_folder import CONFIG_FILE  # after --help, which needs no torch

    model_file = consolidate(**options)
    print(f"wrote {model_file} and {model_file.with_name(CONFIG_FILE)}")
