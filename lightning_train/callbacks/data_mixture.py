"""DataMixtureMonitor: how much of each source of a data mixture training has seen.

Logs ``data/<name>/tokens_seen`` and ``data/<name>/epoch`` on logging steps for a data module with a
mixture (``TextDataModule(mixture=...)``), read from the data position, so they are exact after a resume
and at any world size and cost no host sync. The CLI adds it to every ``fit`` of a mixture.

    >>> import tempfile
    >>> import lightning as L
    >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
    >>> from lightning_train.callbacks import DataMixtureMonitor
    >>> from lightning_train.data import prepare
    >>> folders = []
    >>> texts = {"prose": "the cat sat on the mat. " * 200, "code": "x = [i for i in y]\\n" * 200}
    >>> for name, text in texts.items():
    ...     source = f"{tempfile.mkdtemp()}/{name}.txt"
    ...     _ = open(source, "w").write(text)
    ...     folders.append(str(prepare([source], f"{tempfile.mkdtemp()}/{name}", num_workers=0).output_dir))
    ...     # doctest: +ELLIPSIS
    tokenizing ...
    tokenizing ...
    >>> data = TextDataModule(mixture={folders[0]: 0.75, folders[1]: 0.25}, seq_len=16, batch_size=4)
    >>> monitor = DataMixtureMonitor()
    >>> trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    ...                     log_every_n_steps=2, callbacks=[monitor])
    >>> trainer.fit(PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)), data)
    >>> monitor.last  # 16 rows of 16 tokens: 12 from prose, 4 from code
    {'data/prose/tokens_seen': 192, 'data/prose/epoch': 0, 'data/code/tokens_seen': 64, 'data/code/epoch': 0}
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_train.callbacks._common import is_logging_step, log_metrics


class DataMixtureMonitor(Callback):
    """Logs each mixture source's ``tokens_seen`` and ``epoch`` on logging steps (nothing without one)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        progress = getattr(trainer.datamodule, "source_progress", None)
        if progress is None or not is_logging_step(trainer):
            return
        self.last = {f"data/{name}/{key}": value for name, values in progress().items()
                     for key, value in values.items()}
        if self.last:
            log_metrics(trainer, dict(self.last))
