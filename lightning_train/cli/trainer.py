"""``LightningTrainCLI``: LightningCLI's fit/validate/test/predict with this package's run layout.

Run layout: everything of a run lives under ``trainer.default_root_dir`` (``runs/<name>``):
``checkpoints/`` (shared by every restart of the run, so a restart finds them) and one
``version_N/`` per launch with ``metrics.csv`` and the resolved ``config.yaml`` (one per launch,
so saving the config never collides).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import CheckpointIO, Precision
from lightning.pytorch.plugins.environments import ClusterEnvironment, SLURMEnvironment

from lightning_train.callbacks import PreemptionCheckpoint, RNGStateKeeper, TokenProgressBar
from lightning_train.cli._parsers import PROG, TOOLS, LightningParser
from lightning_train.errors import UserInputError
from lightning_train.plugins import AtomicCheckpointIO
from lightning_train.plugins.precision import amp_for_precision_flag
from lightning_train.resume import checkpoint_mismatch_error, resolve_resume
from lightning_train.strategies import DataParallelStrategy  # noqa: F401  (registers lt_ddp/lt_fsdp/lt_auto)


class LightningTrainCLI(LightningCLI):
    """LightningCLI with this package's run layout and defaults (seed 1234, CSV metrics, checkpoints
    under ``<default_root_dir>/checkpoints``)."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", 1234)
        kwargs.setdefault("parser_class", LightningParser)
        description = (
            f"Train language models with Lightning: fit, validate, test, predict. Tools: {', '.join(TOOLS)} "
            f"(`{PROG} TOOL --help`)."
        )
        kwargs.setdefault("parser_kwargs", {"prog": PROG, "description": description})
        super().__init__(
            LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
            args=args, **kwargs,
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        return super().instantiate_trainer(**{**_run_defaults(trainer_config), **kwargs})

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--resume", type=str | None, default=None,
            help="fit: 'auto' (the newest valid checkpoint of the run, else start fresh), 'none', or "
            "the path of a checkpoint or of a folder of checkpoints. See docs/fault-tolerance.md.",
        )

    def before_fit(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("resume") is None:
            return
        if config.get("ckpt_path"):
            raise UserInputError("pass either --resume or --ckpt_path, not both")
        folders = [c.dirpath for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        config["ckpt_path"] = resolve_resume(config["resume"], folders[0] if folders else "checkpoints")

    def fit(self, model: LightningModule, **kwargs: Any) -> None:
        try:
            self.trainer.fit(model, **kwargs)
        except RuntimeError as error:  # a checkpoint of another model shape: one clear line, not a traceback
            mismatch = checkpoint_mismatch_error(error, kwargs.get("ckpt_path"))
            if mismatch is None:
                raise
            raise mismatch from error


def _run_defaults(trainer: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments that complete what the config left out; a config that sets one wins.

    - CSV metrics in ``<root>/version_N/``; checkpoints (``last.ckpt`` at least) in ``<root>/checkpoints``.
    - A progress bar with tokens/s and ETA.
    - ``16-mixed``: real loss scaling on every device (Lightning's would turn into bf16 on CPU) and the
      LR schedule held on skipped steps (``AmpPrecision``).
    - Exact resume and preemption: every rank's RNG states in checkpoints, checkpoint-and-exit (code 75)
      on SIGTERM/SIGUSR1, atomic sha256-verified checkpoint files; on SLURM, Lightning's own
      auto-requeue is off so that it does not act on the same signals.
    """
    root = Path(trainer.get("default_root_dir") or "runs/default")
    callbacks, plugins = _as_list(trainer.get("callbacks")), _as_list(trainer.get("plugins"))
    defaults: dict[str, Any] = {}
    if trainer.get("logger") in (None, True):
        defaults["logger"] = CSVLogger(save_dir=str(root), name="")

    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    checkpoints = checkpoints or [ModelCheckpoint(save_last=True)]
    for checkpoint in checkpoints:
        checkpoint.dirpath = checkpoint.dirpath or str(root / "checkpoints")
    extra_callbacks: list[Callback] = [c for c in checkpoints if c not in callbacks]
    has_bar = any(isinstance(c, ProgressBar) for c in callbacks)
    if trainer.get("enable_progress_bar") is not False and not has_bar:
        extra_callbacks.append(TokenProgressBar(refresh_rate=10))  # each refresh reads metrics to host
    extra_callbacks += [kind() for kind in (RNGStateKeeper, PreemptionCheckpoint)
                        if not any(isinstance(c, kind) for c in callbacks)]
    defaults["callbacks"] = callbacks + extra_callbacks

    amp = amp_for_precision_flag(trainer.get("precision"), trainer.get("accelerator"))
    if amp is not None and not any(isinstance(p, Precision) for p in plugins):
        defaults["precision"] = None
        plugins.append(amp)
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    if SLURMEnvironment.detect() and not any(isinstance(p, ClusterEnvironment) for p in plugins):
        plugins.append(SLURMEnvironment(auto_requeue=False))
    defaults["plugins"] = plugins
    return defaults


def _as_list(value: Callback | list[Callback] | None) -> list[Callback]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
