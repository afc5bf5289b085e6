"""Training-health callbacks; each works in any Lightning Trainer."""

from lightning_train.callbacks.data_mixture import DataMixtureMonitor
from lightning_train.callbacks.downstream_eval import DownstreamEval
from lightning_train.callbacks.global_batch import GlobalBatch
from lightning_train.callbacks.goodput import GoodputMonitor
from lightning_train.callbacks.grad_norm import GradNormMonitor
from lightning_train.callbacks.hang_watchdog import HangWatchdog
from lightning_train.callbacks.loss_scale import LossScaleMonitor
from lightning_train.callbacks.nan_recovery import NaNRecovery
from lightning_train.callbacks.periodic_checkpoint import PeriodicCheckpoint
from lightning_train.callbacks.preemption import PreemptionCheckpoint
from lightning_train.callbacks.progress import TokenProgressBar
from lightning_train.callbacks.rng_state import RNGStateKeeper
from lightning_train.callbacks.run_summary import RunSummary
from lightning_train.callbacks.step_axis import StepAxisKeeper
from lightning_train.callbacks.straggler import StragglerMonitor
from lightning_train.callbacks.throughput import ThroughputMonitor
from lightning_train.callbacks.time_to_quality import TimeToQuality
from lightning_train.errors import TrainingAborted  # its home is errors.py; docs/recovery.md imports it here

__all__ = [
    "DataMixtureMonitor",
    "DownstreamEval",
    "GlobalBatch",
    "GoodputMonitor",
    "GradNormMonitor",
    "HangWatchdog",
    "LossScaleMonitor",
    "NaNRecovery",
    "PeriodicCheckpoint",
    "PreemptionCheckpoint",
    "RNGStateKeeper",
    "RunSummary",
    "StepAxisKeeper",
    "StragglerMonitor",
    "ThroughputMonitor",
    "TimeToQuality",
    "TokenProgressBar",
    "TrainingAborted",
]
