"""``python -m lightning_train SUBCOMMAND``: LightningCLI's fit/validate/test/predict, plus tools.

    python -m lightning_train fit --config configs/pretrain-tiny.yaml
    python -m lightning_train fit --config configs/pretrain-tiny.yaml --print_config
    python -m lightning_train prepare --inputs '[corpus/]' --output_dir data/corpus

Run layout: everything of a run lives under ``trainer.default_root_dir`` (``runs/<name>``):
``checkpoints/`` (shared by every restart of the run, so a restart finds them) and one
``version_N/`` per launch with ``metrics.csv`` and the resolved ``config.yaml`` (one per launch,
so saving the config never collides).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import CLI, ArgumentParser
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import CheckpointIO, Precision
from lightning.pytorch.plugins.environments import ClusterEnvironment, SLURMEnvironment

from lightning_train.callbacks import PreemptionCheckpoint, RNGStateKeeper, TrainingAborted
from lightning_train.errors import UserInputError
from lightning_train.plugins import AtomicCheckpointIO
from lightning_train.plugins.precision import amp_for_precision_flag
from lightning_train.resume import checkpoint_mismatch_error, resolve_resume
from lightning_train.strategies import DataParallelStrategy  # noqa: F401  (registers lt_ddp/lt_fsdp/lt_auto)


class _OneLineErrors:
    """Parser mixin: a bad argument or config value ends with one ``error: ...`` line (plus a tip)
    and exit code 2, instead of the full usage text."""

    def error(self, message: str, ex: Exception | None = None) -> None:
        message = " ".join(line.strip(" -") for line in message.splitlines() if line.strip())
        prog = self.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {message}\ntip: run `{prog} --help` for the accepted options\n")
        sys.exit(2)


class _LightningParser(_OneLineErrors, LightningArgumentParser):
    pass


class _ToolParser(_OneLineErrors, ArgumentParser):
    pass


class LightningTrainCLI(LightningCLI):
    """LightningCLI with this package's run layout and defaults (seed 1234, CSV metrics, checkpoints
    under ``<default_root_dir>/checkpoints``)."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", 1234)
        kwargs.setdefault("parser_class", _LightningParser)
        kwargs.setdefault("parser_kwargs", {"prog": "python -m lightning_train"})
        super().__init__(
            LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
            args=args, **kwargs,
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        root = Path(trainer_config.get("default_root_dir") or "runs/default")
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = CSVLogger(save_dir=str(root), name="")
        callbacks = _as_list(trainer_config.get("callbacks"))
        checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
        if not checkpoints:
            checkpoints = [ModelCheckpoint(save_last=True)]
            kwargs["callbacks"] = callbacks + checkpoints
        for checkpoint in checkpoints:
            if checkpoint.dirpath is None:
                checkpoint.dirpath = str(root / "checkpoints")
        # 16-mixed: real loss scaling on every device (Lightning's turns into bf16 on CPU) and the LR
        # schedule held on skipped steps (lightning_train.plugins.AmpPrecision).
        amp = amp_for_precision_flag(trainer_config.get("precision"), trainer_config.get("accelerator"))
        plugins = _as_list(trainer_config.get("plugins"))
        if amp is not None and not any(isinstance(p, Precision) for p in plugins):
            kwargs["precision"], kwargs["plugins"] = None, [*plugins, amp]
        _add_fault_tolerance(trainer_config, kwargs)
        return super().instantiate_trainer(**kwargs)

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


def _add_fault_tolerance(trainer_config: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Exact resume and preemption by default: RNG states of every rank in checkpoints, checkpoint-and-exit
    (code 75) on SIGTERM/SIGUSR1, atomic sha256-verified checkpoint files. On SLURM, Lightning's own
    auto-requeue is switched off so that it does not act on the same signals."""
    callbacks = _as_list(kwargs.get("callbacks", trainer_config.get("callbacks")))
    for kind in (RNGStateKeeper, PreemptionCheckpoint):
        if not any(isinstance(c, kind) for c in callbacks):
            callbacks.append(kind())
    kwargs["callbacks"] = callbacks
    plugins = _as_list(kwargs.get("plugins", trainer_config.get("plugins")))
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    if SLURMEnvironment.detect() and not any(isinstance(p, ClusterEnvironment) for p in plugins):
        plugins.append(SLURMEnvironment(auto_requeue=False))
    kwargs["plugins"] = plugins


def _as_list(value: Callback | list[Callback] | None) -> list[Callback]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _tools() -> dict[str, Callable[..., Any]]:
    """Subcommands that are plain functions rather than Trainer methods."""
    from lightning_train.data import prepare
    from lightning_train.loggers.dashboard import dashboard
    from lightning_train.loggers.report import report
    from lightning_train.modules.finetune import generate
    from lightning_train.strategies import consolidate

    return {
        "prepare": prepare, "report": report, "dashboard": dashboard, "consolidate": consolidate,
        "generate": generate,
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        tools = _tools()
        if args and args[0] in tools:
            CLI(tools[args[0]], args=args[1:], as_positional=False, parser_class=_ToolParser,
                prog=f"python -m lightning_train {args[0]}")
        else:
            LightningTrainCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except TrainingAborted as error:  # NaNRecovery gave up: the message names checkpoint and forensics
        print(f"error: {error}", file=sys.stderr)
        sys.exit(3)
