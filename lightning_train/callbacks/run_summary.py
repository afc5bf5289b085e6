"""RunSummary: every fit ends with a few lines saying why it stopped, how it went and what to run next.

What a person sees at the end of ``python -m lightning_train fit --config configs/pretrain-tiny.yaml``::

    Run finished: val/loss 1.5480 reached the target (<= 1.55) at step 500 after 109.9 s (TimeToQuality)
      val/loss    best 1.5480 (step 500), last 1.5480 (step 500)
      throughput  8,845 tokens/s
      checkpoint  runs/pretrain-tiny/checkpoints/last.ckpt (step 500)
      metrics     runs/pretrain-tiny/version_0/metrics.csv
      next        python -m lightning_train report runs/pretrain-tiny
                  python -m lightning_train generate --checkpoint runs/pretrain-tiny/checkpoints/last.ckpt ...

The same facts go to ``<log_dir>/summary.json``; ``fit --resume auto`` reads it to tell a finished run
(target or ``max_steps`` reached) from one to continue.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_train.callbacks._console import close_progress_bars, print_line
from lightning_train.callbacks.preemption import INTERRUPTED_EXIT_CODE
from lightning_train.callbacks.progress import TOKENS_PER_SEC
from lightning_train.callbacks.time_to_quality import TimeToQuality
from lightning_train.checkpoint.format import read_manifest
from lightning_train.errors import CorruptCheckpointError, FaultyNode, Preempted, TrainingAborted

SUMMARY_FILE = "summary.json"
FINISHED_REASONS = ("target", "max_steps", "max_epochs")  # a rerun of these has nothing left to do
# Lightning's lines for the endings the summary says better (on a line of its own, not the bar's)
_LIGHTNING_STOP_MESSAGES = ("`Trainer.fit` stopped: `max_steps=", "`Trainer.fit` stopped: `max_epochs=")


class RunSummary(Callback):
    """Prints (rank zero) why the fit stopped — target reached, ``max_steps``/``max_epochs`` reached,
    stopped by a callback, preempted, interrupted by Ctrl-C, aborted by NaNRecovery — with the best and
    last value of ``monitor``, tokens/s, the last checkpoint, the metrics file and the next commands;
    and writes the same to ``<trainer.log_dir>/summary.json``.

    Args:
        monitor: the validation metric to summarise (best and last value, over every launch of the run).
        mode: "min" or "max": which value is the best.
        command: the command line that started this launch (the CLI passes it); the summary of an
            unfinished run then shows it with ``--resume auto`` as the way to continue.

    Example (the numbers vary from run to run, hence the ``...``):

        >>> import json
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import RunSummary, ThroughputMonitor
        >>> trainer = L.Trainer(
        ...     max_steps=4, accelerator="cpu", log_every_n_steps=2, val_check_interval=2,
        ...     limit_val_batches=2, logger=L.pytorch.loggers.CSVLogger(tempfile.mkdtemp()),
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ...     callbacks=[ThroughputMonitor(), RunSummary(monitor="val/loss")],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))  # doctest: +ELLIPSIS
        <BLANKLINE>
        Run finished: max_steps=4 reached
          val/loss    best ... (step ...), last ... (step 4)
          throughput  ... tokens/s
          metrics     .../version_0/metrics.csv
          next        python -m lightning_train report ...
        >>> summary = json.load(open(f"{trainer.log_dir}/summary.json"))
        >>> summary["finished"], summary["reason"], summary["step"]
        (True, 'max_steps', 4)
    """

    def __init__(
        self, monitor: str = "val/loss", mode: str = "min", command: list[str] | None = None
    ) -> None:
        self.monitor, self.mode, self.command = monitor, mode, command
        self.best: tuple[int, float] | None = None  # (step, value), over the whole run
        self.last: tuple[int, float] | None = None
        self._quiet_stop_message = _DropLightningStopMessage()

    # ---- what happens during the run --------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _lightning_logger().addFilter(self._quiet_stop_message)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)  # one host read per validation
        if trainer.sanity_checking or value is None:
            return
        step, value = trainer.global_step, float(value)
        self.last = (step, value)
        if self.best is None or (value < self.best[1] if self.mode == "min" else value > self.best[1]):
            self.best = (step, value)

    # ---- how it ends ------------------------------------------------------------------------------
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _lightning_logger().removeFilter(self._quiet_stop_message)
        self._finish(trainer, *_why_it_ended(trainer), _newest_checkpoint(trainer))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        _lightning_logger().removeFilter(self._quiet_stop_message)
        ending = _why_it_was_stopped(error, trainer.global_step)
        if ending is None:  # a crash or bad input: its own error message says it all
            return
        checkpoint = getattr(error, "checkpoint", None) or _newest_checkpoint(trainer)
        self._finish(trainer, *ending, str(checkpoint) if checkpoint else None)

    def _finish(self, trainer: L.Trainer, reason: str, headline: str, checkpoint: str | None) -> None:
        rate = trainer.callback_metrics.get(TOKENS_PER_SEC)
        summary = {
            "finished": reason in FINISHED_REASONS, "reason": reason, "headline": headline,
            "step": trainer.global_step, "epoch": trainer.current_epoch,
            "max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs, "monitor": self.monitor,
            "best": _point(self.best), "last": _point(self.last),
            "tokens_per_sec": float(rate) if rate is not None else None,
            "checkpoint": checkpoint, "checkpoint_step": _step_of(checkpoint),
            "metrics": _metrics_file(trainer), "target": _reached_target(trainer),
        }
        self._report(trainer, summary)

    @rank_zero_only
    def _report(self, trainer: L.Trainer, summary: dict[str, Any]) -> None:
        folder = log_dir_of(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        close_progress_bars()
        print_line("\n" + self.render(summary, trainer.default_root_dir))

    def render(self, summary: dict[str, Any], run_dir: str) -> str:
        """The lines a person reads at the end of the run (``summary``: what ``summary.json`` holds)."""
        rows = [summary["headline"]]
        best, last = summary["best"], summary["last"]
        if best and last:
            rows.append(f"  {self.monitor:<11} best {best['value']:.4f} (step {best['step']}), "
                        f"last {last['value']:.4f} (step {last['step']})")
        if summary["tokens_per_sec"] is not None:
            rows.append(f"  {'throughput':<11} {summary['tokens_per_sec']:,.0f} tokens/s")
        checkpoint = summary["checkpoint"]
        if checkpoint:
            at = f" (step {summary['checkpoint_step']})" if summary["checkpoint_step"] is not None else ""
            rows.append(f"  {'checkpoint':<11} {checkpoint}{at}")
        if summary["metrics"]:
            rows.append(f"  {'metrics':<11} {summary['metrics']}")
        for index, command in enumerate(self._next_commands(summary, run_dir)):
            rows.append(f"  {'next' if index == 0 else '':<11} {command}")
        return "\n".join(rows)

    def _next_commands(self, summary: dict[str, Any], run_dir: str) -> list[str]:
        commands = []
        if not summary["finished"] and summary["reason"] != "aborted":
            commands.append(_resume_command(self.command) if self.command else
                            "resume: Trainer.fit(..., ckpt_path=<the checkpoint above>)")
        if summary["metrics"]:
            commands.append(f"python -m lightning_train report {shlex.quote(str(run_dir))}   "
                            f"# plots: {Path(run_dir) / 'report' / 'report.html'}")
        if summary["checkpoint"] and summary["reason"] != "aborted":
            checkpoint = shlex.quote(summary["checkpoint"])
            commands.append(f"python -m lightning_train generate --checkpoint {checkpoint} --prompt 'def '")
        return commands

    # ---- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "last": self.last}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = tuple(state_dict["best"]) if state_dict["best"] else None
        self.last = tuple(state_dict["last"]) if state_dict["last"] else None


def log_dir_of(trainer: L.Trainer) -> Path:
    """This launch's log folder, as ``trainer.log_dir`` says but without its broadcast: safe on one
    rank alone and after the process group is gone."""
    logger = trainer.loggers[0] if trainer.loggers else None
    folder = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
    return Path(folder or trainer.default_root_dir)


def _why_it_ended(trainer: L.Trainer) -> tuple[str, str]:
    step = trainer.global_step
    reached = _reached_target(trainer)
    if reached is not None and reached["step"] == step:
        value = f"{reached['monitor']} {reached['value']:.4f}"
        target = f"{'<=' if reached['mode'] == 'min' else '>='} {reached['target']:g}"
        return "target", (f"Run finished: {value} reached the target ({target}) at step {step} "
                          f"after {reached['seconds']:.1f} s (TimeToQuality)")
    if 0 < trainer.max_steps <= step:
        return "max_steps", f"Run finished: max_steps={trainer.max_steps} reached"
    if trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch:
        return "max_epochs", f"Run finished: max_epochs={trainer.max_epochs} reached at step {step}"
    return "stopped", f"Run stopped by a callback (trainer.should_stop) at step {step}"


def _why_it_was_stopped(error: BaseException, step: int) -> tuple[str, str] | None:
    if isinstance(error, TrainingAborted):
        return "aborted", f"Run aborted by NaNRecovery at step {step}"
    if isinstance(error, FaultyNode):
        suspects = error.verdict["suspects"]
        return "faulty_node", (f"Run stopped at step {step}: rank(s) {suspects} computed the step "
                               "differently when it was rerun (a faulty machine): checkpoint saved, "
                               f"exit code {error.code}")
    if not isinstance(error, Preempted):
        return None
    if error.code != INTERRUPTED_EXIT_CODE:
        return "preempted", f"Run preempted ({error.signal_name}) at step {step}: checkpoint saved"
    if error.checkpoint:
        return "interrupted", f"Run interrupted by Ctrl-C at step {step}: checkpoint saved"
    return "interrupted", (f"Run stopped at once by a second Ctrl-C during step {step + 1}: "
                           "nothing saved since the last checkpoint")


def _reached_target(trainer: L.Trainer) -> dict[str, Any] | None:
    for callback in trainer.callbacks:
        if isinstance(callback, TimeToQuality) and callback.result and callback.result["reached"]:
            return callback.result
    return None


def _newest_checkpoint(trainer: L.Trainer) -> str | None:
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and (callback.last_model_path or callback.best_model_path):
            return callback.last_model_path or callback.best_model_path
    return None


def _step_of(checkpoint: str | None) -> int | None:
    try:
        manifest = read_manifest(checkpoint) if checkpoint else None
    except CorruptCheckpointError:
        return None
    return manifest.get("global_step") if manifest else None


def _metrics_file(trainer: L.Trainer) -> str | None:
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            return str(Path(logger.log_dir) / "metrics.csv")
    return None


def _point(point: tuple[int, float] | None) -> dict[str, Any] | None:
    return {"step": point[0], "value": point[1]} if point else None


def _resume_command(command: list[str]) -> str:
    """``command`` with its own ``--resume`` / ``--ckpt_path`` replaced by ``--resume auto``."""
    kept, skip = [], False
    for argument in command:
        if skip:
            skip = False
        elif argument in ("--resume", "--ckpt_path"):
            skip = True
        elif not argument.startswith(("--resume=", "--ckpt_path=")):
            kept.append(argument)
    return shlex.join([*kept, "--resume", "auto"])


def _lightning_logger() -> logging.Logger:
    return logging.getLogger("lightning.pytorch.utilities.rank_zero")


class _DropLightningStopMessage(logging.Filter):
    """Drops Lightning's "`Trainer.fit` stopped: `max_steps=...` reached." line, which lands on the
    progress bar's line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_LIGHTNING_STOP_MESSAGES)
