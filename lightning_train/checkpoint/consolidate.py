"""``export``: any checkpoint of this package (a sharded folder of any world size, or a ``.ckpt``) or
other weights source, written as a Hugging Face folder or in our safetensors format in one plain
process, or a LoRA fine-tune's adapters as a peft adapter folder; ``consolidate`` is its older name
for our format. Library functions: they return what they
wrote and print nothing (the ``export`` and ``consolidate`` subcommands report it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import lightning_train.storage as storage
from lightning_train.errors import UserInputError
from lightning_train.output_folder import check_apart, check_replaceable, publish, staged

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def export(
    checkpoint: str,
    output: str,
    format: Literal["hf", "safetensors", "peft"] = "hf",
    overwrite: bool = False,
    max_shard_size: str = "5GB",
    base_model: str | None = None,
) -> list[Path]:
    """Export a checkpoint of this package — a ``.ckpt`` file, a sharded folder of any world size
    (LoRA adapters merged), or any other source ``open_pretrained`` reads — in one plain process.
    Returns the files written; prints nothing.

    Args:
        checkpoint: the checkpoint file or folder.
        output: the folder to write: created, or an empty folder, or an earlier export's folder with
            ``overwrite``; never a file, the checkpoint's folder or one around it. Written in a hidden
            sibling folder first, so a failed write (a full disk among the causes) leaves no file of
            it and an earlier export as it was.
        format: ``hf``: a Hugging Face folder that ``transformers.AutoModelForCausalLM`` and
            ``AutoTokenizer`` load with no custom code (``LlamaForCausalLM`` for the Llama-style block,
            ``GPT2LMHeadModel`` for the GPT-2 block: config.json, model.safetensors, generation_config.json,
            tokenizer.json, tokenizer_config.json); a LoRA fine-tune's adapters are merged.
            ``safetensors``: our own ``model.safetensors`` + ``config.json`` (what ``consolidate``
            writes), with the run's tokenizer beside them as for ``hf`` (tokenizer.json,
            tokenizer_config.json) when the checkpoint names one. ``peft``: a LoRA fine-tune's
            adapters, unmerged, as a peft adapter folder (adapter_config.json,
            adapter_model.safetensors) for the ``hf`` export of the model it started from:
            ``PeftModel.from_pretrained(base, output)``.
        overwrite: replace the files of an earlier export in ``output`` (one whose safetensors header
            ``export`` marked: ``model_folder.EXPORT_MARK``), keeping the folder's other files; a
            folder that no export wrote, such as a model downloaded from the Hub, is refused.
        max_shard_size: above it the weights are split into ``model-0000i-of-0000n.safetensors`` with
            a ``model.safetensors.index.json`` (``hf`` only), e.g. ``5GB``, ``500MB`` or a byte count.
        base_model: (``peft`` only) the base model's folder or hub id, recorded as the adapter's
            ``base_model_name_or_path`` (what ``AutoPeftModelForCausalLM`` loads); default: none.
    """
    # here, not at the top: `export --help` and `consolidate --help` answer without importing torch
    import lightning_train.checkpoint.remote as remote
    from lightning_train.checkpoint.model_folder import written_by_export
    from lightning_train.checkpoint.pretrained import open_pretrained
    from lightning_train.models.hf import hf_config

    target = Path(output)
    if storage.is_remote(checkpoint):  # s3://: downloaded once and verified (open_pretrained reuses it)
        storage.check_access(checkpoint)
    elif not Path(checkpoint).exists():
        raise UserInputError(
            f"checkpoint {checkpoint} does not exist; pass a .ckpt file or a checkpoint folder"
        )
    else:
        check_apart(target, "--output", [("the checkpoint being exported", checkpoint)],
                    "choose another folder")
    if format not in ("hf", "safetensors", "peft"):
        raise UserInputError(f"--format {format!r} is not one of 'hf', 'safetensors', 'peft'")
    if base_model is not None and format != "peft":
        raise UserInputError("--base_model is recorded in peft adapters only; drop it or pass --format peft")
    shard_bytes = parse_size(max_shard_size)
    earlier = check_replaceable(target, "--output", overwrite, "a folder export wrote", written_by_export)
    source = remote.local_checkpoint(checkpoint) if storage.is_remote(checkpoint) else Path(checkpoint)
    pretrained = open_pretrained(source)
    if format != "safetensors":
        hf_config(pretrained.config)  # refuses a model with no HF equivalent before reading the weights
    if format == "peft" and pretrained.lora is None:
        raise UserInputError(
            f"--format peft: checkpoint {source} holds no LoRA adapters (it is not a fine-tune with "
            "model.lora); export the whole model with --format hf"
        )
    model = pretrained.build_adapted() if format == "peft" else pretrained.build()
    fix = "choose an --output this user can create, on a disk with room for the export"
    with staged(target, fix, needed=_weight_bytes(model, format)) as tmp:
        written = _write(model, pretrained, format, tmp, shard_bytes, base_model)
        if earlier:
            _replace_export(tmp, target)
        else:
            publish(tmp, target, replace=False)
    return [target / path.name for path in written]


def consolidate(checkpoint: str, output: str, overwrite: bool = False) -> Path:
    """``export(checkpoint, output, format="safetensors")``, by its older name: our
    ``model.safetensors`` + ``config.json``, which fine-tuning and ``generate`` load. Returns the
    path of ``model.safetensors``.

    Args:
        checkpoint: the checkpoint folder or file.
        output: the folder to write (as ``export``'s ``output``).
        overwrite: replace the files of an earlier export in ``output``, keeping its other files.

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
    return export(checkpoint, output, format="safetensors", overwrite=overwrite)[0]


def parse_size(size: str | int) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"2KiB"`` or a plain count (decimal units, as transformers)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size), re.IGNORECASE)
    if not found or float(found.group(1)) <= 0:
        raise UserInputError(f"--max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB or 1000000")
    return int(float(found.group(1)) * _UNITS[(found.group(2) or "").upper()])


# Any for the model and the Pretrained: their modules import torch, which `export --help` must not (the
# parser reads this module's annotations)
def _write(model: Any, pretrained: Any, format: str, folder: Path, shard_bytes: int,
           base_model: str | None) -> list[Path]:
    """Write the export of ``model`` (the ``Pretrained``'s) into ``folder``; returns its files."""
    from lightning_train.checkpoint.model_folder import (
        CONFIG_FILE,
        MODEL_FILE,
        save_hf,
        save_peft_adapter,
        save_safetensors,
        save_tokenizer,
    )

    if format == "peft":
        return save_peft_adapter(model, pretrained.config, pretrained.lora, folder, base_model)
    if format == "hf":
        return save_hf(model, folder, pretrained.tokenizer, shard_bytes)
    save_safetensors(model, folder)
    written = [folder / MODEL_FILE, folder / CONFIG_FILE]
    if pretrained.tokenizer is not None:  # beside the weights, so the folder is usable on its own
        written += save_tokenizer(pretrained.tokenizer, folder, model.config.block_size)
    return written


def _weight_bytes(model: Any, format: str) -> int:
    """The bytes of the weights an export writes: the model's, or only its adapters' for ``peft``."""
    from lightning_train.models.lora import adapters

    tensors = ([tensor for pair in adapters(model).values() for tensor in pair] if format == "peft"
               else list(model.state_dict().values()))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _replace_export(tmp: Path, target: Path) -> None:
    """Move the new export's files from ``tmp`` into ``target``, an earlier export's folder, once that
    export's files are gone (a stale shard or index would be loaded); the folder's other files, such as
    a model card, stay."""
    from lightning_train.checkpoint.model_folder import EXPORT_FILES

    for path in target.iterdir():
        if path.is_file() and EXPORT_FILES.fullmatch(path.name):
            path.unlink()
    for path in tmp.iterdir():
        path.replace(target / path.name)
