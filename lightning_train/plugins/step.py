"""The step object: the one place that decides whether an optimizer step is taken.

Every Trainer has one ``StepControl``, reached with ``step_control(trainer)``. Callbacks and the precision
plugin ask it; none of them touches the GradScaler, the LR schedulers or the gradients' norm directly.

* **Skipping.** ``skip(optimizer)``: this step changes nothing. Every gradient of the optimizer is dropped
  (``grad = None``, which any torch optimizer skips entirely: no moment update, no step count, no weight
  decay — unlike zeroing, since NaN * 0 is NaN), the LR schedule holds and the GradScaler is left as it
  was. Call it on every rank, after backward and before the step (``on_before_optimizer_step``). The
  GradScaler's own overflow steps are skipped the same way (``take_step``, which ``AmpPrecision`` calls).
* **The LR schedule.** It counts each optimizer's real steps (a step post-hook: free, no host sync) and,
  once per fit, wraps the Trainer's LR schedulers so that they step only after a real step of their
  optimizer; checkpoints keep each scheduler's plain ``state_dict``. ``scale_lr(factor, steps)``: the next
  ``steps`` optimizer steps use ``lr * factor``, the schedule itself undisturbed.
* **The loss scale.** ``scale_loss``, ``unscale_loss``, ``unscale_``, ``loss_scale`` and ``overflowed``
  apply, remove and read the precision plugin's GradScaler (a no-op without one: fp32, bf16).
* **The gradient norm.** ``grad_norms()`` measures this step's pre-clip norms once (``GradNorms``, over
  every shard, stage and tied weight) and ``clip_grad_norm_`` clips by that same total.

``trainer.global_step`` counts optimizer steps *attempted*, skipped ones included (as Megatron and
DeepSpeed do): their forward and backward ran, so ``max_steps``, logging, validation and checkpoint
intervals count them. The LR schedule follows the real steps.
"""

from __future__ import annotations

import weakref
from typing import Any

import lightning as L
import torch
from torch.optim import Optimizer

from lightning_train._compat import found_inf_per_device, handles_amp_scaling, loss_scale_async
from lightning_train.plugins.grad_norm import GradNorms, local_tensor


class StepControl:
    """Decides whether each optimizer step is taken; holds the LR schedulers over skipped steps, applies and
    removes the loss scale, and measures the gradient norm once a step. Get it with ``step_control``.

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
        >>> step_control(trainer) is step_control(trainer)  # one per Trainer
        True
        >>> adam_steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
        >>> trainer.global_step, adam_steps, trainer.lr_scheduler_configs[0].scheduler.last_epoch
        (3, {2}, 2)
    """

    def __init__(self, trainer: L.Trainer) -> None:
        self._trainer = weakref.ref(trainer)  # the Trainer keeps its control, not the other way round
        self._optimizers: list[Optimizer] = []  # the ones the hooks below are registered on
        self._hooks: list[Any] = []
        self._real_steps: dict[int, int] = {}  # id(optimizer) -> real steps taken
        self._skipped_at: dict[int, int] = {}  # id(optimizer) -> global_step of the skipped step
        self._lr_window: tuple[float, int, int] = (1.0, 0, 0)  # factor, [first, end) global steps
        self._scheduled_lrs: dict[int, list[Any]] = {}  # id(optimizer) -> LRs put aside during a step
        self._grad_norms = GradNorms()  # the Trainer's measurement (a GradNormMonitor may share its own)
        self._shared = False
        self._norms_of_step: dict[GradNorms, dict[str, torch.Tensor]] = {}
        self._norms_key: tuple[int, int] | None = None  # (global_step, batch) of _norms_of_step
        self._clip_norms: dict[float, GradNorms] = {}  # for a clipping norm_type no measurement uses

    @property
    def trainer(self) -> L.Trainer:
        trainer = self._trainer()
        assert trainer is not None, "StepControl outlived its Trainer"
        return trainer

    # ---- whether the step is taken -------------------------------------------------------------
    def skip(self, optimizer: Optimizer) -> None:
        """Make the current step of ``optimizer`` change nothing (see the module docstring)."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        self._skipped_at[id(optimizer)] = self.trainer.global_step

    def skipped(self, optimizer: Optimizer) -> bool:
        """Whether the current step of ``optimizer`` was skipped."""
        return self._skipped_at.get(id(optimizer)) == self.trainer.global_step

    def take_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Under loss scaling: step ``optimizer`` (gradients already unscaled) unless the step was skipped or
        the GradScaler found inf/NaN gradients, which skips it too and backs the scale off. A step skipped
        by a callback leaves the scaler exactly as it was (scale, growth tracker)."""
        scaler = self.scaler
        assert scaler is not None, "take_step is the loss-scaled step; without a scaler, call optimizer.step"
        if self.skipped(optimizer):
            scaler.update(loss_scale_async(scaler))
            return None
        if self.overflowed(optimizer).item():  # the one host read (FSDP2's DTensor grads: over the mesh)
            self.skip(optimizer)
            scaler.update()  # backs the scale off
            return None
        output = optimizer.step(**kwargs)  # gradients are unscaled and finite: a plain step (fused too)
        scaler.update()
        return output

    def scale_lr(self, factor: float, steps: int, first_step: int | None = None) -> None:
        """Multiply the LR of the optimizer steps ``first_step .. first_step + steps - 1`` (``global_step``
        numbering; default: from the current step) by ``factor``. A new request replaces the previous one."""
        first = self.trainer.global_step if first_step is None else first_step
        self._lr_window = (factor, first, first + steps)

    @property
    def lr_window(self) -> tuple[float, int, int]:
        """``(factor, first, end)``: the steps ``first <= global_step < end`` use ``lr * factor``."""
        return self._lr_window

    def real_steps(self, optimizer_id: int) -> int:
        """The real (not skipped) steps the optimizer with this ``id`` took in this fit."""
        return self._real_steps[optimizer_id]

    # ---- the loss scale --------------------------------------------------------------------------
    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The precision plugin's enabled GradScaler (fp16), else None."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def loss_scale(self) -> torch.Tensor | None:
        """The current loss scale as a 0-d device tensor (no host sync), or None without a scaler or
        before its first ``scale``."""
        scaler = self.scaler
        return loss_scale_async(scaler) if scaler is not None else None  # no public sync-free accessor

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, ready for backward."""
        scaler = self.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss the scale has been applied to, divided by it again."""
        scale = self.loss_scale()
        return loss / scale if scale is not None else loss

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide this step's gradients of ``optimizer`` by the loss scale (once a step, before the hooks)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def unscale_grads_(self, grads: list[torch.Tensor]) -> None:
        """Divide ``grads`` by the loss scale outside the scaler's bookkeeping (a rerun's second backward):
        times the reciprocal, as the GradScaler does (a power of 2: exact)."""
        scale = self.loss_scale()
        if scale is not None:
            inverse = scale.double().reciprocal().float()
            for grad in grads:
                grad.mul_(inverse.to(grad.device))

    def overflowed(self, optimizer: Optimizer) -> torch.Tensor:
        """1.0 if the GradScaler found inf/NaN in this step's (scaled) gradients of ``optimizer``, else 0.0:
        a 0-d float tensor on the device, no host sync."""
        found = found_inf_per_device(self.scaler, optimizer) if self.scaler is not None else []
        if not found:
            return torch.zeros((), device=self.trainer.strategy.root_device)
        device = found[0].device
        return (sum(t.to(device) for t in found) > 0).float()

    def grads_stay_scaled(self) -> bool:
        """Whether gradients reach ``on_before_optimizer_step`` still multiplied by the loss scale, and the
        scaler's skipped steps still advance the LR schedule: Lightning's own mixed precision with a fused
        optimizer (``AmpPrecision`` unscales first)."""
        plugin = self.trainer.precision_plugin
        fused = any(handles_amp_scaling(optimizer) for optimizer in self.trainer.optimizers)
        return self.scaler is not None and fused and not getattr(plugin, "unscales_fused_optimizers", False)

    # ---- the gradient norm -----------------------------------------------------------------------
    def share_grad_norms(self, measurement: GradNorms) -> None:
        """Make ``measurement`` (a ``GradNormMonitor``'s groups and norm type) the one this Trainer's
        ``grad_norms()`` and clipping read, for the rest of this fit (the first one shared wins)."""
        if not self._shared:
            self._grad_norms, self._shared = measurement, True

    def grad_norms(self, measurement: GradNorms | None = None) -> dict[str, torch.Tensor]:
        """This optimizer step's pre-clip gradient norms of the LightningModule, ``{"<group>": ...,
        "total": ...}`` (0-d device tensors, no host sync), measured once a step however many ask (call it
        in ``on_before_optimizer_step``, on every rank: sharded or pipelined, it is a collective).
        ``measurement``: another grouping or norm type than the shared one."""
        measurement = measurement or self._grad_norms
        trainer = self.trainer
        key = (trainer.global_step, trainer.fit_loop.total_batch_idx)
        if key != self._norms_key:
            self._norms_of_step, self._norms_key = {}, key
        if measurement not in self._norms_of_step:
            self._norms_of_step[measurement] = self._measure(measurement)
        return self._norms_of_step[measurement]

    def measure_grad_norms(self) -> dict[str, torch.Tensor]:
        """The gradient norms as they are now, not the step's kept ones (a rerun's second backward)."""
        return self._measure(self._grad_norms)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient of the LightningModule to a total ``norm_type`` norm of ``max_norm`` (the
        norm over all shards and stages) and return the norm before clipping, the same on every rank."""
        measurement = self._grad_norms
        if measurement.norm_type != float(norm_type):
            measurement = self._clip_norms.setdefault(float(norm_type), GradNorms(norm_type=norm_type))
        norm = self.grad_norms(measurement)["total"]
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ formula
        with torch.no_grad():
            for param in self.trainer.lightning_module.parameters():
                if param.grad is not None:  # a tied embedding's second copy too: it steps as well
                    local_tensor(param.grad).mul_(coefficient.to(param.grad.device))
        return norm

    def _measure(self, measurement: GradNorms) -> dict[str, torch.Tensor]:
        trainer = self.trainer
        return measurement.measure(trainer.lightning_module, getattr(trainer.strategy, "pipeline", None))

    # ---- the state a rollback restores -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The LR schedulers' and the precision plugin's (GradScaler's) state, plain dicts."""
        return {"lr_schedulers": [c.scheduler.state_dict() for c in self.trainer.lr_scheduler_configs],
                "precision": self.trainer.precision_plugin.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for config, scheduler_state in zip(self.trainer.lr_scheduler_configs, state["lr_schedulers"],
                                           strict=True):
            config.scheduler.load_state_dict(scheduler_state)
        if state["precision"]:
            self.trainer.precision_plugin.load_state_dict(state["precision"])

    # ---- wiring into the Trainer -----------------------------------------------------------------
    def _attach(self) -> None:
        """Once per fit (a new set of optimizers): hook into the optimizers and wrap the LR schedulers."""
        trainer = self.trainer
        if [id(o) for o in trainer.optimizers] == [id(o) for o in self._optimizers]:
            return
        for hook in self._hooks:
            hook.remove()
        self._optimizers, self._hooks = list(trainer.optimizers), []
        self._real_steps, self._skipped_at, self._scheduled_lrs = {}, {}, {}
        self._grad_norms, self._shared, self._norms_of_step, self._norms_key = GradNorms(), False, {}, None
        for optimizer in self._optimizers:
            self._real_steps[id(optimizer)] = 0
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
            self._hooks.append(optimizer.register_step_post_hook(self._after_step))
        for config in trainer.lr_scheduler_configs:
            optimizer = getattr(config.scheduler, "optimizer", None)
            if not isinstance(config.scheduler, _HeldLRScheduler) and id(optimizer) in self._real_steps:
                config.scheduler = _HeldLRScheduler(config.scheduler, self, id(optimizer))

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        factor, first, end = self._lr_window
        if factor != 1 and first <= self.trainer.global_step < end:
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


_CONTROLS: weakref.WeakKeyDictionary[L.Trainer, StepControl] = weakref.WeakKeyDictionary()


def step_control(trainer: L.Trainer) -> StepControl:
    """The Trainer's one ``StepControl``, hooked into its current optimizers and LR schedulers."""
    control = _CONTROLS.get(trainer)
    if control is None:
        control = _CONTROLS[trainer] = StepControl(trainer)
    control._attach()
    return control
