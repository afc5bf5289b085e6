"""Weighted mixtures of prepared datasets: ``TextDataModule(mixture={"data/web": 0.7, "data/code": 0.3})``.

One mixture epoch is as many draws as the sources have windows together. Each draw's source follows a
fixed low-discrepancy interleave, as Megatron's blended datasets do: source ``s`` gets
``round(weight_s x draws)`` draws of every epoch, spread evenly, so any run of consecutive draws holds
the sources in their proportions (to one draw each). Within a source, draws walk through that
source's own shuffled epochs (a permutation seeded by ``(seed, source, source epoch)``): a small
source weighted up is repeated epoch after epoch, a large one weighted down is not seen whole.

The draw order is the same for a seed on any world size: ``GlobalOrderSampler`` takes it from
``epoch_order`` instead of shuffling, so the data position (global draws consumed) resumes exactly, at
any device count.

    >>> import numpy as np
    >>> from lightning_train.data.mixture import MixtureWindows
    >>> web, code = list(range(100)), list(range(1000, 1010))  # 100 and 10 "windows"
    >>> mixture = MixtureWindows([web, code], weights=[0.7, 0.3], seed=0)
    >>> draws = [mixture[i] for i in mixture.epoch_order(0)[:20]]
    >>> sum(draw >= 1000 for draw in draws)  # 30 % of any 20 consecutive draws
    6
    >>> mixture.progress(epoch=1, consumed=20)  # an epoch (110 draws: 77 + 33) and 20 more
    {'draws': [91, 39], 'epoch': [0, 3]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset


def draw_counts(weights: Sequence[float], draws: int) -> np.ndarray:
    """Draws per source in ``draws``: proportional to ``weights``, largest remainders rounded up."""
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * draws
    counts = np.floor(shares).astype(np.int64)
    counts[np.argsort(-(shares - counts), kind="stable")[: draws - int(counts.sum())]] += 1
    return counts


class MixtureWindows(Dataset):
    """The draws of a weighted mixture of ``sources`` (map-style datasets), item ``g`` being global draw
    ``g`` (``epoch x len(self) + i``); items of a source dataset that is a dict get its index as
    ``"source"``."""

    def __init__(self, sources: Sequence[Any], weights: Sequence[float], seed: int) -> None:
        self.sources, self.seed = list(sources), seed
        self.sizes = np.array([len(source) for source in self.sources], dtype=np.int64)
        self.draws = int(self.sizes.sum())
        self.counts = draw_counts(weights, self.draws)
        # source s's k-th draw of an epoch ideally falls at (k + 0.5) / counts[s] of it: merge those times
        source_of, occurrence, ideal = [], [], []
        for source, count in enumerate(self.counts):
            source_of.append(np.full(count, source, dtype=np.int64))
            occurrence.append(np.arange(count))
            ideal.append((np.arange(count) + 0.5) / max(count, 1))
        merged = np.argsort(np.concatenate(ideal), kind="stable")
        self.source_of = np.concatenate(source_of)[merged]  # draw i of an epoch -> its source
        self.occurrence = np.concatenate(occurrence)[merged]  # ... and how many of that source came before
        # where each source's draws fall in an epoch: counting them is a search, not a pass over the epoch
        self._draws_of = [np.flatnonzero(self.source_of == source) for source in range(len(self.sources))]
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (its epoch, its permutation)

    def __len__(self) -> int:
        return self.draws

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The items of mixture epoch ``epoch``, in order (``GlobalOrderSampler`` draws them as they are)."""
        return np.arange(epoch * self.draws, (epoch + 1) * self.draws)

    def __getitem__(self, draw: int) -> Any:
        epoch, index = divmod(int(draw), self.draws)
        source = int(self.source_of[index])
        source_epoch, position = divmod(epoch * int(self.counts[source]) + int(self.occurrence[index]),
                                        int(self.sizes[source]))
        item = self.sources[source][int(self._order(source, source_epoch)[position])]
        return {**item, "source": source} if isinstance(item, dict) else item

    def progress(self, epoch: int, consumed: int, epoch_draws: int | None = None) -> dict[str, list[int]]:
        """Each source's draws and its epoch (0: in its first pass) at ``consumed`` draws into mixture
        epoch ``epoch``, of which ``epoch_draws`` are trained on (an epoch's last incomplete global batch
        is dropped; None: all)."""
        def count(draws: int) -> np.ndarray:  # each source's draws among the epoch's first ``draws``
            return np.array([np.searchsorted(where, draws) for where in self._draws_of])

        done = epoch * count(self.draws if epoch_draws is None else epoch_draws) + count(consumed)
        return {"draws": done.tolist(), "epoch": (done // np.maximum(self.sizes, 1)).tolist()}

    def _order(self, source: int, source_epoch: int) -> np.ndarray:
        cached = self._orders.get(source)
        if cached is None or cached[0] != source_epoch:
            rng = np.random.default_rng((self.seed, source, source_epoch))
            cached = self._orders[source] = (source_epoch, rng.permutation(int(self.sizes[source])))
        return cached[1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_orders": {}}  # workers build their own


class LabeledSources(Dataset):
    """The sources one after the other (validation), each dict item with its source index."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = list(sources)
        self.starts = np.cumsum([0, *(len(source) for source in self.sources)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> dict[str, Any]:
        source = int(np.searchsorted(self.starts, index, side="right")) - 1
        return {**self.sources[source][index - int(self.starts[source])], "source": source}
