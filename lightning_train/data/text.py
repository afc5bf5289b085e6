"""``TextDataModule``: fixed-length windows over memory-mapped token shards, for pretraining.

A window is ``seq_len + 1`` consecutive tokens of one shard, starting every ``seq_len`` tokens, so every
token is a target once per epoch. Batches are ``{"input_ids": (B, T), "labels": (B, T)}`` int64 tensors,
``labels`` being ``input_ids`` shifted left by one.

Sharding and resume under Lightning:

- The samplers subclass ``DistributedSampler``, so Lightning leaves them alone (``use_distributed_sampler``
  only replaces plain samplers). They shard by the strategy's data-parallel rank themselves, and Lightning
  still calls ``set_epoch`` on them at the start of every epoch.
- The train loader is a ``StatefulDataLoader``. Lightning's fit loop puts its ``state_dict()`` into every
  checkpoint (``loops.fit_loop.state_dict.combined_loader``) and, on resume, loads it right before creating
  the iterator. With workers, that iterator prefetches indices before Lightning calls ``set_epoch``, so the
  epoch travels in the sampler's state, and a position saved after an epoch's last batch resumes at the next
  epoch. For that the sampler's epoch ends exactly where Lightning's does (``limit_train_batches``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_train.data.default_corpus import default_corpus_dir
from lightning_train.data.shards import read_meta
from lightning_train.data.tokenizers import Tokenizer, load_tokenizer
from lightning_train.errors import UserInputError


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens over shard files; item ``i`` is the ``i``-th window overall, or the
    ``indices[i]``-th once ``indices`` picks a subset. Shards are memory-mapped lazily in each process."""

    def __init__(self, paths: list[Path], dtype: str, seq_len: int) -> None:
        self.paths, self.dtype, self.seq_len = paths, np.dtype(dtype), seq_len
        sizes = [path.stat().st_size // self.dtype.itemsize for path in paths]
        windows = [max(size - 1, 0) // seq_len for size in sizes]
        self.first_window = np.cumsum([0, *windows])  # window id where each shard starts
        self.num_windows = int(self.first_window[-1])
        self.indices: np.ndarray | None = None
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.num_windows if self.indices is None else len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = int(i if self.indices is None else self.indices[i])
        shard = int(np.searchsorted(self.first_window, window, side="right")) - 1
        start = (window - int(self.first_window[shard])) * self.seq_len
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self.paths[shard], dtype=self.dtype, mode="r")
        tokens = torch.from_numpy(self._maps[shard][start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # workers open their own maps instead of receiving copies


class WindowSampler(DistributedSampler):
    """This rank's share of the windows: a permutation seeded by ``(seed, epoch)`` (or the plain order when
    ``shuffle=False``) dealt round-robin to the ranks, cut so that every rank gets the same number of whole
    batches, at most ``limit_batches`` (Lightning's ``limit_train_batches``: an int or a fraction). Its
    ``state_dict`` holds the epoch and how far into it the loader has got."""

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
        batch_size: int = 1,
        limit_batches: int | float = 1.0,
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        batches = self.num_samples // batch_size
        batches = (
            int(batches * limit_batches) if isinstance(limit_batches, float) else min(batches, limit_batches)
        )
        # An epoch ends exactly where Lightning's does, so a position saved after its last batch is seen
        # as complete (see load_state_dict).
        self.num_samples = batches * batch_size
        self.yielded = 0  # indices handed out in the current epoch
        self._resume_at = 0

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        order = (
            np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle else np.arange(n)
        )
        mine = order[self.rank : self.total_size : self.num_replicas][: self.num_samples]
        self.yielded, self._resume_at = self._resume_at, 0
        for index in mine[self.yielded :]:
            self.yielded += 1
            yield int(index)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.yielded = self._resume_at = 0  # a position belongs to its epoch only
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_samples"] != self.num_samples:
            raise UserInputError(
                f"the checkpoint's data position counts {state['num_samples']} windows per rank, this run "
                f"has {self.num_samples}; resume with the same data, seq_len, batch_size and device count"
            )
        self.epoch, self._resume_at = state["epoch"], state["yielded"]
        if self._resume_at >= self.num_samples:  # saved after the epoch's last batch: the next epoch follows
            self.epoch, self._resume_at = self.epoch + 1, 0
        self.yielded = self._resume_at


class TextDataModule(L.LightningDataModule):
    """Pretraining data: random windows of ``seq_len`` tokens from a folder made by ``prepare``.

    Args:
        data_dir: the dataset folder; ``None`` uses the default corpus (built once, in seconds).
        seq_len: tokens per training example.
        batch_size: examples per batch on each device.
        seed: seeds the window order; epoch ``e`` uses the permutation for ``(seed, e)``.
        num_workers: data-loading processes per device (0 loads in the training process).
        val_batches: validation batches (of ``batch_size`` windows, spread evenly over the val split and the
            same every time); ``None`` uses every val window.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        seed: int = 1234,
        num_workers: int = 0,
        val_batches: int | None = 20,
    ) -> None:
        super().__init__()
        for name, value, least in (
            ("seq_len", seq_len, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < least:
                raise UserInputError(f"{name}={value} must be at least {least}")
        if val_batches is not None and val_batches < 1:
            raise UserInputError(
                f"val_batches={val_batches} must be at least 1, or None for the whole val split"
            )
        self.save_hyperparameters()
        self.data_dir, self.seq_len, self.batch_size = data_dir, seq_len, batch_size
        self.seed, self.num_workers, self.val_batches = seed, num_workers, val_batches
        self._meta: dict[str, Any] | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    # What the model module checks against its configuration
    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = read_meta(self._resolve_dir())
        return self._meta

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.meta["eos_id"]

    @property
    def max_token_id(self) -> int:
        return max(shard["max_token_id"] for shard in self.meta["shards"])

    @property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.meta["tokenizer"])

    # Lightning hooks
    def prepare_data(self) -> None:
        self._resolve_dir()  # builds the default corpus once per node

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        folder, meta = self._resolve_dir(), self.meta
        train_set = self._windows(folder, meta, "train")
        if len(train_set) == 0:
            longest = max((s["num_tokens"] for s in meta["shards"] if s["split"] == "train"), default=0)
            raise UserInputError(
                f"seq_len={self.seq_len} is too long for {folder}: its longest train shard has {longest} "
                f"tokens, so use seq_len <= {max(longest - 1, 1)}"
            )
        val_set = self._windows(folder, meta, "val")
        if self.val_batches is not None:
            wanted = min(self.val_batches * self.batch_size, val_set.num_windows)
            val_set.indices = np.arange(wanted) * val_set.num_windows // max(wanted, 1)  # evenly spread
        self.train_set, self.val_set = train_set, val_set

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
        sampler = WindowSampler(
            self.train_set,
            world_size,
            rank,
            self.seed,
            batch_size=self.batch_size,
            limit_batches=limit_batches,
        )
        loader = StatefulDataLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, **self._worker_kwargs()
        )
        if len(loader) == 0:
            raise UserInputError(
                f"the train split has {len(self.train_set)} windows of seq_len={self.seq_len}, fewer than "
                f"batch_size={self.batch_size} x {world_size} devices; lower one of them or add data"
            )
        return loader

    def val_loader(self, rank: int = 0, world_size: int = 1) -> DataLoader:
        self.setup()
        assert self.val_set is not None
        sampler = WindowSampler(self.val_set, world_size, rank, self.seed, shuffle=False)
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=sampler, **self._worker_kwargs())

    def _worker_kwargs(self) -> dict[str, Any]:
        # An own generator: creating an iterator draws a worker seed from it, and drawing from the
        # global RNG instead would shift the model's dropout stream between a run and its resume.
        workers = {"persistent_workers": True, "prefetch_factor": 4} if self.num_workers > 0 else {}
        return {
            "num_workers": self.num_workers,
            "pin_memory": torch.cuda.is_available(),  # page-locked batches copy to the GPU asynchronously
            "generator": torch.Generator().manual_seed(self.seed),
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

    def _resolve_dir(self) -> Path:
        return default_corpus_dir() if self.data_dir is None else Path(self.data_dir).expanduser()

    def _windows(self, folder: Path, meta: dict[str, Any], split: str) -> TokenWindows:
        paths = [folder / shard["file"] for shard in meta["shards"] if shard["split"] == split]
        return TokenWindows(paths, meta["dtype"], self.seq_len)
