"""Mixed precision with real loss scaling on every device, and optimizer steps that can be skipped cleanly.

``AmpPrecision`` is Lightning's ``MixedPrecision`` with three fixes:

* ``16-mixed`` gets a real ``torch.amp.GradScaler`` on every device (Lightning turns ``16-mixed`` on CPU
  into ``bf16-mixed``), with its settings configurable from YAML;
* gradients are always unscaled before ``on_before_optimizer_step``, fused optimizers included (Lightning
  leaves them scaled for fused AdamW, so callbacks and gradient clipping would see scaled values);
* a step the scaler skips (inf/NaN gradients) holds the LR schedulers (Lightning advances them).

Whether the step is taken is not decided here: the plugin asks the Trainer's ``StepControl``
(``lightning_train.plugins.step``), which skips the scaler's overflow steps and the steps a callback
skipped (``NaNRecovery``) the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import LBFGS, Optimizer

from lightning_train._compat import after_closure
from lightning_train.errors import UserInputError
from lightning_train.plugins.step import step_control


class AmpPrecision(MixedPrecision):
    """Automatic mixed precision: ``torch.autocast`` plus, for ``16-mixed``, a real GradScaler.

    Args:
        precision: ``"16-mixed"`` (float16 autocast with loss scaling) or ``"bf16-mixed"`` (no scaling).
        device: the autocast/GradScaler device type: ``"cuda"`` or ``"cpu"``.
        init_scale, growth_factor, backoff_factor, growth_interval: ``torch.amp.GradScaler``'s settings.

    Example (float16 with loss scaling on the CPU, where Lightning would switch to bfloat16):

        >>> import lightning as L
        >>> from lightning_train import GPTConfig, PretrainModule, TextDataModule
        >>> from lightning_train.plugins import AmpPrecision
        >>> plugin = AmpPrecision("16-mixed", device="cpu", init_scale=1024.0, growth_interval=2)
        >>> trainer = L.Trainer(
        ...     max_steps=4, accelerator="cpu", limit_val_batches=0, logger=False, plugins=[plugin],
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> module = PretrainModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        >>> trainer.fit(module, TextDataModule(seq_len=16, batch_size=4))
        >>> plugin.scaler.get_scale()  # doubled after every 2 steps without inf/NaN gradients
        4096.0
        >>> {p.dtype for p in module.parameters()}  # the weights stay float32
        {torch.float32}
    """

    unscales_fused_optimizers = True  # read by StepControl.grads_stay_scaled

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
        if self.scaler is None:  # bf16: nothing to unscale; Lightning's path (closure inside step())
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise UserInputError("AmpPrecision: 16-mixed loss scaling does not work with LBFGS; use 32-true")
        control = step_control(model.trainer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # training_step returned None
            after_closure(self, model, optimizer)
            return None
        control.unscale_(optimizer)  # before the hooks, fused optimizers included
        after_closure(self, model, optimizer)  # on_before_optimizer_step callbacks, then clipping
        return control.take_step(optimizer, **kwargs)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Gradients are always unscaled here, so fused optimizers can be clipped (Lightning refuses).
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


def amp_for_precision_flag(precision: Any, accelerator: Any) -> AmpPrecision | None:
    """``AmpPrecision`` for a Trainer's ``precision="16-mixed"`` flag (None for other flags), on the
    device type ``accelerator`` ("cpu", "gpu", "cuda", "auto" or an Accelerator) trains on."""
    if str(precision) not in ("16-mixed", "16"):
        return None
    on_cpu = accelerator == "cpu" or isinstance(accelerator, CPUAccelerator) or not torch.cuda.is_available()
    return AmpPrecision("16-mixed", "cpu" if on_cpu else "cuda")

