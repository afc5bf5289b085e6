"""The checkpoints of ``ParallelStrategy``: under DDP one ordinary file, Lightning's own; otherwise a sharded
folder (``torch.distributed.checkpoint``, loadable at any world size and layout) written and read by
``lightning_train.checkpoint.sharded``, and a single file read into sharded parameters."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_train._compat import PathLike
from lightning_train.checkpoint.format import is_sharded_checkpoint
from lightning_train.storage import as_path


class ShardedCheckpoints:
    """``ParallelStrategy``'s checkpoint methods (module doc); a base of it, before Lightning's
    ``ParallelStrategy``, whose methods (``super()``) save and load the DDP file."""

    def __init__(self) -> None:
        super().__init__()
        # True once load_checkpoint has put the model and optimizer states in place
        self._restored_by_strategy = False
        self._checkpoint_group: Any = None  # the gloo group of background sharded saves
        # the whole LightningModule's state (name -> shape) when this rank holds part of it (a pipeline
        # stage): checkpoints are checked against the whole model
        self.whole_model_shapes: dict[str, tuple[int, ...]] | None = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.sharding == "ddp":
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # this rank's shards, on the host
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=True))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.sharding == "ddp":
            return super().optimizer_state(optimizer)
        # checkpoint.sharded imports torch.distributed.checkpoint (~0.1 s): only runs that shard pay it
        from lightning_train.checkpoint.sharded import sharded_optimizer_state

        return sharded_optimizer_state(self.model, optimizer)  # trainer.optimizers: plain torch ones

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None
    ) -> None:
        if self.sharding == "ddp":  # one ordinary file from rank 0, through the Trainer's CheckpointIO
            super().save_checkpoint(checkpoint, filepath, storage_options)
        else:
            self.save_sharded_checkpoint(checkpoint, as_path(filepath))

    def save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write ``checkpoint`` as a sharded folder at ``path``, atomically and verifiably (see
        ``checkpoint.sharded.save_sharded_checkpoint``); in the background when the checkpoint plugin is
        ``AtomicCheckpointIO(async_save=True)``."""
        from lightning_train.checkpoint.sharded import save_sharded_checkpoint

        path = as_path(self.broadcast(str(path)))  # an s3:// URL stays one
        writer = getattr(self.checkpoint_io, "writer", None)
        if writer is not None and self._checkpoint_group is None:
            # the writer thread's collectives get a group of their own, never interleaved with training's
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")
        save_sharded_checkpoint(
            checkpoint, path, is_writer=self.global_rank == 0, barrier=self.barrier,
            writer=writer, process_group=self._checkpoint_group,
        )

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        flush = getattr(self.checkpoint_io, "flush", None)
        if flush is not None:
            flush()  # a checkpoint being written in the background is complete before anything is read
        path = as_path(self.broadcast(str(checkpoint_path)))  # an s3:// URL stays one
        if is_sharded_checkpoint(path):
            metadata = self.load_sharded_checkpoint(path, weights_only)
        elif self.sharding == "fsdp":  # a single file (one process, ddp) into sharded parameters
            from lightning_train.checkpoint.sharded import load_full_checkpoint

            metadata = super().load_checkpoint(path, weights_only)
            module = self.lightning_module
            load_full_checkpoint(
                metadata, path, module, self.optimizers, strict=module.strict_loading,
                whole_model=self.whole_model_shapes,
            )
        else:
            return super().load_checkpoint(path, weights_only)
        self._restored_by_strategy = True
        return metadata

    def load_sharded_checkpoint(self, path: Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizer states from a sharded folder written at any world size (DCP
        re-shards on load); returns the rest of the checkpoint for Lightning to restore."""
        from lightning_train.checkpoint.sharded import load_sharded_checkpoint

        module = self.lightning_module
        return load_sharded_checkpoint(
            path, module, self.optimizers, strict=module.strict_loading, is_verifier=self.global_rank == 0,
            broadcast=self.broadcast, weights_only=weights_only is not False,
            whole_model=self.whole_model_shapes,
        )

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into the model as laid out (sharded)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._restored_by_strategy

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._restored_by_strategy:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._restored_by_strategy:
            super().load_optimizer_state_dict(checkpoint)
