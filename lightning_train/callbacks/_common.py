"""Helpers shared by the callbacks: sending metrics to the loggers, "is this a logging step",
how many ranks read different batches."""

from __future__ import annotations

import lightning as L

from lightning_train._compat import batches_that_stepped


def log_metrics(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger at the step Lightning logs ``train/loss`` of this batch with
    (what its own LearningRateMonitor does), so the values share one row/step. After a resume that
    counter is the optimizer step only with ``StepAxisKeeper`` (the CLI adds it)."""
    step = batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def is_logging_step(trainer: L.Trainer, every: int | None = None, *, before_step: bool = False) -> bool:
    """Whether this batch's optimizer step is a logging step: the N-th, 2N-th, ... optimizer step, with
    N = ``every`` or the Trainer's ``log_every_n_steps`` (Lightning logs ``train/loss`` on the same ones).

    ``before_step``: called before the step is counted (``on_before_optimizer_step``); otherwise after it
    (``on_train_batch_end``, where ``global_step`` already includes it)."""
    steps_done = trainer.global_step + 1 if before_step else trainer.global_step
    return steps_done % (every or trainer.log_every_n_steps) == 0


def data_parallel_size(trainer: L.Trainer) -> int:
    """How many ranks read different batches: the strategy's sampler replicas (the ranks of one
    tensor-parallel group share a batch), else the world size."""
    kwargs = trainer.distributed_sampler_kwargs
    return int(kwargs["num_replicas"]) if kwargs and "num_replicas" in kwargs else trainer.world_size
