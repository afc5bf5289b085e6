"""Mixed precision with real loss scaling on every device, and optimizer steps that can be skipped cleanly.

``AmpPrecision`` is Lightning's ``MixedPrecision`` with three fixes:

* ``16-mixed`` gets a real ``torch.amp.GradScaler`` on every device (Lightning turns ``16-mixed`` on CPU
  into ``bf16-mixed``), with its settings configurable from YAML;
* gradients are always unscaled before ``on_before_optimizer_step``, fused optimizers included (Lightning
  leaves them scaled for fused AdamW, so callbacks and gradient clipping would see scaled values);
* a step the scaler skips (inf/NaN gradients) holds the LR schedulers (Lightning advances them).

Skipping a step is one mechanism shared by the scaler and by ``NaNRecovery``: ``skip_optimizer_step``.
A skipped step changes nothing: every gradient of the optimizer is dropped (``grad = None``, which any
torch optimizer skips entirely: no moment update, no step count, no weight decay — unlike zeroing, since
NaN * 0 is NaN), and the LR schedulers of that optimizer are held. Schedulers are held by
``HeldLRScheduler``, a thin wrapper that steps the real scheduler only if its optimizer took a real step
since the scheduler's last step (counted by an optimizer step post-hook: free, no host sync);
checkpoints keep the wrapped scheduler's plain ``state_dict``.

    >>> import lightning as L
    >>> from lightning_train.plugins import AmpPrecision
    >>> plugin = AmpPrecision("16-mixed", device="cpu", init_scale=1024.0, growth_interval=100)
    >>> trainer = L.Trainer(plugins=[plugin], accelerator="cpu", max_steps=10)  # doctest: +SKIP
    >>> plugin.scaler.get_scale()
    1024.0

``trainer.global_step`` counts optimizer steps *attempted*, skipped ones included (as Megatron and
DeepSpeed do): ``max_steps``, logging, validation and checkpoint intervals keep following the data.
The LR schedule follows the real steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import LBFGS, Optimizer

from lightning_train.errors import UserInputError


class AmpPrecision(MixedPrecision):
    """Automatic mixed precision: ``torch.autocast`` plus, for ``16-mixed``, a real GradScaler.

    Args:
        precision: ``"16-mixed"`` (float16 autocast with loss scaling) or ``"bf16-mixed"`` (no scaling).
        device: the autocast/GradScaler device type: ``"cuda"`` or ``"cpu"``.
        init_scale, growth_factor, backoff_factor, growth_interval: ``torch.amp.GradScaler``'s settings.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise UserInputError(f"AmpPrecision precision={precision!r}: use '16-mixed' or 'bf16-mixed'")
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise UserInputError(
                f"AmpPrecision(init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}): need init_scale > 0, "
                "growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1"
            )
        scaler = None
        if precision == "16-mixed":
            scaler = torch.amp.GradScaler(
                device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            )
        super().__init__(precision, device, scaler)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: L.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(model, L.LightningModule):
            hold_lr_schedulers_on_skipped_steps(model.trainer)
        if self.scaler is None:  # bf16: nothing to unscale; Lightning's path (closure inside step())
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise UserInputError("AmpPrecision: 16-mixed loss scaling does not work with LBFGS; use 32-true")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # training_step returned None
            self._after_closure(model, optimizer)
            return None
        self.scaler.unscale_(optimizer)  # before the hooks, fused optimizers included
        self._after_closure(model, optimizer)  # on_before_optimizer_step callbacks, then clipping
        trainer = model.trainer
        if skip_requested(trainer, optimizer):
            # Skipped by a callback (NaNRecovery): the scaler stays exactly as it was (scale, growth tracker).
            self.scaler.update(self.scaler._get_scale_async())
            return None
        found_inf = sum(self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if found_inf.item():  # the one host read; FSDP2's DTensor grads reduce found_inf over the mesh
            skip_optimizer_step(trainer, optimizer)
            self.scaler.update()  # backs the scale off
            return None
        output = optimizer.step(**kwargs)  # gradients are unscaled and finite: a plain step (fused too)
        self.scaler.update()
        return output

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Gradients are always unscaled here, so fused optimizers can be clipped (Lightning refuses).
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


# ---- skipping an optimizer step -------------------------------------------------------------------------


class _StepCounter:
    """Counts the real steps of one optimizer (a step post-hook) and remembers a requested skip."""

    def __init__(self, trainer: L.Trainer, optimizer: Optimizer) -> None:
        self._trainer = weakref.ref(trainer)
        self.real_steps = 0
        self.skipped_at: int | None = None  # trainer.global_step of the step skip_optimizer_step dropped
        optimizer.register_step_post_hook(self._after_step)

    def skip_requested(self) -> bool:
        trainer = self._trainer()
        return trainer is not None and self.skipped_at == trainer.global_step

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Lightning's own paths call step() even on a skipped step (the closure runs inside it), with
        # every gradient dropped: that call changes nothing and is not a real step.
        if not self.skip_requested():
            self.real_steps += 1


_COUNTERS: weakref.WeakKeyDictionary[Optimizer, _StepCounter] = weakref.WeakKeyDictionary()


class HeldLRScheduler:
    """An LR scheduler that does not advance over skipped optimizer steps.

    ``step()`` steps the wrapped scheduler only if its optimizer took a real step since the last
    ``step()``; everything else (``state_dict``, ``get_last_lr``, ``optimizer``, ...) is the wrapped
    scheduler's, so checkpoints hold its plain state.
    """

    def __init__(self, scheduler: Any, counter: _StepCounter) -> None:
        self.scheduler = scheduler
        self._counter = counter
        self._seen_steps = counter.real_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._counter.real_steps == self._seen_steps:
            return  # every optimizer step since the last call was skipped
        self._seen_steps = self._counter.real_steps
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_counter", "_seen_steps"):  # not set yet (copy/unpickle)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"HeldLRScheduler({self.scheduler!r})"


def hold_lr_schedulers_on_skipped_steps(trainer: L.Trainer) -> None:
    """Count the real steps of the Trainer's optimizers and wrap its LR schedulers in ``HeldLRScheduler``.
    Idempotent and cheap; ``AmpPrecision``, ``NaNRecovery`` and ``LossScaleMonitor`` call it."""
    for optimizer in trainer.optimizers:
        if optimizer not in _COUNTERS:
            _COUNTERS[optimizer] = _StepCounter(trainer, optimizer)
    for config in trainer.lr_scheduler_configs:
        optimizer = getattr(config.scheduler, "optimizer", None)
        if not isinstance(config.scheduler, HeldLRScheduler) and optimizer in _COUNTERS:
            config.scheduler = HeldLRScheduler(config.scheduler, _COUNTERS[optimizer])


def skip_optimizer_step(trainer: L.Trainer, optimizer: Optimizer) -> None:
    """Make the current step of ``optimizer`` change nothing: its gradients are dropped (whether or not
    ``step()`` still runs, parameters and optimizer state stay bit-identical) and its LR schedulers hold.
    Call it on every rank, after backward and before the step (e.g. in ``on_before_optimizer_step``)."""
    hold_lr_schedulers_on_skipped_steps(trainer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
    _COUNTERS[optimizer].skipped_at = trainer.global_step


def skip_requested(trainer: L.Trainer, optimizer: Optimizer) -> bool:
    """Whether ``skip_optimizer_step`` dropped the current step of ``optimizer``."""
    counter = _COUNTERS.get(optimizer)
    return counter is not None and counter.skip_requested()


def amp_for_precision_flag(precision: Any, accelerator: Any) -> AmpPrecision | None:
    """``AmpPrecision`` for a Trainer's ``precision="16-mixed"`` flag (None for other flags), on the
    device type ``accelerator`` ("cpu", "gpu", "cuda", "auto" or an Accelerator) trains on."""
    if str(precision) not in ("16-mixed", "16"):
        return None
    on_cpu = accelerator == "cpu" or isinstance(accelerator, CPUAccelerator) or not torch.cuda.is_available()
    return AmpPrecision("16-mixed", "cpu" if on_cpu else "cuda")


def loss_scale_tensor(trainer: L.Trainer) -> torch.Tensor | None:
    """The current loss scale of the Trainer's GradScaler as a 0-d device tensor (no host sync), or
    None without an enabled scaler (fp32, bf16) or before its first ``scale()``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler._get_scale_async()  # GradScaler has no public sync-free accessor
