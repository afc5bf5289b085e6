"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) folders, saved, loaded and re-sharded.

A sharded checkpoint is a folder that Lightning's ``ModelParallelStrategy`` layout defines: DCP shards
of ``{"state_dict": <LightningModule state>, "optimizer_0": <optimizer state>}`` (one file per rank,
plus DCP's ``.metadata``) and ``meta.pt`` with everything else a resume needs (step counters, loops
and data-loader position, LR schedulers, callbacks, hyper-parameters). DCP re-shards on load, so a
folder written by N ranks loads on any number of ranks, or in one plain process.

    load_sharded_model_state("runs/x/checkpoints/last.ckpt", model)      # weights into a GPT
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn

from lightning_train.checkpoint.format import atomic_checkpoint_dir, load_torch_file, verify_checkpoint
from lightning_train.errors import UserInputError


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / _METADATA_FILENAME).is_file()


def checkpoint_tensor_shapes(path: str | Path, section: str = "state_dict") -> dict[str, tuple[int, ...]]:
    """Global shapes of the tensors saved under ``section`` (``"state_dict"``: the LightningModule's)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as error:  # DCP's .metadata is a pickle too: refused or unreadable, say which file
        raise UserInputError(
            f"cannot read the index {Path(path) / '.metadata'} of sharded checkpoint {path} "
            f"({type(error).__name__}: {error}); it is corrupt or not a torch.distributed.checkpoint folder"
        ) from error
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


def save_sharded_checkpoint(
    checkpoint: dict[str, Any], path: Path, is_writer: bool, barrier: Callable[[], None]
) -> None:
    """Write ``checkpoint`` as a sharded folder at ``path``, atomically and verifiably; a collective
    (every rank calls it). Every rank writes its DCP shard of model and optimizer state into the hidden
    ``.<name>.partial`` sibling, the writer adds ``meta.pt`` (everything else: counters, loops and data
    position, schedulers, callbacks, hyper-parameters), then fsyncs, writes ``manifest.json`` (sizes +
    sha256) and renames the folder into place. A crash mid-save leaves the previous checkpoint at
    ``path`` untouched."""
    from torch.distributed.checkpoint import save

    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    with atomic_checkpoint_dir(
        path, checkpoint.get("global_step"), checkpoint.get("epoch"), is_writer=is_writer
    ) as staging:
        barrier()  # the writer has cleared the staging folder before anyone writes into it
        save(state, checkpoint_id=str(staging))  # collective: returns when every rank's shard is written
        if is_writer:
            torch.save(checkpoint, staging / _METADATA_FILENAME)
    barrier()


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    is_verifier: bool,
    broadcast: Callable[[Any], Any],
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load model and optimizer states from a sharded folder written at any world size (DCP re-shards
    on load) into ``module`` (plain or FSDP2-sharded) and ``optimizers``; a collective. Returns the rest
    of the checkpoint (``meta.pt``) for Lightning to restore."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # sha256 of every shard against the manifest, once (on the verifier rank), before any rank reads a byte
    problem = None
    if is_verifier:
        try:
            verify_checkpoint(path)
        except UserInputError as error:
            problem = error
    if (problem := broadcast(problem)) is not None:
        raise problem
    model_state = get_model_state_dict(module)
    check_compatible(path, {k: tuple(v.shape) for k, v in model_state.items()}, strict=strict)
    load({"state_dict": model_state}, checkpoint_id=str(path))
    set_model_state_dict(module, model_state, options=_options(strict=strict))
    for index, optimizer in enumerate(optimizers):
        optimizer_state = {f"optimizer_{index}": get_optimizer_state_dict(module, optimizer)}
        load(optimizer_state, checkpoint_id=str(path))
        set_optimizer_state_dict(module, optimizer, optimizer_state[f"optimizer_{index}"])
    return read_metadata(path, weights_only)


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def read_metadata(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, loaded safely: ``weights_only`` (the default) accepts plain
    containers, tensors and ``format.safe_globals()`` only, so nothing in the file can run code;
    ``weights_only=False`` is for files the caller trusts."""
    file = Path(path) / _METADATA_FILENAME
    if not file.is_file():
        raise UserInputError(f"sharded checkpoint {path} has no {_METADATA_FILENAME}: it is incomplete")
    if not weights_only:
        return torch.load(file, map_location="cpu", weights_only=False)
    return load_torch_file(file)
