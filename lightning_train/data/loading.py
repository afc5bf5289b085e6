"""``ResumableDataModule``: the train and val loaders that ``TextDataModule`` and ``SFTDataModule`` share,
over the world-size-independent data position of ``position.py``; the data module writes no Trainer state
(the ``GlobalBatch`` callback sets the accumulation that keeps ``global_batch_size``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_train.data.position import GlobalOrderSampler, ResumableLoader
from lightning_train.errors import UserInputError


def check_at_least(*checks: tuple[str, int, int]) -> None:
    """Refuse the first ``(name, value, least)`` whose value is below its least one."""
    for name, value, least in checks:
        if value < least:
            raise UserInputError(f"{name}={value} must be at least {least}")


def check_seed(seed: int) -> None:
    """Refuse a seed that the sample order (numpy: not negative) or the loaders' ``torch.Generator``
    (64 bits) cannot take."""
    if not 0 <= seed < 1 << 64:
        raise UserInputError(f"seed={seed} must be in [0, 2**64 - 1], e.g. 1234")


class ResumableDataModule(L.LightningDataModule):
    """The train and val loaders of a data module over map-style datasets ``train_set`` and ``val_set``.

    A subclass sets ``batch_size``, ``seed``, ``num_workers`` and ``global_batch_size``, builds the
    datasets in ``setup`` and may override ``collate`` (batches of examples) and ``describe_train_set``
    (for the too-small error). It owns the data position and writes no Trainer state: the accumulation
    that keeps ``global_batch_size`` is set by the ``GlobalBatch`` callback.
    """

    batch_size: int
    global_batch_size: int | None = None
    seed: int
    num_workers: int
    train_set: Dataset | None
    val_set: Dataset | None

    def train_dataloader(self) -> ResumableLoader:
        limit = self.trainer.limit_train_batches if self.trainer is not None else 1.0
        rank, world_size = data_parallel_rank(self.trainer)
        accumulate = self._step_accumulation(world_size)
        return self.train_loader(rank, world_size, limit_batches=limit, accumulate=accumulate)

    def _step_accumulation(self, data_parallel: int) -> int:
        """With ``global_batch_size``, the Trainer's accumulation (``GlobalBatch`` set it), checked to give
        that many samples a step: each epoch then ends at a whole step, the same at any data-parallel size."""
        if self.global_batch_size is None or self.trainer is None:
            return 1
        accumulate = self.trainer.accumulate_grad_batches
        if accumulate * self.batch_size * data_parallel != self.global_batch_size:
            raise UserInputError(
                f"global_batch_size={self.global_batch_size} is not batch_size={self.batch_size} x "
                f"{data_parallel} data-parallel ranks x accumulate_grad_batches={accumulate}; add "
                "lightning_train.callbacks.GlobalBatch() to the Trainer's callbacks, which sets the "
                "accumulation at fit start (the CLI adds it)"
            )
        return accumulate

    def val_dataloader(self) -> DataLoader:
        limit = self.trainer.limit_val_batches if self.trainer is not None else 1.0
        return self.val_loader(*data_parallel_rank(self.trainer), limit_batches=limit)

    # Loaders for an explicit rank (what the hooks above use)
    def train_loader(
        self, rank: int = 0, world_size: int = 1, limit_batches: int | float = 1.0, accumulate: int = 1
    ) -> ResumableLoader:
        self.setup()
        assert self.train_set is not None
        sampler = GlobalOrderSampler(
            self.train_set,
            world_size,
            rank,
            self.seed,
            self.batch_size,
            limit_batches,
            self.describe_train_set(),
            accumulate,
        )
        if len(self.train_set) < sampler.global_batch:
            raise UserInputError(
                f"the train split has {self.describe_train_set()}, fewer than batch_size={self.batch_size} x "
                f"{world_size} devices; lower one of them or add data"
            )
        if sampler.batches_per_epoch == 0:
            raise UserInputError(
                f"limit_train_batches={limit_batches} leaves no whole batch of the train split's "
                f"{len(self.train_set) // sampler.global_batch}; raise it"
            )
        return ResumableLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate(),
            **self._worker_kwargs(),
        )  # fmt: skip

    def val_loader(self, rank: int = 0, world_size: int = 1, limit_batches: int | float = 1.0) -> DataLoader:
        """The val split, or ``limit_batches`` batches a rank of it (the Trainer's ``limit_val_batches``, the
        one knob of the validation size) spread evenly over the split: the same examples at every
        validation, a sample of the whole split rather than its first batches."""
        self.setup()
        assert self.val_set is not None
        if isinstance(limit_batches, float) and limit_batches not in (0.0, 1.0):
            raise UserInputError(
                f"limit_val_batches={limit_batches}: give the validation size as a number of batches a "
                "device (an int, e.g. 10: spread over the val split), or 1.0 for the whole split"
            )
        val_set = self.val_set
        if isinstance(limit_batches, int) and limit_batches * self.batch_size * world_size < len(val_set):
            val_set = self.spread_val_set(limit_batches * self.batch_size * world_size)
        # Every validation starts from the beginning: a plain shard, whole and in order.
        sampler = DistributedSampler(val_set, world_size, rank, shuffle=False, drop_last=True)
        return DataLoader(
            val_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate(),
            **self._worker_kwargs(),
        )  # fmt: skip

    def spread_val_set(self, wanted: int) -> Dataset:
        """``wanted`` (fewer than all) examples of the val split, spread evenly over it."""
        return Subset(self.val_set, spread(len(self.val_set), wanted).tolist())

    def collate(self) -> Callable[[list[Any]], Any] | None:
        """How examples become a batch; None: torch's default (stacking)."""
        return None

    def describe_train_set(self) -> str:
        return f"{len(self.train_set)} examples"

    def _worker_kwargs(self) -> dict[str, Any]:
        workers = {"persistent_workers": True, "prefetch_factor": 4} if self.num_workers > 0 else {}
        return {
            "num_workers": self.num_workers,
            "pin_memory": torch.cuda.is_available(),  # page-locked batches copy to the GPU asynchronously
            "generator": torch.Generator().manual_seed(self.seed),  # see position.py's docstring
            **workers,
        }


def spread(total: int, wanted: int) -> np.ndarray:
    """``wanted`` indices of ``range(total)``, evenly spaced from 0."""
    return np.arange(wanted) * total // max(wanted, 1)


def data_parallel_rank(trainer: L.Trainer | None) -> tuple[int, int]:
    """(rank, world_size) of this process among the data-parallel replicas, as Lightning would shard."""
    kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    if kwargs:
        return kwargs["rank"], kwargs["num_replicas"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
