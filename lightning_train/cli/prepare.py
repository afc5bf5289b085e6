"""``python -m lightning_train prepare``: tokenize text files into token shards."""

from __future__ import annotations

from lightning_train.cli._parsers import parse_tool_args
from lightning_train.data.shards import prepare


def main(args: list[str]) -> None:
    print(prepare(**parse_tool_args(prepare, args, "prepare")))  # what it wrote, after its bar
