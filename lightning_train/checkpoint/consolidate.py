"""``consolidate``: any checkpoint of this package (a sharded folder of any world size, or a ``.ckpt``)
exported to ``model.safetensors`` + ``config.json`` in one plain process. A library function: it
returns what it wrote and prints nothing (the ``consolidate`` subcommand reports it)."""

from __future__ import annotations

from pathlib import Path

from lightning_train.checkpoint.export import MODEL_FILE, save_safetensors
from lightning_train.checkpoint.pretrained import open_pretrained
from lightning_train.errors import UserInputError


def consolidate(checkpoint: str, output: str, overwrite: bool = False) -> Path:
    """Export a checkpoint of this package — a sharded folder of any world size, or a ``.ckpt`` file
    (LoRA adapters merged) — to ``OUTPUT/model.safetensors`` (full fp32 weights, names as in
    ``GPT.state_dict()``) and ``OUTPUT/config.json`` (the ``GPTConfig``), which fine-tuning and
    ``generate`` load. Runs in one plain process, whatever the world size was. Returns the path of
    ``model.safetensors``.

    Args:
        checkpoint: the checkpoint folder or file.
        output: folder to write into (created if missing).
        overwrite: replace an existing export in ``output``.
    """
    source, target = Path(checkpoint), Path(output)
    if not source.exists():
        raise UserInputError(f"checkpoint {source} does not exist")
    if (target / MODEL_FILE).exists() and not overwrite:
        raise UserInputError(
            f"{target / MODEL_FILE} already exists; choose another --output or pass --overwrite true"
        )
    save_safetensors(open_pretrained(source).build(), target)
    return target / MODEL_FILE
