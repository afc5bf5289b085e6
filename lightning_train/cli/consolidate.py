"""``python -m lightning_train consolidate``: the older name of ``export --format safetensors``."""

from __future__ import annotations

from lightning_train.checkpoint.consolidate import consolidate
from lightning_train.checkpoint.export import CONFIG_FILE
from lightning_train.cli._parsers import parse_tool_args


def main(args: list[str]) -> None:
    model_file = consolidate(**parse_tool_args(consolidate, args, "consolidate"))
    print(f"wrote {model_file} and {model_file.with_name(CONFIG_FILE)}")
