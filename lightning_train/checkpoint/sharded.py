"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) folders, saved, loaded and re-sharded.

A sharded checkpoint is a folder that Lightning's ``ModelParallelStrategy`` layout defines: DCP shards
of ``{"state_dict": <LightningModule state>, "optimizer_0": <optimizer state>}`` (one file per rank,
plus DCP's ``.metadata``) and ``meta.pt`` with everything else a resume needs (step counters, loops
and data-loader position, LR schedulers, callbacks, hyper-parameters). DCP re-shards on load, so a
folder written by N ranks loads on any number of ranks, or in one plain process.

DCP's own reader unpickles ``.metadata`` with plain ``pickle`` and non-tensor items with
``torch.load(weights_only=False)``: a hostile folder could run code. Every load here goes through
``_SafeReader`` and ``_SafeLoadPlanner`` instead, which accept only DCP's metadata classes and
``weights_only`` items.

    load_sharded_model_state("runs/x/checkpoints/last.ckpt", model)      # weights into a GPT
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

import lightning_train.checkpoint.remote as remote
import lightning_train.storage as storage
from lightning_train._compat import METADATA_FILENAME, TORCH_LAYOUT_GLOBAL
from lightning_train.checkpoint.atomic import begin_checkpoint_dir, write_checkpoint_dir
from lightning_train.checkpoint.background import BackgroundWriter
from lightning_train.checkpoint.format import (
    is_sharded_checkpoint,
    load_torch_file,
    verify_checkpoint,
)
from lightning_train.checkpoint.optimizer_state import optimizer_state_by_name
from lightning_train.errors import UserInputError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PLAIN_GLOBALS = {
    ("torch", "Size"), TORCH_LAYOUT_GLOBAL,  # a layout from its name
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's ``.metadata`` from DCP's own classes, torch sizes, dtypes and layouts only."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _PLAIN_GLOBALS:
            found = super().find_class(module, name)
            if module not in _DCP_MODULES or (isinstance(found, type) and found.__module__ == module):
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed in a DCP .metadata file")


class _SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled by ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as error:
            raise UserInputError(
                f"cannot read the index {path} of sharded checkpoint {self.path} "
                f"({type(error).__name__}: {error}); it is corrupt, hostile or not a "
                "torch.distributed.checkpoint folder"
            ) from error
        if not isinstance(metadata, Metadata):
            raise UserInputError(f"{path} is not a torch.distributed.checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items (optimizer hyper-parameters, ...) are read with
    ``weights_only=True``: the item is loaded safely, and only that safe copy is handed to DCP (which
    would ``torch.load(weights_only=False)`` the file's own bytes)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        item = load_torch_file(value, source=f"{read_item.dest_index.fqn} of {self.path}")
        safe_copy = io.BytesIO()
        torch.save(item, safe_copy)
        safe_copy.seek(0)
        super().load_bytes(read_item, safe_copy)


def _local(path: str | Path) -> Path:
    """A folder on local disk: ``path`` itself, or the verified download of a remote one (each rank
    downloads its own copy; DCP re-shards, so any rank may need any shard)."""
    return remote.local_checkpoint(path) if storage.is_remote(path) else Path(path)


def _load(
    state: dict[str, Any], path: str | Path, no_dist: bool = False, planner: _SafeLoadPlanner | None = None
) -> None:
    """``torch.distributed.checkpoint.load`` through the safe reader and planner."""
    from torch.distributed.checkpoint import load

    planner = planner or _SafeLoadPlanner(path)
    load(state, storage_reader=_SafeReader(str(path)), planner=planner, no_dist=no_dist)


def checkpoint_tensor_shapes(path: str | Path, section: str = "state_dict") -> dict[str, tuple[int, ...]]:
    """Global shapes of the tensors saved under ``section`` (``"state_dict"``: the LightningModule's)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _SafeReader(str(_local(path))).read_metadata().state_dict_metadata
    prefix = section + "."
    return {
        key[len(prefix) :]: tuple(item.size)
        for key, item in metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state for a sharded folder, flattened: every entry keyed by its parameter's
    name, the param-group settings too (``param_groups.<name>.lr``), so ranks that hold different
    parameters (pipeline stages) each save their own and any layout reads its own. (Unflattened, the
    groups are one list per rank under one key, and a folder keeps only one rank's.)"""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = _options(flatten_optimizer_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(module, optimizer, options=options)


def check_compatible(
    path: str | Path, expected: dict[str, tuple[int, ...]], strict: bool = True,
    saved: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Raise one UserInputError naming every missing, unexpected and mis-shaped tensor between the
    checkpoint's LightningModule state and ``expected`` (name -> global shape); ``strict=False`` only
    checks shapes. ``saved``: the checkpoint's shapes when known (a single file), else read from the
    folder ``path``. Returns the checkpoint's shapes."""
    kind = "checkpoint" if saved is not None else "sharded checkpoint"
    saved = checkpoint_tensor_shapes(path) if saved is None else saved
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
            f"the {kind} {path} does not fit this model ({listed}); resume with the model "
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

    Example (a folder as ``DataParallelStrategy`` writes it, here from one process):

        >>> import os
        >>> import tempfile
        >>> import torch
        >>> from lightning_train import GPT, GPTConfig
        >>> from lightning_train.checkpoint import load_sharded_model_state
        >>> from lightning_train.checkpoint.sharded import save_sharded_checkpoint
        >>> config = GPTConfig(vocab_size=258, block_size=16, n_layer=1, n_head=2, n_embd=32)
        >>> trained, folder = GPT(config), f"{tempfile.mkdtemp()}/step=2"
        >>> module_state = {f"model.{name}": tensor for name, tensor in trained.state_dict().items()}
        >>> checkpoint = {"state_dict": module_state, "hyper_parameters": {"config": config}}
        >>> save_sharded_checkpoint(checkpoint, folder, is_writer=True, barrier=lambda: None)
        >>> sorted(os.listdir(folder))
        ['.metadata', '__0_0.distcp', 'manifest.json', 'meta.pt']
        >>> fresh = GPT(config)
        >>> load_sharded_model_state(folder, fresh)
        >>> all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.state_dict().values()))
        True
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = _local(path) if is_sharded_checkpoint(path) else path
    if not is_sharded_checkpoint(path):
        raise UserInputError(f"{path} is not a sharded checkpoint folder (it has no {METADATA_FILENAME})")
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
    _load({"state_dict": {prefix + key: value for key, value in to_load.items()}}, path)
    set_model_state_dict(model, to_load, options=_options(strict=False))


def save_sharded_checkpoint(
    checkpoint: dict[str, Any], path: Path, is_writer: bool, barrier: Callable[[], None],
    writer: BackgroundWriter | None = None, process_group: Any = None,
) -> None:
    """Write ``checkpoint`` as a sharded folder at ``path``, atomically and verifiably; a collective
    (every rank calls it). Every rank writes its DCP shard of model and optimizer state into the hidden
    ``.<name>.partial`` sibling, the writer adds ``meta.pt`` (everything else: counters, loops and data
    position, schedulers, callbacks, hyper-parameters), then fsyncs, writes ``manifest.json`` (sizes +
    sha256) and renames the folder into place. A crash mid-save leaves the previous checkpoint at
    ``path`` untouched.

    With a ``writer`` (asynchronous saves) the shards are staged to host memory and written, committed
    and renamed in its background thread; ``process_group`` is then the group of that thread's
    collectives, which must not be the one training uses."""
    from torch.distributed.checkpoint import save

    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    if writer is not None:
        writer.ready_for(step)  # the staging folder may be the one an earlier write is still committing
    if storage.is_remote(path):
        remote.save_folder(checkpoint, state, str(path), is_writer, barrier, writer, process_group)
        return
    path = Path(path)
    staging = begin_checkpoint_dir(path, is_writer, barrier)
    if is_writer:
        torch.save(checkpoint, staging / METADATA_FILENAME)
    def write(staged: dict[str, Any], group: Any = None) -> None:
        # DCP's coordinator (rank 0) returns once every rank's shard and the .metadata are written
        write_checkpoint_dir(lambda folder: save(staged, checkpoint_id=str(folder), process_group=group),
                             staging, path, is_writer, step, epoch, staged)

    if writer is None:
        write(state)  # collective: returns when every rank's shard is written (or raises on every rank)
        barrier()
        return
    writer.submit(step, state, lambda staged: write(staged, process_group))



def load_sharded_checkpoint(
    path: Path | str,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    is_verifier: bool,
    broadcast: Callable[[Any], Any],
    weights_only: bool = True,
    whole_model: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Load model and optimizer states from a sharded folder written at any world size (DCP re-shards
    on load) into ``module`` (plain or FSDP2-sharded) and ``optimizers``; a collective. ``whole_model``:
    the names and shapes of the whole model's state when ``module`` holds a part of it (a pipeline
    stage): the checkpoint is checked against the whole, and this rank reads its part. Returns the rest
    of the checkpoint (``meta.pt``) for Lightning to restore."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # sha256 of every shard against the manifest, once (on the verifier rank), before any rank reads a byte
    problem = None
    if storage.is_remote(path):
        try:  # every rank downloads its copy, checked against the manifest on the way
            path = _local(path)
        except UserInputError as error:
            problem = error
    elif is_verifier:
        try:
            verify_checkpoint(path)
        except UserInputError as error:
            problem = error
    if (problem := broadcast(problem)) is not None:
        raise problem
    model_state = get_model_state_dict(module)
    check_compatible(path, whole_model or {k: tuple(v.shape) for k, v in model_state.items()}, strict=strict)
    _load({"state_dict": model_state}, path)
    set_model_state_dict(module, model_state, options=_options(strict=strict))
    for index, optimizer in enumerate(optimizers):
        options = _options(flatten_optimizer_state_dict=True)  # as sharded_optimizer_state saved it
        optimizer_state = {f"optimizer_{index}": get_optimizer_state_dict(module, optimizer, options=options)}
        _load(optimizer_state, path)
        set_optimizer_state_dict(module, optimizer, optimizer_state[f"optimizer_{index}"], options=options)
    return read_metadata(path, weights_only)


def load_full_checkpoint(
    checkpoint: dict[str, Any],
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    whole_model: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Load the model and optimizer states of a single-file checkpoint (whole tensors, as one process or
    ddp writes it; already read into ``checkpoint`` on every rank) into a sharded ``module`` (FSDP2,
    tensor parallel or both; or a pipeline stage, with ``whole_model`` as in ``load_sharded_checkpoint``)
    and ``optimizers``: each rank keeps its own shards of its own tensors."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = checkpoint["state_dict"]
    expected = {key: tuple(value.shape) for key, value in get_model_state_dict(module).items()}
    saved = {key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}
    check_compatible(path, whole_model or expected, strict=strict, saved=saved)
    options = _options(full_state_dict=True, strict=strict)
    own = {key: value for key, value in state.items() if key in expected}  # a copy: the loader pops from it
    set_model_state_dict(module, own, options=options)
    saved_optimizers = checkpoint.get("optimizer_states", [])
    for optimizer, optimizer_state in zip(optimizers, saved_optimizers, strict=True):
        keyed = optimizer_state_by_name(optimizer_state, module, optimizer)
        set_optimizer_state_dict(module, optimizer, keyed, options=options)


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def read_metadata(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, loaded safely: ``weights_only`` (the default) accepts plain
    containers, tensors and ``format.safe_globals()`` only, so nothing in the file can run code;
    ``weights_only=False`` is for files the caller trusts."""
    file = _local(path) / METADATA_FILENAME
    if not file.is_file():
        raise UserInputError(f"sharded checkpoint {path} has no {METADATA_FILENAME}: it is incomplete")
    if not weights_only:
        return torch.load(file, map_location="cpu", weights_only=False)
    return load_torch_file(file)


def read_whole_sharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """A sharded folder (written at any world size, flattened optimizer states) read whole in one process,
    into the form a single file holds, for a strategy that restores through Lightning's own path (the
    default one-device strategy): ``state_dict`` of whole tensors and ``meta.pt``'s entries, with each
    optimizer's state keyed by parameter name as ``{"state": {name: ...}, "settings": {name: ...}}``
    (``optimizer_state.numbered_optimizer_state`` numbers it for the module's optimizer). Verified
    first, read through the safe reader and planner."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify_checkpoint(path)
    path = _local(path)
    items = _SafeReader(str(path)).read_metadata().state_dict_metadata
    optimizers = range(len({key.split(".", 1)[0] for key in items if key.startswith("optimizer_")}))
    whole = {key: torch.empty(item.size, dtype=item.properties.dtype)
             if isinstance(item, TensorStorageMetadata) else None for key, item in items.items()}
    _load(whole, path)
    checkpoint = read_metadata(path)
    checkpoint["state_dict"] = {key.split(".", 1)[1]: value for key, value in whole.items()
                                if key.startswith("state_dict.")}
    checkpoint["optimizer_states"] = [_by_name(whole, f"optimizer_{index}.") for index in optimizers]
    return checkpoint


def _by_name(whole: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``prefix + "state.<parameter>.<key>"`` and ``prefix + "param_groups.<parameter>.<setting>"`` entries
    as ``{"state": {parameter: {key: value}}, "settings": {parameter: {setting: value}}}``."""
    grouped: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "settings": {}}
    for key, value in whole.items():
        if key.startswith(prefix):
            section, rest = key[len(prefix):].split(".", 1)
            name, entry = rest.rsplit(".", 1)
            grouped["state" if section == "state" else "settings"].setdefault(name, {})[entry] = value
    return grouped
