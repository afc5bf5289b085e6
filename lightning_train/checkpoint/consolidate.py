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

    Example (from a ``.ckpt``; a sharded folder works the same):

        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.checkpoint import consolidate, open_pretrained
        >>> trainer = L.Trainer(
        ...     max_steps=1, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> folder = tempfile.mkdtemp()
        >>> trainer.save_checkpoint(f"{folder}/last.ckpt")
        >>> weights = consolidate(f"{folder}/last.ckpt", f"{folder}/export")
        >>> weights.name, open_pretrained(weights.parent).config == module.config
        ('model.safetensors', True)
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
