"""Data-parallel training: ``DataParallelStrategy`` (DDP or FSDP2), registered with Lightning as
``lt_ddp``, ``lt_fsdp`` and ``lt_auto`` (``Trainer(strategy="lt_fsdp")``, ``strategy: lt_fsdp`` in YAML).
``ParallelStrategy`` (``lt_parallel``) adds tensor and pipeline parallelism on the same machinery, and
``plan_layout`` the ``auto`` choice between them. Their sharded checkpoints live in
``lightning_train.checkpoint``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_train.strategies.data_parallel import DataParallelStrategy
from lightning_train.strategies.memory import MemoryEstimate, estimate_memory
from lightning_train.strategies.parallel import ParallelStrategy
from lightning_train.strategies.planner import LayoutPlan, plan_layout

DataParallelStrategy.register_strategies(StrategyRegistry)
ParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DataParallelStrategy",
    "LayoutPlan",
    "MemoryEstimate",
    "ParallelStrategy",
    "estimate_memory",
    "plan_layout",
]
