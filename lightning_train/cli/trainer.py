"""``LightningTrainCLI``: LightningCLI's fit/validate/test/predict with this package's run layout.

Run layout (``run_folder.py``): one folder per run, ``runs/<run_name>``: ``checkpoints/`` (shared by
every launch that resumes the run, so a restart finds them), one ``version_N/`` per training launch
with ``metrics.csv``, ``summary.json`` and the resolved ``config.yaml``, and ``validate/version_N/``
(``test/``, ``predict/``) for evaluations.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_train._compat import cli_config_value, subcommand_parser
from lightning_train._warnings import silence_resumed_checkpoint_dir
from lightning_train.callbacks import (
    DataMixtureMonitor,
)
from lightning_train.callbacks.run_summary import log_dir_of
from lightning_train.checkpoint import (
    checkpoint_mismatch_error,
    find_resume_checkpoint,
    read_checkpoint,
    resolve_resume,
)
from lightning_train.checkpoint.format import safe_globals
from lightning_train.cli._failure import first_process_of_node, write_failure
from lightning_train.cli._parsers import PROG, SUBCOMMANDS, ParserConventions
from lightning_train.cli.checks import check_seed_everything, check_trainer_arguments
from lightning_train.cli.elastic import restart_resume, torchrun_layout
from lightning_train.cli.run_defaults import run_defaults
from lightning_train.cli.run_folder import (
    SaveConfigWhenRunning,
    check_fit,
    launch_log_dir,
    remove_failed_launch,
    run_folder,
)
from lightning_train.cli.run_lock import RunLock
from lightning_train.data.sft import SFTDataModule  # noqa: F401  (--data SFTDataModule finds imported ones)
from lightning_train.data.text import TextDataModule  # noqa: F401
from lightning_train.errors import UserInputError
from lightning_train.modules import FinetuneModule, PretrainModule  # noqa: F401  (--model PretrainModule)
from lightning_train.storage import check_access, is_remote
from lightning_train.strategies import DataParallelStrategy  # noqa: F401  (registers lt_ddp/lt_fsdp/lt_auto)


class LightningParser(ParserConventions, LightningArgumentParser):
    pass



class LightningTrainCLI(LightningCLI):
    """LightningCLI with this package's run layout and defaults (seed 1234, CSV metrics, checkpoints
    under ``<default_root_dir>/checkpoints``).

    Example (what ``python -m lightning_train fit ...`` runs; the numbers vary, hence the ``...``):

        >>> import os
        >>> import tempfile
        >>> from lightning_train.cli.trainer import LightningTrainCLI
        >>> run_dir = f"{tempfile.mkdtemp()}/tiny"
        >>> cli = LightningTrainCLI(args=[
        ...     "fit", "--model", "PretrainModule", "--data", "TextDataModule",
        ...     "--model.config", '{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}',
        ...     "--data.seq_len", "16", "--data.batch_size", "4", "--trainer.max_steps", "2",
        ...     "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        ...     "--trainer.default_root_dir", run_dir,
        ... ])  # doctest: +ELLIPSIS
        <BLANKLINE>
        Run finished: max_steps=2 reached
          checkpoint  .../tiny/checkpoints/last.ckpt (step 2)
          metrics     .../tiny/version_0/metrics.csv
          next        python -m lightning_train report ...
        >>> cli.trainer.global_step, sorted(os.listdir(run_dir))
        (2, ['checkpoints', 'version_0'])
        >>> {"config.yaml", "summary.json"} <= set(os.listdir(f"{run_dir}/version_0"))  # this launch's
        True
    """

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("seed_everything_default", 1234)
        kwargs.setdefault("parser_class", LightningParser)
        kwargs.setdefault("save_config_callback", SaveConfigWhenRunning)
        # An int val_check_interval counts optimizer steps across epochs (run_defaults keeps Lightning's 1
        # where the interval is a fraction of the epoch or nothing is validated).
        kwargs["trainer_defaults"] = {"check_val_every_n_epoch": None, **kwargs.get("trainer_defaults", {})}
        self.command = ["python", "-m", "lightning_train", *(sys.argv[1:] if args is None else args)]
        self.run_lock: RunLock | None = None  # held by a fit's first process while it trains
        super().__init__(
            LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
            args=args, **kwargs,
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        check_seed_everything(config.get("seed_everything"))  # before Lightning seeds with it

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """Lightning's, with a whole line of help for each subcommand, and only the named subcommand's
        parser when the command line starts with one: each parser introspects the Trainer, the models
        and the data modules again (about 0.1 s apiece)."""
        subcommands = parser.add_subcommands(title="subcommands", description=None, metavar="SUBCOMMAND")
        given = self.command[3:4]  # after "python -m lightning_train"
        for name in given if given and given[0] in SUBCOMMANDS else self.subcommands():
            options = {"prog": f"{PROG} {name}", "description": SUBCOMMANDS[name], **kwargs.get(name, {})}
            subcommands.add_subcommand(name, subcommand_parser(self, name, **options), help=SUBCOMMANDS[name])

    def _parse_ckpt_path(self) -> None:
        """Lightning's (it reads ``--ckpt_path``'s hyper-parameters with torch.load), after checking the
        file: a corrupt, foreign or unsafe checkpoint is one clear error, and our configs are allowed."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            read_checkpoint(ckpt_path)
        with torch.serialization.safe_globals(safe_globals()):
            super()._parse_ckpt_path()

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:  # a model or data argument its constructor refused
            raise _user_error(error) from error

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = cli_config_value(self, self.config_init, "trainer", default={})
        check_trainer_arguments(trainer_config)
        async_checkpoint = cli_config_value(self, self.config_init, "async_checkpoint", default=False)
        target = cli_config_value(self, self.config_init, "time_to_quality.target")
        defaults = {**run_defaults(trainer_config, self.subcommand, self.command, async_checkpoint, target),
                    **torchrun_layout(trainer_config)}
        try:
            return super().instantiate_trainer(**{**defaults, **kwargs})
        except (MisconfigurationException, ValueError) as error:  # Lightning's checks of its arguments
            raise _user_error(error) from error

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--resume", type=str | None, default=None,
            help="'auto': the newest valid checkpoint of the run (fit starts fresh when there is none; "
            "validate, test and predict refuse), 'none', or the path of a checkpoint or of a folder of "
            "checkpoints. See docs/fault-tolerance.md.",
        )
        parser.add_argument(
            "--run_name", type=str | None, default=None,
            help="the run's folder: runs/<run_name> (default: the config's trainer.default_root_dir, "
            "else the config file's name). A new fit into a folder that holds a run is refused.",
        )
        parser.add_argument(
            "--async_checkpoint", type=bool, default=False,
            help="write checkpoints in the background (training waits only for the copy to host "
            "memory); the manifest is still written last. See docs/fault-tolerance.md.",
        )
        parser.add_argument(
            "--continue_past_target", type=bool, default=False,
            help="fit: resume a run that TimeToQuality stopped at its target and train on to max_steps "
            "(without it, such a run says it is finished and exits 0).",
        )
        parser.add_argument(
            "--time_to_quality.target", type=float | None, default=None,
            help="fit: stop when val/loss reaches this value and write time_to_quality.json (the "
            "TimeToQuality callback: it replaces the target of one in trainer.callbacks, else it is added)",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config  # run=False: no subcommand
        root = run_folder(config.get("run_name"), config.trainer.default_root_dir, config.get("config") or [])
        if is_remote(root):  # a missing bucket or refused credential: one line, before anything runs
            check_access(str(root))
        config.trainer.default_root_dir = str(root)

    def before_fit(self) -> None:
        self._resolve_checkpoint()  # a bad --resume or --ckpt_path is refused before anything is written
        if self.trainer.global_rank == 0 and first_process_of_node():  # the launch's first process
            self.run_lock = RunLock(self.trainer.default_root_dir)  # the local logs' folder for s3:// runs
            self.run_lock.acquire()
        try:
            self._check_fit()
        except BaseException:
            self._release_run_lock()
            remove_failed_launch(self.trainer, log_dir_was_new=False)  # the lock may have made the folder
            raise

    def _check_fit(self) -> None:
        callbacks = self.trainer.callbacks
        if getattr(self.datamodule, "mixture", None) and not any(
            isinstance(c, DataMixtureMonitor) for c in callbacks
        ):
            callbacks.append(DataMixtureMonitor())  # data/<source>/tokens_seen, data/<source>/epoch
        config = self.config_init[self.subcommand]
        auto = (config.get("resume") or "").lower() == "auto"
        past_target = config["continue_past_target"]
        if check_fit(self.trainer, self._checkpoint_dir(), config.get("ckpt_path"), auto, past_target):
            # Resuming this run: the checkpoints in its folder are its own, Lightning's warning is wrong.
            run = Path(self.trainer.default_root_dir).resolve()
            for callback in self.trainer.checkpoint_callbacks:
                dirpath = getattr(callback, "dirpath", None)
                if dirpath is not None and (is_remote(dirpath)
                                            or Path(dirpath).resolve().is_relative_to(run)):
                    silence_resumed_checkpoint_dir(dirpath)

    def before_validate(self) -> None:
        self._resolve_checkpoint()

    def before_test(self) -> None:
        self._require("test_step", "test_dataloader", "use `validate` for the held-out loss")
        self._resolve_checkpoint()

    def before_predict(self) -> None:
        self._require("predict_step", "predict_dataloader", f"for text completions use `{PROG} generate`")
        self._resolve_checkpoint()

    def _require(self, step: str, loader: str, instead: str) -> None:
        """Lightning's defaults for these hooks fail on our modules mid-run: refuse up front."""
        missing = [f"{type(self.model).__name__}.{step}"] if not is_overridden(step, self.model) else []
        if self.datamodule is not None and not is_overridden(loader, self.datamodule, LightningDataModule):
            missing.append(f"{type(self.datamodule).__name__}.{loader}")
        if missing:
            raise UserInputError(
                f"`{self.subcommand}` needs {' and '.join(missing)}, which this config does not define; "
                f"{instead}"
            )

    def _resolve_checkpoint(self) -> None:
        """``--resume`` becomes ``ckpt_path``: for fit as docs/fault-tolerance.md says; for the other
        subcommands ``auto`` must find a checkpoint (evaluating untrained weights is never the intent).
        A ``--ckpt_path`` that does not exist is refused here, before the run writes anything. A
        restarted fit that names no checkpoint resumes as with ``auto`` (``elastic.py``)."""
        config = self.config_init[self.subcommand]
        resume, ckpt_path = config.get("resume"), config.get("ckpt_path")
        if self.subcommand == "fit":
            resume = config["resume"] = restart_resume(resume, ckpt_path, self._checkpoint_dir())
        if resume is None:
            _check_checkpoint_path(ckpt_path)
            return
        if ckpt_path:
            raise UserInputError("pass either --resume or --ckpt_path, not both")
        folder = self._checkpoint_dir()
        if self.subcommand != "fit" and resume.lower() == "auto":
            found = find_resume_checkpoint(folder)
            if found is None:
                raise UserInputError(
                    f"{self.subcommand} --resume auto: no valid checkpoint in {folder}; train one first with "
                    "`fit` (same config), or pass --ckpt_path PATH"
                )
            rank_zero_info(f"--resume auto: {self.subcommand} {found}")
            config["ckpt_path"] = str(found)
            return
        config["ckpt_path"] = resolve_resume(resume, folder)

    def _checkpoint_dir(self) -> Path | str:
        """The run's checkpoint folder: that of the first ``ModelCheckpoint`` (a URL on object storage)."""
        folders = [c.dirpath for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        if folders and is_remote(folders[0]):
            return str(folders[0])
        return Path(folders[0]) if folders else Path(self.trainer.default_root_dir, "checkpoints")

    def fit(self, model: LightningModule, **kwargs: Any) -> None:
        self._run(self.trainer.fit, model, **kwargs)

    def validate(self, model: LightningModule, **kwargs: Any) -> None:
        self._run(self.trainer.validate, model, **kwargs)

    def test(self, model: LightningModule, **kwargs: Any) -> None:
        self._run(self.trainer.test, model, **kwargs)

    def predict(self, model: LightningModule, **kwargs: Any) -> None:
        self._run(self.trainer.predict, model, **kwargs)

    def _run(self, trainer_fn: Callable[..., Any], model: LightningModule, **kwargs: Any) -> None:
        check_model = getattr(self.trainer.strategy, "check_model", None)
        log_dir = launch_log_dir(self.trainer)
        log_dir_was_new = log_dir is not None and not log_dir.exists()
        failed = True
        try:
            if check_model is not None:  # a layout the model cannot take: one line, before any process starts
                check_model(model, kwargs.get("datamodule"))
            if isinstance(self.trainer.accelerator, CUDAAccelerator):
                torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls autocast leaves
            trainer_fn(model, **kwargs)
            failed = False
        except (RuntimeError, OSError) as error:
            # a checkpoint of another model shape, or a log file the disk refused: one line, not a traceback
            replacement = (checkpoint_mismatch_error(error, kwargs.get("ckpt_path"))
                           or write_failure(error, log_dir_of(self.trainer), self.subcommand))
            if replacement is None:
                raise
            raise replacement from error
        finally:
            self._release_run_lock()
            if failed:  # a launch that failed before it ran leaves the run folder as it found it
                remove_failed_launch(self.trainer, log_dir_was_new)

    def _release_run_lock(self) -> None:
        lock, self.run_lock = self.run_lock, None
        if lock is not None:
            lock.release()


def _check_checkpoint_path(ckpt_path: str | None) -> None:
    if ckpt_path is None or ckpt_path in ("best", "last", "hpc") or ckpt_path.startswith("registry"):
        return  # Lightning's names for checkpoints it finds itself
    if "://" not in ckpt_path and not Path(ckpt_path).exists():
        raise UserInputError(
            f"--ckpt_path {ckpt_path}: no such file or folder; check the path, or pass --resume auto for "
            "the run's newest checkpoint"
        )


def _user_error(error: BaseException) -> UserInputError:
    """The ``UserInputError`` behind ``error`` (jsonargparse wraps what a constructor raised), or one
    made of the innermost message."""
    innermost = error
    while True:
        if isinstance(innermost, UserInputError):
            return innermost
        if innermost.__cause__ is None:
            return UserInputError(" ".join(str(innermost).split()))
        innermost = innermost.__cause__
