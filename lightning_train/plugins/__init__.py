"""Lightning plugins: ``AmpPrecision`` (mixed precision with real loss scaling on every device) and the
Trainer's step object, ``step_control(trainer)``: whether a step is taken, the LR schedule over skipped
steps, the loss scale and the step's gradient norm (``lightning_train.plugins.step``).
The checkpoint plugin, ``AtomicCheckpointIO``, lives in ``lightning_train.checkpoint``."""

from lightning_train.plugins.precision import AmpPrecision
from lightning_train.plugins.step import step_control

__all__ = ["AmpPrecision", "step_control"]
