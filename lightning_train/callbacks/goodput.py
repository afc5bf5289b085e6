"""Goodput: the share of a run's wall time spent in productive optimizer steps, and where the rest went.

A long run loses time in ways no step-time metric shows: start-up (imports, process groups, loading a
checkpoint, compiling), checkpoint writes that block training, validation, steps skipped or rolled
back by NaNRecovery, and restarts that recompute the steps since the last checkpoint. ``GoodputMonitor``
puts every second of each launch into one part, from the process's start to the launch's last record:

========== ==================================================================================
startup    process start to the first training batch (imports, set-up, checkpoint loading,
           the sanity check, the first data loader start)
productive optimizer steps that were taken, each from the end of the previous batch (its data
           loading) to the end of its own
checkpoint time training was blocked by a save: the gap around a save minus the median gap
           between batches without one (with asynchronous saves only the blocked part)
validation validation during training
recovery   steps skipped (NaNRecovery, GradScaler overflows) and steps rolled back by NaNRecovery
lost       steps of an earlier launch after the checkpoint the run resumed from: recomputed
other      the rest: after the last step (teardown), an interrupted step, ...
========== ==================================================================================

Timing is ``time.perf_counter`` on the host at hook boundaries: no device sync. Queued device work
shows where the host waits for it (a logging step's reads, a save), as in any host timing. On logging
steps it logs ``goodput/productive_fraction`` and ``goodput/<part>_sec`` of the run (every launch
summed) and, at most once a minute, rewrites ``goodput.json`` in the launch's log folder (also at the
start and the end); every step it rewrites the launch's live record
(``lightning_train.loggers.goodput``), which a resumed launch reads to know how far a killed one got.
Rank zero's clock stands for the run (every rank waits for the slowest anyway).
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from lightning_train.callbacks._common import is_logging_step, log_metrics
from lightning_train.callbacks.nan_recovery import NaNRecovery
from lightning_train.callbacks.run_summary import log_dir_of
from lightning_train.errors import TrainingAborted, UserInputError, ended_by_a_write
from lightning_train.loggers.goodput import (
    PARTS,
    LiveRecord,
    Record,
    earlier_launches,
    launch_record,
    total,
    write_goodput,
)
from lightning_train.plugins.step import StepControl, step_control

_ORDINARY_GAPS = 32  # recent gaps between batches without a save or validation, for their median
_JSON_EVERY_S = 60.0  # goodput.json on logging steps at most this often (a rewrite costs ~0.5 ms)


class GoodputMonitor(Callback):
    """Measures where each launch's wall time goes; writes ``goodput.json``, logs ``goodput/*``.

    Args:
        start: when a launch starts: "process" (the process's start: what a job pays, imports
            included; for scripts and the CLI) or "created" (when this callback was made: for a
            Trainer in a notebook or a test process that has run other things before).

    The run's totals cover every launch of it: the checkpoint carries the earlier launches' records
    (``state_dict``), and the live records of the launch folders next to this one say how far the
    launch that saved the checkpoint got before it ended. Launches of the run that the checkpoint
    does not know (one killed before a checkpoint of its own was resumed) count as lost work. Time
    between launches (a job waiting in a queue) is in no launch.

    Example (the parts add up to the launch's wall time):

        >>> import json
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import GoodputMonitor
        >>> trainer = L.Trainer(
        ...     max_steps=6, accelerator="cpu", log_every_n_steps=2, val_check_interval=3,
        ...     limit_val_batches=2, logger=L.pytorch.loggers.CSVLogger(tempfile.mkdtemp()),
        ...     enable_progress_bar=False, enable_model_summary=False,
        ...     callbacks=[GoodputMonitor(start="created")],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> run = json.load(open(f"{trainer.log_dir}/goodput.json"))
        >>> sorted(run["seconds"])
        ['checkpoint', 'lost', 'other', 'productive', 'recovery', 'startup', 'validation']
        >>> abs(sum(run["seconds"].values()) - run["wall_sec"]) < 1e-6, 0 < run["productive_fraction"] < 1
        (True, True)
        >>> run["steps"], run["launches"][0]["state"]
        ({'productive': 6, 'recovery': 0, 'lost': 0}, 'finished')
    """

    def __init__(self, start: str = "process") -> None:
        if start not in ("process", "created"):
            raise UserInputError(f"GoodputMonitor start={start!r}: use 'process' or 'created'")
        self.start = start
        self._created = (time.perf_counter(), time.time())
        self.run_id = secrets.randbits(63)
        self.earlier: list[Record] = []  # the run's launches before this one, final
        self._checkpointed: dict[str, Any] | None = None  # the state a resume loaded
        self._reset(*self._created)

    def _reset(self, origin: float, started: float) -> None:
        """A new launch, started at ``origin`` (perf_counter), ``started`` (unix time)."""
        self.seconds = dict.fromkeys(PARTS, 0.0)  # this launch, up to ``_mark``
        self.steps = {"productive": 0, "recovery": 0, "lost": 0}
        self._started = started
        self._mark = origin  # every second up to here is in a part (or pending below)
        self._step_sec = 0.0  # the step in progress: its data loading and micro-batches (pending)
        self._gap = 0.0  # since the last batch end, validation aside (pending)
        self._gap_saved = self._gap_validated = self._in_batch = self._saved_in_batch = False
        self._training = False
        self._gaps: deque[float] = deque(maxlen=_ORDINARY_GAPS)
        self._name, self._state = "", "training"
        self._first_step = self._counted_step = 0
        self._resumed_from: int | None = None
        self._control: StepControl | None = None
        self._optimizer_ids: list[int] = []
        self._real_steps = 0
        self._recovery: NaNRecovery | None = None
        self._rollbacks, self._snapshot_step = 0, None
        self._at_snapshot = (0.0, 0)  # productive seconds and steps at NaNRecovery's snapshot
        self._folder: Path | None = None
        self._live: LiveRecord | None = None
        self._json_written = -float("inf")  # perf_counter of the last goodput.json

    # ---- the launch ---------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.start == "process":
            now, age = time.perf_counter(), process_age()
            self._reset(now - age, time.time() - age)
        else:
            self._reset(*self._created)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After any checkpoint was restored (some strategies restore after on_fit_start).
        self._control = step_control(trainer)  # hooked in now, so that it counts this launch's steps
        self._optimizer_ids = [id(optimizer) for optimizer in trainer.optimizers]
        self._real_steps = self._real_step_count()
        self._first_step = self._counted_step = trainer.global_step
        self._resumed_from = trainer.global_step if trainer.ckpt_path else None
        self._recovery = next((c for c in trainer.callbacks if isinstance(c, NaNRecovery)), None)
        self._rollbacks = self._recovery.rollbacks if self._recovery else 0
        loaded, self._checkpointed = self._checkpointed, None
        if loaded is not None:
            self.run_id = int(loaded["run_id"], 16)
        now = time.perf_counter()
        self.seconds["startup"] += now - self._mark
        self._mark = now
        if not trainer.is_global_zero:
            return
        self._folder = log_dir_of(trainer)
        self._name = self._folder.name
        self.earlier = earlier_launches(
            self._folder.parent, self.run_id, loaded["launches"] if loaded else [],
            loaded["current"] if loaded else None, self._started,
        )
        self._live = LiveRecord(self._folder)
        self._write(goodput_json=True)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        unusual = self._gap_saved or self._gap_validated
        if not self._training:
            self._training = True
            self.seconds["startup"] += now - self._mark
        else:
            self._step_sec += self._close_gap(now)
        self._mark, self._in_batch = now, True
        self._note_rollback()
        if unusual:  # a save or a validation just ended: on record at once
            self._write()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self._saved_in_batch:  # a callback before this one saved (preemption, NaNRecovery's abort)
            self.seconds["checkpoint"] += now - self._mark
            self._saved_in_batch = False
        else:
            self._step_sec += now - self._mark
        self._mark, self._in_batch = now, False
        self._note_snapshot()
        if trainer.global_step != self._counted_step:  # not a gradient accumulation micro-batch
            self._close_step(trainer.global_step)
            if is_logging_step(trainer):
                run = total([*self.earlier, self.record()])
                log_metrics(trainer, {"goodput/productive_fraction": run["productive_fraction"],
                                      **{f"goodput/{part}_sec": run["seconds"][part] for part in PARTS}})
                self._write(goodput_json=now - self._json_written >= _JSON_EVERY_S)
                return
        self._write()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._training and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            now = time.perf_counter()
            self._gap += now - self._mark
            self._mark = now

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._training and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            now = time.perf_counter()
            self.seconds["validation"] += now - self._mark
            self._mark, self._gap_validated = now, True
            self._write()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if not self._training:
            return
        if not self._in_batch:
            self._gap_saved = True  # its cost is known when the next batch starts
            return
        # Saved from inside a batch (by a callback's on_train_batch_end before this one's): the step
        # ends here, and what follows until this callback's next hook is the save.
        now = time.perf_counter()
        self._step_sec += now - self._mark
        self._mark, self._saved_in_batch = now, True
        if trainer.global_step != self._counted_step:
            self._close_step(trainer.global_step)
        if "callbacks" in checkpoint:  # its state was taken a moment ago, before the step was counted
            checkpoint["callbacks"][self.state_key] = self.state_dict()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish("finished")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, error: BaseException) -> None:
        if isinstance(error, TrainingAborted):  # NaNRecovery restored its snapshot before giving up
            self._roll_back()
        # after a write the file system refused (a full disk), nothing more is written
        self._finish("stopped", write=not ended_by_a_write(error))

    def _finish(self, state: str, write: bool = True) -> None:
        self._note_rollback()
        now = time.perf_counter()
        if not self._training:
            self.seconds["startup"] += now - self._mark
        elif self._saved_in_batch:
            self.seconds["checkpoint"] += now - self._mark
        elif self._in_batch:
            self._step_sec += now - self._mark  # a batch that never finished
        else:
            self.seconds["other"] += self._close_gap(now)
        self.seconds["other"] += self._step_sec  # no optimizer step came of it
        self._step_sec, self._mark, self._state = 0.0, now, state
        if write:
            self._write(goodput_json=True)
        if self._live is not None:
            self._live.close()
            self._live = None

    # ---- accounting ---------------------------------------------------------------------------------
    def _close_gap(self, now: float) -> float:
        """Ends the gap since the last batch end (a save's stall goes to "checkpoint"); returns the rest."""
        gap = self._gap + now - self._mark
        if self._gap_saved:
            ordinary = statistics.median(self._gaps) if self._gaps else 0.0
            stall = min(max(gap - ordinary, 0.0), gap)
            self.seconds["checkpoint"] += stall
            gap -= stall
        elif not self._gap_validated:
            self._gaps.append(gap)
        self._gap, self._gap_saved, self._gap_validated = 0.0, False, False
        return gap

    def _close_step(self, global_step: int) -> None:
        real_steps = self._real_step_count()
        kind = "productive" if real_steps != self._real_steps else "recovery"  # skipped: no real step
        self.seconds[kind] += self._step_sec
        self.steps[kind] += global_step - self._counted_step
        self._step_sec, self._real_steps, self._counted_step = 0.0, real_steps, global_step

    def _real_step_count(self) -> int:
        control = self._control
        return sum(control.real_steps(i) for i in self._optimizer_ids) if control is not None else 0

    def _note_snapshot(self) -> None:
        """NaNRecovery snapshots at a batch's start: the productive time so far is what a rollback keeps."""
        recovery = self._recovery
        if recovery is not None and recovery.snapshot.step != self._snapshot_step:
            self._snapshot_step = recovery.snapshot.step
            self._at_snapshot = (self.seconds["productive"], self.steps["productive"])

    def _note_rollback(self) -> None:
        recovery = self._recovery
        if recovery is not None and recovery.rollbacks != self._rollbacks:
            self._rollbacks = recovery.rollbacks
            self._roll_back()

    def _roll_back(self) -> None:
        """The steps since NaNRecovery's snapshot were undone: their time was recovery, not progress."""
        seconds = self.seconds["productive"] - self._at_snapshot[0]
        steps = self.steps["productive"] - self._at_snapshot[1]
        self.seconds["productive"] -= seconds
        self.seconds["recovery"] += seconds
        self.steps["productive"] -= steps
        self.steps["recovery"] += steps

    # ---- records ------------------------------------------------------------------------------------
    def record(self) -> Record:
        """This launch so far (up to the last hook): time not yet known to be a step or a stall (the
        step in progress, the gap since the last batch) counts as other."""
        seconds = {**self.seconds, "other": self.seconds["other"] + self._step_sec + self._gap}
        return launch_record(self._name, self._started, self._state, self._first_step, self._counted_step,
                             self._resumed_from, seconds, self.steps)

    def _write(self, goodput_json: bool = False) -> None:
        if self._live is None:  # not rank zero, or not training
            return
        self._live.write(self.run_id, self._state, self._started, self.seconds, self._step_sec + self._gap,
                         self._first_step, self._counted_step, self.steps, self._resumed_from)
        if goodput_json:
            assert self._folder is not None
            write_goodput(self._folder, self.run_id, [*self.earlier, self.record()])
            self._json_written = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": f"{self.run_id:016x}", "launches": self.earlier, "current": self.record()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._checkpointed = state_dict  # read at on_train_start, with the launch folders beside it


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc, 10 ms resolution; elsewhere psutil)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        import psutil  # a dependency of wandb

        return time.time() - psutil.Process().create_time()
