"""Lightning plugins: ``AmpPrecision`` (mixed precision with real loss scaling on every device) and the
step-control object through which callbacks skip a step or scale the LR (``step_control(trainer)``).
The checkpoint plugin, ``AtomicCheckpointIO``, lives in ``lightning_train.checkpoint``."""

from lightning_train.plugins.precision import AmpPrecision
from lightning_train.plugins.step_control import StepControl, step_control

__all__ = ["AmpPrecision", "StepControl", "step_control"]
