"""``python -m lightning_train consolidate``: a checkpoint of any world size to safetensors."""

from __future__ import annotations

from lightning_train.cli._parsers import parse_tool_args
from lightning_train.strategies.checkpoint import CONFIG_FILE, consolidate


def main(args: list[str]) -> None:
    model_file = consolidate(**parse_tool_args(consolidate, args, "consolidate"))
    print(f"wrote {model_file} and {model_file.with_name(CONFIG_FILE)}")
