"""One folder per run, never shared by two runs, and a finished run that is started again stays finished.

    runs/<run_name>/
      checkpoints/          every checkpoint of the run (each launch that resumes it adds to them)
      version_N/            one per training launch: config.yaml, metrics.csv, summary.json, ...
      validate/version_N/   `validate` (and `test`, `predict`) launches: never a version of the training

The run name is ``--run_name`` (the folder ``<parent of trainer.default_root_dir>/<run_name>``), else the
last part of the config's ``trainer.default_root_dir``, else the config file's name (``runs/<stem>``).
A new ``fit`` into a folder that holds a run is refused unless it resumes that run; a ``fit`` that resumes
a run that already finished (its target or ``max_steps`` reached) says so and exits 0 without training.

A run folder on object storage (``trainer.default_root_dir: s3://bucket/runs/x``) keeps the run's
checkpoints there, ``s3://bucket/runs/x/checkpoints/``, what a restart on any machine needs; the
launches' logs (``version_N/``) go to the local ``runs/x/`` of the machine that ran them.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.trainer.states import TrainerFn

import lightning_train.storage as storage
from lightning_train.callbacks import TimeToQuality
from lightning_train.callbacks.run_summary import SUMMARY_FILE, log_dir_of
from lightning_train.checkpoint.format import read_manifest
from lightning_train.checkpoint.resume import checkpoints_newest_first
from lightning_train.errors import CorruptCheckpointError, UserInputError

RUNS = Path("runs")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def run_folder(run_name: str | None, default_root_dir: str | None, config_files: list[Any]) -> Path | str:
    """The run's folder from ``--run_name``, the config's ``default_root_dir`` and the config files (a
    URL when that is one)."""
    if run_name is not None and not _NAME.fullmatch(run_name):
        raise UserInputError(
            f"--run_name {run_name!r}: use a plain folder name (letters, digits, '.', '_', '-')"
        )
    if storage.is_remote(default_root_dir):
        assert default_root_dir is not None
        root = default_root_dir.rstrip("/")
        return storage.join(storage.parent(root), run_name) if run_name else root
    if default_root_dir:
        root = Path(default_root_dir)
        root = root.parent / run_name if run_name else root
    else:
        stem = Path(str(config_files[-1])).stem if config_files else "default"
        root = RUNS / (run_name or stem)
    if root.exists() and not root.is_dir():
        raise UserInputError(f"the run folder {root} is a file; pass a folder for the run with "
                             "--trainer.default_root_dir (or --run_name NAME)")
    return root


def local_logs(url: str) -> Path:
    """Where the launches of the run at ``url`` log: ``runs/<last part of the URL>``."""
    return RUNS / storage.name(url)


def check_fit(
    trainer: Trainer, checkpoint_dir: Path | str, ckpt_path: str | None, resume_auto: bool,
    continue_past_target: bool,
) -> bool:
    """Before a ``fit``: refuse to mix runs in one folder; exit 0 (after saying so) when the run being
    resumed has nothing left to do. ``ckpt_path`` is the resolved checkpoint, None for a fresh start.
    Returns whether the fit resumes this run from its own checkpoints.

    ``--resume auto`` that found no checkpoint may start afresh in a folder that holds only metrics (a
    launch killed before its first checkpoint), never over checkpoints."""
    folder = Path(trainer.default_root_dir)
    if storage.is_remote(checkpoint_dir):
        own = ckpt_path is not None and ckpt_path.startswith(str(checkpoint_dir).rstrip("/") + "/")
        # a checkpoint counts once its manifest is written: an upload cut short leaves none
        has_checkpoints = bool(checkpoints_newest_first(checkpoint_dir))
    else:
        checkpoint_dir = Path(checkpoint_dir)
        own = ckpt_path is not None and Path(ckpt_path).resolve().is_relative_to(checkpoint_dir.resolve())
        has_checkpoints = checkpoint_dir.is_dir() and any(
            not entry.name.startswith(".") for entry in checkpoint_dir.iterdir()  # .partial: torn writes
        )
    has_metrics = any(folder.glob("version_*/metrics.csv"))
    if resume_auto and ckpt_path is None and has_checkpoints:
        raise UserInputError(
            f"--resume auto: {checkpoint_dir} holds checkpoints but none passed verification (see the "
            "warnings above), so nothing was resumed or overwritten; move them away to start this run "
            "afresh, or start a new run in its own folder with --run_name NAME"
        )
    if not own and (has_checkpoints or (has_metrics and not resume_auto)):
        started = f" from {ckpt_path}" if ckpt_path else ""
        raise UserInputError(
            f"{folder} already holds a run; a new fit{started} would mix with it. Continue that run with "
            "--resume auto, or start a new one in its own folder with --run_name NAME"
        )
    if own:
        finished = _finished(trainer, folder, ckpt_path, continue_past_target)
        if finished is not None:
            if trainer.is_global_zero:
                print(finished, flush=True)
            raise SystemExit(0)
    return own


def _finished(trainer: Trainer, folder: Path, checkpoint: str, continue_past_target: bool) -> str | None:
    """What to say when resuming ``checkpoint`` would train no further, else None."""
    step = _step_of(checkpoint)
    if step is not None and 0 < trainer.max_steps <= step:
        name = storage.name(checkpoint) if storage.is_remote(checkpoint) else Path(checkpoint).name
        return (f"{folder} is finished: its checkpoint {name} is at step {step}, "
                f"max_steps={trainer.max_steps}; nothing to train (a higher --trainer.max_steps trains on)")
    summary = _latest_summary(folder)
    if summary is None or not summary["finished"] or step is None or step > summary["step"]:
        return None  # not finished, or the run went on after that launch
    if summary["reason"] == "target" and continue_past_target:
        for callback in trainer.callbacks:
            if isinstance(callback, TimeToQuality):
                callback.continue_past_target(summary["target"])
        return None
    if summary["reason"] == "max_steps" and trainer.max_steps > summary["step"]:
        return None  # max_steps was raised
    if summary["reason"] == "max_epochs" and (trainer.max_epochs or 0) > summary["epoch"]:
        return None
    how = "--continue_past_target" if summary["reason"] == "target" else "a higher limit"
    why = summary["headline"].removeprefix("Run finished: ")
    return f"{folder} is finished: {why}; nothing to train ({how} trains on)"


def _latest_summary(folder: Path) -> dict[str, Any] | None:
    """The ``summary.json`` of the newest training launch that wrote one."""
    summaries = [(int(p.parent.name.split("_")[1]), p) for p in folder.glob(f"version_*/{SUMMARY_FILE}")
                 if p.parent.name.split("_")[1].isdigit()]
    if not summaries:
        return None
    try:
        return json.loads(max(summaries)[1].read_text())
    except (OSError, ValueError):
        return None  # unreadable: treat the run as not finished, resuming is the safe side


def _step_of(checkpoint: str) -> int | None:
    try:
        manifest = read_manifest(checkpoint)
    except CorruptCheckpointError:
        return None
    return manifest.get("global_step") if manifest else None


def launch_log_dir(trainer: Trainer) -> Path | None:
    """This launch's own log folder (its logger's ``version_N/``), None when it logs into the run folder."""
    folder = log_dir_of(trainer)
    return None if folder.resolve() == Path(trainer.default_root_dir).resolve() else folder


def remove_failed_launch(trainer: Trainer, log_dir_was_new: bool) -> None:
    """After a launch failed before it started training or evaluating (it saved no ``config.yaml``): remove
    the log folder it created (Lightning's ``hparams.yaml`` is all it holds), then its parents up to the
    run folder and the run's ``checkpoints/`` where they are empty: the folder is as the launch found it."""
    log_dir = launch_log_dir(trainer)
    if log_dir is not None and log_dir_was_new and not (log_dir / "config.yaml").exists():
        shutil.rmtree(log_dir, ignore_errors=True)
    run = Path(trainer.default_root_dir)
    for folder in (*(log_dir.parents if log_dir else ()), run / "checkpoints"):
        if folder == run or run in folder.parents:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only ever removes an empty folder
    with contextlib.suppress(OSError):
        run.rmdir()


class SaveConfigWhenRunning(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback``, saving ``config.yaml`` once the launch has set up and starts
    training (or evaluating) rather than at ``setup``: a launch that fails on its data, its checkpoint
    or its model leaves no ``version_N/`` folder that holds nothing but a config."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pass

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().setup(trainer, pl_module, "fit")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            super().setup(trainer, pl_module, "validate")

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().setup(trainer, pl_module, "test")

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().setup(trainer, pl_module, "predict")
