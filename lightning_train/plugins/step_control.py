"""The step-control object: the one place where callbacks skip an optimizer step or scale the LR.

Every Trainer has one ``StepControl``, reached with ``step_control(trainer)``. It lives on the Trainer's
precision plugin: ``AmpPrecision`` creates its own, and for any other plugin (Lightning's ``Precision``,
``MixedPrecision``, ...) ``step_control`` creates one on first use and keeps it there. Callbacks ask it:

* ``skip(optimizer)``: this step changes nothing. Every gradient of the optimizer is dropped
  (``grad = None``, which any torch optimizer skips entirely: no moment update, no step count, no weight
  decay — unlike zeroing, since NaN * 0 is NaN), the LR schedule holds and ``AmpPrecision`` leaves the
  GradScaler as it was. Call it on every rank, after backward and before the step
  (``on_before_optimizer_step``). The GradScaler's own overflow steps go through it too.
* ``scale_lr(factor, steps)``: the next ``steps`` optimizer steps use ``lr * factor``; the schedule
  itself is not disturbed (the scheduled LR is back right after each step).

It alone holds the LR schedule over skipped steps: it counts each optimizer's real steps (a step
post-hook: free, no host sync) and wraps the Trainer's LR schedulers so that they step only after a real
step of their optimizer; checkpoints keep each scheduler's plain ``state_dict``.

``trainer.global_step`` counts optimizer steps *attempted*, skipped ones included (as Megatron and
DeepSpeed do): their forward and backward ran, so ``max_steps``, logging, validation and checkpoint
intervals count them. The LR schedule follows the real steps.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.optim import Optimizer


class StepControl:
    """Skips optimizer steps and scales the LR on request; holds the LR schedulers over skipped steps.

    Example (a callback skips the second of three steps):

        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.plugins import step_control
        >>> class SkipSecondStep(L.Callback):
        ...     def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ...         if trainer.global_step == 1:
        ...             step_control(trainer).skip(optimizer)
        >>> trainer = L.Trainer(
        ...     max_steps=3, accelerator="cpu", limit_val_batches=0, logger=False, enable_progress_bar=False,
        ...     enable_checkpointing=False, enable_model_summary=False, callbacks=[SkipSecondStep()],
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> step_control(trainer) is trainer.precision_plugin.step_control  # one per Trainer
        True
        >>> adam_steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
        >>> trainer.global_step, adam_steps, trainer.lr_scheduler_configs[0].scheduler.last_epoch
        (3, {2}, 2)
    """

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._optimizers: list[Optimizer] = []  # the ones the hooks below are registered on
        self._hooks: list[Any] = []
        self._real_steps: dict[int, int] = {}  # id(optimizer) -> real steps taken
        self._skipped_at: dict[int, int] = {}  # id(optimizer) -> global_step of the skipped step
        self._lr_window: tuple[float, int, int] = (1.0, 0, 0)  # factor, [first, end) global steps
        self._scheduled_lrs: dict[int, list[Any]] = {}  # id(optimizer) -> LRs put aside during a step

    # ---- what callbacks ask for ----------------------------------------------------------------
    def skip(self, optimizer: Optimizer) -> None:
        """Make the current step of ``optimizer`` change nothing (see the module docstring)."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        self._skipped_at[id(optimizer)] = self._global_step()

    def skipped(self, optimizer: Optimizer) -> bool:
        """Whether the current step of ``optimizer`` was skipped."""
        return self._skipped_at.get(id(optimizer)) == self._global_step()

    def scale_lr(self, factor: float, steps: int, first_step: int | None = None) -> None:
        """Multiply the LR of the optimizer steps ``first_step .. first_step + steps - 1`` (``global_step``
        numbering; default: from the current step) by ``factor``. A new request replaces the previous one."""
        first = self._global_step() if first_step is None else first_step
        self._lr_window = (factor, first, first + steps)

    @property
    def lr_window(self) -> tuple[float, int, int]:
        """``(factor, first, end)``: the steps ``first <= global_step < end`` use ``lr * factor``."""
        return self._lr_window

    # ---- wiring into the Trainer ---------------------------------------------------------------
    def attach(self, trainer: L.Trainer) -> None:
        """Hook into ``trainer``'s optimizers and wrap its LR schedulers. Idempotent and cheap (called every
        step); a new set of optimizers (a new ``fit``) is hooked afresh."""
        self._trainer = trainer
        if [id(o) for o in trainer.optimizers] != [id(o) for o in self._optimizers]:
            for hook in self._hooks:
                hook.remove()
            self._optimizers, self._hooks = list(trainer.optimizers), []
            self._real_steps, self._skipped_at, self._scheduled_lrs = {}, {}, {}
            for optimizer in self._optimizers:
                self._real_steps[id(optimizer)] = 0
                self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
                self._hooks.append(optimizer.register_step_post_hook(self._after_step))
        for config in trainer.lr_scheduler_configs:
            optimizer = getattr(config.scheduler, "optimizer", None)
            if not isinstance(config.scheduler, _HeldLRScheduler) and id(optimizer) in self._real_steps:
                config.scheduler = _HeldLRScheduler(config.scheduler, self, id(optimizer))

    def real_steps(self, optimizer_id: int) -> int:
        return self._real_steps[optimizer_id]

    def _global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        factor, first, end = self._lr_window
        if factor != 1 and first <= self._global_step() < end:
            self._scheduled_lrs[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor  # a new object: the scheduled value stays intact

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Put the scheduled LRs back before the scheduler computes the next ones (chainable schedulers
        # read the current LR).
        scheduled = self._scheduled_lrs.pop(id(optimizer), None)
        for group, lr in zip(optimizer.param_groups, scheduled or [], strict=False):
            group["lr"] = lr
        # Lightning's own paths call step() even on a skipped step (the closure runs inside it), with
        # every gradient dropped: that call changes nothing and is not a real step.
        if not self.skipped(optimizer):
            self._real_steps[id(optimizer)] += 1


class _HeldLRScheduler:
    """An LR scheduler that does not advance over skipped optimizer steps: ``step()`` steps the wrapped
    scheduler only if its optimizer took a real step since the last ``step()``. Everything else
    (``state_dict``, ``get_last_lr``, ``optimizer``, ...) is the wrapped scheduler's."""

    def __init__(self, scheduler: Any, control: StepControl, optimizer_id: int) -> None:
        self.scheduler = scheduler
        self._control, self._optimizer_id = control, optimizer_id
        self._seen_steps = control.real_steps(optimizer_id)

    def step(self, *args: Any, **kwargs: Any) -> None:
        real_steps = self._control.real_steps(self._optimizer_id)
        if real_steps == self._seen_steps:
            return  # every optimizer step since the last call was skipped
        self._seen_steps = real_steps
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_control", "_optimizer_id", "_seen_steps"):  # not set yet (copy/unpickle)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"HeldLRScheduler({self.scheduler!r})"


def step_control(trainer: L.Trainer) -> StepControl:
    """The Trainer's one ``StepControl``, hooked into its current optimizers and schedulers."""
    plugin = trainer.precision_plugin
    control = getattr(plugin, "step_control", None)
    if control is None:  # a plugin other than AmpPrecision: the control is created once, kept on it
        control = plugin.step_control = StepControl()
    control.attach(trainer)
    return control
