"""Training-health callbacks; each works in any Lightning Trainer."""

from lightning_train.callbacks.grad_norm import GradNormMonitor
from lightning_train.callbacks.loss_scale import LossScaleMonitor
from lightning_train.callbacks.nan_recovery import NaNRecovery, TrainingAborted
from lightning_train.callbacks.preemption import PreemptionCheckpoint
from lightning_train.callbacks.progress import TokenProgressBar
from lightning_train.callbacks.rng_state import RNGStateKeeper
from lightning_train.callbacks.run_summary import RunSummary
from lightning_train.callbacks.step_axis import StepAxisKeeper
from lightning_train.callbacks.throughput import ThroughputMonitor
from lightning_train.callbacks.time_to_quality import TimeToQuality

__all__ = [
    "GradNormMonitor",
    "LossScaleMonitor",
    "NaNRecovery",
    "PreemptionCheckpoint",
    "RNGStateKeeper",
    "RunSummary",
    "StepAxisKeeper",
    "ThroughputMonitor",
    "TimeToQuality",
    "TokenProgressBar",
    "TrainingAborted",
]
