"""Lightning plugins: ``AmpPrecision`` (mixed precision with real loss scaling on every device) and the
step-control object through which callbacks skip a step or scale the LR (``step_control(trainer)``)."""

from lightning_train.plugins.checkpoint_io import AtomicCheckpointIO
from lightning_train.plugins.precision import AmpPrecision
from lightning_train.plugins.step_control import StepControl, step_control

__all__ = ["AmpPrecision", "AtomicCheckpointIO", "StepControl", "step_control"]
