"""Advancing the training data past a window of batches without computing them (``NaNRecovery``'s
rollback, PaLM §5.1): no ``training_step``, no forward, backward or optimizer step, no ``global_step``.

Two ways, the first that applies:

1. The train sampler can jump (``sampler.skip_batches(n)``: ``TextDataModule`` and ``SFTDataModule``):
   the skipped batches are not even loaded, and a skip past the epoch's end goes on into the next epoch.
   With ``num_workers=0`` the skip starts at the very next batch; with workers, the batches they already
   loaded ahead (``prefetch_factor x num_workers``) are trained on first.
2. Any other DataLoader: exactly the next ``n`` batches are drawn from the fit loop's iterator and dropped
   (loaded, never moved to the device nor trained on), up to the end of the epoch.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from lightning_train._compat import data_fetcher, fetcher_hands_out_iterator


def skip_train_batches(trainer: L.Trainer, num_batches: int) -> int:
    """Pass over the next ``num_batches`` training batches without computing them; returns how many
    were passed over (with the fallback, fewer when the epoch ends first). Call it on every rank with the
    same ``num_batches``: each skips its own part of the global batches."""
    if num_batches <= 0:
        return 0
    sampler = getattr(trainer.train_dataloader, "sampler", None)
    if callable(getattr(sampler, "skip_batches", None)):
        sampler.skip_batches(num_batches)  # a skip past the epoch's end carries into the next one
        return num_batches
    return _draw_and_drop_batches(trainer, num_batches)


def _draw_and_drop_batches(trainer: L.Trainer, num_batches: int) -> int:
    """The fallback for any DataLoader. Lightning's loop has no public way to pass over a batch, so this
    draws from its private data fetcher (``trainer.fit_loop._data_fetcher``, Lightning 2.5/2.6): the loop
    never sees the batches, and a StatefulDataLoader's saved position counts them as consumed."""
    fetcher = data_fetcher(trainer)
    if fetcher_hands_out_iterator(fetcher):
        rank_zero_warn("NaNRecovery cannot pass over batches when training_step draws them itself "
                       "(dataloader_iter); no batches were skipped after the rollback")
        return 0
    for dropped in range(num_batches):
        if fetcher is None or fetcher.done:
            return dropped
        try:
            next(fetcher)
        except StopIteration:  # the epoch's data ended; Lightning's loop ends the epoch on its next fetch
            return dropped
    return num_batches
