"""TimeToQuality: MLPerf Training's yardstick, the wall-clock time to reach a validation target."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from lightning_train.callbacks._common import log_metrics
from lightning_train.errors import UserInputError

RESULT_FILE = "time_to_quality.json"


class TimeToQuality(Callback):
    """Stops training when the validation metric ``monitor`` reaches ``target`` (``<=`` with mode
    "min", ``>=`` with "max"), logs ``perf/time_to_target_sec`` and ``perf/time_to_target_step``,
    and writes ``time_to_quality.json`` into ``trainer.log_dir`` (rank zero). If training ends
    first, the file says ``"reached": false`` with the time spent and the best value seen.

    What the seconds count: the wall clock from the start of ``fit`` (``on_fit_start``) to the end
    of the validation that reached the target, everything in between included: the sanity check,
    training, every validation, checkpointing and logging. Not counted: what precedes
    ``on_fit_start`` (process start, imports, process-group set-up, ``prepare_data``/``setup``, model
    construction). On resume the count continues from the value saved in the checkpoint, so the
    time between that checkpoint and the interruption, and the restart's set-up, are not counted.

    Once reached, a run is finished: the CLI's ``fit --resume auto`` then says so and exits 0. To train
    on past the target, ``--continue_past_target`` calls ``continue_past_target(result)``: the result of
    the launch that reached it is kept (and its file left alone) and the run is not stopped again.

    Args:
        target: the value to reach.
        monitor: a metric logged during validation (``trainer.callback_metrics``).
        mode: "min" (e.g. a loss) or "max" (e.g. an accuracy).

    Example (an easy target, a loss below 6.0: reached at the first validation, which stops the run):

        >>> import json
        >>> import tempfile
        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import TimeToQuality
        >>> stopper = TimeToQuality(target=6.0, monitor="val/loss", mode="min")
        >>> trainer = L.Trainer(
        ...     max_steps=20, val_check_interval=2, limit_val_batches=2, accelerator="cpu", logger=False,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ...     default_root_dir=tempfile.mkdtemp(), callbacks=[stopper],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> stopper.result["reached"], stopper.result["step"], trainer.global_step
        (True, 2, 2)
        >>> json.load(open(f"{trainer.log_dir}/time_to_quality.json")) == stopper.result
        True
    """

    def __init__(self, target: float, monitor: str = "val/loss", mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise UserInputError(f"TimeToQuality mode={mode!r}: use 'min' (lower is better) or 'max'")
        self.target, self.monitor, self.mode = float(target), monitor, mode
        self.result: dict[str, Any] | None = None  # what the JSON file holds, once written
        self._seconds_before = 0.0  # counted by the runs before a resume
        self._fit_start: float | None = None
        self._best: float | None = None
        self._reached_earlier: dict[str, Any] | None = None  # set by continue_past_target

    def elapsed(self) -> float:
        """Seconds counted so far (see the class docstring)."""
        running = time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0
        return self._seconds_before + running

    def continue_past_target(self, result: dict[str, Any]) -> None:
        """The target was reached in an earlier launch (``result``: what its ``time_to_quality.json``
        holds): keep that result, and neither stop the run nor write the file again. It holds over the
        checkpoint's state, which may predate the validation that reached the target."""
        self._reached_earlier = self.result = result

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or self._reached():
            return
        metrics = trainer.callback_metrics  # the host reads of this callback: once per validation
        if self.monitor not in metrics:
            raise UserInputError(
                f"TimeToQuality monitor={self.monitor!r} was not logged in validation; "
                f"logged metrics: {sorted(metrics)}. Set monitor to one of them."
            )
        value = float(metrics[self.monitor])
        better = min if self.mode == "min" else max
        self._best = value if self._best is None else better(self._best, value)
        reached = value <= self.target if self.mode == "min" else value >= self.target
        # Ranks must agree on stopping (a metric that is not synced could differ between ranks).
        if trainer.strategy.reduce_boolean_decision(reached, all=False):
            seconds, step = self.elapsed(), trainer.global_step
            trainer.should_stop = True
            log_metrics(trainer, {"perf/time_to_target_sec": seconds, "perf/time_to_target_step": step})
            self._write(trainer, reached=True, seconds=seconds, step=step, value=value)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._reached():
            self._write(trainer, reached=False, seconds=self.elapsed(), step=trainer.global_step, value=None)

    def _reached(self) -> bool:
        return self.result is not None and self.result["reached"]

    def _write(
        self, trainer: L.Trainer, reached: bool, seconds: float, step: int, value: float | None
    ) -> None:
        self.result = {
            "reached": reached, "seconds": seconds, "step": step, "value": value, "best": self._best,
            "monitor": self.monitor, "mode": self.mode, "target": self.target,
            "counted": "wall clock from fit start, including sanity check, validation and checkpointing",
        }
        _write_json(Path(trainer.log_dir or trainer.default_root_dir) / RESULT_FILE, self.result)

    # ---- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.elapsed(), "best": self._best, "result": self.result}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._seconds_before, self._best = state_dict["seconds"], state_dict["best"]
        self.result = self._reached_earlier or state_dict["result"]


@rank_zero_only
def _write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
