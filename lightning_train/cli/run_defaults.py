"""The Trainer arguments a ``LightningTrainCLI`` run gets unless its config sets them: where metrics and
checkpoints go, the callbacks and plugins every run has (``run_defaults``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import CheckpointIO, Precision
from lightning.pytorch.plugins.environments import (
    ClusterEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from lightning_train.callbacks import (
    GlobalBatch,
    GoodputMonitor,
    PreemptionCheckpoint,
    RNGStateKeeper,
    RunSummary,
    StepAxisKeeper,
    TimeToQuality,
    TokenProgressBar,
)
from lightning_train.checkpoint import AtomicCheckpointIO
from lightning_train.cli.run_folder import local_logs
from lightning_train.errors import UserInputError
from lightning_train.plugins.precision import amp_for_precision_flag
from lightning_train.storage import is_remote, join


def run_defaults(
    trainer: dict[str, Any], subcommand: str | None, command: list[str], async_checkpoint: bool = False,
    target: float | None = None,
) -> dict[str, Any]:
    """Trainer arguments that complete what the config left out; a config that sets one wins.

    - CSV metrics in ``<root>/version_N/`` (``fit``) or ``<root>/<subcommand>/version_N/`` (``validate``,
      ``test``, ``predict``); checkpoints (``last.ckpt`` at least) in ``<root>/checkpoints``.
    - A progress bar with tokens/s and ETA; at the end of ``fit``, a summary (``RunSummary``); where the
      wall time went, in ``goodput.json`` and ``goodput/*`` (``GoodputMonitor``).
    - ``16-mixed``: real loss scaling on every device (Lightning's would turn into bf16 on CPU) and the
      LR schedule held on skipped steps (``AmpPrecision``).
    - Exact resume and preemption: every rank's RNG states in checkpoints, the logging step kept on the
      optimizer step (``StepAxisKeeper``), the data module's global batch kept by the Trainer
      (``GlobalBatch``: the accumulation for ``global_batch_size``), checkpoint-and-exit (code 75)
      on SIGTERM/SIGUSR1 (code 130 on Ctrl-C), atomic sha256-verified checkpoint files (written in the
      background with ``--async_checkpoint true``); on SLURM,
      Lightning's own auto-requeue is off so that it does not act on the same signals (under torchrun
      inside SLURM, torchrun's ranks are the ones that count: Lightning's TorchElasticEnvironment).
    - Validation on the optimizer-step grid: the CLI's ``check_val_every_n_epoch`` is ``None``, so an int
      ``val_check_interval`` counts steps across epochs (``GlobalBatch`` turns them into batches under
      accumulation) and the default checkpoint, written after each validation, falls on the same steps;
      where the interval is a fraction of the epoch, or nothing is validated, Lightning's 1 is kept.
    - ``--time_to_quality.target`` (``target``): the target of the config's ``TimeToQuality``, or a
      ``TimeToQuality(target)`` on ``val/loss`` when the config has none.
    """
    root_dir = trainer["default_root_dir"]  # set by before_instantiate_classes
    callbacks, plugins = _as_list(trainer.get("callbacks")), _as_list(trainer.get("plugins"))
    defaults: dict[str, Any] = {}
    if is_remote(root_dir):  # checkpoints on object storage, this launch's logs on local disk
        root, checkpoint_dir = local_logs(root_dir), join(root_dir, "checkpoints")
        defaults["default_root_dir"] = str(root)
    else:
        root = Path(root_dir)
        checkpoint_dir = str(root / "checkpoints")
    if trainer.get("logger") in (None, True):
        name = "" if subcommand in ("fit", None) else subcommand  # evaluations never join the run's versions
        defaults["logger"] = CSVLogger(save_dir=str(root), name=name)

    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    checkpoints = checkpoints or [ModelCheckpoint(save_last=True)]
    for checkpoint in checkpoints:
        checkpoint.dirpath = checkpoint.dirpath or checkpoint_dir
    extra_callbacks: list[Callback] = [c for c in checkpoints if c not in callbacks]
    has_bar = any(isinstance(c, ProgressBar) for c in callbacks)
    if trainer.get("enable_progress_bar") is not False and not has_bar:
        extra_callbacks.append(TokenProgressBar(refresh_rate=10))  # each refresh reads metrics to host
    extra_callbacks += [kind() for kind in (RNGStateKeeper, StepAxisKeeper, PreemptionCheckpoint, GlobalBatch)
                        if not any(isinstance(c, kind) for c in callbacks)]
    if subcommand == "fit" and not any(isinstance(c, RunSummary) for c in callbacks):
        extra_callbacks.append(RunSummary(command=command))
    if subcommand == "fit" and not any(isinstance(c, GoodputMonitor) for c in callbacks):
        extra_callbacks.append(GoodputMonitor())
    if target is not None:
        stoppers = [c for c in callbacks if isinstance(c, TimeToQuality)]
        for stopper in stoppers:
            stopper.target = target
        if not stoppers:
            extra_callbacks.append(TimeToQuality(target=target))
    defaults["callbacks"] = callbacks + extra_callbacks

    if trainer.get("check_val_every_n_epoch") is None and not validates_on_steps(trainer):
        defaults["check_val_every_n_epoch"] = 1  # a fraction of an epoch needs epochs: Lightning refuses None

    amp = amp_for_precision_flag(trainer.get("precision"), trainer.get("accelerator"))
    if amp is not None and not any(isinstance(p, Precision) for p in plugins):
        defaults["precision"] = None
        plugins.append(amp)
    checkpoint_io = next((p for p in plugins if isinstance(p, CheckpointIO)), None)
    if checkpoint_io is None:
        plugins.append(AtomicCheckpointIO(async_save=async_checkpoint))
    elif async_checkpoint and not getattr(checkpoint_io, "async_save", False):
        raise UserInputError(
            f"--async_checkpoint true needs AtomicCheckpointIO, but the config's trainer.plugins has "
            f"{type(checkpoint_io).__name__}; drop --async_checkpoint, or give that plugin async_save: true"
        )
    on_slurm = SLURMEnvironment.detect() and not TorchElasticEnvironment.detect()
    if on_slurm and not any(isinstance(p, ClusterEnvironment) for p in plugins):
        plugins.append(SLURMEnvironment(auto_requeue=False))
    defaults["plugins"] = plugins
    return defaults


def validates_on_steps(trainer: dict[str, Any]) -> bool:
    """Whether validation runs every ``val_check_interval`` optimizer steps (an int) rather than per epoch."""
    interval = trainer.get("val_check_interval")
    steps = isinstance(interval, int) and not isinstance(interval, bool)
    return steps and trainer.get("limit_val_batches") != 0


def _as_list(value: Callback | list[Callback] | None) -> list[Callback]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
