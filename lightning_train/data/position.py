"""The data position: one global sample order, resumable at any world size (``GlobalOrderSampler``,
``ResumableLoader``), under the loaders of ``TextDataModule`` and ``SFTDataModule`` (``loading.py``).

One global sample order per epoch (a permutation seeded by ``(seed, epoch)``) is cut into global batches
of ``batch_size x data-parallel ranks`` samples; rank ``r`` takes every ``world_size``-th sample of each
global batch, starting at ``r``. The data position is the number of global samples of the epoch consumed
so far, so it means the same thing at any world size (as Megatron's ``consumed_samples`` and OLMo's
global step do). Validation reads a plain shard of the val set, the same at every validation.

- Same world size and batch size: the resumed run loads the very batches the uninterrupted run would
  (with one rank this is ``DistributedSampler``'s order exactly).
- Another global batch (2 devices -> 1 or 1 -> 2, ddp <-> fsdp, a lost node, another per-device
  ``batch_size``): the resumed run continues with the first global sample not yet consumed, cut into
  batches of the new global size. No sample of the epoch is repeated or skipped; only the last incomplete
  global batch of an epoch is dropped, as always. A step then holds another number of samples; the LR
  schedule and ``max_steps`` still count optimizer steps, so scale them yourself if that matters.
- Another dataset, ``seq_len`` or ``seed``: the position means nothing in the new order and is refused
  with one ``UserInputError`` naming both.

Resume under Lightning:

- The samplers subclass ``DistributedSampler``, so Lightning leaves them alone (``use_distributed_sampler``
  only replaces plain samplers). They shard by the strategy's data-parallel rank themselves.
- The train loader is a ``ResumableLoader``: its ``state_dict()`` is the position after the last batch it
  handed out, not after those its workers drew ahead, so it does not depend on ``num_workers`` either.
  Lightning's fit loop saves rank zero's (being global, it is every rank's) in every checkpoint
  (``loops.fit_loop.state_dict.combined_loader``) and loads it on resume before the first batch.
- The sampler's epoch ends exactly where Lightning's does (``limit_train_batches``: an int counts global
  batches, a fraction takes that share of the epoch's), so a position saved after an epoch's last batch
  resumes at the next epoch. Lightning counts the epoch's batches itself; after a change of the global
  batch the sampler works out that count in batches of the new size (``take_recount``), and the
  ``GlobalBatch`` callback restates Lightning's with it, so the epoch still ends where the data does.
- The data module writes no Trainer state: the accumulation that keeps ``global_batch_size`` is set by
  ``GlobalBatch`` too (``callbacks/global_batch.py``; the CLI adds it to every run).
- ``set_epoch`` picks the epoch of a fresh sampler; once in use, the data's epochs follow one another
  (see ``GlobalOrderSampler.set_epoch``).
- ``train_loader.sampler.skip_batches(n)`` passes over the next ``n`` global batches without loading them
  (NaN recovery uses it); the saved position counts them.
- Each loader has its own seeded ``torch.Generator``: creating an iterator draws a worker seed from it, and
  drawing from the global RNG instead would shift the model's dropout stream between a run and its resume.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_train.errors import UserInputError


class GlobalOrderSampler(DistributedSampler):
    """This rank's share of one global sample order, resumable at any world size.

    Epoch ``e`` is the permutation of the dataset seeded by ``(seed, e)``, cut into ``batches_per_epoch``
    global batches of ``batch_size x num_replicas`` samples: all whole global batches, at most
    ``limit_batches`` (Lightning's ``limit_train_batches``: an int, or a fraction of the epoch); with
    ``accumulate`` batches a step, an epoch ends at a whole number of steps. Rank ``r``
    yields samples ``r, r + num_replicas, ...`` of each global batch.
    ``len()`` is this rank's share, as Lightning counts it: with a fraction, that of every whole batch
    (Lightning applies the fraction to ``len(loader)`` itself).

    ``state_dict()`` is the position after the last batch its ``ResumableLoader`` handed out (workers draw
    batches ahead; those do not count): the epoch and ``consumed``, the global samples of the epoch drawn or
    skipped, the skips asked for after that batch was drawn, and what the position is only valid for
    (dataset size and seed).

    Example (two ranks together draw the one-rank order; a skip jumps over whole global batches):

        >>> from lightning_train.data import GlobalOrderSampler
        >>> dataset = list(range(12))
        >>> one_rank = list(GlobalOrderSampler(dataset, num_replicas=1, rank=0, seed=0, batch_size=4))
        >>> sorted(one_rank) == dataset
        True
        >>> ranks = [GlobalOrderSampler(dataset, 2, rank, seed=0, batch_size=2) for rank in (0, 1)]
        >>> [sample for pair in zip(*map(list, ranks)) for sample in pair] == one_rank
        True
        >>> sampler = GlobalOrderSampler(dataset, num_replicas=1, rank=0, seed=0, batch_size=4)
        >>> sampler.skip_batches(1)
        >>> list(sampler) == one_rank[4:]
        True
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        seed: int,
        batch_size: int = 1,
        limit_batches: int | float = 1.0,
        description: str | None = None,
        accumulate: int = 1,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=True)
        self.description = description or f"{len(dataset)} samples"  # names the data in errors
        self.batch_size = batch_size
        self.global_batch = batch_size * num_replicas
        # whole optimizer steps of `accumulate` batches: a step at the epoch's end is never a partial one
        whole = len(dataset) // (self.global_batch * accumulate) * accumulate
        self.batches_per_epoch = (
            int(whole * limit_batches) if isinstance(limit_batches, float) else min(whole, limit_batches)
        )
        # len(self): this rank's share. Lightning applies a fractional limit_train_batches to len(loader)
        # itself, so the len of a fraction counts every whole batch, and Lightning's epoch ends at ours.
        reported = whole if isinstance(limit_batches, float) else self.batches_per_epoch
        self.num_samples = reported * batch_size
        self.epoch_samples = self.batches_per_epoch * self.global_batch  # where the epoch ends, globally
        self.consumed = 0  # global samples of this epoch drawn or skipped
        self.skip_into_next_epoch = 0  # global samples a skip past the epoch's end still has to pass over
        self.pending_skips: list[list[int]] = []  # loaded [epoch, at, samples] skips not yet reached
        self.drawn: deque[dict[str, Any]] = deque()  # the position after each batch drawn, not handed out
        self.handed_out = self._position()  # the position after the last batch handed out
        self.started = False  # drawn from, skipped or loaded: set_epoch no longer picks the epoch
        self.recount: int | None = None  # see take_recount

    def __iter__(self) -> Iterator[int]:
        order = self._epoch_order()
        self.started = True
        self._draw_undelivered_again()
        if self._epoch_finished():  # iterated again without set_epoch: the next epoch
            self._next_epoch()
        self.handed_out = self._position()
        while True:  # reads the position before each batch, so a skip_batches in between jumps right there
            self._apply_due_skips()
            if self.consumed + self.global_batch > self.epoch_samples:
                return
            first = self.consumed + self.rank
            batch = order[first : first + self.global_batch : self.num_replicas]
            self.consumed += self.global_batch
            self.drawn.append(self._position())
            yield from batch.tolist()

    def _epoch_order(self) -> np.ndarray:
        """The epoch's global order: the permutation seeded by ``(seed, epoch)``, or the dataset's own
        ``epoch_order(epoch)`` where it has one (a mixture's draws, shuffled by construction)."""
        own = getattr(self.dataset, "epoch_order", None)
        if own is not None:
            return own(self.epoch)
        return np.random.default_rng((self.seed, self.epoch)).permutation(len(self.dataset))

    def batch_handed_out(self) -> None:
        """The loader gave the oldest drawn batch to its caller: that is now the saved position."""
        self.handed_out = self.drawn.popleft()
        if self.recount is not None:  # nobody took it: Lightning's epoch would end off the data's
            self.recount = None
            rank_zero_warn(
                "the data position was saved at another global batch; in a Lightning Trainer add "
                "lightning_train.callbacks.GlobalBatch() to the callbacks, so that the epoch ends where the "
                "data's does (the CLI adds it)"
            )

    def take_recount(self) -> int | None:
        """After a position saved at another global batch was loaded mid-epoch, the epoch's batches done,
        counted at this global batch: what Lightning's count of them must become (``GlobalBatch`` restates
        it); None otherwise. Taken once."""
        recount, self.recount = self.recount, None
        return recount

    def skip_batches(self, num_batches: int) -> None:
        """Pass over the next ``num_batches`` global batches of the order without loading them.

        Call it with the same ``num_batches`` on every data-parallel rank: each then skips
        ``num_batches x batch_size x num_replicas`` samples of the one global order, so the ranks stay in
        step. A skip past the epoch's end ends the epoch and goes on into the next one. The saved position
        counts the skipped batches, so a run resumed after the skip continues after them.

        Batches a loader has already drawn are not affected: they are the next ones it yields (and a run
        resumed from a checkpoint taken before they came yields them too). Lightning does not prefetch a
        sized loader, so with ``num_workers=0`` the skip starts at the very next batch; with workers
        ``prefetch_factor x num_workers`` batches are drawn ahead, and those are still loaded and trained on.
        """
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be at least 0")
        self.started = True
        skip = [self.epoch, self.consumed, num_batches * self.global_batch]
        for position in (self.handed_out, *self.drawn):  # drawn before the skip: it is still ahead of them
            position["pending_skips"].append(skip)
        self._advance(skip[2])

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this as each of its epochs starts. Before the sampler is used it picks the epoch,
        as ``DistributedSampler``'s does. Once used, the data's own epochs follow one another: an unfinished
        one goes on, a finished one is followed by the next. (A Lightning epoch can end before the data's:
        Lightning counts the epoch of a checkpoint written when ``max_steps`` stopped a run mid-epoch as
        complete, so a run resumed from it goes on with the rest of the data's epoch first.)"""
        if not self.started:
            super().set_epoch(epoch)
            return
        self._draw_undelivered_again()
        if epoch != self.epoch and self._epoch_finished():
            self._next_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {
            **copy.deepcopy(self.handed_out),
            "dataset_size": len(self.dataset),
            "seed": self.seed,
            "data": self.description,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["dataset_size"], state["seed"]) != (len(self.dataset), self.seed):
            raise UserInputError(
                f"the checkpoint's data position is in the order of {state['data']} with "
                f"seed={state['seed']}; this run's train split has {self.description} with seed={self.seed}. "
                "Resume with the data, seq_len and seed the checkpoint was saved with, or start a new run "
                "from its weights"
            )
        self._restore(state)
        self._apply_due_skips()
        self.started = True
        if self._epoch_finished():  # saved after the epoch's last whole batch
            self._next_epoch()
        elif state["global_batch"] != self.global_batch:
            left = (self.epoch_samples - self.consumed) // self.global_batch
            self.recount = self.batches_per_epoch - left
        self.handed_out = self._position()

    def _position(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "skip_into_next_epoch": self.skip_into_next_epoch,
            "pending_skips": [list(skip) for skip in self.pending_skips],
            "global_batch": self.global_batch,
        }

    def _restore(self, position: dict[str, Any]) -> None:
        self.epoch, self.consumed = position["epoch"], position["consumed"]
        self.skip_into_next_epoch = position["skip_into_next_epoch"]
        self.pending_skips = [list(skip) for skip in position["pending_skips"]]
        self.drawn.clear()

    def _draw_undelivered_again(self) -> None:
        """An iterator dropped with batches drawn but not handed out (its epoch ended early): the position
        goes back to the last batch handed out, so those batches come again rather than being lost."""
        if self.drawn:
            self._restore(self.handed_out)

    def _epoch_finished(self) -> bool:
        return self.consumed + self.global_batch > self.epoch_samples

    def _next_epoch(self) -> None:
        for _, at, samples in self.pending_skips:  # skips not reached in this epoch go on into the next
            self.consumed = max(self.consumed, at)
            self._advance(samples)
        carried = self.skip_into_next_epoch
        super().set_epoch(self.epoch + 1)
        self.pending_skips = []
        self.consumed = min(carried, self.epoch_samples)
        self.skip_into_next_epoch = carried - self.consumed

    def _advance(self, samples: int) -> None:
        within_epoch = min(samples, max(self.epoch_samples - self.consumed, 0))
        self.consumed += within_epoch
        self.skip_into_next_epoch += samples - within_epoch

    def _apply_due_skips(self) -> None:
        while self.pending_skips and self.pending_skips[0][:2] <= [self.epoch, self.consumed]:
            self._advance(self.pending_skips.pop(0)[2])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a ``GlobalOrderSampler`` whose ``state_dict`` is the sampler's position after the
    last batch handed out; independent of the world size and the number of workers.

    Example (a position saved on one rank, resumed on two):

        >>> import torch
        >>> from lightning_train.data import GlobalOrderSampler, ResumableLoader
        >>> dataset = torch.arange(24)
        >>> def loader(num_replicas, rank, batch_size):
        ...     sampler = GlobalOrderSampler(dataset, num_replicas, rank, seed=0, batch_size=batch_size)
        ...     return ResumableLoader(dataset, batch_size=batch_size, sampler=sampler)
        >>> single = loader(1, 0, batch_size=4)
        >>> batches = iter(single)
        >>> first, second = next(batches), next(batches)
        >>> state = single.state_dict()  # what a checkpoint keeps
        >>> state["consumed"]
        8
        >>> two_ranks = [loader(2, rank, batch_size=2) for rank in (0, 1)]
        >>> for rank_loader in two_ranks:
        ...     rank_loader.load_state_dict(state)
        >>> resumed = torch.cat([next(iter(rank_loader)) for rank_loader in two_ranks])
        >>> sorted(resumed.tolist()) == sorted(next(batches).tolist())  # the uninterrupted run's third batch
        True
    """

    sampler: GlobalOrderSampler

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            self.sampler.batch_handed_out()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
