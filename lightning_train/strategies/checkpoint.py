"""Sharded checkpoints (``torch.distributed.checkpoint`` folders) and their export to safetensors.

A sharded checkpoint is a folder that Lightning's ``ModelParallelStrategy`` layout defines: DCP shards
of ``{"state_dict": <LightningModule state>, "optimizer_0": <optimizer state>}`` (one file per rank,
plus DCP's ``.metadata``) and ``meta.pt`` with everything else a resume needs (step counters, loops
and data-loader position, LR schedulers, callbacks, hyper-parameters). DCP re-shards on load, so a
folder written by N ranks loads on any number of ranks, or in one plain process.

    load_sharded_model_state("runs/x/checkpoints/last.ckpt", model)      # weights into a GPT
    consolidate("runs/x/checkpoints/last.ckpt", "exports/x")              # model.safetensors + config.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn

from lightning_train.errors import UserInputError

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / _METADATA_FILENAME).is_file()


def checkpoint_tensor_shapes(path: str | Path, section: str = "state_dict") -> dict[str, tuple[int, ...]]:
    """Global shapes of the tensors saved under ``section`` (``"state_dict"``: the LightningModule's)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = section + "."
    return {
        key[len(prefix) :]: tuple(item.size)
        for key, item in metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def check_compatible(
    path: str | Path, expected: dict[str, tuple[int, ...]], strict: bool = True
) -> dict[str, tuple[int, ...]]:
    """Raise one UserInputError naming every missing, unexpected and mis-shaped tensor between the
    checkpoint's LightningModule state and ``expected`` (name -> global shape); ``strict=False`` only
    checks shapes. Returns the checkpoint's shapes."""
    saved = checkpoint_tensor_shapes(path)
    problems = [
        f"{key}: checkpoint {saved[key]} vs model {tuple(shape)}"
        for key, shape in expected.items()
        if key in saved and tuple(saved[key]) != tuple(shape)
    ]
    if strict:
        problems += [f"{key}: missing from the checkpoint" for key in expected if key not in saved]
        problems += [f"{key}: not in the model" for key in saved if key not in expected]
    if problems:
        listed = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise UserInputError(
            f"the sharded checkpoint {path} does not fit this model ({listed}); resume with the model "
            "config the checkpoint was trained with, or start a new run"
        )
    return saved


def load_sharded_model_state(
    path: str | Path, model: nn.Module, prefix: str = "model.", strict: bool = True
) -> None:
    """Load the weights of a sharded checkpoint folder into ``model``, on any number of ranks (or in a
    plain process), whether ``model`` is plain or sharded with ``fully_shard``.

    ``prefix`` is where the network sits inside the saved LightningModule (``PretrainModule.model``);
    pass ``""`` for a LightningModule. ``strict=False`` leaves parameters the checkpoint lacks (e.g.
    new LoRA adapters) as they are; shapes must match either way.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not is_sharded_checkpoint(path):
        raise UserInputError(f"{path} is not a sharded checkpoint folder (it has no {_METADATA_FILENAME})")
    own = get_model_state_dict(model)
    saved = check_compatible(
        path, {prefix + key: tuple(value.shape) for key, value in own.items()}, strict=False
    )
    missing = [key for key in own if prefix + key not in saved]
    if strict and missing:
        raise UserInputError(
            f"the sharded checkpoint {path} lacks {len(missing)} of the model's tensors under prefix "
            f"{prefix!r} (e.g. {missing[:4]}); pass the right prefix, or strict=False for new parameters"
        )
    to_load = {key: value for key, value in own.items() if prefix + key in saved}
    load({"state_dict": {prefix + key: value for key, value in to_load.items()}}, checkpoint_id=str(path))
    set_model_state_dict(model, to_load, options=_options(strict=False))


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def read_metadata(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, or a whole ``.ckpt`` file. ``weights_only`` (the default)
    unpickles no code: only plain containers, tensors and ``models.weights.safe_globals()``."""
    from lightning_train.models.weights import safe_globals

    file = Path(path) / _METADATA_FILENAME if Path(path).is_dir() else Path(path)
    with torch.serialization.safe_globals(safe_globals()):
        try:
            return torch.load(file, map_location="cpu", weights_only=weights_only)
        except Exception as error:  # pickle.UnpicklingError for objects outside the allow-list
            raise UserInputError(
                f"cannot read {file} safely ({error}); pass the model config explicitly"
            ) from error


def consolidate(checkpoint: str, output: str, overwrite: bool = False) -> Path:
    """Export a checkpoint of this package — a sharded folder of any world size, or a ``.ckpt`` file
    (LoRA adapters merged) — to ``OUTPUT/model.safetensors`` (full fp32 weights, names as in
    ``GPT.state_dict()``) and ``OUTPUT/config.json`` (the ``GPTConfig``), which fine-tuning and
    ``generate`` load. Runs in one plain process, whatever the world size was.

    Args:
        checkpoint: the checkpoint folder or file.
        output: folder to write into (created if missing).
        overwrite: replace an existing export in ``output``.
    """
    from lightning_train.models.weights import open_pretrained, save_safetensors

    source, target = Path(checkpoint), Path(output)
    if not source.exists():
        raise UserInputError(f"checkpoint {source} does not exist")
    if (target / MODEL_FILE).exists() and not overwrite:
        raise UserInputError(
            f"{target / MODEL_FILE} already exists; choose another --output or pass --overwrite true"
        )
    save_safetensors(open_pretrained(source).build(), target)
    print(f"wrote {target / MODEL_FILE} and {target / CONFIG_FILE}")
    return target / MODEL_FILE
