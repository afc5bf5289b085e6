"""The loaders that ``TextDataModule`` and ``SFTDataModule`` share, and their world-size-independent position.

One global sample order per epoch (a permutation seeded by ``(seed, epoch)``, or the plain order for
validation) is cut into global batches of ``batch_size x data-parallel ranks`` samples; rank ``r`` takes
every ``world_size``-th sample of each global batch, starting at ``r``. The data position is the number of
global samples of the epoch consumed so far, so it means the same thing at any world size (as Megatron's
``consumed_samples`` and OLMo's global step do):

- Same world size and batch size: the resumed run loads the very batches the uninterrupted run would
  (with one rank this is ``DistributedSampler``'s order exactly).
- Another world size or per-device batch size (2 devices -> 1, ddp <-> fsdp, a lost node): the resumed run
  continues with the first global sample not yet consumed, cut into batches of the new global size. No
  sample of the epoch is repeated or skipped; only the last, incomplete global batch of an epoch is
  dropped, as always. Steps then hold another number of samples; the LR schedule still counts steps.
- Another dataset, ``seq_len`` or ``seed``: the position means nothing in the new order and is refused.

Sharding and resume under Lightning:

- The samplers subclass ``DistributedSampler``, so Lightning leaves them alone (``use_distributed_sampler``
  only replaces plain samplers). They shard by the strategy's data-parallel rank themselves, and Lightning
  still calls ``set_epoch`` on them at the start of every epoch.
- The train loader is a ``StatefulDataLoader``. Lightning's fit loop puts its ``state_dict()`` (rank zero's;
  being global, it is every rank's) into every checkpoint (``loops.fit_loop.state_dict.combined_loader``)
  and, on resume, loads it right before creating the iterator. With workers, that iterator prefetches
  indices before Lightning calls ``set_epoch``, so the epoch travels in the sampler's state, and a position
  saved after an epoch's last batch resumes at the next epoch. For that the sampler's epoch ends exactly
  where Lightning's does (``limit_train_batches``: an int counts global batches, a fraction the epoch).
- Each loader has its own seeded ``torch.Generator``: creating an iterator draws a worker seed from it, and
  drawing from the global RNG instead would shift the model's dropout stream between a run and its resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_train.errors import UserInputError


def check_at_least(*checks: tuple[str, int, int]) -> None:
    """Refuse the first ``(name, value, least)`` whose value is below its least one."""
    for name, value, least in checks:
        if value < least:
            raise UserInputError(f"{name}={value} must be at least {least}")


class GlobalOrderSampler(DistributedSampler):
    """This rank's share of one global sample order, resumable at any world size.

    Epoch ``e`` is the permutation of the dataset seeded by ``(seed, e)`` (the plain order when
    ``shuffle=False``), cut into ``batches_per_epoch`` global batches of ``batch_size x num_replicas``
    samples: all whole global batches, at most ``limit_batches`` (Lightning's ``limit_train_batches``: an int,
    or a fraction of the epoch). Rank ``r`` yields samples ``r, r + num_replicas, ...`` of each global batch.

    ``state_dict()`` holds the epoch and ``consumed``, the global samples of the epoch drawn or skipped, plus
    what the position is only valid for (dataset size, seed, order) and the global batch it was saved with.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        seed: int,
        batch_size: int = 1,
        shuffle: bool = True,
        limit_batches: int | float = 1.0,
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.batch_size = batch_size
        self.global_batch = batch_size * num_replicas
        whole = len(dataset) // self.global_batch
        self.batches_per_epoch = (
            int(whole * limit_batches) if isinstance(limit_batches, float) else min(whole, limit_batches)
        )
        self.num_samples = self.batches_per_epoch * batch_size  # this rank's share: len(self)
        self.epoch_samples = self.batches_per_epoch * self.global_batch  # where the epoch ends, globally
        self.consumed = 0  # global samples of this epoch drawn or skipped
        self.skip_into_next_epoch = 0  # global samples a skip past the epoch's end still has to pass over

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        shuffled = self.shuffle
        order = np.random.default_rng((self.seed, self.epoch)).permutation(n) if shuffled else np.arange(n)
        # Reads the position before each batch, so a skip_batches in between jumps right there.
        while self.consumed + self.global_batch <= self.epoch_samples:
            first = self.consumed + self.rank
            batch = order[first : first + self.global_batch : self.num_replicas]
            self.consumed += self.global_batch
            yield from batch.tolist()

    def skip_batches(self, num_batches: int) -> None:
        """Pass over the next ``num_batches`` global batches of the order without loading them.

        Call it with the same ``num_batches`` on every data-parallel rank: each then skips
        ``num_batches x batch_size x num_replicas`` samples of the one global order, so the ranks stay in
        step. A skip past the epoch's end ends the epoch and goes on into the next one. The position in
        ``state_dict()`` counts the skipped batches, so a run resumed after the skip continues after them.

        Indices a loader has already drawn are not affected: they are the next batches it yields. Lightning
        does not prefetch a sized loader, so with ``num_workers=0`` the skip starts at the very next batch;
        with workers each worker holds ``prefetch_factor`` batches drawn ahead (``prefetch_factor x
        num_workers`` in all), which are still loaded and trained on before the skip takes effect.
        """
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be at least 0")
        samples = num_batches * self.global_batch
        within_epoch = min(samples, max(self.epoch_samples - self.consumed, 0))
        self.consumed += within_epoch
        self.skip_into_next_epoch += samples - within_epoch

    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        carried = self.skip_into_next_epoch if epoch == self.epoch + 1 else 0
        super().set_epoch(epoch)
        self.consumed = min(carried, self.epoch_samples)  # a position belongs to its epoch only
        self.skip_into_next_epoch = carried - self.consumed

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "skip_into_next_epoch": self.skip_into_next_epoch,
            "global_batch": self.global_batch,
            "dataset_size": len(self.dataset),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["dataset_size"], state["seed"], state["shuffle"])
        if saved != (len(self.dataset), self.seed, self.shuffle):
            raise UserInputError(
                f"the checkpoint's data position is in the order of {state['dataset_size']} samples with "
                f"seed={state['seed']}; this run's data has {len(self.dataset)} samples with seed={self.seed}"
                " (another dataset, seq_len or seed). Resume with the data, seq_len and seed the checkpoint "
                "was saved with, or start a new run from its weights"
            )
        self.epoch, self.consumed = state["epoch"], state["consumed"]
        self.skip_into_next_epoch = state["skip_into_next_epoch"]
        if self.consumed + self.global_batch > self.epoch_samples:  # no whole batch left: the next epoch
            self.set_epoch(self.epoch + 1)


class ResumableDataModule(L.LightningDataModule):
    """The train and val loaders of a data module over map-style datasets ``train_set`` and ``val_set``.

    A subclass sets ``batch_size``, ``seed``, ``num_workers``, builds the datasets in ``setup`` and may
    override ``collate`` (batches of examples) and ``describe_train_set`` (for the too-small error).
    """

    batch_size: int
    seed: int
    num_workers: int
    train_set: Dataset | None
    val_set: Dataset | None

    def train_dataloader(self) -> StatefulDataLoader:
        limit = self.trainer.limit_train_batches if self.trainer is not None else 1.0
        return self.train_loader(*self._data_parallel_rank(), limit_batches=limit)

    def val_dataloader(self) -> DataLoader:
        return self.val_loader(*self._data_parallel_rank())

    # Loaders for an explicit rank (what the hooks above use)
    def train_loader(
        self, rank: int = 0, world_size: int = 1, limit_batches: int | float = 1.0
    ) -> StatefulDataLoader:
        self.setup()
        assert self.train_set is not None
        sampler = GlobalOrderSampler(
            self.train_set, world_size, rank, self.seed, self.batch_size, limit_batches=limit_batches
        )
        if sampler.batches_per_epoch == 0:
            raise UserInputError(
                f"the train split has {self.describe_train_set()}, fewer than batch_size={self.batch_size} x "
                f"{world_size} devices; lower one of them or add data"
            )
        return StatefulDataLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate(),
            **self._worker_kwargs(),
        )  # fmt: skip

    def val_loader(self, rank: int = 0, world_size: int = 1) -> DataLoader:
        self.setup()
        assert self.val_set is not None
        sampler = GlobalOrderSampler(self.val_set, world_size, rank, self.seed, shuffle=False)
        return DataLoader(
            self.val_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate(),
            **self._worker_kwargs(),
        )  # fmt: skip

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
            "generator": torch.Generator().manual_seed(self.seed),  # see the module docstring
            **workers,
        }

    def _data_parallel_rank(self) -> tuple[int, int]:
        """(rank, world_size) of this process among the data-parallel replicas, as Lightning would shard."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if kwargs:
            return kwargs["rank"], kwargs["num_replicas"]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1
