"""``python -m lightning_train export``: a checkpoint of any world size to a Hugging Face folder (or
``--format safetensors``, or a LoRA fine-tune's adapters with ``--format peft``)."""

from __future__ import annotations

from lightning_train.checkpoint.consolidate import export
from lightning_train.cli._parsers import parse_tool_args


def main(args: list[str]) -> None:
    written = export(**parse_tool_args(export, args, "export"))
    print(f"wrote {written[0].parent}: {', '.join(path.name for path in written)}")
