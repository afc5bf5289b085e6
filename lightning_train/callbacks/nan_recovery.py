"""NaNRecovery: skip bad optimizer steps, roll back and skip data when they persist, abort with forensics.

The escalation ladder, checked at every optimizer step:

1. **Skip** a step whose loss or gradient norm is non-finite, or whose loss (optionally gradient norm) is
   a spike: more than ``spike_threshold`` standard deviations above the mean of the last ``window``
   accepted steps. The step changes nothing (``step_control(trainer).skip``, ``lightning_train.plugins``).
2. **Roll back** after ``max_consecutive_skips`` skips in a row, or ``max_skips_in_window`` within
   ``skip_window`` steps: restore model, optimizer, LR schedulers and GradScaler from the snapshot taken
   every ``snapshot_every`` steps (host memory, each rank its own shard), pass over the next
   ``skip_batches`` batches without computing them (they cost no step of ``max_steps``), and optionally
   scale the LR by ``lr_scale`` for ``lr_scale_steps`` steps (PaLM §5.1).
3. **Abort** when a rollback is due after ``max_rollbacks`` of them: save the last good state as a
   checkpoint, write a forensic JSON, raise ``TrainingAborted`` (the CLI exits with code 3).

With ``rerun=True`` a bad step is first rerun from the same state to tell a bad machine from a bad batch
(``step_rerun``): ``transient`` (the rerun differs) saves the state and exits with code 77 on the faulty
node, for a requeue without it; ``persistent`` and ``data`` go up the ladder.

All ranks decide the same: the step's loss, gradient norm (the step's one measurement, over every shard
and stage) and the scaler's overflow flag are averaged over ranks in one all-reduce and read on the host
once. Overflows the GradScaler handles itself (finite loss, inf/NaN scaled gradients) are left to it.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer

from lightning_train.callbacks._common import data_parallel_size, is_logging_step, log_metrics
from lightning_train.callbacks._data_skip import skip_train_batches
from lightning_train.callbacks._forensics import save_with_forensics
from lightning_train.callbacks._snapshot import HostSnapshot
from lightning_train.callbacks.step_rerun import StepRerun, Verdict, exit_faulty_node
from lightning_train.errors import TrainingAborted, UserInputError
from lightning_train.loggers.alerts import send_alert
from lightning_train.plugins.step import step_control

_HISTORY = 64  # bad steps, recent steps and events kept for the forensic report
_SETTINGS = ("spike_threshold", "window", "min_window", "grad_norm_spikes", "max_consecutive_skips",
             "max_skips_in_window", "skip_window", "snapshot_every", "skip_batches", "lr_scale",
             "lr_scale_steps", "max_rollbacks", "rerun", "rerun_every", "rerun_tolerance")  # for forensics
_HISTORIES = ("losses", "norms", "recent_skips", "bad_steps", "recent", "events")  # deques in state_dict


class NaNRecovery(Callback):
    """Detects non-finite and spiking steps and escalates: skip → roll back and skip data → abort.

    It judges the step's gradient norm as the Trainer measures it once a step (``step_control(trainer).
    grad_norms()``): a ``GradNormMonitor``'s groups in the forensic report when there is one.

    Args:
        spike_threshold: z-score above which a loss is a spike; ``inf`` turns spike detection off.
        window: accepted steps in the rolling mean/std (non-finite and spiking values never enter).
        min_window: accepted steps needed before spikes are judged.
        grad_norm_spikes: also treat gradient-norm spikes as bad steps.
        max_consecutive_skips: roll back after this many skipped steps in a row ...
        max_skips_in_window: ... or after this many within the last ``skip_window`` steps.
        skip_window: see ``max_skips_in_window``.
        snapshot_every: optimizer steps between host-memory snapshots (also one at the start).
        skip_batches: batches after a rollback that are passed over without computing them; they do not
            count as steps (``global_step`` and ``max_steps`` ignore them).
        lr_scale: LR factor for the ``lr_scale_steps`` steps after a rollback.
        lr_scale_steps: see ``lr_scale``; 0 leaves the LR alone.
        max_rollbacks: abort when one more rollback would be needed.
        rerun: rerun a bad step from the same state on every rank before acting on it, and record the
            verdict (``transient``: exit 77 on the faulty node; ``persistent``; ``data``) in the forensic
            report, the event log and the alert. Data-parallel layouts (ddp, fsdp, one device).
        rerun_every: also rerun every N-th healthy step with the batches on the next data-parallel rank
            (0: never), to catch silent corruption that leaves the step finite; implies ``rerun``.
        rerun_tolerance: the relative difference in a loss or gradient norm that makes a rerun "differ".

    Example (the loss of the third step is NaN; that step is skipped and training goes on):

        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.callbacks import GradNormMonitor, NaNRecovery
        >>> class OneNaNStep(PretrainModule):
        ...     def compute_loss(self, logits, labels):
        ...         loss = super().compute_loss(logits, labels)
        ...         return loss * float("nan") if self.global_step == 2 else loss
        >>> recovery = NaNRecovery(snapshot_every=2, skip_batches=2, max_rollbacks=2)
        >>> trainer = L.Trainer(
        ...     max_steps=5, accelerator="cpu", limit_val_batches=0, logger=False,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ...     callbacks=[GradNormMonitor(), recovery],
        ... )
        >>> module = OneNaNStep(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> recovery.skipped_steps, recovery.rollbacks
        (1, 0)
        >>> all(p.isfinite().all() for p in module.parameters())  # the NaN step changed nothing
        True

    When every step is bad, it rolls back and finally gives up with ``TrainingAborted``, leaving the last
    good state as a checkpoint and a forensic report:

        >>> import json
        >>> import tempfile
        >>> class AlwaysNaN(PretrainModule):
        ...     def compute_loss(self, logits, labels):
        ...         return super().compute_loss(logits, labels) * float("nan")
        >>> recovery = NaNRecovery(max_consecutive_skips=2, skip_batches=1, max_rollbacks=1)
        >>> trainer = L.Trainer(
        ...     max_steps=20, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_checkpointing=False, enable_model_summary=False, default_root_dir=tempfile.mkdtemp(),
        ...     callbacks=[recovery],
        ... )
        >>> try:
        ...     trainer.fit(AlwaysNaN(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)),
        ...                 TextDataModule(seq_len=16, batch_size=4))
        ... except Exception as error:  # TrainingAborted; the CLI exits with code 3
        ...     aborted = error
        >>> type(aborted).__name__, aborted.checkpoint.is_file(), recovery.rollbacks
        ('TrainingAborted', True, 1)
        >>> print(json.loads(aborted.forensics.read_text())["reason"])
        1 rollbacks did not stop the bad steps (last: non-finite loss (nan))
    """

    def __init__(
        self,
        spike_threshold: float = 6.0,
        window: int = 128,
        min_window: int = 32,
        grad_norm_spikes: bool = False,
        max_consecutive_skips: int = 5,
        max_skips_in_window: int = 10,
        skip_window: int = 100,
        snapshot_every: int = 100,
        skip_batches: int = 200,
        lr_scale: float = 1.0,
        lr_scale_steps: int = 0,
        max_rollbacks: int = 3,
        rerun: bool = False,
        rerun_every: int = 0,
        rerun_tolerance: float = 1e-5,
    ) -> None:
        checks = {
            "spike_threshold": spike_threshold > 0, "window": window >= 2,
            "min_window": 2 <= min_window <= window, "max_consecutive_skips": max_consecutive_skips >= 1,
            "max_skips_in_window": max_skips_in_window >= 1, "skip_window": skip_window >= 1,
            "snapshot_every": snapshot_every >= 1, "skip_batches": skip_batches >= 0,
            "lr_scale": 0 < lr_scale <= 1, "lr_scale_steps": lr_scale_steps >= 0,
            "max_rollbacks": max_rollbacks >= 0, "rerun_every": rerun_every >= 0,
            "rerun_tolerance": 0 <= rerun_tolerance < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise UserInputError(
                    f"NaNRecovery {name}={locals()[name]!r} is out of range: spike_threshold > 0, "
                    "2 <= min_window <= window, 0 < lr_scale <= 1, 0 <= rerun_tolerance < 1, counts >= 1 "
                    "(skip_batches, lr_scale_steps, max_rollbacks, rerun_every >= 0)"
                )
        self.spike_threshold, self.window, self.min_window = spike_threshold, window, min_window
        self.grad_norm_spikes = grad_norm_spikes
        self.max_consecutive_skips, self.max_skips_in_window = max_consecutive_skips, max_skips_in_window
        self.skip_window, self.snapshot_every, self.skip_batches = skip_window, snapshot_every, skip_batches
        self.lr_scale, self.lr_scale_steps, self.max_rollbacks = lr_scale, lr_scale_steps, max_rollbacks
        self.rerun, self.rerun_every = rerun or rerun_every > 0, rerun_every
        self.rerun_tolerance = rerun_tolerance
        # ---- state (all of it in state_dict) ----
        self.skipped_steps = self.spikes = self.rollbacks = 0
        self.skipped_data: list[list[int]] = []  # [global_step, batches passed over] per rollback
        self._losses: deque[float] = deque(maxlen=window)
        self._norms: deque[float] = deque(maxlen=window)
        self._consecutive = 0
        self._recent_skips: deque[int] = deque()
        self._lr_scaled = (0, 0)  # [first, end) steps trained with lr * lr_scale (the control applies it)
        self._bad_steps: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self._recent: deque[list[float]] = deque(maxlen=_HISTORY)  # [step, loss, grad_norm]
        self._events: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        # ---- per-run, not state ----
        self.snapshot = HostSnapshot()
        self._step_loss: torch.Tensor | None = None
        self._escalate = False
        self._step_rerun = StepRerun(rerun_tolerance, rerun_every) if self.rerun else None
        self._faulty: Verdict | None = None  # a transient verdict: checkpoint and exit at the batch's end
        self._trained_since_snapshot = False  # a snapshot of an unchanged state would only relabel it

    # ---- Lightning hooks ------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        control = step_control(trainer)
        if control.grads_stay_scaled():
            raise UserInputError(
                "NaNRecovery cannot skip steps of a fused optimizer under Lightning's 16-mixed "
                "MixedPrecision (its gradients are still scaled in on_before_optimizer_step); use "
                "plugins=[lightning_train.plugins.AmpPrecision('16-mixed', device)] or a non-fused optimizer"
            )
        if self.rerun and data_parallel_size(trainer) != trainer.world_size:
            raise UserInputError(
                "NaNRecovery(rerun=True) reruns steps on data-parallel layouts only (ddp, fsdp, one device); "
                "this run splits the model over tensor or pipeline ranks: set rerun=false and rerun_every=0"
            )
        first, end = self._lr_scaled
        if end > first and self.lr_scale != 1:  # resumed inside a rollback's LR window
            control.scale_lr(self.lr_scale, end - first, first_step=first)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_snapshot(trainer, pl_module)  # the starting (or resumed) state is the first good one

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        healthy = self._consecutive == 0 and not self._escalate
        if step % self.snapshot_every == 0 and self._trained_since_snapshot and healthy:
            self._take_snapshot(trainer, pl_module)
        if self._step_rerun is not None:
            self._step_rerun.record(trainer, batch, batch_idx)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
                           ) -> None:
        loss = step_control(trainer).unscale_loss(loss.detach().float())  # the GradScaler multiplied it
        # With gradient accumulation Lightning has divided each loss by the number of batches: sum = mean.
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer
    ) -> None:
        step, loss, self._step_loss = trainer.global_step, self._step_loss, None
        if loss is None:  # no backward this step (training_step returned None)
            return
        control = step_control(trainer)
        norm = control.grad_norms()["total"]
        overflow = control.overflowed(optimizer)
        stats = torch.stack([loss.reshape(()), norm.float().to(loss.device), overflow.to(loss.device)])
        # One all-reduce (mean over ranks: a non-finite value anywhere stays non-finite) and one host read.
        loss_value, norm_value, overflow = trainer.strategy.reduce(stats, reduce_op="mean").tolist()
        self._recent.append([step, loss_value, norm_value])
        if overflow > 0 and math.isfinite(loss_value):
            return  # the GradScaler's own overflow: it skips, backs off and is counted by LossScaleMonitor
        reason = self._judge(loss_value, norm_value)
        verdict = (self._step_rerun.verdict(trainer, pl_module, optimizer, reason is not None, loss, norm)
                   if self._step_rerun is not None else None)
        if verdict is not None and verdict.kind == "transient":
            self._stop_for_faulty_node(trainer, optimizer, reason or "periodic rerun check", verdict)
        elif reason is None:
            self._consecutive = 0
            self._trained_since_snapshot = True
            self._losses.append(loss_value)
            self._norms.append(norm_value)
        else:
            self._skip(trainer, pl_module, optimizer, reason, loss_value, norm_value, verdict)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._faulty is not None:
            exit_faulty_node(trainer, self._faulty, self._save_with_forensics)
        if self._escalate:
            self._escalate = False
            if self.rollbacks >= self.max_rollbacks:
                self._abort(trainer, pl_module)
            self._rollback(trainer, pl_module)
        elif is_logging_step(trainer):
            self._log(trainer)

    # ---- the ladder -----------------------------------------------------------------------------
    def _judge(self, loss: float, norm: float) -> str | None:
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not math.isfinite(norm):
            return f"non-finite gradient norm ({norm})"
        z = _z_score(loss, self._losses, self.min_window)
        if z > self.spike_threshold:
            return f"loss spike ({loss:.4g}, z={z:.1f})"
        z = _z_score(norm, self._norms, self.min_window) if self.grad_norm_spikes else 0.0
        if z > self.spike_threshold:
            return f"gradient-norm spike ({norm:.4g}, z={z:.1f})"
        return None

    def _skip(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer, reason: str,
              loss: float, norm: float, verdict: Verdict | None = None) -> None:
        step = trainer.global_step
        norms = step_control(trainer).grad_norms()  # this step's, measured before the skip
        # a host read on bad steps only: the per-group norms for the forensic report
        group_norms = dict(zip(norms, torch.stack(list(norms.values())).tolist(), strict=True))
        step_control(trainer).skip(optimizer)
        self.skipped_steps += 1
        self.spikes += "spike" in reason
        self._consecutive += 1
        self._recent_skips.append(step)
        while self._recent_skips[0] <= step - self.skip_window:
            self._recent_skips.popleft()
        self._bad_steps.append({"step": step, "batch_idx": trainer.fit_loop.total_batch_idx, "reason": reason,
                                "loss": loss, "grad_norm": norm, "grad_norm_per_group": group_norms,
                                "rerun": verdict.as_dict() if verdict else None})
        said = f"{reason}; rerun: {verdict.kind} ({verdict.detail})" if verdict else reason
        self._event(step, "skip", said)
        send_alert(trainer, "NaNRecovery skipped a step", f"step {step}: {said}; parameters, optimizer, "
                   f"LR schedule and loss scale left unchanged ({self.skipped_steps} skipped so far)")
        self._escalate = (self._consecutive >= self.max_consecutive_skips
                          or len(self._recent_skips) >= self.max_skips_in_window)
        self._log(trainer)

    def _rollback(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step  # already counts the step that triggered the rollback
        self.snapshot.restore(trainer, pl_module)
        self._trained_since_snapshot = False
        self.rollbacks += 1
        self._consecutive = 0
        self._recent_skips.clear()
        skipped = skip_train_batches(trainer, self.skip_batches)  # no step, no compute, no global_step
        if skipped:
            self.skipped_data.append([step, skipped])
        detail = f"restored the snapshot of step {self.snapshot.step}; passed over the next {skipped} batches"
        if self.lr_scale_steps and self.lr_scale != 1:
            self._lr_scaled = (step, step + self.lr_scale_steps)
            step_control(trainer).scale_lr(self.lr_scale, self.lr_scale_steps)
            detail += f"; LR x{self.lr_scale} for {self.lr_scale_steps} steps"
        self._event(step, "rollback", detail)
        title = f"NaNRecovery rolled back ({self.rollbacks}/{self.max_rollbacks})"
        send_alert(trainer, title, detail, "ERROR")
        self._log(trainer)

    def _abort(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        self.snapshot.restore(trainer, pl_module)
        reason = (f"{self.max_rollbacks} rollbacks did not stop the bad steps "
                  f"(last: {self._bad_steps[-1]['reason'] if self._bad_steps else 'n/a'})")
        self._event(step, "abort", f"{reason}; saved the snapshot of step {self.snapshot.step}")
        name = f"nan-recovery-abort-step={step}.ckpt"
        checkpoint, forensics = self._save_with_forensics(trainer, name, reason)
        send_alert(trainer, "NaNRecovery aborted training", f"{reason}; checkpoint {checkpoint}, "
                   f"forensics {forensics}", "ERROR")
        raise TrainingAborted(
            f"training aborted at step {step}: {reason}; last good state (step {self.snapshot.step}) "
            f"saved to {checkpoint}, forensics in {forensics}", checkpoint, forensics,
        )

    def _stop_for_faulty_node(self, trainer: L.Trainer, optimizer: Optimizer, reason: str,
                              verdict: Verdict) -> None:
        step_control(trainer).skip(optimizer)  # the machine's result is not to be trusted: keep the state
        self._bad_steps.append({"step": trainer.global_step, "batch_idx": trainer.fit_loop.total_batch_idx,
                                "reason": reason, "rerun": verdict.as_dict()})
        self._event(trainer.global_step, "rerun", f"{verdict.kind}: {verdict.detail}")
        self._faulty = verdict

    # ---- helpers --------------------------------------------------------------------------------
    @property
    def reruns(self) -> int:
        """Steps rerun so far: bad ones, and healthy ones under ``rerun_every``."""
        return self._step_rerun.runs if self._step_rerun is not None else 0

    def _save_with_forensics(self, trainer: L.Trainer, name: str, reason: str) -> tuple[Path | str, Path]:
        settings = {key: getattr(self, key) for key in _SETTINGS}
        return save_with_forensics(trainer, name, reason, self.state_dict(), settings)

    def _take_snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.snapshot.take(trainer, pl_module)
        self._trained_since_snapshot = False

    def _event(self, step: int, action: str, detail: str) -> None:
        self._events.append({"step": step, "action": action, "detail": detail})

    def _log(self, trainer: L.Trainer) -> None:
        metrics = {"recovery/skipped_steps": self.skipped_steps, "recovery/spikes": self.spikes,
                   "recovery/rollbacks": self.rollbacks,
                   "recovery/skipped_batches": sum(batches for _, batches in self.skipped_data)}
        if self.rerun:  # a counter that can only stay 0 would be noise on every dashboard
            metrics["recovery/reruns"] = self.reruns
        log_metrics(trainer, metrics)

    # ---- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps, "spikes": self.spikes, "rollbacks": self.rollbacks,
            "reruns": self.reruns, "skipped_data": self.skipped_data, "consecutive": self._consecutive,
            "lr_scaled": list(self._lr_scaled), "snapshot_step": self.snapshot.step,
            **{name: list(getattr(self, f"_{name}")) for name in _HISTORIES},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps, self.spikes = state_dict["skipped_steps"], state_dict["spikes"]
        self.rollbacks, self._consecutive = state_dict["rollbacks"], state_dict["consecutive"]
        if self._step_rerun is not None:
            self._step_rerun.runs = state_dict["reruns"]
        self.skipped_data = [list(r) for r in state_dict["skipped_data"]]
        self._lr_scaled = tuple(state_dict["lr_scaled"])
        for name in _HISTORIES:
            getattr(self, f"_{name}").extend(state_dict[name])
        # The host snapshot itself is not in checkpoints: on resume the restored state is the first one.


def _z_score(value: float, window: deque[float], min_window: int) -> float:
    if len(window) < min_window:
        return 0.0
    mean = sum(window) / len(window)
    std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
    return (value - mean) / max(std, 1e-3 * abs(mean), 1e-12)  # a floor, so a flat window does not flag noise

